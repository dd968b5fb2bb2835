"""Downstream tuning: gradient steps on a fitted mapper against the target's own next-token loss.

The closed-form fit minimises the error of every translated K/V entry alike; the target only
cares about the entries its later tokens read, and about how errors there move its predictions.
``tune_mapper`` starts from the fitted weights and minimises what matters directly: on windows
of calibration text, the source's cache of a prompt is translated exactly as a hand-off does it
(the target's own layer 0 and sink tokens, the rest mapped), the frozen target reads the
continuation over it, and its cross-entropy on the true next tokens is back-propagated into the
map's weights (and a reduced-rank map's projections). With ``objective="kl"`` the loss is the
KL divergence from the target's own next-token distribution (its own cache of the prompt, one
extra no-grad forward per step) instead: a whole distribution per token rather than one label,
and the quantity retention measures, the target behaving as it would have. Held-out windows
from the calibration's held-out files score the map every ``eval_every`` steps, and the
best-scoring weights are kept (the fitted ones included), so tuning never returns a map that
is worse on held-out text.

Data parallel: called on every rank of a torch.distributed group (``distributed.fit_resumable``),
each rank takes every world-th training window, the gradients are averaged over ranks before
each step (so every rank holds the same weights: one step reads ``world`` windows), and the
held-out windows are scored in shares whose sums are all-reduced.

The map stays linear and its shapes do not change: a tuned mapper is saved, loaded, translated
by the kernels and served by the SGLang extension exactly like a fitted one. With
``residual_hidden`` a reduced-rank map also grows a small non-linear residual
(``residual.Residual``), started at zero and trained with the rest; the pack records it, and
every backend applies it (it is part of ``KVMapper.content_products``).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..core.cache import KVCache
from ..core.errors import KVMapError
from ..core.fit import KINDS
from ..core.mapper import KVMapper, content_features
from ..core.residual import initial_residual, output_rates
from ..core.spec import check_models
from ..models.capture import LoadedModel, capture_kv, logits_over, run
from ..models.transfer import handoff_split, mapped_prefix
from .calibrate import calibration_files
from .config import TuneConfig
from .texts import calibration_windows, code_corpus_files


@dataclass
class TuneReport:
    """What tuning measured. curve: one entry per held-out scoring, {step, train_loss (the mean
    training loss over the steps since the previous entry, the KL divergence for objective
    "kl"; None at step 0), heldout_nll, heldout_accuracy, and heldout_kl for "kl"};
    best_step: the step whose weights were kept, the lowest held-out objective (0: the fitted
    map was best)."""

    config: TuneConfig
    curve: list[dict] = field(default_factory=list)
    best_step: int = 0
    seconds: float = 0.0

    @property
    def best(self) -> dict:
        return next(point for point in self.curve if point["step"] == self.best_step)

    def summary(self) -> dict:
        """Flat figures for a pack's metrics."""
        first = self.curve[0]
        return {
            "tune_steps": self.config.steps,
            "tune_lr": self.config.lr,
            "tune_objective": self.config.objective,
            "tune_tail": self.config.tail,
            "tune_residual_hidden": self.config.residual_hidden,
            "tune_best_step": self.best_step,
            "tune_train_tokens": self.config.steps * self.config.continuation,
            "tune_heldout_nll_fitted": first["heldout_nll"],
            "tune_heldout_nll": self.best["heldout_nll"],
            "tune_heldout_accuracy_fitted": first["heldout_accuracy"],
            "tune_heldout_accuracy": self.best["heldout_accuracy"],
            "tune_seconds": round(self.seconds, 1),
            **(
                {
                    "tune_heldout_kl_fitted": first["heldout_kl"],
                    "tune_heldout_kl": self.best["heldout_kl"],
                }
                if "heldout_kl" in first
                else {}
            ),
        }


