"""The step time as co-located regions see it: the task's inner step timed in N processes at once.

A local run puts every region actor on this host (Ray reserves CPUs as a count, it does not pin
an actor to cores), each a process with ``regions.torch_threads`` torch threads. Timed alone, the
default config's step read 0.41 ms where its four regions, sharing two cores, stepped in 2.5-6.6 ms
(issue 37): a plan sized on the alone step predicted 24% utilisation where the run had 96%. So the
planner starts one process per co-located region, lets each build the task and warm up, then
starts them together and times their steps over the same wall-clock window; the round waits for
the slowest region, so the step is the slowest process's mean (compute_s / steps, as a region
reports it).

The children import only torch and the task's package (geofed.regions.tasks), not the
orchestrator: their start-up is part of what the plan costs.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

# The child: build the task, warm up, say "ready", wait for "go", step for `seconds`, print the times.
_CHILD = r"""
import base64, json, pickle, sys, time
import torch
from geofed.regions.tasks import make_task
a = pickle.loads(base64.b64decode(sys.argv[1]))
torch.set_num_threads(a["threads"])
task = make_task(a["task"], batch_size=a["batch_size"], seed=a["seed"])
model = task.build_model(a["seed"])
params = [p for p in model.parameters() if p.requires_grad]
opt = (torch.optim.AdamW(params, lr=a["lr"]) if a["inner"] == "adamw"
       else torch.optim.SGD(params, lr=a["lr"], momentum=a["momentum"]))
batches = task.shard(a["index"], a["n"], a["seed"]).batches(torch.Generator().manual_seed(a["seed"]))
def step():
    opt.zero_grad(set_to_none=False)
    task.loss(model, next(batches)).backward()
    opt.step()
for _ in range(5):
    step()
print("ready", flush=True)
sys.stdin.readline()
steps, t0 = 0, time.monotonic()
while True:
    step()
    steps += 1
    t = time.monotonic()
    if t - t0 >= a["seconds"] and steps >= a["min_steps"]:
        break
print(json.dumps({"steps": steps, "start": t0, "end": t, "mean_s": (t - t0) / steps}), flush=True)
"""


class ProbeError(RuntimeError):
    """A probe process failed or did not answer in time (the message has its stderr's tail)."""


@dataclass(frozen=True, kw_only=True)
class SharedStep:
    """The co-located probe's result: the slowest process's mean step and every process's window."""

    step_s: float                     # the slowest process's mean seconds per step
    copies: int
    threads: int                      # torch threads per process (regions.torch_threads)
    host_cpus: int                    # cores this process may run on
    per_copy: tuple[dict[str, Any], ...]  # steps, start, end (time.monotonic, host-wide), mean_s


def host_cpus() -> int:
    """Cores this process may run on (its affinity; what co-located actors share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def probe_shared_step(cfg, *, copies: int, seconds: float = 1.5, min_steps: int = 20,
                      timeout_s: float = 180.0) -> SharedStep:
    """Time the task's inner step in `copies` processes stepping at the same time (one per region
    that shares this host), each with regions.torch_threads threads and region i's shard."""
    assert copies >= 1 and seconds > 0
    inner = cfg.sync.inner
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    procs = []
    try:
        for i in range(copies):
            arg = base64.b64encode(pickle.dumps({
                "task": cfg.task, "batch_size": inner.batch_size, "seed": cfg.run.seed, "threads": cfg.regions.torch_threads,
                "inner": inner.kind, "lr": inner.lr, "momentum": getattr(inner, "momentum", 0.0), "index": i,
                "n": max(copies, len(cfg.regions.names)), "seconds": seconds, "min_steps": min_steps})).decode()
            procs.append(subprocess.Popen([sys.executable, "-c", _CHILD, arg], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        deadline = time.monotonic() + timeout_s
        for p in procs:
            _expect(p, "ready", deadline)
        for p in procs:  # all built and warm: start them together
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [json.loads(_expect(p, "{", deadline)) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            for f in (p.stdin, p.stdout, p.stderr):
                f.close()
    return SharedStep(step_s=max(r["mean_s"] for r in results), copies=copies, threads=cfg.regions.torch_threads,
                      host_cpus=host_cpus(), per_copy=tuple(results))


def _expect(p: subprocess.Popen, prefix: str, deadline: float) -> str:
    """The child's next stdout line, which must start with `prefix`; ProbeError on exit or timeout."""
    left = deadline - time.monotonic()
    ready, _, _ = select.select([p.stdout], [], [], max(0.0, left))
    line = p.stdout.readline() if ready else ""
    if not line.startswith(prefix):
        if p.poll() is None:
            p.kill()
        p.wait()
        err = p.stderr.read()[-2000:]
        why = "timed out" if not ready else f"exited {p.returncode}"
        raise ProbeError(f"step-time probe process {why} (expected {prefix!r}, got {line[:200]!r}): {err}")
    return line.strip()
