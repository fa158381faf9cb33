"""Task configs without torch: the config class of every built-in task kind, plug-in tasks'
config and their trust checks, and the registry of kind -> config class.

The config loader, `geofed validate` and `geofed config-docs` need only these, so they never import
torch; the task modules (digits.py, charlm.py, ...) import their config from here and register
their factory with `base.register_task`, which refuses a kind or class this registry does not
hold (one list of kinds). A graph config's `check_data` imports the graph loader, and torch with
it; a plug-in task's module is the user's code and imports what it imports.

Trust model of plug-ins: see base.py's module docstring.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

TEXT_DEFAULT_DATASET = "tinyshakespeare"
GRAPH_DEFAULT_DATASET = "cora"
# regions/graph/data.py's MAX_GRAPH_BYTES in MiB (a test keeps them equal: that module imports torch).
GRAPH_MAX_MB = 1024
INSTALL_HINT = "pip install 'geofed[hf]'"


def _doc(text: str) -> dict:
    return {"doc": text}


def task_data_path(dataset: str, kind: str) -> str:
    """The dataset's file in this machine's data cache (regions/datasets/cache.py), imported only
    when a config names a dataset: the datasets package brings the downloader (HTTP, TLS) with it."""
    from geofed.regions.datasets.cache import task_data_path as cached_path

    return cached_path(dataset, kind)


_CONFIGS: dict[str, type] = {}


def register_task_config(cls: type) -> type:
    """Class decorator adding a built-in task's config class under its `kind` field's default."""
    assert dataclasses.is_dataclass(cls), cls
    kind = next(f.default for f in dataclasses.fields(cls) if f.name == "kind")
    assert kind not in _CONFIGS, kind
    _CONFIGS[kind] = cls
    return cls


def task_kinds() -> list[str]:
    """The built-in task kinds; plug-ins are named python:module:function instead."""
    return sorted(_CONFIGS)


def task_config_class(kind: str) -> type:
    """Config class for `kind`; KeyError with the known names otherwise (used by the loader)."""
    if kind.startswith("python:"):
        return PluginTaskConfig
    if kind not in _CONFIGS:
        raise KeyError(f"unknown task {kind!r} (known: {', '.join(sorted(_CONFIGS))}, python:module:function)")
    return _CONFIGS[kind]


# ---- plug-in tasks ----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class PluginTaskConfig:
    """``kind: python:package.module:function``; every other key goes to the function."""

    kind: str
    path: str | None = field(default=None, metadata={"path": "config", "doc": "folder put on sys.path before importing the module"})
    options: Mapping[str, Any] = field(default_factory=dict, metadata={"doc": "keyword arguments for the factory"})

    def __post_init__(self):
        if not _PLUGIN_KIND.fullmatch(self.kind):
            raise ValueError(f"kind: expected python:module:function (dotted Python names), got {self.kind!r}")


_PLUGIN_KIND = re.compile(r"python:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*", re.ASCII)
ENTRY_POINT_GROUP = "geofed.tasks"
# id -> the factory itself: a mark by identity, which no look-alike object (a proxy whose every
# attribute is truthy, a module __getattr__) can fake. Holding the function keeps its id unique.
_FACTORIES: dict[int, Callable[..., Any]] = {}


def task_factory(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark `fn` as a geofed task factory: a config may then name it as
    ``task.kind: python:module:function``; ``fn(**task.options)`` returns a Task.

    A config can only make geofed call functions marked so (or declared as ``geofed.tasks``
    entry points): naming any other callable, ``os:system`` say, is refused before a call.
    """
    if not callable(fn):
        raise TypeError(f"task_factory: {fn!r} is not callable")
    _FACTORIES[id(fn)] = fn
    return fn


def is_task_factory(fn: Any) -> bool:
    """Whether `fn` was marked by @task_factory (by identity, which no look-alike object can fake)."""
    return _FACTORIES.get(id(fn)) is fn


