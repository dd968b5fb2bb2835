"""The Hugging Face Hub client (the only importer of huggingface_hub). Importing it installs
the Hub as the model source under ``sgl_kvmap.core.sources``, so every layer below takes a Hub
id where it takes a model folder.

- ``hub``: a model argument (a local folder or a Hub repo id) as a local folder, from the
  Hugging Face cache or downloaded, failing in one line when it is neither there nor reachable.
"""

from ..core.sources import use_model_source
from .hub import model_folder

use_model_source(model_folder)

__all__ = ["model_folder"]
