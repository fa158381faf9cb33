"""run.trackers: a real run logs every round to TensorBoard and MLflow stores inside the run
directory, read back here with each library's own reader."""

from __future__ import annotations

import sys

import pytest

from geofed.orchestrator.cli import main
from geofed.orchestrator.config import load_config
from geofed.orchestrator.driver.rundir import read_jsonl
from geofed.orchestrator.driver.run import Runner
from geofed.orchestrator.driver.trackers import round_metrics

pytest.importorskip("tensorboard", reason="needs the 'tensorboard' package (pip install 'geofed[tensorboard]')")
pytest.importorskip("mlflow", reason="needs the 'mlflow' package (pip install 'geofed[mlflow]')")


@pytest.mark.usefixtures("ray_session")
def test_tensorboard_and_mlflow_get_every_round(tmp_path):
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # 2048 hidden units: 0.55 MB identity updates over links at 5% of AWS bandwidth, so transfers
    # measure bandwidth (a small update measures only latency).
    cfg = load_config(None, ["run.rounds=3", "run.eval_every=1", "run.report=false", "run.trackers=[tensorboard, mlflow]",
                             "regions.names=[us-east-1, eu-west-1]", "task.hidden=2048", "compression.codec=identity",
                             "network.emulation.bandwidth_scale=0.05",
                             # every round evaluates its own model (with overlap round 0 is evaluated in round 1)
                             "sync.overlap=false", "sync.policy={kind: fixed, H: 20}"])
    runner = Runner(cfg, tmp_path, show_progress=False)
    try:
        runner.run()
    finally:
        runner.shutdown()
    rounds = read_jsonl(tmp_path / "rounds.jsonl")
    expected = [round_metrics(r) for r in rounds]
    assert len(expected) == 3
    for name in ("loss", "H", "bytes_sent", "utilization", "eval/accuracy"):
        assert all(name in e for e in expected), name
    links = {k for e in expected for k in e if k.startswith("link/")}
    for link in ("us-east-1_to_eu-west-1", "eu-west-1_to_us-east-1"):
        assert {f"link/{link}/rtt_ms", f"link/{link}/bandwidth_mbps", f"link/{link}/configured_bandwidth_mbps"} <= links

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert set().union(*expected) <= tags
    for r, e in enumerate(expected):
        for name, value in e.items():
            (ev,) = [s for s in acc.Scalars(name) if s.step == r]
            assert ev.value == pytest.approx(value, rel=1e-6), (name, r)
    config_text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| sync.policy.kind | adaptive |" in config_text or f"| sync.policy.kind | {cfg.sync.policy.kind} |" in config_text

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("geofed").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == tmp_path.name
    assert run.data.params["run.rounds"] == "3" and run.data.params["task.hidden"] == "2048"
    assert run.data.params["run.trackers"] == "['tensorboard', 'mlflow']"
    for name in set().union(*expected):
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
        assert history == pytest.approx({r: e[name] for r, e in enumerate(expected) if name in e}), name


def test_a_missing_tracker_library_is_a_config_error_naming_the_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed: find_spec and import both fail
    code = main(["run", "--out", str(tmp_path / "r"), "--set", "run.trackers=[mlflow]"])
    err = capsys.readouterr().err
    assert code == 2
    assert "run.trackers" in err and "pip install 'geofed[mlflow]'" in err
    assert not (tmp_path / "r").exists()  # refused before the run directory is made
    assert main(["validate", "configs/local-wan.yaml", "--set", "run.trackers=[mlflow]"]) == 2
