"""Which model wrote a stored page, as one string its page record carries (pure; no sglang).

A served model name says nothing about the model behind it: a peer redeployed under the same
name with another model, or other weights, stores pages a pack was never fitted for. Each
engine therefore stamps its page records with ``model_identity``: the KV-relevant configuration
and tokenizer (``ModelSpec.fingerprint``) and a digest of its weights, ``"<config>:<weights>"``.
A reader translates a peer's page only if the record's first part is the fingerprint its pack
was fitted for and its second part the digest of the peer's weights: read from the peer's model
folder when this host has its weight files, else pinned to the first record it reads (so a later
change of weights under the same name is still caught).

The weights digest covers every weight file's name and size and ``SAMPLES`` blocks of
``BLOCK`` bytes at evenly spaced offsets. Hashing every byte of a large model would take
minutes at start-up; a fine-tune or another checkpoint of the same shape differs in the sampled
blocks (an update of the weights changes essentially every block), which is what this must
tell apart.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..core.errors import KVMapError
from ..core.sources import model_folder
from ..core.spec import ModelSpec

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
SAMPLES = 64
BLOCK = 4096
DIGITS = 32  # hex digits kept of each part


def model_identity(spec: ModelSpec, weights: str) -> str:
    """The identity of a model of spec ``spec`` whose weights digest is ``weights``."""
    return f"{identity_config(spec)}:{weights[:DIGITS]}"


def split_identity(identity: str) -> tuple[str, str]:
    """(config part, weights part) of an identity; KVMapError if it is not one."""
    config, sep, weights = identity.partition(":")
    if not sep or len(config) != DIGITS or len(weights) != DIGITS:
        raise KVMapError(f"not a model identity: {identity!r}")
    return config, weights


def local_weights_digest(model_path: str) -> str | None:
    """The weights digest of ``model_path`` (a folder or Hub id) if its weight files are on this
    host, else None (nothing is downloaded)."""
    try:
        folder = model_folder(model_path, weights=False)
    except KVMapError:
        return None
    return weights_digest(folder)


def weights_digest(folder: str | Path) -> str | None:
    """sha256 over the weight files of ``folder`` (names, sizes, sampled blocks); None if it
    holds none."""
    files = [
        path
        for path in sorted(Path(folder).iterdir())
        if path.is_file() and path.name.endswith(WEIGHT_SUFFIXES)
    ]
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
        digest.update(_sampled_blocks(path))
    return digest.hexdigest()


def _sampled_blocks(path: Path) -> bytes:
    size = path.stat().st_size
    step = max(BLOCK, size // SAMPLES)
    with open(path, "rb") as file:
        blocks = []
        for offset in range(0, size, step):
            file.seek(offset)
            blocks.append(file.read(BLOCK))
    return b"".join(blocks)


def identity_config(spec: ModelSpec) -> str:
    """The configuration part of the identity of any model of spec ``spec``."""
    return spec.fingerprint[:DIGITS]
