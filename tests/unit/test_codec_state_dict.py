"""CodecState.state_dict()/load_state_dict(): a restored stream encodes exactly as the original
would have, its random generator included (stochastic rounding draws from it)."""

from __future__ import annotations

import io

import pytest
import torch
from geofed.compression import CodecState, encode_and_decode, make_codec

torch.set_num_threads(1)


def _through_a_checkpoint(d: dict) -> dict:
    # As a checkpoint holds it: no tensor shared with the live state (PowerSGD's Q is updated in place).
    buf = io.BytesIO()
    torch.save(d, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _updates(n: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [[torch.randn(300, generator=g), torch.randn(4, 25, generator=g)] for _ in range(n)]


@pytest.mark.parametrize("spec", [{"kind": "int8", "stochastic": True}, {"kind": "topk", "fraction": 0.1},
                                  {"kind": "powersgd", "rank": 2}])
def test_a_restored_state_encodes_the_same_bytes_as_the_original(spec):
    codec = make_codec(spec)
    updates = _updates(5)
    original = CodecState(error_feedback=True, seed=11)
    for tensors in updates[:3]:
        encode_and_decode(codec, tensors, original)
    saved = _through_a_checkpoint(original.state_dict())
    restored = CodecState(error_feedback=True, seed=99)  # another seed: the saved one must win
    restored.load_state_dict(saved)
    assert restored.seed == original.seed and restored.counter == original.counter == 3
    for tensors in updates[3:]:
        a, _ = encode_and_decode(codec, tensors, original)
        b, _ = encode_and_decode(codec, tensors, restored)
        assert bytes(a) == bytes(b)
    assert torch.equal(original.residual, restored.residual) if original.residual is not None else restored.residual is None


def test_the_generator_state_travels_and_scratch_buffers_do_not():
    state = CodecState(seed=5)
    torch.rand(3, generator=state.generator)  # advance it past its seed
    state.scratch(10)
    saved = state.state_dict()
    assert "scratch" not in saved["store"] and saved["generator"] is not None
    other = CodecState(seed=5)
    other.load_state_dict(saved)
    assert torch.equal(other.generator.get_state(), state.generator.get_state())
    assert CodecState(seed=5).generator.get_state().tolist() != other.generator.get_state().tolist()
    untouched = CodecState(seed=7).state_dict()
    assert untouched["generator"] is None  # never drawn from: rebuilt from the seed on load
