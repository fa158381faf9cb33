import math

import numpy as np
import pytest

from geofed.p2p.topology import make_topology, spectral_gap, topology_names


@pytest.mark.parametrize("kind", topology_names())
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 16])
def test_every_mixing_matrix_is_doubly_stochastic_and_consistent(kind, n):
    topo = make_topology(kind, n, seed=3)
    for r in range(6):
        w = topo.matrix(r)
        assert np.all(w >= -1e-12)
        np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12)
        np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-12)
        for i in range(n):
            # What i receives from j is exactly what j sends to i this round.
            for j in topo.in_weights(i, r):
                assert i in topo.out_neighbours(j, r), (kind, n, r, i, j)
            for j in topo.out_neighbours(i, r):
                assert i in topo.in_weights(j, r)
            assert i not in topo.in_weights(i, r)


@pytest.mark.parametrize("n,ring,exp", [(16, 0.0507, 0.50), (32, 0.0128, 0.40), (64, 0.0032, 0.333)])
def test_spectral_gaps_match_theory(n, ring, exp):
    assert spectral_gap(make_topology("ring", n).matrix(0)) == pytest.approx(ring, rel=0.01)
    assert spectral_gap(make_topology("exponential", n).matrix(0)) == pytest.approx(exp, rel=0.01)
    # Ring theory: MH weights 1/3, eigenvalues (1 + 2 cos(2 pi k / n)) / 3.
    assert spectral_gap(make_topology("ring", n).matrix(0)) == pytest.approx(
        1 - (1 + 2 * math.cos(2 * math.pi / n)) / 3, rel=1e-9)


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32])
def test_one_peer_exponential_reaches_exact_average_in_log2_n_rounds(n):
    topo = make_topology("one-peer-exponential", n)
    x = np.random.default_rng(0).normal(size=(n, 5))
    target = x.mean(axis=0)
    for r in range(int(math.log2(n))):
        assert not np.allclose(x, target)
        x = topo.matrix(r) @ x
    np.testing.assert_allclose(x, np.broadcast_to(target, x.shape), atol=1e-12)


def test_random_matching_is_seeded_per_round_and_pairs_everyone():
    a, b = make_topology("random-matching", 8, seed=1), make_topology("random-matching", 8, seed=1)
    c = make_topology("random-matching", 8, seed=2)
    assert all(np.array_equal(a.matrix(r), b.matrix(r)) for r in range(5))
    assert any(not np.array_equal(a.matrix(r), a.matrix(r + 1)) for r in range(5))
    assert any(not np.array_equal(a.matrix(r), c.matrix(r)) for r in range(5))
    for r in range(5):
        assert all(len(a.out_neighbours(i, r)) == 1 for i in range(8))
    odd = make_topology("random-matching", 7, seed=1)
    assert sum(len(odd.out_neighbours(i, 0)) == 0 for i in range(7)) == 1


def test_full_and_exponential_neighbour_sets():
    assert make_topology("full", 4).out_neighbours(2, 0) == [0, 1, 3]
    assert make_topology("exponential", 16).out_neighbours(0, 0) == [1, 2, 4, 8, 12, 14, 15]
    assert make_topology("ring", 5).in_weights(0, 7) == pytest.approx({1: 1 / 3, 4: 1 / 3})


def test_bad_arguments_are_loud():
    with pytest.raises(ValueError, match="kind: unknown topology 'star'"):
        make_topology("star", 4)
    with pytest.raises(ValueError, match="n:"):
        make_topology("ring", 0)
    with pytest.raises(ValueError, match="i: region index 4"):
        make_topology("ring", 4).in_weights(4, 0)
