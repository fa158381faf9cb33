"""The run's model in a standard format: ``model.safetensors`` and ``model.json`` at the end of a
run, and ``geofed export RUN_DIR`` for any checkpoint's model (docs/export.md)."""

from __future__ import annotations

from pathlib import Path
import torch

from geofed.regions import checkpoint
from geofed.regions.algorithm_traits import algorithm_traits
from geofed.regions.export import average_states, encode, named_result, params_of, trainable_names
from geofed.regions.tasks import make_task
from geofed.regions.tasks.base import PluginTaskConfig

from ..config import RunConfig, to_mapping
from ..config.strict import ConfigError
from .resume import recorded_train_fn
from .rundir import output_dir, read_json_file, run_dir_config, utc_now, write_json

SUFFIX = {"safetensors": ".safetensors", "torch": ".pt"}


def write_model(path: Path, cfg: RunConfig, state: dict[str, torch.Tensor], *, fmt: str = "safetensors",
                round_: int, regions: list[str], eval_: dict | None = None, final: dict | None = None,
                trained_by: str | None = None) -> Path:
    """Write `state` to `path` (0600, atomic) and its description next to it (same name, ``.json``):
    the task, the whole config, the round, the regions averaged and the evaluation; and the model
    card beside them (write_card). `final` is the run's summary.json when the model is not the
    run's end (``geofed export``): the card's metric is its final one, said to be of that round.
    `trained_by`: the loop API's function (`module:qualname`) whose model this is, not the task's."""
    task = cfg.task.kind if trained_by is None else f"train_fn {trained_by}"
    meta = {"geofed_task": task, "geofed_round": str(round_), "geofed_regions": ",".join(regions)}
    checkpoint.write_bytes_atomic(path, encode(state, fmt, meta if fmt == "safetensors" else None))
    write_json(path.with_suffix(".json"), {
        "file": path.name, "format": fmt, "round": round_, "regions_averaged": regions, "eval": eval_,
        "written": utc_now(), "task": to_mapping(cfg.task), "config": to_mapping(cfg),
        "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in state.items()},
    })
    write_card(path, cfg, state, fmt=fmt, round_=round_, metric=_card_metric(eval_, round_, final), trained_by=trained_by)
    return path


CARD_JSON, CARD_MD = "model-card.json", "MODEL_CARD.md"


def _card_metric(eval_: dict | None, round_: int, final: dict | None) -> dict | None:
    """The run's final metric: the one just evaluated at the end of a run, else summary.json's."""
    if final is None:
        return None if eval_ is None else {**eval_, "of_round": round_, "source": "final evaluation"}
    got = final.get("eval")
    rounds = final.get("rounds")
    if not isinstance(got, dict) or not isinstance(rounds, int) or isinstance(rounds, bool):
        return None  # an interrupted run, or a summary that does not say
    return {**{k: got.get(k) for k in ("metric", "value", "higher_is_better")}, "of_round": rounds - 1,
            "source": "summary.json"}


def load_snippet(cfg: RunConfig, weights: str, fmt: str, meta: str) -> str:
    """Python that builds the task's model and loads `weights` into it, run in their folder."""
    load = (f"from safetensors.torch import load_file\nstate = load_file({weights!r})\n" if fmt == "safetensors"
            else f"import torch\nstate = torch.load({weights!r}, weights_only=True)\n")
    # The whole config is in the weights' .json: the same task and seed build the same model class.
    return ("import json\n" + load
            + "from geofed.orchestrator.config import config_from_mapping\n"
            + "from geofed.regions.tasks import make_task\n"
            + f"cfg = config_from_mapping(json.load(open({meta!r}))['config'])\n"
            + "model = make_task(cfg.task, seed=cfg.run.seed).build_model(cfg.run.seed)\n"
            + "model.load_state_dict(state)\nmodel.eval()\n")


def write_card(path: Path, cfg: RunConfig, state: dict[str, torch.Tensor], *, fmt: str, round_: int,
               metric: dict | None, trained_by: str | None = None) -> None:
    """model-card.json and MODEL_CARD.md beside `path`: the task, how its inputs are prepared (the
    task config's own ``preprocessing()``; a plug-in's is its author's to say), the parameter
    count, the metric and a load snippet (docs/export.md, "The model card"). `trained_by`: the
    loop API's function; its model and inputs are its own, so the card names it and loads the
    weights only."""
    if trained_by is None:
        prep = cfg.task.preprocessing() if callable(getattr(cfg.task, "preprocessing", None)) else None
        task, load = cfg.task.kind, load_snippet(cfg, path.name, fmt, path.with_suffix(".json").name)
    else:
        prep, task = None, f"train_fn {trained_by}"
        load = (f"state = load_file({path.name!r})  # from safetensors.torch; build the model as {trained_by} does\n"
                "model.load_state_dict(state)\nmodel.eval()\n")
    card = {"weights": path.name, "format": fmt, "task": task, "round": round_, "rounds_trained": round_ + 1,
            "preprocessing": prep, "parameters": sum(t.numel() for t in state.values()),
            "metric": metric, "load": load}
    write_json(path.parent / CARD_JSON, card)
    checkpoint.write_bytes_atomic(path.parent / CARD_MD, _card_markdown(card).encode())


