"""The registry: models and mapper packs on the Hugging Face Hub (the only code that imports
huggingface_hub). Importing it installs the Hub beneath the layers below, so each takes a Hub
id where it takes a folder:

- ``hub``: a model argument (a local folder or a Hub repo id) as a local folder, from the
  Hugging Face cache or downloaded, failing in one line when it is neither there nor reachable
  (installed as ``sgl_kvmap.core.sources``' model source);
- ``packs``: packs fetched at one commit, published in one commit, listed (installed as
  ``sgl_kvmap.core.pack``'s registry: ``KVMapper.from_pretrained("org/name")``,
  ``push_to_hub``);
- ``resolve``: the pack for a model pair from the caches, the Hub, or built here;
- ``card``, ``naming``: the model card, conventional names and tags.

It also gives every Hub request huggingface_hub sends a time limit (``hub.use_time_limits``).
"""

from ..core.pack import use_registry
from ..core.sources import use_model_source
from .hub import model_folder, use_time_limits
from .packs import HubRegistry

use_model_source(model_folder)
use_registry(HubRegistry())
use_time_limits()

__all__ = ["HubRegistry", "model_folder"]
