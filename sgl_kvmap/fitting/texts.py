"""Text that exists offline, cut into token windows for calibration and evaluation.

Defaults keep calibration and evaluation disjoint: calibration reads the Python standard
library's sources; evaluation reads the sources of third-party packages that sgl-kvmap itself
installs (click, tqdm, huggingface_hub) plus the system's licence texts, never the stdlib.
A broader code corpus that every install has too: the stdlib plus the sources of sgl-kvmap's
other dependencies (``code_corpus_files``: torch, transformers, numpy, ...), never the
evaluation's packages.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from ..core.errors import KVMapError

TEXT_SUFFIXES = {".py", ".md", ".rst", ".txt", ".json", ".toml", ".yaml", ".yml", ".c", ".h", ""}
EVAL_PACKAGES = ("click", "tqdm", "huggingface_hub")
# installed with sgl-kvmap everywhere (its dependencies), disjoint from EVAL_PACKAGES
DEPENDENCY_PACKAGES = ("torch", "transformers", "numpy", "accelerate", "safetensors", "gguf")
LICENCE_DIR = Path("/usr/share/common-licenses")
PROBE_TEXT = "def tokens(text): return text.split()"  # what any tokenizer of code reads


def stdlib_files() -> list[Path]:
    """The standard library's .py files (site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in sorted(root.rglob("*.py")) if "site-packages" not in p.parts]


def stdlib_docs_files(folder: Path) -> list[Path]:
    """English prose that every CPython ships: the language and library reference pages behind
    ``help()`` (``pydoc_data.topics``, ~80 pages, ~110k tokens), one text file per page under
    ``folder`` (written once per Python version). Disjoint from the evaluation's licence texts
    and third-party sources."""
    from pydoc_data.topics import topics

    root = folder / f"pydoc-topics-{sysconfig.get_python_version()}"
    if not root.is_dir():
        partial = root.with_name(root.name + ".partial")
        partial.mkdir(parents=True, exist_ok=True)
        for name, text in topics.items():
            (partial / f"{name}.txt").write_text(text, encoding="utf-8")
        partial.rename(root)  # complete or absent, never half-written
    return sorted(root.glob("*.txt"))


def package_files(names: Iterable[str]) -> list[Path]:
    """The .py sources of the installed packages ``names`` (any not installed are skipped),
    sorted within each package."""
    files: list[Path] = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec and spec.submodule_search_locations:
            files += sorted(Path(next(iter(spec.submodule_search_locations))).rglob("*.py"))
    return files


def dependency_files() -> list[Path]:
    """The sources of sgl-kvmap's dependencies (DEPENDENCY_PACKAGES), never an evaluation
    package's."""
    return package_files(DEPENDENCY_PACKAGES)


def code_corpus_files() -> list[Path]:
    """The stdlib's sources and its dependencies' (``dependency_files``): more kinds of code
    than the stdlib alone, still disjoint from ``default_eval_files``."""
    return stdlib_files() + dependency_files()


def default_eval_files() -> list[Path]:
    """Held-out text disjoint from the stdlib: third-party sources and licence texts."""
    files = package_files(EVAL_PACKAGES)
    if LICENCE_DIR.is_dir():
        files += sorted(p for p in LICENCE_DIR.iterdir() if p.is_file())
    return files


def expand_paths(paths: Iterable[str | Path]) -> list[Path]:
    """Files as given, folders expanded recursively to their text files; sorted, deduplicated."""
    out: set[Path] = set()
    for path in map(Path, paths):
        if path.is_dir():
            out.update(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        elif path.is_file():
            out.add(path)
        else:
            raise KVMapError(f"text path {path} does not exist")
    if not out:
        raise KVMapError(f"no text files found under {list(map(str, paths))}")
    return sorted(out)


def shuffled(files: Iterable[Path], seed: str = "sgl-kvmap") -> list[Path]:
    """A deterministic, machine-independent shuffle (by hash of the file name and parent)."""
    key = lambda p: hashlib.sha256(f"{seed}/{p.parent.name}/{p.name}".encode()).hexdigest()  # noqa: E731
    return sorted(files, key=key)


def calibration_windows(
    tokenizer, files: list[Path], window: int, per_file: int, max_tokens: int | None = None
) -> Iterator[torch.Tensor]:
    """Windows ``[window]`` of token ids from a stream of files (at most ``per_file`` tokens each),
    in shuffled file order, until ``max_tokens`` tokens have been yielded (None: until the files
    run out)."""
    check_tokenizer(tokenizer)
    limit = float("inf") if max_tokens is None else max_tokens
    buffer: list[int] = []
    produced = 0
    for path in shuffled(files):
        buffer += file_tokens(tokenizer, path)[:per_file]
        while len(buffer) >= window and produced + window <= limit:
            yield torch.tensor(buffer[:window])
            buffer = buffer[window:]
            produced += window
        if produced + window > limit:
            return


def prompt_of_length(tokenizer, tokens: int) -> torch.Tensor:
    """A prompt of exactly ``tokens: [tokens]`` ids of real text (stdlib sources), for timing."""
    prompt = next(calibration_windows(tokenizer, stdlib_files(), tokens, tokens, tokens), None)
    if prompt is None:
        raise KVMapError(
            f"no standard library source file holds a prompt of {tokens:,} tokens; time a "
            "shorter one"
        )
    return prompt


def eval_windows(tokenizer, files: list[Path], length: int, count: int) -> list[torch.Tensor]:
    """Up to ``count`` windows ``[length]``: the opening tokens of distinct long-enough files."""
    return [window for _, window in eval_sources(tokenizer, files, length, count)]


def eval_sources(
    tokenizer, files: list[Path], length: int, count: int
) -> list[tuple[Path, torch.Tensor]]:
    """``eval_windows`` with the file each window opens: (path, window ``[length]``) pairs."""
    check_tokenizer(tokenizer)
    sources = []
    for path in shuffled(files, seed="sgl-kvmap-eval"):
        ids = file_tokens(tokenizer, path)
        if len(ids) >= length:
            sources.append((path, torch.tensor(ids[:length])))
        if len(sources) == count:
            break
    if not sources:
        raise KVMapError(
            f"no evaluation file has {length} tokens; pass longer texts or a shorter prefix"
        )
    return sources


def check_tokenizer(tokenizer) -> None:
    """Refuse a tokenizer that turns text into no tokens: what transformers loads for a model
    folder without tokenizer files, whose text would otherwise make no window at all."""
    if not tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]:
        folder = getattr(tokenizer, "name_or_path", "") or "the model"
        raise KVMapError(
            f"{folder} has no tokenizer (it turns text into no tokens): copy the model's "
            "tokenizer files (tokenizer.json, tokenizer_config.json, ...) into its folder"
        )


def check_model_tokenizers(*models: str) -> None:
    """``check_tokenizer`` for each model (a folder or Hub id), before any weight loads."""
    from transformers import AutoTokenizer

    from ..core.sources import model_folder

    for model in models:
        check_tokenizer(AutoTokenizer.from_pretrained(model_folder(model, weights=False)))


def file_tokens(tokenizer, path: Path) -> list[int]:
    """The token ids of a text file (no special tokens; undecodable bytes replaced)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    return tokenizer(text, add_special_tokens=False)["input_ids"]
