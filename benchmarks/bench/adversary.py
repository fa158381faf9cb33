"""A hostile member: a real region whose own code misbehaves (`geofed bench attack`, issue 36).

Bench-only, so it lives with the bench, not in the wheel's regions room: it plugs into a Region
through public seams only (Region.add_hook with a RoundHook's before_send and report,
SecAggRound.contribution_hooks, Region.serve_state), and the core names none of it.

The bench's HostilePeer (benchmarks/bench/hostile_peer.py) attacks from outside the run with a stolen certificate; this one is
a member of the run. It trains like the others and keeps its own model honest, and it lies at
one point of the data path, chosen by its `Adversary` spec:

- ``withhold``: it never pushes its update (its pushes are left out), yet receives everyone's
  and answers heartbeats, so the driver sees a live region that missed nothing;
- ``poisoned``: it withholds as above and serves a random finite state on FetchState (the model,
  the global model, the outer momentum, every float replaced), so a region resyncing from it
  takes that state;
- ``scale``: it sends its pseudo-gradient times `factor` (-9 flips it under the clip bound, +9
  inflates it);
- ``bound``: it sends its pseudo-gradient rescaled to ``norm_multiple`` x the median of its own
  recent update norms, times `factor` (-1: a sign flip at the clip bound a receiver derives from
  the same median, since every region's norms are alike);
- ``secagg``: under secure aggregation, its masked contribution is its update times `factor`
  (1e30: finite, and it sets every region's shared scale).

Only the Python API carries it (``Runner(hostile={region: Adversary(...)})`` -> the region actor's
creation argument `plugin`, which the built Region calls: ``Adversary(...)(region)`` attaches the
member): there is no config key, so no config file can turn a region hostile.

Each act is counted by the hostile region itself (``take_acts``: one per push withheld or
altered, per state served, per masked contribution sent to a peer) and reported in its round
metrics under ``hostile``, so the bench can tell whether the honest regions counted every one.
"""

from __future__ import annotations

import io
import math
import statistics
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from geofed.regions.hooks import RoundHook

__all__ = ["KINDS", "Adversary", "HostileMember", "attach", "poisoned_state_bytes"]

KINDS = ("withhold", "poisoned", "scale", "bound", "secagg")
_NORM_WINDOW = 32  # as many own norms as a receiver's admission keeps (geofed.p2p.robust.UpdateAdmission)


@dataclass(frozen=True, kw_only=True)
class Adversary:
    """What a hostile member does (module docstring): `kind`, the `factor` its update is multiplied
    by (scale, secagg) or the sign and multiple of the clip bound it is sent at (bound), and the
    round it turns hostile from (it is honest before)."""

    kind: str
    factor: float = 1.0
    from_round: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Adversary.kind: expected one of {', '.join(KINDS)}, got {self.kind!r}")
        if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)) or not math.isfinite(self.factor):
            raise ValueError(f"Adversary.factor: must be a finite number, got {self.factor!r}")
        if isinstance(self.from_round, bool) or not isinstance(self.from_round, int) or self.from_round < 0:
            raise ValueError(f"Adversary.from_round: must be an integer >= 0, got {self.from_round!r}")

    @property
    def withholds(self) -> bool:
        return self.kind in ("withhold", "poisoned")

    def __call__(self, region: Any) -> HostileMember:
        """Region's `plugin` call point: turn the built `region` hostile (attach)."""
        return attach(self, region)


