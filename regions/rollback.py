"""A region whose model turns non-finite goes back to the start of the round instead of failing the run.

Admission (geofed.p2p.robust) refuses the updates that are plainly wrong; what it lets through
can still break a model: a finite update that overflows the next forward pass, a region's own
divergence. ``Rollback`` keeps the region's state at the start of every round (its model, the
inner optimiser's state and the algorithm's: DiLoCo's global model and outer momentum) and,
when the round ends with a non-finite loss, a non-finite parameter or a non-finite loss on a
fixed probe batch (the check that catches an update mixed in at the end of the round, before the
next round trains on it), restores that state: the round's inputs (the peers' updates mixed in
it) are dropped and the region goes on with the next round. A region that rolls back
``MAX_IN_A_ROW`` rounds in a row cannot make progress: it fails as before.

``Rollback`` is one of the region's round hooks (regions/hooks.py): ``plan`` snapshots what the
inner steps change, ``before_outer_step`` what the algorithm's outer step changes, ``after_round``
checks, ``recover`` restores, ``report`` lets the copy go.

The copy holds only what cannot be had back otherwise (issue 39): the inner optimizer's state and
the model's buffers from the round's start; the model's parameters only when the algorithm does not
restart them itself (whole-model DiLoCo restores them from its global copy, `restores_live`); the
algorithm's state (DiLoCo: global copy, outer momentum; 8 B/param) from its outer step to the
round's report, for an algorithm that announces that step (`announces_outer_step`), since a round
that fails in its inner steps left it as the round started. The restore stays bitwise. With DiLoCo
and AdamW that is 8 B/param through the inner steps and 16 at the round's end, against 20 all the
time before. It costs a forward pass on a few sequences too; ``security.rollback_on_nonfinite:
false`` turns both off. Where ``security.rollback_copy`` is ``disk`` (the default) each part of the copy
is written to a file of the region's run directory (``rollback/``) with plain writes as it is taken
and read back only by a restore: the page cache holds it, not the process, so a round's peak
resident memory no longer counts it (8 + 8 B/param for DiLoCo with AdamW; the file is deleted when
the round stands). Both run every round, so both are kept small: tensors are cloned without copy.deepcopy's bookkeeping,
and the probe is PROBE_ROWS rows of a batch (a forward pass overflows on all inputs alike when
its weights make it overflow). With a round of 25 steps of char-lm's GRU on shared cores they
cost 16 ms a round before (deepcopy 2.2 ms, a 32-sequence probe 2.7 ms, on an idle core), ~3% of
the round (docs/bench-wan.md).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .checkpoint import make_private_dirs
from .hooks import RoundHook
from .sync.common import no_exchange_metrics

if TYPE_CHECKING:
    from .messages import RoundPlan

log = logging.getLogger(__name__)
MAX_IN_A_ROW = 3
PROBE_ROWS = 4  # sequences (rows) of the probe batch, where a batch is a tensor of rows
_PROBE_SEED = 7919  # the probe batch's own generator: the training data stream is not touched


def copy_state(obj: Any) -> Any:
    """A deep copy of a state tree (dicts, lists, tuples; tensors and plain values at the leaves):
    tensors cloned, containers rebuilt, anything else deep-copied. A tensor held twice (tied
    weights) is copied twice, which loading back does not mind."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        out = copy.copy(obj)  # its type and attributes (a state_dict's _metadata: versions for loading)
        for k, v in obj.items():
            out[k] = copy_state(v)
        return out
    if isinstance(obj, list):
        return [copy_state(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(copy_state(v) for v in obj)
    return copy.deepcopy(obj)


class OnDisk:
    """One part of a round's copy in a file: written with plain writes (`torch.save` writes each tensor's
    bytes from where they lie), not mapped, so it is not resident in the process; read back only by a
    restore, and deleted when the round stands. Loaded with `weights_only`: the run directory is data."""

    def __init__(self, obj: Any, directory: Path):
        make_private_dirs(directory)  # 0700, as checkpoints/: it holds the model's state
        # Named by host and process: the region's workers share the folder, and a later process clears a dead one's.
        fd, name = tempfile.mkstemp(prefix=f"{_owner(os.getpid())}-", suffix=".pt", dir=directory)
        os.close(fd)
        self.path = Path(name)
        try:
            torch.save(obj, self.path)
        except BaseException:
            self.drop()
            raise

    def load(self) -> Any:
        return torch.load(self.path, map_location="cpu", weights_only=True)

    def drop(self) -> None:
        self.path.unlink(missing_ok=True)


def _owner(pid: int) -> str:
    return f"{socket.gethostname()}-{pid}"


def drop_stale(directory: Path) -> int:
    """Delete the copies that processes of this host left when they died (killed mid-round, a region's
    restarted actor's predecessor); a live process's are kept. The number deleted."""
    host = _owner(0)[:-2]  # this host's name
    dropped = 0
    for path in directory.glob(f"{host}-*.pt") if directory.is_dir() else ():
        pid = path.name[len(host) + 1:].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        path.unlink(missing_ok=True)
        dropped += 1
    return dropped


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


class Guarded(Protocol):
    """What the hook reads and restores of its region (regions/region.py's Region is one)."""

    cfg: Any
    index: int
    region: str
    shard: Any
    task: Any
    model: torch.nn.Module
    inner: torch.optim.Optimizer
    algorithm: Any
    params: list[torch.Tensor]


class Rollback(RoundHook):
    """Keeps a region's state at the start of each round and undoes a round that leaves the model
    non-finite (see the module docstring).
    """

    def __init__(self, w: Guarded, *, directory: Path | None = None):
        """`directory`: where the copy is written (security.rollback_copy disk); None keeps it in memory."""
        self.w, self.directory = w, directory
        if directory is not None:
            drop_stale(directory)
        self.probe_batch: Any = None  # the loop API (regions/loop.py): no task, no shard; the loss and weights are checked
        if w.task is not None:
            gen = torch.Generator().manual_seed(w.cfg.run.seed * 1000 + w.index + _PROBE_SEED)
            batch = next(w.shard.batches(gen))
            self.probe_batch = batch[:PROBE_ROWS] if isinstance(batch, torch.Tensor) and batch.dim() >= 2 else batch
        self._state: dict[str, Any] | None = None  # a part is an OnDisk where the copy goes to a file
        self.in_a_row = 0
        self.total = 0

    def plan(self, plan: RoundPlan) -> RoundPlan:
        """Keep a copy of what the round changes first: the inner optimizer's state, the model's
        buffers, and the model's parameters unless the algorithm restores them itself (whole-model
        DiLoCo restarts from its global copy: `restores_live`). The algorithm's state is copied here
        only when it may change at any time; one that announces its outer step is copied then
        (`before_outer_step`), so the inner steps run without that copy (issue 39: 20 B/param held
        all the time before, 8 for DiLoCo with AdamW now, 16 from the outer step to after_round)."""
        w = self.w
        # The last round's copy goes first: built while that one was still held, the new copy made
        # every round's start cost the state twice (20 B/param more at DiLoCo's peak, issue 39).
        self.release()
        model = w.model.state_dict()
        if getattr(w.algorithm, "restores_live", False):
            live = {p.data_ptr() for p in w.params}
            kept = type(model)((k, v) for k, v in model.items() if v.numel() == 0 or v.data_ptr() not in live)
            kept._metadata = getattr(model, "_metadata", None)  # type: ignore[attr-defined]  # versions, for loading
            model = kept
        state = {"model": model, "inner": w.inner.state_dict()}
        if not getattr(w.algorithm, "announces_outer_step", False):
            state["algorithm"] = w.algorithm.state_dict()
        self._state = {k: self._keep(v) for k, v in state.items()}
        return plan

    def _keep(self, part: Any) -> Any:
        """The part's copy: in memory, or written to a file without a copy in memory first."""
        return copy_state(part) if self.directory is None else OnDisk(part, self.directory)

    def release(self) -> None:
        """Let the copy go (and its files)."""
        state, self._state = self._state, None
        for part in (state or {}).values():
            if isinstance(part, OnDisk):
                part.drop()

    def before_outer_step(self) -> None:
        """The algorithm is about to change its own state (the outer step): copy it as the round started."""
        if self._state is not None and "algorithm" not in self._state:
            self._state["algorithm"] = self._keep(self.w.algorithm.state_dict())

    def probe_loss(self) -> float:
        """The model's loss on the fixed probe batch, in eval mode and without gradients (0.0 without one)."""
        w = self.w
        if self.probe_batch is None:
            return 0.0
        was_training = w.model.training
        w.model.eval()
        try:
            with torch.no_grad():
                return float(w.task.loss(w.model, self.probe_batch))
        finally:
            w.model.train(was_training)

    def after_round(self, plan: RoundPlan, metrics: dict[str, Any]) -> dict[str, Any]:
        """`metrics` as they are; FloatingPointError if the round left the region's model unusable."""
        loss = metrics.get("train_loss")
        if loss is not None and not math.isfinite(loss):
            raise FloatingPointError(f"region {self.w.region}: train loss is {loss}")
        if not all(bool(torch.isfinite(p).all()) for p in self.w.params):
            raise FloatingPointError(f"region {self.w.region}: a parameter is non-finite after the round")
        probe = self.probe_loss()
        if not math.isfinite(probe):
            raise FloatingPointError(f"region {self.w.region}: the model after the round gives a loss of {probe}")
        self.in_a_row = 0
        return metrics

    def report(self, plan: RoundPlan, metrics: dict[str, Any]) -> None:
        """The round stands (every hook's after_round passed; a later hook may still reject it there):
        its start is no longer needed, and is not held through the end of the run (export) or the wait
        for the next round."""
        self.release()

    def recover(self, plan: RoundPlan, error: FloatingPointError, partial: dict[str, Any] | None) -> dict[str, Any]:
        """Restore the start of the round; the round's metrics say what was dropped. `partial`:
        the round's metrics if it got that far, else what inner_steps attached to `error`."""
        w = self.w
        partial = partial if partial is not None else getattr(error, "metrics", None)
        self.in_a_row += 1
        self.total += 1
        if self._state is None or self.in_a_row >= MAX_IN_A_ROW:
            raise FloatingPointError(f"{error} ({self.in_a_row} rounds in a row rolled back)") from error
        t0 = time.monotonic()
        state = {k: v.load() if isinstance(v, OnDisk) else v for k, v in self._state.items()}
        self.release()
        w.model.load_state_dict(state["model"], strict=not getattr(w.algorithm, "restores_live", False))
        w.inner.load_state_dict(state["inner"])
        # Not copied: the round failed before the algorithm changed its state (the inner steps), which
        # is then still the round's start; loading it sets the live tensors as a copy's would.
        w.algorithm.load_state_dict(state["algorithm"] if "algorithm" in state else w.algorithm.state_dict())
        w.algorithm.rolled_back()  # gossip: our public copy moved with the round's message; start it over
        loss = self.probe_loss()
        if not math.isfinite(loss):
            raise FloatingPointError(f"{error}; the state at the start of the round gives a loss of {loss} too") from error
        dropped = sorted({t["peer"] for t in (partial or {}).get("transfers", []) if t.get("direction") == "recv"})
        log.warning("region %s rolled back round %d (%s); dropped the updates of %s", w.region, plan.round, error,
                    dropped or "nobody")
        metrics = {**no_exchange_metrics(), **(partial or {})}
        metrics.update({"train_loss": loss if self.probe_batch is not None else None, "steps": 0, "compute_s": (partial or {}).get("compute_s", 0.0),
                        "step_time_s": (partial or {}).get("step_time_s", 0.0),
                        "rolled_back": {"why": str(error), "dropped": dropped, "restore_s": round(time.monotonic() - t0, 6)}})
        return metrics
