"""Issue 19, trap 2: `geofed bench -h` and `geofed net -h` failed with "unrecognized arguments:
-h". Benches and `net cleanup` are real subcommands: -h lists them, NAME -h shows NAME's options."""

from __future__ import annotations

import pytest
from geofed.orchestrator import cli


@pytest.mark.parametrize("argv, wanted", [
    (["bench", "-h"], ["usage: geofed bench", "codecs", "wan", "soak", "NAME -h"]),
    (["bench", "--help"], ["usage: geofed bench", "dfgl"]),
    (["net", "-h"], ["usage: geofed net", "cleanup", "namespaces"]),
    (["bench", "codecs", "-h"], ["usage: geofed bench codecs"]),
    (["net", "cleanup", "-h"], ["usage: geofed net cleanup", "--prefix"]),
])
def test_help_exits_0_and_describes(argv, wanted, capsys):
    assert cli.main(argv) == 0
    out = capsys.readouterr()
    assert "unrecognized" not in out.err
    for w in wanted:
        assert w in out.out, (w, out.out)


@pytest.mark.parametrize("argv", [["bench"], ["bench", "nope"], ["net"], ["net", "nope"]])
def test_missing_or_unknown_name_exits_2(argv, capsys):
    assert cli.main(argv) == 2
    assert "usage: geofed" in capsys.readouterr().err


def test_one_region_warns(tmp_path, monkeypatch, capsys):
    """Issue 19: one region ran without a word, though nothing is exchanged."""
    import yaml

    # A task data path that does not exist: `geofed run` warns, then refuses the path before Ray
    # starts (orchestrator/trainer.py's checks, in that order), so the run ends at once in this
    # process whether or not a test session's shared Ray is up (a subprocess cost 5-12 s).
    cfg = {"run": {"name": "one", "rounds": 1, "report": False}, "task": {"kind": "char-lm", "path": "missing.txt"},
           "regions": {"names": ["us-east-1"]}, "network": {"emulation": {"mode": "none"}}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["run", "run.yaml", "--quiet"]) == 2
    err = capsys.readouterr().err
    warned = err.index("warning: one region (us-east-1): nothing is exchanged")
    assert warned < err.index("task.path: cannot read"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]  # it ended before any run directory
