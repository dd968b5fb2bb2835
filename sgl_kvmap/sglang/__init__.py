"""The SGLang extension: cached prefixes survive model swaps in multi-model deployments.

``storage.KVMapStorage`` is a HiCache ``dynamic`` storage backend (the only module here that
imports sglang); ``records`` is what it writes beside each page, ``pages`` converts HiCache
pages, ``heads`` says which KV heads a TP rank holds, ``translation`` translates one run of
pages; ``settings`` and ``launch`` build its configuration and the launch flags. Importing this
package does not import sglang (docs/sglang.md).
"""

from .settings import PeerSettings, StorageSettings

__all__ = ["PeerSettings", "StorageSettings"]
