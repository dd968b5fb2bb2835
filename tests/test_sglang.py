"""The SGLang extension with real SGLang 0.5.23 objects: a source engine stores a prompt's pages,
the target engine fetches them translated through KVMapStorage, and continues from its pool."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from sgl_kvmap.capture import KVCache, capture_kv, load_model, run
from sgl_kvmap.sglang import PeerSettings, StorageSettings

from .conftest import fit_tiny_mapper, save_loaded
from .sglang_engines import PAGE, Engine, info, page_keys

PROMPT_PAGES = 5


@pytest.fixture(scope="module")
def deployment(tiny_pair, tmp_path_factory):
    """Two model folders (the served model names), loaded back as the engines run them, and
    the source -> target pack (4 sink tokens)."""
    root = tmp_path_factory.mktemp("deployment")
    folders = [save_loaded(m, root / "models" / n) for m, n in zip(tiny_pair, ("source", "target"))]
    source, target = (load_model(folder) for folder in folders)
    mapper = dataclasses.replace(fit_tiny_mapper(source, target), sink_tokens=4)
    mapper.save_pretrained(root / "packs" / "source_to_target")
    return {"root": root, "source": folders[0], "target": folders[1], "mapper": mapper,
            "models": (source, target)}  # fmt: skip


def settings(deployment, store, translate=True, pack=None, **more) -> dict:
    peer = PeerSettings(
        model_name=deployment["source"],
        pack=str(pack or deployment["root"] / "packs" / "source_to_target"),
    )
    more = {key: str(value) if key == "model_path" else value for key, value in more.items()}
    more.setdefault("interface_v1", True)
    ours = StorageSettings(translate=translate, peers=(peer,), **more)
    return ours.to_extra_config(file_storage_path=str(store))


@pytest.fixture
def engines(deployment, tmp_path):
    """(source engine, prompt) with the prompt's pages stored, and a factory of target engines
    sharing the store; each target engine has computed the prompt's first page itself."""
    torch.manual_seed(0)
    prompt = torch.randint(3, 100, (PROMPT_PAGES * PAGE + 6,)).tolist()
    store = tmp_path / "store"
    models = deployment["models"]
    source = Engine.build(models[0], deployment["source"], settings(deployment, store, False))
    stored = prompt[: PROMPT_PAGES * PAGE]  # the source's cached pages; the request goes on
    assert all(source.back_up(stored, source.prefill(stored)))

    def target(native_first_page=True, **extra):
        extra = settings(deployment, store, **extra)
        engine = Engine.build(models[1], deployment["target"], extra)
        if native_first_page:
            first = prompt[:PAGE]
            assert all(engine.back_up(first, engine.prefill(first)))
            engine.tree.reset()  # the page is in storage only, like a request long evicted
        return engine

    return source, prompt, store, target


def continuation_logits(engine: Engine, prompt: list[int], cache: KVCache) -> torch.Tensor:
    """The target model's logits for the rest of ``prompt`` after ``cache``."""
    rest = torch.tensor(prompt[len(cache) :])
    past = cache if len(cache) else None
    return run(engine.model.model, rest, past=past, logits_to_keep=rest.numel()).logits


def test_translated_prefix_is_cached_and_continues_like_the_reference_mapper(engines, deployment):
    source, prompt, _, make_target = engines
    target = make_target()
    fetched = target.fetch(prompt)
    assert fetched == PROMPT_PAGES * PAGE  # page 0 native, pages 1-4 translated
    assert target.storage.counters["translated_pages"] == PROMPT_PAGES - 1
    cached = target.cached(prompt)
    assert len(cached) == fetched  # match_prefix reports the whole translated prefix as cached

    # reference: the target's own first page + the mapper's output for the rest, in pool dtype
    tokens = torch.tensor(prompt[:fetched])
    own = capture_kv(target.model.model, tokens[:PAGE])
    source_kv = capture_kv(deployment["models"][0].model, tokens)
    mapped = deployment["mapper"].map(bf16(source_kv))
    reference = bf16(mapped.replace_front(own.slice(0, PAGE)))
    for got, want in zip(cached.keys + cached.values, reference.keys + reference.values):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(
        continuation_logits(target, prompt, cached),
        continuation_logits(target, prompt, reference),
    )


