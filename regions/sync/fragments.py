"""Streaming DiLoCo (arXiv 2501.18512): the model's parameters in N fragments, one synced per round.

``sync.fragments: N`` splits the parameters, in model order, into N contiguous groups balanced
by element count (`split_fragments`: a fragment is a run of whole layers). Round r runs the
plan's H inner steps and then exchanges fragment ``r % N`` only: its pseudo-gradient is taken
against that fragment's own last-synchronised copy, mixed, and stepped by that fragment's own
outer optimizer (its own `Diloco` object, regions/sync/diloco.py: its own global copy and outer
optimizer state). Fragment f therefore syncs at rounds f,
f + N, ...: the coordinator plans rounds of H/N steps (orchestrator/driver/coordinator.py), so
every parameter still syncs every H inner steps, as in DiLoCo, with the offsets f*H/N of the
paper, one fragment on the wire at a time and 1/N of the model's bytes per exchange.

Between two syncs of a fragment the region keeps training it; a fragment's progress that was
not yet sent is never thrown away. With overlap (delayed or eager) fragment f's exchange runs
during the next round; when its mean arrives the fragment is rebased: ``local = global -
(start - local)`` keeps the steps the region took meanwhile, and ``start = global`` makes them
part of the fragment's next pseudo-gradient (`Diloco.rebase`). N = 1 is DiLoCo itself: one part,
the whole model.

Per-fragment state: the global copy and the outer optimizer state of each fragment, and with
overlap where each fragment's unsent progress starts; the live model carries the rest (its
fragments' unsent progress), so a checkpoint resumes mid-schedule exactly. A donor's state
(rejoin) restarts every fragment from the donor's global model. Codec streams (error feedback)
are per fragment too: the exchange's codec state is keyed by the fragment.

The result (`eval_params`) is the global model: each fragment as of its last sync. Progress a
fragment made after its last sync of the run is not in it (the paper's evaluation does the same).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .algorithm import OuterPart
from .protocol import Shapes

Piece = tuple[int, int, int]  # (parameter index, first row, end row) of a fragment's slice of a tensor


def split_fragments(shapes: Shapes, n: int) -> list[list[Piece]]:
    """The `n` fragments of a model of `shapes`, each a list of pieces (parameter index, rows [a, b)
    along dim 0): contiguous in model order, every element in exactly one piece, and as even in element
    count as whole rows allow. A fragment takes whole tensors while they fit its share (total/n) and cuts
    the tensor that crosses the boundary between rows: a model whose size sits in one matrix (char-lm's
    GRU: 59% in one weight) still splits evenly. Scalars are never cut. Refuses more fragments than rows."""
    rows = [s[0] if len(s) else 1 for s in shapes]
    if not 1 <= n <= sum(rows):
        raise ValueError(f"sync.fragments: {n} fragments of a model of {sum(rows)} rows (at most one fragment per row)")
    row_size = [max(1, math.prod(s) // max(1, r)) for s, r in zip(shapes, rows)]
    total = sum(r * w for r, w in zip(rows, row_size))
    out: list[list[Piece]] = [[] for _ in range(n)]
    f, filled = 0, 0.0
    for i, (nrows, w) in enumerate(zip(rows, row_size)):
        a = 0
        while a < nrows:
            goal = (f + 1) * total / n
            take = nrows - a if f == n - 1 else max(0, min(nrows - a, round((goal - filled) / w)))
            # at least one row a fragment, and leave at least one row for each fragment still to come
            rows_left = sum(rows[i + 1:]) + nrows - a
            take = min(take, rows_left - (n - 1 - f)) if f < n - 1 else take
            if take == 0 and not out[f]:
                take = 1
            if take:
                out[f].append((i, a, a + take))
                a, filled = a + take, filled + take * w
            if f < n - 1 and (take == 0 or filled >= goal - w / 2):
                f += 1
    assert all(out) and sum(b - a for frag in out for _, a, b in frag) == sum(rows), out
    return out


class Layout:
    """The model's parameters as `n` fragments of pieces (`split_fragments`): each fragment's live
    views, and whole parameters put back together from per-piece tensors."""

    def __init__(self, shapes: Shapes, n: int):
        self.n = n
        layout = split_fragments(shapes, n)
        self.pieces: list[Piece] = [p for frag in layout for p in frag]
        self.fragments = layout

    def views(self, params: Sequence[torch.Tensor], f: int) -> list[torch.Tensor]:
        """Fragment f's pieces as views of the live `params` (a whole tensor is itself, detached)."""
        out = []
        for i, a, b in self.fragments[f]:
            p = params[i].detach()
            out.append(p if p.dim() == 0 or (a == 0 and b == p.shape[0]) else p[a:b])
        return out

    def assemble(self, pieces: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Whole parameters (model order) from per-piece tensors (in piece order)."""
        by_param: dict[int, list[torch.Tensor]] = {}
        for (i, _, _), t in zip(self.pieces, pieces):
            by_param.setdefault(i, []).append(t.detach())
        return [ts[0] if len(ts) == 1 else torch.cat(ts) for _, ts in sorted(by_param.items())]


def fragment_state(parts: Sequence[OuterPart], *, region: str, overlap: bool) -> dict[str, Any]:
    """Every piece's global copy and every fragment's outer optimizer state, the fragment count, whose
    state it is, and (overlap) where each piece's unsent progress starts; the live model is the worker's.
    References, as Diloco.state_dict's: whoever keeps it copies it."""
    d: dict[str, Any] = {"global": [g.detach() for p in parts for g in p.global_params],
                         "fragments": len(parts), "outer": [p.outer_opt.state_dict() for p in parts], "region": region}
    if overlap:
        d["start"] = [s.detach() for p in parts for s in p.start]
    return d


def load_fragment_state(parts: Sequence[OuterPart], d: dict[str, Any], *, region: str, overlap: bool) -> None:
    """Own state (checkpoint, rollback): global copies, outer states and starts; the live model was
    restored by the worker, unsent progress and all. A donor's (rejoin): every fragment restarts from
    the donor's global model. Refuses a state of another fragment count."""
    sizes = [len(p.global_params) for p in parts]
    if int(d.get("fragments", 1)) != len(parts) or len(d["global"]) != sum(sizes):
        raise ValueError(f"sync.fragments: the state has {d.get('fragments', 1)} fragments, this run {len(parts)}")
    at = 0
    for part, n, outer in zip(parts, sizes, d["outer"]):
        part.load_state_dict({"global": d["global"][at:at + n], "outer": outer})
        if d.get("region") != region or (overlap and "start" not in d):
            part.set_live(part.global_params, start=overlap)
        elif overlap:
            saved = d["start"][at:at + n]
            if part.start is None:
                part.start = [s.detach().clone() for s in saved]
            else:  # in place: the start stays where the outer state lives (sync.outer.offload)
                with torch.no_grad():
                    for s, x in zip(part.start, saved):
                        s.copy_(x)
        at += n
