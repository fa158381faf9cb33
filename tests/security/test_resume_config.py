"""Issue 15, finding 11: a config.yaml edited in the run directory before --resume was applied
silently (`security.tls: false` resumed in plaintext; a changed `task.hidden` failed with a
560-character RuntimeError naming neither key nor file). Now the run records its config when it
starts and --resume refuses any change, by dotted key, exit 2, unless the key is named with
--allow-config-change and may change mid-run; TLS never turns off on resume."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from geofed.orchestrator import cli
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.resume import resume_config
from geofed.orchestrator.driver.rundir import new_run_dir
from geofed.orchestrator.config.strict import ConfigError

RECORD_FILE = "config.record.json"
BASE = {"run": {"name": "rec", "rounds": 4, "report": False},
        "task": {"kind": "mlp-digits", "hidden": 32},
        "regions": {"names": ["us-east-1", "eu-west-1"]},
        "network": {"emulation": {"mode": "none"}},
        # Unreachable on purpose: were a refused resume to go ahead anyway, it would fail at
        # once (exit 1) instead of starting Ray (the refusal is exit 2).
        "ray": {"address": "127.0.0.1:9", "init_timeout_s": 1}}


@pytest.fixture
def run_dir(tmp_path):
    return new_run_dir(config_from_mapping(json.loads(json.dumps(BASE))), str(tmp_path / "run"))


def _edit(run_dir, section, key, value):
    path = run_dir / "config.yaml"
    data = yaml.safe_load(path.read_text())
    data[section][key] = value
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def test_tls_turned_off_in_config_yaml_is_refused_naming_the_key_and_file(run_dir):
    _edit(run_dir, "security", "tls", False)
    with pytest.raises(ConfigError) as err:
        resume_config(run_dir, [])
    text = str(err.value)
    assert str(run_dir / "config.yaml") in text and RECORD_FILE in text
    assert "security.tls: true -> false (config.yaml; never changes on resume)" in text
    # Naming it does not help: TLS cannot be turned off on resume.
    with pytest.raises(ConfigError, match="security.tls: never changes on resume"):
        resume_config(run_dir, [], ["security.tls"])


def test_a_changed_model_is_refused_by_key_before_any_checkpoint_is_read(run_dir):
    _edit(run_dir, "task", "hidden", 64)
    with pytest.raises(ConfigError) as err:
        resume_config(run_dir, [])
    assert "task.hidden: 32 -> 64 (config.yaml)" in str(err.value)
    with pytest.raises(ConfigError, match="task.hidden: is not a key a resume may change"):
        resume_config(run_dir, [], ["task.hidden"])


def test_set_overrides_on_resume_go_through_the_same_check(run_dir):
    with pytest.raises(ConfigError) as err:
        resume_config(run_dir, ["run.rounds=9", "security.tls=false"])
    text = str(err.value)
    assert "run.rounds: 4 -> 9 (--set)" in text and "security.tls: true -> false (--set; never" in text
    with pytest.raises(ConfigError, match="--allow-config-change run.rounds"):
        resume_config(run_dir, ["run.rounds=9"])
    # Named and safe: accepted, and config.yaml and the record now say so (a later resume
    # without --set keeps 9 rounds instead of silently going back to 4).
    cfg, _ = resume_config(run_dir, ["run.rounds=9"], ["run.rounds"])
    assert cfg.run.rounds == 9
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["run"]["rounds"] == 9
    record = json.loads((run_dir / RECORD_FILE).read_text())
    assert record["changes"][-1]["keys"] == {"run.rounds": [4, 9]}
    cfg, _ = resume_config(run_dir, [])
    assert cfg.run.rounds == 9


def test_an_unchanged_or_only_reformatted_config_resumes(run_dir):
    cfg, _ = resume_config(run_dir, [])
    assert cfg.run.rounds == 4 and cfg.security.tls
    text = (run_dir / "config.yaml").read_text()
    (run_dir / "config.yaml").write_text("# a comment\n" + text)  # the hash differs, no key does
    cfg, _ = resume_config(run_dir, ["run.rounds=4"])
    assert cfg.run.rounds == 4


def test_a_run_directory_without_its_record_is_refused(run_dir):
    (run_dir / RECORD_FILE).unlink()
    with pytest.raises(ConfigError, match="config.record.json is missing"):
        resume_config(run_dir, [])


def test_the_help_lists_exactly_the_keys_that_may_change():
    from geofed.orchestrator.driver.rundir import SAFE_ON_RESUME

    assert tuple(SAFE_ON_RESUME) == cli.RESUMABLE_KEYS
    help_text = cli._parser()._subparsers._group_actions[0].choices["run"].format_help()
    assert "--allow-config-change" in help_text and "never security" in help_text


def test_allow_config_change_needs_resume(tmp_path, capsys):
    assert cli.main(["run", "--allow-config-change", "run.rounds"]) == 2
    assert "--allow-config-change: only with --resume" in capsys.readouterr().err


def test_geofed_run_resume_exits_2_with_the_diff_and_starts_nothing(run_dir):
    _edit(run_dir, "security", "tls", False)
    _edit(run_dir, "task", "hidden", 64)
    proc = subprocess.run([sys.executable, "-c", "from geofed.orchestrator.cli import entry; entry()",
                           "run", "--resume", str(run_dir), "--quiet"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()  # one line, naming the file and every changed key
    assert line.startswith(f"geofed: {run_dir / 'config.yaml'}: differs from the run's record")
    assert ("security.tls: true -> false (config.yaml; never changes on resume); "
            "task.hidden: 32 -> 64 (config.yaml)") in line
    assert "Traceback" not in proc.stderr
    assert not (run_dir / "events.jsonl").exists() and not (run_dir / "tls").exists()


def test_a_named_section_allows_the_keys_inside_it(run_dir):
    cfg, _ = resume_config(run_dir, ["run.target.metric=accuracy", "run.target.value=0.9"], ["run.target"])
    assert cfg.run.target.value == 0.9
    cfg, _ = resume_config(run_dir, ["run.target.value=0.95"], ["run.target"])
    assert cfg.run.target.value == 0.95
    with pytest.raises(ConfigError, match=r"run.target.value: 0.95 -> 0.97 \(--set\)"):
        resume_config(run_dir, ["run.target.value=0.97"])
