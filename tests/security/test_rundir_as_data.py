"""Issue 36, item 5 ("a run directory is data"), findings N5, N8, N9, N11, N13 and N14.

A run directory can be someone else's: `export`, `report`, `watch` and `--resume` read it as
data. They never import the plug-in its config.yaml names (N5), read its YAML with aliases and
deep nesting refused (N8), read every file through the bounded regular-file opener (N9), show its
strings in the terminal as plain text without control characters (N11), never write through a
symbolic link planted in it (N13), and refuse a checkpoint whose tensors do not fit together with
one line and exit 2 (N14).

The run directories here are real: the config written by the run's own writer (write_config),
the checkpoints by Region.state_dict through checkpoint.save_atomic (what a region writes
at the end of a round), with no Ray.
"""

from __future__ import annotations

import copy
import io
import json
import os
import resource
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from hostile_files import call_bounded, child_peak
from rich.console import Console
from safetensors.torch import load_file

from geofed.orchestrator.cli import main
from geofed.orchestrator.config import RunConfig, config_from_mapping, strict
from geofed.orchestrator.driver.rundir import write_record
from geofed.orchestrator.config.strict import ConfigError
from geofed.orchestrator.driver.resume import load_driver_checkpoint, resume_config
from geofed.orchestrator.driver.rundir import write_config
from geofed.orchestrator.watch import watch
from geofed.p2p.memory import InMemoryHub, InMemoryTransport
from geofed.regions import checkpoint
from geofed.regions.region import Region

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
REGIONS = ["us-east-1", "eu-west-1"]
BASE = {"run": {"name": "data", "rounds": 2, "report": False, "checkpoint_every": 1},
        "task": {"kind": "mlp-digits", "hidden": 8},
        "regions": {"names": REGIONS, "num_cpus": 0.5},
        "network": {"emulation": {"mode": "none"}}}


def _cfg(algorithm: str = "diloco", hidden: int = 8) -> RunConfig:
    data = copy.deepcopy(BASE)
    data["task"]["hidden"] = hidden
    data["sync"] = {"algorithm": algorithm}
    if algorithm == "gossip":
        data["compression"] = {"error_feedback": False}  # CHOCO gossip carries what the codec dropped
    return config_from_mapping(data)


def _write_checkpoints(run_dir: Path, cfg: RunConfig, round_: int = 0, regions=REGIONS) -> dict[str, dict]:
    """Each region's real checkpoint of `round_` (Region.state_dict, checkpoint.save_atomic)."""
    hub, states = InMemoryHub(), {}
    for region in regions:
        w = Region(cfg, region, run_dir, transport=InMemoryTransport(region, hub))
        w.start()
        try:
            with torch.no_grad():  # regions differ, as after local steps
                for p in w.model.parameters():
                    p.add_(0.01 * (1 + regions.index(region)))
            states[region] = w.state_dict()
        finally:
            w.close()
        checkpoint.save_atomic(checkpoint.checkpoint_path(run_dir / "checkpoints" / region, round_), states[region])
    return states


def _run_dir(tmp_path: Path, algorithm: str = "diloco") -> tuple[Path, RunConfig, dict[str, dict]]:
    cfg = _cfg(algorithm)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_config(run_dir, cfg)  # config.yaml and config.record.json, as `geofed run` writes them
    return run_dir, cfg, _write_checkpoints(run_dir, cfg)


def _plugin_module(folder: Path, marker: Path, *, marked: bool = True) -> str:
    """A plug-in module whose import leaves `marker` behind (a fresh name: nothing cached)."""
    name = f"plug_{uuid.uuid4().hex[:12]}"
    body = [f"from pathlib import Path\nPath({str(marker)!r}).touch()\n"]
    if marked:
        body.append("from geofed.regions.tasks import task_factory\n"
                    "@task_factory\ndef make(**options):\n    raise RuntimeError('never called here')\n")
    (folder / f"{name}.py").write_text("".join(body))
    return name


