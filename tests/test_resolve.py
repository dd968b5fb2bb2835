"""resolve without a Hub: an offline miss says how to get the pack, a build happens once and is
found again, packs for other models are refused by their pins, two processes resolving one
pair at once build one valid pack, and packs built here are kept by recipe (a lookup for one
recipe never returns another's; packs of the layout before that are of unknown recipe).

Caches are temporary folders passed as ``cache_dir`` / ``assets_dir`` (or ``HF_HOME`` for child
processes); the Hub is never contacted (``local_files_only``)."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from sgl_kvmap.core.errors import PackError, PairMismatchError
from sgl_kvmap.core.mapper import KVMapper
from sgl_kvmap.core.spec import spec_from_pretrained
from sgl_kvmap.fitting.config import CalibrationConfig, DemoConfig, PackRecipe
from sgl_kvmap.registry.resolve import (
    built_pack_dir,
    built_pack_folder,
    built_packs,
    check_pins,
    keep_as_built,
    pack_recipe,
    resolve_pack,
)

SMALL_RECIPE = PackRecipe(CalibrationConfig(tokens=512, window=64, top_k=1), None)
# what the registry's builds fit in tests that ask for the default recipe (its real budget
# takes minutes): another map than SMALL_RECIPE's (2 source layers per target layer, not 1)
STAND_IN = PackRecipe(CalibrationConfig(tokens=512, window=64, top_k=2), None)


def build_cheaply(monkeypatch) -> list[PackRecipe]:
    """Make the registry's builds fit STAND_IN whatever recipe they are asked for; returns the
    list the recipes asked for are appended to."""
    from sgl_kvmap.fitting.build import build_pack
    from sgl_kvmap.registry import resolve

    asked = []

    def stand_in(source, target, calibration, recipe):
        asked.append(recipe)
        return build_pack(source, target, calibration, STAND_IN)

    monkeypatch.setattr(resolve, "build_pack", stand_in)
    return asked


@pytest.fixture
def caches(tmp_path):
    return {"cache_dir": tmp_path / "hub", "assets_dir": tmp_path / "assets"}


def test_an_offline_miss_says_how_to_get_the_pack(model_folders, caches):
    with pytest.raises(PackError) as err:
        resolve_pack(
            model_folders["source"], model_folders["target"], local_files_only=True, **caches
        )
    message = str(err.value)
    assert "no mapper pack" in message and "in the local cache" in message
    assert "sgl-kvmap pull" in message and "--build" in message


def test_a_pack_is_built_once_then_found(model_folders, caches):
    built = resolve_pack(
        model_folders["source"], model_folders["target"], build=True, local_files_only=True,
        recipe=SMALL_RECIPE, **caches,
    )  # fmt: skip
    mapper = KVMapper.from_pretrained(built)
    assert mapper.source.fingerprint == spec_from_pretrained(model_folders["source"]).fingerprint
    again = resolve_pack(
        model_folders["source"], model_folders["target"], local_files_only=True, **caches
    )
    assert again == built
    assert [e.where for e in built_packs(caches["assets_dir"])] == [str(built)]
    # another target: not this pack
    with pytest.raises(PackError, match="no mapper pack"):
        resolve_pack(
            model_folders["source"], model_folders["other"], local_files_only=True, **caches
        )


def test_pins_refuse_other_models_unless_told(model_folders, caches, caplog):
    built = resolve_pack(
        model_folders["source"], model_folders["target"], build=True, local_files_only=True,
        recipe=SMALL_RECIPE, **caches,
    )  # fmt: skip
    specs = (
        spec_from_pretrained(model_folders["source"]),
        spec_from_pretrained(model_folders["target"]),
    )
    wrong_weights_same_shape = replace(specs[1], config={**specs[1].config, "rope_theta": 1.0})
    with pytest.raises(PairMismatchError, match="target"):
        check_pins(built, (specs[0], wrong_weights_same_shape))
    check_pins(built, (specs[0], wrong_weights_same_shape), allow_mismatch=True)
    assert "does not match the models" in caplog.text


BUILD = """
import json, sys
from sgl_kvmap.fitting.config import CalibrationConfig, DemoConfig, PackRecipe
from sgl_kvmap.registry.resolve import resolve_pack
source, target, assets = sys.argv[1:]
recipe = PackRecipe(CalibrationConfig(tokens=512, window=64, top_k=1), None)
folder = resolve_pack(
    source, target, build=True, local_files_only=True, assets_dir=assets, recipe=recipe
)
print(json.dumps(str(folder)))
"""


def test_two_processes_resolving_one_pair_build_one_pack(model_folders, caches):
    argv = [sys.executable, "-c", BUILD, model_folders["source"], model_folders["target"]]
    procs = [
        subprocess.Popen(
            [*argv, str(caches["assets_dir"])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [proc.communicate(timeout=600) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [err[-2000:] for _, err in results]
    folders = {json.loads(out) for out, _ in results}
    assert len(folders) == 1
    assert sum("building the pack" in err for _, err in results) == 1
    KVMapper.from_pretrained(folders.pop())


def test_a_pin_to_a_commit_refuses_other_weights_with_the_same_configuration(tiny_mapper):
    """Two commits of one Hub model (a fine-tune, say) share a fingerprint; the commit a pack
    recorded tells them apart when both are known."""
    from sgl_kvmap.core.spec import check_models

    pinned = replace(tiny_mapper, target=replace(tiny_mapper.target, revision="a" * 40))
    check_models(pinned, tiny_mapper.source, replace(tiny_mapper.target, revision="a" * 40))
    check_models(pinned, tiny_mapper.source, tiny_mapper.target)  # a local folder: no commit
    with pytest.raises(PairMismatchError, match="at commit a{40} but .* at commit b{40}"):
        check_models(pinned, tiny_mapper.source, replace(tiny_mapper.target, revision="b" * 40))


def test_an_unreachable_hub_is_a_warning_and_the_pack_is_built(
    model_folders, caches, monkeypatch, caplog
):
    """The Hub's address answers nothing (a closed port on 127.0.0.1; huggingface_hub 1.x raises
    httpx's ConnectError): resolve warns, then builds, as offline."""
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "2")
    with pytest.raises(PackError, match="no mapper pack"):
        resolve_pack(model_folders["source"], model_folders["target"], **caches)
    built = resolve_pack(
        model_folders["source"], model_folders["target"], build=True, recipe=SMALL_RECIPE, **caches
    )
    assert KVMapper.from_pretrained(built).source.model_id
    assert "could not list packs on the Hub" in caplog.text


