"""task.kind hf-causal-lm (the geofed[hf] extra): a transformers model built from a local config
or a named architecture, trained across two regions; config errors name their key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from geofed.orchestrator.config import config_from_mapping, load_config
from geofed.orchestrator.cli import main
from geofed.orchestrator.config.strict import ConfigError

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'geofed[hf]')")

from geofed.regions.inprocess import InProcessRegions
from geofed.regions.tasks.hf import HFCausalLMConfig, HFCausalLMTask
from geofed.regions.messages import RoundPlan

ROOT = Path(__file__).resolve().parents[2]
TINY = {"architecture": "gpt2", "n_layer": 2, "n_head": 2, "d_model": 32, "context": 32, "max_chars": 60_000,
        "eval_sequences": 16}


@pytest.fixture
def text(tinyshakespeare_txt):
    return str(tinyshakespeare_txt)


def test_a_tiny_gpt2_learns_across_two_regions_in_two_rounds(text, tmp_path):
    cfg = config_from_mapping({
        "run": {"seed": 0}, "task": {"kind": "hf-causal-lm", "path": text, **TINY},
        "regions": {"names": ["a", "b"], "device": "cpu"}, "network": {"emulation": {"mode": "none"}},
        "sync": {"algorithm": "diloco", "inner": {"lr": 0.003, "batch_size": 8},
                 "outer": {"lr": 0.7, "momentum": 0.0}},
        "compression": {"codec": "int8"},
    })
    with InProcessRegions(cfg, tmp_path) as c:
        model = c.workers["a"].model
        assert isinstance(model, transformers.GPT2LMHeadModel)
        before = c.workers["a"].evaluate_synced()["value"]
        for r in range(2):
            res = c.run_round({reg: RoundPlan(round=r, H=30, evaluate=(r == 1), final=(r == 1)) for reg in ("a", "b")})
        after = res["a"].evaluation.eval["value"]
    assert res["a"].evaluation.eval["metric"] == "loss"
    assert after < before - 0.5, (before, after)  # ln 256 = 5.5 at the start


def test_a_local_config_json_and_a_named_llama(text, tmp_path):
    hf = transformers.AutoConfig.for_model("llama", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                           intermediate_size=64, max_position_embeddings=64, vocab_size=300)
    hf.save_pretrained(tmp_path)  # a folder with config.json, as a user's own model would have
    task = HFCausalLMTask(HFCausalLMConfig(path=text, config=str(tmp_path), context=32, max_chars=20_000), batch_size=2)
    model = task.build_model(0)
    assert model.config.model_type == "llama" and model.config.vocab_size == 300
    loss = task.loss(model, next(task.shard(0, 1, 0).batches(torch.Generator())))
    assert 4.0 < loss.item() < 8.0  # about ln 300 at random init
    named = HFCausalLMTask(HFCausalLMConfig(path=text, architecture="llama", n_layer=1, n_head=2, d_model=32,
                                            context=32, max_chars=20_000, extra={"num_key_value_heads": 1}))
    assert named.build_model(0).config.num_key_value_heads == 1
    assert named.describe()["vocab"] == 256


@pytest.mark.parametrize("bad,key", [({"architecture": "no-such-model"}, "architecture"),
                                     ({"config": "/nonexistent/folder"}, "config"),
                                     ({"d_model": 30, "n_head": 4}, "n_head"),
                                     ({"tokenizer": "/nonexistent/tok.json"}, "tokenizer")])
def test_bad_keys_are_config_errors_naming_the_key(text, bad, key):
    with pytest.raises(ConfigError) as exc:
        config_from_mapping({"task": {"kind": "hf-causal-lm", "path": text, **bad}})
    assert f"task.{key}" in str(exc.value)


def test_an_unreadable_config_json_is_an_error_naming_config(text, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "no-such-model"}')
    with pytest.raises(ValueError, match="^config: cannot read"):
        HFCausalLMTask(HFCausalLMConfig(path=text, config=str(tmp_path / "config.json"), max_chars=20_000))


def test_a_context_longer_than_the_models_positions_is_refused(text, tmp_path):
    hf = transformers.AutoConfig.for_model("gpt2", n_embd=32, n_layer=1, n_head=2, n_positions=16, vocab_size=256)
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="context"):
        HFCausalLMTask(HFCausalLMConfig(path=text, config=str(tmp_path), context=32, max_chars=20_000))


def test_the_example_config_validates(tinyshakespeare_txt):
    cfg = load_config(ROOT / "examples" / "hf-gpt2-tiny.yaml")
    assert cfg.task.kind == "hf-causal-lm" and cfg.task.path == str(tinyshakespeare_txt)
    assert main(["validate", str(ROOT / "examples" / "hf-gpt2-tiny.yaml")]) == 0


def test_without_transformers_the_kind_is_a_config_error_naming_the_extra(tmp_path, text):
    # A child process in which transformers cannot be imported, as on an install without geofed[hf].
    cfg = tmp_path / "hf.yaml"
    cfg.write_text(json.dumps({"task": {"kind": "hf-causal-lm", "path": text}}))
    code = ("import sys; sys.modules['transformers'] = None; from geofed.orchestrator.cli import main; "
            f"raise SystemExit(main(['validate', {str(cfg)!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "task.kind" in out.stderr and "pip install 'geofed[hf]'" in out.stderr
