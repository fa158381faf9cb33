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

import os
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


from .base import EvalResult, Task, register_task
from .configs import INSTALL_HINT, HFCausalLMConfig, _config_file, _tokenizer_file  # noqa: F401 - INSTALL_HINT: importers of hf
from .charlm import read_text_prefix
from .gpt import tokenize
from .sequences import WindowShard, heldout_loss, region_shard



def transformers_module():
    """The transformers package, imported offline (HF_HUB_OFFLINE=1 first: no download can start)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import transformers

    transformers.logging.set_verbosity_error()  # its warnings about unused generation tokens are noise here
    return transformers


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
