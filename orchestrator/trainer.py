"""Trainer: one geofed run, its inner steps taken by the user's own training loop (issue 38) or
by a task's built-in stepper (`geofed run`). Both are the same run: the driver's set-up and round
loop (orchestrator/driver/run.py), the same Region in every region; only who takes the inner
steps differs (regions/loop.py: LoopStepper, or the Region itself).

    def train_region(ctx):                       # runs in every region, on a thread of its own
        model, opt = build(ctx.device)
        sync = ctx.sync(model, opt, state={"data": loader})
        for batch in loader:
            ...; opt.step(); opt.zero_grad()
            sync.step(loss=loss.item())
            if sync.should_stop:
                break
        ctx.report(eval=evaluate(model))

    Trainer(train_region, config="configs/my-run.yaml").fit()   # -> the run's summary

Over Ray (the default) `train_region` is pickled into each region actor's creation arguments
(cloudpickle: a function of the script run as __main__ travels by value, one of an importable
module by name, which the actors must then import). `in_process=True` runs the regions as threads
of this process over the in-memory transport instead (no Ray, no sockets; tests, quick tries).

Resume: a function is code, not data, so the run directory does not hold it. The script that
started the run runs again with `Trainer(train_region, resume=RUN_DIR).fit()`; the regions restore
their checkpoint, the user's objects registered with `ctx.sync(..., state=...)` included, before
the loop takes its first batch. The run records the function's name (`module:qualname`, the
`started` event of events.jsonl): a loop-API run resumed without a function (`geofed run
--resume`), or a task's run resumed with one, is refused; another name is said on stderr.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .config import RunConfig, config_from_mapping, default_config_path, load_mapping, to_mapping
from .config.strict import ConfigError
from .driver.resume import train_fn_name

__all__ = ["Trainer", "check_train_fn"]


def check_train_fn(train_fn: Any) -> None:
    """TypeError unless `train_fn` is None or can be called as `train_fn(ctx)`: found here, in the
    caller's process, not in every region actor once Ray is up."""
    if train_fn is None:
        return
    if not callable(train_fn):
        raise TypeError(f"Trainer: train_fn must be a function taking the region's context, train_fn(ctx); "
                        f"got {type(train_fn).__name__} {train_fn!r}")
    try:
        sig = inspect.signature(train_fn)
    except (TypeError, ValueError):
        return  # a builtin or C callable without a signature: its call says what is wrong
    try:
        sig.bind(object())
    except TypeError as exc:
        raise TypeError(f"Trainer: train_fn {train_fn_name(train_fn)}{sig} must take exactly one argument, the "
                        f"region's context (def train_region(ctx): ...): {exc}") from None


