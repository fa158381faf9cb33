"""A rejoining region pulls the current parameters from a peer, spreading the load, and checks
what it gets like an update (issue 36, N1).

hivemind's joiners all pulled state from the same donor (its issues #169, #445). Here each
joiner ranks the candidate donors by rendezvous hashing of (salt, joiner, donor): different
joiners start at different donors, the order is stable for a joiner, and a donor that fails or
times out is skipped for the next one.

A donor is one member and may be hostile: it holds a valid certificate and serves whatever state
it likes. ``check_state`` refuses (``bad_state``) a state with a non-finite value, a value above
``security.max_update_value``, another layout than the receiver's own, or one farther from the
receiver's own state than the norm rule allows (``bound``: security.norm_multiple x the recent
median update norm, per round the receiver is behind). ``fetch_checked_states`` asks up to
``want`` donors at once and more when one fails or is refused; ``combine_states`` takes the
coordinate-wise median of three or more states (one hostile donor among three cannot move it:
two honest ones hold the same state, so the median is theirs exactly).
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .admission import Refusal
from .transport import Transport, TransportError

log = logging.getLogger("geofed.p2p")


def donor_order(joiner: str, donors: Sequence[str], *, salt: str = "") -> list[str]:
    """The donors (without the joiner) in the order `joiner` tries them: rendezvous hashing of (salt, joiner, donor)."""
    def score(d: str) -> bytes:
        return hashlib.sha256(f"{salt}\0{joiner}\0{d}".encode()).digest()

    return sorted((d for d in donors if d != joiner), key=score)


STATE_DONORS = 3  # states fetched for one catch-up where regions share one model: a majority of three


def flat_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state (dicts, lists, tuples) by its path ("model/fc.weight", "algorithm/global/0")."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flat_tensors(v, f"{prefix}/{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flat_tensors(v, f"{prefix}/{i}" if prefix else str(i)))
    return out


def state_distance(a: Any, b: Any) -> float:
    """L2 distance over the floating tensors the two states share by path and shape."""
    fa, fb = flat_tensors(a), flat_tensors(b)
    total = 0.0
    for path, t in fa.items():
        o = fb.get(path)
        if o is not None and t.is_floating_point() and o.shape == t.shape:
            total += float(torch.linalg.vector_norm(t.detach().float() - o.detach().float())) ** 2
    return math.sqrt(total)


def check_state(state: Any, own: Any, *, max_value: float, bound: float | None, donor: str) -> float:
    """Refuse (Refusal ``bad_state``) a donor's state that is not like the receiver's own (a tensor of
    another shape, a tensor of its own missing), holds a non-finite value or one above `max_value`, or
    lies farther than `bound` from `own` (None: no distance check). Returns the distance."""
    if not isinstance(state, dict):
        raise Refusal("bad_state", f"the state from {donor} is a {type(state).__name__}, not a dict")
    mine, theirs = flat_tensors(own), flat_tensors(state)
    for path, o in mine.items():
        t = theirs.get(path)
        if path.startswith("model/") and t is None:
            raise Refusal("bad_state", f"the state from {donor} lacks {path}")
        if t is not None and tuple(t.shape) != tuple(o.shape):
            raise Refusal("bad_state", f"{path} from {donor} has shape {tuple(t.shape)}, here {tuple(o.shape)}")
    for path, t in theirs.items():
        if not t.is_floating_point() or not t.numel():
            continue
        if not bool(torch.isfinite(t).all()):
            raise Refusal("bad_state", f"{path} from {donor} holds a non-finite value")
        peak = float(t.detach().abs().max())
        if peak > max_value:
            raise Refusal("bad_state", f"{path} from {donor} holds a value of magnitude {peak:.3g} above "
                                       f"security.max_update_value {max_value:.3g}")
    distance = state_distance(state, own)
    if bound is not None and distance > bound:
        raise Refusal("bad_state", f"the state from {donor} lies {distance:.3g} from this region's own, "
                                   f"beyond the bound {bound:.3g} (security.norm_multiple x the recent median update norm)")
    return distance


def combine_states(states: Sequence[Any], own: Any) -> tuple[int, Any]:
    """One state from several checked ones: (index of the state it is, or is closest to, combined).

    One state: itself. Two: the one closer to the receiver's own (the two differ only if one is
    hostile, and the one that moves the region less is then the safer). Three or more: the
    coordinate-wise median of every floating tensor they share by path and shape, over the
    structure (plain values, integer tensors) of the state closest to that median."""
    if not states:
        raise ValueError("states: nothing to combine")
    if len(states) == 1:
        return 0, states[0]
    if len(states) == 2:
        d = [state_distance(s, own) for s in states]
        return (0, states[0]) if d[0] <= d[1] else (1, states[1])
    flats = [flat_tensors(s) for s in states]
    median: dict[str, torch.Tensor] = {}
    for path, t in flats[0].items():
        group = [f.get(path) for f in flats]
        if t.is_floating_point() and all(g is not None and g.shape == t.shape for g in group):
            stacked = torch.stack([g.detach().float() for g in group])
            median[path] = stacked.median(dim=0).values if len(group) % 2 else _mid(stacked)
    nearest = min(range(len(states)), key=lambda i: state_distance(median, flats[i]))
    return nearest, _replace(states[nearest], median, "")


def _mid(stacked: torch.Tensor) -> torch.Tensor:
    n = stacked.shape[0]
    ordered = stacked.sort(dim=0).values
    return (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def _replace(obj: Any, values: dict[str, torch.Tensor], prefix: str) -> Any:
    if isinstance(obj, torch.Tensor):
        v = values.get(prefix)
        return obj if v is None else v.to(obj.dtype)
    if isinstance(obj, dict):
        return {k: _replace(v, values, f"{prefix}/{k}" if prefix else str(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_replace(v, values, f"{prefix}/{i}" if prefix else str(i)) for i, v in enumerate(obj))
    return obj


def fetch_checked_states(transport: Transport, donors: Sequence[str], *, timeout_s: float,
                         check: Callable[[str, bytes], Any], want: int = 1, salt: str = "",
                         on_refused: Callable[[str, Refusal], None] | None = None) -> list[tuple[str, Any]]:
    """[(donor, checked state), ...]: up to `want` donors in this joiner's order, asked at once; a donor
    that fails, or whose state `check` refuses (Refusal, passed to `on_refused`), is replaced by the
    next one. ValueError when no state passed and some were refused, TransportError when none came."""
    order = donor_order(transport.region, donors, salt=salt)
    if not order:
        raise ValueError("donors: no peer to fetch the state from")
    want = max(1, min(want, len(order)))
    good: list[tuple[str, Any]] = []
    failures: list[str] = []
    refused = False
    with ThreadPoolExecutor(max_workers=want, thread_name_prefix="geofed-fetch") as pool:
        while order and len(good) < want:
            batch, order = order[:want - len(good)], order[want - len(good):]
            futures = [(d, pool.submit(transport.fetch_state, d, timeout_s=timeout_s)) for d in batch]
            for donor, fut in futures:
                try:
                    good.append((donor, check(donor, fut.result())))
                except TransportError as exc:
                    log.warning("%s: state fetch from %s failed (%s); trying the next donor", transport.region, donor, exc)
                    failures.append(f"{donor}: {exc.reason}")
                except Refusal as r:
                    log.warning("%s: refused the state of %s: %s", transport.region, donor, r.detail)
                    failures.append(f"{donor}: refused: {r}")
                    refused = True
                    if on_refused is not None:
                        on_refused(donor, r)
    if not good and refused:  # a state was there and unfit: the donors' fault, not the network's
        raise ValueError(f"{transport.region}: no donor gave a usable state ({'; '.join(failures)})")
    if not good:
        raise TransportError(f"{transport.region}: no donor gave its state ({'; '.join(failures)})", reason="unavailable")
    return good
