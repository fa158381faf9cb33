"""Where Runner was imported from before the round loop moved to run.py: the benches still import
it from here (they are moving to benchmarks/); new code imports orchestrator/driver/run.py."""

from .run import Runner, RunFailed, prepare_task

__all__ = ["Runner", "RunFailed", "prepare_task"]
