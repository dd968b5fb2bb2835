"""sgl-kvmap: cross-model KV cache transfer for LLM families.

Fit closed-form mappers between two causal LMs that share a tokenizer, save them as packs,
and translate one model's KV cache into the other's so a prefix survives a model swap.
Importing this package needs neither sglang, triton nor a GPU.
"""

from . import registry as registry  # importing it installs the Hub as the model source
from ._version import __version__ as __version__
from .core.cache import KVCache
from .core.errors import KVMapError, PackError, PairMismatchError
from .core.mapper import KVMapper
from .core.spec import ModelSpec, spec_from_pretrained
from .fitting.calibrate import FitReport, fit_mapper
from .fitting.config import CalibrationConfig, TuneConfig
from .fitting.evaluate import EvalReport, evaluate
from .fitting.tune import TuneReport, tune_mapper
from .models.capture import LoadedModel, capture_kv, load_model
from .models.transfer import Repair, handoff, translate_prefix
from .registry.resolve import resolve_mapper  # importing the registry installs the Hub client

__all__ = [
    "CalibrationConfig",
    "EvalReport",
    "FitReport",
    "KVCache",
    "KVMapError",
    "KVMapper",
    "LoadedModel",
    "ModelSpec",
    "PackError",
    "PairMismatchError",
    "Repair",
    "TuneConfig",
    "TuneReport",
    "capture_kv",
    "evaluate",
    "fit_mapper",
    "handoff",
    "load_model",
    "spec_from_pretrained",
    "translate_prefix",
    "tune_mapper",
    "resolve_mapper",
]
