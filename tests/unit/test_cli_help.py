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