def _declared_entry_point(module: str, attr: str) -> bool:
    """Whether an installed distribution declares ``module:attr`` in the ``geofed.tasks`` entry
    point group (read from metadata: nothing is imported)."""
    from importlib.metadata import entry_points

    return any(ep.module == module and ep.attr == attr for ep in entry_points(group=ENTRY_POINT_GROUP))


def load_task_factory(config: PluginTaskConfig) -> Callable[..., Any]:
    """The factory `config.kind` names, once it is known to be marked; ValueError('kind: ...')
    otherwise. Importing the module runs its top-level code (see the module docstring)."""
    _, module_name, fn_name = config.kind.split(":")
    top = module_name.split(".")[0]
    if top in sys.stdlib_module_names or top == "geofed":
        raise ValueError(f"kind: {config.kind!r} names {top!r}, which holds no geofed task factory "
                         f"(a plug-in task is a function in your own module, marked @task_factory)")
    declared = _declared_entry_point(module_name, fn_name)
    if config.path is not None and config.path not in sys.path:
        sys.path.insert(0, config.path)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - the user's module: any error it raises, on one line
        raise ValueError(f"kind: cannot import {module_name!r} for {config.kind!r}: {type(exc).__name__}: {exc} "
                         f"(python -c 'import {module_name}' shows the traceback)") from None
    fn = vars(module).get(fn_name)  # no module __getattr__: a plain lookup
    if fn is None:
        raise ValueError(f"kind: {config.kind!r}: module {module_name!r} has no {fn_name!r}")
    if not (declared or is_task_factory(fn)):
        raise ValueError(f"kind: {config.kind!r} is not a geofed task factory; mark it with "
                         f"@geofed.regions.tasks.task_factory or declare it as a {ENTRY_POINT_GROUP!r} entry point "
                         f"(a config may only name marked factories)")
    return fn


# ---- the built-in tasks' configs -------------------------------------------------------------
DIGITS_INPUT_SCALE = 16.0  # the 8x8 digits' pixels are 0..16; the MLP sees them in 0..1


def _text_tokens(tokenizer: str | None, context: int) -> dict[str, Any]:
    if tokenizer is None:
        return {"input": f"token ids, up to {context} at a time", "transform": "UTF-8 bytes; token id = byte value "
                "(vocabulary 256)", "tokenizer": "bytes", "output": "next-token logits"}
    return {"input": f"token ids, up to {context} at a time", "transform": "the tokenizers file's encode(text).ids",
            "tokenizer": tokenizer, "output": "next-token logits"}


@register_task_config
@dataclass(frozen=True, kw_only=True)
class DigitsConfig:
    """``task.kind: mlp-digits``: an MLP on scikit-learn's bundled 8x8 digits (no download)."""

    kind: Literal["mlp-digits"] = "mlp-digits"

    def preprocessing(self) -> dict[str, Any]:
        """What the model's inputs are, as data (the export's model card says it; digits.py divides by it)."""
        return {"input": "an 8x8 grey image as 64 float32 values, row by row, pixel values 0..16",
                "transform": f"x / {DIGITS_INPUT_SCALE:g}", "scale": DIGITS_INPUT_SCALE,
                "output": "10 logits, digits 0..9"}

    hidden: int = field(default=64, metadata={"doc": "hidden units of each hidden layer of the MLP"})
    layers: int = field(default=1, metadata={"doc": "hidden layers: 1 is 64-hidden-10, 2 is 64-hidden-hidden-10"})
    activation: Literal["relu", "tanh"] = field(default="relu", metadata={"doc": (
        "of the hidden layers; tanh (a tempered sigmoid: bounded, so clipped, noised DP-SGD gradients stay "
        "smaller; Papernot et al. 2021) suits privacy.dp.mode record")})
    test_fraction: float = field(default=0.25, metadata={"doc": "held-out fraction (stratified) for evaluation"})
    partition: Literal["iid", "dirichlet"] = field(default="iid", metadata={"doc": "how training data is split across regions"})
    alpha: float = field(default=0.5, metadata={"doc": "Dirichlet concentration for partition: dirichlet (small = skewed)"})
    batch_size: int | None = field(default=None, metadata={"doc": "overrides sync.inner.batch_size for this task"})

    def __post_init__(self):
        if not 1 <= self.hidden <= 65536:
            raise ValueError(f"hidden: must be in [1, 65536], got {self.hidden}")
        if not 1 <= self.layers <= 8:
            raise ValueError(f"layers: must be in [1, 8], got {self.layers}")
        if not 0.05 <= self.test_fraction <= 0.9:
            raise ValueError(f"test_fraction: must be in [0.05, 0.9], got {self.test_fraction}")
        if not 0 < self.alpha <= 1e6:
            raise ValueError(f"alpha: must be in (0, 1e6], got {self.alpha}")


