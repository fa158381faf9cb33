"""`geofed bench` lives in a distribution of its own (benchmarks/, geofed-bench), outside geofed's wheel.
The core CLI finds it through the `geofed.commands` entry point; without it, one line says what to
install and the exit code is 2 (bad input), not a traceback."""

from __future__ import annotations

import importlib.metadata

import pytest
from geofed.orchestrator import cli


def _entry_points_returning(found):
    return lambda **kw: found if kw == {"group": "geofed.commands", "name": "bench"} else ()


@pytest.mark.parametrize("argv", [["bench"], ["bench", "-h"], ["bench", "wan", "--quick"]])
def test_without_the_bench_it_says_what_to_install_and_exits_2(argv, monkeypatch, capsys):
    monkeypatch.setattr(importlib.metadata, "entry_points", _entry_points_returning(()))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install -e ./benchmarks" in err, err


def test_metadata_without_its_code_reads_as_not_installed(monkeypatch, capsys):
    gone = importlib.metadata.EntryPoint(name="bench", value="geofed.bench.gone_module:main", group="geofed.commands")
    monkeypatch.setattr(importlib.metadata, "entry_points", _entry_points_returning((gone,)))
    assert cli.main(["bench", "-h"]) == 2
    assert "pip install -e ./benchmarks" in capsys.readouterr().err


def test_the_installed_entry_point_is_the_bench_cli():
    found = importlib.metadata.entry_points(group="geofed.commands", name="bench")
    from geofed.bench.cli import main

    assert [ep.load() for ep in found] == [main]


def test_help_lists_bench(capsys):
    assert cli.main(["--help"]) == 0
    assert "bench" in capsys.readouterr().out
