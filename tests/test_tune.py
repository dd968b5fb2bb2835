"""Downstream tuning: its loss is the evaluated hand-off's loss, descending it helps, and it
grows and trains a non-linear residual."""

import dataclasses

import pytest
import torch

from sgl_kvmap.core.errors import KVMapError
from sgl_kvmap.core.mapper import KVMapper
from sgl_kvmap.fitting.config import FAMILY_RATES, TuneConfig
from sgl_kvmap.fitting.evaluate import EvalRuns, continuation_scores
from sgl_kvmap.fitting.tune import (
    _copy,
    _frozen,
    _trainable,
    _warmup,
    continuation_loss,
    own_log_probs,
    tune_mapper,
)
from sgl_kvmap.models.capture import capture_kv, run
from sgl_kvmap.models.transfer import handoff_split, translate_prefix

from .conftest import TINY_TUNING, fit_tiny_mapper, random_cache


@pytest.fixture(scope="module", params=[None, 16], ids=["k-layer", "rank-16"])
def mapper(request, tiny_pair):
    """Fitted mappers of both families, with two sink tokens."""
    fitted = fit_tiny_mapper(*tiny_pair, rank=request.param)
    return dataclasses.replace(fitted, sink_tokens=2)


@pytest.mark.parametrize("tail", [0, 8])
def test_training_loss_is_the_evaluated_handoff_loss(tiny_pair, mapper, tail):
    """continuation_loss emulates the hand-off with autograd on; it must score exactly what the
    evaluation scores for a hand-off with that tail (sinks recomputed over the mapped cache,
    the tail read by the target over it)."""
    source, target = tiny_pair
    window = torch.randint(0, 100, (64,), generator=torch.Generator().manual_seed(3))
    prompt_len = 48
    split = handoff_split(prompt_len, tail)
    cache = capture_kv(source.model, window[:split])
    with torch.no_grad():
        nll, accuracy = continuation_loss(mapper, target, cache, window, prompt_len, tail=tail)
    translated = translate_prefix(mapper, cache, window[:split], target.model)
    correct, nlls = continuation_scores(target.model, translated, window, prompt_len)
    torch.testing.assert_close(nll, nlls.mean(), rtol=1e-4, atol=1e-5)
    assert accuracy.item() == pytest.approx(correct.float().mean().item())


def test_kl_objective_is_the_divergence_from_the_targets_own_prediction(tiny_pair, mapper):
    """The teacher is the target's own next-token distribution (its own cache of the prompt, as
    the evaluation's reference scores it); the loss is KL(teacher || translated) per token."""
    source, target = tiny_pair
    window = torch.randint(0, 100, (64,), generator=torch.Generator().manual_seed(5))
    prompt_len, split = 48, handoff_split(48, 0)
    teacher = own_log_probs(target, window, prompt_len)
    labels = window[prompt_len:]
    _, own_nll = EvalRuns([window], prompt_len, 16).get(target, 0).own
    torch.testing.assert_close(
        -teacher.gather(1, labels[:, None])[:, 0], own_nll, atol=1e-5, rtol=1e-4
    )
    cache = capture_kv(source.model, window[:split])
    with torch.no_grad():
        kl, _ = continuation_loss(mapper, target, cache, window, prompt_len, teacher)
    translated = translate_prefix(mapper, cache, window[:split], target.model)
    logits = run(target.model, window[split:], past=translated, logits_to_keep=17).logits[:-1]
    student = logits.log_softmax(-1)
    expected = (teacher.exp() * (teacher - student)).sum(-1).mean()
    torch.testing.assert_close(kl, expected, atol=1e-5, rtol=1e-4)
    assert kl.item() > 0  # a fitted map is not exact
    # the target's own cache is the minimum: zero divergence from itself
    own = capture_kv(target.model, window[:split])
    with torch.no_grad():
        logits = run(target.model, window[split:], past=own, logits_to_keep=17).logits[:-1]
    self_kl = (teacher.exp() * (teacher - logits.log_softmax(-1))).sum(-1).mean()
    assert self_kl.abs().item() < 1e-4


