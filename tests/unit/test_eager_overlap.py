"""sync.overlap: eager (arXiv 2502.12996) over the in-memory transport: the region's own
pseudo-gradient is applied at once and corrected with the global mean when it arrives."""

from __future__ import annotations

import torch

from geofed.orchestrator.config import config_from_mapping
from geofed.regions.inprocess import InProcessRegions
from geofed.regions.messages import RoundPlan


def _cfg(regions, overlap, momentum=0.5):
    return config_from_mapping({
        "run": {"name": "t", "seed": 4},
        "task": {"kind": "mlp-digits", "hidden": 16},
        "regions": {"names": regions},
        "sync": {"overlap": overlap, "outer": {"momentum": momentum}, "inner": {"lr": 0.01}},
        "compression": {"codec": "identity", "error_feedback": False},
        "network": {"emulation": {"mode": "none"}},
    })


def _train(tmp_path, regions, overlap, rounds=4, momentum=0.5):
    with InProcessRegions(_cfg(regions, overlap, momentum), tmp_path / f"{overlap}-{momentum}") as c:
        for r in range(rounds):
            res = c.run_round({reg: RoundPlan(round=r, H=5, final=(r == rounds - 1), evaluate=(r == rounds - 1))
                               for reg in regions})
        return {reg: [g.clone() for g in w.algorithm.eval_params()] for reg, w in c.workers.items()}, res


def test_eager_equals_sync_when_the_local_pseudo_gradient_is_the_global_one(tmp_path):
    # One region: the global mean is its own pseudo-gradient, every correction is zero.
    eager, _ = _train(tmp_path, ["a"], "eager")
    sync, _ = _train(tmp_path, ["a"], False)
    delayed, _ = _train(tmp_path, ["a"], True)
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(eager["a"], sync["a"]))
    assert not all(torch.allclose(x, y, atol=1e-4) for x, y in zip(delayed["a"], sync["a"]))  # delayed lags


def test_eager_regions_end_on_one_model_and_learn(tmp_path):
    # The global model and its momentum see only the means: after the final flush every region
    # holds one model, momentum and all.
    got, res = _train(tmp_path, ["a", "b", "c"], "eager", rounds=6)
    for reg in ("b", "c"):
        assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(got["a"], got[reg]))
    assert res["a"].evaluation.eval["value"] > 0.6 and res["a"].exchange.exchange_round == 5  # the last round flushes its own
    delayed, _ = _train(tmp_path, ["a", "b", "c"], True, rounds=6)
    assert not all(torch.allclose(x, y, atol=1e-4) for x, y in zip(got["a"], delayed["a"]))  # it is another run


def test_the_eager_preview_is_the_delayed_outer_step_when_local_and_global_agree(tmp_path):
    # Eager applies outer_step(local pseudo-gradient) at once; delayed applies outer_step(global
    # mean) a round later. With the two pseudo-gradients equal, both must move the global model
    # to the same point, momentum and Nesterov included (0.9, after rounds that filled the buffer).
    with InProcessRegions(_cfg(["a"], True, momentum=0.9), tmp_path / "delayed") as c:
        for r in range(3):
            c.run_round({"a": RoundPlan(round=r, H=5, final=(r == 2))})
        algo = c.workers["a"].algorithm.parts[0]
        assert all(s.get("momentum_buffer") is not None for s in algo.outer_opt.state.values())
        gen = torch.Generator().manual_seed(0)
        delta = [torch.randn(p.shape, generator=gen) * 1e-2 for p in algo.global_params]
        before = [g.detach().clone() for g in algo.global_params]
        state = {k: v["momentum_buffer"].clone() for k, v in algo.outer_opt.state.items()}
        preview = algo.preview(delta)
        assert all(torch.equal(g, b) for g, b in zip(algo.global_params, before))  # a preview writes nothing
        assert all(torch.equal(algo.outer_opt.state[k]["momentum_buffer"], v) for k, v in state.items())
        algo.step(delta)
        # The preview steps a copy of the real optimizer: the very same arithmetic, bit for bit.
        assert all(torch.equal(p, g) for p, g in zip(preview, algo.global_params))
        assert not all(torch.allclose(p, b, atol=1e-6) for p, b in zip(preview, before))  # it did move