def test_native_pages_always_win(engines):
    _, prompt, _, make_target = engines
    target = make_target()
    stored = prompt[: PROMPT_PAGES * PAGE]
    assert all(target.back_up(stored, target.prefill(stored)))
    target.tree.reset()
    assert target.fetch(prompt) == PROMPT_PAGES * PAGE
    assert target.storage.counters["translated_pages"] == 0
    exact = capture_kv(target.model.model, torch.tensor(prompt[: PROMPT_PAGES * PAGE]))
    torch.testing.assert_close(target.cached(prompt).keys[2], exact.keys[2].bfloat16())


def test_translated_pages_and_their_descendants_are_never_stored_as_native(engines, deployment):
    _, prompt, store, make_target = engines
    target = make_target()
    target.fetch(prompt)
    longer = prompt[: PROMPT_PAGES * PAGE] + torch.randint(3, 100, (2 * PAGE,)).tolist()
    slots = target.extend(longer)  # the target continues natively after the translated prefix
    results = target.back_up(longer, slots)  # HiCache's write-through of every page
    assert all(results)  # withheld pages report success, so HiCache does not retry them
    assert target.storage.counters["pages_withheld"] == len(page_keys(longer)) - 1
    target_files = [p for p in os.listdir(store) if deployment["target"].replace("/", "-") in p]
    assert len(target_files) == 1  # only the native first page
    # an engine of the target model that does not translate finds exact pages only
    exact_only = make_target(native_first_page=False, translate=False)
    assert exact_only.fetch(longer) == PAGE


def test_exact_pages_only_unless_translation_is_enabled(engines):
    _, prompt, _, make_target = engines
    target = make_target(translate=False)
    assert target.fetch(prompt) == PAGE
    assert not any(key.startswith("fallback") for key in target.storage.counters)
    exact = capture_kv(target.model.model, torch.tensor(prompt))
    cached = target.cached(prompt)
    torch.testing.assert_close(  # the request completes exactly as without sgl-kvmap
        continuation_logits(target, prompt, cached),
        exact_logits(target, prompt, len(cached)),
    )
    del exact


def exact_logits(engine: Engine, prompt: list[int], prefix: int) -> torch.Tensor:
    """Logits of prompt[prefix:] after the target's own (bf16-pooled) KV of prompt[:prefix]."""
    if prefix == 0:
        return continuation_logits(engine, prompt, KVCache([], [], torch.arange(0)))
    own = capture_kv(engine.model.model, torch.tensor(prompt[:prefix]))
    return continuation_logits(engine, prompt, bf16(own))


def bf16(cache: KVCache) -> KVCache:
    """A cache as SGLang's bf16 pools hold it."""
    return KVCache(
        [k.bfloat16() for k in cache.keys], [v.bfloat16() for v in cache.values], cache.positions
    )


@pytest.mark.parametrize(
    "case, reason",
    [
        ("missing pack", "pack_invalid"),
        ("damaged pack", "pack_invalid"),
        ("pack of another pair", "model_mismatch"),
        ("tokenizer differs", "tokenizer_mismatch"),
        ("host pool of another geometry", "geometry_mismatch"),
        ("no native first page", "no_native_sink_page"),
        ("interface_v1 off", "interface_v1_off"),
        ("this engine's model unreadable", "model_unverifiable"),
    ],
)
def test_fallbacks_prefill_natively_and_count_the_reason(
    engines, deployment, tmp_path, case, reason
):
    _, prompt, store, make_target = engines
    extra, native_first_page = {}, True
    if case == "missing pack":
        extra["pack"] = tmp_path / "nowhere"
    elif case == "damaged pack":
        extra["pack"] = damaged_copy(deployment["root"] / "packs" / "source_to_target", tmp_path)
    elif case == "pack of another pair":
        extra["pack"] = reverse_pack(deployment, tmp_path)
    elif case == "tokenizer differs":
        extra["model_path"] = other_tokenizer_copy(deployment["target"], tmp_path)
    elif case == "no native first page":
        native_first_page = False
    elif case == "interface_v1 off":
        extra["interface_v1"] = False
    elif case == "this engine's model unreadable":
        extra["model_path"] = tmp_path / "no-such-model"
    if case == "host pool of another geometry":  # the target's name, the source's pool shape
        target = Engine.build(
            deployment["models"][0], deployment["target"], settings(deployment, store)
        )
    else:
        target = make_target(native_first_page=native_first_page, **extra)
    fetched = target.fetch(prompt)
    assert fetched == (PAGE if native_first_page and case != "host pool of another geometry" else 0)
    assert target.storage.counters[f"fallback.{reason}"] >= 1
    assert target.storage.counters["translated_pages"] == 0
    cached = target.cached(prompt)
    torch.testing.assert_close(
        continuation_logits(target, prompt, cached), exact_logits(target, prompt, len(cached))
    )


