"""The exchange encodes once per CodecSpec and keeps error feedback per spec key, across checkpoints."""

import torch

from geofed.compression import CodecSpec
from geofed.p2p.deadline import AdaptiveDeadline
from geofed.p2p.memory import InMemoryHub, InMemoryTransport
from geofed.regions.exchange import Exchanger

INT8_SR = CodecSpec.parse({"kind": "int8", "stochastic": True})
TOPK = CodecSpec.parse("topk(fraction=0.01,inner=int8)")


def _mesh(names):
    hub = InMemoryHub()
    ts = {n: InMemoryTransport(n, hub) for n in names}
    addrs = {n: t.start() for n, t in ts.items()}
    for t in ts.values():
        t.connect(addrs)
    return ts


def _exchanger(transport):
    return Exchanger(transport, error_feedback=True, deadline=AdaptiveDeadline(1.0, 0.1, 5.0, 3.0), send_timeout_s=5.0)


def test_links_on_one_spec_share_its_bytes_and_state_and_checkpoints_name_it_by_key():
    ts = _mesh(["a", "b", "c", "d"])
    ex = _exchanger(ts["a"])
    try:
        x = [torch.randn(300, 10), torch.randn(7)]
        for r in range(2):
            for peer in "bcd":
                ts[peer].mailbox.expect(r, ["a"])
            res = ex.exchange(r, x, out_peers=["b", "c", "d"], in_peers=[],
                              codecs={"b": INT8_SR, "c": CodecSpec.parse({"kind": "int8", "stochastic": True,
                                                                          "chunk": 4096})},
                              default_codec=TOPK)
            assert not res.send_failures
        assert set(ex.states) == {"int8(chunk=4096,stochastic=True)", "topk(fraction=0.01,inner=int8)"}
        got = {p: ts[p].receive(1, 1.0) for p in "bcd"}
        assert {p: not g.missing for p, g in got.items()} == dict.fromkeys("bcd", True)
        sent = {t["peer"]: t["bytes"] for t in res.transfers if t["direction"] == "send"}
        assert sent["b"] == sent["c"] > 5 * sent["d"]  # b and c: one int8 payload; d: top-k 1%
        assert ex.states[TOPK.key].residual is not None  # EF on the contractive codec only
        # An older checkpoint's key (the spec as it was written) still finds its residual.
        sd = ex.state_dict()
        sd["codecs"] = {("int8(stochastic=True)" if k.startswith("int8") else k): v for k, v in sd["codecs"].items()}
        again = _exchanger(ts["a"])
        try:
            again.load_state_dict(sd)
            assert set(again.states) == set(ex.states)
            for key, st in ex.states.items():
                assert (st.residual is None and again.states[key].residual is None
                        or torch.equal(again.states[key].residual, st.residual))
                assert again.states[key].counter == st.counter == 2
        finally:
            again.close()
    finally:
        ex.close()
        for t in ts.values():
            t.close()


def test_an_overlapped_exchange_waits_its_window_for_a_peer_the_adaptive_deadline_would_refuse():
    import threading
    import time

    ts = _mesh(["a", "b"])
    ex = Exchanger(ts["a"], error_feedback=True, deadline=AdaptiveDeadline(0.1, 0.1, 5.0, 3.0), send_timeout_s=5.0)
    try:
        x = [torch.randn(20)]
        late = []
        for r, window in ((0, 0.0), (1, 1.5)):
            ts["b"].mailbox.expect(r, ["a"])
            # b's update arrives 0.5 s into the receive: after the 0.1 s deadline, within a 1.5 s window
            sender = threading.Timer(0.5, lambda r=r: late.append(
                Exchanger(ts["b"], error_feedback=False, deadline=AdaptiveDeadline(1.0, 0.1, 5.0, 3.0),
                          send_timeout_s=5.0).exchange(r, x, out_peers=["a"], in_peers=[], codecs={},
                                                       default_codec=CodecSpec.parse("identity"))))
            sender.start()
            t0 = time.monotonic()
            res = ex.exchange(r, x, out_peers=[], in_peers=["b"], codecs={}, default_codec=TOPK, window_s=window)
            waited = time.monotonic() - t0
            sender.join()
            if window == 0.0:
                assert res.missing == ["b"] and waited < 0.45  # refused at its deadline: too early
            else:
                assert res.missing == [] and "b" in res.received and 0.4 < waited < 1.4
    finally:
        ex.close()
