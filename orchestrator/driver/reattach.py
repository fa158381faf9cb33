"""Regions that outlive their driver (run.orphan_timeout_s; docs/reliability.md, "A killed driver").

When the driver joined a Ray cluster that outlives it (ray.address), its region actors are
detached and named from the run, `geofed/<run id>/<region>` in the namespace RUN_NAMESPACE; the
run id is made once and kept in RUN_DIR/run_id, so every resume of RUN_DIR finds the same names.
A killed driver leaves them training to the end of the round it started, serving their gRPC
port, holding their model, optimizers and codec state in memory. Each is held through the warm
pool's mechanism (regions/warm.py, WarmSlot): once its driver's Ray job is dead it is idle, and an
idle one ends itself after run.orphan_timeout_s unless a resumed driver claims it first.

`geofed run --resume RUN_DIR` looks them up before it creates any actor (`find_live`); what it does
with each region's state is `decide`, a pure rule (module tests: tests/unit/test_reattach.py):

- every region answers at the driver checkpoint's round r: all are kept as they are (no
  restore);
- every region answers at r + 1 (the driver died after they finished a round it never
  checkpointed) and kept that round's report: all are kept, and the driver takes round r + 1
  from those reports (`replay`) as if it had just read them: it plans the round as before,
  observes, logs and checkpoints it; no round is done again and none goes unlogged;
- a region is gone (no actor, or one that does not answer): a new actor restores its own
  checkpoint of r, as before; the live ones are kept when they are at r;
- anything else (rounds that differ, a region ahead while another is gone): the live regions are
  ended too and every region starts again from its checkpoint of r, as before (one round redone,
  said in the event). A live region cannot be put back to an earlier round in place: its mailbox
  has closed the rounds it ran.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from ..config import RunConfig
from .rundir import read_json_file, read_jsonl, write_json
from .warmpool import end_pooled

RUN_NAMESPACE = "geofed-runs"
RUN_ID_FILE = "run_id.json"
# A live actor answers a claim at once (its pool thread); its attach waits for the round its dead driver started.
_CLAIM_TIMEOUT_S = 10.0


def detached(cfg: RunConfig, *, hostile: dict | None = None, train_fn: Callable[..., Any] | None = None) -> bool:
    """Whether this run's region actors outlive their driver: a Ray cluster that outlives it
    (ray.address), run.orphan_timeout_s > 0, no warm pool (pooled actors have names of their own and
    are rebuilt by the next run that claims them), one worker and one region a process, a task's own stepper (the
    loop API's function runs in the driver's script) and no hostile region (a bench's)."""
    return (bool(cfg.ray.address) and cfg.run.orphan_timeout_s > 0 and cfg.ray.warm_pool_s == 0
            and cfg.regions.workers == 1 and cfg.regions.per_process == 1 and train_fn is None and not hostile)


def run_id(run_dir: Path) -> str:
    """The run's id, made on its first start and read by every resume (RUN_DIR/run_id.json)."""
    path = Path(run_dir) / RUN_ID_FILE
    data = read_json_file(path)
    if isinstance(data, dict) and isinstance(data.get("run_id"), str) and data["run_id"].isalnum():
        return data["run_id"]
    rid = secrets.token_hex(8)
    write_json(path, {"run_id": rid})
    return rid


def actor_name(rid: str, region: str) -> str:
    """The detached actor's name of `region` in the run `rid`."""
    return f"geofed/{rid}/{region}"


def actor_names(run_dir: Path, regions: Iterable[str]) -> dict[str, str]:
    """region -> the name of its detached actor in RUN_NAMESPACE."""
    rid = run_id(run_dir)
    return {r: actor_name(rid, r) for r in regions}


def joined_regions(state: Mapping[str, Any]) -> list[str]:
    """The regions a driver checkpoint's run took in under new names (membership.py keeps them as
    `grown`, in join order) and that had not left: their actors are detached and named as the
    starting regions' are, so a resume looks them up too."""
    membership = state.get("membership") or {}
    out = set(membership.get("out") or ())
    return [region for region, _label in membership.get("grown") or () if region not in out]


def release_name(name: str) -> None:
    """Free `name` for a new actor of its region: a region that joins again under its name finds it
    held by its predecessor, retired (Ray frees a name only once its actor is dead) or failed for
    good. That one is ended, and the wait bounded as a resume's is."""
    try:
        handle = ray.get_actor(name, namespace=RUN_NAMESPACE)
    except ValueError:
        return
    _end({name: handle})


def region_pids(run_dir: Path) -> set[int]:
    """The pids of the run's region actors as its last driver started them (events.jsonl `started`)."""
    started = [e for e in read_jsonl(Path(run_dir) / "events.jsonl") if e.get("event") == "started"]
    regions = started[-1].get("regions") if started else None
    if not isinstance(regions, dict):
        return set()
    return {i["pid"] for i in regions.values() if isinstance(i, dict) and isinstance(i.get("pid"), int)}


@dataclass(frozen=True, kw_only=True)
class Live:
    """A region actor of the run that answered a resumed driver: its handle, its node_info (with its
    gRPC address and completed_round) and the report of its last round (None before round 0)."""

    handle: Any
    info: dict[str, Any]
    report: Any = None


def find_live(names: dict[str, str], *, job: str, timeout_s: float,
              orphan_timeout_s: float) -> tuple[dict[str, Live], dict[str, str]]:
    """The run's named actors that are alive and now held by this driver (`job`, with this run's
    `orphan_timeout_s` from now on), and for the others why not. `timeout_s` bounds the wait for a
    round their dead driver started."""
    live: dict[str, Live] = {}
    gone: dict[str, str] = {}
    handles: dict[str, Any] = {}
    for region, name in names.items():
        try:
            handles[region] = ray.get_actor(name, namespace=RUN_NAMESPACE)
        except ValueError:
            gone[region] = "no actor (it ended: run.orphan_timeout_s passed, it failed, or the run never detached it)"
    claims = {h.claim.remote(job, orphan_timeout_s): r for r, h in handles.items()}
    ready, _ = ray.wait(list(claims), num_returns=len(claims), timeout=_CLAIM_TIMEOUT_S)
    taken = []
    for ref in claims:
        region = claims[ref]
        try:
            if ref in ready and ray.get(ref):
                taken.append(region)
            else:
                gone[region] = "it did not answer its claim" if ref not in ready else "another live driver holds it"
        except ray.exceptions.RayError as exc:
            gone[region] = f"its actor is dead: {_first_line(exc)}"
    attach = {handles[r].attach.remote(): r for r in taken}
    ready, _ = ray.wait(list(attach), num_returns=len(attach), timeout=timeout_s)
    for ref, region in attach.items():
        try:
            if ref not in ready:
                gone[region] = f"no answer within {timeout_s:.0f}s"
                continue
            info = ray.get(ref)
        except ray.exceptions.RayError as exc:
            gone[region] = f"its actor failed: {_first_line(exc)}"
            continue
        if not info.get("grpc_address"):
            gone[region] = "its server never started"
            continue
        report = info.pop("last_report", None)
        live[region] = Live(handle=handles[region], info=info, report=report)
    # a stuck or half-started one would hold the name a new actor needs
    _end({names[r]: handles[r] for r in gone if r in handles})
    return live, gone


def settle(names: dict[str, str], live: dict[str, Live], gone: dict[str, str],
           decision: Decision) -> tuple[dict[str, Live], dict[str, str]]:
    """The live regions `decision` keeps, and `gone` with the others, which are ended: a region cannot
    go back to an earlier round in place (its mailbox has closed the rounds it ran), so a new actor
    restores its checkpoint instead."""
    ended = {r: lv for r, lv in live.items() if r not in decision.kept}
    _end({names[r]: lv.handle for r, lv in ended.items()})
    why = decision.why or "not in the run at the driver checkpoint"
    return ({r: lv for r, lv in live.items() if r in decision.kept},
            {**gone, **{r: f"ended: {why}" for r in ended}})


def _end(handles: dict[str, Any]) -> None:
    """End these named actors for good and wait (bounded) until Ray has freed their names."""
    for name, handle in handles.items():
        end_pooled(name, handle)
    stuck = set(handles)
    deadline = time.monotonic() + _CLAIM_TIMEOUT_S
    while stuck and time.monotonic() < deadline:  # Ray frees a name once its actor is dead
        stuck = {n for n in stuck if _named(n)}
        time.sleep(0.2 if stuck else 0)


def _named(name: str) -> bool:
    try:
        ray.get_actor(name, namespace=RUN_NAMESPACE)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What a resume does with each region's state (module docstring). `kept`: live regions whose
    in-memory state goes on; `restore`: regions that start again from their checkpoint of the
    driver's round in a new actor (live ones are then ended); `replay`: the round the driver takes
    from the kept reports (None: none); `why`: why live regions were not kept."""

    kept: tuple[str, ...]
    restore: tuple[str, ...]
    replay: int | None = None
    why: str | None = None
    rounds: dict[str, int] = field(default_factory=dict)


def decide(ckpt_round: int, regions: list[str], live_rounds: dict[str, int], reports: dict[str, int | None]) -> Decision:
    """`regions`: the regions a resume restores (alive at the checkpoint); `live_rounds`: the
    completed round of each live one; `reports`: the round of each live one's last report."""
    live = [r for r in regions if r in live_rounds]
    new = [r for r in regions if r not in live_rounds]
    rounds = {r: live_rounds[r] for r in live}
    at = set(rounds.values())
    if live and at == {ckpt_round}:
        return Decision(kept=tuple(live), restore=tuple(new), rounds=rounds)
    if live and not new and at == {ckpt_round + 1} and all(reports.get(r) == ckpt_round + 1 for r in live):
        return Decision(kept=tuple(live), restore=(), replay=ckpt_round + 1, rounds=rounds)
    if not live:
        return Decision(kept=(), restore=tuple(regions), rounds=rounds)
    if at == {ckpt_round + 1} and new:
        why = f"round {ckpt_round + 1} done by the live regions but not by {', '.join(new)}, which are gone"
    elif at == {ckpt_round + 1}:
        why = f"round {ckpt_round + 1} done, but not every region kept its report"
    else:
        why = f"completed rounds differ from the driver checkpoint's {ckpt_round}: {rounds}"
    return Decision(kept=(), restore=tuple(regions), why=why, rounds=rounds)


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "cause", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
