"""sync.outer.offload: where DiLoCo's outer state lives, and the chunked copies between it and the model.

With ``sync.outer.offload: true`` the global copy, the outer optimizer's state (built over the global
copy, so it lands beside it) and overlap's start live in host memory, pinned where CUDA is (a pinned
page copies to and from the GPU without a staging buffer), while the model and the inner optimizer
stay on the model's device, as INTELLECT-1 does. An 80 GB GPU then holds only what the inner steps
need (parameters, gradients, AdamW: 16 B/param) instead of 28 more of outer state (issue 39).

What runs where follows the tensors: the pseudo-gradient (start - live) is formed on the host, one
chunk of the live tensors copied down at a time into the pseudo-gradient's own storage; the mix,
the codec (which is CPU code: compression/update.py) and the outer step then run on the host; the
restarts (live = global - progress) are computed on the host and copied up. No full-size copy of
what is offloaded is ever made on the model's device, and no host temporary is larger than a chunk.

Where the model is on the host already (a CPU region) offload changes nothing: the placement is the
model's own device, and Diloco takes the same code path, bit for bit, as without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Elements per chunk of a host<->device step: 16 MiB of fp32, large enough that a copy's fixed cost
# is small against its bytes, small enough that the chunk temporaries are no model's worth.
CHUNK = 1 << 22


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a model-sized outer buffer lives: its device, and whether its host pages are pinned."""

    device: torch.device
    pin: bool = False


def outer_placement(model_device: torch.device | str, offload: bool, *, cuda_available: bool | None = None) -> Placement:
    """Where DiLoCo's outer state (global copy, outer momentum, overlap's start) lives for a model on
    `model_device`: the model's device, or with `offload` the host, pinned when the model is on a GPU
    and CUDA is there to pin with (pinning needs a CUDA context)."""
    device = torch.device(model_device)
    if not offload or device.type == "cpu":
        return Placement(device=device)
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    return Placement(device=torch.device("cpu"), pin=cuda and device.type == "cuda")


def placed_clone(t: torch.Tensor, where: Placement) -> torch.Tensor:
    """A copy of `t` where `where` says (copied directly across devices: no staging copy)."""
    t = t.detach()
    if t.device == where.device and not where.pin:
        return t.clone()
    out = torch.empty(t.shape, dtype=t.dtype, device=where.device, pin_memory=where.pin)
    out.copy_(t)
    return out


def _chunks(n: int, chunk: int) -> range:
    return range(0, n, max(1, chunk))


def pseudo_gradient_into(start: Sequence[torch.Tensor], live: Sequence[torch.Tensor],
                         *, chunk: int = CHUNK) -> list[torch.Tensor]:
    """start - live, in new tensors beside `start` (the host): each chunk of `live` is copied into the
    result's own storage, then start's chunk less it written over it; the same subtraction as
    ``start - live`` elementwise, so the same bits."""
    out = []
    with torch.no_grad():
        for s, v in zip(start, live):
            d = torch.empty(s.shape, dtype=s.dtype, device=s.device, pin_memory=s.is_pinned())
            flat_d, flat_s, flat_v = d.view(-1), s.reshape(-1), v.detach().reshape(-1)
            for i in _chunks(flat_d.numel(), chunk):
                part = flat_d[i: i + chunk]
                part.copy_(flat_v[i: i + chunk], non_blocking=False)
                torch.sub(flat_s[i: i + chunk], part, out=part)
            out.append(d)
    return out


def restart_behind_into(live: Sequence[torch.Tensor], start: Sequence[torch.Tensor], global_: Sequence[torch.Tensor],
                        delta: Sequence[torch.Tensor]) -> None:
    """start = global - delta on the host (in place), then live = start copied up: the values of
    ``live = global - delta; start = live``, with no temporary at all."""
    with torch.no_grad():
        for v, s, g, d in zip(live, start, global_, delta):
            torch.sub(g, d, out=s)
            v.copy_(s)


def rebase_into(live: Sequence[torch.Tensor], start: Sequence[torch.Tensor], global_: Sequence[torch.Tensor],
                *, chunk: int = CHUNK) -> None:
    """live = global - (start - live) and start = global, start and global on the host: each chunk of
    `live` comes down into one host buffer of a chunk, the two subtractions run there in
    Diloco.rebase's order, and the result goes back up."""
    with torch.no_grad():
        tmp: torch.Tensor | None = None
        for v, s, g in zip(live, start, global_):
            if not v.is_contiguous():  # a fragment's piece that is no flat view: one copy of the piece
                part = v.to(s.device)
                torch.sub(s, part, out=part)
                torch.sub(g, part, out=part)
                v.copy_(part)
                s.copy_(g)
                continue
            flat_v, flat_s, flat_g = v.view(-1), s.view(-1), g.view(-1)
            n = flat_v.numel()
            if tmp is None or tmp.numel() < min(n, chunk):
                tmp = torch.empty(min(n, chunk), dtype=s.dtype, device=s.device, pin_memory=s.is_pinned())
            for i in _chunks(n, chunk):
                part = tmp[: min(chunk, n - i)]
                part.copy_(flat_v[i: i + chunk])
                torch.sub(flat_s[i: i + chunk], part, out=part)
                torch.sub(flat_g[i: i + chunk], part, out=part)
                flat_v[i: i + chunk].copy_(part)
            s.copy_(g)


__all__ = ["CHUNK", "Placement", "outer_placement", "placed_clone", "pseudo_gradient_into", "rebase_into",
           "restart_behind_into"]