def test_a_pair_is_built_both_ways_from_one_pass_and_equals_two_separate_builds(
    model_folders, caches
):
    from sgl_kvmap.fitting.build import build_pack
    from sgl_kvmap.registry.resolve import resolve_pack_pair

    a, b = model_folders["source"], model_folders["target"]
    up, down = resolve_pack_pair(a, b, build=True, recipe=SMALL_RECIPE, **caches)
    assert (up, down) == resolve_pack_pair(a, b, local_files_only=True, **caches)
    for folder, (source, target) in ((up, (a, b)), (down, (b, a))):
        built = KVMapper.from_pretrained(folder)
        alone, _ = build_pack(source, target, None, SMALL_RECIPE)
        assert built.target.fingerprint == spec_from_pretrained(target).fingerprint
        assert built.selection == alone.selection
        for kind in ("k", "v"):
            for got, want in zip(built.maps[kind], alone.maps[kind]):
                torch.testing.assert_close(got.weight, want.weight)
                torch.testing.assert_close(got.bias, want.bias)


def test_a_pair_with_one_pack_found_builds_only_the_other(model_folders, caches):
    from sgl_kvmap.fitting.build import build_pack
    from sgl_kvmap.registry.resolve import resolve_pack_pair

    a, b = model_folders["source"], model_folders["target"]
    options = {"local_files_only": True, "recipe": SMALL_RECIPE, **caches}
    up = resolve_pack(a, b, build=True, **options)
    tensors = {f.name: f.read_bytes() for f in up.iterdir() if f.is_file()}
    found, down = resolve_pack_pair(a, b, build=True, **options)
    assert found == up
    assert {f.name: f.read_bytes() for f in up.iterdir() if f.is_file()} == tensors
    built, (alone, _) = KVMapper.from_pretrained(down), build_pack(b, a, None, SMALL_RECIPE)
    assert built.source.fingerprint == spec_from_pretrained(b).fingerprint
    for kind in ("k", "v"):
        for got, want in zip(built.maps[kind], alone.maps[kind]):
            torch.testing.assert_close(got.weight, want.weight)


