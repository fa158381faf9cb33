"""A census of a region's live tensors between rounds (issue 39, item 2): what `geofed bench memory`
reads as a peak, counted here buffer by buffer in one cheap in-process run. Two Regions of a small gpt
(about 0.43M parameters), DiLoCo with delayed overlap, int8 + error feedback, the gauntlet and
rollback on (the defaults): after each round every tensor alive that the run made is counted, per
region and per parameter.

What a region holds between rounds once its exchange in flight has mixed (the peer's decoded update,
4 more until then, is let go), fp32 bytes per parameter: the model 4, AdamW 8, the global copy 4,
outer momentum 4 (from the first outer step), the error-feedback residual 4, overlap's start 4 and
the pseudo-gradient in flight (the mean summed into it) 4: 32, with the data, the scoring and probe
batches and the layout's small tensors about 0.4 more (the pooled int8 payloads are bytes, not
tensors: not counted). Measured: 28.4 after round 0 (no momentum yet), 32.4 after round 1; with
the gauntlet's copy of the model (4, before d8aa594) 32.4 and 36.4."""

from __future__ import annotations

import gc

import torch

from geofed.orchestrator.config import config_from_mapping
from geofed.regions.inprocess import InProcessRegions
from geofed.regions.messages import RoundPlan

BOUND = 34.0  # B/param per region between rounds (module docstring: 32 and the small ones)


def _storages() -> dict[int, int]:
    """Every live CPU tensor's storage: data pointer -> bytes."""
    out = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type == "cpu":
            try:
                st = o.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a tensor without storage (meta, sparse)
                continue
            out[st.data_ptr()] = st.nbytes()
    return out


def test_a_delayed_overlap_region_holds_under_the_bound_between_rounds(tinyshakespeare_txt, tmp_path):
    cfg = config_from_mapping({
        "run": {"seed": 0, "checkpoint_every": 0, "eval_every": 0},
        "task": {"kind": "gpt", "path": str(tinyshakespeare_txt), "n_layer": 2, "n_head": 4, "d_model": 128,
                 "context": 32, "max_chars": 20_000, "eval_sequences": 4},
        "regions": {"names": ["a", "b"]}, "network": {"emulation": {"mode": "none"}},
        "compression": {"codec": "int8", "error_feedback": True},
        "sync": {"overlap": True, "policy": {"kind": "fixed", "H": 1}, "inner": {"kind": "adamw", "batch_size": 2},
                 "deadline": {"initial_s": 5.0, "min_s": 1.0, "max_s": 10.0}},
    })
    gc.collect()
    before = set(_storages())
    per_round = []
    with InProcessRegions(cfg, tmp_path) as group:
        params = sum(p.numel() for p in group.workers["a"].params)
        for r in range(2):  # round 1 holds the most: the outer momentum and an exchange in flight
            group.run_round({reg: RoundPlan(round=r, H=1) for reg in ("a", "b")})
            for w in group.workers.values():  # the exchange in flight has mixed: its peer's update is gone
                if w.algorithm.overlap.in_flight:
                    w.algorithm.overlap._pending.result(timeout=60)
            gc.collect()
            made = sum(nbytes for ptr, nbytes in _storages().items() if ptr not in before)
            per_round.append(round(made / 2 / params, 1))
        assert all(g is None for w in group.workers.values() for g in (p.grad for p in w.params))
    assert max(per_round) <= BOUND, f"B/param per region after rounds 0 and 1: {per_round}"
