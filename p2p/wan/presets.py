"""Named tables of measured inter-region links (p2p/wan/presets.yaml)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import yaml

from .config import LinkSpec, parse_link_key

PRESETS_FILE = "presets.yaml"


@dataclass(frozen=True, kw_only=True)
class Preset:
    """A symmetric table: (a, b) -> LinkSpec with latency_ms (one way) and bandwidth_mbps set."""

    name: str
    description: str
    regions: dict[str, str]            # region id -> place name
    pairs: dict[tuple[str, str], LinkSpec]   # both directions present
    sources: dict[tuple[str, str], str]

    def link(self, src: str, dst: str) -> LinkSpec | None:
        """The measured shape of src->dst, or None when the table does not know the pair."""
        return self.pairs.get((self.canonical(src), self.canonical(dst)))

    def canonical(self, region: str) -> str:
        """Region id for an id or a place name ('Virginia' -> 'us-east-1'); unknown names pass through."""
        if region in self.regions:
            return region
        by_place = {place.lower(): rid for rid, place in self.regions.items()}
        return by_place.get(region.lower(), region)


def preset_names() -> list[str]:
    """The names of the preset tables in presets.yaml, sorted."""
    return sorted(_load_all())


def load_preset(name: str) -> Preset:
    """The preset called `name`; ValueError listing the known names when there is none."""
    table = _load_all()
    if name not in table:
        raise ValueError(f"preset: unknown preset {name!r} (known: {', '.join(sorted(table))})")
    return _build(name, table[name])


def _load_all() -> dict:
    text = resources.files("geofed.p2p.wan").joinpath(PRESETS_FILE).read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    assert isinstance(data, dict), f"{PRESETS_FILE} must be a mapping of presets"
    return data


def _build(name: str, raw: dict) -> Preset:
    regions = {str(k): str(v) for k, v in raw["regions"].items()}
    pairs: dict[tuple[str, str], LinkSpec] = {}
    sources: dict[tuple[str, str], str] = {}
    for key, row in raw["pairs"].items():
        a, b, both = parse_link_key(key)
        # A preset row is a measurement between two VMs, so it is symmetric by construction.
        assert both, f"{PRESETS_FILE}: {name}.pairs.{key}: preset pairs are symmetric ('a<->b')"
        assert a in regions and b in regions, f"{PRESETS_FILE}: {name}.pairs.{key}: region not in {name}.regions"
        spec = LinkSpec(latency_ms=float(row["rtt_ms"]) / 2, bandwidth_mbps=float(row["bandwidth_gbps"]) * 1000)
        for pair in ((a, b), (b, a)):
            assert pair not in pairs, f"{PRESETS_FILE}: {name}.pairs.{key}: pair listed twice"
            pairs[pair] = spec
            sources[pair] = str(row.get("source", ""))
    return Preset(name=name, description=str(raw.get("description", "")), regions=regions, pairs=pairs, sources=sources)