def test_a_pack_kept_as_built_is_what_resolve_finds_and_other_maps_never_replace_it(
    model_folders, caches, tiny_mapper
):
    """What the demo does with its packs: the first kept pack is the pair's built pack; other
    maps never replace it, while the same maps measured again (a second demo run) refresh its
    figures, which resolve then finds (before: they stayed as first recorded, so engines read
    figures the demo no longer printed)."""
    a, b = model_folders["source"], model_folders["target"]
    mapper = KVMapper.from_pretrained(resolve_pack(a, b, build=True, recipe=SMALL_RECIPE, **caches))
    assert keep_as_built(mapper, SMALL_RECIPE, caches["assets_dir"]) is None  # kept as it was
    other = replace(mapper, ridge=mapper.ridge * 2)
    assert keep_as_built(other, SMALL_RECIPE, caches["assets_dir"]) is None
    assert KVMapper.from_pretrained(resolve_pack(a, b, local_files_only=True, **caches)).ridge == (
        mapper.ridge
    )
    measured = replace(mapper, info={**mapper.info, "metrics": {"eval_gap_closed_served": 0.25}})
    folder = keep_as_built(measured, SMALL_RECIPE, caches["assets_dir"])
    assert folder == resolve_pack(a, b, local_files_only=True, **caches)
    found = KVMapper.from_pretrained(folder)
    assert found.info["metrics"] == {"eval_gap_closed_served": 0.25} and found.ridge == mapper.ridge
    assert keep_as_built(measured, SMALL_RECIPE, caches["assets_dir"]) is None  # nothing new
    fresh = {"cache_dir": caches["cache_dir"], "assets_dir": caches["assets_dir"].parent / "fresh"}
    kept = keep_as_built(mapper, SMALL_RECIPE, fresh["assets_dir"])
    assert kept == resolve_pack(a, b, local_files_only=True, **fresh)


def test_a_mapper_fitted_on_loaded_folders_is_kept_where_resolve_looks(model_folders, caches):
    """The demo's route: models loaded from their folders, fitted, kept as built."""
    from sgl_kvmap.fitting.calibrate import fit_mapper
    from sgl_kvmap.models.capture import load_model

    a, b = model_folders["source"], model_folders["target"]
    ((mapper, _),) = fit_mapper(load_model(a), load_model(b), None, SMALL_RECIPE.calibration)
    kept = keep_as_built(mapper, SMALL_RECIPE, caches["assets_dir"])
    assert kept == resolve_pack(a, b, local_files_only=True, **caches)


def test_a_cheap_build_is_never_what_a_build_with_the_default_recipe_returns(
    model_folders, caches, monkeypatch
):
    """Issue 30: after the benchmark's cheap build, a build with the default recipe returned the
    cheap pack. Now each recipe's pack is its own, and a lookup that states no recipe prefers the
    default recipe's."""
    a, b = model_folders["source"], model_folders["target"]
    options = {"local_files_only": True, **caches}
    cheap = resolve_pack(a, b, build=True, recipe=SMALL_RECIPE, **options)  # as bench does
    cheap_files = {f.name: f.read_bytes() for f in cheap.iterdir()}
    assert resolve_pack(a, b, **options) == cheap  # no recipe stated: any pack built here
    with pytest.raises(PackError, match="no mapper pack"):
        resolve_pack(a, b, recipe=PackRecipe(), **options)
    asked = build_cheaply(monkeypatch)
    default = resolve_pack(a, b, build=True, **options)
    assert asked == [PackRecipe()] and default != cheap
    specs = spec_from_pretrained(a), spec_from_pretrained(b)
    assert default == built_pack_folder(*specs, PackRecipe(), caches["assets_dir"])
    assert len(KVMapper.from_pretrained(default).selection[0]) == 2  # STAND_IN's map, not cheap's
    assert resolve_pack(a, b, build=True, **options) == default and len(asked) == 1  # found
    assert resolve_pack(a, b, recipe=SMALL_RECIPE, **options) == cheap
    assert resolve_pack(a, b, **options) == default  # no recipe stated: the default's first
    assert {f.name: f.read_bytes() for f in cheap.iterdir()} == cheap_files
    assert pack_recipe(default, caches["assets_dir"]).startswith(
        f"{PackRecipe().key()} (the default): "
    )
    assert pack_recipe(cheap, caches["assets_dir"]) == (
        f"{SMALL_RECIPE.key()}: 512 calibration tokens, top-k 1, not tuned"
    )


