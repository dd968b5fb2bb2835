"""The SGLang extension: cached prefixes survive model swaps in multi-model deployments.

``storage.KVMapStorage`` is a HiCache ``dynamic`` storage backend (the only module here that
imports sglang); ``settings`` and ``launch`` build its configuration and the launch flags;
``pages`` converts HiCache pages. Importing this package does not import sglang.
"""

from .settings import PeerSettings, StorageSettings

__all__ = ["PeerSettings", "StorageSettings"]
