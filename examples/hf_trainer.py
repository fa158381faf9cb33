"""A Hugging Face ``transformers.Trainer`` run, synced across regions by geofed.

The model is the tiny GPT-2 of examples/hf-gpt2-tiny.yaml (2 blocks, width 64, byte tokens, random
weights: nothing is downloaded); the regions, links, H, codec and outer optimizer are that file's
too. Each region trains its own stretch of the text with an ordinary ``transformers.Trainer``;
``GeofedCallback(ctx)`` hands the model and the Trainer's optimizer to geofed when training begins,
counts the optimizer steps, and stops training after the run's final outer step. Needs
``pip install 'geofed[hf]'``.

    geofed data fetch tinyshakespeare          # or: --text any-utf8-file.txt
    python examples/hf_trainer.py --rounds 2

Each region saves its final model under RUN_DIR/hf/REGION (``Trainer.save_model``). After the final
outer step of serial DiLoCo with a lossless codec (``--set compression.codec=identity``) they hold
the same weights; with the yaml's int8 they differ by the codec's error (each region mixes its own
update as it is and the others' as decoded). docs/own-loop.md says more.
"""

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, TrainingArguments
from transformers import Trainer as HFTrainer

from geofed.orchestrator import Trainer
from geofed.regions.hf_callback import GeofedCallback
from geofed.regions.tasks.hf import build_hf_config

CONFIG = Path(__file__).with_name("hf-gpt2-tiny.yaml")


class Windows(torch.utils.data.Dataset):
    """Consecutive windows of `length` byte tokens; the labels are the inputs (the model shifts them)."""

    def __init__(self, ids, length):
        self.ids, self.length = ids, length

    def __len__(self):
        return len(self.ids) // self.length

    def __getitem__(self, i):
        window = self.ids[i * self.length:(i + 1) * self.length]
        return {"input_ids": window, "labels": window}


def heldout_loss(model, windows, count):
    """The mean loss on the first `count` held-out windows, without dropout."""
    batch = torch.stack([windows[i]["input_ids"] for i in range(min(count, len(windows)))])
    training = model.training
    model.eval()
    with torch.no_grad():
        batch = batch.to(next(model.parameters()).device)
        loss = model(input_ids=batch, labels=batch).loss
    model.train(training)
    return {"metric": "loss", "value": float(loss), "higher_is_better": False}


def train(ctx):
    task = ctx.config.task  # the yaml's task section: sizes, context, and the text (dataset or path)
    text = Path(task.path).read_text(encoding="utf-8")[:task.max_chars]
    ids = torch.tensor(list(text.encode("utf-8")))
    cut = int(len(ids) * (1 - task.test_fraction))
    stretch = cut // ctx.num_regions  # each region its own stretch of the text (non-IID)
    mine = Windows(ids[ctx.region_index * stretch:(ctx.region_index + 1) * stretch], task.context)
    heldout = Windows(ids[cut:], task.context)

    torch.manual_seed(ctx.seed)  # the same initial weights in every region
    model = AutoModelForCausalLM.from_config(build_hf_config(task, vocab=256))
    inner = ctx.config.sync.inner
    args = TrainingArguments(
        output_dir=str(ctx.run_dir / "hf" / ctx.region), per_device_train_batch_size=inner.batch_size,
        learning_rate=inner.lr, lr_scheduler_type="constant",
        max_steps=10**9,  # geofed ends training: the callback stops it after the final round
        use_cpu=ctx.device.type == "cpu", seed=ctx.seed, report_to="none", save_strategy="no",
        logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    callback = GeofedCallback(ctx, evaluate=lambda m: heldout_loss(m, heldout, task.eval_sequences))
    trainer = HFTrainer(model=model, args=args, train_dataset=mine, callbacks=[callback])
    result = trainer.train()
    trainer.save_model(str(ctx.run_dir / "hf" / ctx.region))
    ctx.report(steps=result.global_step, train_loss=result.training_loss,
               heldout_loss=heldout_loss(model, heldout, task.eval_sequences)["value"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, help="run.rounds (the config's: 10)")
    parser.add_argument("--text", help="a UTF-8 text file (default: tinyshakespeare from geofed's data cache)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any config key, as `geofed run --set` takes it (repeatable)")
    parser.add_argument("--out", help="the run directory (default: runs/hf-gpt2-tiny-...)")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint (over Ray)")
    parser.add_argument("--in-process", action="store_true",
                        help="the regions as threads of this process over the in-memory transport (no Ray)")
    a = parser.parse_args()
    overrides = ([f"run.rounds={a.rounds}"] if a.rounds else []) + ([f"task.path={a.text}"] if a.text else []) + a.set
    Trainer(train, config=str(CONFIG), overrides=overrides, out=a.out, resume=a.resume, in_process=a.in_process).fit()