def _card_markdown(card: dict) -> str:
    prep = card["preprocessing"]
    if prep is None:
        whose = "the training function's" if card["task"].startswith("train_fn ") else "a plug-in task's"
        prep_lines = [f"not declared: {whose} inputs are its own code's to prepare"]
    else:
        prep_lines = [f"- {k}: `{v}`" if k == "transform" else f"- {k}: {v}" for k, v in prep.items()]
    m = card["metric"]
    metric = ("not recorded (the run was stopped before its final evaluation)" if m is None else
              f"{m['metric']} {m['value']:.4g} (the run's final model, round {m['of_round']}, from {m['source']})"
              if isinstance(m.get("value"), (int, float)) else f"{m.get('metric')}: not recorded")
    return "\n".join([
        f"# Model card: {card['weights']}", "",
        f"- task: {card['task']}",
        f"- round: {card['round']} ({card['rounds_trained']} rounds trained)",
        f"- parameters: {card['parameters']:,} (every tensor in the file)",
        f"- metric: {metric}", "",
        "## Preprocessing (apply to inputs before the model)", "", *prep_lines, "",
        "## Load", "", "Run in this folder, with geofed installed (it builds the model class):", "",
        "```python", card["load"].rstrip("\n"), "```", ""])


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
    on the first region alive. Returns (round, regions averaged, state_dict); ConfigError naming the
    file when there is no such checkpoint or its tensors do not fit together.

    The tensors keep the names the checkpoint gives them (regions/export.py: named_result): no
    model is built, so a plug-in task named by the run directory is never imported."""
    have = _rounds(run_dir, list(cfg.regions.names))
    if not have:
        raise ConfigError("", "no region checkpoints (checkpoints/<region>/ckpt-*.pt) in this run directory",
                          source=str(run_dir))
    r = max(have) if round_ is None else round_
    if r not in have:
        raise ConfigError("", f"no checkpoint of round {r}; rounds with checkpoints: "
                          + ", ".join(map(str, sorted(have))), source="--round")
    regions = have[r] if algorithm_traits(cfg.sync.algorithm).mixes_models else _first_alive(run_dir, r, have[r])
    states: dict[Path, dict[str, torch.Tensor]] = {}
    for region in regions:
        path = checkpoint.checkpoint_path(run_dir / "checkpoints" / region, r)
        states[path] = _named(path, checkpoint.load_verified(path), cfg)
    _check_alike(states)
    return r, regions, average_states(list(states.values()))


def _named(path: Path, state: dict, cfg: RunConfig) -> dict[str, torch.Tensor]:
    """One checkpoint's result by name; where the names are ambiguous in the state alone, a
    built-in task's model (geofed's own code) names them; a plug-in's never is built."""
    try:
        try:
            return named_result(state)
        except ValueError as exc:
            if "more than one way" not in str(exc) or isinstance(cfg.task, PluginTaskConfig):
                raise
        model = make_task(cfg.task, batch_size=cfg.sync.inner.batch_size, seed=cfg.run.seed).build_model(cfg.run.seed)
        return named_result(state, trainable_names(model))
    except ValueError as exc:
        raise ConfigError("", str(exc), source=str(path)) from None


def _check_alike(states: dict[Path, dict[str, torch.Tensor]]) -> None:
    """Every region's result has the first one's names, shapes and dtypes, or nothing is averaged."""
    (first_path, first), *rest = states.items()
    for path, state in rest:
        missing = [k for k in first if k not in state]
        extra = [k for k in state if k not in first]
        if missing or extra:
            what = f"missing {missing[0]!r}" if missing else f"an extra tensor {extra[0]!r}"
            raise ConfigError("", f"its model is not {first_path}'s: {what} "
                              f"({len(missing)} missing, {len(extra)} extra)", source=str(path))
        for k, t in first.items():
            if state[k].shape != t.shape or state[k].dtype != t.dtype:
                raise ConfigError("", f"{k}: shape {list(state[k].shape)} {state[k].dtype}, but {list(t.shape)} {t.dtype} "
                                  f"in {first_path}: not the same model", source=str(path))


def _first_alive(run_dir: Path, r: int, have: list[str]) -> list[str]:
    """DiLoCo and all-reduce: every region holds the synchronised model (up to the order of
    floating-point sums), and the run evaluates the first alive one's; so does the export."""
    try:
        alive = checkpoint.load_verified(checkpoint.checkpoint_path(run_dir / "checkpoints" / "driver", r))["alive"]
    except (checkpoint.CheckpointError, KeyError, TypeError):
        alive = have
    if not isinstance(alive, (list, tuple)):
        alive = have
    return [next((a for a in alive if isinstance(a, str) and a in have), have[0])]


def export_from_args(args) -> int:
    """`geofed export RUN_DIR [--round N] [--format F] [--out PATH]`: prints the file written.
    The run directory is read as data: its config through the strict loader, no plug-in it
    names imported, every file bounded, nothing written through a link inside it."""
    run_dir = Path(args.run_dir)
    cfg = run_dir_config(run_dir)
    if (fn := recorded_train_fn(run_dir)) is not None:
        raise ConfigError("", f"this run trained the model of the function {fn}, which geofed cannot build to name "
                          f"a checkpoint's tensors; the run's final model is {run_dir / 'model.safetensors'} (the "
                          "model's state_dict: load it with model.load_state_dict)", source=str(run_dir))
    try:
        r, regions, state = checkpoint_model(run_dir, cfg, args.round)
    except checkpoint.CheckpointError as exc:
        raise ConfigError("", str(exc), source=str(run_dir)) from None
    name = f"model-round{r}{SUFFIX[args.format]}"
    out = Path(args.out) if args.out else output_dir(run_dir, "export") / name
    summary = read_json_file(run_dir / "summary.json")  # bounded; missing: a run stopped before its end
    print(write_model(out, cfg, state, fmt=args.format, round_=r, regions=regions,
                      final=summary if isinstance(summary, dict) else {}))
    return 0
