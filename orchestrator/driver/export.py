"""The run's model in a standard format: ``model.safetensors`` and ``model.json`` at the end of a
run, and ``geofed export RUN_DIR`` for any checkpoint's model (docs/export.md)."""

from __future__ import annotations

from pathlib import Path
import torch

from geofed.regions import checkpoint
from geofed.regions.export import average_states, checkpoint_result, encode, params_of
from geofed.regions.tasks import make_task

from ..config import RunConfig, load_config, to_mapping
from ..config.strict import ConfigError
from .rundir import utc_now, write_json

SUFFIX = {"safetensors": ".safetensors", "torch": ".pt"}


def write_model(path: Path, cfg: RunConfig, state: dict[str, torch.Tensor], *, fmt: str = "safetensors",
                round_: int, regions: list[str], eval_: dict | None = None) -> Path:
    """Write `state` to `path` (0600, atomic) and its description next to it (same name, ``.json``):
    the task, the whole config, the round, the regions averaged and the evaluation."""
    meta = {"geofed_task": cfg.task.kind, "geofed_round": str(round_), "geofed_regions": ",".join(regions)}
    checkpoint.write_bytes_atomic(path, encode(state, fmt, meta if fmt == "safetensors" else None))
    write_json(path.with_suffix(".json"), {
        "file": path.name, "format": fmt, "round": round_, "regions_averaged": regions, "eval": eval_,
        "written": utc_now(), "task": to_mapping(cfg.task), "config": to_mapping(cfg),
        "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in state.items()},
    })
    return path


def params_by_region(cfg: RunConfig, states: dict[str, dict[str, torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    """Each region's trainable parameters (model.parameters() order) from its result state_dict."""
    model = make_task(cfg.task, batch_size=cfg.sync.inner.batch_size, seed=cfg.run.seed).build_model(cfg.run.seed)
    return {region: params_of(model, state) for region, state in states.items()}


def _rounds(run_dir: Path, regions: list[str]) -> dict[int, list[str]]:
    """Round -> regions that have a checkpoint file of it."""
    out: dict[int, list[str]] = {}
    for region in regions:
        for r in checkpoint.list_rounds(run_dir / "checkpoints" / region):
            out.setdefault(r, []).append(region)
    return out


def checkpoint_model(run_dir: Path, cfg: RunConfig, round_: int | None = None
                     ) -> tuple[int, list[str], dict[str, torch.Tensor]]:
    """The model of round `round_` (default: the newest) from the regions' checkpoints, as the run
    evaluates it: gossip's average of every region's, DiLoCo's and all-reduce's synchronised model
    on the first region alive. Returns (round, regions averaged, state_dict); ConfigError when
    there is no such checkpoint."""
    have = _rounds(run_dir, list(cfg.regions.names))
    if not have:
        raise ConfigError("", "no region checkpoints (checkpoints/<region>/ckpt-*.pt) in this run directory",
                          source=str(run_dir))
    r = max(have) if round_ is None else round_
    if r not in have:
        raise ConfigError("", f"no checkpoint of round {r}; rounds with checkpoints: "
                          + ", ".join(map(str, sorted(have))), source="--round")
    regions = have[r] if cfg.sync.algorithm == "gossip" else _first_alive(run_dir, r, have[r])
    task = make_task(cfg.task, batch_size=cfg.sync.inner.batch_size, seed=cfg.run.seed)
    model = task.build_model(cfg.run.seed)
    states = []
    for region in regions:
        state = checkpoint.load_verified(checkpoint.checkpoint_path(run_dir / "checkpoints" / region, r))
        states.append(checkpoint_result(model, state))
    return r, regions, average_states(states)


def _first_alive(run_dir: Path, r: int, have: list[str]) -> list[str]:
    """DiLoCo and all-reduce: every region holds the synchronised model (up to the order of
    floating-point sums), and the run evaluates the first alive one's; so does the export."""
    try:
        alive = checkpoint.load_verified(checkpoint.checkpoint_path(run_dir / "checkpoints" / "driver", r))["alive"]
    except (checkpoint.CheckpointError, KeyError, TypeError):
        alive = have
    return [next((a for a in alive if a in have), have[0])]


def export_from_args(args) -> int:
    """`geofed export RUN_DIR [--round N] [--format F] [--out PATH]`: prints the file written."""
    run_dir = Path(args.run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError("", "not a run directory (no config.yaml)", source=str(run_dir))
    cfg = load_config(run_dir / "config.yaml")
    try:
        r, regions, state = checkpoint_model(run_dir, cfg, args.round)
    except checkpoint.CheckpointError as exc:
        raise ConfigError("", str(exc), source=str(run_dir)) from None
    out = Path(args.out) if args.out else run_dir / "export" / f"model-round{r}{SUFFIX[args.format]}"
    print(write_model(out, cfg, state, fmt=args.format, round_=r, regions=regions))
    return 0

