"""`geofed plan`: predict round time, utilisation, bytes and egress dollars before a run (docs/plan.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from geofed.compression import CodecSpec
from geofed.p2p.wan.prices import EgressPricer

from ..config import RunConfig
from .inputs import codec_facts, config_segments, file_segments, out_links, price_file, probe_task
from .model import ROUND_OVERHEAD_ALONE_S, Candidate, Setup, predict, recommend
from .probe import SharedStep, host_cpus, probe_shared_step
from .steady import PolicyRange, policy_range, steady_decision

DEFAULT_H = (20, 50, 100, 200, 400, 1000)
DEFAULT_CODECS = ("fp16", "int8", "topk(fraction=0.01)")


def config_H(cfg: RunConfig) -> int:
    """The H a config runs with (fixed: H; adaptive: its initial H)."""
    p = cfg.sync.policy
    return int(getattr(p, "H", None) or getattr(p, "initial_H", 0) or 50)


def candidate_codecs(cfg: RunConfig, codecs: Sequence[str] | None, rng: PolicyRange | None = None) -> list[CodecSpec]:
    """The codecs to compare: the given ones; else for an adaptive policy its ladder (what it may
    choose), for a fixed one the config's codec and ladder and the defaults."""
    if codecs:
        return [CodecSpec.parse(c) for c in codecs]
    if rng is not None and rng.kind != "fixed":
        return [CodecSpec.parse(c) for c in rng.codecs]
    specs = [cfg.compression.codec, *cfg.compression.ladder, *(CodecSpec.parse(c) for c in DEFAULT_CODECS)]
    return list(dict.fromkeys(specs))


def candidate_Hs(cfg: RunConfig, rng: PolicyRange) -> list[int]:
    """The default H values: DEFAULT_H, the config's H and an adaptive policy's bounds, each clamped
    into the policy's [H_min, H_max] (a fixed policy: the defaults and its H)."""
    Hs = [*DEFAULT_H, config_H(cfg)]
    if rng.kind == "fixed":
        return Hs
    ceiling = [rng.H_max] if rng.H_max <= 100_000 else []   # a bound far out is no candidate
    return [rng.clamp(H) for H in (*Hs, rng.H_min, *ceiling)]


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
         codecs: Sequence[str] | None = None, step_s: float | Mapping[str, float] | None = None,
         links_path: str | None = None,
         prices_path: str | None = None, utilization_floor: float = 0.9, budget_usd_per_hour: float | None = None,
         overhead_s: float | None = None, contention: float | None = None) -> dict[str, Any]:
    """Every candidate's prediction, the run's policy's steady pick and the recommendations, as
    `geofed plan --json` prints them.

    The step time (docs/plan.md, "The step time"): `step_s` when given (as the regions will see it;
    a mapping region -> seconds, e.g. each node's own measurement: the slowest of the plan's regions);
    else the probe alone times `contention` when that is given; else, for a local run (no
    ray.address: every region on this host), the step timed in one process per region at once,
    contention = that over the alone probe; for a cluster, the alone probe (a machine per region).
    """
    regions = list(regions or cfg.regions.names)
    if len(regions) < 2:
        raise ValueError("regions: the plan needs at least 2 regions (one region sends nothing)")
    table = None
    if prices_path is not None and cfg.network.egress.provider != "none":
        table = price_file(prices_path).get(cfg.network.egress.provider)
    pricer = EgressPricer(cfg.network.egress, table) if prices_path else EgressPricer(cfg.network.egress)
    step_s = slowest_step(step_s, regions)
    facts = probe_task(cfg, probe=step_s is None)
    step, contention, source, shared = step_time(cfg, facts, regions, step_s=step_s, contention=contention)
    setup, notes = build_setup(cfg, regions=regions, step_s=step, links_path=links_path, pricer=pricer,
                               overhead_s=overhead_s, contention=contention)
    in_peers = max(1, round(len(setup.out_links) / len(regions)))
    rng = policy_range(cfg)
    steady = steady_decision(cfg, setup, facts.numel)
    specs = candidate_codecs(cfg, codecs, rng)
    Hs = sorted(set(Hs) if Hs else {*candidate_Hs(cfg, rng), steady["H"]})   # given ones: exactly those
    preds, by_codec = [], {}
    for spec in dict.fromkeys([*specs, CodecSpec.parse(steady["codec"])]):
        wire, codec_s = codec_facts(spec, facts.shapes, chunk_bytes=cfg.network.chunk_kb * 1024,
                                    sender=regions[0], in_peers=in_peers)
        by_codec[spec.key] = (wire, codec_s)
        if spec in specs:
            preds += [predict(setup, Candidate(H=H, codec=spec.key, wire_bytes=wire, codec_s=codec_s)) for H in Hs]
    wire, codec_s = by_codec[steady["codec"]]
    steady_pred = predict(setup, Candidate(H=steady["H"], codec=steady["codec"], wire_bytes=wire, codec_s=codec_s))
    eligible = [p for p in preds if rng.admits(p.H, p.codec)]
    outside = len(preds) - len(eligible)
    if outside:
        notes.append(f"{outside} candidate(s) lie outside what sync.policy ({rng.kind}) may choose (H in "
                     f"[{rng.H_min}, {rng.H_max}], codecs {', '.join(rng.codecs or ['any'])}): shown, never recommended")
    rec = recommend(eligible, utilization_floor=utilization_floor, budget_usd_per_hour=budget_usd_per_hour)
    late = [p for p in preds if p.sync_s > cfg.sync.deadline.min_s]
    if late:
        notes.append(f"{len(late)} candidate(s) need a sync longer than sync.deadline.min_s={cfg.sync.deadline.min_s:g} s "
                     "(up to {:.3g} s): an adaptive deadline fit to faster rounds may drop those updates (shorter "
                     "rounds, lost updates); raise min_s".format(max(p.sync_s for p in late)))
    return {
        "regions": regions, "step_time_s": step, "step_time_source": source, "step_probe": {
            "alone_s": facts.step_s, "shared_s": None if shared is None else shared.step_s,
            "copies": None if shared is None else shared.copies, "torch_threads": cfg.regions.torch_threads,
            "per_copy": None if shared is None else list(shared.per_copy),
            "host_cpus": host_cpus()},
        "model_numel": facts.numel, "overlap": setup.overlap, "rounds": cfg.run.rounds, "max_steps": cfg.run.max_steps,
        "round_overhead_s": setup.overhead_s * contention, "contention": contention, "rtt_factor": setup.rtt_factor,
        "egress_provider": cfg.network.egress.provider, "utilization_floor": utilization_floor,
        "budget_usd_per_hour": budget_usd_per_hour, "notes": notes,
        "candidates": [{**p.to_json(), "in_policy_range": rng.admits(p.H, p.codec)} for p in preds],
        "policy": {**steady, "H_min": rng.H_min, "H_max": rng.H_max, "ladder": None if rng.codecs is None else list(rng.codecs),
                   "prediction": steady_pred.to_json()},
        "recommended": {k: None if rec[k] is None else {"H": rec[k].H, "codec": rec[k].codec}
                        for k in ("cheapest_meeting_floor", "fastest_under_budget")},
        "recommendation": recommendation_json(rec["recommended"], rec["met_floor"], utilization_floor),
    }


