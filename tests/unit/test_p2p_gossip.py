import numpy as np
import pytest
import torch

from geofed.p2p.gossip import ChocoGossip, LocalUpdateGossip, fold_missing, mix
from geofed.p2p.topology import make_topology


def _topk_compressor(fraction):
    """Exact top-k on the wire: dense float64 bytes (the algorithm test, not a codec test)."""
    def compress(tensors):
        out = []
        for t in tensors:
            flat = t.flatten()
            k = max(1, int(fraction * flat.numel()))
            idx = flat.abs().topk(k).indices
            q = torch.zeros_like(flat)
            q[idx] = flat[idx]
            out.append(q.view_as(t))
        return b"".join(q.numpy().tobytes() for q in out), out
    return compress


def _decode(payload, shape):
    return [torch.from_numpy(np.frombuffer(payload, dtype=np.float64).copy()).view(shape)]


def _consensus_error(xs):
    m = torch.stack(xs).mean(0)
    return float(sum(((x - m) ** 2).sum() for x in xs))


def test_fold_missing_moves_absent_weight_to_self():
    kept, w_self = fold_missing({"a": 0.25, "b": 0.25, "c": 0.2}, 0.3, {"a"})
    assert kept == {"a": 0.25}
    assert w_self == pytest.approx(0.75)


def test_mix_with_missing_peer_keeps_weights_summing_to_one():
    own = [torch.full((3,), 1.0)]
    got = mix(own, {"a": [torch.full((3,), 5.0)]}, {"a": 0.25, "b": 0.25}, 0.5)
    torch.testing.assert_close(got[0], torch.full((3,), 0.75 * 1.0 + 0.25 * 5.0))
    assert torch.equal(own[0], torch.ones(3))  # inputs untouched
    with pytest.raises(ValueError, match="received: values from peers without a weight"):
        mix(own, {"z": [torch.ones(3)]}, {"a": 0.5}, 0.5)
    with pytest.raises(ValueError, match="received: peer 'a' sent shape"):
        mix(own, {"a": [torch.ones(4)]}, {"a": 0.5}, 0.5)


def test_local_update_dpsgd_reaches_the_global_optimum_on_a_ring():
    # f_i(x) = |x - b_i|^2 / 2: the global optimum is mean(b); each node alone goes to b_i.
    n, d, h, lr = 8, 4, 5, 0.05
    gen = torch.Generator().manual_seed(1)
    b = torch.randn(n, d, generator=gen, dtype=torch.float64) * 5
    params = [torch.zeros(d, dtype=torch.float64) for _ in range(n)]
    topo, gossip = make_topology("ring", n), LocalUpdateGossip()
    for r in range(300):
        lr_r = lr / (1 + r / 30)  # decays: D-PSGD's consensus bias scales with lr * H
        for i in range(n):
            for _ in range(h):
                params[i] -= lr_r * (params[i] - b[i])
        sent = [gossip.outgoing([p]) for p in params]
        for i in range(n):
            received = {j: sent[j] for j in topo.in_weights(i, r)}
            gossip.mix_into([params[i]], received, topo.in_weights(i, r), topo.self_weight(i, r))
    target = b.mean(0)
    spread = float((b - target).abs().max())  # where a node alone would end up
    # Doubly stochastic mixing keeps the average on the exact centralized trajectory...
    assert float((torch.stack(params).mean(0) - target).abs().max()) < 1e-6
    # ...and the nodes agree up to a bias proportional to the (decayed) local learning rate.
    err = max(float((p - target).abs().max()) for p in params)
    assert err < spread / 20, (err, spread)


def _run_ring(n, d, rounds, step):
    torch.manual_seed(0)
    xs = [torch.randn(d, dtype=torch.float64) * 3 for _ in range(n)]
    start_mean = torch.stack(xs).mean(0)
    start = _consensus_error(xs)
    xs = step(xs, rounds)
    return start, _consensus_error(xs), float((torch.stack(xs).mean(0) - start_mean).abs().max())


