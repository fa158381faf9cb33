"""`geofed plan`: predict round time, utilisation, bytes and egress dollars before a run (docs/plan.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from geofed.compression import CodecSpec
from geofed.p2p.wan.prices import EgressPricer, load_prices

from ..config import RunConfig
from .inputs import codec_facts, config_segments, file_segments, out_links, probe_task
from .model import ROUND_OVERHEAD_ALONE_S, Candidate, Setup, predict, recommend

DEFAULT_H = (20, 50, 100, 200, 400, 1000)
DEFAULT_CODECS = ("fp16", "int8", "topk(fraction=0.01)")


def config_H(cfg: RunConfig) -> int:
    """The H a config runs with (fixed: H; adaptive: its initial H)."""
    p = cfg.sync.policy
    return int(getattr(p, "H", None) or getattr(p, "initial_H", 0) or 50)


def candidate_codecs(cfg: RunConfig, codecs: Sequence[str] | None) -> list[CodecSpec]:
    """The codecs to compare: the given ones, else the config's codec and ladder and the defaults."""
    if codecs:
        return [CodecSpec.parse(c) for c in codecs]
    specs = [cfg.compression.codec, *cfg.compression.ladder, *(CodecSpec.parse(c) for c in DEFAULT_CODECS)]
    return list(dict.fromkeys(specs))


def build_setup(cfg: RunConfig, *, regions: Sequence[str], step_s: float, links_path: str | None,
                pricer: EgressPricer, overhead_s: float | None = None,
                contention: float = 1.0) -> tuple[Setup, list[str]]:
    """The candidates' shared Setup: the link matrix from `links_path` or the config's emulation."""
    if links_path:
        segments, notes = file_segments(links_path, regions, pricer), [f"links from {links_path}"]
    else:
        segments, notes = config_segments(cfg.network.emulation, regions, pricer)
    rtt_factor = float(getattr(cfg.sync.policy, "rtt_factor", 1.0))
    setup = Setup(step_s=step_s, rounds=cfg.run.rounds, max_steps=cfg.run.max_steps, overlap=bool(cfg.sync.overlap),
                  out_links=out_links(cfg, regions), segments=segments, rtt_factor=rtt_factor,
                  overhead_s=ROUND_OVERHEAD_ALONE_S if overhead_s is None else overhead_s, contention=contention)
    return setup, notes


def plan(cfg: RunConfig, *, regions: Sequence[str] | None = None, Hs: Sequence[int] | None = None,
         codecs: Sequence[str] | None = None, step_s: float | None = None, links_path: str | None = None,
         prices_path: str | None = None, utilization_floor: float = 0.9, budget_usd_per_hour: float | None = None,
         overhead_s: float | None = None, contention: float = 1.0) -> dict[str, Any]:
    """Every candidate's prediction and the recommendations, as `geofed plan --json` prints them.

    `contention`: the regions' step time over this machine's alone (>= 1; docs/plan.md); a probed
    step time is multiplied by it, a given one (`step_s`) is taken as the regions will see it.
    """
    regions = list(regions or cfg.regions.names)
    if len(regions) < 2:
        raise ValueError("regions: the plan needs at least 2 regions (one region sends nothing)")
    table = None
    if prices_path is not None and cfg.network.egress.provider != "none":
        table = load_prices(prices_path).get(cfg.network.egress.provider)
    pricer = EgressPricer(cfg.network.egress, table) if prices_path else EgressPricer(cfg.network.egress)
    facts = probe_task(cfg, probe=step_s is None)
    step = step_s if step_s is not None else facts.step_s * contention
    setup, notes = build_setup(cfg, regions=regions, step_s=step, links_path=links_path, pricer=pricer,
                               overhead_s=overhead_s, contention=contention)
    in_peers = max(1, round(len(setup.out_links) / len(regions)))
    H_max = getattr(cfg.sync.policy, "H_max", None)  # an adaptive policy's ceiling is a candidate too
    extra = [H_max] if H_max and H_max <= 100_000 else []
    Hs = sorted(set(Hs or (*DEFAULT_H, config_H(cfg), *extra)))
    preds = []
    for spec in candidate_codecs(cfg, codecs):
        wire, codec_s = codec_facts(spec, facts.shapes, chunk_bytes=cfg.network.chunk_kb * 1024,
                                    sender=regions[0], in_peers=in_peers)
        preds += [predict(setup, Candidate(H=H, codec=spec.key, wire_bytes=wire, codec_s=codec_s)) for H in Hs]
    rec = recommend(preds, utilization_floor=utilization_floor, budget_usd_per_hour=budget_usd_per_hour)
    late = [p for p in preds if p.sync_s > cfg.sync.deadline.min_s]
    if late:
        notes.append(f"{len(late)} candidate(s) need a sync longer than sync.deadline.min_s={cfg.sync.deadline.min_s:g} s "
                     "(up to {:.3g} s): an adaptive deadline fit to faster rounds may drop those updates (shorter "
                     "rounds, lost updates); raise min_s".format(max(p.sync_s for p in late)))
    return {
        "regions": regions, "step_time_s": step, "step_time_source": "given" if step_s is not None else "probe",
        "model_numel": facts.numel, "overlap": setup.overlap, "rounds": cfg.run.rounds, "max_steps": cfg.run.max_steps,
        "round_overhead_s": setup.overhead_s * contention, "contention": contention, "rtt_factor": setup.rtt_factor,
        "egress_provider": cfg.network.egress.provider, "utilization_floor": utilization_floor,
        "budget_usd_per_hour": budget_usd_per_hour, "notes": notes,
        "candidates": [p.to_json() for p in preds],
        "recommended": {k: None if rec[k] is None else {"H": rec[k].H, "codec": rec[k].codec}
                        for k in ("cheapest_meeting_floor", "fastest_under_budget")},
        "recommendation": recommendation_json(rec["recommended"], rec["met_floor"], utilization_floor),
    }


def recommendation_json(p, met_floor: bool, floor: float) -> dict[str, Any] | None:
    """The pick of the rule (model.choose) with the branch that chose it, as --json prints it."""
    if p is None:
        return None
    return {"H": p.H, "codec": p.codec, "met_floor": met_floor,
            "rule": "cheapest_meeting_floor" if met_floor else "fastest_none_meets_floor",
            "utilization": p.utilization, "s_per_step": p.round_s / p.H,
            "why": (f"the cheapest egress $ per step of the candidates with utilisation >= {floor:g}" if met_floor else
                    f"no candidate reaches utilisation {floor:g}: the fastest per step (the closest to the floor)")}
