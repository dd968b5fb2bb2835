"""The SGLang extension: cached prefixes survive model swaps in multi-model deployments.

``storage.KVMapStorage`` is a HiCache ``dynamic`` storage backend; ``records`` is what it
writes beside each page, ``identity`` the writer's model in them, ``pages`` converts HiCache
pages, ``heads`` says which KV heads a TP rank holds, ``translation`` translates one run of
pages, ``jobs`` runs translations off SGLang's I/O thread, ``provenance`` keeps translated
pages from being stored as native; ``priming`` decides when an engine computes a swap's first
page before it, and ``plugin`` (SGLang's plugin, in a server's TokenizerManager) does it and
reports per request what was translated; ``settings`` and ``launch`` build its configuration
and the launch flags (``cpu_engine`` holds what SGLang's CPU engine needs on ``PYTHONPATH``);
``servers`` starts live servers from those flags and ``client`` talks to them over HTTP.
``engine`` drives SGLang's own scheduler calls in process (the tests' and the benchmark's
engines). ``storage``, ``engine``, ``priming`` and ``plugin`` are the only modules that import
sglang; importing this package does not (docs/sglang.md).
"""

from .settings import PeerSettings, StorageSettings

__all__ = ["PeerSettings", "StorageSettings"]