def _name_plugin(run_dir: Path, module: str, folder: Path) -> None:
    """Rewrite the run's config.yaml (and its record, as the run itself would have) to name the
    plug-in `module` as its task, the way someone handing over the run directory could."""
    data = yaml.safe_load((run_dir / "config.yaml").read_text())
    data["task"] = {"kind": f"python:{module}:make", "path": str(folder), "options": {}}
    text = yaml.safe_dump(data, sort_keys=False).encode()
    checkpoint.write_bytes_atomic(run_dir / "config.yaml", text)
    write_record(run_dir, strict.build(RunConfig, copy.deepcopy(data)), text)


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("geofed: ") and err.count("\n") == 1, err
    return err


# -- N5: nothing a run directory names is imported --------------------------------------------------

def test_export_never_imports_the_plugin_a_run_dir_names_and_writes_named_tensors(tmp_path, capsys):
    """Before: export imported the module config.yaml named (its top-level code ran: the marker
    was written) before the mark was checked; the model came from the plug-in's model class."""
    run_dir, cfg, states = _run_dir(tmp_path)
    marker = tmp_path / "imported"
    module = _plugin_module(tmp_path, marker)
    _name_plugin(run_dir, module, tmp_path)
    assert main(["export", str(run_dir)]) == 0, capsys.readouterr().err
    assert not marker.exists() and module not in sys.modules
    out = run_dir / "export" / "model-round0.safetensors"
    assert capsys.readouterr().out.strip() == str(out)
    exported = load_file(str(out))
    # DiLoCo's result is the global model under the model's own tensor names (first region alive).
    names = list(states["us-east-1"]["model"])
    assert sorted(exported) == sorted(names)  # safetensors lists its tensors by name
    for name, glob in zip(names, states["us-east-1"]["algorithm"]["global"]):
        assert torch.equal(exported[name], glob)
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["task"]["kind"] == f"python:{module}:make" and meta["regions_averaged"] == ["us-east-1"]


def test_report_and_watch_never_import_the_plugin_a_run_dir_names(tmp_path, capsys):
    run_dir, _, _ = _run_dir(tmp_path)
    (run_dir / "rounds.jsonl").write_text(json.dumps({"round": 0, "t_start": 0.0, "t_end": 1.0, "H": 5}) + "\n")
    marker = tmp_path / "imported"
    module = _plugin_module(tmp_path, marker)
    _name_plugin(run_dir, module, tmp_path)
    assert main(["report", str(run_dir)]) == 0, capsys.readouterr().err
    assert main(["watch", str(run_dir), "--once"]) == 0
    assert not marker.exists() and module not in sys.modules


def test_resume_refuses_a_plugin_the_user_did_not_name(tmp_path, capsys):
    """Before: `geofed run --resume RUN_DIR` imported the plug-in config.yaml named (the marker was
    written) on its way to checking the config against the record."""
    run_dir, _, _ = _run_dir(tmp_path)
    marker = tmp_path / "imported"
    module = _plugin_module(tmp_path, marker)
    _name_plugin(run_dir, module, tmp_path)
    assert main(["run", "--resume", str(run_dir)]) == 2
    err = _one_line_error(capsys)
    assert f"python:{module}:make" in err and "--trust-run-dir" in err and str(run_dir / "config.yaml") in err
    assert not marker.exists() and module not in sys.modules

    # The user's own config naming another plug-in is refused as well, before either is imported.
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({**copy.deepcopy(BASE), "task": {"kind": "python:someone_else:make"}}))
    with pytest.raises(ConfigError, match=f"python:{module}:make.*python:someone_else:make"):
        resume_config(run_dir, [], config=str(other))
    assert not marker.exists() and module not in sys.modules


def test_resume_takes_a_plugin_the_user_names_or_trusts(tmp_path):
    run_dir, _, _ = _run_dir(tmp_path)
    marker = tmp_path / "imported"
    module = _plugin_module(tmp_path, marker)
    _name_plugin(run_dir, module, tmp_path)
    mine = tmp_path / "mine.yaml"
    mine.write_text((run_dir / "config.yaml").read_text())
    cfg, _ = resume_config(run_dir, [], config=str(mine))
    assert cfg.task.kind == f"python:{module}:make" and marker.exists()  # the user's choice: imported
    marker.unlink()
    cfg, _ = resume_config(run_dir, [], trust_run_dir=True)
    assert cfg.task.kind == f"python:{module}:make"


