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


def test_one_region_warns(tmp_path):
    """Issue 19: one region ran without a word, though nothing is exchanged."""
    import subprocess
    import sys

    import yaml

    cfg = {"run": {"name": "one", "rounds": 1, "report": False}, "task": {"kind": "mlp-digits", "hidden": 8},
           "regions": {"names": ["us-east-1"]}, "network": {"emulation": {"mode": "none"}},
           "ray": {"address": "127.0.0.1:9", "init_timeout_s": 1}}  # unreachable: ends quickly after the warning
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    # A process of its own: in this one a test session's shared Ray may be up, and a Ray that is
    # up refuses another ray.address (docs/launch.md) before the warning would be printed.
    done = subprocess.run([sys.executable, "-m", "geofed.orchestrator.cli", "run", "run.yaml", "--quiet"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "warning: one region (us-east-1): nothing is exchanged" in done.stderr
