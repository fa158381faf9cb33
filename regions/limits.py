"""What a region accepts from its peers, sized from its own model (docs/p2p.md, "Memory budget").

A region knows its model, so it knows the largest honest message: the model's update encoded
with the least compressing codec the run may use (compression.codec and ladder). Anything
bigger is refused before a byte is read, and the memory one peer can make it hold follows:

- ``max_message_bytes`` = that largest encoding x MESSAGE_MARGIN, at least 1 MiB
  (``network.max_message_mb`` overrides); with secure aggregation the masked update, at
  ``security.secagg_bits`` per value, counts as an encoding;
- ``peer_budget_bytes``: 2 messages in flight + ``round_window + 1`` decoded updates waiting for
  their round (fp32, 4 bytes per value) (``network.peer_memory_mb`` overrides);
- ``max_state_bytes``: the largest state a donor may send on FetchState (the model, the outer
  optimizer or the gossip public copies: a few model copies per region);
- ``decode_bytes``: the bound decode_update applies to a payload and its fp32 result;
- ``max_rpc_s``: the longest client deadline a call may carry (pushes use sync.deadline.max_s).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from geofed.compression import make_codec

MiB = 1 << 20
MESSAGE_MARGIN = 1.5
_HEADER_SLACK = 4096  # the wire header: codec spec, tensor and section records (docs/compression.md)


@dataclass(frozen=True, kw_only=True)
class WireLimits:
    """The size and time bounds of one region's transport, derived from its model (see the module docstring)."""

    max_message_bytes: int
    peer_budget_bytes: int
    max_state_bytes: int
    decode_bytes: int
    max_rpc_s: float


def encoded_bytes(spec: Any, shapes: Sequence[tuple[int, ...]]) -> int:
    """The payload size of an update of these shapes under codec `spec` (its sections, no encode)."""
    numel = sum(math.prod(s) for s in shapes)
    if numel == 0:
        return _HEADER_SLACK
    codec = make_codec(spec)
    return math.ceil(4 * numel / codec.estimate_ratio(numel, list(shapes))) + _HEADER_SLACK + 24 * len(shapes)


def wire_limits(cfg: Any, shapes: Sequence[tuple[int, ...]]) -> WireLimits:
    """The size and time bounds of one region's wire, from the run config and `shapes`, the
    tensors one message holds (the sync algorithm's wire_shapes)."""
    decoded = 4 * sum(math.prod(s) for s in shapes)
    net, comp = cfg.network, cfg.compression
    if net.max_message_mb is not None:
        message = net.max_message_mb * MiB
    else:
        largest = max(encoded_bytes(spec, shapes) for spec in (comp.codec, *comp.ladder))
        if cfg.security.secure_aggregation:
            # The masked update is security.secagg_bits per value whatever the codec (regions/secagg/):
            # at 32 bits a 1M-parameter model's 4.2 MB was refused against an int8-sized cap.
            largest = max(largest, math.ceil(decoded // 4 * cfg.security.secagg_bits / 8) + _HEADER_SLACK)
        message = max(MiB, math.ceil(largest * MESSAGE_MARGIN))
    window = cfg.security.round_window
    budget = net.peer_memory_mb * MiB if net.peer_memory_mb is not None else 2 * message + (window + 1) * decoded
    regions = len(cfg.regions.names)
    state = max(message, math.ceil((regions + 6) * decoded * MESSAGE_MARGIN) + MiB)
    return WireLimits(max_message_bytes=message, peer_budget_bytes=max(budget, message), max_state_bytes=state,
                      decode_bytes=max(message, decoded + _HEADER_SLACK), max_rpc_s=max(60.0, cfg.sync.deadline.max_s + 30))
