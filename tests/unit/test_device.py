"""regions.device and sync.inner.precision: device selection and its errors, autocast and loss
scaling on the CPU, checkpoints that load wherever the region trains, and what the summary says."""

from __future__ import annotations

import pytest
import torch
from geofed.orchestrator.cli import main
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.config.strict import ConfigError
from geofed.p2p.memory import InMemoryHub, InMemoryTransport
from geofed.regions import checkpoint
from geofed.regions.device import DeviceError, Precision, resolve_device, to_device
from geofed.regions.region import Region

NO_GPU = not torch.cuda.is_available()
needs_no_gpu = pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU error path; this machine has a CUDA device")


def _cfg(**regions):
    return config_from_mapping({
        "run": {"seed": 0}, "task": {"kind": "mlp-digits", "hidden": 16},
        "regions": {"names": ["a"], **regions}, "network": {"emulation": {"mode": "none"}},
        "sync": {"inner": {"lr": 0.01}},
    })


def test_cpu_and_auto_resolve_on_this_machine():
    assert resolve_device("cpu") == torch.device("cpu")
    expected = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device("auto") == expected


@needs_no_gpu
@pytest.mark.parametrize("spec", ["cuda", "cuda:1"])
def test_cuda_without_a_gpu_names_the_key_the_region_and_the_node(spec):
    with pytest.raises(DeviceError) as exc:
        resolve_device(spec, region="eu-west-1")
    msg = str(exc.value)
    assert "regions.device" in msg and "eu-west-1" in msg and "no CUDA device" in msg


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "CPU", "cuda:0\n"])
def test_bad_device_spellings_are_config_errors(spec):
    with pytest.raises(ConfigError) as exc:
        _cfg(device=spec)
    assert "regions.device" in str(exc.value)


def test_cuda_without_reserved_gpus_is_refused():
    # Ray hides every GPU from an actor that reserves none: the run could never see its device.
    with pytest.raises(ConfigError) as exc:
        _cfg(device="cuda", num_gpus=0)
    assert "regions.num_gpus" in str(exc.value)


@needs_no_gpu
def test_validate_and_run_exit_2_with_one_line_naming_regions_device(tmp_path, capsys):
    for command in (["validate", "configs/local-wan.yaml"], ["run", "--out", str(tmp_path / "r")]):
        code = main([*command, "--set", "regions.device=cuda", "--set", "regions.num_gpus=0.25"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2, err
        assert len(err) == 1 and "regions.device" in err[0] and "has none" in err[0]
    assert not (tmp_path / "r").exists()  # refused before a run directory was made


@needs_no_gpu
def test_num_gpus_on_a_local_machine_without_one_is_refused(capsys):
    assert main(["validate", "configs/local-wan.yaml", "--set", "regions.num_gpus=1"]) == 2
    assert "regions.num_gpus" in capsys.readouterr().err


def test_cpu_works_everywhere(capsys):
    assert main(["validate", "configs/local-wan.yaml", "--set", "regions.device=cpu"]) == 0


def test_to_device_moves_nested_batches():
    batch = {"x": torch.ones(2), "pair": (torch.zeros(1), 3), "list": [torch.ones(1)]}
    out = to_device(batch, torch.device("cpu"))
    assert out["pair"][1] == 3 and out["x"].device.type == "cpu" and out["list"][0].device.type == "cpu"


@pytest.mark.parametrize("name,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_autocast_runs_matmuls_in_16_bits_and_keeps_parameters_fp32(name, dtype):
    pr = Precision(name, torch.device("cpu"))
    lin = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    before = lin.weight.detach().clone()
    with pr.autocast():
        y = lin(torch.randn(3, 8))
    assert y.dtype == dtype
    pr.backward(y.float().pow(2).mean(), opt)
    assert lin.weight.grad.dtype == torch.float32
    pr.step(opt)
    assert lin.weight.dtype == torch.float32 and not torch.equal(lin.weight, before)
    assert (pr.scaler is not None) == (name == "fp16")


def test_fp16_scaler_skips_a_step_whose_gradients_overflowed():
    pr = Precision("fp16", torch.device("cpu"))
    lin = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    before = lin.weight.detach().clone()
    scale = pr.scaler.get_scale()
    with pr.autocast():
        loss = lin(torch.full((1, 2), float("inf"))).float().sum()
    pr.backward(loss, opt)
    pr.step(opt)
    assert torch.equal(lin.weight, before)  # the non-finite step was skipped...
    assert pr.scaler.get_scale() < scale    # ...and the loss scale backed off


def _worker(tmp_path, *, precision="fp32", device="cpu"):
    cfg = config_from_mapping({
        "run": {"seed": 0, "checkpoint_every": 1}, "task": {"kind": "mlp-digits", "hidden": 16},
        "regions": {"names": ["a"], "device": device}, "network": {"emulation": {"mode": "none"}},
        "sync": {"inner": {"lr": 0.01, "precision": precision}},
    })
    return Region(cfg, "a", tmp_path, transport=InMemoryTransport("a", InMemoryHub()))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_worker_trains_in_each_precision(tmp_path, precision):
    w = _worker(tmp_path, precision=precision)
    try:
        first = w.inner_steps(10, 1.0)["train_loss"]
        later = w.inner_steps(40, 1.0)["train_loss"]
        assert later < first
        info = w.info()
        assert info["device"] == "cpu" and info["device_name"] == "cpu" and info["precision"] == precision
    finally:
        w.close()


def test_checkpoint_loads_into_the_device_the_region_trains_on(tmp_path):
    w = _worker(tmp_path / "one", precision="fp16")
    try:
        w.inner_steps(5, 1.0)
        w.completed_round = 0
        path = w.save_checkpoint()
        state = checkpoint.load_verified(path)
        assert all(t.device.type == "cpu" for t in state["model"].values())  # map_location: host memory
        assert state["precision"]["scale"] == w.precision.scaler.get_scale()
        w2 = _worker(tmp_path / "two", precision="fp16", device="auto")
        try:
            w2.load_state_dict(state)
            assert all(p.device == w2.device for p in w2.params)
            # DiLoCo takes up a checkpoint from its global model (the local steps of an unfinished round are redone)
            assert all(torch.equal(p.cpu(), q.cpu()) for p, q in zip(w.algorithm.global_params, w2.params))
            assert w2.precision.scaler.get_scale() == w.precision.scaler.get_scale()
        finally:
            w2.close()
    finally:
        w.close()
