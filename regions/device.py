"""Where a region trains (``regions.device``) and in which precision (``sync.inner.precision``).

The device is decided inside the region's actor, on the node it landed on: ``auto`` takes the
node's first GPU where it has one and the CPU otherwise; ``cuda`` or ``cuda:N`` demand a GPU and
fail (DeviceError, naming the key, the region and what the node has) where there is none. A run
never falls back to the CPU silently.

Precision is torch autocast around the forward pass and the loss: ``bf16`` and ``fp16`` run the
matrix products in 16 bits while the parameters, optimiser state, pseudo-gradients and what goes
on the wire stay fp32. ``fp16`` gradients go through a GradScaler (a loss scale that backs off on
overflow) on every device that has one; bf16 has fp32's range and needs none.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import torch

DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?")
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class DeviceError(RuntimeError):
    """regions.device asks for something this node does not have."""


def node_devices() -> str:
    """What this node has, in words (for errors and the summary)."""
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return f"{n} CUDA device(s): " + ", ".join(torch.cuda.get_device_name(i) for i in range(n))
    return "no CUDA device (torch.cuda.is_available() is False)"


def resolve_device(spec: str, *, region: str = "?") -> torch.device:
    """The torch device `spec` (regions.device) names on this node; DeviceError where it has none."""
    if not DEVICE_RE.fullmatch(spec):
        raise DeviceError(f"regions.device: expected auto, cpu, cuda or cuda:N, got {spec!r}")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(f"regions.device is {spec!r} but region {region}'s node has {node_devices()}; "
                          f"set regions.device to auto or cpu, or place the region on a node with a GPU")
    index = int(spec.split(":")[1]) if ":" in spec else 0
    if index >= torch.cuda.device_count():
        raise DeviceError(f"regions.device is {spec!r} but region {region}'s node has {node_devices()}")
    return torch.device("cuda", index)


def device_name(device: torch.device) -> str:
    """A human name: the GPU's model, or the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor in it (nested tuples, lists, dicts; objects with .to) on `device`."""
    if device.type == "cpu" and not isinstance(batch, (list, tuple, dict)):
        return batch.to(device) if isinstance(batch, torch.Tensor) else batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        moved = [to_device(b, device) for b in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    to = getattr(batch, "to", None)
    return to(device) if callable(to) else batch


class Precision:
    """Autocast and (for fp16) gradient scaling of one region's inner steps."""

    def __init__(self, precision: str, device: torch.device):
        if precision not in PRECISIONS:
            raise ValueError(f"sync.inner.precision: expected one of {', '.join(PRECISIONS)}, got {precision!r}")
        self.name, self.device = precision, device
        self.dtype = PRECISIONS[precision]
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context the forward pass and the loss run in."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """loss.backward(), scaled for fp16; gradients are unscaled at once, so whatever runs between
        backward and step (gradient tracking's correction) sees true gradients."""
        if self.scaler is None:
            loss.backward()
            return
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """optimizer.step(); for fp16 skipped when the gradients overflowed, and the scale adjusted."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        """The loss scale's state (fp16), for checkpoints."""
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the loss scale (ignored where there is no scaler)."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def move_received(received: dict[str, list[torch.Tensor]], device: torch.device,
                  ) -> dict[str, list[torch.Tensor]]:
    """Decoded updates (host memory) on the region's device, where its pseudo-gradients are."""
    if device.type == "cpu":
        return received
    return {peer: [t.to(device, non_blocking=True) for t in ts] for peer, ts in received.items()}