@register_task_config
@dataclass(frozen=True, kw_only=True)
class CharLMConfig:
    """``task.kind: char-lm``: a character-level GRU language model trained on a text file."""

    kind: Literal["char-lm"] = "char-lm"

    def preprocessing(self) -> dict[str, Any]:
        """What the model's inputs are, as data (the export's model card says it)."""
        return {"input": "character ids, seq_len at a time",
                "transform": "each character -> its index in sorted(set(text)) of the first max_chars characters "
                             "of the training file (the vocabulary is that file's; rebuild it from the same file)",
                "path": self.path, "max_chars": self.max_chars, "output": "logits over that vocabulary"}

    dataset: str = field(default=TEXT_DEFAULT_DATASET, metadata={"doc": (
        "tinyshakespeare, read from the data cache ($GEOFED_DATA, default ~/.cache/geofed; fetch with "
        "`geofed data fetch tinyshakespeare`, docs/data.md); resolved on the driver; ignored when path is set")})
    path: str = field(default="", metadata={"path": "config", "doc": (
        "your own UTF-8 text file instead of dataset; a regular file of any "
        "size, of which only the first max_chars characters are read")})
    max_chars: int = field(default=300_000, metadata={"doc": (
        "use at most this many characters from the start of the file (at most 4 bytes each are read)")})
    seq_len: int = field(default=64, metadata={"doc": "characters per training sequence"})
    embed: int = field(default=32, metadata={"doc": "character embedding size"})
    hidden: int = field(default=128, metadata={"doc": "GRU hidden size"})
    layers: int = field(default=1, metadata={"doc": "GRU layers"})
    test_fraction: float = field(default=0.1, metadata={"doc": "the last fraction of the text is held out"})
    partition: Literal["contiguous", "iid"] = field(
        default="contiguous", metadata={"doc": "contiguous: each region a different stretch of text (non-IID); iid: windows from anywhere"})
    eval_sequences: int = field(default=64, metadata={"doc": "held-out sequences scored at evaluation"})

    def __post_init__(self):
        if not self.path:  # the dataset's file in this machine's cache (the driver's, where configs are built)
            object.__setattr__(self, "path", task_data_path(self.dataset, "char-lm"))
        for key, lo, hi in (("max_chars", 1000, 10**9), ("seq_len", 2, 4096), ("embed", 1, 4096),
                            ("hidden", 1, 8192), ("layers", 1, 16), ("eval_sequences", 1, 100_000)):
            v = getattr(self, key)
            if not lo <= v <= hi:
                raise ValueError(f"{key}: must be in [{lo}, {hi}], got {v}")
        if not 0.01 <= self.test_fraction <= 0.5:
            raise ValueError(f"test_fraction: must be in [0.01, 0.5], got {self.test_fraction}")


