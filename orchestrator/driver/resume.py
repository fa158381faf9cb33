"""`geofed run --resume RUN_DIR`: what a resumed run takes up from its run directory.

The newest driver checkpoint that verifies (a torn or corrupt one is reported and the previous
used), the logs cut back to that round (rounds logged after it are redone: at most one with
checkpoint_every 1), the processes a killed driver left behind ended, and the WAN emulator's
schedule minus the part already played. The regions' own state is restored by the Runner.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from geofed.regions import checkpoint
from geofed.regions.tasks.configs import PluginTaskConfig

from ..config import RunConfig, config_from_mapping
from .leftovers import reap_previous
from .recovery import RunFailed, schedule_after
from .rundir import check_resume, ensure_private_dir, read_json_file, read_jsonl, truncate_jsonl
from ..config.strict import ConfigError, build
from ..config.yamlconfig import apply_override, parse_yaml, parse_yaml_file, read_config_bytes


class DriverCheckpoint(NamedTuple):
    """The driver checkpoint a resume starts from, with what verification skipped and the rounds that run again."""

    round: int
    state: dict[str, Any]
    skipped: list[str]  # newer driver checkpoints that failed verification, why
    lost: list[int]  # rounds logged after `round`: they run again


def resume_config(run_dir: Path, overrides, allow: Sequence[str] = (), *, config: str | None = None,
                  trust_run_dir: bool = False) -> tuple[RunConfig, Path]:
    """The run's config: config.yaml, which must match the run's record of it, with the --set
    overrides, of which only keys named in `allow` may change it (orchestrator/driver/rundir.py).

    A plug-in task config.yaml names (``task.kind: python:...``) is imported only once the user
    vouched for it: `config` (the user's own config) names the same plug-in, or `trust_run_dir`
    (--trust-run-dir). A run directory handed over is data until then."""
    path = Path(run_dir) / "config.yaml"
    if not path.exists() and not path.is_symlink():
        raise ConfigError("", "not a run directory (no config.yaml)", source=str(run_dir))
    text = read_config_bytes(path)  # a regular file of at most 1 MiB: a run directory is anyone's file
    data = parse_yaml(text, source=str(path))
    if not trust_run_dir:
        for task in (_task_unimported(data, (), str(path)), _task_unimported(data, overrides, str(path))):
            _check_plugin_vouched(task, config, source=str(path))
    file_cfg = config_from_mapping(copy.deepcopy(data), source=str(path))
    cfg = config_from_mapping(data, overrides, source=str(path))
    changes = check_resume(Path(run_dir), text, file_cfg, cfg, allow)
    for key, (old, new) in sorted(changes.items()):
        print(f"geofed: resuming with {key} changed: {old!r} -> {new!r} (--allow-config-change)", file=sys.stderr)
    ensure_private_dir(Path(run_dir))  # a run directory written before the modes were tightened
    return cfg, Path(run_dir)


def finished_run(run_dir: Path, cfg: RunConfig) -> str | None:
    """The line `--resume` prints for a run that already ended, or None while the run has work left.

    Ended: summary.json was written by the run's end (not by a stop signal: ``interrupted`` is
    null), no round was logged after it, and `cfg` (with any change --allow-config-change just
    accepted) still ends the run there: run.rounds reached, run.max_steps spent, run.target
    reached, or privacy.dp.target_epsilon reached. Reads only the run's small files (bounded), so
    the answer comes before Ray, the regions or a checkpoint are touched."""
    run_dir = Path(run_dir)
    summary = read_json_file(run_dir / "summary.json")
    if not isinstance(summary, dict) or summary.get("interrupted") is not None:
        return None
    done = summary.get("rounds")
    if not isinstance(done, int) or isinstance(done, bool):
        return None
    rounds = read_jsonl(run_dir / "rounds.jsonl")
    if max((r.get("round", -1) for r in rounds if isinstance(r.get("round"), int)), default=-1) + 1 != done:
        return None  # rounds logged after the summary: a later resume that was killed before its end
    steps = sum(r.get("H") or 0 for r in rounds if isinstance(r.get("H"), int))
    if done >= cfg.run.rounds:
        why = f"run.rounds={cfg.run.rounds}"
    elif cfg.run.max_steps and steps >= cfg.run.max_steps:
        why = f"run.max_steps={cfg.run.max_steps} spent ({steps} steps)"
    elif cfg.run.target is not None and isinstance(summary.get("target"), dict) and summary["target"].get("reached"):
        why = "run.target reached"
    elif any(e.get("event") == "privacy_budget_reached" for e in read_jsonl(run_dir / "events.jsonl")):
        why = "privacy.dp.target_epsilon reached"
    else:
        return None
    return (f"geofed: run {run_dir.name} finished after {done} of {cfg.run.rounds} rounds (last round {done - 1}, "
            f"{why}); nothing to resume "
            f"(summary.json left as it is). To train further, raise the bound: geofed run --resume {run_dir} "
            "--set run.rounds=N --allow-config-change run.rounds")


def _task_unimported(data: dict, overrides, source: str) -> Any:
    """The task section of `data` with `overrides`, built without looking up a plug-in's factory
    (which imports its module)."""
    data = copy.deepcopy(data)
    try:
        for assignment in overrides:
            apply_override(data, assignment)
        return build(RunConfig, data).task
    except ConfigError as exc:
        raise exc.with_source(source) from None


def _check_plugin_vouched(task: Any, config: str | None, *, source: str) -> None:
    """ConfigError unless `task` is built in, or the user's `config` names the same plug-in (kind and path)."""
    if not isinstance(task, PluginTaskConfig):
        return
    where = f" (path {task.path})" if task.path is not None else ""
    if config is None:
        raise ConfigError("task.kind", f"names the plug-in {task.kind!r}{where}, whose module resuming would import "
                          "(its top-level code runs); a run directory is data until you vouch for its code: pass "
                          "your own config naming the same plug-in (geofed run CONFIG --resume RUN_DIR), or "
                          "--trust-run-dir", source=source)
    mine = _task_unimported(parse_yaml_file(config), (), config)
    if not isinstance(mine, PluginTaskConfig) or (mine.kind, mine.path) != (task.kind, task.path):
        theirs = mine.kind + (f" (path {mine.path})" if getattr(mine, "path", None) is not None else "")
        raise ConfigError("task.kind", f"names the plug-in {task.kind!r}{where}, but {config} names {theirs!r}; "
                          "resuming imports only a plug-in your own config names (or pass --trust-run-dir)",
                          source=source)