def test_gradients_reach_the_map_and_not_the_target(tiny_pair, mapper):
    source, target = tiny_pair
    window = torch.randint(0, 100, (64,), generator=torch.Generator().manual_seed(4))
    cache = capture_kv(source.model, window[:47])
    trainable = _copy(mapper, trainable=True)
    with _frozen(target.model):
        loss, _ = continuation_loss(trainable, target, cache, window, 48)
        loss.backward()
    # layer 0 is the target's own (exact), so its map gets no gradient; every other layer does
    for kind in ("k", "v"):
        first, *rest = [m.weight for m in trainable.maps[kind]]
        assert first.grad is None or first.grad.abs().sum() == 0
        assert all(w.grad is not None and w.grad.abs().sum() > 0 for w in rest)
    if trainable.projections is not None:
        assert all(p.grad.abs().sum() > 0 for p in trainable.projections.values())
    assert all(p.grad is None for p in target.model.parameters())
    assert all(p.requires_grad for p in target.model.parameters())  # restored after


@pytest.mark.parametrize("objective", ["nll", "kl"])
def test_tuning_lowers_the_heldout_loss_and_keeps_the_map_servable(
    tiny_pair, mapper, text_dir, tmp_path, objective
):
    source, target = tiny_pair
    before = {kind: [m.weight.clone() for m in mapper.maps[kind]] for kind in ("k", "v")}
    lr = 3e-2 if objective == "nll" else 3e-3  # KL's first steps overshoot at 3e-2 here
    config = TuneConfig(steps=15, lr=lr, objective=objective, warmup=0, **TINY_TUNING)
    tuned, report = tune_mapper(mapper, source, target, [text_dir / "calib"], config)
    assert [p["step"] for p in report.curve] == [0, 5, 10, 15]
    # the objective falls on held-out windows, and the kept weights are its minimum (the tiny
    # target is near uniform, so its own distribution need not lower the NLL on true tokens)
    guard = f"heldout_{objective}"
    assert report.best_step > 0
    fitted = report.curve[0][guard]
    assert report.best[guard] < (fitted - 0.01 if objective == "nll" else 0.95 * fitted)
    assert min(p[guard] for p in report.curve) == report.best[guard]
    for kind in ("k", "v"):  # the fitted mapper is left as it was; the tuned one moved
        assert all(torch.equal(w, m.weight) for w, m in zip(before[kind], mapper.maps[kind]))
        assert any(not torch.equal(w, m.weight) for w, m in zip(before[kind], tuned.maps[kind]))
        assert not any(m.weight.requires_grad for m in tuned.maps[kind])
    assert tuned.info["metrics"]["tune_best_step"] == report.best_step
    loaded = KVMapper.from_pretrained(tuned.save_pretrained(tmp_path / "pack"))
    assert loaded.info["calibration"]["tuning"]["steps"] == 15
    assert loaded.info["calibration"]["tuning"]["objective"] == objective
    assert loaded.info["metrics"]["tune_heldout_nll"] == report.best["heldout_nll"]
    window = torch.randint(0, 100, (40,))
    cache = capture_kv(source.model, window)
    expected, got = tuned.map(cache), loaded.map(cache)
    for a, b in zip(expected.keys + expected.values, got.keys + got.values):
        torch.testing.assert_close(a, b)


def test_tuning_refuses_bad_settings_and_too_little_text(tiny_pair, mapper, text_dir):
    with pytest.raises(KVMapError, match="lr"):
        TuneConfig(lr=0)
    with pytest.raises(KVMapError, match="steps"):
        TuneConfig(steps=0)
    with pytest.raises(KVMapError, match="objective"):
        TuneConfig(objective="mse")
    with pytest.raises(KVMapError, match="warmup"):
        TuneConfig(warmup=-1)
    with pytest.raises(KVMapError, match="tail"):
        TuneConfig(prompt_len=64, tail=63)
    config = TuneConfig(steps=1, **{**TINY_TUNING, "heldout_windows": 10_000})
    with pytest.raises(KVMapError, match="held-out calibration files give"):
        tune_mapper(mapper, *tiny_pair, [text_dir / "calib"], config)


