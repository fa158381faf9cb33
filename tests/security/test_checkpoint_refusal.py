"""Issue 15, finding 12: a refused code-carrying checkpoint (or a peer's FetchState state) is
refused in our words. torch's own message advises re-running torch.load with weights_only set
to False, which for a hostile file is the one thing never to do."""

from __future__ import annotations

import hashlib
import io
import os
import pickle

import pytest
import torch
from geofed.orchestrator.config import config_from_mapping
from geofed.p2p.memory import InMemoryHub, InMemoryTransport
from geofed.regions import checkpoint
from geofed.regions.checkpoint import CheckpointError
from geofed.regions.region import Region

TORCH_ADVICE = ("weights_only", "Re-running", "re-run", "trusted source")


def _evil_body(marker) -> bytes:
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    buf = io.BytesIO()
    torch.save({"round": 3, "model": Evil()}, buf, pickle_module=pickle)
    return buf.getvalue()


def test_a_code_carrying_checkpoint_is_refused_without_torchs_advice(tmp_path):
    body = _evil_body(tmp_path / "pwned")
    path = checkpoint.checkpoint_path(tmp_path / "driver", 3)
    checkpoint.write_bytes_atomic(path, checkpoint.MAGIC + hashlib.sha256(body).digest() + body)
    with pytest.raises(CheckpointError) as err:
        checkpoint.load_verified(path)
    text = str(err.value)
    assert not any(a in text for a in TORCH_ADVICE), text
    assert str(path) in text and "refused" in text and "system" in text  # names the file and what it holds
    assert len(text.splitlines()) == 1
    assert not (tmp_path / "pwned").exists()
    # What --resume prints for it goes through load_latest's skip reason: the same words.
    skipped = []
    assert checkpoint.load_latest(path.parent, on_skip=lambda p, why: skipped.append(why)) is None
    assert skipped == [text]


def test_a_peer_serving_code_as_its_state_is_refused_without_torchs_advice(tmp_path):
    cfg = config_from_mapping({"task": {"kind": "mlp-digits", "hidden": 8},
                               "regions": {"names": ["us-east-1", "eu-west-1"]},
                               "network": {"emulation": {"mode": "none"}}})
    hub = InMemoryHub()
    workers = {r: Region(cfg, r, tmp_path, transport=InMemoryTransport(r, hub)) for r in cfg.regions.names}
    for w in workers.values():
        w.start()
        w.connect({r: f"inmem:{r}" for r in workers})
    evil = _evil_body(tmp_path / "pwned")
    workers["eu-west-1"].transport.state_provider = lambda: evil  # a compromised donor
    try:
        with pytest.raises(ValueError) as err:
            workers["us-east-1"].catch_up(["eu-west-1"], timeout_s=5)
    finally:
        for w in workers.values():
            w.close()
    text = str(err.value)
    assert not any(a in text for a in TORCH_ADVICE), text
    assert "eu-west-1" in text and "refused" in text
    assert not (tmp_path / "pwned").exists()
