"""The wheel installs what the repository has: pyproject.toml's package list is written by hand
(the code folders install under the ``geofed`` namespace), so a new subfolder must not pass the
editable install and go missing from a wheel. CI also installs the built wheel outside the repo."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE = ("orchestrator", "regions", "p2p", "compression")


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_folder_holding_python_is_a_listed_package_mapped_to_itself():
    st = _setuptools()
    listed, dirs = set(st["packages"]), st["package-dir"]
    found = set()
    for top in CODE:
        for py in (ROOT / top).rglob("*.py"):
            rel = py.parent.relative_to(ROOT)
            if "__pycache__" not in rel.parts:
                found.add("geofed." + ".".join(rel.parts))
    missing = sorted(found - listed)
    assert not missing, f"folders with .py files missing from pyproject.toml's packages: {missing}"
    for pkg in found:
        assert dirs.get(pkg) == pkg.removeprefix("geofed.").replace(".", "/"), pkg
        assert (ROOT / dirs[pkg] / "__init__.py").is_file(), f"{dirs[pkg]} has no __init__.py"


def test_every_listed_package_exists_and_data_files_are_declared():
    st = _setuptools()
    for pkg in st["packages"]:
        assert (ROOT / st["package-dir"][pkg]).is_dir(), pkg
    data = st["package-data"]
    for pkg, folder in st["package-dir"].items():
        suffixes = {p.suffix for p in (ROOT / folder).iterdir() if p.is_file() and p.suffix not in (".py", ".pyc")}
        for suffix in suffixes - {".md"}:
            assert any(pattern.endswith(suffix) for pattern in data.get(pkg, [])), (
                f"{folder}/*{suffix} would be left out of the wheel: add it to [tool.setuptools.package-data]")


def test_the_bench_is_a_distribution_of_its_own_and_not_in_geofeds_wheel():
    bench = tomllib.loads((ROOT / "benchmarks" / "pyproject.toml").read_text())
    st = bench["tool"]["setuptools"]
    assert not [p for p in _setuptools()["packages"] if "bench" in p]
    found = {"geofed." + ".".join(py.parent.relative_to(ROOT / "benchmarks").parts)
             for py in (ROOT / "benchmarks" / "bench").rglob("*.py") if "__pycache__" not in py.parts}
    assert found == set(st["packages"]) == {"geofed.bench"}
    assert st["package-dir"] == {"geofed.bench": "bench"}
    assert bench["project"]["entry-points"]["geofed.commands"] == {"bench": "geofed.bench.cli:main"}
