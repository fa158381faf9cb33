"""Which codecs secure aggregation can carry (docs/privacy.md). Kept apart from
the protocol so that the config loader can ask without importing the cryptography.

Masking needs every region's update as integers on one shared grid, summed coordinate by
coordinate: int8/int4 (with a shared per-chunk scale), shared-seed random-k over such values, or
floats that the secure-aggregation quantiser puts on that grid. A codec whose wire shows
data-dependent structure, or whose outputs do not add up, is refused.
"""

from __future__ import annotations

from geofed.compression import CodecSpec

_REFUSED = {
    "topk": "top-k sends the indices of each region's largest values in the clear (masking hides the values, "
            "not where they are) and different regions' index sets do not sum",
    "sign": "sign scales each region's bits by its own mean |value|: the scaled signs of different regions "
            "do not add up as integers",
    "powersgd": "PowerSGD's low-rank factors are products of each region's update: their sum is not a "
                "factorisation of the sum",
}


def secagg_codec_problem(spec: CodecSpec) -> str | None:
    """Why `spec` cannot go under secure aggregation, or None when it can."""
    if spec.kind in _REFUSED:
        return _REFUSED[spec.kind]
    for name, value in spec.params:
        if isinstance(value, CodecSpec):
            inner = secagg_codec_problem(value)
            if inner is not None:
                return f"its {name} codec {value.key}: {inner}"
    return None
