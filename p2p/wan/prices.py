"""Cloud egress prices between regions (p2p/wan/prices.yaml), and the run config's overrides.

Data, not code: per provider a table of region -> geography, exact pairs, and first-match rules
by source region or geography, each figure with its source (URL and date). A malformed file is
a PriceError naming the file and the dotted key, as a malformed run config is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Literal

import yaml

from .config import parse_link_key

PRICES_FILE = "prices.yaml"
GB = 2**30  # the providers bill GB of 2**30 bytes
PROVIDERS = ("aws", "gcp", "azure")
_TO = ("same", "other", "any")


class PriceError(ValueError):
    """A malformed price table: the message starts with the file and the dotted key."""


@dataclass(frozen=True, kw_only=True)
class Price:
    """$/GB of one directed pair and where the figure comes from."""

    usd_per_gb: float
    source: str          # a key of the file's `sources`, or "config" for network.egress.usd_per_gb
    url: str = ""
    as_of: str = ""


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One first-match rule: traffic from a region or geography to the same, another or any geography."""

    src: str
    to: str
    price: Price


@dataclass(frozen=True, kw_only=True)
class PriceTable:
    """One provider's egress prices."""

    provider: str
    geography: dict[str, str]
    pairs: dict[tuple[str, str], Price]
    rules: tuple[Rule, ...]

    def price(self, src: str, dst: str) -> Price | None:
        """$/GB of traffic src -> dst, or None when the table does not cover the pair."""
        if (src, dst) in self.pairs:
            return self.pairs[(src, dst)]
        gs, gd = self.geography.get(src), self.geography.get(dst)
        if gs is None or gd is None:
            return None
        for r in self.rules:
            if r.src not in (src, gs):
                continue
            if r.to == "any" or (r.to == "same") == (gs == gd):
                return r.price
        return None


@dataclass(frozen=True, kw_only=True)
class EgressConfig:
    """``network.egress``: whose price list prices the run's traffic, and per-link overrides."""

    provider: Literal["aws", "gcp", "azure", "none"] = field(default="aws", metadata={"doc": (
        "price list of p2p/wan/prices.yaml (public list prices, each with its source and date) that turns the bytes "
        "counted at the transport into egress_usd in summary.json and `geofed plan`; none: only the overrides")})
    usd_per_gb: dict[str, float] = field(default_factory=dict, metadata={"doc": (
        "per-link price overrides in $/GB (2**30 bytes): 'a->b' or 'a<->b' -> price ('a->b' wins), e.g. a private "
        "interconnect or a negotiated rate")})
    default_usd_per_gb: float | None = field(default=None, metadata={"doc": (
        "price of a link that neither the overrides nor the price list cover (null: unpriced, reported as such)")})

    def __post_init__(self):
        for key, v in self.usd_per_gb.items():
            try:
                parse_link_key(key)
            except ValueError as exc:
                raise ValueError(f"usd_per_gb: {exc}") from None
            if not (0 <= v < 1e3 and math.isfinite(v)):
                raise ValueError(f"usd_per_gb.{key}: must be in [0, 1000) $/GB, got {v}")
        d = self.default_usd_per_gb
        if d is not None and not 0 <= d < 1e3:
            raise ValueError(f"default_usd_per_gb: must be in [0, 1000) $/GB, got {d}")


class EgressPricer:
    """Prices every directed link: config override, then the provider's table, then the default."""

    def __init__(self, cfg: EgressConfig, table: PriceTable | None = None):
        self.cfg = cfg
        self.table = table if table is not None or cfg.provider == "none" else load_prices()[cfg.provider]
        self._over: dict[tuple[str, str], float] = {}
        # 'a<->b' first so that a directed 'a->b' wins over it.
        for key, v in sorted(cfg.usd_per_gb.items(), key=lambda kv: "<->" not in kv[0]):
            a, b, both = parse_link_key(key)
            for pair in ([(a, b), (b, a)] if both else [(a, b)]):
                self._over[pair] = v

    def price(self, src: str, dst: str) -> Price | None:
        if (src, dst) in self._over:
            return Price(usd_per_gb=self._over[(src, dst)], source="config")
        p = self.table.price(src, dst) if self.table is not None else None
        if p is None and self.cfg.default_usd_per_gb is not None:
            return Price(usd_per_gb=self.cfg.default_usd_per_gb, source="config-default")
        return p

    def usd(self, src: str, dst: str, nbytes: float) -> float | None:
        """Dollars for `nbytes` sent src -> dst, None when the pair is unpriced."""
        p = self.price(src, dst)
        return None if p is None else nbytes / GB * p.usd_per_gb


