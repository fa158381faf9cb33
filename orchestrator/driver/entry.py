"""`geofed run` from the command line: load or resume the config, check it, run it, print the
summary and write the report (the round loop itself is orchestrator/driver/run.py)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from ..config import RunConfig, load_config
from ..config.devicecheck import local_device_problem
from ..config.strict import ConfigError
from .progress import print_summary
from .recovery import Interrupted, RunFailed
from .resume import finished_run, resume_config
from .rundir import lock_run_dir, new_run_dir, release_run_dir
from .trackers import check_trackers


def run_from_args(args) -> int:
    """`geofed run`: load or resume the config, run it, print the summary and write the report; returns
    the exit code (143/130 after a clean stop on SIGTERM/SIGINT, 130 after an immediate one, 1 on a failed run).
    """
    if args.resume:
        cfg, run_dir = resume_config(Path(args.resume), args.overrides, getattr(args, "allow_config_change", None) or (),
                                     config=args.config, trust_run_dir=bool(getattr(args, "trust_run_dir", False)))
        lock_run_dir(run_dir, key="--resume")  # at once: a run still going there is named before any work
        if (line := finished_run(run_dir, cfg)) is not None:  # before Ray: nothing would run, summary.json stays
            print(line)
            release_run_dir(run_dir)
            return 0
    else:
        cfg = load_config(args.config, args.overrides)
        run_dir = None
    cfg = _with_address(cfg, args.address)
    if (problem := local_device_problem(cfg)) is not None:
        raise ConfigError("", problem, source=args.resume or args.config or "default config")
    if len(cfg.regions.names) == 1:
        print(f"geofed: warning: one region ({cfg.regions.names[0]}): nothing is exchanged, no link is measured; "
              "list two or more in regions.names to train across regions", file=sys.stderr)
    # Ray and the regions: imported only once there is a run to drive (a finished run's resume never waits on them)
    from .cluster import PlacementError
    from .run import Runner, prepare_task

    cfg = prepare_task(cfg, source=args.resume or args.config or "default config")
    check_trackers(cfg, source=str(args.resume or args.config or "default config"))
    if run_dir is None:  # only once the config and its data are known to be good
        run_dir = new_run_dir(cfg, args.out)
    runner = Runner(cfg, run_dir, show_progress=not args.quiet, resume=bool(args.resume),
                    verbose=bool(getattr(args, "verbose", False)))
    try:
        summary = runner.run()
    except Interrupted as stop:
        print(f"geofed: {stop}; checkpoint of round {stop.round} in {run_dir}; "
              f"continue with: geofed run --resume {run_dir}", file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:
        print(f"geofed: stopped at once; the last checkpoint in {run_dir} stands; "
              f"continue with: geofed run --resume {run_dir}", file=sys.stderr)
        return 130
    except (PlacementError, RunFailed) as exc:
        print(f"geofed: {exc}", file=sys.stderr)
        return 1
    finally:
        runner.shutdown()
    print_summary(summary, str(run_dir))
    if cfg.run.report and not args.no_report:
        from ..report import write_report

        print(f"report: {write_report(run_dir)}")
    print(f"run directory: {run_dir}")
    return 0


def _with_address(cfg: RunConfig, address: str | None) -> RunConfig:
    if not address:
        return cfg
    return dataclasses.replace(cfg, ray=dataclasses.replace(cfg.ray, address=address))
