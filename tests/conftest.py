"""Shared test fixtures: tiny randomly initialised transformers models (and a character
tokenizer), fitted mappers of them, synthetic fitting problems and comparison helpers; ``hub``,
a local Hugging Face Hub (tests/hub_servers.py)."""

from __future__ import annotations

import dataclasses
import string
from pathlib import Path

import pytest
import torch

from sgl_kvmap.core.cache import KVCache
from sgl_kvmap.core.mapper import content_features
from sgl_kvmap.core.residual import initial_residual
from sgl_kvmap.core.rope import rope, unrope
from sgl_kvmap.core.spec import spec_from_config, tables_for_spec
from sgl_kvmap.core.stats import Moments
from sgl_kvmap.fitting.calibrate import PairStatistics, fit_from_statistics
from sgl_kvmap.fitting.config import CalibrationConfig
from sgl_kvmap.models.capture import (
    LoadedModel,
    capture_kv,
)

from .hub_servers import hub  # noqa: F401 (the local test Hub, a session fixture)

CHARS = string.printable


def char_tokenizer(extra: str = ""):
    """A real fast tokenizer, one token per printable character (plus ``extra`` tokens)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(CHARS + extra)}
    vocab["<unk>"] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")


def tiny_config(kind: str, layers: int = 3, kv_heads: int = 2, head_dim: int = 16, **extra):
    """A small config of ``kind``: qwen2, qwen3 (QK-norm), llama3 (scaled RoPE), yarn,
    glm (partial rotary, interleaved)."""
    from transformers import GlmConfig, LlamaConfig, Qwen2Config, Qwen3Config

    heads = 2 * kv_heads
    common = dict(
        vocab_size=128,
        hidden_size=heads * head_dim,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(extra)
    if kind == "qwen2":
        return Qwen2Config(**common)
    if kind == "qwen3":
        return Qwen3Config(**common)
    if kind == "llama3":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        return LlamaConfig(**common, rope_parameters=rope)
    if kind == "yarn":
        rope = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return LlamaConfig(**common, rope_parameters=rope)
    if kind == "glm":
        return GlmConfig(**common, partial_rotary_factor=0.5)
    raise ValueError(kind)


def tiny_model(kind: str, seed: int = 0, **kwargs) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, **kwargs)).eval()
    tokenizer = char_tokenizer()
    return LoadedModel(
        model, tokenizer, spec_from_config(model.config, tokenizer, model_id=f"tiny-{kind}-{seed}")
    )


@pytest.fixture(scope="session")
def tiny_pair() -> tuple[LoadedModel, LoadedModel]:
    """Mismatched geometry: source 3 layers x 2 KV heads x 16, target 4 layers x 1 KV head x 32."""
    return tiny_model("qwen2", seed=1), tiny_model(
        "qwen2", seed=2, layers=4, kv_heads=1, head_dim=32
    )


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory):
    """Calibration and evaluation text: this repository's sources, as two disjoint folders."""

    root = tmp_path_factory.mktemp("texts")
    sources = sorted(Path(__file__).resolve().parents[1].joinpath("sgl_kvmap").rglob("*.py"))
    for i, path in enumerate(sources):
        folder = root / ("calib" if i % 3 else "eval")
        folder.mkdir(exist_ok=True)
        (folder / f"{i}_{path.name}").write_text(path.read_text())
    return root


@pytest.fixture(scope="session")
def model_folders(tiny_pair, tmp_path_factory) -> dict[str, str]:
    """The tiny pair saved as model folders ("source", "target"), and "other": a model of
    another geometry with the same tokenizer."""
    root = tmp_path_factory.mktemp("models")
    other = tiny_model("qwen2", seed=3, layers=2, kv_heads=1, head_dim=32)
    return {
        "source": save_loaded(tiny_pair[0], root / "source"),
        "target": save_loaded(tiny_pair[1], root / "target"),
        "other": save_loaded(other, root / "other"),
    }


