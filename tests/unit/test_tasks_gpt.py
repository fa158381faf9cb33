"""task.kind gpt: the decoder-only transformer, its byte tokens and splits, and that it learns
on tinyshakespeare across two regions in two rounds; plug-in tasks get the run's facts."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.config.strict import ConfigError
from geofed.regions.inprocess import InProcessRegions
from geofed.regions.tasks import make_task
from geofed.regions.tasks.gpt import GPT, GPTConfig, GPTTask
from geofed.regions.messages import RoundPlan

TINY = {"n_layer": 2, "n_head": 2, "d_model": 32, "context": 32, "max_chars": 60_000, "eval_sequences": 16}


@pytest.fixture
def text(tinyshakespeare_txt):
    return str(tinyshakespeare_txt)


def test_default_size_is_a_one_to_three_million_parameter_model():
    n = sum(p.numel() for p in GPT(256, GPTConfig()).parameters())
    assert 1_000_000 <= n <= 3_000_000, n


def test_embeddings_are_tied_and_attention_is_causal():
    model = GPT(256, GPTConfig(**TINY)).eval()
    assert model.head.weight is model.tok.weight
    assert GPT(256, GPTConfig(**TINY, tie_embeddings=False)).head.weight is not None
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 256  # change only the future of position 9
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-6)
    assert not torch.allclose(a[0, 10:], b[0, 10:])


@pytest.mark.parametrize("bad,key", [({"d_model": 30, "n_head": 4}, "n_head"), ({"dropout": 1.0}, "dropout"),
                                     ({"context": 1}, "context")])
def test_bad_sizes_name_their_key(bad, key):
    with pytest.raises(ConfigError) as exc:
        config_from_mapping({"task": {"kind": "gpt", **bad}})
    assert f"task.{key}" in str(exc.value)


def test_activation_checkpointing_gives_the_same_gradients_and_saves_less_for_backward():
    """task.activation_checkpointing recomputes each block in the backward pass (dropout on: the
    recomputation draws the forward pass's masks): the same loss and gradients, bitwise here, with
    only the blocks' inputs saved for backward through the blocks, not their insides."""
    cfg = {**TINY, "n_layer": 3, "dropout": 0.1}
    x = torch.randint(0, 256, (4, 33))

    def run(checkpointing):
        torch.manual_seed(0)
        model = GPT(256, GPTConfig(**cfg, activation_checkpointing=checkpointing)).train()
        saved = []

        def pack(t):
            saved.append(t.numel() * t.element_size())
            return t

        torch.manual_seed(1)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1))
        saved_forward = sum(saved)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()], saved_forward

    plain, ckpt = run(False), run(True)
    assert torch.equal(plain[0], ckpt[0])
    assert all(torch.equal(a, b) for a, b in zip(plain[1], ckpt[1]))
    assert ckpt[2] < plain[2] / 2, (ckpt[2], plain[2])


def test_byte_tokens_and_the_held_out_tail(text):
    task = GPTTask(GPTConfig(path=text, **TINY), batch_size=4)
    raw = open(text, encoding="utf-8").read(TINY["max_chars"]).encode("utf-8")
    assert task.vocab_size == 256
    assert bytes(task.train_ids[:50].tolist()) == raw[:50]
    assert len(task.train_ids) + len(task.test_ids) == len(raw)
    a, b = task.shard(0, 2, 0), task.shard(1, 2, 0)
    assert a.num_examples + b.num_examples < len(task.train_ids)  # contiguous: two different stretches
    batch = next(a.batches(torch.Generator().manual_seed(0)))
    assert batch.shape == (4, TINY["context"] + 1)


def test_a_missing_tokenizer_library_or_file_is_a_clear_error(text, tmp_path):
    with pytest.raises(ValueError, match="tokenizer"):
        GPTTask(GPTConfig(path=text, tokenizer=str(tmp_path / "none.json"), **TINY))


def test_gpt_learns_on_tinyshakespeare_across_two_regions_in_two_rounds(text, tmp_path):
    cfg = config_from_mapping({
        "run": {"seed": 0}, "task": {"kind": "gpt", "path": text, **TINY},
        "regions": {"names": ["a", "b"]}, "network": {"emulation": {"mode": "none"}},
        "sync": {"algorithm": "diloco", "inner": {"lr": 0.003, "batch_size": 8, "precision": "bf16"},
                 "outer": {"lr": 0.7, "momentum": 0.0}},
        "compression": {"codec": "int8"},
    })
    with InProcessRegions(cfg, tmp_path) as c:
        before = c.workers["a"].evaluate_synced()["value"]
        for r in range(2):
            res = c.run_round({reg: RoundPlan(round=r, H=30, evaluate=(r == 1), final=(r == 1)) for reg in ("a", "b")})
        after = res["a"].evaluation.eval["value"]
    assert res["a"].evaluation.eval["metric"] == "loss"
    assert after < before - 0.5, (before, after)  # ln 256 = 5.5 at the start


def test_plugin_tasks_get_batch_size_seed_and_device(tmp_path, monkeypatch):
    (tmp_path / "facts_task.py").write_text(textwrap.dedent("""
        from geofed.regions.tasks import task_factory
        from geofed.regions.tasks.digits import DigitsConfig, DigitsTask

        SEEN = {}

        @task_factory
        def make(batch_size, seed, device, hidden=16):
            SEEN.update(batch_size=batch_size, seed=seed, device=device, hidden=hidden)
            return DigitsTask(DigitsConfig(hidden=hidden), batch_size=batch_size, seed=seed)

        @task_factory
        def make_kw(**kwargs):
            SEEN.update(kwargs)
            return DigitsTask(DigitsConfig(), batch_size=kwargs["batch_size"])
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = config_from_mapping({"task": {"kind": "python:facts_task:make", "options": {"hidden": 8}}})
    task = make_task(cfg.task, batch_size=7, seed=3, device="cpu")
    seen = sys.modules["facts_task"].SEEN
    assert seen == {"batch_size": 7, "seed": 3, "device": "cpu", "hidden": 8}
    assert next(task.shard(0, 1, 0).batches(torch.Generator()))[0].shape[0] == 7
    cfg = config_from_mapping({"task": {"kind": "python:facts_task:make_kw", "options": {"seed": 11}}})
    make_task(cfg.task, batch_size=5, seed=3, device="cpu")
    assert seen["seed"] == 11 and seen["batch_size"] == 5  # an option the user set wins
