"""Delayed overlap without a copy of overlap's start (issue 39): whole-model DiLoCo keeps the round's
pseudo-gradient (`Diloco.behind`) instead, start == global - behind bitwise, and the exchange's mix is
written into the first peer's decoded update (p2p mix's `into_received`), so the region holds 4 B/param
less from its restart to the mix. The weights must be the bytes the copied start gave."""

from __future__ import annotations

import torch

from geofed.orchestrator.config import config_from_mapping
from geofed.p2p.gossip import mix
from geofed.p2p.robust import fair_share_clip, fair_share_clip_received
from geofed.regions.inprocess import InProcessRegions
from geofed.regions.messages import RoundPlan


def _lists(seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * scale for s in ((7, 5), (13,), (3, 4, 2))]


def test_the_mix_into_the_first_peer_has_the_bytes_of_the_mix_into_own_and_leaves_own_alone():
    own, weights = _lists(0), {"b": 0.3, "c": 0.25}
    for clip in (False, True):
        # The consumed path (today's DiLoCo): own scaled in place by the clip, the mean summed into it.
        peers_a = {"b": _lists(1, 4.0), "c": _lists(2)}
        mine = [t.clone() for t in own]
        if clip:
            mine, peers_a, clipped_a = fair_share_clip(mine, peers_a, multiple=1.0, in_place=True)
        want = mix(mine, peers_a, weights, 0.45, consume_own=True)
        # The kept path: own untouched, its scale applied where the mix reads it.
        peers_b = {"b": _lists(1, 4.0), "c": _lists(2)}
        first_ptrs = [t.data_ptr() for t in peers_b["b"]]
        own_scale = None
        if clip:
            own_scale, peers_b, clipped_b = fair_share_clip_received(own, peers_b, multiple=1.0)
            assert clipped_b == clipped_a == ["b"]
        got = mix(own, peers_b, weights, 0.45, into_received=True, own_scale=own_scale)
        assert all(torch.equal(a, b) for a, b in zip(got, want))  # bitwise
        assert [t.data_ptr() for t in got] == first_ptrs  # written into the first peer's tensors
        assert all(torch.equal(a, b) for a, b in zip(own, _lists(0)))  # own as it was


def test_the_clip_keeping_own_scales_own_the_way_the_clip_in_place_does():
    own, peers = _lists(0, 5.0), {"b": _lists(1), "c": _lists(2)}  # own far over the median
    scaled, _, _ = fair_share_clip([t.clone() for t in own], {k: [t.clone() for t in v] for k, v in peers.items()},
                                   multiple=1.0, in_place=True)
    own_scale, _, clipped = fair_share_clip_received(own, peers, multiple=1.0)
    assert own_scale is not None and clipped == []
    assert all(torch.equal(t * own_scale, s) for t, s in zip(own, scaled))
    assert all(torch.equal(a, b) for a, b in zip(own, _lists(0, 5.0)))


def test_with_no_peer_the_mix_is_a_new_tensor_and_own_is_kept():
    own = _lists(0)
    got = mix(own, {}, {"b": 0.5}, 0.5, into_received=True)
    assert all(torch.equal(g, o) for g, o in zip(got, own))  # the missing peer's weight folds into self
    assert all(g.data_ptr() != o.data_ptr() for g, o in zip(got, own))


def _cfg(overlap):
    return config_from_mapping({
        "run": {"name": "behind", "seed": 3, "rounds": 4},
        "task": {"kind": "mlp-digits", "hidden": 16},
        "regions": {"names": ["a", "b", "c"]},
        "network": {"emulation": {"mode": "none"}},
        "compression": {"codec": "int8", "error_feedback": True},
        "sync": {"overlap": overlap, "policy": {"kind": "fixed", "H": 3}, "inner": {"lr": 0.01},
                 "outer": {"momentum": 0.5}, "deadline": {"initial_s": 30.0, "max_s": 60.0}},
    }, source="test_overlap_behind")


def _train(tmp_path, *, copied_start: bool, overlap=True, rounds: int = 4):
    """Weights after `rounds` delayed-overlap rounds and the finish; `copied_start` takes the code path
    that copies overlap's start (eager's and fragments', and delayed's before this change)."""
    with InProcessRegions(_cfg(overlap), tmp_path) as group:
        parts = [w.algorithm.parts[0] for w in group.workers.values()]
        if copied_start:
            for part in parts:
                part.keeps_behind = False
                part.mark_start()
        held = []
        for r in range(rounds):
            reports = group.run_round({reg: RoundPlan(round=r, H=3, final=r == rounds - 1) for reg in group.workers})
            assert not any(m.exchange.peers_missing for m in reports.values())
            # Through the next round's inner steps (the exchange in flight): a start copy or not.
            held.append([part.start is not None for part in parts])
        group.call(lambda w: w.finish_pending())
        weights = {reg: [p.detach().clone() for p in w.params] + [g.detach().clone() for g in w.algorithm.eval_params()]
                   for reg, w in group.workers.items()}
        return weights, held, [part.keeps_behind for part in parts]


def test_delayed_overlap_trains_the_same_bytes_without_holding_a_start_copy(tmp_path):
    kept, held_kept, behind = _train(tmp_path / "behind", copied_start=False)
    copied, held_copied, _ = _train(tmp_path / "copied", copied_start=True)
    assert all(behind)  # delayed whole-model DiLoCo takes the new path by default
    assert not any(any(h) for h in held_kept)  # no start copy while an exchange is in flight
    assert all(all(h) for h in held_copied)
    for reg in kept:
        assert all(torch.equal(a, b) for a, b in zip(kept[reg], copied[reg])), reg


def test_eager_overlap_keeps_its_start_copy(tmp_path):
    _, held, behind = _train(tmp_path, copied_start=False, overlap="eager", rounds=2)
    assert not any(behind) and all(all(h) for h in held)