def test_trust_run_dir_is_only_for_resume(capsys):
    assert main(["run", "--trust-run-dir"]) == 2
    assert "--trust-run-dir: only with --resume RUN_DIR" in _one_line_error(capsys)


# -- N8: strict YAML, bounded ----------------------------------------------------------------------

def _bomb() -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    lines.append("regions: {names: *a9}")
    return "\n".join(lines) + "\n"


def _child_rlimit():
    cap = 2 << 30
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def test_report_refuses_a_yaml_alias_bomb_at_once(tmp_path):
    """Before: `geofed report` read config.yaml with yaml.safe_load; the issue measured a 1 KB
    bomb past 120 s at 2.2 GB. Here the child (2 GiB address space) ran past its 60 s."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "rounds.jsonl").write_text(json.dumps({"round": 0, "t_start": 0.0, "t_end": 1.0}) + "\n")
    (run_dir / "config.yaml").write_text(_bomb())
    assert len(_bomb()) < 1200
    geofed = os.path.join(os.path.dirname(sys.executable), "geofed")
    proc = subprocess.run([geofed, "report", str(run_dir)], capture_output=True, text=True, timeout=60,
                          preexec_fn=_child_rlimit)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "config.yaml" in proc.stderr and "aliases" in proc.stderr, proc.stderr


@pytest.mark.parametrize("command", ["report", "export", "watch"])
def test_deeply_nested_config_yaml_is_one_line_not_a_recursion_error(tmp_path, capsys, command):
    """Before: report raised RecursionError (a traceback); watch too."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "rounds.jsonl").write_text(json.dumps({"round": 0, "t_start": 0.0, "t_end": 1.0}) + "\n")
    (run_dir / "config.yaml").write_text("run: " + "[" * 20000 + "]" * 20000 + "\n")
    argv = [command, str(run_dir)] + (["--once"] if command == "watch" else [])
    assert main(argv) == 2
    err = _one_line_error(capsys)
    assert str(run_dir / "config.yaml") in err and "nested deeper than" in err