def tune_mapper(
    mapper: KVMapper,
    source: LoadedModel,
    target: LoadedModel,
    calibration=None,
    config: TuneConfig = TuneConfig(),
) -> tuple[KVMapper, TuneReport]:
    """A copy of ``mapper`` tuned on the target's next-token loss over translated caches, and
    the report. ``calibration``: text files/folders (default: ``texts.code_corpus_files``, the
    standard library's sources and those of sgl-kvmap's dependencies, which tuned the real
    pair's map better than the stdlib alone: see docs/LOG.md). ``mapper`` itself is left as it
    was."""
    check_models(mapper, source.spec, target.spec)
    config = config.for_mapper(mapper)
    started = time.perf_counter()
    rank, world = _rank_and_world()
    training, heldout = tuning_windows(source.tokenizer, calibration, config)
    training = itertools.islice(training, rank, None, world)  # this rank's share
    scored = [
        (w, _source_cache(source, w, config), _teacher(target, w, config))
        for w in heldout[rank::world]
    ]
    guard = f"heldout_{config.objective}"  # the best weights: the lowest held-out objective
    first_cache = scored[0][1] if rank == 0 else _source_cache(source, heldout[0], config)
    trainable, groups = _trainable(mapper, config, first_cache)
    optimizer = torch.optim.Adam(groups)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup(config.warmup))
    report, best, losses = TuneReport(config), _copy(mapper), []
    with _frozen(target.model):
        report.curve.append(
            {"step": 0, "train_loss": None, **_score(trainable, target, scored, config)}
        )
        for step in tqdm(range(1, config.steps + 1), desc="tuning", unit="step"):
            window = next(training, None)
            if window is None:
                raise KVMapError(f"calibration text ran out of windows at step {step}")
            cache = _source_cache(source, window, config)
            teacher = _teacher(target, window, config)
            loss, _ = continuation_loss(
                trainable, target, cache, window, config.prompt_len, teacher, config.tail
            )
            optimizer.zero_grad()
            loss.backward()
            _average_gradients(_parameters(trainable), world)
            optimizer.step()
            schedule.step()
            losses.append(_mean_over_ranks([loss.item()], world)[0])
            if step % config.eval_every == 0 or step == config.steps:
                point = {"step": step, "train_loss": sum(losses) / len(losses)}
                report.curve.append({**point, **_score(trainable, target, scored, config)})
                losses = []
                if report.curve[-1][guard] < report.best[guard]:
                    report.best_step, best = step, _copy(trainable)
    report.seconds = time.perf_counter() - started
    best.info.setdefault("calibration", {})["tuning"] = asdict(config)  # the pack records both
    best.info.setdefault("metrics", {}).update(report.summary())
    return best, report


def tuning_windows(tokenizer, calibration, config: TuneConfig):
    """(an iterator of training windows, a list of held-out windows), each ``[prompt_len +
    continuation]`` token ids, from the calibration's training and held-out files (default:
    ``texts.code_corpus_files``, the stdlib and sgl-kvmap's dependencies' sources)."""
    length = config.prompt_len + config.continuation
    text = calibration or code_corpus_files()
    train_files, heldout_files = calibration_files(text, config.heldout_every)

    def windows(files):
        return calibration_windows(tokenizer, files, length, config.per_file_tokens)

    heldout = [w for _, w in zip(range(config.heldout_windows), windows(heldout_files))]
    if len(heldout) < config.heldout_windows:
        raise KVMapError(
            f"held-out calibration files give {len(heldout)} windows of {length} tokens, "
            f"{config.heldout_windows} asked for: pass more text or shorter windows"
        )
    return windows(train_files), heldout


def continuation_loss(
    mapper: KVMapper,
    target: LoadedModel,
    source_cache: KVCache,
    window: torch.Tensor,
    prompt_len: int,
    teacher: torch.Tensor | None = None,
    tail: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, top-1 accuracy) of ``target`` on ``window[prompt_len:]`` after a hand-off of
    ``window[:prompt_len]`` with ``tail`` recomputed tokens: the source's cache
    (``source_cache``, at least the first ``handoff_split(prompt_len, tail)`` tokens) of the
    translated tokens translated, the target's own layer 0 and sink tokens, then the tail, the
    last prompt token and the continuation read by the target. The loss is the mean
    cross-entropy on the true tokens, or with ``teacher`` ([C, vocab] log-probabilities,
    ``own_log_probs``) the mean KL divergence KL(teacher || target on the translated cache) per
    token. Differentiable in the mapper's weights. window: [prompt_len + C] token ids."""
    nll, accuracy, divergence = _handoff_scores(
        mapper, target, source_cache, window, prompt_len, teacher, tail
    )
    return (nll if teacher is None else divergence), accuracy


