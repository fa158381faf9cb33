"""The configured state of every directed link: preset -> overrides -> schedule -> scale, and outages.

Pure bookkeeping (no sockets, no asyncio) so it can be tested on its own; the proxy reads it on
every chunk and the emulator's schedule writes it, from different threads, hence the lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from .config import EmulationConfig, LinkSpec, ScheduleEvent, parse_link_key
from .presets import Preset

log = logging.getLogger(__name__)

Pair = tuple[str, str]


def link_name(pair: Pair) -> str:
    """The display and config name of a directed pair: 'src->dst'."""
    return f"{pair[0]}->{pair[1]}"


@dataclass(frozen=True)
class Shape:
    """A resolved link in the units the shaper uses."""

    spec: LinkSpec          # every field set, bandwidth already scaled
    latency_s: float
    rate_bps: float         # bytes per second
    jitter_s: float
    loss: float

    @classmethod
    def of(cls, spec: LinkSpec) -> "Shape":
        assert spec.latency_ms is not None and spec.bandwidth_mbps is not None
        return cls(spec=spec, latency_s=spec.latency_ms / 1e3, rate_bps=spec.bandwidth_mbps * 1e6 / 8,
                   jitter_s=(spec.jitter_ms or 0.0) / 1e3, loss=spec.loss or 0.0)


@dataclass(frozen=True)
class Outage:
    """A cut of one direction over [start_s, end_s) (emulator clock): 'stall' holds the bytes,
    'reset' resets the connections."""

    start_s: float
    end_s: float
    mode: str               # "stall" | "reset"


def _warn_unmeasured(preset: Preset | None, pairs: Sequence[Pair]) -> None:
    """One line for every link the preset has no figures for (a run of 10 regions with one unnamed
    region has 18 such links, and a line each buried the rest of the output)."""
    if preset is None:
        return
    missing = [link_name(p) for p in pairs if preset.link(*p) is None]
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        log.warning("wan: preset %r has no figures for %d link%s (%s); %s network.emulation.default", preset.name,
                    len(missing), "s" * (len(missing) > 1), shown, "they use" if len(missing) > 1 else "it uses")


class LinkTable:
    """Every directed link between `regions`, resolved now; times are seconds on the emulator clock."""

    def __init__(self, config: EmulationConfig, regions: Sequence[str], preset: Preset | None):
        if len(set(regions)) != len(regions):
            raise ValueError(f"regions: names must be unique, got {list(regions)}")
        self.config = config
        self.preset = preset
        self.regions = tuple(regions)
        self.pairs: tuple[Pair, ...] = tuple((a, b) for a in self.regions for b in self.regions if a != b)
        self._lock = threading.Lock()
        self._base = {p: self._resolve_base(p, preset) for p in self.pairs}
        _warn_unmeasured(preset, self.pairs)
        self._changes: dict[Pair, LinkSpec] = {}
        self._outages: dict[Pair, list[Outage]] = {p: [] for p in self.pairs}
        self._shapes = {p: self._shape_of(p) for p in self.pairs}
        for i, ev in enumerate(config.schedule):
            if ev.link != "*":
                self._check_regions(ev.link, f"schedule.{i}.link")

    def add_region(self, region: str, *, like: str | None = None) -> list[Pair]:
        """Links between a region that joined the run under a new name and every region before it
        (orchestrator/driver/membership.py); returns them. `like`: a region whose configured links
        its own copy in both directions (the link between the two is network.emulation.default);
        None: each new link resolved as at start (the default, the preset's figures where it has them).
        Schedule changes made before the join are not replayed on them; those after apply as to any link."""
        if region in self.regions:
            raise ValueError(f"regions: {region!r} is already one of the run's regions")
        if like is not None and like not in self.regions:
            raise ValueError(f"like: {like!r} is not one of the run's regions ({', '.join(self.regions)})")
        new = [p for r in self.regions for p in ((region, r), (r, region))]
        base = {}
        for a, b in new:
            other = b if a == region else a
            if like is None or other == like:
                base[(a, b)] = self._resolve_base((a, b), self.preset)
            else:
                base[(a, b)] = self._base[(like, b) if a == region else (a, like)]
        _warn_unmeasured(self.preset, [p for p in new if like is None or like in p])
        with self._lock:
            self._base.update(base)
            self._outages.update({p: [] for p in new})
            self._shapes.update({p: self._shape_of(p) for p in new})
            self.regions = (*self.regions, region)
            self.pairs = (*self.pairs, *new)
        return new

    def _check_regions(self, key: str, where: str) -> list[Pair]:
        a, b, both = parse_link_key(key)
        for r in (a, b):
            if r not in self.regions:
                raise ValueError(f"{where}: region {r!r} in {key!r} is not one of the run's regions ({', '.join(self.regions)})")
        return [(a, b), (b, a)] if both else [(a, b)]

    def _resolve_base(self, pair: Pair, preset: Preset | None) -> LinkSpec:
        default = self.config.default
        measured = preset.link(*pair) if preset is not None else None
        spec = default.merged(measured) if measured is not None else default
        # 'a<->b' first so that a directed 'a->b' override wins over it.
        for key, over in sorted(self.config.links.items(), key=lambda kv: "->" in kv[0] and "<->" not in kv[0]):
            if pair in self._check_regions(key, f"links.{key}"):
                spec = spec.merged(over)
        return spec

    def _shape_of(self, pair: Pair) -> Shape:
        spec = self._base[pair]
        if pair in self._changes:
            spec = spec.merged(self._changes[pair])
        assert spec.bandwidth_mbps is not None
        scaled = LinkSpec(latency_ms=spec.latency_ms, bandwidth_mbps=spec.bandwidth_mbps * self.config.bandwidth_scale,
                          jitter_ms=spec.jitter_ms or 0.0, loss=spec.loss or 0.0)
        return Shape.of(scaled)

    def targets(self, key: str) -> list[Pair]:
        return list(self.pairs) if key == "*" else self._check_regions(key, "link")

    def shape(self, src: str, dst: str) -> Shape:
        """Hot path: a dict read (atomic under the GIL); writers replace whole Shape objects."""
        try:
            return self._shapes[(src, dst)]
        except KeyError:
            raise ValueError(f"link: no link {src}->{dst} between the run's regions ({', '.join(self.regions)})") from None

    def configured(self, src: str, dst: str) -> LinkSpec:
        return self.shape(src, dst).spec

    def apply(self, event: ScheduleEvent, now_s: float, with_outage: bool = True) -> list[Pair]:
        """Apply one schedule event at emulator time `now_s`; returns the links it touched.

        `with_outage=False`: its outage window was put in place ahead of time (add_outage).
        """
        pairs = self.targets(event.link)
        with self._lock:
            for p in pairs:
                if event.set is not None:
                    prev = self._changes.get(p, LinkSpec())
                    self._changes[p] = prev.merged(event.set)
                    self._shapes[p] = self._shape_of(p)
                if event.end_outage:   # ends the windows in force, not those still to come
                    self._outages[p] = [Outage(start_s=o.start_s, end_s=min(o.end_s, now_s) if o.start_s <= now_s else o.end_s,
                                               mode=o.mode) for o in self._outages[p]]
            if event.outage_s is not None and with_outage:
                self._add_outage(pairs, event, now_s)
        return pairs

    def add_outage(self, event: ScheduleEvent, start_s: float) -> list[Pair]:
        """Put `event`'s outage window in place now, starting at `start_s` (may be in the future).

        The emulator does this at start for every `at_s` outage, so a late schedule timer (a busy
        machine) cannot let bytes through at the start of the window.
        """
        pairs = self.targets(event.link)
        with self._lock:
            self._add_outage(pairs, event, start_s)
        return pairs

    def _add_outage(self, pairs: list[Pair], event: ScheduleEvent, start_s: float) -> None:
        assert event.outage_s is not None
        for p in pairs:
            # Kept after they end: outage_seconds() sums them for the stats.
            self._outages[p] = [*self._outages[p], Outage(start_s=start_s, end_s=start_s + event.outage_s, mode=event.outage_mode)]

    def outage(self, src: str, dst: str, now_s: float) -> Outage | None:
        """The outage in force on src->dst at `now_s` (the one lasting longest), or None."""
        live = [o for o in self._outages[(src, dst)] if o.start_s <= now_s < o.end_s]
        if not live:
            return None
        return max(live, key=lambda o: (o.mode == "reset", o.end_s))

    def outage_seconds(self, src: str, dst: str, now_s: float) -> float:
        """Seconds of outage on src->dst up to `now_s` (windows merged, for stats)."""
        spans = sorted((o.start_s, min(o.end_s, now_s)) for o in self._outages[(src, dst)] if o.start_s < now_s)
        total, end = 0.0, float("-inf")
        for s, e in spans:
            s = max(s, end)
            if e > s:
                total += e - s
                end = e
        return total
