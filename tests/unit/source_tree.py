"""The core rooms' source, read with ast, for the tests that hold the rooms' rules (test_layering,
test_boundaries): every module with the package its relative imports resolve against, and every
import statement with what it names (lazy ones inside functions and ones under TYPE_CHECKING too)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ["orchestrator", "regions", "p2p", "compression"]  # the installed rooms, in import order


def modules() -> dict[str, tuple[Path, list[str]]]:
    """module name -> (file, the package its relative imports resolve against), of the core rooms."""
    out = {}
    for room in ROOMS:
        for path in sorted((ROOT / room).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            parts = ["geofed", *path.relative_to(ROOT).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
                package = parts
            else:
                package = parts[:-1]
            out[".".join(parts)] = (path, package)
    return out


def named_imports(tree: ast.AST, package: list[str]) -> list[tuple[int, str, str | None]]:
    """(line, absolute module, imported name or None) of every import, relative ones resolved."""
    out: list[tuple[int, str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out += [(node.lineno, module, a.name) for a in node.names]
    return out
