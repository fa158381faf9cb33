"""The numbers a reader asks for first, each taken from summary.json when the run wrote one and
otherwise worked out from the per-round records (a run in progress, or one that crashed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .load import Run, num


@dataclass(frozen=True)
class Headline:
    """The figures a report leads with, from summary.json where present, else from the per-round files."""

    rounds: int
    wall_s: float | None
    bytes_sent: float
    final_train_loss: float | None
    eval_metric: str | None
    eval_value: float | None
    utilization: float | None


def headline(run: Run) -> Headline:
    """The run's Headline: summary.json's figures, each falling back to what rounds.jsonl gives (a run still going)."""
    s = run.summary
    rows = run.rounds
    ends = [r.t_end for r in rows if r.t_end is not None]
    losses = [r.mean_train_loss for r in rows if r.mean_train_loss is not None]
    utils = [r.utilization for r in rows if r.utilization is not None]
    ev = s.get("eval") if isinstance(s.get("eval"), dict) else None
    metric, value = (str(ev.get("metric", "eval")), num(ev.get("value"))) if ev else _last_eval(run)
    return Headline(
        rounds=int(s["rounds"]) if isinstance(s.get("rounds"), int) else len(rows),
        wall_s=_pick(num(s.get("wall_s")), max(ends) if ends else None),
        bytes_sent=_pick(num(s.get("bytes_sent")), sum(r.bytes_sent for r in rows)) or 0.0,
        final_train_loss=_pick(num(s.get("final_train_loss")), losses[-1] if losses else None),
        eval_metric=metric,
        eval_value=value,
        utilization=_pick(num(s.get("compute_utilization")), sum(utils) / len(utils) if utils else None),
    )


def _last_eval(run: Run) -> tuple[str | None, float | None]:
    metric, series = run.eval_series()
    last = [pts[-1][2] for pts in series.values() if pts]
    return (metric, sum(last) / len(last)) if last else (None, None)


def _pick(*values):
    return next((v for v in values if v is not None), None)


def config_highlights(run: Run) -> list[tuple[str, str]]:
    """(label, value) of what distinguishes one run from another, from summary.config or config.yaml."""
    sc = run.summary.get("config") if isinstance(run.summary.get("config"), dict) else {}
    c = run.config

    def dig(*path: str) -> Any:
        node: Any = c
        for p in path:
            node = node.get(p) if isinstance(node, dict) else None
        return node

    def kind(v: Any) -> Any:
        return v.get("kind") if isinstance(v, dict) else v

    pairs = [
        ("task", sc.get("task") or kind(dig("task"))),
        ("algorithm", sc.get("algorithm") or dig("sync", "algorithm")),
        ("sync policy", sc.get("policy") or kind(dig("sync", "policy"))),
        ("codec", sc.get("codec") or _codec_text(dig("compression", "codec"))),
        ("topology", sc.get("topology") or dig("sync", "topology")),
        ("regions", sc.get("regions") or len(run.regions) or None),
        ("WAN emulation", sc.get("emulation") or dig("network", "emulation", "mode")),
        ("H (local steps)", _h_text(run, dig("sync", "policy"))),
        ("codecs used", ", ".join(_codecs_used(run)) or None),
        ("inner lr", _lr_text(dig("sync", "inner"))),
        ("outer lr / momentum", _outer_text(run, dig("sync", "outer"))),
        ("overlap", sc.get("overlap") if "overlap" in sc else dig("sync", "overlap")),
        ("differential privacy", privacy_text(run.summary.get("privacy"))),
    ]
    return [(k, str(v)) for k, v in pairs if v not in (None, "")]


def privacy_text(p: Any) -> str | None:
    """summary.json's privacy entry in words (None with DP off)."""
    if not isinstance(p, dict) or p.get("epsilon") is None:
        return None
    text = (f"{p.get('mode')} level: epsilon {p['epsilon']:.3g} at delta {p.get('delta'):g} "
            f"(noise multiplier {p.get('noise_multiplier'):.3g}, clip {p.get('clip'):g})")
    if p.get("target_epsilon") is not None:
        text += f", target {p['target_epsilon']:g}"
    stopped = p.get("stopped_at_budget")
    if isinstance(stopped, dict):
        text += f"; stopped before round {stopped.get('round')} (the budget)"
    return text


