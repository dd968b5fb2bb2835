"""The package: importing it needs neither sglang nor triton, and its layers import downward
only (core <- models <- fitting <- demo, cli; kernels on core; sglang on core, kernels and
models (its CPU engine runs the models' forwards); the registry, the Hub client, on core,
models and fitting; bench on all of them), with no import cycle, lazy imports inside
functions included."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "sgl_kvmap"
# what each layer may import besides itself
LAYERS = {
    "sgl_kvmap._version": set(),
    "sgl_kvmap.core": {"sgl_kvmap._version"},
    "sgl_kvmap.models": {"sgl_kvmap.core"},
    "sgl_kvmap.fitting": {"sgl_kvmap.core", "sgl_kvmap.models"},
    "sgl_kvmap.kernels": {"sgl_kvmap.core"},
    "sgl_kvmap.sglang": {"sgl_kvmap.core", "sgl_kvmap.kernels", "sgl_kvmap.models"},
    "sgl_kvmap.registry": {"sgl_kvmap.core", "sgl_kvmap.models", "sgl_kvmap.fitting"},
    "sgl_kvmap.bench": {
        "sgl_kvmap.core",
        "sgl_kvmap.models",
        "sgl_kvmap.fitting",
        "sgl_kvmap.kernels",
        "sgl_kvmap.sglang",
        "sgl_kvmap.registry",
    },
}


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports anywhere in its file (a package's __init__
    counts when a name comes from it)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found |= {
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            }
    return {m for m in found if m in known and m != name and not name.startswith(m + ".")}


def layer(name: str) -> str | None:
    return next((top for top in LAYERS if name == top or name.startswith(top + ".")), None)


def test_importing_the_package_imports_neither_sglang_nor_triton():
    probe = "import sys, sgl_kvmap; print(sorted({m.split('.')[0] for m in sys.modules}))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr
    assert "sglang" not in loaded.stdout and "triton" not in loaded.stdout


def test_layers_import_downward_only_and_nothing_imports_in_a_cycle():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    upward = [
        f"{name} -> {dep}"
        for name, deps in graph.items()
        for dep in deps
        if layer(name) and layer(dep) != layer(name) and layer(dep) not in LAYERS[layer(name)]
    ]
    assert not upward
    done, active = set(), []

    def visit(name):  # depth-first; a module met again on the active path closes a cycle
        if name in active:
            pytest.fail("import cycle: " + " -> ".join(active[active.index(name) :] + [name]))
        if name not in done:
            active.append(name)
            for dep in sorted(graph[name]):
                visit(dep)
            active.pop()
            done.add(name)

    for name in sorted(graph):
        visit(name)


def test_only_what_sglang_loads_and_the_harness_import_sglang():
    """sglang is imported by what SGLang loads: the storage backend (sglang/storage.py), the
    plugin of its TokenizerManager (sglang/plugin.py) and what decides priming for both engines
    (sglang/priming.py); and by the in-process harness that drives SGLang's scheduler calls
    (sglang/engine.py)."""
    importers = set()
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            if any(n == "sglang" or n.startswith("sglang.") for n in names):
                importers.add(name)
    assert {name for name in importers if "cpu_engine" not in name} == {
        "sgl_kvmap.sglang.storage",
        "sgl_kvmap.sglang.engine",
        "sgl_kvmap.sglang.priming",
        "sgl_kvmap.sglang.plugin",
    }
