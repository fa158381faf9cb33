"""`char-lm`: a small character-level GRU language model on any UTF-8 text file."""

from __future__ import annotations

import io

import numpy as np
import torch
from torch import nn

from geofed.regions.inputfiles import InputFileError, open_regular

from .base import EvalResult, Task, register_task
from .configs import CharLMConfig
from .sequences import WindowShard, heldout_loss, region_shard

# Characters are classes of the model's output layer: a "text" of 10^5 distinct code points is
# a file built to blow the model up, not prose (the largest scripts in use need ~20k).
MAX_VOCAB = 65_536


class CharGRU(nn.Module):
    """Embedding, GRU and linear head: next-character logits at every position."""

    def __init__(self, vocab: int, embed: int, hidden: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.rnn = nn.GRU(embed, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(x))
        return self.head(out)


class CharLMTask(Task):
    """Next-character prediction; the text's last test_fraction is held out and evaluation is the
    loss on fixed, evenly spaced windows of it.
    """

    kind = "char-lm"

    def __init__(self, cfg: CharLMConfig, *, batch_size: int = 32, seed: int = 0):
        text = read_text_prefix(cfg.path, cfg.max_chars)
        if len(text) < 1000:
            raise ValueError(f"path: {cfg.path!r} has {len(text)} characters; need at least 1000")
        self.cfg, self.batch_size = cfg, batch_size
        # Code points -> ids in numpy (4 + 8 bytes a character, not a Python int each); the
        # vocabulary sorted by code point is sorted(set(text)).
        points = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
        vocab, inverse = np.unique(points, return_inverse=True)
        if len(vocab) > MAX_VOCAB:
            raise ValueError(f"path: {cfg.path!r} has {len(vocab)} distinct characters; char-lm takes at most {MAX_VOCAB}")
        self.vocab = [chr(c) for c in vocab.tolist()]
        ids = torch.from_numpy(inverse.astype(np.int64).reshape(-1))
        cut = int(len(ids) * (1 - cfg.test_fraction))
        self.train_ids, self.test_ids = ids[:cut], ids[cut:]

    def build_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return CharGRU(len(self.vocab), self.cfg.embed, self.cfg.hidden, self.cfg.layers)

    def shard(self, region_index: int, n_regions: int, seed: int) -> WindowShard:
        return region_shard(self.train_ids, region_index, n_regions, length=self.cfg.seq_len,
                            batch_size=self.batch_size, partition=self.cfg.partition)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        logits = model(batch[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def evaluate(self, model: nn.Module) -> EvalResult:
        return heldout_loss(self.loss, model, self.test_ids, length=self.cfg.seq_len, windows=self.cfg.eval_sequences)

    def describe(self) -> dict:
        return {"vocab": len(self.vocab), "train_chars": len(self.train_ids), "test_chars": len(self.test_ids)}


def read_text_prefix(path: str, max_chars: int) -> str:
    """The first `max_chars` characters of a UTF-8 text file, streamed: however big the file,
    at most about 4 x max_chars bytes are read (undecodable bytes become U+FFFD, line ends
    become \\n, as Path.read_text does). Only a regular file is opened (no FIFO, no device)."""
    try:
        with open_regular(path, max_bytes=None) as raw, \
                io.TextIOWrapper(raw, encoding="utf-8", errors="replace") as text:
            return text.read(max_chars)
    except InputFileError as exc:
        if exc.strerror is not None:
            raise ValueError(f"path: cannot read {path!r}: {exc.strerror}") from None
        raise ValueError(f"path: {exc}") from None
    except OSError as exc:
        raise ValueError(f"path: cannot read {path!r}: {exc.strerror or exc}") from None


register_task("char-lm", CharLMConfig, lambda cfg, **kw: CharLMTask(cfg, **kw))