def load_prices() -> dict[str, PriceTable]:
    """Every provider's table from the packaged prices.yaml (a file of this package, trusted). A
    user's price file is anyone's file: geofed.orchestrator.plan reads it with the strict, bounded
    config reader and hands the parsed mapping to `parse_prices`."""
    text = resources.files("geofed.p2p.wan").joinpath(PRICES_FILE).read_text(encoding="utf-8")
    return parse_prices(yaml.safe_load(text), PRICES_FILE)


def parse_prices(data: Any, name: str = PRICES_FILE) -> dict[str, PriceTable]:
    """The tables of a parsed price file (see prices.yaml for the layout)."""
    def fail(key: str, msg: str):
        raise PriceError(f"{name}: {key}: {msg}")

    if not isinstance(data, dict):
        fail("(top level)", "must be a mapping of sources and providers")
    sources = data.get("sources")
    if not isinstance(sources, dict) or not sources:
        fail("sources", "must map source keys to {url, as_of}")
    for k, s in sources.items():
        for f in ("url", "as_of"):
            if not isinstance(s, dict) or not str(s.get(f) or "").strip():
                fail(f"sources.{k}.{f}", "missing: every figure needs a source URL and a date")
    unknown = sorted(set(data) - {"sources", *PROVIDERS})
    if unknown:
        fail(unknown[0], f"unknown provider (known: {', '.join(PROVIDERS)})")
    return {p: _table(p, data[p], sources, fail) for p in PROVIDERS if p in data}


def _price(row: Any, key: str, sources: dict, fail) -> Price:
    if not isinstance(row, dict):
        fail(key, "must be a mapping with usd_per_gb and source")
    v = row.get("usd_per_gb")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v < 1e3 and math.isfinite(v)):
        fail(f"{key}.usd_per_gb", f"must be a number of $/GB in [0, 1000), got {v!r}")
    src = row.get("source")
    if src not in sources:
        fail(f"{key}.source", f"{src!r} is not a key of `sources` ({', '.join(sorted(sources))})")
    return Price(usd_per_gb=float(v), source=src, url=str(sources[src]["url"]), as_of=str(sources[src]["as_of"]))


def _table(provider: str, raw: Any, sources: dict, fail) -> PriceTable:
    if not isinstance(raw, dict) or not isinstance(raw.get("regions"), dict):
        fail(f"{provider}.regions", "must map region ids to geographies")
    geo = {str(k): str(v) for k, v in raw["regions"].items()}
    pairs: dict[tuple[str, str], Price] = {}
    for key, row in (raw.get("pairs") or {}).items():
        try:
            a, b, both = parse_link_key(str(key))
        except ValueError as exc:
            fail(f"{provider}.pairs.{key}", str(exc))
        price = _price(row, f"{provider}.pairs.{key}", sources, fail)
        for pair in ([(a, b), (b, a)] if both else [(a, b)]):
            pairs[pair] = price
    rules = []
    for i, row in enumerate(raw.get("rules") or []):
        key = f"{provider}.rules.{i}"
        if not isinstance(row, dict) or row.get("to") not in _TO:
            fail(f"{key}.to", f"must be one of {', '.join(_TO)}")
        if row.get("from") not in geo and row.get("from") not in set(geo.values()):
            fail(f"{key}.from", f"{row.get('from')!r} is neither a region nor a geography of {provider}.regions")
        rules.append(Rule(src=str(row["from"]), to=row["to"], price=_price(row, key, sources, fail)))
    return PriceTable(provider=provider, geography=geo, pairs=pairs, rules=tuple(rules))