def test_choco_converges_on_a_compressed_ring_where_naive_gossip_stalls():
    n, d, rounds, gamma = 16, 100, 400, 0.4
    topo, compress = make_topology("ring", n), _topk_compressor(0.1)

    def naive(xs, rounds):
        for r in range(rounds):
            q = [compress([x])[1][0] for x in xs]
            xs = [xs[i] + gamma * sum(w * (q[j] - q[i]) for j, w in topo.in_weights(i, r).items())
                  for i in range(n)]
        return xs

    def choco(xs, rounds):
        nodes = [ChocoGossip(gamma=gamma, compressor=compress) for _ in range(n)]
        for r in range(rounds):
            payloads = [nodes[i].outgoing([xs[i]]) for i in range(n)]
            for i in range(n):
                for j in topo.in_weights(i, r):
                    nodes[i].incoming(j, _decode(payloads[j], (d,)))
            xs = [nodes[i].step([xs[i]], topo.in_weights(i, r))[0] for i in range(n)]
        return xs

    start, naive_end, _ = _run_ring(n, d, rounds, naive)
    _, naive_more, _ = _run_ring(n, d, rounds * 2, naive)
    _, choco_end, drift = _run_ring(n, d, rounds, choco)
    assert naive_end > start / 100, "naive compressed gossip should stall"
    assert naive_more > naive_end / 2, "doubling the rounds should barely help naive gossip"
    assert choco_end < start * 1e-8, (start, choco_end)
    assert drift < 1e-9  # gossip preserves the average


def test_choco_marks_a_silent_neighbour_stale_until_resync():
    compress = _topk_compressor(1.0)
    a, b = ChocoGossip(gamma=0.5, compressor=compress), ChocoGossip(gamma=0.5, compressor=compress)
    xa, xb = [torch.zeros(4, dtype=torch.float64)], [torch.ones(4, dtype=torch.float64)]
    a.outgoing(xa)
    pb = b.outgoing(xb)
    a.incoming("b", _decode(pb, (4,)))
    xa = a.step(xa, {"b": 0.5})
    assert float(xa[0][0]) == pytest.approx(0.25)
    a.outgoing(xa)
    held = a.step(xa, {"b": 0.5})  # b's message missing this round
    assert "b" in a.stale and torch.equal(held[0], xa[0])
    a.incoming("b", _decode(b.outgoing(xb), (4,)))  # ignored while stale
    a.resync("b", b.public_copy())
    assert "b" not in a.stale
    with pytest.raises(ValueError, match="gamma:"):
        ChocoGossip(gamma=0, compressor=compress)


def test_choco_with_the_real_topk_codec_over_its_wire_format():
    from geofed.compression import CodecState, decode_update, make_codec

    from geofed.p2p.gossip import codec_compressor

    # Seeded and deterministic: the error falls ~8x every 50 rounds, below 1e-5 of the start by
    # round ~265; 300 rounds end at 5.5e-7 (400 ended at 8e-9 for a third more time).
    n, d, rounds = 16, 100, 300
    codec = make_codec({"kind": "topk", "fraction": 0.1})
    topo = make_topology("ring", n)
    torch.manual_seed(0)
    xs = [torch.randn(d) * 3 for _ in range(n)]
    start = _consensus_error(xs)
    nodes = [ChocoGossip(gamma=0.4, compressor=codec_compressor(codec, CodecState(error_feedback=False)))
             for _ in range(n)]
    for r in range(rounds):
        payloads = [nodes[i].outgoing([xs[i]]) for i in range(n)]
        assert len(payloads[0]) < d * 4 / 2  # really compressed on the wire
        for i in range(n):
            for j in topo.in_weights(i, r):
                nodes[i].incoming(j, decode_update(payloads[j], max_bytes=1 << 20))
        xs = [nodes[i].step([xs[i]], topo.in_weights(i, r))[0] for i in range(n)]
    assert _consensus_error(xs) < start * 1e-5
