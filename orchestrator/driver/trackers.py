"""Experiment trackers (run.trackers): TensorBoard and MLflow, each writing a local store inside
the run directory (no server). The runner hands every rounds.jsonl record to `Trackers.log_round`
and the config to `log_params` at the start (docs/trackers.md)."""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Any, Protocol

from ..config import RunConfig, to_mapping
from ..config.strict import ConfigError

log = logging.getLogger(__name__)

# tracker -> (module that must be importable, pip extra that installs it)
EXTRAS = {"tensorboard": ("tensorboard", "geofed[tensorboard]"), "mlflow": ("mlflow", "geofed[mlflow]")}


def check_trackers(cfg: RunConfig, *, source: str = "run.trackers") -> None:
    """ConfigError (exit 2) naming run.trackers and the pip extra when a tracker's library is missing."""
    for name in cfg.run.trackers:
        module, extra = EXTRAS[name]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ConfigError("run.trackers", f"{name} needs the {module!r} package, which is not installed: "
                              f"pip install '{extra}' (or drop {name} from run.trackers)", source=source)


def round_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The numbers a tracker logs from one rounds.jsonl record: loss, eval, H, bytes, utilisation,
    and per link (``link/<src>_to_<dst>/...``: MLflow names may not hold '>') bandwidth and RTT."""
    out: dict[str, float] = {}
    for key, name in (("mean_train_loss", "loss"), ("H", "H"), ("bytes_sent", "bytes_sent"),
                      ("utilization", "utilization"), ("consensus_distance", "consensus_distance")):
        if isinstance(record.get(key), (int, float)):
            out[name] = float(record[key])
    ev = record.get("eval_avg")
    if ev and isinstance(ev.get("value"), (int, float)):
        out[f"eval/{ev['metric']}"] = float(ev["value"])
    for link, est in (record.get("links") or {}).items():
        tag = "link/" + link.replace("->", "_to_")
        for key in ("bandwidth_mbps", "rtt_ms", "configured_bandwidth_mbps", "configured_rtt_ms"):
            if isinstance(est.get(key), (int, float)):
                out[f"{tag}/{key}"] = float(est[key])
    return out


def config_params(cfg: RunConfig) -> dict[str, str]:
    """The config flattened to dotted keys (``sync.policy.kind``) with string values."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = str(value)
    walk("", to_mapping(cfg))
    return out


class Tracker(Protocol):
    """One tracker's store: the config once, then the metrics of every round (step = round)."""

    def log_params(self, params: dict[str, str]) -> None: ...
    def log_round(self, round_: int, metrics: dict[str, float]) -> None: ...
    def close(self, status: str) -> None: ...


class TensorBoardTracker:
    """Scalars per round and the config as a text table, in RUN_DIR/tensorboard/ (event files)."""

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = run_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.logdir))

    def log_params(self, params: dict[str, str]) -> None:
        rows = "\n".join(f"| {k} | {v} |" for k, v in params.items())
        self.writer.add_text("config", "| key | value |\n| --- | --- |\n" + rows, global_step=0)

    def log_round(self, round_: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=round_)
        self.writer.flush()  # `geofed watch` and a TensorBoard open on the run see each round at once

    def close(self, status: str) -> None:
        self.writer.close()
        _private(self.logdir)


class MlflowTracker:
    """A run in a local MLflow store, RUN_DIR/mlflow.db (SQLite; MLflow 3 refuses its old file
    store without an opt-out), artifacts under RUN_DIR/mlartifacts. A resumed run continues
    the MLflow run of the same name."""

    EXPERIMENT = "geofed"

    def __init__(self, run_dir: Path, run_name: str):
        import mlflow

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # its "Creating initial MLflow database tables" lines
        self.run_dir = run_dir
        self.uri = f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        self.client = mlflow.MlflowClient(tracking_uri=self.uri)
        exp = self.client.get_experiment_by_name(self.EXPERIMENT)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(
            self.EXPERIMENT, artifact_location=(run_dir / "mlartifacts").resolve().as_uri())
        found = self.client.search_runs([exp_id], filter_string=f"tags.`mlflow.runName` = '{run_name}'", max_results=1)
        self.run_id = found[0].info.run_id if found else self.client.create_run(exp_id, run_name=run_name).info.run_id
        self.resumed = bool(found)
        if self.resumed:
            self.client.update_run(self.run_id, status="RUNNING")

    def log_params(self, params: dict[str, str]) -> None:
        if self.resumed:
            return  # params are immutable in MLflow, and a resume keeps the config (config.record.json)
        from mlflow.entities import Param

        items = [Param(k, v[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_round(self, round_: int, metrics: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, round_) for k, v in metrics.items()])

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)
        _private(self.run_dir / "mlflow.db")


def _private(path: Path) -> None:
    """The run directory's rule (0600 files, 0700 folders) for what a library wrote with its own modes."""
    paths = [path, *path.rglob("*")] if path.is_dir() else [path]
    for p in paths:
        if p.exists() and not p.is_symlink():
            os.chmod(p, 0o700 if p.is_dir() else 0o600)


class Trackers:
    """The run's trackers together; a tracker that fails is reported once and dropped (the run goes on)."""

    def __init__(self, cfg: RunConfig, run_dir: Path):
        self.items: dict[str, Tracker] = {}
        for name in cfg.run.trackers:
            self.items[name] = TensorBoardTracker(run_dir) if name == "tensorboard" else MlflowTracker(run_dir, run_dir.name)
        self._each("log_params", config_params(cfg))

    def log_round(self, record: dict[str, Any]) -> None:
        """Log one rounds.jsonl record (step = its round)."""
        if self.items:
            self._each("log_round", int(record["round"]), round_metrics(record))

    def log_reports(self, round_: int, reports: dict[str, dict[str, Any]]) -> None:
        """The loop API's ctx.report values that are numbers, as ``report/<region>/<key>`` at the
        run's last round (summary.json's `reports` holds them all)."""
        metrics = {f"report/{region}/{key}": float(value) for region, values in reports.items()
                   for key, value in values.items() if isinstance(value, (int, float)) and not isinstance(value, bool)}
        if self.items and metrics:
            self._each("log_round", round_, metrics)

    def close(self, status: str = "FINISHED") -> None:
        """Flush and close every tracker (status: MLflow's FINISHED, FAILED or KILLED)."""
        self._each("close", status)
        self.items.clear()

    def _each(self, method: str, *args) -> None:
        for name, tracker in list(self.items.items()):
            try:
                getattr(tracker, method)(*args)
            except Exception as exc:  # noqa: BLE001 - a tracker (disk, database) never takes the run down
                log.warning("tracker %s dropped: %s failed: %s", name, method, exc)
                print(f"geofed: run.trackers: {name} dropped ({method}: {exc})", flush=True)
                self.items.pop(name, None)
