"""GCN and GraphSAGE in plain torch: equal to the dense formulas, seeded, trainable."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from geofed.regions.graph.data import feature_tensor, gcn_adjacency, mean_adjacency
from geofed.regions.graph.models import accuracy, build_gnn, gnn_loss

torch.set_num_threads(1)
EI = np.array([[0, 1, 1, 2, 3, 4], [1, 0, 2, 1, 4, 3]])


def _inputs():
    x = (np.random.default_rng(0).random((5, 6)) < 0.5).astype(np.uint8)
    x[:, 0] = 1  # no empty rows
    return x, feature_tensor(x)


def test_gcn_equals_dense_two_layer_formula():
    x_np, x = _inputs()
    m = build_gnn("gcn", 6, 4, 3, dropout=0.5, seed=1).eval()
    a = gcn_adjacency(EI, 5).to_dense()
    xd = x.to_dense()
    h = torch.relu(a @ xd @ m.w1 + m.b1)
    expected = a @ h @ m.w2 + m.b2
    assert torch.allclose(m(x, gcn_adjacency(EI, 5)), expected, atol=1e-6)
    assert torch.allclose(m(xd, gcn_adjacency(EI, 5)), expected, atol=1e-6)  # dense input works too


def test_sage_equals_dense_mean_aggregator():
    _, x = _inputs()
    m = build_gnn("sage", 6, 4, 3, dropout=0.0, seed=2).eval()
    adj = mean_adjacency(EI, 5)
    xd, a = x.to_dense(), adj.to_dense()
    w1s, w1n = m.w1[:, :4], m.w1[:, 4:]
    w2s, w2n = m.w2[:, :3], m.w2[:, 3:]
    h = torch.relu(xd @ w1s + a @ xd @ w1n + m.b1)
    assert torch.allclose(m(x, adj), h @ w2s + a @ h @ w2n + m.b2, atol=1e-6)


@pytest.mark.parametrize("kind", ["gcn", "sage"])
def test_same_seed_same_weights(kind):
    a, b, c = (build_gnn(kind, 6, 4, 3, dropout=0.5, seed=s) for s in (7, 7, 8))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.w1, c.w1)


def test_unknown_model_is_named():
    with pytest.raises(ValueError, match="model: unknown model 'gat'"):
        build_gnn("gat", 6, 4, 3, dropout=0.5, seed=0)


def test_dropout_only_in_training_mode():
    _, x = _inputs()
    m = build_gnn("gcn", 6, 8, 3, dropout=0.5, seed=0)
    adj = gcn_adjacency(EI, 5)
    torch.manual_seed(0)
    assert not torch.allclose(m(x, adj), m(x, adj))
    m.eval()
    assert torch.equal(m(x, adj), m(x, adj))


def test_loss_l2_on_first_layer_and_scale():
    _, x = _inputs()
    m = build_gnn("gcn", 6, 4, 3, dropout=0.0, seed=0)
    adj, y = gcn_adjacency(EI, 5), torch.tensor([0, 1, 2, 0, 1])
    mask = torch.tensor([1, 1, 0, 0, 1], dtype=torch.bool)
    base = gnn_loss(m, x, adj, y, mask, weight_decay=0.0)
    reg = gnn_loss(m, x, adj, y, mask, weight_decay=0.1)
    assert torch.allclose(reg - base, 0.05 * (m.w1 ** 2).sum())
    assert torch.allclose(gnn_loss(m, x, adj, y, mask, weight_decay=0.0, scale=3.0), 3 * base)
    empty = gnn_loss(m, x, adj, y, torch.zeros(5, dtype=torch.bool), weight_decay=0.0)
    empty.backward()  # a region without labels still yields a differentiable zero
    assert empty.item() == 0.0 and empty.requires_grad


@pytest.mark.parametrize("kind", ["gcn", "sage"])
def test_fits_a_small_labelled_graph(kind):
    # Two cliques with different features; half the nodes labelled: the other half must follow.
    rng = np.random.default_rng(0)
    n = 40
    y = np.repeat([0, 1], n // 2)
    x = (rng.random((n, 20)) < np.where(y[:, None] == 0, [0.6] * 10 + [0.05] * 10, [0.05] * 10 + [0.6] * 10)).astype(np.uint8)
    x[:, 0] |= 1 - x.any(1).astype(np.uint8)
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j and y[i] == y[j] and rng.random() < 0.2]
    ei = np.array(pairs).T
    m = build_gnn(kind, 20, 8, 2, dropout=0.2, seed=0)
    xs = feature_tensor(x)
    adj = gcn_adjacency(ei, n) if kind == "gcn" else mean_adjacency(ei, n)
    yt = torch.from_numpy(y)
    train = torch.from_numpy(np.arange(n) % 2 == 0)
    opt = torch.optim.Adam(m.parameters(), lr=0.05)
    for _ in range(60):
        opt.zero_grad()
        gnn_loss(m, xs, adj, yt, train, weight_decay=5e-4).backward()
        opt.step()
    assert accuracy(m, xs, adj, yt, ~train) >= 0.9
    assert m.training  # accuracy() restores the mode