class Trainer:
    """One run of geofed. `train_fn(ctx)` is the user's training loop (regions/loop.py: RegionContext,
    Sync), run in every region; None runs the config's task with the built-in stepper (what
    `geofed run` does).

    `config`: a YAML path, a RunConfig, or None (the default config); `overrides`: `KEY.PATH=VALUE`
    strings as `geofed run --set` takes them; `out`: the run directory (default
    run.out_dir/NAME-STAMP); `resume`: a run directory to continue (its config.yaml; `config`, when
    a path, only vouches for a plug-in task as `geofed run CONFIG --resume` does). `in_process`: the
    regions as threads of this process (no Ray, no checkpoints, no resume). `report`: write
    report.html when run.report is on. `show_summary`: print the end-of-run table (default: as
    `show_progress`). `address`, `allow_config_change`, `trust_run_dir` and `verbose` are
    `geofed run`'s options of the same names.

    fit() returns the run's summary (summary.json) and sets `run_dir`; a failed run raises RunFailed
    or PlacementError, a bad config ConfigError (naming the file and the dotted key), a stop signal
    Interrupted (a checkpoint stands: resume it).
    """

    def __init__(self, train_fn: Callable[[Any], None] | None, config: str | Path | RunConfig | None = None, *,
                 overrides: Sequence[str] = (), out: str | Path | None = None, resume: str | Path | None = None,
                 show_progress: bool = True, in_process: bool = False, report: bool = True,
                 show_summary: bool | None = None, address: str | None = None,
                 allow_config_change: Sequence[str] = (), trust_run_dir: bool = False, verbose: bool = False):
        check_train_fn(train_fn)
        if isinstance(overrides, str) or not all(isinstance(o, str) for o in overrides):
            raise TypeError(f"Trainer: overrides must be a sequence of 'KEY.PATH=VALUE' strings, got {overrides!r}")
        if config is not None and not isinstance(config, (str, Path, RunConfig)):
            raise TypeError(f"Trainer: config must be a YAML path, a RunConfig or None, got {type(config).__name__}")
        if allow_config_change and resume is None:
            raise ConfigError("", "only with resume=RUN_DIR (a new run takes any config)", source="allow_config_change")
        if in_process and resume is not None:
            raise ValueError("Trainer: in_process runs keep no checkpoints, so they cannot resume; drop in_process")
        self.train_fn = train_fn
        self.config, self.overrides = config, tuple(overrides)
        self.out = None if out is None else str(out)
        self.resume = None if resume is None else Path(resume)
        self.show_progress, self.in_process, self.report = show_progress, in_process, report
        self.show_summary = show_progress if show_summary is None else show_summary
        self.address, self.allow_config_change = address, tuple(allow_config_change)
        self.trust_run_dir, self.verbose = trust_run_dir, verbose
        self.run_dir: Path | None = None

    @property
    def source(self) -> str:
        """Where the config came from, as errors name it."""
        if self.resume is not None:
            return str(self.resume)
        if isinstance(self.config, RunConfig):
            return "<RunConfig>"
        return "default config" if self.config is None else str(self.config)

    def fit(self) -> dict[str, Any]:
        """Run (or resume) to the end; returns the summary. See the class's doc for what it raises."""
        from .driver.resume import finished_run
        from .driver.rundir import read_json_file, release_run_dir

        cfg = self._load()
        if self.resume is not None:
            run_dir = self.run_dir = self.resume
            if (line := finished_run(run_dir, cfg)) is not None:  # before Ray: nothing would run
                print(line)
                release_run_dir(run_dir)
                return read_json_file(run_dir / "summary.json")
        cfg = self._check(cfg)
        if self.resume is None:
            from .driver.rundir import new_run_dir

            self.run_dir = new_run_dir(cfg, self.out)  # only once the config and its data are known to be good
        assert self.run_dir is not None
        summary = self._run(cfg, self.run_dir)
        if self.show_summary:
            from .driver.progress import print_summary

            print_summary(summary, str(self.run_dir))
        if cfg.run.report and self.report:
            from .report import write_report

            print(f"report: {write_report(self.run_dir)}")
        if self.show_summary:
            print(f"run directory: {self.run_dir}")
        from .driver.progress import end_line

        if (line := end_line(summary)) is not None:  # last, where a user looks first: a region lost for good
            print(f"geofed: {line}")
        return summary

    # -- before the run --------------------------------------------------------------------------
    def _load(self) -> RunConfig:
        """The config: a new run's from `config` and `overrides`, a resume's from RUN_DIR (checked
        against its record; the run directory is locked at once)."""
        if self.resume is not None:
            from .driver.resume import check_resume_mode, resume_config
            from .driver.rundir import lock_run_dir

            vouch = None if self.config is None or isinstance(self.config, RunConfig) else str(self.config)
            cfg, run_dir = resume_config(self.resume, self.overrides, self.allow_config_change, config=vouch,
                                         trust_run_dir=self.trust_run_dir)
            lock_run_dir(run_dir, key="--resume")  # at once: a run still going there is named before any work
            check_resume_mode(run_dir, train_fn_name(self.train_fn))
            return cfg
        if isinstance(self.config, RunConfig):
            if not self.overrides:
                return self.config
            return config_from_mapping(to_mapping(self.config), self.overrides, source="<RunConfig>")
        path = Path(self.config) if self.config is not None else default_config_path()
        data = load_mapping(path, self.overrides)
        if self.train_fn is not None and "task" not in data:
            # The config's task is required, but a training function brings its own model and data
            # and its regions never build a task: a placeholder the run never trains (the summary
            # names the function instead).
            data["task"] = {"kind": "mlp-digits"}
        return config_from_mapping(data, source=str(path))

    def _check(self, cfg: RunConfig) -> RunConfig:
        """What `geofed run` checks before Ray starts: the address, the device, the task's data
        (a task's run), the trackers, and what the loop API cannot do."""
        import dataclasses

        from .config.devicecheck import local_device_problem
        from .driver.trackers import check_trackers

        if self.address:
            cfg = dataclasses.replace(cfg, ray=dataclasses.replace(cfg.ray, address=self.address))
        if (problem := local_device_problem(cfg)) is not None:
            raise ConfigError("", problem, source=self.source)
        if len(cfg.regions.names) == 1:
            print(f"geofed: warning: one region ({cfg.regions.names[0]}): nothing is exchanged, no link is measured; "
                  "list two or more in regions.names to train across regions", file=sys.stderr)
        self._refuse(cfg)
        if self.train_fn is None:
            from .driver.run import prepare_task  # the task's data: a bad path fails before Ray starts

            cfg = prepare_task(cfg, source=self.source)
        check_trackers(cfg, source=self.source)
        return cfg

    def _refuse(self, cfg: RunConfig) -> None:
        """ConfigError naming the key of what this Trainer cannot run (regions/loop.py refuses what
        a loop-mode Region cannot do; these are the driver's)."""
        from geofed.regions.algorithm_traits import algorithm_traits

        looping = self.train_fn is not None
        if looping and cfg.ray.warm_pool_s > 0 and not self.in_process:
            raise ConfigError("ray.warm_pool_s", "must be 0 with a training function (Trainer(train_fn)): a pooled "
                              "actor is handed the next run's config, not its function", source=self.source)
        if looping and algorithm_traits(cfg.sync.algorithm).mixes_models:
            raise ConfigError("sync.algorithm", f"{cfg.sync.algorithm} with a training function: its regions' "
                              "average model is evaluated at the driver with the task's model, which a training "
                              "function replaces; use diloco", source=self.source)
        if self.in_process and cfg.privacy.dp.mode != "off":
            raise ConfigError("privacy.dp.mode", "in_process runs have no privacy budget (the driver's); run over "
                              "Ray (in_process=False)", source=self.source)
        if self.in_process and cfg.sync.pacing.mode == "quorum":
            raise ConfigError("sync.pacing.mode", "quorum rounds need the driver's pacing over Ray; in_process runs "
                              "barrier or time-budget rounds", source=self.source)

    # -- the run -----------------------------------------------------------------------------------
    def _run(self, cfg: RunConfig, run_dir: Path) -> dict[str, Any]:
        if self.in_process:
            from .driver.inprocess import run_in_process

            return run_in_process(cfg, run_dir, self.train_fn, show_progress=self.show_progress)
        from .driver.recovery import Interrupted
        from .driver.run import Runner

        runner = Runner(cfg, run_dir, show_progress=self.show_progress, resume=self.resume is not None,
                        verbose=self.verbose, train_fn=self.train_fn)
        try:
            return runner.run()
        except Interrupted as stop:
            print(f"geofed: {stop}; checkpoint of round {stop.round} in {run_dir}; continue with: "
                  f"{self.resume_hint(run_dir)}", file=sys.stderr)
            raise
        except KeyboardInterrupt:
            print(f"geofed: stopped at once; the last checkpoint in {run_dir} stands; continue with: "
                  f"{self.resume_hint(run_dir)}", file=sys.stderr)
            raise
        finally:
            runner.shutdown()

    def resume_hint(self, run_dir: Path) -> str:
        """How to continue this run: `geofed run --resume` for a task's run, the script's own
        Trainer for a loop-API run (the function travels with the script, not the run directory)."""
        if self.train_fn is None:
            return f"geofed run --resume {run_dir}"
        name = (train_fn_name(self.train_fn) or "").rpartition(":")[2]
        return f"Trainer({name}, resume={str(run_dir)!r}).fit() (run your script again)"
