"""A model's exact layer 0 from its vocabulary table, and token ids read back from stored
layer-0 values (sgl_kvmap/models/first_layer.py), on the tiny pair saved as model folders."""

from __future__ import annotations

import dataclasses

import torch

from sgl_kvmap.kernels import fast_matmul_dtype
from sgl_kvmap.models.capture import capture_kv, first_layer_kv
from sgl_kvmap.models.first_layer import (
    ExactFirstLayer,
    first_layer_at,
    first_layer_table,
    recover_token_ids,
)

from .conftest import fit_tiny_mapper


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 100, (n,), generator=torch.Generator().manual_seed(seed))


def test_the_table_gives_the_models_own_layer_0_at_any_position(tiny_pair, model_folders):
    """K (post-RoPE) and V from the table equal the model's own forward over a prompt, at the
    prompt's positions and at positions shifted by 1,000."""
    table = first_layer_table(model_folders["target"])
    ids = prompt(40, seed=1)
    keys, values = first_layer_kv(tiny_pair[1].model, ids)
    got_keys, got_values = first_layer_at(table, ids, torch.arange(40))
    torch.testing.assert_close(got_keys, keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_values, values, rtol=1e-5, atol=1e-5)
    shifted, _ = first_layer_at(table, ids, torch.arange(1000, 1040))
    assert not torch.allclose(shifted, keys, atol=1e-3)


def test_stored_values_read_back_as_their_token_ids(tiny_pair, model_folders):
    """Layer-0 values as an engine stores them (bfloat16) give back every token id; a row
    two tokens share (the same embedding) gives back none."""
    table = first_layer_table(model_folders["source"])
    ids = prompt(64, seed=2)
    _, values = first_layer_kv(tiny_pair[0].model, ids)
    assert torch.equal(recover_token_ids(values.bfloat16(), table), ids)
    twin = table.values.clone()
    twin[ids[0]] = twin[ids[1]]
    blurred = dataclasses.replace(table, values=twin)
    got = recover_token_ids(values.bfloat16(), blurred)
    assert got[ids == ids[1]].eq(-1).all() and got[ids == ids[0]].eq(-1).all()
    assert torch.equal(
        got[(ids != ids[0]) & (ids != ids[1])], ids[(ids != ids[0]) & (ids != ids[1])]
    )


def test_a_translation_gets_the_targets_layer_0_and_keeps_the_rest(tiny_pair, model_folders):
    """``ExactFirstLayer.overwrite`` replaces the mapped layer 0 of a translated run (at
    positions 16..) with the target's own and leaves every other layer as mapped; the ids it
    read back are remembered, so the same run again searches nothing."""
    source, target = tiny_pair
    mapper = fit_tiny_mapper(source, target)
    ids = prompt(48, seed=3)
    cache = capture_kv(source.model, ids).slice(16, 48)
    mapped = mapper.map(cache, fast_matmul_dtype("cpu"))
    stored = torch.stack(
        [torch.stack(cache.keys, 1), torch.stack(cache.values, 1)]
    ).bfloat16()  # [2, tokens, layers, heads, dim]
    translated = torch.stack([torch.stack(mapped.keys, 1), torch.stack(mapped.values, 1)])
    exact = ExactFirstLayer(
        first_layer_table(model_folders["source"]), first_layer_table(model_folders["target"])
    )
    out = translated.clone()
    assert exact.overwrite(stored, torch.arange(16, 48), out) == 32
    keys, values = first_layer_kv(target.model, ids)
    torch.testing.assert_close(out[0, :, 0], keys[16:48], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1, :, 0], values[16:48], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[:, :, 1:], translated[:, :, 1:])
    # every stored row is remembered: pointing them all at one token shows a second call
    # reads the memory instead of searching the table
    exact.known.update(dict.fromkeys(exact.known, int(ids[0])))
    again = translated.clone()
    exact.overwrite(stored, torch.arange(16, 48), again)
    want, _ = first_layer_at(exact.target, ids[:1].expand(32), torch.arange(16, 48))
    torch.testing.assert_close(again[0, :, 0], want)
