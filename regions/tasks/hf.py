"""`hf-causal-lm`: a Hugging Face ``transformers`` causal language model on a local text file.

The optional extra ``pip install 'geofed[hf]'`` brings transformers and tokenizers; geofed imports
them only when a config names this kind (a config that does without them is a config error). The
model is built with ``AutoModelForCausalLM.from_config`` from a local ``config.json`` (or a folder
holding one), or from a named ``architecture`` (gpt2, llama, qwen2, ... any model type
transformers knows) and the sizes below: random weights, never ``from_pretrained`` on a hub name.
``HF_HUB_OFFLINE`` is set before transformers is imported, so nothing downloads at run time.
Tokens are bytes (vocabulary 256) or a local ``tokenizers`` file; data, splits and the held-out
loss are those of the ``gpt`` task (regions/tasks/gpt.py).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional as F

from geofed.regions.datasets.cache import task_data_path

from .base import EvalResult, Task, register_task
from .charlm import DEFAULT_DATASET, read_text_prefix
from .gpt import tokenize
from .sequences import WindowShard, heldout_loss, region_shard

INSTALL_HINT = "pip install 'geofed[hf]'"


def transformers_module():
    """The transformers package, imported offline (HF_HUB_OFFLINE=1 first: no download can start)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import transformers

    transformers.logging.set_verbosity_error()  # its warnings about unused generation tokens are noise here
    return transformers


@dataclass(frozen=True, kw_only=True)
class HFCausalLMConfig:
    """``task.kind: hf-causal-lm``: a transformers causal LM (from a local config or a named
    architecture) trained on a text file; needs ``pip install 'geofed[hf]'``."""

    kind: Literal["hf-causal-lm"] = "hf-causal-lm"
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
    dataset: str = field(default=DEFAULT_DATASET, metadata={"doc": (
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


def build_hf_config(cfg: HFCausalLMConfig, vocab: int) -> Any:
    """The transformers config: the local file's, or `architecture` with the sizes; the standard
    names (hidden_size, ...) map to each architecture's own through its attribute_map."""
    transformers = transformers_module()
    if cfg.config:
        try:
            hf = transformers.AutoConfig.from_pretrained(str(_config_file(cfg.config)), **dict(cfg.extra))
        except Exception as exc:  # noqa: BLE001 - the library's own error (bad JSON, unknown model_type), on one line
            raise ValueError(f"config: cannot read {cfg.config!r}: {type(exc).__name__}: {exc}") from None
    else:
        sizes = {"hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
                 "intermediate_size": 4 * cfg.d_model, "max_position_embeddings": cfg.context,
                 "vocab_size": cfg.vocab or vocab, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
        hf = transformers.AutoConfig.for_model(cfg.architecture, **{**sizes, **dict(cfg.extra)})
    if cfg.config and cfg.vocab:
        hf.vocab_size = cfg.vocab
    if hf.vocab_size < vocab:
        raise ValueError(f"vocab: the model's vocabulary ({hf.vocab_size}) is smaller than the tokenizer's ({vocab})")
    positions = getattr(hf, "max_position_embeddings", None)
    if positions is not None and cfg.context > positions:
        raise ValueError(f"context: {cfg.context} is longer than the model's {positions} positions")
    return hf


class HFCausalLMTask(Task):
    """Next-token prediction with a transformers model; the last test_fraction of the tokens is held out."""

    kind = "hf-causal-lm"

    def __init__(self, cfg: HFCausalLMConfig, *, batch_size: int = 32, seed: int = 0):
        text = read_text_prefix(cfg.path, cfg.max_chars)
        if len(text) < 1000:
            raise ValueError(f"path: {cfg.path!r} has {len(text)} characters; need at least 1000")
        self.cfg, self.batch_size = cfg, batch_size
        ids, token_vocab = tokenize(text, str(_tokenizer_file(cfg.tokenizer)) if cfg.tokenizer else None)
        self.hf_config = build_hf_config(cfg, token_vocab)
        cut = int(len(ids) * (1 - cfg.test_fraction))
        self.train_ids, self.test_ids = ids[:cut], ids[cut:]
        if len(self.test_ids) <= cfg.context + 1:
            raise ValueError(f"test_fraction: the held-out text ({len(self.test_ids)} tokens) is shorter than context + 1")

    def build_model(self, seed: int) -> nn.Module:
        transformers = transformers_module()
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(self.hf_config)

    def shard(self, region_index: int, n_regions: int, seed: int) -> WindowShard:
        return region_shard(self.train_ids, region_index, n_regions, length=self.cfg.context,
                            batch_size=self.batch_size, partition=self.cfg.partition)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        batch = batch.to(next(model.parameters()).device)
        logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))

    def evaluate(self, model: nn.Module) -> EvalResult:
        return heldout_loss(self.loss, model, self.test_ids, length=self.cfg.context, windows=self.cfg.eval_sequences)

    def describe(self) -> dict:
        params = sum(p.numel() for p in self.build_model(0).parameters())
        return {"model_type": self.hf_config.model_type, "vocab": self.hf_config.vocab_size, "parameters": params,
                "train_tokens": len(self.train_ids), "test_tokens": len(self.test_ids),
                "tokenizer": self.cfg.tokenizer or "bytes"}


register_task("hf-causal-lm", HFCausalLMConfig, lambda cfg, **kw: HFCausalLMTask(cfg, **kw))