def _h_text(run: Run, policy: Any) -> str | None:
    """The H the run used: its range over the rounds, with the fixed policy's setting or the adaptive bounds."""
    hs = [int(r.H) for r in run.rounds if r.H is not None]
    used = (f"{hs[0]}" if min(hs) == max(hs) else f"{min(hs)}–{max(hs)}") if hs else None
    conf = None
    if isinstance(policy, dict):
        if policy.get("kind") == "fixed" and policy.get("H") is not None:
            conf = f"fixed {policy['H']}"
        elif policy.get("H_min") is not None and policy.get("H_max") is not None:
            conf = f"{policy.get('kind')}, bounds {policy['H_min']}–{policy['H_max']}"
    if used and conf:
        return f"{used} ({conf})"
    return used or conf


def _codecs_used(run: Run) -> list[str]:
    """Every codec key the run sent with, most used first (rounds x links)."""
    from collections import Counter

    n = Counter(c for r in run.rounds for c in r.codecs.values())
    return [k for k, _ in n.most_common()]


def _lr_text(inner: Any) -> str | None:
    if not isinstance(inner, dict) or inner.get("lr") is None:
        return None
    decay = inner.get("lr_decay")
    return f"{inner['lr']:g} ({inner.get('kind', 'adamw')}" + (f", {decay} decay)" if decay and decay != "none" else ")")


def _outer_text(run: Run, outer: Any) -> str | None:
    has_outer = run.algorithm is None or (run.traits is not None and run.traits.outer_step)
    if not has_outer or not isinstance(outer, dict) or outer.get("lr") is None:
        return None  # only an algorithm with an outer step (DiLoCo) has an outer optimizer
    # sync.outer.kind; a record from before it has nesterov: true or false instead
    kind = outer.get("kind") or ("nesterov" if outer.get("nesterov") else "sgd")
    if kind not in ("nesterov", "sgd"):
        return f"{outer['lr']:g} ({kind})"
    nesterov = ", Nesterov" if kind == "nesterov" and outer.get("momentum", 0) else ""
    return f"{outer['lr']:g} / {outer.get('momentum', 0):g}{nesterov}"


def _codec_text(spec: Any) -> Any:
    """The codec's key (summary.json's "codec"), for a run without summary.json; a spec this
    version no longer reads is shown as written (a report must load any old run)."""
    if spec is None:
        return None
    from geofed.compression import spec_key  # lazy: only runs without a summary need it (torch)

    try:
        return spec_key(spec)
    except ValueError:
        return str(spec)


@dataclass(frozen=True)
class ToTarget:
    """When a run first reached a target loss: the round, seconds since round 0 started, bytes sent by then
    (None: never)."""

    round: int | None
    seconds: float | None
    bytes: float | None


def training_start(run: Run) -> float:
    """When round 0 started on the run's clock. Comparisons count time from here: the seconds
    before it (Ray start-up, placement, connecting) differ between machines, not between methods."""
    for r in run.rounds:
        for t in (r.t_start, r.t_end):
            if t is not None:
                return t
    return 0.0


def to_target(run: Run, target: float) -> ToTarget:
    """When the mean train loss first reached `target`: at round granularity, since the loss is
    only known at round ends; seconds since round 0 started; bytes counted through that round."""
    sent, t0 = 0.0, training_start(run)
    for r in run.rounds:
        sent += r.bytes_sent
        if r.mean_train_loss is not None and r.mean_train_loss <= target:
            return ToTarget(r.round, None if r.t_end is None else r.t_end - t0, sent)
    return ToTarget(None, None, None)


def default_target(runs: list[Run]) -> float | None:
    """The loss every run reached: the highest of the runs' best mean train losses."""
    bests = [min(ls) for ls in ([r.mean_train_loss for r in run.rounds if r.mean_train_loss is not None] for run in runs) if ls]
    return max(bests) if len(bests) == len(runs) and bests else None