def slowest_step(step_s: float | Mapping[str, float] | None, regions: Sequence[str]) -> float | None:
    """One step time from a per-region mapping: the slowest region's (every round waits for it, and
    the policy sizes H on it); ValueError naming a region it lacks or a region it names that is not planned."""
    if step_s is None or not isinstance(step_s, Mapping):
        return step_s
    missing = [r for r in regions if r not in step_s]
    unknown = sorted(set(step_s) - set(regions))
    if missing or unknown:
        raise ValueError("--step-time: " + "; ".join(
            ([f"no step time for region(s) {', '.join(missing)}"] if missing else [])
            + ([f"region(s) {', '.join(unknown)} not among the planned regions {', '.join(regions)}"] if unknown else [])))
    return max(step_s[r] for r in regions)


def step_time(cfg: RunConfig, facts, regions: Sequence[str], *, step_s: float | None,
              contention: float | None) -> tuple[float, float, str, SharedStep | None]:
    """(seconds per step as the regions see it, contention, its source, the shared probe or None)."""
    if step_s is not None:
        return step_s, 1.0 if contention is None else contention, "given", None
    if contention is not None:
        return facts.step_s * contention, contention, "probe x --contention", None
    if cfg.ray.address is not None:  # a cluster: each region on its own node (docs/plan.md: --step-time there)
        return facts.step_s, 1.0, "probe (alone: a node per region)", None
    slowdown = max([1.0, *cfg.regions.emulation.slowdown.values()])
    shared = probe_shared_step(cfg, copies=len(regions))
    step = max(facts.step_s, shared.step_s * slowdown)
    return step, step / facts.step_s, f"probe, {len(regions)} regions at once on {host_cpus()} cores", shared


def recommendation_json(p, met_floor: bool, floor: float) -> dict[str, Any] | None:
    """The pick of the rule (model.choose) with the branch that chose it, as --json prints it."""
    if p is None:
        return None
    return {"H": p.H, "codec": p.codec, "met_floor": met_floor,
            "rule": "cheapest_meeting_floor" if met_floor else "fastest_none_meets_floor",
            "utilization": p.utilization, "s_per_step": p.round_s / p.H,
            "why": (f"the cheapest egress $ per step of the candidates with utilisation >= {floor:g}" if met_floor else
                    f"no candidate reaches utilisation {floor:g}: the fastest per step (the closest to the floor)")}
