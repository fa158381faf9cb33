"""mypy over the seams ([tool.mypy] `packages` in pyproject.toml) finds zero errors.

The Protocols and annotations of compression/ and orchestrator/policies/ are checked, not just
read: a codec missing a method its callers use, an Optional used as if never None, a policy that
does not return a Decision all fail here, with mypy's own lines in the failure.

The rooms install as `geofed.<room>` through setuptools' package-dir table, and an editable
install is an import hook mypy cannot follow, so the rooms are linked under
.mypy_cache/geofed-src/geofed/ (from that same table) and [tool.mypy] `mypy_path` points there.
Run by hand: `python tests/unit/test_types.py` (same check, mypy's output as is).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"
TREE = ROOT / ".mypy_cache" / "geofed-src"
COLD_LIMIT_S = 300  # a cold run is ~5 s of CPU here; this only stops a hang


def link_rooms(root: Path = ROOT) -> Path:
    """Link each top-level room (`geofed.<room>` in [tool.setuptools.package-dir]) under
    .mypy_cache/geofed-src/geofed/ and return geofed-src. Safe to run concurrently."""
    package_dir = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    tree = root / ".mypy_cache" / "geofed-src"
    (tree / "geofed").mkdir(parents=True, exist_ok=True)
    # mypy ignores its own cache folder for git; created here first, the folder needs saying so.
    ignore = root / ".mypy_cache" / ".gitignore"
    if not ignore.exists():
        ignore.write_text("# Automatically created by mypy\n*\n")
    for name, folder in package_dir.items():
        parts = name.split(".")
        if len(parts) != 2 or parts[0] != "geofed":
            continue  # subpackages come with their room
        link = tree / "geofed" / parts[1]
        target = os.path.relpath(root / folder, link.parent)
        if link.is_symlink() and os.readlink(link) == target:
            continue
        tmp = link.with_name(f".{parts[1]}.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        os.symlink(target, tmp)
        os.replace(tmp, link)  # atomic: another test process never sees the link missing
    return tree


def run_mypy(root: Path = ROOT) -> tuple[subprocess.CompletedProcess[str], Path]:
    """mypy with the repository's [tool.mypy] (its `packages`), from the repository root, and the
    linked tree it read."""
    tree = link_rooms(root)
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(root / "pyproject.toml")],
                          cwd=root, capture_output=True, text=True, timeout=COLD_LIMIT_S,
                          env={**os.environ, "MYPY_FORCE_COLOR": "0"}, check=False), tree


def _readable(output: str, root: Path, tree: Path) -> str:
    """mypy names the linked path; say the file's own path in the repository."""
    out = output
    for link in sorted((tree / "geofed").iterdir()):
        if link.is_symlink():
            rel = link.relative_to(root).as_posix() + "/"
            real = (link.resolve()).relative_to(root).as_posix() + "/"
            out = out.replace(rel, real)
    return out


def test_packages_are_configured() -> None:
    """[tool.mypy] names what it checks; each is a module or package of an installed room."""
    cfg = tomllib.loads(PYPROJECT.read_text())["tool"]["mypy"]
    assert "geofed.compression" in cfg["packages"] and "geofed.orchestrator.policies" in cfg["packages"]
    tree = link_rooms()
    for name in cfg["packages"]:
        path = tree.joinpath(*name.split("."))
        assert path.is_dir() or path.with_suffix(".py").is_file(), f"[tool.mypy] packages: {name} is not in the tree"


def test_mypy_finds_no_errors() -> None:
    """Before the seams' fixes this failed with 21 errors (Optional used as a number in the
    policies, dataclasses.fields on the codec base classes, a Mapping written to, ...) and, with
    disallow_untyped_defs, 48 more functions without annotations."""
    done, tree = run_mypy()
    report = _readable(done.stdout + done.stderr, ROOT, tree)
    # No skip without mypy: CI installs it with the `test` extra, and a skip would pass a CI that lost it.
    if done.returncode != 0:
        pytest.fail(f"mypy (pyproject.toml [tool.mypy]) found errors:\n{report}", pytrace=False)


if __name__ == "__main__":
    done, tree = run_mypy()
    print(_readable(done.stdout + done.stderr, ROOT, tree), end="")
    sys.exit(done.returncode)
