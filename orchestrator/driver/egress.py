"""What a run's cross-region traffic cost: the bytes the transport counted, priced per link.

Every byte that left a region over geofed's gRPC links is counted at the transport (updates,
state fetches, the set-up probes), per peer; network.egress prices it with the provider's list
price (p2p/wan/prices.yaml) or the config's override. Ray's control plane is not counted.
"""

from __future__ import annotations

from typing import Any

from geofed.p2p.wan.prices import GB, EgressPricer

from ..config import RunConfig


def link_bytes_at_transport(transport_stats: dict[str, dict]) -> dict[str, int]:
    """Bytes sent per directed link 'a->b', updates and probes, as each sender's transport counted them."""
    out: dict[str, int] = {}
    for region, s in transport_stats.items():
        for key in ("bytes_sent", "probe_bytes_sent"):
            for peer, n in (s.get(key) or {}).items():
                out[f"{region}->{peer}"] = out.get(f"{region}->{peer}", 0) + int(n)
    return out


def add_egress(cfg: RunConfig, links: dict[str, dict], transport_stats: dict[str, dict]) -> dict[str, Any]:
    """Put egress_bytes, usd_per_gb and egress_usd in every entry of summary.json's `links` and
    return the run's totals; links that carried no update (only probes, say) go to
    `egress.other_links`, so that `links` stays the links of the topology."""
    pricer = EgressPricer(cfg.network.egress)
    counted = link_bytes_at_transport(transport_stats)
    other = {link: {"bytes": 0} for link in counted if link not in links}
    total, unpriced, sources = 0.0, [], {}
    for link, entry in [*links.items(), *other.items()]:
        src, dst = link.split("->", 1)
        nbytes = counted.get(link, entry.get("bytes", 0))  # no transport stats (a crash): the rounds' count
        price = pricer.price(src, dst)
        entry["egress_bytes"] = nbytes
        entry["usd_per_gb"] = None if price is None else price.usd_per_gb
        entry["egress_usd"] = None if price is None else round(nbytes / GB * price.usd_per_gb, 9)
        if price is None:
            unpriced.append(link)
            continue
        total += entry["egress_usd"]
        if price.url:
            sources[price.source] = {"url": price.url, "as_of": price.as_of}
    return {"egress_usd": round(total, 9),
            "egress": {"provider": cfg.network.egress.provider, "gb_bytes": GB, "unpriced_links": sorted(unpriced),
                       "other_links": {k: {f: v[f] for f in ("egress_bytes", "usd_per_gb", "egress_usd")}
                                       for k, v in other.items()},
                       "sources": sources, "counted": "bytes sent over geofed's gRPC links (updates, fetches, probes)"}}
