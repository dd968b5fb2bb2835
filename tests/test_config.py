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