@register_task_config
@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """``task.kind: gpt``: a decoder-only transformer trained on a text file (byte tokens or BPE)."""

    kind: Literal["gpt"] = "gpt"

    def preprocessing(self) -> dict[str, Any]:
        """What the model's inputs are, as data (the export's model card says it)."""
        return _text_tokens(self.tokenizer, self.context)

    dataset: str = field(default=TEXT_DEFAULT_DATASET, metadata={"doc": (
        "tinyshakespeare, read from the data cache ($GEOFED_DATA, default ~/.cache/geofed; fetch with "
        "`geofed data fetch tinyshakespeare`, docs/data.md); resolved on the driver; ignored when path is set")})
    path: str = field(default="", metadata={"path": "config", "doc": (
        "your own UTF-8 text file instead of dataset; only the first "
        "max_chars characters are read")})
    tokenizer: str | None = field(default=None, metadata={"path": "config", "doc": (
        "a Hugging Face `tokenizers` JSON file (e.g. a trained BPE); null: byte-level tokens (vocabulary 256)")})
    max_chars: int = field(default=1_000_000, metadata={"doc": "use at most this many characters from the start of the file"})
    n_layer: int = field(default=5, metadata={"doc": "transformer blocks"})
    n_head: int = field(default=4, metadata={"doc": "attention heads (d_model must divide by it)"})
    d_model: int = field(default=128, metadata={"doc": "model width; the MLP is 4 x d_model"})
    context: int = field(default=128, metadata={"doc": "tokens per training sequence (and positions the model knows)"})
    dropout: float = field(default=0.0, metadata={"doc": "dropout on attention, residual and embeddings"})
    tie_embeddings: bool = field(default=True, metadata={"doc": "the output layer shares the token embedding's weights"})
    test_fraction: float = field(default=0.1, metadata={"doc": "the last fraction of the tokens is held out"})
    partition: Literal["contiguous", "iid"] = field(
        default="contiguous", metadata={"doc": "contiguous: each region a different stretch of text (non-IID); iid: windows from anywhere"})
    eval_sequences: int = field(default=64, metadata={"doc": "held-out sequences scored at evaluation"})
    activation_checkpointing: bool = field(default=False, metadata={"doc": (
        "keep only each block's input through the forward pass and recompute the block in the backward pass "
        "(torch.utils.checkpoint): activations fall from all blocks' to about one block's (at 100M parameters, "
        "batch 4 x 256: docs/bench-memory.md) for about one more forward pass of compute per step")})

    def __post_init__(self):
        if not self.path:  # the dataset's file in this machine's cache (the driver's, where configs are built)
            object.__setattr__(self, "path", task_data_path(self.dataset, "gpt"))
        for key, lo, hi in (("max_chars", 1000, 10**10), ("n_layer", 1, 128), ("n_head", 1, 256),
                            ("d_model", 8, 16384), ("context", 2, 65_536), ("eval_sequences", 1, 100_000)):
            v = getattr(self, key)
            if not lo <= v <= hi:
                raise ValueError(f"{key}: must be in [{lo}, {hi}], got {v}")
        if self.d_model % self.n_head:
            raise ValueError(f"n_head: d_model {self.d_model} does not divide into {self.n_head} heads")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: must be in [0, 1), got {self.dropout}")
        if not 0.01 <= self.test_fraction <= 0.5:
            raise ValueError(f"test_fraction: must be in [0.01, 0.5], got {self.test_fraction}")