@pytest.fixture(scope="session")
def served_pair(tiny_pair, tmp_path_factory) -> dict:
    """``tiny_pair`` as two engines serve it: "names" (model folders, their served names),
    "models" (loaded back from them) and "packs" {(s, t): a pack folder s -> t with 4 sink
    tokens} for s, t in 0 (3 layers x 2 KV heads x 16) and 1 (4 layers x 1 KV head x 32)."""
    from sgl_kvmap.models.capture import load_model

    root = tmp_path_factory.mktemp("served_pair")
    names = [save_loaded(m, root / n) for m, n in zip(tiny_pair, ("a", "b"))]
    models = [load_model(name) for name in names]
    packs = {}
    for s, t in ((0, 1), (1, 0)):
        mapper = dataclasses.replace(fit_tiny_mapper(models[s], models[t]), sink_tokens=4)
        packs[s, t] = str(mapper.save_pretrained(root / f"pack_{s}{t}"))
    return {"names": names, "models": models, "packs": packs}


def save_loaded(loaded: LoadedModel, folder) -> str:
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_mapper(tiny_pair):
    """A mapper of ``tiny_pair`` (source -> target) fitted on random token windows."""
    return fit_tiny_mapper(*tiny_pair)


def fit_tiny_mapper(
    source: LoadedModel, target: LoadedModel, top_k: int = 2, rank: int | None = None
):
    """A source -> target mapper fitted on six random windows of 64 tokens (no sink tokens;
    rank: a reduced-rank mapper instead)."""
    from sgl_kvmap.fitting.calibrate import PairStatistics
    from sgl_kvmap.models.capture import capture_kv

    stats = PairStatistics(source.spec, target.spec)
    generator = torch.Generator().manual_seed(0)
    for i in range(6):
        ids = torch.randint(0, 100, (64,), generator=generator)
        stats.update(
            *(
                content_features(capture_kv(m.model, ids), m.spec, slice(1, None))
                for m in (source, target)
            ),
            held_out=i == 5,
        )
    config = CalibrationConfig(top_k=top_k, sink_tokens=0, rank=rank)
    mapper, _ = fit_from_statistics(stats, config)
    return mapper


def with_random_residual(mapper, cache, hidden: int = 8):
    """``mapper`` (reduced-rank) plus a non-linear residual whose output matrices are random
    (not the zero start), scaled for the features of ``cache``."""

    from sgl_kvmap.core.residual import Residual

    generator = torch.Generator().manual_seed(7)
    features = content_features(cache, mapper.source)
    residuals = {}
    for kind in ("k", "v"):
        z = features[kind] @ mapper.projections[kind]
        start = initial_residual(z, hidden, mapper.target.num_layers, mapper.target.kv_width)
        scale = mapper.maps[kind][1].weight.abs().mean()
        outputs = [torch.randn(w.shape, generator=generator) * scale for w in start.weights_out]
        residuals[kind] = Residual(
            start.weight_in, torch.randn(hidden, generator=generator), outputs
        )
    return dataclasses.replace(mapper, residuals=residuals)


@pytest.fixture(scope="session")
def reduced_mapper(tiny_pair):
    """A reduced-rank (rank 16) mapper of ``tiny_pair``."""
    return fit_tiny_mapper(*tiny_pair, rank=16)


def random_cache(model: LoadedModel, tokens: int = 30, seed: int = 0) -> KVCache:
    """``model``'s cache of ``tokens`` random token ids (seeded)."""
    ids = torch.randint(0, 100, (tokens,), generator=torch.Generator().manual_seed(seed))
    return capture_kv(model.model, ids)


TINY_TUNING = dict(prompt_len=48, continuation=16, eval_every=5, heldout_windows=2, heldout_every=3)


SMALL_CALIBRATION = dict(tokens=1024, window=128, heldout_every=4)


def moments_of(x, y, batches=3):
    m = Moments.empty(x[:10].mean(0), y[:10].mean(0))
    for xb, yb in zip(x.chunk(batches), y.chunk(batches)):
        m.update(xb, yb)
    return m


def assert_same_cache(got: KVCache, want: KVCache) -> None:
    assert len(got) == len(want)
    for g, w in zip(got.keys + got.values, want.keys + want.values):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


# target layer -> source layers it is built from (3 source layers, 4 target layers)
TRUE_SOURCES = [[0], [0, 2], [1], [1, 2]]


