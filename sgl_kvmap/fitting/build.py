"""build_pack: a map made as a ``PackRecipe`` says, the library call behind ``sgl-kvmap fit``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core.mapper import KVMapper
from ..models.capture import LoadedModel, loaded
from .calibrate import fit_mapper
from .config import PackRecipe
from .tune import tune_mapper


def build_pack(
    source: str | LoadedModel,
    target: str | LoadedModel,
    calibration: list[str | Path] | None = None,
    recipe: PackRecipe = PackRecipe(),
) -> tuple[KVMapper, dict[str, Any]]:
    """Fit ``source`` -> ``target`` as ``recipe.calibration`` says, then tune the map as
    ``recipe.tuning`` says (if it says so). ``source``/``target``: anything transformers loads,
    or loaded models; ``calibration``: text files/folders (default: ``fit_mapper``'s for the
    fit and ``tune_mapper``'s for tuning). Returns the mapper (save it with
    ``save_pretrained``) and the flat summary of what the fit and the tuning measured."""
    models = loaded(source), loaded(target)
    ((mapper, report),) = fit_mapper(*models, calibration, recipe.calibration)
    return tuned(mapper, report.summary(), *models, calibration, recipe)


def build_pack_pair(
    a: str | LoadedModel,
    b: str | LoadedModel,
    calibration: list[str | Path] | None = None,
    recipe: PackRecipe = PackRecipe(),
) -> list[tuple[KVMapper, dict[str, Any]]]:
    """``build_pack`` both ways, a -> b then b -> a, from one calibration pass (each model runs
    over the text once, not twice)."""
    models = loaded(a), loaded(b)
    fits = fit_mapper(*models, calibration, recipe.calibration, both_directions=True)
    return [
        tuned(mapper, report.summary(), source, target, calibration, recipe)
        for (mapper, report), (source, target) in zip(fits, (models, models[::-1]))
    ]


def tuned(mapper, summary, source, target, calibration, recipe) -> tuple[KVMapper, dict]:
    if recipe.tuning is not None:
        mapper, tuning = tune_mapper(mapper, source, target, calibration, recipe.tuning)
        summary.update(tuning.summary())
    return mapper, summary
