"""sync.outer.offload (regions/sync/offload.py): where DiLoCo's model-sized outer buffers live, and
that offload's chunked steps between host and model compute the same bits as the plain ones.

This host has no GPU. What can fail here: the placement decided for a model on a GPU (the host,
pinned; or the GPU without offload), every model-sized buffer of a real run checked against the
placement its Diloco decided, and offload's host/model path itself, forced on for a CPU model, run
against the plain path bit for bit (the same round, with the same seeds, through the same code but
for the chunked copies). The CUDA test runs the same checks on a model on the GPU where CUDA exists."""

from __future__ import annotations

import pytest
import torch

from geofed.orchestrator.config import config_from_mapping
from geofed.regions.inprocess import InProcessRegions
from geofed.regions.messages import RoundPlan
from geofed.regions.sync.offload import (Placement, outer_placement, pseudo_gradient_into, rebase_into,
                                         restart_behind_into)

REGIONS = ["a", "b"]


def _cfg(*, offload, overlap=True, device="cpu", fragments=1):
    return config_from_mapping({
        "run": {"name": "t", "seed": 3},
        "task": {"kind": "mlp-digits", "hidden": 16},
        "regions": {"names": REGIONS, "device": device, **({"num_gpus": 0.5} if device != "cpu" else {})},
        "sync": {"overlap": overlap, "fragments": fragments, "outer": {"momentum": 0.5, "offload": offload},
                 "inner": {"lr": 0.01}},
        "compression": {"codec": "int8", "error_feedback": True},
        "network": {"emulation": {"mode": "none"}},
    })


def _rounds(group, n, *, split=False):
    if split:  # offload's host/model path, on one device: what a GPU region runs, here on the CPU
        for w in group.workers.values():
            for part in w.algorithm.parts:
                part.split = True
    for r in range(n):
        group.run_round({reg: RoundPlan(round=r, H=3, final=r == n - 1) for reg in REGIONS})
    return {reg: [t.clone() for t in w.algorithm.eval_params()] + [p.detach().clone() for p in w.params]
            for reg, w in group.workers.items()}


def _check_placed(group, model_device: torch.device, offload: bool, *, stepped: bool = True) -> list[str]:
    """Every model-sized buffer of every region against where it should be; the misplaced, named.
    `stepped`: after an outer step (the momentum exists) and a round (overlap's start exists)."""
    want = outer_placement(model_device, offload)
    bad = []
    for reg, w in group.workers.items():
        for p in w.params:
            if p.device != model_device:
                bad.append(f"{reg}: a parameter on {p.device}")
        for part in w.algorithm.parts:
            assert part.placement == want
            for name, ts in part.outer_buffers().items():
                if name == "global" or (stepped and (name != "start" or w.algorithm.overlap is not None)):
                    assert ts, f"{reg}: no {name} buffers to check"
                for t in ts:
                    if t.device != want.device or t.is_pinned() != want.pin:
                        bad.append(f"{reg}: {name} on {t.device}, pinned {t.is_pinned()}; want {want}")
        for key, state in w.exchanger.states.items():
            if state.residual is not None and state.residual.device.type != "cpu":
                bad.append(f"{reg}: the residual of {key} on {state.residual.device}")
    return bad


def test_the_placement_for_a_model_on_a_gpu_is_the_host_pinned_with_offload_and_the_gpu_without():
    gpu = torch.device("cuda", 0)
    assert outer_placement(gpu, True, cuda_available=True) == Placement(device=torch.device("cpu"), pin=True)
    assert outer_placement(gpu, False, cuda_available=True) == Placement(device=gpu)
    assert outer_placement("cuda:1", False, cuda_available=True).device == torch.device("cuda", 1)
    assert outer_placement(torch.device("cpu"), True) == Placement(device=torch.device("cpu"))
    assert outer_placement(torch.device("cpu"), False) == Placement(device=torch.device("cpu"))


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 22])
def test_offloads_chunked_steps_give_the_plain_steps_bits(chunk):
    g = torch.Generator().manual_seed(0)
    shapes = [(33, 7), (5,), (), (1000,)]
    live = [torch.randn(s, generator=g) for s in shapes]
    start = [v + 0.01 * torch.randn(v.shape, generator=g) for v in live]
    glob = [v + 0.02 * torch.randn(v.shape, generator=g) for v in live]
    delta = pseudo_gradient_into(start, live, chunk=chunk)
    assert all(torch.equal(d, s - v) for d, s, v in zip(delta, start, live))
    v2, s2 = [v.clone() for v in live], [s.clone() for s in start]
    restart_behind_into(v2, s2, glob, delta)
    assert all(torch.equal(v, g_ - d) and torch.equal(s, g_ - d) for v, s, g_, d in zip(v2, s2, glob, delta))
    v3, s3 = [v.clone() for v in live], [s.clone() for s in start]
    rebase_into(v3, s3, glob, chunk=chunk)
    assert all(torch.equal(v, g_ - (s - v0)) for v, g_, s, v0 in zip(v3, glob, start, live))
    assert all(torch.equal(s, g_) for s, g_ in zip(s3, glob))


def test_offload_config_is_a_bool_named_by_its_key():
    with pytest.raises(ValueError, match="offload"):
        _cfg(offload="yes")


@pytest.mark.parametrize("overlap,fragments", [(True, 1), ("eager", 1), (False, 1), (True, 2), ("eager", 2)])
def test_offloads_host_path_trains_the_plain_paths_bits(tmp_path, overlap, fragments):
    # Fragments with overlap rebase the part whose exchange lands (offload's chunked rebase).
    with InProcessRegions(_cfg(offload=False, overlap=overlap, fragments=fragments), tmp_path / "plain") as group:
        plain = _rounds(group, 3)
    with InProcessRegions(_cfg(offload=True, overlap=overlap, fragments=fragments), tmp_path / "split") as group:
        assert not _check_placed(group, torch.device("cpu"), True, stepped=False)
        assert all(not part.split for w in group.workers.values() for part in w.algorithm.parts)
        split = _rounds(group, 3, split=True)
        assert not _check_placed(group, torch.device("cpu"), True)
    for reg in REGIONS:
        assert all(torch.equal(a, b) for a, b in zip(plain[reg], split[reg])), reg


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch.cuda.is_available() is False on this host")
@pytest.mark.parametrize("offload", [True, False])
def test_on_a_gpu_the_outer_state_is_on_the_host_pinned_with_offload(tmp_path, offload):
    gpu = torch.device("cuda", 0)
    with InProcessRegions(_cfg(offload=offload, device="cuda"), tmp_path) as group:
        _rounds(group, 3)
        assert all(part.split == offload for w in group.workers.values() for part in w.algorithm.parts)
        bad = _check_placed(group, gpu, offload)
    assert not bad, bad