def _handoff_scores(mapper, target, source_cache, window, prompt_len, teacher, tail):
    """(NLL, top-1 accuracy, KL divergence from ``teacher`` or None) of one hand-off's
    continuation, from one target forward (``handoff_logits``)."""
    logits = handoff_logits(mapper, target, source_cache, window, prompt_len, tail)
    nll, accuracy = _nll_and_accuracy(logits, window[prompt_len:])
    return nll, accuracy, (None if teacher is None else _divergence(logits, teacher))


def handoff_logits(
    mapper: KVMapper,
    target: LoadedModel,
    source_cache: KVCache,
    window: torch.Tensor,
    prompt_len: int,
    tail: int = 0,
) -> torch.Tensor:
    """[C, vocab] logits of ``target`` predicting ``window[prompt_len:]`` after the hand-off
    that ``continuation_loss`` describes (differentiable in the mapper's weights)."""
    split = handoff_split(prompt_len, tail)
    translated = mapped_prefix(mapper, source_cache.slice(0, split), window[:split], target.model)
    sinks = min(mapper.sink_tokens, split)
    if sinks:
        translated = translated.replace_front(capture_kv(target.model, window[:sinks]))
    # the logits of positions prompt_len - 1 .. end - 1 predict window[prompt_len:]
    return logits_over(target.model, translated, window[split:])[prompt_len - 1 - split : -1]


def _nll_and_accuracy(logits: torch.Tensor, labels: torch.Tensor):
    """(mean cross-entropy, top-1 accuracy) of logits [C, vocab] on labels [C]."""
    return F.cross_entropy(logits, labels), (logits.argmax(-1) == labels).float().mean()


def _divergence(logits: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher || softmax(logits)); teacher: [C, vocab] log-probs."""
    student = F.log_softmax(logits, dim=-1)
    return F.kl_div(student, teacher, reduction="batchmean", log_target=True)


def own_log_probs(target: LoadedModel, window: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """[C, vocab] log-probabilities of ``target``'s next-token predictions for
    ``window[prompt_len:]`` over its own cache of the prompt: the teacher of ``objective="kl"``.
    window: [prompt_len + C] token ids."""
    keep = window.numel() - prompt_len + 1
    with torch.no_grad():
        logits = run(target.model, window, logits_to_keep=keep).logits
    return F.log_softmax(logits[:-1], dim=-1)


def _teacher(target: LoadedModel, window: torch.Tensor, config: TuneConfig):
    """The window's teacher for the configured objective: ``own_log_probs`` for "kl", else None."""
    return own_log_probs(target, window, config.prompt_len) if config.objective == "kl" else None


def _source_cache(source: LoadedModel, window: torch.Tensor, config: TuneConfig) -> KVCache:
    """The source's cache of the translated part of the window's prompt, as ordinary tensors
    (``capture_kv`` returns inference tensors, which autograd may not save)."""
    cache = capture_kv(source.model, window[: handoff_split(config.prompt_len, config.tail)])
    return KVCache(
        [k.clone() for k in cache.keys], [v.clone() for v in cache.values], cache.positions.clone()
    )


def _score(mapper: KVMapper, target: LoadedModel, scored: list, config: TuneConfig) -> dict:
    """Mean held-out NLL and accuracy over (window, source cache, teacher) triples, and the mean
    KL divergence from the teachers where they are given (objective "kl"); one target forward
    per window."""
    nll, accuracy, divergence = [], [], []
    with torch.no_grad():
        for window, cache, teacher in scored:
            window_nll, window_accuracy, window_divergence = _handoff_scores(
                mapper, target, cache, window, config.prompt_len, teacher, config.tail
            )
            nll.append(window_nll.item())
            accuracy.append(window_accuracy.item())
            if window_divergence is not None:
                divergence.append(window_divergence.item())
    sums = [sum(nll), sum(accuracy), sum(divergence), len(nll)]
    total_nll, total_accuracy, total_divergence, count = _summed_over_ranks(sums)
    score = {"heldout_nll": total_nll / count, "heldout_accuracy": total_accuracy / count}
    if config.objective == "kl":
        score["heldout_kl"] = total_divergence / count
    return score