@register_task_config
@dataclass(frozen=True, kw_only=True)
class GcnPlanetoidConfig:
    """``task.kind: gcn-planetoid``: node classification on a graph .npz, its nodes split across regions."""

    kind: Literal["gcn-planetoid"] = "gcn-planetoid"

    def preprocessing(self) -> dict[str, Any]:
        """What the model's inputs are, as data (the export's model card says it)."""
        return {"input": "the graph's node features x and edge_index, as stored in the .npz", "transform": "none",
                "path": self.path, "output": "per-node class logits"}

    dataset: str = field(default=GRAPH_DEFAULT_DATASET, metadata=_doc(
        "cora or citeseer, read from the data cache ($GEOFED_DATA, default ~/.cache/geofed; fetch with "
        "`geofed data fetch NAME`, docs/data.md); resolved on the driver; ignored when path is set"))
    path: str = field(default="", metadata={"path": "config", **_doc(
        "your own graph .npz (x, y, edge_index, train/val/test masks; `geofed data convert-graph` writes one) "
        "instead of dataset")})
    model: Literal["gcn", "sage"] = field(default="gcn", metadata=_doc("gcn (Kipf & Welling) or sage (GraphSAGE-mean)"))
    hidden: int = field(default=16, metadata=_doc("hidden units"))
    dropout: float = field(default=0.5, metadata=_doc("dropout on input features and hidden layer"))
    weight_decay: float = field(default=5e-4, metadata=_doc(
        "L2 on the first layer, inside the loss (use an inner optimizer with weight_decay 0)"))
    partition: Literal["louvain", "label-dirichlet", "random"] = field(
        default="louvain", metadata=_doc("how nodes are split into regions"))
    alpha: float = field(default=0.5, metadata=_doc("Dirichlet concentration for label-dirichlet (small: more skew)"))
    partition_seed: int = field(default=0, metadata=_doc(
        "seed of the partition; fixed apart from run.seed so seeds compare on the same split"))
    loss_weighting: Literal["nodes", "regions"] = field(default="nodes", metadata=_doc(
        "nodes: weight each region's loss by its train-node count, so the regions' average objective "
        "is the centralized one; regions: each region's plain mean"))
    halo: bool = field(default=False, metadata=_doc(
        "keep 1-hop out-of-region neighbours' features (not labels); their one-time bytes are counted"))
    max_mb: int = field(default=GRAPH_MAX_MB, metadata=_doc(
        "largest graph accepted, MiB: the file on disk and its arrays uncompressed, checked before anything "
        "is decompressed (the driver and every region load the whole graph; Cora is 4 MB)"))

    def __post_init__(self):
        if not self.path:  # the dataset's file in this machine's cache (the driver's, where configs are built)
            object.__setattr__(self, "path", task_data_path(self.dataset, "gcn-planetoid"))
        if not 1 <= self.hidden <= 65536:
            raise ValueError(f"hidden: must be in [1, 65536], got {self.hidden}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout: must be in [0, 1), got {self.dropout}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay: must be >= 0, got {self.weight_decay}")
        if not self.alpha > 0:
            raise ValueError(f"alpha: must be > 0, got {self.alpha}")
        if not 1 <= self.max_mb <= 1 << 20:
            raise ValueError(f"max_mb: must be in [1, 1048576], got {self.max_mb}")

    def check_data(self) -> None:
        """Load the graph with the task's own checks and caps (`geofed validate` calls this), so a
        file every region would refuse, or pay gigabytes for, is refused before anything starts;
        ValueError starts with "task.path: " and names the file."""
        from geofed.regions.graph.data import load_task_graph  # torch and the loader: only when a graph is read

        load_task_graph(self.path, max_mb=self.max_mb)


