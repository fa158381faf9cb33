"""`gpt`: a decoder-only transformer language model on any UTF-8 text file.

Tokens are the file's bytes (a vocabulary of 256, nothing to train or ship) unless
``tokenizer`` names a Hugging Face ``tokenizers`` JSON file (a trained BPE); that library is then
needed (``pip install tokenizers``). Attention is torch's ``scaled_dot_product_attention`` with a
causal mask, so a GPU's fused kernels are used where there is one. Evaluation is the held-out
loss (nats per token) on fixed windows of the text's last ``test_fraction``; the summary also
reports its perplexity.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


from .base import EvalResult, Task, register_task
from .configs import GPTConfig
from .charlm import read_text_prefix
from .sequences import WindowShard, heldout_loss, region_shard


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask, through scaled_dot_product_attention."""

    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-norm transformer block: attention and a 4x GELU MLP, each with a residual."""

    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model),
                                 nn.Dropout(dropout))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and learned position embeddings, n_layer blocks, a final LayerNorm and the LM head."""

    def __init__(self, vocab: int, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.n_head, cfg.dropout) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.checkpointing = cfg.activation_checkpointing
        self.head = nn.Linear(cfg.d_model, vocab, bias=False)
        self.apply(self._init)
        if cfg.tie_embeddings:
            self.head.weight = self.tok.weight
        # GPT-2's scaled init of the residual projections keeps the residual stream's variance flat in depth.
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        recompute = self.checkpointing and torch.is_grad_enabled()
        for block in self.blocks:
            # Recomputed in the backward pass with the RNG state of its forward pass (dropout draws the same).
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        return self.head(self.ln_f(x))


def tokenize(text: str, tokenizer: str | None) -> tuple[torch.Tensor, int]:
    """Token ids of `text` and the vocabulary size: UTF-8 bytes, or the `tokenizers` file's BPE."""
    if tokenizer is None:
        return torch.from_numpy(np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)), 256
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("tokenizer: needs the `tokenizers` package (pip install tokenizers), "
                         "or leave tokenizer unset for byte-level tokens") from None
    try:
        tok = Tokenizer.from_file(tokenizer)
    except Exception as exc:  # noqa: BLE001 - the library's own error, on one line
        raise ValueError(f"tokenizer: cannot load {tokenizer!r}: {exc}") from None
    return torch.tensor(tok.encode(text).ids, dtype=torch.int64), tok.get_vocab_size()


class GPTTask(Task):
    """Next-token prediction; the last test_fraction of the tokens is held out."""

    kind = "gpt"

    def __init__(self, cfg: GPTConfig, *, batch_size: int = 32, seed: int = 0):
        text = read_text_prefix(cfg.path, cfg.max_chars)
        if len(text) < 1000:
            raise ValueError(f"path: {cfg.path!r} has {len(text)} characters; need at least 1000")
        self.cfg, self.batch_size = cfg, batch_size
        ids, self.vocab_size = tokenize(text, cfg.tokenizer)
        cut = int(len(ids) * (1 - cfg.test_fraction))
        self.train_ids, self.test_ids = ids[:cut], ids[cut:]
        if len(self.test_ids) <= cfg.context + 1:
            raise ValueError(f"test_fraction: the held-out text ({len(self.test_ids)} tokens) is shorter than context + 1")

    def build_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return GPT(self.vocab_size, self.cfg)

    def shard(self, region_index: int, n_regions: int, seed: int) -> WindowShard:
        return region_shard(self.train_ids, region_index, n_regions, length=self.cfg.context,
                            batch_size=self.batch_size, partition=self.cfg.partition)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        batch = batch.to(_device_of(model))
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))

    def evaluate(self, model: nn.Module) -> EvalResult:
        return heldout_loss(self.loss, model, self.test_ids, length=self.cfg.context, windows=self.cfg.eval_sequences)

    def describe(self) -> dict:
        params = sum(p.numel() for p in self.build_model(0).parameters())
        return {"vocab": self.vocab_size, "parameters": params, "train_tokens": len(self.train_ids),
                "test_tokens": len(self.test_ids), "tokenizer": self.cfg.tokenizer or "bytes"}


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


register_task("gpt", GPTConfig, lambda cfg, **kw: GPTTask(cfg, **kw))
