"""Peak-to-mean rate of a link: how bursty its traffic is (Streaming DiLoCo's peak bandwidth).

A link's sends (metrics.jsonl ``transfers``: bytes, seconds, ``t_end`` on the sender's wall
clock) are spread evenly over each push's own interval ``[t_end - seconds, t_end]`` and summed
into windows of ``window_s`` seconds, from the link's first push to its last. The ratio is the
busiest window's bytes over the mean window's (1.0: the link carries the same bytes in every
window; N: all of it in 1/N of the windows). It depends on the window against the round: a
window much longer than a round sees every round alike (near 1 for any schedule), one much
shorter than a push sees only line rate and idle time. WINDOW_S (2 s) lies between a fragment
round and a whole-model round of `geofed bench wan`'s adaptive arms (about 0.5-1.5 s and 1.5-4 s
on the 2-core machine), so it shows whether a period's bytes go out in one burst or in N smaller
pushes. Pushes without ``t_end`` (older runs) are skipped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

WINDOW_S = 2.0
MIN_WINDOWS = 3  # fewer windows than this: no meaningful ratio (None)


def peak_to_mean(pushes: Iterable[tuple[float, float, float]], window_s: float = WINDOW_S) -> float | None:
    """Busiest window's bytes / mean window's bytes for pushes of (t_end, seconds, bytes); None when the
    link's traffic spans fewer than MIN_WINDOWS windows or carries no bytes."""
    spans = [(t - max(0.0, s), t, b) for t, s, b in pushes if b > 0]
    if not spans:
        return None
    t0 = min(a for a, _, _ in spans)
    n = math.ceil((max(e for _, e, _ in spans) - t0) / window_s)
    if n < MIN_WINDOWS:
        return None
    bins = [0.0] * n
    for a, e, b in spans:
        _spread(bins, (a - t0) / window_s, (e - t0) / window_s, b)
    mean = sum(bins) / n
    return round(max(bins) / mean, 4) if mean > 0 else None


def _spread(bins: list[float], lo: float, hi: float, nbytes: float) -> None:
    """Add `nbytes` evenly over [lo, hi) (in window units) to `bins`; a zero-length push lands in one bin."""
    last = len(bins) - 1
    if hi - lo <= 1e-12:
        bins[min(last, int(lo))] += nbytes
        return
    rate = nbytes / (hi - lo)
    k = int(lo)
    while k <= last and k < hi:
        overlap = min(hi, k + 1) - max(lo, k)
        if overlap > 0:
            bins[k] += rate * overlap
        k += 1


def link_peak_to_mean(metrics: list[dict], window_s: float = WINDOW_S) -> dict[str, float | None]:
    """Every directed link's peak-to-mean ratio, keyed 'src->dst', from metrics.jsonl records."""
    pushes: dict[str, list[tuple[float, float, float]]] = {}
    for m in metrics:
        for t in m.get("transfers", []):
            if t.get("direction") == "send" and t.get("t_end") is not None:
                pushes.setdefault(f"{m['region']}->{t['peer']}", []).append(
                    (float(t["t_end"]), float(t.get("seconds") or 0.0), float(t["bytes"])))
    return {link: peak_to_mean(p, window_s) for link, p in pushes.items()}


def busiest(links: dict[str, dict]) -> tuple[str | None, float | None]:
    """(link, its peak-to-mean) of the link that carried the most bytes (summary.json's ``links``)."""
    rated = [(e.get("bytes", 0), k, e.get("peak_to_mean")) for k, e in links.items()]
    if not rated:
        return None, None
    _, link, ratio = max(rated)
    return link, ratio
