"""The registry: mapper packs on the Hugging Face Hub (the only code that imports
huggingface_hub). Importing it installs the Hub client under ``sgl_kvmap.core.pack``, so
``KVMapper.from_pretrained("org/name")`` and ``push_to_hub`` work."""

from ..core.pack import use_registry
from .packs import HubRegistry

use_registry(HubRegistry())
