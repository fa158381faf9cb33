"""A region's memory budget (issue 39, item 2): each model-sized buffer owned once. What these
check would otherwise only show as a peak in `geofed bench memory`: error feedback corrects int8's
residual in place, the exchange decodes this region's own payload only for whoever reads it, the
outer step keeps no gradient buffer of its own, and an overlapped exchange keeps no received update
alive through the next round."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from geofed.compression import CodecState, encode_and_decode, encode_update
from geofed.orchestrator.config import config_from_mapping
from geofed.regions.exchange import ExchangeResult, OwnDecoded
from geofed.regions.messages import RoundPlan
from geofed.regions.sync import DilocoSync, mix
from geofed.regions.sync.protocol import SyncContext



class _Quadratic:
    """Inner steps of plain SGD on 0.5 * ||x - target||^2 (test_sync_protocol's)."""

    def __init__(self, params, target, lr):
        self.params, self.target, self.lr = params, target, lr

    def inner_steps(self, H, lr_scale, *, before_step=None, budget_s=None, max_steps=None):
        (x,) = self.params
        for _ in range(H):
            with torch.no_grad():
                x.sub_(self.lr * lr_scale * (x - self.target))
        return {"train_loss": 0.0, "compute_s": 0.0, "step_time_s": 0.0, "steps": H}


def _updates(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3000, generator=g), torch.randn(17, 33, generator=g)]


@pytest.mark.parametrize("codec", ["int8", "int4", "int3", {"kind": "int8", "chunk": 64}])
def test_quantized_error_feedback_corrects_the_residual_in_place_with_the_same_values(codec):
    in_place, decoded_path = CodecState(error_feedback=True, seed=1), CodecState(error_feedback=True, seed=1)
    for seed in range(3):
        a = encode_update(codec, _updates(seed), in_place)  # blockwise subtract, no scratch
        b, _ = encode_and_decode(codec, _updates(seed), decoded_path)  # a whole decode, then subtract
        assert a == b
        assert torch.equal(in_place.residual, decoded_path.residual)
    assert "scratch" not in in_place.store and "scratch" not in decoded_path.store


def test_the_exchange_decodes_its_own_payload_only_when_read():
    payload = encode_update("int8", _updates(0), CodecState(error_feedback=False))
    _, expected = encode_and_decode("int8", _updates(0), CodecState(error_feedback=False))
    own = OwnDecoded({"b": payload, "c": payload}, numel=sum(t.numel() for t in _updates(0)))
    assert sorted(own) == ["b", "c"] and len(own) == 2
    assert all(torch.equal(x, y) for x, y in zip(own["b"], expected))
    assert own["c"] is own["b"]  # peers on one codec share one decode


def test_an_overlapped_exchange_keeps_no_received_update_and_the_outer_step_no_gradient():
    cfg = config_from_mapping({"task": {"kind": "mlp-digits"}, "sync": {"overlap": True}})
    x = torch.zeros(64, requires_grad=True)
    received: list[weakref.ref] = []

    def exchange(plan, tensors, **kw):
        t = torch.full((64,), 0.25)
        received.append(weakref.ref(t))
        return ExchangeResult(received={"b": [t]}, own_decoded={}, missing=[])

    ctx = SyncContext(region="a", index=0, params=[x], shapes=[(64,)], settings=cfg.sync, seed=0,
                      stepper=_Quadratic([x], torch.ones(64), lr=0.5), exchange=exchange,
                      mix=lambda plan, own, res, **kw: mix(own, res.received, {"b": 0.5}, 0.5, **kw),
                      in_weights=lambda r: {"b": 0.5}, fetch_state=lambda peer, **kw: b"",
                      evaluate=lambda params, **kw: {"metric": "none", "value": 0.0, "higher_is_better": True})
    algo = DilocoSync(ctx)
    try:
        algo.run_round(RoundPlan(round=0, H=1))
        algo.overlap._pending.result(timeout=30)  # the exchange of round 0 is mixed, not yet applied
        gc.collect()
        assert received and received[0]() is None, "the pending exchange holds a received update"
        algo.run_round(RoundPlan(round=1, H=1))  # applies round 0's mean
        assert all(g.grad is None for g in algo.parts[0].global_params)
    finally:
        algo.close()


