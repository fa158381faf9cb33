"""`geofed run` from the command line: a Trainer (orchestrator/trainer.py) with the task's
built-in stepper, its exceptions turned into exit codes (the round loop itself is
orchestrator/driver/run.py)."""

from __future__ import annotations

import sys

from .recovery import Interrupted, RunFailed


def run_from_args(args) -> int:
    """`geofed run`: a Trainer with the task's built-in stepper (orchestrator/trainer.py) run to its
    end; returns the exit code (143/130 after a clean stop on SIGTERM/SIGINT, 130 after an immediate
    one, 1 on a failed run). The Trainer prints the summary, the report's path and, on a stop, how
    to continue."""
    from ..trainer import Trainer

    trainer = Trainer(None, args.config, overrides=args.overrides, out=args.out, resume=args.resume,
                      show_progress=not args.quiet, show_summary=True, report=not args.no_report,
                      address=args.address, allow_config_change=getattr(args, "allow_config_change", None) or (),
                      trust_run_dir=bool(getattr(args, "trust_run_dir", False)),
                      verbose=bool(getattr(args, "verbose", False)))
    try:
        trainer.fit()
    except Interrupted as stop:
        return stop.exit_code
    except KeyboardInterrupt:
        return 130
    except (RunFailed, _placement_error()) as exc:  # evaluated only when one is raised: Ray is loaded by then
        print(f"geofed: {exc}", file=sys.stderr)
        return 1
    return 0


def _placement_error() -> type[Exception]:
    # Ray and the regions are imported only once there is a run to drive (a finished run's resume never waits on them)
    from .cluster import PlacementError

    return PlacementError
