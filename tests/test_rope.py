"""Content space: RoPE stripped and put back, exactly as each model family rotates."""

import pytest
import torch

from sgl_kvmap.core.rope import RotaryTables, rope, unrope
from sgl_kvmap.core.spec import tables_for_spec
from sgl_kvmap.models.capture import run

from .conftest import tiny_model

KINDS = ["qwen2", "qwen3", "llama3", "yarn", "glm"]


def random_tables(tokens: int, pairs: int, scale: float = 1.0) -> RotaryTables:
    angles = torch.rand(tokens, pairs) * 100
    return RotaryTables(angles.cos() * scale, angles.sin() * scale)


@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [32, 16])  # full and partial rotary of a 32-dim head
@pytest.mark.parametrize(
    "scale", [1.0, 1.3]
)  # 1.3: YaRN-style attention factor folded into cos/sin
def test_round_trip_exact_to_float32(style, rotary_dim, scale):
    x = torch.randn(50, 3, 32)
    tables = random_tables(50, rotary_dim // 2, scale)
    back = unrope(rope(x, tables, style), tables, style)
    torch.testing.assert_close(back, x, rtol=0, atol=5e-6)
    assert torch.equal(rope(x, tables, style)[..., rotary_dim:], x[..., rotary_dim:])


def test_styles_pair_different_dims():
    x = torch.randn(4, 1, 8)
    tables = random_tables(4, 4)
    assert not torch.allclose(rope(x, tables, "half"), rope(x, tables, "interleaved"))


@pytest.mark.parametrize("kind", KINDS)
def test_unrope_recovers_the_models_own_pre_rope_keys(kind):
    """Strip RoPE from the cache the model wrote; compare with the keys it computed before RoPE."""
    loaded = tiny_model(kind)
    attn = loaded.model.model.layers[1].self_attn
    seen = {}
    last = attn.k_norm if hasattr(attn, "k_norm") else attn.k_proj
    last.register_forward_hook(lambda module, args, out: seen.__setitem__("k", out))
    ids = torch.randint(0, 100, (70,))
    cache = run(loaded.model, ids).cache
    spec = loaded.spec
    pre_rope = seen["k"][0].reshape(70, spec.num_kv_heads, spec.head_dim)
    stripped = unrope(cache.keys[1], tables_for_spec(spec, cache.positions), spec.rope_style)
    torch.testing.assert_close(stripped, pre_rope, rtol=1e-4, atol=1e-5)
