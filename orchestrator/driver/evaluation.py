"""Evaluation rounds, the run's target (run.target) and what reaching it cost.

Where the evaluated model comes from (docs/launch.md, "What travels where"): DiLoCo and
all-reduce evaluate the synchronised model on the first alive region, which holds it already
(every region of a full topology has the same global model after the outer step), so an
evaluation sends no model and waits for nothing; how far apart the regions' models are (the
consensus distance) comes from a 32 KiB count sketch of each (regions/sketch.py). Gossip's regions hold different models; their
average needs each region's parameters at the driver, a fetch through Ray that is counted as
``eval_fetch_bytes``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from geofed.regions.algorithm_traits import algorithm_traits
from geofed.regions.messages import RoundReport
from geofed.regions.sketch import consensus_from_sketches

from ..config import RunConfig
from .recovery import RunFailed
from .summary import evaluate_average


def fetched_bytes(params: Mapping[str, list[torch.Tensor]]) -> int:
    """Bytes of the parameters fetched from the regions (what a gossip evaluation costs)."""
    return sum(t.numel() * t.element_size() for tensors in params.values() for t in tensors)


class RunEvaluation:
    """The run's evaluations: which rounds evaluate (run.eval_every, or every round toward a target),
    the record of each, and whether and at what cost (time, steps, bytes) run.target was reached.
    """

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.target = cfg.run.target
        self.every = cfg.run.eval_every or (1 if self.target is not None else 0)
        self.hit: dict[str, Any] | None = None   # the round that reached the target, and its cost
        self.last: dict[str, Any] | None = None  # the last evaluation's eval_avg
        self.fetch_bytes = 0
        self._steps: dict[int, int] = {}   # round -> inner steps per region by its end
        self._bytes: dict[int, int] = {}   # exchange round -> bytes every region sent for it
        self._forced: set[int] = set()     # rounds that end on run.eval_at_steps

    def due(self, round_: int) -> bool:
        return round_ in self._forced or (bool(self.every) and (round_ + 1) % self.every == 0)

    def force(self, round_: int) -> None:
        """`round_` evaluates whatever run.eval_every says: it ends on one of run.eval_at_steps."""
        self._forced.add(round_)

    def of_round(self, round_: int, results: Mapping[str, RoundReport], alive: list[str],
                 fetch_params: Callable[[], dict[str, list[torch.Tensor]]], *, t_end: float) -> dict[str, Any]:
        """A round's evaluation record for rounds.jsonl: eval_avg, the round whose synchronised
        model it is (eval_round: with overlap it was evaluated during the next round, when its
        exchange completed) and when (eval_t); for gossip also the consensus distance and the
        fetch's bytes. Empty when nothing was evaluated."""
        if algorithm_traits(self.cfg.sync.algorithm).mixes_models:
            if not self.due(round_):
                return {}
            params = fetch_params()
            if not params:
                return {}
            avg, consensus = evaluate_average(self.cfg, params)
            n = fetched_bytes(params)
            self.fetch_bytes += n
            self.last = avg
            return {"eval_avg": avg, "eval_round": round_, "eval_t": round(t_end, 4), "consensus_distance": consensus,
                    "eval_fetch_bytes": n}
        sketches = [results[r].sketch for r in alive if r in results and results[r].sketch is not None]
        out: dict[str, Any] = {"consensus_distance": consensus_from_sketches(sketches)} if sketches else {}
        evaluator = next((r for r in alive if r in results and results[r].evaluation.eval is not None), None)
        if evaluator is not None:
            m = results[evaluator].evaluation
            ev = dict(m.eval or {})
            self.last = {k: ev[k] for k in ("metric", "value", "higher_is_better")}
            out.update(eval_avg=self.last, eval_region=evaluator, eval_round=ev.get("round", round_),
                       eval_t=round(t_end - (m.eval_age_s or 0.0), 4))
            # A flush in this round (a resync under overlap) also completed the next model's exchange:
            # the earlier model's evaluation is kept beside it.
            earlier = [{"round": e.get("round"), "value": e["value"], "t": round(t_end - e.get("age_s", 0.0), 4)}
                       for e in m.evals_earlier or [] if "value" in e]
            if earlier:
                out["evals_earlier"] = earlier
        return out

    def note_round(self, round_: int, results: Mapping[str, RoundReport], *, steps: int) -> None:
        """What the run had cost by the end of `round_`: inner steps per region, and the bytes of
        each exchange by the round it belongs to (with overlap, round r's exchange is reported
        with round r + 1's metrics: its exchange_round says so)."""
        self._steps[round_] = steps
        for m in results.values():
            er = m.exchange.exchange_round
            er = round_ if er is None else er
            self._bytes[er] = self._bytes.get(er, 0) + int(m.exchange.bytes_sent)

    def _cost(self, round_: int) -> tuple[int | None, int]:
        return self._steps.get(round_), sum(b for r, b in self._bytes.items() if r <= round_)

    def reached(self, ev: Mapping[str, Any] | None) -> bool:
        t = self.target
        if t is None or not ev:
            return False
        if ev["metric"] != t.metric:
            raise RunFailed(f"run.target.metric is {t.metric!r}, but task {self.cfg.task.kind} evaluates "
                            f"{ev['metric']!r}: set run.target.metric to {ev['metric']!r}")
        return ev["value"] >= t.value if ev["higher_is_better"] else ev["value"] <= t.value

    def check(self, record: Mapping[str, Any]) -> bool:
        """Whether this evaluation record reached the target (the first time: its cost is kept)."""
        ev = record.get("eval_avg")
        if self.hit is not None or ev is None or not self.reached(ev):
            return False
        r = record["eval_round"]
        steps, sent = self._cost(r)
        self.hit = {"round": r, "metric": ev["metric"], "value": ev["value"], "time_to_target_s": record["eval_t"],
                    "steps_to_target": steps, "bytes_to_target": sent + self.fetch_bytes}
        return True

    def summary_fields(self) -> dict[str, Any]:
        t = self.target
        out: dict[str, Any] = {"eval_fetch_bytes": self.fetch_bytes}
        if t is None:
            return out
        out["target"] = {"metric": t.metric, "value": t.value, "reached": self.hit is not None,
                         **({k: v for k, v in self.hit.items()} if self.hit else {})}
        for key in ("time_to_target_s", "steps_to_target", "bytes_to_target"):
            out[key] = self.hit[key] if self.hit else None
        return out