def synthetic_target_cache(source_cache: KVCache, source_spec, target_spec, weights) -> KVCache:
    """Target post-RoPE K/V that are exact affine maps of the source's content-space K/V."""
    t = len(source_cache)
    src_tables, tgt_tables = (
        tables_for_spec(source_spec, source_cache.positions),
        tables_for_spec(target_spec, source_cache.positions),
    )
    content = {
        "k": [
            unrope(k, src_tables, source_spec.rope_style).reshape(t, -1) for k in source_cache.keys
        ],
        "v": [v.reshape(t, -1) for v in source_cache.values],
    }
    shape = (t, target_spec.num_kv_heads, target_spec.head_dim)
    out = {"k": [], "v": []}
    for layer, sources in enumerate(TRUE_SOURCES):
        for kind in ("k", "v"):
            w, b = weights[kind][layer]
            y = (torch.cat([content[kind][s] for s in sources], 1) @ w + b).reshape(shape)
            out[kind].append(rope(y, tgt_tables, target_spec.rope_style) if kind == "k" else y)
    return KVCache(out["k"], out["v"], source_cache.positions)


def cross_family_pair():
    """Llama-3-scaled RoPE (half-split) -> GLM (partial, interleaved), geometry differs too."""
    return tiny_model("llama3", seed=7), tiny_model(
        "glm", seed=8, layers=4, kv_heads=1, head_dim=32
    )


@pytest.fixture(scope="module", params=["qwen2->qwen2", "llama3->glm"])
def exact_problem(request, tiny_pair):
    source, target = tiny_pair if request.param == "qwen2->qwen2" else cross_family_pair()
    torch.manual_seed(0)
    ws, wt = source.spec.kv_width, target.spec.kv_width
    weights = {
        kind: [(torch.randn(len(s) * ws, wt) / ws**0.5, torch.randn(wt)) for s in TRUE_SOURCES]
        for kind in ("k", "v")
    }
    stats = statistics_of(
        source, target, lambda src: synthetic_target_cache(src, source.spec, target.spec, weights)
    )
    return source, target, weights, stats


def statistics_of(source, target, target_cache_of) -> PairStatistics:
    """Statistics of six random 64-token windows of ``source`` (the last held out) against the
    synthetic target caches ``target_cache_of(source_cache)``."""
    stats = PairStatistics(source.spec, target.spec)
    for i in range(6):
        src = capture_kv(source.model, torch.randint(0, 100, (64,)))
        stats.update(
            content_features(src, source.spec, slice(1, None)),
            content_features(target_cache_of(src), target.spec, slice(1, None)),
            held_out=i == 5,
        )
    return stats


def low_rank_target(src: KVCache, source_spec, target_spec, factors) -> KVCache:
    """Target post-RoPE K/V that are rank-r maps of ALL the source's content-space K/V."""
    t, layers = len(src), target_spec.num_layers
    x = content_features(src, source_spec, slice(0, None))
    tables = tables_for_spec(target_spec, src.positions)
    out = {}
    for kind, (a, b, bias) in factors.items():
        y = (x[kind] @ a @ b + bias).reshape(t, layers, target_spec.num_kv_heads, -1)
        out[kind] = [y[:, layer] for layer in range(layers)]
    keys = [rope(k, tables, target_spec.rope_style) for k in out["k"]]
    return KVCache(keys, out["v"], src.positions)


@pytest.fixture(scope="module")
def low_rank_problem(tiny_pair):
    """Target K/V of true rank 3 over all source layers, as statistics and as caches."""
    source, target = tiny_pair
    torch.manual_seed(1)
    dx = source.spec.num_layers * source.spec.kv_width
    dy = target.spec.num_layers * target.spec.kv_width
    factors = {
        kind: (torch.randn(dx, 3) / dx**0.5, torch.randn(3, dy), torch.randn(dy))
        for kind in ("k", "v")
    }
    stats = statistics_of(
        source, target, lambda src: low_rank_target(src, source.spec, target.spec, factors)
    )
    return source, target, factors, stats


def hicache_storage_config(model_name: str, extra_config: dict, is_mla_model: bool = False):
    """SGLang's ``HiCacheStorageConfig`` as a one-GPU server builds it for its storage backend:
    rank 0 of 1 (no pipeline or context parallelism), page-first layout, no metrics."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=is_mla_model,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=model_name,
        extra_config=extra_config,
    )
