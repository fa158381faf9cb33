"""Reading a run directory: what must be there, what may be missing, and loud errors for damage."""

from __future__ import annotations

import json
import math

import pytest
from geofed.orchestrator.cli import main
from geofed.orchestrator.report import RunDirError, load_run, write_report
from geofed.orchestrator.report.facts import headline
from geofed.orchestrator.config.strict import ConfigError
from test_report_fakerun import REGIONS, fake_run_dir


def test_a_folder_without_run_files_is_refused_naming_what_is_missing(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(RunDirError) as exc:
        load_run(tmp_path)
    msg = str(exc.value)
    assert str(tmp_path) in msg and "metrics.jsonl" in msg and "rounds.jsonl" in msg and "summary.json" in msg
    assert isinstance(exc.value, ConfigError) and isinstance(exc.value, ValueError)


def test_missing_path_and_plain_file_are_refused(tmp_path):
    with pytest.raises(RunDirError, match="no such run directory"):
        load_run(tmp_path / "nope")
    (tmp_path / "f").write_text("x")
    with pytest.raises(RunDirError, match="not a directory"):
        load_run(tmp_path / "f")


def test_cli_report_exits_2_on_a_non_run_directory(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a run directory" in err and str(tmp_path) in err


def test_cli_report_writes_and_prints_the_path(tmp_path, capsys):
    run = fake_run_dir(tmp_path / "run", rounds=2, regions=REGIONS[:2])
    assert main(["report", str(run)]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == str(run / "report" / "report.html")
    assert (run / "report" / "report.html").is_file()


def test_a_damaged_line_names_file_and_line(tmp_path):
    run = fake_run_dir(tmp_path / "run", rounds=3, regions=REGIONS[:2])
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[2] = lines[2][:-5]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(RunDirError, match=r"metrics\.jsonl:3: invalid JSON"):
        load_run(run)


def test_an_unfinished_last_line_is_skipped_with_a_warning(tmp_path):
    # The runtime appends as rounds finish: a report made mid-run can catch half a line.
    run = fake_run_dir(tmp_path / "run", rounds=3, regions=REGIONS[:2], summary=False)
    text = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(text + '{"round": 3, "region": "us-ea')
    loaded = load_run(run)
    assert len(loaded.metrics) == 6
    assert any("metrics.jsonl:7" in w for w in loaded.warnings)
    assert any("summary.json is missing" in w for w in loaded.warnings)


@pytest.mark.parametrize("bad, match", [
    ({"round": "3", "region": "a"}, r"metrics\.jsonl:1: round: expected an integer"),
    ({"round": 1}, r"metrics\.jsonl:1: required key 'region' is missing"),
    ({"round": 1, "region": "a", "train_loss": "low"}, r"metrics\.jsonl:1: train_loss: expected a number"),
    ([1, 2], r"metrics\.jsonl:1: expected a JSON object"),
])
def test_malformed_records_are_refused_with_the_key(tmp_path, bad, match):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(bad) + "\n")
    with pytest.raises(RunDirError, match=match):
        load_run(tmp_path)


def test_summary_that_is_not_an_object_is_refused(tmp_path):
    (tmp_path / "summary.json").write_text("[1]")
    with pytest.raises(RunDirError, match=r"summary\.json: expected a JSON object"):
        load_run(tmp_path)


def test_resumed_rounds_keep_the_later_record(tmp_path):
    recs = [{"round": 0, "region": "a", "train_loss": 1.0}, {"round": 1, "region": "a", "train_loss": 9.0},
            {"round": 1, "region": "a", "train_loss": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    run = load_run(tmp_path)
    assert [m["train_loss"] for m in run.metrics] == [1.0, 0.5]
    assert [r.mean_train_loss for r in run.rounds] == [1.0, 0.5]


def test_rounds_are_worked_out_from_metrics_when_rounds_jsonl_is_missing(tmp_path):
    run_dir = fake_run_dir(tmp_path / "run", rounds=4, regions=REGIONS[:3], summary=False)
    coord = load_run(run_dir).rounds
    (run_dir / "rounds.jsonl").unlink()
    derived = load_run(run_dir).rounds
    assert [r.round for r in derived] == [0, 1, 2, 3]
    for a, b in zip(coord, derived):
        assert b.mean_train_loss == pytest.approx(a.mean_train_loss)
        assert b.bytes_sent == pytest.approx(a.bytes_sent)
        assert b.t_end == pytest.approx(a.t_end)
        assert set(b.codecs) == set(a.codecs)  # "a->b" keys rebuilt from each region's peer codecs


def test_headline_falls_back_to_the_rounds_without_a_summary(tmp_path):
    with_summary = headline(load_run(fake_run_dir(tmp_path / "a", rounds=5)))
    without = headline(load_run(fake_run_dir(tmp_path / "b", rounds=5, summary=False)))
    assert without.rounds == with_summary.rounds == 5
    assert without.bytes_sent == pytest.approx(with_summary.bytes_sent)
    assert without.final_train_loss == pytest.approx(with_summary.final_train_loss)
    assert without.wall_s == pytest.approx(with_summary.wall_s)
    assert without.eval_value is not None


def test_regions_keep_the_config_order(tmp_path):
    order = ("zz-south-1", "aa-north-1", "mm-west-1")
    run = load_run(fake_run_dir(tmp_path / "r", regions=order, rounds=2))
    assert run.regions == list(order)
    assert run.link_order(["mm-west-1->aa-north-1", "aa-north-1->zz-south-1", "zz-south-1->mm-west-1"]) == [
        "zz-south-1->mm-west-1", "aa-north-1->zz-south-1", "mm-west-1->aa-north-1"]


def test_a_diverged_loss_does_not_break_the_report(tmp_path):
    # Python's json writes NaN/Infinity; a diverged run must still render, with the gap visible.
    recs = [{"round": r, "region": "a", "t_start": r, "t_end": r + 1, "train_loss": v}
            for r, v in enumerate([1.0, math.nan, math.inf, 0.5])]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    run = load_run(tmp_path)
    assert [r.mean_train_loss for r in run.rounds] == [1.0, None, None, 0.5]
    assert (write_report(tmp_path)).is_file()


@pytest.mark.parametrize("spec, shown", [
    ({"inner": "int8", "kind": "topk", "fraction": 0.01}, "topk(fraction=0.01,inner=int8)"),  # by its key
    ({"kind": "lz4", "level": 3}, "{'kind': 'lz4', 'level': 3}"),  # a codec this version lacks: as written
])
def test_a_run_without_summary_names_its_codec_by_key(tmp_path, spec, shown):
    import yaml
    from geofed.orchestrator.report.facts import config_highlights

    run = fake_run_dir(tmp_path / "run", rounds=2, regions=REGIONS[:2], summary=False)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["compression"]["codec"] = spec
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert ("codec", shown) in config_highlights(load_run(run))