def test_no_plain_yaml_load_left_in_orchestrator_or_regions():
    """Every YAML the control plane reads goes through the strict, bounded loader."""
    found = []
    for folder in ("orchestrator", "regions"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            for call in ("yaml.safe_load(", "yaml.load(", "yaml.full_load(", "yaml.unsafe_load("):
                if call in text:
                    found.append(f"{path.relative_to(ROOT)}: {call}")
    assert found == []


# -- N9: files read bounded, regular files only -----------------------------------------------------

def _ckpt(run_dir: Path, region: str = "us-east-1", round_: int = 0) -> Path:
    return checkpoint.checkpoint_path(run_dir / "checkpoints" / region, round_)


def test_export_refuses_a_fifo_checkpoint_without_hanging(tmp_path, capsys):
    """Before: export blocked in open() on the FIFO (released by the test after 10 s)."""
    run_dir, _, _ = _run_dir(tmp_path)
    fifo = _ckpt(run_dir)
    fifo.unlink()
    os.mkfifo(fifo)
    rc = {}
    assert call_bounded(lambda: rc.setdefault("rc", main(["export", str(run_dir)])), fifo) is None
    assert rc["rc"] == 2
    err = _one_line_error(capsys)
    assert str(fifo) in err and "FIFO" in err


def test_export_refuses_a_checkpoint_linked_to_dev_zero(tmp_path):
    """Before: the whole of /dev/zero was read: MemoryError (in a child capped at 2 GiB)."""
    run_dir, _, _ = _run_dir(tmp_path)
    _ckpt(run_dir).unlink()
    _ckpt(run_dir).symlink_to("/dev/zero")
    code = ("import contextlib, io\nfrom geofed.orchestrator.cli import main\nerr = io.StringIO()\n"
            f"with contextlib.redirect_stderr(err):\n    result['rc'] = main(['export', {str(run_dir)!r}])\n"
            "result['err'] = err.getvalue()\n")
    result = child_peak(code, cwd=tmp_path, memory_cap=2 << 30)
    assert result.get("rc") == 2, result
    assert "character device" in result["err"] and result["err"].count("\n") == 1, result
    assert result["grew_mb"] < 200, result


def test_export_refuses_a_checkpoint_larger_than_half_the_memory_before_reading_it(tmp_path):
    """A sparse file costs no disk. Before: the cap was a flat 64 GiB, so a file past this host's
    memory was read: MemoryError, a traceback (in a child capped at 2 GiB)."""
    run_dir, _, _ = _run_dir(tmp_path)
    with open(_ckpt(run_dir), "r+b") as f:
        f.truncate(checkpoint.checkpoint_cap() + 1)
    code = ("import contextlib, io\nfrom geofed.orchestrator.cli import main\nerr = io.StringIO()\n"
            f"with contextlib.redirect_stderr(err):\n    result['rc'] = main(['export', {str(run_dir)!r}])\n"
            "result['err'] = err.getvalue()\n")
    result = child_peak(code, cwd=tmp_path, memory_cap=2 << 30)
    assert result.get("rc") == 2, result
    assert f"the limit is {checkpoint.checkpoint_cap()}" in result["err"] and result["err"].count("\n") == 1, result
    assert result["grew_mb"] < 200, result


def test_resume_skips_a_fifo_checkpoint_and_refuses_a_fifo_log(tmp_path):
    """Before: load_driver_checkpoint blocked on the FIFO checkpoint, then on rounds.jsonl."""
    run_dir, _, states = _run_dir(tmp_path)
    driver = run_dir / "checkpoints" / "driver"
    checkpoint.save_atomic(checkpoint.checkpoint_path(driver, 0), {"round": 0, "clock": 1.0})
    fifo = checkpoint.checkpoint_path(driver, 1)
    os.mkfifo(fifo)
    found = {}
    assert call_bounded(lambda: found.setdefault("ckpt", load_driver_checkpoint(run_dir)), fifo) is None
    assert found["ckpt"].round == 0 and "FIFO" in found["ckpt"].skipped[0]
    rounds = run_dir / "rounds.jsonl"
    rounds.unlink()  # the resume above rewrote it, cut back to round 0
    os.mkfifo(rounds)
    error = call_bounded(lambda: load_driver_checkpoint(run_dir), rounds)
    assert isinstance(error, ConfigError) and str(rounds) in str(error) and "FIFO" in str(error)


# -- N11: watch shows run-directory strings as text ------------------------------------------------

ROUND = {"round": 0, "t_start": 0.0, "t_end": 1.5, "H": 5, "mean_train_loss": 0.5, "bytes_sent": 10,
         "codecs": {"a->b": "int8"}, "links": {"a->b": {"bandwidth_mbps": 5.0, "rtt_ms": 3.0}}, "alive": ["a", "b"]}
ESC = "\x1b]0;pwned\x07\x1b[2J"


def _hostile(kind: str) -> tuple[list, list, object]:
    """(rounds records, events records, summary) of one hostile run directory."""
    r = dict(ROUND)
    events: list = [{"event": "setup_done"}]
    summary = None
    if kind == "markup-close":
        r["codecs"] = {"a->b": "[/]"}
    elif kind == "markup-link":
        r["links"] = {"[/bold][link=file:///etc/passwd]x": {"bandwidth_mbps": 1.0}}
    elif kind == "escape-sequences":
        r["alive"] = [f"a{ESC}"]
        events.append({"event": f"x{ESC}", "round": ESC})
    elif kind == "wrong-types":
        r.update(round="seven", t_end="late", H={"x": 1}, codecs=["int8"], links={"a->b": 5}, alive=7)
    elif kind == "eval-not-a-mapping":
        r["eval_avg"] = 5
    elif kind == "records-not-objects":
        return [7, [1, 2], r], [None, "setup_done"], None
    elif kind == "summary-interrupted-wrong":
        summary = {"interrupted": "yes", "eval": [1]}
    elif kind == "summary-not-an-object":
        summary = [1, 2, 3]
    elif kind == "huge-numbers":
        r.update(round=10 ** 400, t_end=1e308, bytes_sent="x")
    return [r], events, summary


@pytest.mark.parametrize("kind", ["markup-close", "markup-link", "escape-sequences", "wrong-types", "eval-not-a-mapping",
                                  "records-not-objects", "summary-interrupted-wrong", "summary-not-an-object",
                                  "huge-numbers"])
def test_watch_shows_hostile_run_dirs_as_plain_text(tmp_path, kind):
    """Before: `[/]` raised MarkupError, ESC and OSC reached the terminal, wrong types raised
    TypeError/AttributeError/KeyError (a traceback from `geofed watch`)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rounds, events, summary = _hostile(kind)
    (run_dir / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"run": {"rounds": 3}}))
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))
    buf = io.StringIO()
    console = Console(file=buf, width=200, force_terminal=True, color_system=None)
    try:
        rc = watch(run_dir, once=True, console=console)
    except ConfigError as exc:  # a file that cannot be shown at all: one line
        assert "\n" not in str(exc)
        rc = 2
    assert rc in (0, 2)
    out = buf.getvalue()
    assert "\x1b" not in out and "\x07" not in out, repr(out)
    if kind == "markup-close":
        assert "[/]" in out
    if kind == "markup-link":
        assert "[/bold][link=file:///etc/passwd]x" in out


def test_watch_refuses_a_fifo_log_with_one_line(tmp_path, capsys):
    """Before: `geofed watch` blocked on rounds.jsonl, a FIFO."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    fifo = run_dir / "rounds.jsonl"
    os.mkfifo(fifo)
    rc = {}
    assert call_bounded(lambda: rc.setdefault("rc", main(["watch", str(run_dir), "--once"])), fifo) is None
    assert rc["rc"] == 2
    assert "FIFO" in _one_line_error(capsys)


# -- N13: no writes through symbolic links ---------------------------------------------------------

def test_export_never_writes_through_a_link_in_the_run_dir(tmp_path, capsys):
    """Before: RUN_DIR/export linked elsewhere received the model and its description."""
    run_dir, _, _ = _run_dir(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run_dir / "export").symlink_to(elsewhere)
    assert main(["export", str(run_dir)]) == 2
    assert "symbolic link" in _one_line_error(capsys)
    assert list(elsewhere.iterdir()) == []


def test_report_never_writes_through_a_link_in_the_run_dir(tmp_path, capsys):
    """Before: a planted RUN_DIR/report/loss.png -> victim was overwritten with the PNG, and a
    RUN_DIR/report linked elsewhere received the whole report."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    recs = [{"round": i, "region": r, "t_start": float(i), "t_end": i + 1.0, "train_loss": 1.0 / (i + 1), "H": 5,
             "bytes_sent": 100} for i in range(3) for r in REGIONS]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in recs))
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (run_dir / "report").mkdir()
    (run_dir / "report" / "loss.png").symlink_to(victim)
    assert main(["report", str(run_dir)]) == 0, capsys.readouterr().err
    assert victim.read_text() == "precious"
    assert not (run_dir / "report" / "loss.png").is_symlink()  # the link was replaced, not followed

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for p in (run_dir / "report").iterdir():
        p.unlink()
    (run_dir / "report").rmdir()
    (run_dir / "report").symlink_to(elsewhere)
    capsys.readouterr()
    assert main(["report", str(run_dir)]) == 2
    assert "symbolic link" in _one_line_error(capsys)
    assert list(elsewhere.iterdir()) == []


# -- N14: checkpoints that do not fit together ------------------------------------------------------

def test_export_of_mismatched_checkpoints_is_one_line_and_exit_2(tmp_path, capsys):
    """Before: torch.stack raised RuntimeError (a traceback) averaging a hidden-8 region's model
    with a hidden-16 one's; a missing key was a KeyError."""
    cfg = _cfg("gossip")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_config(run_dir, cfg)
    _write_checkpoints(run_dir, cfg, regions=["us-east-1"])
    _write_checkpoints(run_dir, _cfg("gossip", hidden=16), regions=["eu-west-1"])
    assert main(["export", str(run_dir)]) == 2
    err = _one_line_error(capsys)
    assert "eu-west-1" in err and "shape" in err

    state = checkpoint.load_verified(_ckpt(run_dir, "eu-west-1"))
    state["model"] = dict(list(state["model"].items())[:1])
    checkpoint.save_atomic(_ckpt(run_dir, "eu-west-1"), state)
    assert main(["export", str(run_dir)]) == 2
    err = _one_line_error(capsys)
    assert "eu-west-1" in err and "missing" in err


def test_export_of_a_global_model_that_does_not_fit_the_model_is_exit_2(tmp_path, capsys):
    run_dir, _, states = _run_dir(tmp_path)
    state = states["us-east-1"]
    state["algorithm"]["global"] = state["algorithm"]["global"][:1] + [torch.zeros(3)]
    checkpoint.save_atomic(_ckpt(run_dir), state)
    assert main(["export", str(run_dir)]) == 2
    err = _one_line_error(capsys)
    assert str(_ckpt(run_dir)) in err and "global" in err


# -- export's names without a model class -----------------------------------------------------------

def _global_state(model: torch.nn.Module) -> dict:
    """A checkpoint-like state of `model`: its state_dict, and a global model (parameters() order)
    that differs from it, as DiLoCo's does after an outer step."""
    return {"model": model.state_dict(), "algorithm": {"global": [p.detach() + 1 for p in model.parameters()]}}


def test_named_result_puts_the_global_model_under_the_parameters_names():
    from geofed.regions.export import named_result, trainable_names

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    state = _global_state(model)
    out = named_result(state)
    assert list(out) == list(model.state_dict())
    for name, g in zip(trainable_names(model), state["algorithm"]["global"]):
        assert torch.equal(out[name], g)


def test_named_result_names_a_tied_weight_under_both_names():
    from geofed.regions.export import named_result

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(5, 3)
            self.mid = torch.nn.Linear(3, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight

    model = Tied()
    buf = io.BytesIO()
    torch.save(_global_state(model), buf)  # what a checkpoint holds: torch.save keeps the sharing
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    out = named_result(state)
    glob = state["algorithm"]["global"]  # emb.weight, mid.weight, mid.bias: parameters() skips the tie
    assert torch.equal(out["emb.weight"], glob[0]) and torch.equal(out["head.weight"], glob[0])
    assert torch.equal(out["mid.weight"], glob[1]) and torch.equal(out["mid.bias"], glob[2])


def test_named_result_refuses_to_guess_between_buffers_and_parameters():
    """BatchNorm's running statistics have its parameters' shape: only the model class can tell
    them apart, so the names come from the caller (export: a built-in task's model) or nowhere."""
    from geofed.regions.export import named_result, trainable_names

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 4))
    state = _global_state(model)
    with pytest.raises(ValueError, match="more than one way"):
        named_result(state)
    out = named_result(state, trainable_names(model))
    assert torch.equal(out["1.weight"], state["algorithm"]["global"][2])
    assert torch.equal(out["1.running_mean"], model.state_dict()["1.running_mean"])


