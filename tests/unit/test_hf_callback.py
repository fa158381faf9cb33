"""GeofedCallback (regions/hf_callback.py) inside a real transformers.Trainer, against a recording
stand-in for the loop API's context: what it hands to ctx.sync, the loss it passes to each
sync.step, and that training stops once sync.should_stop. The whole run through geofed:
tests/integration/test_own_loop_examples.py."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'geofed[hf]')")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (pip install 'geofed[hf]')")

from geofed.regions.hf_callback import GeofedCallback  # after the skips


class RecordingSync:
    """Sync's surface: counts steps, keeps the losses, stops after `steps`."""

    def __init__(self, steps: int):
        self.steps, self.losses = steps, []

    def step(self, loss=None):
        self.losses.append(loss)

    @property
    def should_stop(self):
        return len(self.losses) >= self.steps


class RecordingContext:
    def __init__(self, steps: int):
        self.steps, self.calls = steps, []

    def sync(self, model, optimizer, *, state=None, evaluate=None, examples=None):
        self.calls.append((model, optimizer, state, evaluate, examples))
        self.recorded = RecordingSync(self.steps)
        return self.recorded


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("gpt2", n_layer=1, n_head=2, n_embd=32, n_positions=16, vocab_size=256,
                                               bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return transformers.AutoModelForCausalLM.from_config(config)


def test_callback_syncs_the_trainers_optimizer_passes_each_steps_loss_and_stops(tmp_path):
    ctx = RecordingContext(steps=5)
    evaluate = object()  # passed through untouched
    callback = GeofedCallback(ctx, state={"data": "loader"}, evaluate=evaluate, examples=64)
    # Gradient accumulation: a step's loss is made of two forward passes (transformers divides each
    # by the step's items), and the callback must give sync.step the step's loss, as transformers logs it.
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=10**9,
        use_cpu=True, report_to="none", save_strategy="no", logging_strategy="steps", logging_steps=1,
        disable_tqdm=True, lr_scheduler_type="constant")
    model = _tiny_gpt2()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback])
    result = trainer.train()

    assert result.global_step == 5  # stopped by sync.should_stop, not by max_steps
    (synced_model, optimizer, state, passed_eval, examples), = ctx.calls
    assert synced_model is model and optimizer is trainer.optimizer and passed_eval is evaluate and examples == 64
    assert state == {"data": "loader", "lr_scheduler": trainer.lr_scheduler}  # the scheduler is checkpointed too
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert ctx.recorded.losses == pytest.approx(logged, rel=1e-6) and len(logged) == 5
    assert callback.sync is ctx.recorded
    # The loss hook is gone after training: an evaluation's forward passes are not kept.
    model(input_ids=torch.zeros(1, 8, dtype=torch.long), labels=torch.zeros(1, 8, dtype=torch.long))
    assert callback.losses.take() is None


class ContextWithLock(RecordingContext):
    """A context holding what the real one holds (a thread's lock): not deep-copyable."""

    def __init__(self, steps: int):
        super().__init__(steps)
        self.lock = threading.Condition()

    def sync(self, model, optimizer, **kwargs):
        synced = super().sync(model, optimizer, **kwargs)
        self.copied = copy.deepcopy(model)  # what Region.evaluate_params does, mid-training
        return synced


def test_the_model_can_be_deep_copied_while_the_loss_hook_is_on(tmp_path):
    """geofed evaluates on a deep copy of the model; before StepLosses the hook was a method of the
    callback, and the copy failed with "cannot pickle '_thread.RLock' object" (the context's lock)."""
    ctx = ContextWithLock(steps=2)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=10**9, use_cpu=True, report_to="none",
                                          save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=_tiny_gpt2(), args=args, train_dataset=Tokens(),
                                   callbacks=[GeofedCallback(ctx)])
    assert trainer.train().global_step == 2
    ctx.copied.eval()
    out = ctx.copied(input_ids=torch.zeros(1, 8, dtype=torch.long), labels=torch.zeros(1, 8, dtype=torch.long))
    assert torch.isfinite(out.loss)


def test_callback_stops_at_once_when_the_run_is_already_over(tmp_path):
    ctx = RecordingContext(steps=0)  # a resumed run whose final round had been done
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=10**9, use_cpu=True, report_to="none",
                                          save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=_tiny_gpt2(), args=args, train_dataset=Tokens(),
                                   callbacks=[GeofedCallback(ctx)])
    result = trainer.train()
    # transformers reads the flag after a step, not before the first: one step, then it stops.
    assert result.global_step == 1 and len(ctx.calls) == 1 and len(ctx.recorded.losses) == 1
