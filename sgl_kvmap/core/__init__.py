"""The core: what a KV map is and how it is fitted and stored, as pure functions of tensors.

Model specs and RoPE (``spec``, ``rope``), the cache layout (``cache``), streaming statistics
and the closed-form fit (``stats``, ``fit``, ``token_weights``, ``residual``), the mapper
(``mapper``) and its pack folder format (``pack``). Nothing here runs a model: it needs torch
(and transformers' configs, never their weights). Imports nothing from the rest of sgl-kvmap
but its version.
"""
