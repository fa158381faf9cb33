"""Imports flow one way: bench -> orchestrator -> regions -> p2p -> compression (docs/architecture.md).
The bench (benchmarks/bench, distribution geofed-bench) is not in geofed's wheel: no core room may import it.

Read from the source with ast (every import statement, including ones inside functions), so a
lazy import that goes the wrong way is caught too."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import networkx as nx
import pytest
from source_tree import modules, named_imports

ROOT = Path(__file__).resolve().parents[2]
ORDER = ["bench", "orchestrator", "regions", "p2p", "compression"]  # each may import only those after it
FOLDERS = {"bench": "benchmarks/bench", "orchestrator": "orchestrator", "regions": "regions", "p2p": "p2p",
           "compression": "compression"}
CORE = ORDER[1:]  # geofed's wheel
DOC_OWNERS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
THIRD_PARTY_OK_IN_COMPRESSION = {"torch", "numpy"}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative ones resolved."""
    rel = path.relative_to(ROOT).with_suffix("")
    room = next(r for r, folder in FOLDERS.items() if rel.is_relative_to(folder))
    package = ["geofed", room, *rel.relative_to(FOLDERS[room]).parts][:-1]  # an __init__'s is its own folder
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((node.lineno, name))
    return out


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "geofed" and parts[1] in ORDER else None


@pytest.mark.parametrize("room", ORDER)
def test_no_room_imports_a_room_above_it(room):
    allowed = set(ORDER[ORDER.index(room):])
    bad = []
    for path in sorted((ROOT / FOLDERS[room]).rglob("*.py")):
        if "_pb2" in path.name:
            continue
        for line, module in _imports(path):
            target = _room(module)
            if target is not None and target not in allowed:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, "\n".join(bad)


def test_no_core_room_names_the_bench():
    # An import by name (importlib, an entry point's target) escapes the import check above; the CLI
    # reaches the bench only through the `geofed.commands` entry point the bench registers.
    bad = []
    for room in CORE:
        for path in sorted((ROOT / FOLDERS[room]).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, DOC_OWNERS) and ast.get_docstring(n)}
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} names {node.value!r}" for node in ast.walk(tree)
                    if isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and "geofed.bench" in node.value and id(node) not in docs]
    assert not bad, "\n".join(bad)


def test_compression_needs_only_torch_and_numpy():
    stdlib = set(sys.stdlib_module_names)
    bad = []
    for path in sorted((ROOT / "compression").rglob("*.py")):
        for line, module in _imports(path):
            top = module.split(".")[0]
            if top in stdlib or top in THIRD_PARTY_OK_IN_COMPRESSION or _room(module) == "compression":
                continue
            bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_core_room_importing_the_bench(monkeypatch):
    fake = ROOT / "orchestrator" / "_layering_probe.py"
    monkeypatch.setattr(Path, "rglob", lambda self, pat: iter([fake]) if self == ROOT / "orchestrator" else iter([]))
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: "import importlib\nimportlib.import_module('geofed.bench.wan')\n")
    with pytest.raises(AssertionError, match="names 'geofed.bench.wan'"):
        test_no_core_room_names_the_bench()
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: "from geofed.bench import cli\n")
    with pytest.raises(AssertionError, match="imports geofed.bench"):
        test_no_room_imports_a_room_above_it("orchestrator")


def test_the_check_sees_a_wrong_way_import(tmp_path, monkeypatch):
    # A check that passes everything proves nothing: an upward import in a p2p file is found.
    fake = ROOT / "p2p" / "_layering_probe.py"
    monkeypatch.setattr(Path, "rglob", lambda self, pat: iter([fake]) if self == ROOT / "p2p" else iter([]))
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: "from ..regions import messages\n")
    with pytest.raises(AssertionError, match="imports geofed.regions"):
        test_no_room_imports_a_room_above_it("p2p")


def import_cycles(modules) -> list[list[str]]:
    graph = nx.DiGraph()
    for name, (path, package) in modules.items():
        room = name.split(".")[1]
        for _, module, attr in named_imports(ast.parse(path.read_text(), str(path)), package):
            if module.split(".")[1:2] != [room]:
                continue
            target = f"{module}.{attr}" if attr and f"{module}.{attr}" in modules else module
            if target in modules and target != name:
                graph.add_edge(name, target)
    return sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)


def test_no_import_cycle_inside_a_room():
    cycles = import_cycles(modules())
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_sees_a_lazy_and_a_type_checking_import(tmp_path):
    a, b, c = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    a.write_text("def f():\n    from . import b\n")
    b.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n")
    c.write_text("x = 1\n")
    pkg = ["geofed", "p2p"]
    mods = {"geofed.p2p.a": (a, pkg), "geofed.p2p.b": (b, pkg), "geofed.p2p.c": (c, pkg)}
    assert import_cycles(mods) == [["geofed.p2p.a", "geofed.p2p.b"]]
