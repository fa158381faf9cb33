"""Two-layer GCN and GraphSAGE in plain torch (torch.sparse matmul; no torch_geometric).

Both take sparse row-normalised features and a sparse propagation matrix whose
normalisation the model names in ``adjacency`` ("gcn": D^-1/2 (A+I) D^-1/2; "mean": row-mean
of neighbours), so the data side builds the right one.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

MODELS = ("gcn", "sage")


def _spmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.sparse.mm(x, w) if x.is_sparse else x @ w


def _sparse_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    if not training or p == 0.0:
        return x
    if not x.is_sparse:
        return F.dropout(x, p, training=True)
    # Dropping stored values only: the zeros of a bag-of-words row stay zero either way.
    return torch.sparse_coo_tensor(x.indices(), F.dropout(x.values(), p, training=True), x.shape,
                                   check_invariants=False)


def _glorot(w: torch.Tensor, generator: torch.Generator) -> None:
    bound = math.sqrt(6.0 / (w.shape[0] + w.shape[1]))
    with torch.no_grad():
        w.uniform_(-bound, bound, generator=generator)


class GCN(nn.Module):
    """Kipf & Welling (2017): dropout, GCN layer, ReLU, dropout, GCN layer."""

    adjacency = "gcn"

    def __init__(self, in_dim: int, hidden: int, n_classes: int, *, dropout: float, generator: torch.Generator):
        super().__init__()
        self.dropout = dropout
        self.w1 = nn.Parameter(torch.empty(in_dim, hidden))
        self.b1 = nn.Parameter(torch.zeros(hidden))
        self.w2 = nn.Parameter(torch.empty(hidden, n_classes))
        self.b2 = nn.Parameter(torch.zeros(n_classes))
        _glorot(self.w1, generator)
        _glorot(self.w2, generator)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        x = _sparse_dropout(x, self.dropout, self.training)
        h = torch.sparse.mm(adj, _spmm(x, self.w1)) + self.b1
        h = F.dropout(F.relu(h), self.dropout, training=self.training)
        return torch.sparse.mm(adj, h @ self.w2) + self.b2

    def regularized(self) -> list[torch.Tensor]:
        """Kipf & Welling put weight decay on the first layer only."""
        return [self.w1]


class SAGE(nn.Module):
    """GraphSAGE-mean (Hamilton et al. 2017): h_i = W_s x_i + W_n mean_{j in N(i)} x_j, two layers."""

    adjacency = "mean"

    def __init__(self, in_dim: int, hidden: int, n_classes: int, *, dropout: float, generator: torch.Generator):
        super().__init__()
        self.dropout = dropout
        # Self and neighbour weights side by side: one sparse matmul per layer instead of two.
        self.w1 = nn.Parameter(torch.empty(in_dim, 2 * hidden))
        self.b1 = nn.Parameter(torch.zeros(hidden))
        self.w2 = nn.Parameter(torch.empty(hidden, 2 * n_classes))
        self.b2 = nn.Parameter(torch.zeros(n_classes))
        for w in (self.w1, self.w2):
            half = w.shape[1] // 2
            _glorot(w.data[:, :half], generator)
            _glorot(w.data[:, half:], generator)

    @staticmethod
    def _layer(x: torch.Tensor, adj: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        xs, xn = _spmm(x, w).chunk(2, dim=1)
        return xs + torch.sparse.mm(adj, xn) + b

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        x = _sparse_dropout(x, self.dropout, self.training)
        h = F.dropout(F.relu(self._layer(x, adj, self.w1, self.b1)), self.dropout, training=self.training)
        return self._layer(h, adj, self.w2, self.b2)

    def regularized(self) -> list[torch.Tensor]:
        return [self.w1]


def build_gnn(kind: str, in_dim: int, hidden: int, n_classes: int, *, dropout: float, seed: int) -> nn.Module:
    """A fresh model; the same seed gives the same weights in every region."""
    cls = {"gcn": GCN, "sage": SAGE}.get(kind)
    if cls is None:
        raise ValueError(f"model: unknown model {kind!r} (known: {', '.join(MODELS)})")
    g = torch.Generator().manual_seed(seed)
    return cls(in_dim, hidden, n_classes, dropout=dropout, generator=g)


def gnn_loss(model: nn.Module, x: torch.Tensor, adj: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
             *, weight_decay: float, scale: float = 1.0) -> torch.Tensor:
    """Cross-entropy on `mask` (times `scale`) plus weight_decay/2 * ||W1||^2 (Kipf's L2 term).

    The L2 term lives in the loss, not in the optimizer, so a plain Adam/AdamW(weight_decay=0)
    inner optimizer reproduces the reference training exactly.
    """
    logits = model(x, adj)
    if mask.any():
        loss = F.cross_entropy(logits[mask], y[mask]) * scale
    else:  # a region without training labels still regularises (and keeps the graph alive)
        loss = logits.sum() * 0.0
    if weight_decay:
        loss = loss + 0.5 * weight_decay * sum((w * w).sum() for w in model.regularized())
    return loss


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, adj: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> float:
    """Share of the `mask` nodes predicted right, computed in eval mode (the model's mode is restored)."""
    was_training = model.training
    model.eval()
    pred = model(x, adj).argmax(dim=1)
    model.train(was_training)
    return float((pred[mask] == y[mask]).float().mean())