def test_an_overlapped_mean_is_written_into_the_peers_update_and_the_pseudo_gradient_kept():
    """The mix's output was a model's worth beside the pseudo-gradient it was made of, held to the next
    round's end; then the mean was summed into the pseudo-gradient; now (delayed overlap) it is written
    into the peer's decoded update (the same operations: the same values), and the pseudo-gradient is
    kept as it was sent: the model restarted behind it (live = global - delta), and where the next
    pseudo-gradient starts is global - delta, not a copy (Diloco.behind)."""
    cfg = config_from_mapping({"task": {"kind": "mlp-digits"}, "sync": {"overlap": True}})
    x = torch.zeros(64, requires_grad=True)
    sent: list[tuple[torch.Tensor, torch.Tensor]] = []
    peer = torch.linspace(-1.0, 1.0, 64)
    peers: list[torch.Tensor] = []

    def exchange(plan, tensors, **kw):
        sent.append((tensors[0], tensors[0].clone()))
        peers.append(peer.clone())
        return ExchangeResult(received={"b": [peers[-1]]}, own_decoded={}, missing=[])

    ctx = SyncContext(region="a", index=0, params=[x], shapes=[(64,)], settings=cfg.sync, seed=0,
                      stepper=_Quadratic([x], torch.linspace(0.0, 3.0, 64), lr=0.3), exchange=exchange,
                      mix=lambda plan, own, res, **kw: mix(own, res.received, {"b": 0.5}, 0.5, **kw),
                      in_weights=lambda r: {"b": 0.5}, fetch_state=lambda peer, **kw: b"",
                      evaluate=lambda params, **kw: {"metric": "none", "value": 0.0, "higher_is_better": True})
    algo = DilocoSync(ctx)
    try:
        algo.run_round(RoundPlan(round=0, H=1))
        _, mixed, _, _ = algo.overlap._pending.result(timeout=30)
        own, delta = sent[0]
        assert mixed[0].data_ptr() == peers[0].data_ptr()  # no model-sized output beside it
        assert torch.equal(mixed[0], mix([delta], {"b": [peer]}, {"b": 0.5}, 0.5)[0])
        assert torch.equal(own, delta)  # kept: the next pseudo-gradient starts from global - delta
        part = algo.parts[0]
        assert part.start is None and part.behind is not None and part.behind[0].data_ptr() == own.data_ptr()
        assert torch.equal(x.detach(), part.global_params[0] - delta)  # restarted behind the delta as sent
    finally:
        algo.close()


def test_a_diloco_round_lets_the_inner_steps_gradients_go(tmp_path):
    """The gradients (a model's worth) were held through the exchange and the outer step, the round's
    other peak; nothing reads them before the next round's first backward, which makes them anew."""
    from geofed.p2p.memory import InMemoryHub, InMemoryTransport
    from geofed.regions.region import Region

    cfg = config_from_mapping({
        "run": {"seed": 0, "checkpoint_every": 0}, "task": {"kind": "mlp-digits", "hidden": 8},
        "regions": {"names": ["a"]}, "network": {"emulation": {"mode": "none"}},
        "sync": {"overlap": True, "deadline": {"initial_s": 2.0, "min_s": 0.5, "max_s": 5.0}}})
    region = Region(cfg, "a", tmp_path, transport=InMemoryTransport("a", InMemoryHub()))
    try:
        for r in range(2):
            region.run_round(RoundPlan(round=r, H=2))
            assert all(p.grad is None for p in region.params)
    finally:
        region.close()


def test_the_algorithm_state_is_lent_not_copied():
    """Rollback copies the state it keeps (copy_state); a copy inside state_dict made that two, a
    model's worth more at every round's start. A checkpoint of it still restores a model that moves on."""
    cfg = config_from_mapping({"task": {"kind": "mlp-digits"}, "sync": {"overlap": True, "fragments": 2}})
    x, y = torch.zeros(8, requires_grad=True), torch.zeros(3, requires_grad=True)
    ctx = SyncContext(region="a", index=0, params=[x, y], shapes=[(8,), (3,)], settings=cfg.sync, seed=0,
                      stepper=_Quadratic([x], torch.ones(8), lr=0.5), exchange=None, mix=None,
                      in_weights=lambda r: {}, fetch_state=lambda peer, **kw: b"", evaluate=None)
    algo = DilocoSync(ctx)
    try:
        state = algo.state_dict()
        held = [g for p in algo.parts for g in p.global_params]
        assert all(s.data_ptr() == g.data_ptr() for s, g in zip(state["global"], held))
        algo.load_state_dict({**state, "global": [g.clone() for g in state["global"]]})  # its own, as rollback restores it
        assert all(torch.equal(g, torch.zeros_like(g)) for g in held)
    finally:
        algo.close()


def test_a_regions_result_is_its_parameters_over_the_models_buffers_all_copied():
    from geofed.regions.export import result_state

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    params = [torch.full_like(p, float(i)) for i, p in enumerate(model.parameters())]
    state = result_state(model, params)
    assert list(state) == list(model.state_dict())
    for (name, _), want in zip(model.named_parameters(), params):
        assert torch.equal(state[name], want) and state[name].data_ptr() != want.data_ptr()
    assert torch.equal(state["1.running_var"], model[1].running_var)
    assert state["1.running_var"].data_ptr() != model[1].running_var.data_ptr()


