"""Payload buffer reuse: a stream's payload is overwritten only once nobody else holds it."""

from __future__ import annotations

import threading

import pytest
import torch
from geofed.compression import (
    CodecState,
    buffers,
    decode_update,
    encode_and_decode,
    encode_update,
)

torch.set_num_threads(1)
MAX = 1 << 24
pytestmark = pytest.mark.skipif(not buffers._REUSABLE, reason="payload reuse needs CPython's bytes layout")


def _x(seed: int, n: int = 10_000) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _decoded(payload) -> torch.Tensor:
    return decode_update(payload, max_bytes=MAX)[0]


def test_a_dropped_payload_is_reused_and_a_held_one_never_changes():
    state = CodecState(error_feedback=False)
    assert state.payloads.capacity == 1  # a stream keeps one payload between encodes (1 B/param at int8)
    p1 = encode_update("identity", [_x(1)], state)
    first = id(p1)
    del p1
    p2 = encode_update("identity", [_x(2)], state)  # p1 was dropped: its buffer comes back
    assert id(p2) == first and state.payloads.reused == 1
    snapshot = bytearray(p2)
    p3 = encode_update("identity", [_x(3)], state)  # p2 is still held: a fresh buffer, p2 left alone
    assert id(p3) != first and p2 == snapshot and state.payloads.reused == 1
    assert len(state.payloads._bufs) == 1  # p3's: p2 is its holder's alone
    assert torch.equal(_decoded(p3), _x(3)) and torch.equal(_decoded(p2), _x(2))


def test_a_pool_of_two_double_buffers():
    state = CodecState(error_feedback=False)
    state.payloads = buffers.PayloadPool(capacity=2)
    p1 = encode_update("identity", [_x(1)], state)
    snapshot, first = bytearray(p1), id(p1)
    p2 = encode_update("identity", [_x(2)], state)  # p1 is still held: a fresh buffer
    assert id(p2) != first and p1 == snapshot and state.payloads.reused == 0
    del p1
    p3 = encode_update("identity", [_x(3)], state)  # p1 was dropped: its buffer comes back
    assert id(p3) == first and state.payloads.reused == 1
    assert torch.equal(_decoded(p3), _x(3)) and torch.equal(_decoded(p2), _x(2))


def test_views_and_threads_holding_a_payload_keep_it_intact():
    # What a send in flight holds: a memoryview (p2p slices one into chunks), a torch view,
    # or the bytes object in another thread's frame.
    state = CodecState(error_feedback=False)
    payload = encode_update("fp16", [_x(0)], state)
    expected = bytes(bytearray(payload))
    views = [memoryview(payload)[100:], torch.frombuffer(payload, dtype=torch.uint8)]
    release, seen = threading.Event(), []
    holder = threading.Thread(target=lambda p=payload: (release.wait(10), seen.append(p == expected)))
    holder.start()
    del payload
    for seed in range(1, 4):
        encode_update("fp16", [_x(seed)], state)
    assert bytes(views[0]) == expected[100:] and bytes(views[1].numpy()) == expected
    views.clear()  # now only the thread holds it
    for seed in range(4, 7):
        encode_update("fp16", [_x(seed)], state)
    release.set()
    holder.join()
    assert seen == [True]
    assert state.payloads.reused == 5  # the pool's buffer, at every encode after the first two


def test_held_payloads_survive_many_encodes_of_a_double_buffered_stream():
    # Overlap mode: round r's payload is still being sent while round r + 1 encodes (a stalled push:
    # a pool of one makes a fresh payload each time; of two, it alternates).
    state = CodecState(error_feedback=True)
    state.payloads = buffers.PayloadPool(capacity=2)
    in_flight = None
    for r in range(6):
        payload, sent = encode_and_decode("int8", [_x(r)], state)
        if in_flight is not None:
            old_payload, old_sent = in_flight
            assert torch.equal(_decoded(old_payload), old_sent[0])
            del old_payload, old_sent  # round r - 1's sends are done
        in_flight = payload, sent
        del payload, sent
    assert state.payloads.reused >= 3


def test_a_reused_payload_hashes_and_compares_by_its_new_contents():
    state = CodecState(error_feedback=False)
    p = encode_update("bf16", [_x(1)], state)
    first, old_hash = id(p), hash(p)
    del p
    p = encode_update("bf16", [_x(2)], state)
    assert id(p) == first
    assert hash(p) == hash(bytes(bytearray(p))) != old_hash
    assert {p: 1}[bytes(bytearray(p))] == 1


def test_only_same_length_payloads_are_reused_and_at_most_two_are_kept():
    state = CodecState(error_feedback=False)
    state.payloads = buffers.PayloadPool(capacity=2)
    ids = set()
    for spec in ["fp16", "int8", "fp16", "int8", "int4", "fp16"]:
        ids.add(id(encode_update(spec, [_x(0)], state)))
    assert len(state.payloads._bufs) == 2
    assert state.payloads.reused == 2  # fp16 and int8 alternate; int4 then pushes fp16 out
    state.reset()
    assert not state.payloads._bufs


def test_one_off_encodes_keep_no_buffer(monkeypatch):
    def no_pool(self, n):
        raise AssertionError("an encode without a state must not pool its payload")

    monkeypatch.setattr(buffers.PayloadPool, "take", no_pool)
    assert torch.equal(_decoded(encode_update("identity", [_x(1)])), _x(1))


SPECS = ["identity", "fp16", "bf16", "int8", {"kind": "int8", "chunk": 7, "stochastic": True}, "int4",
         {"kind": "int4", "chunk": 6}, "int3", {"kind": "int3", "chunk": 24}, "sign", {"kind": "sign", "chunk": 5}, {"kind": "topk", "fraction": 0.05},
         {"kind": "topk", "fraction": 0.3, "inner": "int4"}, {"kind": "topk", "fraction": 0.01, "inner": "sign"},
         "randomk", {"kind": "powersgd", "rank": 2}, {"kind": "sparseloco", "fraction": 0.05, "chunk": 64},
         {"kind": "ternary", "chunk": 24}]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_every_byte_of_a_payload_is_written_whatever_the_buffer_held(spec, monkeypatch):
    # A reused buffer holds the previous payload, not zeroed pages: a codec that skipped a
    # byte (padding, an odd tail) would leak it. Encode into garbage and compare with a clean encode.
    tensors = [_x(5, 1001), _x(6, 30 * 17).view(30, 17), torch.zeros(0), _x(7, 3).to(torch.float16)]
    clean = encode_update(spec, tensors, CodecState(error_feedback=True, seed=9))
    real = buffers.new_bytes

    def garbage(n):
        buf = real(n)
        buffers.writable(buf).fill_(0xA5)
        return buf

    monkeypatch.setattr(buffers, "new_bytes", garbage)
    monkeypatch.setattr("geofed.compression.wire.new_bytes", garbage)
    assert encode_update(spec, tensors, CodecState(error_feedback=True, seed=9)) == clean