@register_task_config
@dataclass(frozen=True, kw_only=True)
class HFCausalLMConfig:
    """``task.kind: hf-causal-lm``: a transformers causal LM (from a local config or a named
    architecture) trained on a text file; needs ``pip install 'geofed[hf]'``."""

    kind: Literal["hf-causal-lm"] = "hf-causal-lm"

    def preprocessing(self) -> dict[str, Any]:
        """What the model's inputs are, as data (the export's model card says it)."""
        return _text_tokens(self.tokenizer, self.context)

    config: str = field(default="", metadata={"path": "config", "doc": (
        "a local transformers config.json, or a folder holding one (the model gets random weights); "
        "empty: built from architecture and the sizes below")})
    architecture: str = field(default="gpt2", metadata={"doc": (
        "a transformers model type (gpt2, llama, qwen2, ...) built from n_layer/n_head/d_model/context; "
        "ignored when config is set")})
    n_layer: int = field(default=2, metadata={"doc": "transformer blocks (num_hidden_layers)"})
    n_head: int = field(default=2, metadata={"doc": "attention heads (d_model must divide by it)"})
    d_model: int = field(default=64, metadata={"doc": "model width (hidden_size); the MLP is 4 x d_model"})
    vocab: int | None = field(default=None, metadata={"doc": (
        "vocabulary size; null: the tokenizer's (256 for bytes); must hold every token id")})
    extra: Mapping[str, Any] = field(default_factory=dict, metadata={"doc": (
        "more transformers config keys, e.g. {num_key_value_heads: 1, rope_theta: 10000}")})
    context: int = field(default=128, metadata={"doc": "tokens per training sequence (at most the model's positions)"})
    dataset: str = field(default=TEXT_DEFAULT_DATASET, metadata={"doc": (
        "tinyshakespeare from the data cache (`geofed data fetch tinyshakespeare`); ignored when path is set")})
    path: str = field(default="", metadata={"path": "config", "doc": "your own UTF-8 text file instead of dataset"})
    tokenizer: str | None = field(default=None, metadata={"path": "config", "doc": (
        "a local `tokenizers` JSON file, or a folder holding tokenizer.json; null: byte tokens (vocabulary 256)")})
    max_chars: int = field(default=1_000_000, metadata={"doc": "use at most this many characters from the start of the file"})
    test_fraction: float = field(default=0.1, metadata={"doc": "the last fraction of the tokens is held out"})
    partition: Literal["contiguous", "iid"] = field(
        default="contiguous", metadata={"doc": "contiguous: each region a different stretch of text (non-IID); iid: windows from anywhere"})
    eval_sequences: int = field(default=64, metadata={"doc": "held-out sequences scored at evaluation"})

    def __post_init__(self):
        if importlib.util.find_spec("transformers") is None:
            raise ValueError(f"kind: hf-causal-lm needs the transformers package, which is not installed: {INSTALL_HINT}")
        if not self.path:
            object.__setattr__(self, "path", task_data_path(self.dataset, "hf-causal-lm"))
        for key, lo, hi in (("n_layer", 1, 256), ("n_head", 1, 256), ("d_model", 8, 65_536), ("context", 2, 1 << 20),
                            ("max_chars", 1000, 10**10), ("eval_sequences", 1, 100_000)):
            if not lo <= getattr(self, key) <= hi:
                raise ValueError(f"{key}: must be in [{lo}, {hi}], got {getattr(self, key)}")
        if self.vocab is not None and not 2 <= self.vocab <= 10**7:
            raise ValueError(f"vocab: must be in [2, 10000000] or null, got {self.vocab}")
        if not 0.01 <= self.test_fraction <= 0.5:
            raise ValueError(f"test_fraction: must be in [0.01, 0.5], got {self.test_fraction}")
        if self.config:
            if not _config_file(self.config).is_file():
                raise ValueError(f"config: no transformers config.json at {self.config!r} (a local file or folder; "
                                 "nothing is downloaded)")
        else:
            if self.d_model % self.n_head:
                raise ValueError(f"n_head: d_model {self.d_model} does not divide into {self.n_head} heads")
            _check_architecture(self.architecture)
        if self.tokenizer is not None and not _tokenizer_file(self.tokenizer).is_file():
            raise ValueError(f"tokenizer: no tokenizers JSON at {self.tokenizer!r} (a file, or a folder with tokenizer.json)")


def _config_file(path: str) -> Path:
    p = Path(path)
    return p / "config.json" if p.is_dir() else p


def _tokenizer_file(path: str) -> Path:
    p = Path(path)
    return p / "tokenizer.json" if p.is_dir() else p


def _check_architecture(name: str) -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if name not in CONFIG_MAPPING:
        raise ValueError(f"architecture: {name!r} is not a transformers model type (e.g. gpt2, llama, qwen2)")