def test_the_gauntlet_holds_no_model_sized_buffer_and_reads_as_a_full_copy_did():
    """The gauntlet kept a deep copy of the model for good (4 B/param, issue 39); its scratch now has
    the model's structure and buffers only, lent the parameters of each reading. The readings are those
    of a full copy of the model with the same parameters, bitwise, and neither theta nor the model moves."""
    import copy

    from geofed.regions.gauntlet import Gauntlet

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 16),
                                torch.nn.Linear(16, 16), torch.nn.Linear(16, 3))
    model(torch.randn(16, 6))  # running statistics that are not their defaults
    batches = [(torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in range(3)]

    def loss(m, b):
        return torch.nn.functional.cross_entropy(m(b[0]), b[1])

    made: list[int] = []  # the scratch's parameter bytes as each module's forward pass starts
    gauntlet = Gauntlet(model=model, loss=loss, batches=batches, margin=0.5)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())

    def held() -> int:
        return sum(t.untyped_storage().nbytes() for t in [*gauntlet._scratch.parameters(), *gauntlet._scratch.buffers()])

    def note(m, args):  # theta itself is lent, not made: only a made reading's bytes count
        if gauntlet._making is not None:
            made.append(sum(p.untyped_storage().nbytes() for p in gauntlet._scratch.parameters()))

    for module in gauntlet._scratch:  # registered after the gauntlet's hooks: its module's parameters are made
        module.register_forward_pre_hook(note)

    assert held() <= buffer_bytes < param_bytes
    theta = [p.detach().clone() + 0.01 for p in model.parameters()]
    update = [torch.randn_like(t) * 0.1 for t in theta]
    kept = [t.clone() for t in theta], [p.detach().clone() for p in model.parameters()]
    score = gauntlet.score("b", 0, theta, update, reverse=True)

    full = copy.deepcopy(model).eval()  # the old scratch

    def mean_loss(values):
        with torch.no_grad():
            for p, v in zip(full.parameters(), values):
                p.copy_(v)
            return sum(float(loss(full, b)) for b in batches) / len(batches)

    assert score.loss_before == mean_loss(theta)
    assert score.loss_after == mean_loss([t - u for t, u in zip(theta, update)])
    assert score.loss_reversed == mean_loss([t + u for t, u in zip(theta, update)])
    assert held() <= buffer_bytes
    assert all(torch.equal(a, b) for a, b in zip(theta, kept[0]))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), kept[1]))
    # theta - update is made a module at a time (checked once against the whole reading: the same losses)
    assert gauntlet._layerwise is True
    made.clear()
    again = gauntlet.score("b", 1, theta, update)
    assert (again.loss_before, again.loss_after) == (score.loss_before, score.loss_after)
    largest = max(sum(p.numel() * 4 for p in m.parameters()) for m in model)
    assert made and max(made) <= largest < param_bytes / 2


def test_the_gauntlet_reads_whole_a_model_whose_forward_reads_a_parameter_outside_its_module():
    from geofed.regions.gauntlet import Gauntlet

    class Tied(torch.nn.Module):  # the output layer reads the embedding's weight (tied, no module call)
        def __init__(self):
            super().__init__()
            self.emb, self.mid = torch.nn.Embedding(11, 8), torch.nn.Linear(8, 8)

        def forward(self, idx):
            return torch.nn.functional.linear(self.mid(self.emb(idx)), self.emb.weight)

    torch.manual_seed(1)
    model = Tied()
    batches = [torch.randint(0, 11, (4, 5)) for _ in range(2)]

    def loss(m, b):
        return torch.nn.functional.cross_entropy(m(b).reshape(-1, 11), b.reshape(-1))

    model.mid.bias.requires_grad_(False)  # a frozen parameter is the scratch's own, never lent
    gauntlet = Gauntlet(model=model, loss=loss, batches=batches, margin=0.5)
    trained = [p for p in model.parameters() if p.requires_grad]
    theta = [p.detach().clone() for p in trained]
    update = [torch.randn_like(t) * 0.1 for t in theta]
    score = gauntlet.score("b", 0, theta, update)
    with torch.no_grad():
        for p, t, u in zip(trained, theta, update):
            p.copy_(t - u)
        want = sum(float(loss(model.eval(), b)) for b in batches) / len(batches)
    assert score.loss_after == want and gauntlet._layerwise is False


def test_the_round_mix_clips_the_updates_it_is_given_in_place_with_the_same_values():
    """With the default clip_multiple 1 and two regions one update of the two is over the round's median
    every round: its copy was a model's worth beside it at the mix. DiLoCo gives its updates up
    (consume_own), so they are scaled where they are."""
    from geofed.p2p.robust import fair_share_clip

    own, peer = _updates(0), [t * 3.0 for t in _updates(1)]
    want_own, want_received, want_clipped = fair_share_clip(own, {"b": peer}, multiple=1.0)
    ptrs = [t.data_ptr() for t in peer]
    got_own, got_received, got_clipped = fair_share_clip([t.clone() for t in own], {"b": peer}, multiple=1.0, in_place=True)
    assert got_clipped == want_clipped == ["b"]
    assert [t.data_ptr() for t in got_received["b"]] == ptrs  # scaled where it was
    assert all(torch.equal(a, b) for a, b in zip(got_received["b"], want_received["b"]))
    assert all(torch.equal(a, b) for a, b in zip(got_own, want_own))
