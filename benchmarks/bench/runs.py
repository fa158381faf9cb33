"""What the benches share: one local Ray for all of a bench's runs, and one `geofed run` to its end."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def start_local_ray(cfg: Any, *, num_cpus: int | None = None) -> bool:
    """Start a local Ray for every run of a bench (6-10 s here: once, not once per run), unless one
    is up already (then False, and the caller must not shut it down). `num_cpus`: cfg.ray.num_cpus
    unless given; every worker gets OMP_NUM_THREADS = regions.torch_threads."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(num_cpus=cfg.ray.num_cpus if num_cpus is None else num_cpus, include_dashboard=False,
             log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": str(cfg.regions.torch_threads)}})
    return True


@contextmanager
def bench_ray(cfg: Any, *, num_cpus: int | None = None) -> Iterator[None]:
    """start_local_ray around a block; after it, shut down the Ray it started (never one it found)."""
    started = start_local_ray(cfg, num_cpus=num_cpus)
    try:
        yield
    finally:
        if started:
            import ray

            ray.shutdown()


def run_to_end(cfg: Any, parent: Path | str, *, source: str | None = None) -> tuple[Path, dict[str, Any]]:
    """One `geofed run` of `cfg` (no progress bar, no report) in a new run directory under `parent`;
    returns (run directory, summary). With `source` (what the error names) the task is prepared
    first (prepare_task: a relative data path resolved, a bad one refused before Ray starts)."""
    from geofed.orchestrator.driver.rundir import new_run_dir
    from geofed.orchestrator.driver.run import Runner, prepare_task

    if source is not None:
        cfg = prepare_task(cfg, source=source)
    run_dir = new_run_dir(cfg, str(parent))
    runner = Runner(cfg, run_dir, show_progress=False)
    try:
        summary = runner.run()
    finally:
        runner.shutdown()
    return run_dir, summary
