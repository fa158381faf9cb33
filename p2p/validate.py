"""The validator a region gives its transport for geofed.compression updates.

Runs on the receiving server thread before the push is acknowledged, so a bad update is
refused to its sender (``invalid_payload``) instead of failing later inside training.
``decode_update`` bounds sizes, checks shapes against the model's and refuses NaN/Inf; its
``CodecError`` is a ``ValueError``, which the transport turns into the refusal.
"""

from __future__ import annotations

from collections.abc import Sequence

from .transport import Validator


def update_validator(*, max_bytes: int, expected_shapes: Sequence[tuple[int, ...]] | None = None) -> Validator:
    """A Validator decoding a geofed.compression update within `max_bytes` (and `expected_shapes`,
    if given); its CodecError, a ValueError, becomes the sender's ``invalid_payload`` refusal.
    """
    from geofed.compression import decode_update

    shapes = None if expected_shapes is None else [tuple(s) for s in expected_shapes]

    def validate(sender: str, round: int, payload: memoryview):
        return decode_update(payload, max_bytes=max_bytes, expected_shapes=shapes)

    return validate
