"""Attention each token receives, and the calibration weights made from it."""

import pytest
import torch

from sgl_kvmap.core.errors import KVMapError
from sgl_kvmap.core.token_weights import attention_paid, attention_received, token_weights
from sgl_kvmap.models.capture import run

from .conftest import tiny_model


def test_attention_received_matches_the_models_own_attention_probabilities():
    loaded = tiny_model("qwen3", seed=3)  # QK-norm: queries differ from the raw projections
    ids = torch.randint(0, 100, (40,))
    result = run(loaded.model, ids, want_queries=True)
    ours = attention_received(result.queries, result.cache.keys)
    loaded.model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = loaded.model(input_ids=ids[None], output_attentions=True)
    finally:
        loaded.model.set_attn_implementation("sdpa")
    probs = torch.stack(out.attentions)[:, 0]  # [layers, heads, i, j]
    received = probs.sum(2).mean((0, 1))
    uniform = torch.tensor([sum(1 / (i + 1) for i in range(j, 40)) for j in range(40)])
    torch.testing.assert_close(ours, received / uniform, rtol=1e-4, atol=1e-5)
    last = [q[-7:] for q in result.queries]  # the last 7 positions' queries only
    torch.testing.assert_close(
        attention_paid(last, result.cache.keys),
        probs[:, :, -7:].sum(2).mean((0, 1)),
        rtol=1e-4,
        atol=1e-5,
    )


def test_uniform_attention_gives_weight_one():
    queries = [torch.zeros(10, 4, 8)]
    keys = [torch.randn(10, 2, 8)]
    torch.testing.assert_close(attention_received(queries, keys), torch.ones(10))


def test_token_weights_mean_one_and_power_zero_is_unweighted():
    received = torch.tensor([4.0, 1.0, 0.25, 1.0])
    torch.testing.assert_close(token_weights(received, 0.0), torch.ones(4))
    weights = token_weights(received, 1.0)
    assert weights.mean().item() == pytest.approx(1.0)
    assert weights[0] / weights[2] == pytest.approx(16.0)
    root = received.sqrt()
    torch.testing.assert_close(token_weights(received, 0.5), root / root.mean())
    with pytest.raises(KVMapError):
        token_weights(received, -1.0)