def test_warmup_raises_the_rate_linearly_then_holds_it():
    assert [_warmup(3)(step) for step in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert [_warmup(0)(step) for step in range(3)] == [1.0, 1.0, 1.0]


def test_the_default_rate_is_the_map_familys_and_is_recorded(tiny_pair, mapper, text_dir):
    want = FAMILY_RATES["k-layer" if mapper.projections is None else "reduced-rank"]
    assert TuneConfig().for_mapper(mapper).lr == want
    assert TuneConfig(lr=1e-3).for_mapper(mapper).lr == 1e-3
    config = TuneConfig(steps=1, **TINY_TUNING)
    tuned, report = tune_mapper(mapper, *tiny_pair, [text_dir / "calib"], config)
    assert report.config.lr == want and report.summary()["tune_lr"] == want
    assert tuned.info["calibration"]["tuning"]["lr"] == want


def test_a_tail_is_tuned_for_and_recorded(tiny_pair, mapper, text_dir):
    """With a tail the held-out scores are those of the hand-off with that tail, and the pack
    records it."""
    config = TuneConfig(steps=1, warmup=0, tail=8, **TINY_TUNING)
    tuned, report = tune_mapper(mapper, *tiny_pair, [text_dir / "calib"], config)
    assert tuned.info["calibration"]["tuning"]["tail"] == 8
    assert tuned.info["metrics"]["tune_tail"] == 8
    no_tail = tune_mapper(
        mapper, *tiny_pair, [text_dir / "calib"], dataclasses.replace(config, tail=0)
    )[1]
    assert report.curve[0]["heldout_nll"] != no_tail.curve[0]["heldout_nll"]


def test_tuning_grows_trains_and_keeps_a_residual(tiny_pair, reduced_mapper, text_dir, tmp_path):
    source, target = tiny_pair
    config = TuneConfig(steps=15, lr=3e-2, warmup=0, residual_hidden=8, **TINY_TUNING)
    plain = tune_mapper(
        reduced_mapper,
        source,
        target,
        [text_dir / "calib"],
        TuneConfig(steps=1, lr=3e-2, warmup=0, **TINY_TUNING),
    )[1]
    tuned, report = tune_mapper(reduced_mapper, source, target, [text_dir / "calib"], config)
    # step 0 scores the fitted map: the residual starts at zero output
    assert report.curve[0]["heldout_nll"] == pytest.approx(plain.curve[0]["heldout_nll"], abs=1e-6)
    assert (
        report.best_step > 0 and report.best["heldout_nll"] < report.curve[0]["heldout_nll"] - 0.01
    )
    assert tuned.residual_hidden == 8 and reduced_mapper.residuals is None
    assert any(w.abs().sum() > 0 for w in tuned.residuals["v"].weights_out)
    assert tuned.info["metrics"]["tune_residual_hidden"] == 8
    loaded = KVMapper.from_pretrained(tuned.save_pretrained(tmp_path / "tuned"))
    cache = random_cache(tiny_pair[0])
    want, got = tuned.map(cache), loaded.map(cache)
    for a, b in zip(want.keys + want.values, got.keys + got.values):
        torch.testing.assert_close(a, b)


def test_gradients_reach_every_residual_tensor_after_one_step(tiny_pair, reduced_mapper):
    """At the zero start only the output matrices get a gradient (the hidden layer is behind
    B = 0); once B moves, the hidden layer's weights do too."""
    source, target = tiny_pair
    window = torch.randint(0, 100, (64,), generator=torch.Generator().manual_seed(4))
    cache = capture_kv(source.model, window[:47])
    trainable, groups = _trainable(
        reduced_mapper, TuneConfig(lr=1e-2, residual_hidden=8, **TINY_TUNING), cache
    )
    optimizer = torch.optim.Adam(groups)
    residual = trainable.residuals["k"]
    with _frozen(target.model):
        for step in range(2):
            optimizer.zero_grad()
            continuation_loss(trainable, target, cache, window, 48)[0].backward()
            outputs_moved = all(w.grad.abs().sum() > 0 for w in residual.weights_out[1:])
            hidden_moved = residual.weight_in.grad.abs().sum() > 0
            assert outputs_moved and bool(hidden_moved) == (step == 1)
            optimizer.step()


def test_a_residual_needs_a_reduced_rank_map_to_tune(tiny_pair, text_dir):
    config = TuneConfig(steps=1, residual_hidden=8, **TINY_TUNING)
    with pytest.raises(KVMapError, match="reduced-rank"):
        tune_mapper(fit_tiny_mapper(*tiny_pair), *tiny_pair, [text_dir / "calib"], config)
    with pytest.raises(KVMapError, match="residual_hidden"):
        TuneConfig(residual_hidden=-1)
