"""Model identities (sgl_kvmap/sglang/identity.py): the configuration and the weights."""

from __future__ import annotations

import pytest

from sgl_kvmap.core.errors import KVMapError
from sgl_kvmap.sglang.identity import (
    local_weights_digest,
    model_identity,
    split_identity,
    weights_digest,
)

from .conftest import save_loaded, tiny_model


def test_other_weights_of_one_configuration_have_another_identity(tmp_path):
    one = save_loaded(tiny_model("qwen2", seed=1), tmp_path / "one")
    two = save_loaded(tiny_model("qwen2", seed=2), tmp_path / "two")
    spec = tiny_model("qwen2", seed=1).spec
    first, second = (model_identity(spec, weights_digest(p)) for p in (one, two))
    assert split_identity(first)[0] == split_identity(second)[0]
    assert split_identity(first)[1] != split_identity(second)[1]


def test_the_weights_digest_reads_samples_not_everything(tmp_path):
    """Bytes between the sampled blocks of a large file do not change the digest; a sampled
    block does (a weight update changes essentially every block)."""
    big = tmp_path / "model.safetensors"
    big.write_bytes(bytes(64 * 4096 * 4))
    before = weights_digest(tmp_path)
    data = bytearray(big.read_bytes())
    data[4096 * 2] = 1  # between samples (they start every 4 blocks)
    big.write_bytes(bytes(data))
    assert weights_digest(tmp_path) == before
    data[0] = 1
    big.write_bytes(bytes(data))
    assert weights_digest(tmp_path) != before


def test_a_folder_without_weights_has_no_digest(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert weights_digest(tmp_path) is None
    assert local_weights_digest(str(tmp_path / "missing")) is None


def test_an_identity_has_two_parts():
    with pytest.raises(KVMapError, match="not a model identity"):
        split_identity("abc")