class HostileMember:
    """The hooks one hostile region runs (attach() wires them); thread-safe counts of its acts.

    `norm_multiple`: the run's security.norm_multiple (a member knows the config); `seed`: of the
    poisoned state's random values."""

    def __init__(self, spec: Adversary, *, norm_multiple: float, seed: int = 0):
        self.spec, self.norm_multiple = spec, float(norm_multiple)
        self._norms: deque[float] = deque(maxlen=_NORM_WINDOW)
        self._acts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._generator = torch.Generator().manual_seed(10_007 + seed)

    def _act(self, what: str, n: int = 1) -> None:
        if n > 0:
            with self._lock:
                self._acts[what] += n

    def take_acts(self) -> dict[str, int]:
        """Acts by kind since the last call (a round's metrics report them)."""
        with self._lock:
            out, self._acts = dict(self._acts), Counter()
        return out

    def outgoing(self, round_: int, tensors: Sequence[torch.Tensor],
                 out_peers: Sequence[str]) -> tuple[Sequence[torch.Tensor], Sequence[str]]:
        """The exchanger's hook, before encoding: (what is sent, to whom) in place of the honest pair."""
        spec = self.spec
        if spec.kind == "bound":  # its own norms are its reference, as a receiver's admission median is
            norm = _l2(tensors)
            if math.isfinite(norm):
                self._norms.append(norm)
        if round_ < spec.from_round or not out_peers or spec.kind == "secagg":
            return tensors, out_peers
        if spec.withholds:
            self._act("withheld", len(out_peers))
            return tensors, []
        if spec.kind == "scale":
            scale = spec.factor
        elif not self._norms:  # no finite norm of its own yet: nothing to aim at, it sends honestly
            return tensors, out_peers
        else:
            norm = _l2(tensors)
            scale = spec.factor * self.norm_multiple * statistics.median(self._norms) / norm if norm > 0 else 0.0
        self._act("flipped" if scale < 0 else "scaled", len(out_peers))
        return [t * scale for t in tensors], out_peers

    def masked(self, round_: int, own: list[torch.Tensor], peers: Sequence[str]) -> list[torch.Tensor]:
        """Secure aggregation's hook: the update that is quantised, masked and sent (and whose
        absmax sets the shared scales); the error-feedback residual is added after, so it stays
        what the honest update left behind and the attack does not compound over rounds."""
        if self.spec.kind != "secagg" or round_ < self.spec.from_round:
            return own
        self._act("secagg_scaled", len(peers))
        return [t * self.spec.factor for t in own]

    def state_provider(self, honest: Callable[[], bytes]) -> Callable[[], bytes]:
        """FetchState's provider: a poisoned member serves a random finite state, the others `honest`."""
        if self.spec.kind != "poisoned":
            return honest

        def serve() -> bytes:
            data = honest()
            self._act("poisoned_state")
            with self._lock:
                return poisoned_state_bytes(data, self._generator)
        return serve


def poisoned_state_bytes(data: bytes, generator: torch.Generator) -> bytes:
    """FetchState bytes (RegionState.state_bytes) with every floating tensor replaced by standard
    normal values: finite, of the right shapes, so a receiver that checks nothing loads it."""
    state = torch.load(io.BytesIO(data), weights_only=True)
    buf = io.BytesIO()
    torch.save(_randomised(state, generator), buf)
    return buf.getvalue()


def _randomised(obj: Any, generator: torch.Generator) -> Any:
    if isinstance(obj, torch.Tensor) and obj.is_floating_point():
        return torch.randn(obj.shape, generator=generator, dtype=torch.float32).to(obj.dtype)
    if isinstance(obj, dict):
        return {k: _randomised(v, generator) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_randomised(v, generator) for v in obj)
    return obj


def _l2(tensors: Sequence[torch.Tensor]) -> float:
    return math.sqrt(math.fsum(float(torch.linalg.vector_norm(t.detach().float())) ** 2 for t in tensors))


def attach(spec: Adversary, region: Any) -> HostileMember:
    """Turn `region` (a Region, built honest) hostile: its round gets the member's hook (what it
    sends, the acts it reports), its secure aggregation the member's mask and FetchState the
    member's state; returns the member."""
    member = HostileMember(spec, norm_multiple=region.cfg.security.norm_multiple, seed=region.cfg.run.seed)
    region.add_hook(_MemberHook(member))
    if region.secagg is not None:
        region.secagg.contribution_hooks.append(member.masked)
    region.serve_state(member.state_provider(region.state_bytes))
    return member


class _MemberHook(RoundHook):
    """A hostile member at the region's round (regions/hooks.py): it changes what is sent, and
    the round reports its acts under `hostile`."""

    def __init__(self, member: HostileMember):
        self.member = member

    def before_send(self, round_: int, tensors: Sequence[torch.Tensor],
                    out_peers: Sequence[str]) -> tuple[Sequence[torch.Tensor], Sequence[str]]:
        return self.member.outgoing(round_, tensors, out_peers)

    def report(self, plan: Any, metrics: dict[str, Any]) -> None:
        metrics["hostile"] = self.member.take_acts()
