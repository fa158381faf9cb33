"""Issue 15, finding 13: `run.out_dir` followed a symbolic link out of the working directory,
and names accepted a newline. Now a config may only name a real folder inside the working
directory (no component a link), the run directory itself is never reached through a link (also
with --out), control characters are refused; each with the key named, exit 2."""

from __future__ import annotations

import json

import pytest
import yaml
from geofed.orchestrator import cli
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.rundir import new_run_dir
from geofed.orchestrator.config.strict import ConfigError

BASE = {"run": {"name": "names", "rounds": 1, "report": False},
        "task": {"kind": "mlp-digits", "hidden": 8},
        "regions": {"names": ["us-east-1", "eu-west-1"]},
        "network": {"emulation": {"mode": "none"}},
        # Unreachable: a run the check failed to stop would end here at once (exit 1), not train.
        "ray": {"address": "127.0.0.1:9", "init_timeout_s": 1}}


def _cfg(**run):
    data = json.loads(json.dumps(BASE))
    data["run"].update(run)
    return config_from_mapping(data)


@pytest.fixture
def work(tmp_path, monkeypatch):
    (tmp_path / "work").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    return tmp_path


@pytest.mark.parametrize("out_dir", ["runs", "runs/nested", "a/runs"])
def test_out_dir_through_a_symlink_is_refused(work, out_dir):
    link = work / "work" / ("a" if out_dir.startswith("a/") else "runs")
    link.symlink_to(work / "elsewhere")
    with pytest.raises(ConfigError) as err:
        new_run_dir(_cfg(out_dir=out_dir), None)
    assert str(err.value).startswith("run.out_dir: ") and "symbolic link" in str(err.value)
    assert list((work / "elsewhere").iterdir()) == []  # nothing written where the link points


def test_through_the_cli_exit_2_and_nothing_written(work, capsys):
    (work / "work" / "runs").symlink_to(work / "elsewhere")
    (work / "work" / "run.yaml").write_text(yaml.safe_dump(BASE))
    assert cli.main(["run", "run.yaml", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("geofed: run.out_dir: runs is a symbolic link") and len(err.strip().splitlines()) == 1
    assert list((work / "elsewhere").iterdir()) == []


def test_out_pointing_at_a_symlink_is_refused(work):
    (work / "work" / "run").symlink_to(work / "elsewhere")
    with pytest.raises(ConfigError, match=r"^--out: run is a symbolic link"):
        new_run_dir(_cfg(), "run")
    assert list((work / "elsewhere").iterdir()) == []


@pytest.mark.parametrize("key,value", [("out_dir", "runs\nx"), ("out_dir", "runs\x1b[2J"), ("name", "x\n"),
                                       ("name", "run\r")])
def test_control_characters_in_names_are_refused(work, key, value):
    with pytest.raises(ConfigError) as err:
        _cfg(**{key: value})
    assert f": run.{key}: " in str(err.value)  # out_dir: "control character"; name: its pattern
    assert list((work / "work").iterdir()) == []


def test_a_region_name_with_a_newline_is_refused():
    with pytest.raises(ConfigError, match="regions.names"):
        config_from_mapping({**BASE, "regions": {"names": ["us-east-1\n", "eu-west-1"]}})


@pytest.mark.parametrize("out", ["run\nx", "run\x00x", "a\x1bb"])
def test_control_characters_in_out_are_refused(work, out):
    with pytest.raises(ConfigError, match=r"^--out: .*control character"):
        new_run_dir(_cfg(), out)
    assert list((work / "work").iterdir()) == []


def test_a_real_folder_inside_the_working_directory_still_works(work):
    (work / "work" / "runs").mkdir()
    path = new_run_dir(_cfg(out_dir="runs/deeper"), None)
    assert path.parent.resolve() == (work / "work" / "runs" / "deeper").resolve() and path.is_dir()
