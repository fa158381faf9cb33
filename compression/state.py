"""Per-stream codec state: one `CodecState` per directed peer link (or per CHOCO public copy).

Holds what must survive from one round to the next on the *sending* side: the error-feedback
residual, PowerSGD's warm-start Q, the random-k seed counter and the generator used for
sampling and stochastic rounding, byte counters, and the last payloads it produced (reused
in place once nobody else holds them; see buffers.py). Receivers need no state: every
payload carries what decoding needs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from .buffers import PayloadPool

Shape = tuple[int, ...]
# Scratch buffers whose contents are garbage between encodes: not worth a checkpoint's bytes.
_SCRATCH_KEYS = ("scratch", "topk.mask")


class CodecState:
    """Mutable state of one encoding stream.

    error_feedback: keep what a lossy codec dropped and add it to the next update. It is
    applied only with contractive codecs (`codec.contractive`): with unbiased rescaled ones
    (random-k, stochastic int8) EF diverges, so there it is skipped and `ef_applied` says so.
    seed: seeds the sampling/stochastic-rounding generator and random-k's seeds (default: fresh
    entropy, so two links never share random-k index sets by accident).
    Not thread-safe: one stream is encoded by one thread at a time.
    """

    def __init__(self, error_feedback: bool = True, *, seed: int | None = None):
        if not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback: must be true or false, got {error_feedback!r}")
        self.error_feedback = error_feedback
        self.seed = int.from_bytes(os.urandom(8), "little") >> 1 if seed is None else int(seed)
        self.residual: torch.Tensor | None = None
        self.shapes: tuple[Shape, ...] | None = None
        self.ef_applied = False
        self.counter = 0  # encodes so far; also random-k's per-update seed counter
        self.bytes_raw = 0  # fp32 bytes of the updates encoded
        self.bytes_wire = 0  # bytes of the payloads produced
        self.store: dict[str, Any] = {}  # codec-private entries, keyed "<kind>.<what>"
        self.input_absmax: float | None = None  # max |x| of the buffer being encoded, when known
        self._generator: torch.Generator | None = None
        # The last payload, reused once its holders drop it. One, not two: the exchange in flight is
        # settled before the next is encoded (regions/sync/overlap.py), so the last one is free by then
        # unless a stalled push still holds it (then a fresh one: its page faults, not a held 1 B/param
        # at int8 every round; issue 39).
        self.payloads = PayloadPool(capacity=1)

    @property
    def generator(self) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator().manual_seed(self.seed & 0x7FFF_FFFF_FFFF_FFFF)
        return self._generator

    @property
    def ratio(self) -> float:
        """fp32 bytes / wire bytes over every update this state encoded (0.0 before the first)."""
        return self.bytes_raw / self.bytes_wire if self.bytes_wire else 0.0

    def bind(self, shapes: Sequence[Shape]) -> None:
        """Tie the state to one model layout; a changed layout is a caller bug, said loudly."""
        shapes = tuple(tuple(s) for s in shapes)
        if self.shapes is None:
            self.shapes = shapes
        elif self.shapes != shapes:
            raise ValueError(
                f"state: this CodecState encoded tensors of shapes {_brief(self.shapes)} and now gets {_brief(shapes)};"
                " use one CodecState per stream, or call reset()"
            )

    def reset(self) -> None:
        """Forget the residual, warm starts and the bound layout (counters are kept)."""
        self.residual = None
        self.shapes = None
        self.store.clear()
        self.payloads.clear()

    def state_dict(self) -> dict[str, Any]:
        """What a restored stream needs to encode exactly as this one would have: the seed, the
        residual and warm starts, the bound layout, the counters and the generator's state.
        Scratch buffers (garbage between encodes) and the payload pool are left out."""
        return {"seed": self.seed, "residual": self.residual, "shapes": self.shapes, "ef_applied": self.ef_applied,
                "counter": self.counter, "bytes_raw": self.bytes_raw, "bytes_wire": self.bytes_wire,
                "store": {k: v for k, v in self.store.items() if k not in _SCRATCH_KEYS},
                "generator": None if self._generator is None else self._generator.get_state()}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore `state_dict()` into this state (its error_feedback setting is kept)."""
        self.seed = int(d["seed"])
        self.residual = None if d["residual"] is None else d["residual"].clone()
        self.shapes = None if d["shapes"] is None else tuple(tuple(s) for s in d["shapes"])
        self.ef_applied, self.counter = bool(d["ef_applied"]), int(d["counter"])
        self.bytes_raw, self.bytes_wire = int(d["bytes_raw"]), int(d["bytes_wire"])
        self.store.clear()
        self.store.update(d["store"])
        self.payloads.clear()
        self._generator = None
        if d["generator"] is not None:
            self.generator.set_state(d["generator"])

    def residual_buffer(self, numel: int) -> torch.Tensor:
        if self.residual is None:
            self.residual = torch.zeros(numel, dtype=torch.float32)
        assert self.residual.numel() == numel
        return self.residual

    def scratch(self, numel: int) -> torch.Tensor:
        """A reusable fp32 buffer of numel elements (its contents are garbage); with error
        feedback it swaps roles with the residual every update."""
        buf = self.store.get("scratch")
        if buf is None or buf.numel() != numel:
            buf = self.store["scratch"] = torch.empty(numel)
        return buf

    def __repr__(self) -> str:
        return (f"CodecState(error_feedback={self.error_feedback}, updates={self.counter}, "
                f"bytes_raw={self.bytes_raw}, bytes_wire={self.bytes_wire})")


def _brief(shapes: tuple[Shape, ...]) -> str:
    text = ", ".join(str(s) for s in shapes[:4])
    return f"[{text}{', ...' if len(shapes) > 4 else ''}] ({len(shapes)} tensors)"
