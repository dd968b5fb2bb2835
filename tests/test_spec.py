"""Model specs: what a config says about the KV cache, and the pairs a pack refuses."""

import pytest

from sgl_kvmap.core.errors import PairMismatchError
from sgl_kvmap.core.spec import check_models

from .conftest import tiny_model


def test_spec_reads_partial_rotary_interleaving_and_qk_norm():
    assert (
        tiny_model("glm").spec.rotary_dim == 8
        and tiny_model("glm").spec.rope_style == "interleaved"
    )
    assert tiny_model("qwen3").spec.qk_norm and not tiny_model("qwen2").spec.qk_norm
    assert tiny_model("qwen2").spec.rotary_dim == 16


def test_a_mapper_refuses_models_other_than_its_own(tiny_mapper, tiny_pair):
    other = tiny_model("qwen2", seed=3, layers=5)
    check_models(tiny_mapper, *(m.spec for m in tiny_pair))
    with pytest.raises(PairMismatchError, match="num_layers: 4 vs 5"):
        check_models(tiny_mapper, tiny_pair[0].spec, other.spec)
