"""Issue 40, item 6: secure aggregation's modules (the regions/secagg/ subpackage; p2p holds none
since issue 40, items 4-5) hold only what the product runs. Every one of them is imported (transitively, lazy imports included) from the CLI entry point
`geofed.orchestrator.cli`, and every name defined at the top of one is used by a module the CLI
reaches, or by a live name of its own module. Tests do not count: a name only tests use would be
code in users' installs that nothing runs (DESIGN.md: code only tests use lives under tests/).

Before the deletion this failed with: p2p/secagg_session.py not reached from the CLI, and
p2p/secagg.py's RoundContext, RoundSecrets, ShareHolder, verify_advert, recover_secret,
mask_update, unmask_sum, default_threshold, _commitment, _check_share, _public (the superseded
per-round protocol) and p2p/secagg_wire.py's encode/decode_bundle, encode/decode_reveal, _share,
_SHARE_LEN used by nothing the CLI reaches.

Read from the source with ast, the way tests/unit/test_layering.py reads imports. A name another
module mentions counts as used by it (coarse: ShareBundle, KINDS and the BUNDLE/REVEAL type
numbers were only found dead once their users above were gone)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ("orchestrator", "regions", "p2p", "compression")
ENTRY = "geofed.orchestrator.cli"
PACKAGE = "geofed.regions.secagg"
CHECKED = ("", ".codecs", ".keys", ".masks", ".relay", ".round", ".wire")


def _modules() -> dict[str, Path]:
    out = {}
    for room in ROOMS:
        for path in (ROOT / room).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = ["geofed", *rel.parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _package(module: str) -> list[str]:
    is_pkg = MODULES[module].name == "__init__.py"
    return module.split(".") if is_pkg else module.split(".")[:-1]


@functools.cache
def _imported(module: str) -> set[str]:
    """The geofed modules `module` imports anywhere in its body (`from pkg import mod` counts mod),
    and those it names in a string (importlib: `geofed bench`'s table, the codec registry's list)."""
    out = set()
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value, ".".join([*_package(module), node.value])]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            pkg = _package(module)
            base = ".".join(pkg[: len(pkg) - (node.level - 1)] + ([node.module] if node.module else [])) \
                if node.level else node.module or ""
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            # `import geofed.p2p.x` also imports its packages.
            parts = name.split(".")
            out.update(".".join(parts[:i]) for i in range(2, len(parts) + 1) if ".".join(parts[:i]) in MODULES)
    return out


def _reached() -> set[str]:
    seen, todo = set(), [ENTRY]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += sorted(_imported(m) - seen)
    return seen


def _mentions(node: ast.AST) -> set[str]:
    """Every identifier a node mentions: names, attributes and the names of `from x import name`."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.ImportFrom):
            out.update(a.name for a in n.names)
    return out


def _defined(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [stmt.name]
    if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        return [e.id for t in targets for e in ast.walk(t) if isinstance(e, ast.Name)]
    return []


def _unused(module: str, reached: set[str]) -> list[str]:
    """Top-level names of `module` that nothing reached uses: a name is live when a reached module
    that imports this one mentions it, or when a live name's body or a top-level statement that
    defines nothing here mentions it."""
    body = TREES[module].body
    defs = {name: stmt for stmt in body for name in _defined(stmt)}
    live = set()
    for other in reached - {module}:
        if module in _imported(other):
            live |= _mentions(TREES[other]) & set(defs)
    for stmt in body:
        if not _defined(stmt):
            live |= _mentions(stmt) & set(defs)
    todo = list(live)
    while todo:
        for name in _mentions(defs[todo.pop()]) & set(defs):
            if name not in live:
                live.add(name)
                todo.append(name)
    return sorted(set(defs) - live - {"__all__"})


def test_every_secure_aggregation_module_is_reached_from_the_cli_and_none_is_left_in_p2p():
    reached = _reached()
    in_p2p = {m for m in MODULES if m.startswith("geofed.p2p.") and
              m.rsplit(".", 1)[1].startswith(("secagg", "secmask", "shamir"))}
    assert in_p2p == set()  # p2p carries secure aggregation's stream, not its protocol
    on_disk = {m for m in MODULES if m == PACKAGE or m.startswith(PACKAGE + ".")}
    assert on_disk == {PACKAGE + m for m in CHECKED}  # the list above still names every file
    assert sorted(on_disk - reached) == []


def test_every_name_in_secure_aggregations_modules_is_used_by_the_product():
    reached = _reached()
    unused = {m: _unused(PACKAGE + m, reached) for m in CHECKED}
    assert {m: names for m, names in unused.items() if names} == {}
