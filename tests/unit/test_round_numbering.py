"""Issue 37, Why 8: rounds were 1..N on the console and 0..N-1 in checkpoints and export: the
console's "round 3/3" was checkpoints/ckpt-2.pt and `geofed export` wrote model-round2.

One rule now (docs/RUNDIR.md, "Rounds"): a round's number counts from 0 everywhere it names a
round (metrics.jsonl, rounds.jsonl, events, checkpoints, export, the console, watch, --resume's
messages); how many rounds are done is a count and says so ("3/3 done").

Before the fix the console's line for the last of 3 rounds read "round 3/3" (this failed on
"round 2 (3/3 done)"), watch showed "round 3 / 3" with no round number, and --resume of a
finished run said "finished at round 2" for checkpoint ckpt-1.pt.
"""

from __future__ import annotations

import io
import json

from geofed.orchestrator import cli
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.progress import round_line
from geofed.orchestrator.driver.resume import finished_run
from geofed.orchestrator.driver.rundir import JsonlLog, new_run_dir, release_run_dir, write_json
from geofed.orchestrator.watch import watch
from geofed.regions import checkpoint
from geofed.regions.tasks import make_task
from rich.console import Console

CFG = {"run": {"name": "num", "rounds": 3, "report": False},
       "task": {"kind": "mlp-digits", "hidden": 8},
       "regions": {"names": ["us-east-1", "eu-west-1"]},
       "network": {"emulation": {"mode": "none"}}}


def test_console_watch_checkpoints_export_and_resume_name_the_last_round_alike(tmp_path, capsys):
    cfg = config_from_mapping(json.loads(json.dumps(CFG)))
    run_dir = new_run_dir(cfg, str(tmp_path / "run"))
    model = make_task(cfg.task, seed=0).build_model(0)
    rounds = JsonlLog(run_dir / "rounds.jsonl")
    for r in range(3):
        rounds.write({"round": r, "t_start": r, "t_end": r + 1.0, "H": 10, "bytes_sent": 100, "links": {},
                      "mean_train_loss": 1.0})
        for region in cfg.regions.names:
            checkpoint.save_atomic(checkpoint.checkpoint_path(run_dir / "checkpoints" / region, r),
                                   {"model": model.state_dict()})
        checkpoint.save_atomic(checkpoint.checkpoint_path(run_dir / "checkpoints" / "driver", r),
                               {"round": r, "alive": list(cfg.regions.names)})
    rounds.close()
    last = max(checkpoint.list_rounds(run_dir / "checkpoints" / "driver"))
    assert last == 2

    line = round_line(round_=last, total=3, loss=1.0, H=10, codec="int8", mb_sent=0.1, utilization=0.5,
                      elapsed_s=3.0, eta_s=0.0)
    assert line.startswith(f"round {last} (3/3 done) ")

    buf = io.StringIO()
    assert watch(run_dir, once=True, console=Console(file=buf, width=160, force_terminal=False)) == 0
    assert f"3 / 3 done (last round {last})" in buf.getvalue(), buf.getvalue()

    release_run_dir(run_dir)
    assert cli.main(["export", str(run_dir)]) == 0
    assert capsys.readouterr().out.strip().endswith(f"model-round{last}.safetensors")
    assert json.loads((run_dir / "export" / f"model-round{last}.json").read_text())["round"] == last

    write_json(run_dir / "summary.json", {"rounds": 3, "interrupted": None})
    said = finished_run(run_dir, cfg)
    assert said is not None and f"finished after 3 of 3 rounds (last round {last}" in said
