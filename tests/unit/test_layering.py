"""Imports flow one way: orchestrator -> regions -> p2p -> compression (docs/architecture.md).

Read from the source with ast (every import statement, including ones inside functions), so a
lazy import that goes the wrong way is caught too."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ORDER = ["orchestrator", "regions", "p2p", "compression"]  # each may import only those after it
THIRD_PARTY_OK_IN_COMPRESSION = {"torch", "numpy"}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative ones resolved."""
    rel = path.relative_to(ROOT).with_suffix("")
    package = ["geofed", *rel.parts][:-1]  # a module's package; an __init__'s is its own folder
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
    for path in sorted((ROOT / room).rglob("*.py")):
        if "_pb2" in path.name:
            continue
        for line, module in _imports(path):
            target = _room(module)
            if target is not None and target not in allowed:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
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


def test_the_check_sees_a_wrong_way_import(tmp_path, monkeypatch):
    # A check that passes everything proves nothing: an upward import in a p2p file is found.
    fake = ROOT / "p2p" / "_layering_probe.py"
    monkeypatch.setattr(Path, "rglob", lambda self, pat: iter([fake]) if self == ROOT / "p2p" else iter([]))
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: "from ..regions import worker\n")
    with pytest.raises(AssertionError, match="imports geofed.regions"):
        test_no_room_imports_a_room_above_it("p2p")
