"""Keys that name a region must name one of ``regions.names``.

A link override, a schedule event, a price override, a label, a slowdown, an absence window or
the head region that names a region the run does not have is a typo. Left alone it either does
nothing (a price or a link shape that never applies) or fails deep in set-up (the emulator's
schedule, after Ray and every region started), so the config refuses it when it is built:
`geofed validate` and `geofed run` alike, exit 2, one line with the dotted key, the unknown
region and the known ones.

The references inside ``regions`` are checked by RegionsSection itself (its keys are relative to
the section, and the loader prefixes ``regions.``); the others by RunConfig, which sees both.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from geofed.p2p.wan.config import parse_link_key

from .errors import ConfigError


def unknown_region_message(region: str, names: Sequence[str]) -> str:
    """The one wording every unknown-region error uses (without its key)."""
    return f"{region!r} is not one of regions.names ({', '.join(names)})"


def first_unknown(refs: Iterable[tuple[str, str]], names: Sequence[str]) -> tuple[str, str] | None:
    """The first (key, region) of `refs` whose region is not in `names`, or None."""
    known = set(names)
    return next(((key, region) for key, region in refs if region not in known), None)


def section_refs(regions: Any) -> Iterator[tuple[str, str]]:
    """(key inside ``regions``, region) for every region a RegionsSection names besides its names."""
    for region in regions.labels:
        yield f"labels.{region}", region
    emulation = regions.emulation
    for region in emulation.slowdown:
        yield f"emulation.slowdown.{region}", region
    for i, window in enumerate(emulation.availability.schedule):
        yield f"emulation.availability.schedule.{i}.region", window.region


def run_refs(cfg: Any) -> Iterator[tuple[str, str]]:
    """(dotted key, region) for every region the sections other than ``regions`` name, in file order."""
    em = cfg.network.emulation
    for key in em.links:
        yield from _link_ends(f"network.emulation.links.{key}", key)
    for i, event in enumerate(em.schedule):
        if event.link != "*":
            yield from _link_ends(f"network.emulation.schedule.{i}.link", event.link)
    for key in cfg.network.egress.usd_per_gb:
        yield from _link_ends(f"network.egress.usd_per_gb.{key}", key)
    if cfg.launch.head_region is not None:
        yield "launch.head_region", cfg.launch.head_region


def check_section_refs(regions: Any) -> None:
    """ValueError('key: ...') for RegionsSection.__post_init__ (the loader prefixes ``regions.``)."""
    bad = first_unknown(section_refs(regions), regions.names)
    if bad is not None:
        raise ValueError(f"{bad[0]}: {unknown_region_message(bad[1], regions.names)}")


def check_run_refs(cfg: Any) -> None:
    """ConfigError at the dotted key for RunConfig.__post_init__."""
    names = cfg.regions.names
    bad = first_unknown(run_refs(cfg), names)
    if bad is not None:
        raise ConfigError(bad[0], unknown_region_message(bad[1], names))


def _link_ends(key: str, link: str) -> Iterator[tuple[str, str]]:
    a, b, _ = parse_link_key(link)  # the sections checked the key's form when they were built
    yield key, a
    yield key, b