@pytest.mark.parametrize("command", ["report", "watch"])
@pytest.mark.parametrize("name", ["rounds.jsonl", "summary.json"])
def test_deeply_nested_json_in_a_run_dir_is_one_line_not_a_recursion_error(tmp_path, capsys, command, name):
    """Before: json.loads raised RecursionError on 100000 nested brackets (a traceback from report
    and watch); a torn line is a ValueError, this was not."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"round": 0, "region": "a", "t_end": 1.0, "train_loss": 1.0}) + "\n")
    deep = "[" * 100000 + "]" * 100000
    (run_dir / name).write_text(deep + ("\n" if name.endswith(".jsonl") else ""))
    argv = [command, str(run_dir)] + (["--once"] if command == "watch" else [])
    rc = main(argv)
    err = capsys.readouterr().err
    if rc == 2:  # refused: one line naming the file
        assert err.startswith("geofed: ") and err.count("\n") == 1 and name in err, err
    else:  # a live view skips a damaged log line
        assert rc == 0 and command == "watch" and name == "rounds.jsonl", err


def test_resume_reads_a_deeply_nested_log_line_as_damage(tmp_path):
    from geofed.orchestrator.driver.rundir import read_json_file, read_jsonl

    path = tmp_path / "rounds.jsonl"
    path.write_text(json.dumps({"round": 0}) + "\n" + "[" * 100000 + "]" * 100000 + "\n")
    assert read_jsonl(path) == [{"round": 0}]  # as a torn line: the records before it stand
    path = tmp_path / "driver.json"
    path.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(ConfigError, match="driver.json: not JSON"):
        read_json_file(path)


METRIC = {"round": 0, "region": "a", "t_start": 0.0, "t_end": 1.0, "train_loss": 1.0, "H": 5, "bytes_sent": 10}


@pytest.mark.parametrize("name, record, key", [
    ("metrics.jsonl", dict(METRIC, codecs=["int8"]), "codecs"),
    ("metrics.jsonl", dict(METRIC, eval="0.9"), "eval"),
    ("metrics.jsonl", dict(METRIC, transfers={"peer": "b"}), "transfers"),
    ("summary.json", {"utilization_per_region": ["a"]}, "utilization_per_region"),
    ("summary.json", {"links": [1]}, "links"),
    ("summary.json", {"refusals": {"by_reason": ["late"]}}, "refusals.by_reason"),
])
def test_report_names_a_container_of_the_wrong_type(tmp_path, capsys, name, record, key):
    """Before: a list where the report walks a mapping (or a string where it reads one) was an
    AttributeError traceback from `geofed report`; a mapping where it walks a list was read as
    its keys (exit 0)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps(METRIC) + "\n")
    (run_dir / name).write_text(json.dumps(record) + ("\n" if name.endswith(".jsonl") else ""))
    assert main(["report", str(run_dir)]) == 2
    err = _one_line_error(capsys)
    assert name in err and f"{key}: expected" in err, err