def test_without_a_stated_recipe_the_default_comes_first_then_the_largest_budget(
    model_folders, caches
):
    """Packs kept as built (the demo's route) under their recipes: a lookup that states none
    takes the default recipe's, else the one with the most calibration tokens."""
    from sgl_kvmap.fitting.build import build_pack

    a, b = model_folders["source"], model_folders["target"]
    options = {"local_files_only": True, **caches}
    mapper, _ = build_pack(a, b, None, SMALL_RECIPE)
    small = keep_as_built(mapper, SMALL_RECIPE, caches["assets_dir"])
    calibration = {**mapper.info["calibration"], "tokens": 16384}
    larger = replace(mapper, info={**mapper.info, "calibration": calibration})
    demo = keep_as_built(larger, DemoConfig().recipe, caches["assets_dir"])
    assert len({small, demo}) == 2 and resolve_pack(a, b, **options) == demo
    assert resolve_pack(a, b, recipe=SMALL_RECIPE, **options) == small
    default = keep_as_built(mapper, PackRecipe(), caches["assets_dir"])
    assert resolve_pack(a, b, **options) == default
    listed = {e.where: e.recipe for e in built_packs(caches["assets_dir"])}
    assert listed == {
        str(default): f"{PackRecipe().key()} (the default): 512 calibration tokens, top-k 1, "
        "not tuned",
        str(demo): f"{DemoConfig().recipe.key()}: 16,384 calibration tokens, top-k 1, not tuned",
        str(small): f"{SMALL_RECIPE.key()}: 512 calibration tokens, top-k 1, not tuned",
    }


def test_a_pack_built_before_recipes_keyed_the_cache_is_of_unknown_recipe(
    model_folders, caches, monkeypatch
):
    """The layout before: the pair's folder held one pack (``pack``), whatever its recipe. It is
    still found by a lookup that states no recipe (after every keyed pack), never taken for a
    stated recipe or a build, and never replaced."""
    from sgl_kvmap.fitting.build import build_pack

    a, b = model_folders["source"], model_folders["target"]
    options = {"local_files_only": True, **caches}
    specs = spec_from_pretrained(a), spec_from_pretrained(b)
    mapper, _ = build_pack(a, b, None, SMALL_RECIPE)
    old = mapper.save_pretrained(built_pack_dir(*specs, caches["assets_dir"]) / "pack")
    old_files = {f.name: f.read_bytes() for f in old.iterdir()}
    assert resolve_pack(a, b, **options) == old
    assert pack_recipe(old, caches["assets_dir"]) == (
        "unknown (built here before packs were kept by recipe; it records 512 calibration "
        "tokens, top-k 1, not tuned)"
    )
    with pytest.raises(PackError, match="no mapper pack"):
        resolve_pack(a, b, recipe=SMALL_RECIPE, **options)  # even the recipe it records
    asked = build_cheaply(monkeypatch)
    default = resolve_pack(a, b, build=True, **options)
    assert asked == [PackRecipe()] and default != old
    assert resolve_pack(a, b, **options) == default
    assert [e.where for e in built_packs(caches["assets_dir"])][-1] == str(old)
    assert {f.name: f.read_bytes() for f in old.iterdir()} == old_files


def test_the_benchmark_takes_any_pack_found_and_builds_its_recipe_only_when_one_is_missing(
    model_folders, caches
):
    """``sgl-kvmap bench``: the demo's packs (kept under the demo's recipe) are used as found;
    with none, the benchmark's own recipe is built, both ways from one pass."""
    from sgl_kvmap.bench.run import _registry_packs
    from sgl_kvmap.fitting.build import build_pack_pair

    a, b = model_folders["source"], model_folders["target"]
    options = {"local_files_only": True, **caches}
    demo = DemoConfig().recipe
    kept = [
        keep_as_built(m, demo, caches["assets_dir"])
        for m, _ in build_pack_pair(a, b, None, SMALL_RECIPE)
    ]
    assert _registry_packs(a, b, SMALL_RECIPE, **options) == tuple(kept)
    fresh = {**options, "assets_dir": caches["assets_dir"].parent / "fresh"}
    up, down = _registry_packs(a, b, SMALL_RECIPE, **fresh)
    assert up.parent.name == down.parent.name == f"recipe-{SMALL_RECIPE.key()}"
