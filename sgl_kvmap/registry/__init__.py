"""The Hugging Face Hub client (the only importer of huggingface_hub).

- ``hub``: a model argument (a local folder or a Hub repo id) as a local folder, from the
  Hugging Face cache or downloaded, failing in one line when it is neither there nor reachable.
"""

from .hub import model_folder

__all__ = ["model_folder"]