def test_a_resumed_run_directorys_tls_folder_is_read_bounded(tmp_path):
    """N9 for tls/: a resumed run loads its regions' TLS material from the run directory, and read
    each file whole: a 64 MiB file linked at tls/ca.pem was read into memory (any size would be).
    Now at most 1 MiB is read, and a FIFO there is refused as not a regular file (it was reported
    as "TLS file missing")."""
    from geofed.p2p.tls import load_tls, make_pki

    tls = tmp_path / "tls"
    make_pki(tls, ["a", "b"])
    (tls / "ca.pem").unlink()
    os.mkfifo(tls / "ca.pem")
    error = call_bounded(lambda: load_tls(tls, "a"), tls / "ca.pem", timeout_s=5.0)
    assert isinstance(error, ValueError) and "ca.pem" in str(error) and "regular file" in str(error)
    big = tmp_path / "big.pem"
    with open(big, "wb") as f:
        f.truncate(64 << 20)  # sparse: 64 MiB of zeros the old read took whole
    (tls / "ca.pem").unlink()
    (tls / "ca.pem").symlink_to(big)
    with pytest.raises(ValueError, match="over .* bytes"):
        load_tls(tls, "a")


def test_renewing_certificates_never_writes_through_a_planted_symlink(tmp_path):
    """N13 for tls/: renewing an expiring certificate on --resume wrote tls/<region>.pem through a
    symbolic link planted there, overwriting the file it pointed at."""
    from geofed.p2p.tls import make_pki, renew_expiring

    tls = tmp_path / "tls"
    make_pki(tls, ["a"], valid_days=1)  # expires within the 7-day renewal window: renewed on resume
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tls / "a.key").unlink()
    (tls / "a.key").symlink_to(victim)
    with pytest.raises(OSError):
        renew_expiring(tls, ["a"])
    assert victim.read_text() == "keep me"