def load_driver_checkpoint(run_dir: Path) -> DriverCheckpoint:
    """The newest good driver checkpoint; metrics.jsonl and rounds.jsonl are cut back to it."""
    skipped: list[str] = []
    found = checkpoint.load_latest(Path(run_dir) / "checkpoints" / "driver",
                                   on_skip=lambda path, why: skipped.append(why))
    for why in skipped:
        print(f"geofed: {why}; using the previous checkpoint", file=sys.stderr)
    if found is None:
        raise RunFailed(f"{run_dir}: no usable driver checkpoint to resume from"
                        + (f" ({'; '.join(skipped)})" if skipped else ""))
    r, state = found
    lost = sorted({rec["round"] for rec in read_jsonl(Path(run_dir) / "rounds.jsonl") if rec.get("round", -1) > r})
    for name in ("metrics.jsonl", "rounds.jsonl"):
        truncate_jsonl(Path(run_dir) / name, lambda rec: rec.get("round", -1) <= r)
    return DriverCheckpoint(r, state, skipped, lost)


def emulation_for_resume(cfg: RunConfig, ckpt: DriverCheckpoint | None) -> RunConfig:
    """A resumed run's emulator starts afresh: it must not replay outages already over."""
    em = cfg.network.emulation
    if ckpt is None or not em.schedule:
        return cfg
    em = dataclasses.replace(em, schedule=schedule_after(em.schedule, next_round=ckpt.round + 1,
                                                          elapsed_s=ckpt.state["clock"]))
    return dataclasses.replace(cfg, network=dataclasses.replace(cfg.network, emulation=em))


def reap_previous_driver(run_dir: Path, *, keep: set[int] | frozenset[int] = frozenset()) -> list[dict]:
    """End what a killed driver of this run directory left running (and say so on stderr); RunFailed
    if that driver is still alive. `keep`: pids never ended (region actors a resume re-attaches to).
    """
    try:
        reaped = reap_previous(run_dir, keep=keep)
    except RuntimeError as exc:  # two drivers on one run directory would interleave its files
        raise RunFailed(f"{exc}; stop it first") from None
    if reaped:
        print(f"geofed: ended {len(reaped)} processes the previous driver of {run_dir} left running: "
              f"{', '.join(sorted({p['name'] for p in reaped}))}", file=sys.stderr)
    return reaped


def train_fn_name(train_fn: Callable[..., Any] | None) -> str | None:
    """`module:qualname` of the loop API's function (what the run records), None for a task's run."""
    if train_fn is None:
        return None
    module = getattr(train_fn, "__module__", None) or "?"
    return f"{module}:{getattr(train_fn, '__qualname__', type(train_fn).__name__)}"


def recorded_train_fn(run_dir: Path) -> str | None:
    """The loop API's function a run was started with (its first `started` event), None for a task's run."""
    started = next((e for e in read_jsonl(Path(run_dir) / "events.jsonl") if e.get("event") == "started"), None)
    name = (started or {}).get("train_fn")
    return name if isinstance(name, str) else None


def check_resume_mode(run_dir: Path, train_fn: str | None) -> None:
    """ConfigError when a resume would swap who takes the inner steps: a loop-API run (its `started`
    event names the user's function, orchestrator/trainer.py) resumed without one (`geofed run
    --resume`), or a task's run resumed with one; its checkpoints hold the other's state. A
    function of another name is taken (the script may have renamed it) and said on stderr."""
    started = next((e for e in read_jsonl(Path(run_dir) / "events.jsonl") if e.get("event") == "started"), None)
    if started is None:
        return  # killed before its set-up ended: no checkpoint either, nothing to mismatch
    recorded = recorded_train_fn(run_dir)
    if recorded is None and train_fn is not None:
        raise ConfigError("", f"this run trains its task with the built-in stepper; resume it with geofed run "
                          f"--resume {run_dir} (not with a training function, {train_fn})", source=str(run_dir))
    if recorded is not None and train_fn is None:
        raise ConfigError("", f"this run trains with the function {recorded}: run the script that started it "
                          f"again, with Trainer({recorded.rpartition(':')[2]}, resume={str(run_dir)!r}).fit() "
                          "(the run directory holds no code)", source=str(run_dir))
    if recorded != train_fn:
        print(f"geofed: resuming with the training function {train_fn}; the run started with {recorded}",
              file=sys.stderr)
