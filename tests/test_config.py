"""Settings are validated where they are made, and recipes hold only well-formed settings."""

import pytest

from sgl_kvmap.core.errors import KVMapError
from sgl_kvmap.fitting.config import (
    CalibrationConfig,
    DemoConfig,
    EvalConfig,
    PackRecipe,
    TuneConfig,
)
from sgl_kvmap.models.transfer import Repair


def test_config_validation():
    with pytest.raises(KVMapError):
        CalibrationConfig(tokens=100, window=128)
    with pytest.raises(KVMapError):
        CalibrationConfig(top_k="many")


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(prefix_len=1), "prefix_len"),
        (dict(continuation=0), "continuation"),
        (dict(windows=0), "windows"),
        (dict(prefix_len=16, tail=15), "tail"),
        (dict(tail=-1), "tail"),
        (dict(speed_tokens=1), "speed_tokens"),
    ],
)
def test_evaluation_settings_are_validated(settings, message):
    with pytest.raises(KVMapError, match=message):
        EvalConfig(**settings)


def test_recipes_hold_only_settings_of_their_kind():
    assert PackRecipe(tuning=None).tuning is None  # the closed-form fit as it is
    with pytest.raises(KVMapError, match="CalibrationConfig"):
        PackRecipe(calibration=TuneConfig())
    with pytest.raises(KVMapError, match="TuneConfig"):
        PackRecipe(tuning=CalibrationConfig())
    with pytest.raises(KVMapError, match="PackRecipe"):
        DemoConfig(recipe=CalibrationConfig())
    with pytest.raises(KVMapError, match="speed_tokens"):  # the demo always times
        DemoConfig(evaluation=EvalConfig(repair=Repair(anchors=8)))


def test_a_recipe_key_is_stable_readable_and_differs_for_any_field():
    """The registry keeps the packs built here by this key: equal recipes share it, and a
    change of any one field (the cheap benchmark recipe's budget, a tuning rate) changes it."""
    from sgl_kvmap.bench.run import BENCH_RECIPE

    default = PackRecipe()
    assert default.key() == PackRecipe().key()
    assert default.key().startswith("128k-rank-auto-tuned-120-")
    assert BENCH_RECIPE.key().startswith("4k-top-k-4-untuned-")
    assert DemoConfig().recipe.key().startswith("16k-rank-auto-untuned-")
    variants = [
        BENCH_RECIPE,
        DemoConfig().recipe,
        PackRecipe(CalibrationConfig(tokens=131072, rank="auto", ridge=0.02)),
        PackRecipe(tuning=TuneConfig(steps=120, lr=1e-5)),
        PackRecipe(tuning=TuneConfig(steps=121)),
    ]
    keys = [default.key()] + [recipe.key() for recipe in variants]
    assert len(set(keys)) == len(keys)
    assert all(key.rsplit("-", 1)[1].isalnum() and len(key.rsplit("-", 1)[1]) == 12 for key in keys)


def test_a_recorded_recipe_is_summarised_in_a_few_words():
    from sgl_kvmap.fitting.config import recipe_summary

    tuned = {"tokens": 131072, "rank": "auto", "top_k": "auto", "tuning": {"steps": 120}}
    assert recipe_summary(tuned) == "131,072 calibration tokens, rank auto, tuned 120 steps"
    cheap = {"tokens": 4096, "rank": None, "top_k": 4}
    assert recipe_summary(cheap) == "4,096 calibration tokens, top-k 4, not tuned"
    assert recipe_summary({}) == "not recorded"
