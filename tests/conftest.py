"""Tiny randomly initialised transformers models (and a character tokenizer) for fast tests."""

from __future__ import annotations

import string

import pytest
import torch

from sgl_kvmap.core.mapper import content_features
from sgl_kvmap.core.spec import spec_from_config
from sgl_kvmap.models.capture import LoadedModel

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
        vocab_size=128, hidden_size=heads * head_dim, intermediate_size=64,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=512,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    common.update(extra)
    if kind == "qwen2":
        return Qwen2Config(**common)
    if kind == "qwen3":
        return Qwen3Config(**common)
    if kind == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}  # fmt: skip
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
    from pathlib import Path

    root = tmp_path_factory.mktemp("texts")
    sources = sorted(Path(__file__).resolve().parents[1].joinpath("sgl_kvmap").rglob("*.py"))
    for i, path in enumerate(sources):
        folder = root / ("calib" if i % 3 else "eval")
        folder.mkdir(exist_ok=True)
        (folder / f"{i}_{path.name}").write_text(path.read_text())
    return root


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
    from sgl_kvmap.fitting.calibrate import PairStatistics, fit_from_statistics
    from sgl_kvmap.fitting.config import CalibrationConfig
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
    import dataclasses

    from sgl_kvmap.core.residual import Residual, initial_residual

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