def _rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size of torch.distributed's group ((0, 1) alone)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _average_gradients(tensors: list[torch.Tensor], world: int) -> None:
    """Replace every gradient by its mean over the ranks (nothing to do alone). A tensor the
    loss does not reach has no gradient on any rank (the same graph everywhere): skipped."""
    for tensor in tensors if world > 1 else ():
        if tensor.grad is None:
            continue
        dist.all_reduce(tensor.grad)
        tensor.grad /= world


def _summed_over_ranks(values: list[float]) -> list[float]:
    """``values`` summed over the ranks, in float64 (as they are alone)."""
    if _rank_and_world()[1] == 1:
        return values
    total = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(total)
    return total.tolist()


def _mean_over_ranks(values: list[float], world: int) -> list[float]:
    return [v / world for v in _summed_over_ranks(values)]


def _copy(mapper: KVMapper, trainable: bool = False) -> KVMapper:
    """A float32 copy of ``mapper`` with fresh weight tensors (requiring grad if ``trainable``)."""
    return mapper.apply(lambda tensor: tensor.detach().float().clone().requires_grad_(trainable))


def _parameters(mapper: KVMapper) -> list[torch.Tensor]:
    tensors = [t for kind in KINDS for m in mapper.maps[kind] for t in (m.weight, m.bias)]
    return tensors + list((mapper.projections or {}).values()) + _residual_tensors(mapper)


def _residual_tensors(mapper: KVMapper) -> list[torch.Tensor]:
    return [t for r in (mapper.residuals or {}).values() for t in r.tensors()]


def _trainable(mapper: KVMapper, config: TuneConfig, cache: KVCache):
    """(a trainable copy of ``mapper``, with a new residual if ``config`` asks for one, and its
    Adam parameter groups). ``cache``: a source cache whose features scale the new residual."""
    if not config.residual_hidden or mapper.residuals is not None:
        trainable = _copy(mapper, trainable=True)
        return trainable, _relative_groups(_parameters(trainable), config.lr)
    if mapper.projections is None:
        raise KVMapError("a non-linear residual needs a reduced-rank map (fit with --rank)")
    features = content_features(cache, mapper.source)
    with torch.no_grad():
        z = {kind: features[kind] @ mapper.projections[kind].float() for kind in KINDS}
    residuals = {
        kind: initial_residual(
            z[kind], config.residual_hidden, mapper.target.num_layers, mapper.target.kv_width
        )
        for kind in KINDS
    }
    trainable = _copy(replace(mapper, residuals=residuals), trainable=True)
    groups = _relative_groups(_parameters(trainable), config.lr)
    by_tensor = {id(g["params"][0]): g for g in groups}
    for kind, residual in trainable.residuals.items():
        # the hidden bias starts at zero against unit-RMS pre-activations: an absolute rate
        by_tensor[id(residual.bias_in)]["lr"] = config.lr
        linear = [by_tensor[id(m.weight)]["lr"] for m in trainable.maps[kind]]
        for weight, rate in zip(residual.weights_out, output_rates(residual, z[kind], linear)):
            by_tensor[id(weight)]["lr"] = rate
    return trainable, groups


def _relative_groups(tensors: list[torch.Tensor], lr: float) -> list[dict]:
    """One Adam parameter group per tensor, its learning rate ``lr`` x the tensor's RMS."""
    return [
        {"params": [t], "lr": lr * max(t.detach().pow(2).mean().sqrt().item(), 1e-12)}
        for t in tensors
    ]


def _warmup(steps: int):
    """Rate factor of step s (from 0): (s + 1) / (steps + 1) for the first ``steps`` steps, then
    1."""
    return lambda step: min(1.0, (step + 1) / (steps + 1))


@contextlib.contextmanager
def _frozen(model: torch.nn.Module):
    """The model's own weights left out of autograd for the duration (restored after)."""
    previous = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(model.parameters(), previous):
            p.requires_grad_(flag)