def test_translating_sinks_is_the_operators_choice(engines):
    _, prompt, _, make_target = engines
    target = make_target(native_first_page=False, translate_sinks=True)
    assert target.fetch(prompt) == PROMPT_PAGES * PAGE
    assert target.storage.counters["translated_pages"] == PROMPT_PAGES


def test_unknown_positions_refuse_translation(engines):
    _, prompt, _, make_target = engines
    target = make_target()
    keys = page_keys(prompt)
    host = target.host.alloc(len(keys) * PAGE)
    ok = target.storage.batch_get_v1(keys, host, info(None))  # SGLang passed no prefix keys
    assert ok == [True] + [False] * (len(keys) - 1)
    assert target.storage.counters["fallback.positions_unknown"] == 1


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_a_peer_page_lost_mid_prefetch_ends_the_translated_run(engines, damage):
    _, prompt, store, make_target = engines
    target = make_target()
    keys = page_keys(prompt)
    assert target.storage.batch_exists(keys, info(None)) == PROMPT_PAGES
    victim = next(p for p in store.iterdir() if p.name.startswith(keys[3]) and "source" in p.name)
    if damage == "deleted":
        victim.unlink()
    else:
        victim.write_bytes(victim.read_bytes()[:100])
    host = target.host.alloc(len(keys) * PAGE)
    ok = target.storage.batch_get_v1(keys, host, info([]))
    if damage == "deleted":
        assert ok == [True, True, True, False, False]  # pages 1-2 translated, then prefill
        assert target.storage.counters["translated_pages"] == 2
    else:
        assert ok == [True, False, False, False, False]  # the read error voids the whole run
        assert target.storage.counters["fallback.translation_error"] == 1


def damaged_copy(pack, tmp_path):
    import shutil

    broken = tmp_path / "damaged"
    shutil.copytree(pack, broken)
    weights = broken / "mapper.safetensors"
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(64)  # flip the tail of the tensor data: the sha256 check must catch it
    weights.write_bytes(bytes(data))
    return broken


def reverse_pack(deployment, tmp_path):
    """A valid pack for another pair: the source model onto itself."""
    from sgl_kvmap.calibrate import (
        CalibrationConfig,
        PairStatistics,
        content_features,
        fit_from_statistics,
    )
    from sgl_kvmap.capture import load_model

    model = load_model(deployment["source"])
    stats = PairStatistics(model.spec, model.spec)
    for i in range(3):
        cache = capture_kv(model.model, torch.randint(0, 100, (32,)))
        features = content_features(cache, model.spec, slice(1, None))
        stats.update(features, features, held_out=i == 2)
    mapper, _ = fit_from_statistics(stats, CalibrationConfig(top_k=1))
    return mapper.save_pretrained(tmp_path / "self_pack")


def other_tokenizer_copy(model_dir, tmp_path):
    """The target model's folder with a different tokenizer (one extra token)."""
    import shutil

    from .conftest import char_tokenizer

    copy = tmp_path / "other_tokenizer"
    shutil.copytree(model_dir, copy)
    char_tokenizer(extra="§").save_pretrained(copy)
    return str(copy)
