"""`char-lm`: a small character-level GRU language model on any UTF-8 text file."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch import nn

from geofed.regions.datasets.cache import task_data_path
from geofed.regions.inputfiles import InputFileError, open_regular

from .base import EvalResult, Task, register_task
from .sequences import WindowShard, heldout_loss, region_shard

DEFAULT_DATASET = "tinyshakespeare"
# Characters are classes of the model's output layer: a "text" of 10^5 distinct code points is
# a file built to blow the model up, not prose (the largest scripts in use need ~20k).
MAX_VOCAB = 65_536


@dataclass(frozen=True, kw_only=True)
class CharLMConfig:
    """``task.kind: char-lm``: a character-level GRU language model trained on a text file."""

    kind: Literal["char-lm"] = "char-lm"
    dataset: str = field(default=DEFAULT_DATASET, metadata={"doc": (
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
