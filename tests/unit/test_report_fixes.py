"""The report shows what the summary reports: the averaged/synchronised model's evaluation,
consensus only for gossip, readable events, the run's H, codecs and learning rates in the config
table, and RTT panels on one y-axis."""

from __future__ import annotations

import json

from geofed.orchestrator.report import load_run, write_report
from geofed.orchestrator.report import plots, plots_links
from geofed.orchestrator.report.facts import config_highlights
from test_report_fakerun import REGIONS, fake_run_dir


def _rewrite_jsonl(path, edit):
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(edit(r)) + "\n" for r in recs))


def _capture(monkeypatch, module):
    figs = {}

    def save(fig, out, name):
        figs[name] = fig
        fig.savefig(out / name)
        return name
    monkeypatch.setattr(module, "save", save)
    return figs


def test_eval_plot_draws_the_runs_own_evaluation_and_the_final_one(tmp_path, monkeypatch):
    run_dir = fake_run_dir(tmp_path / "run", rounds=6, regions=REGIONS[:3], eval_every=2)

    # What the runner logs: eval_avg per eval round in rounds.jsonl (here 0.5 + round / 100, unlike
    # any region's own eval in metrics.jsonl) and the final evaluation in summary.json.
    def add(r):
        if r["round"] % 2 == 1:
            r.update(eval_avg={"metric": "accuracy", "value": 0.5 + r["round"] / 100, "higher_is_better": True},
                     eval_round=r["round"], eval_t=r["t_end"])
        return r
    _rewrite_jsonl(run_dir / "rounds.jsonl", add)
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["eval"] = {"metric": "accuracy", "value": 0.77, "higher_is_better": True}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    figs = _capture(monkeypatch, plots)
    run = load_run(run_dir)
    out = tmp_path / "out"
    out.mkdir()
    plot = plots.plot_eval(run, out)
    assert plot is not None and "summary.json" in plot.caption
    ax_r = figs["eval.png"].axes[1]
    lines = {ln.get_label(): ln for ln in ax_r.get_lines()}
    assert list(lines["synchronised model"].get_ydata()) == [0.51, 0.53, 0.55]
    assert list(lines["synchronised model"].get_xdata()) == [1, 3, 5]
    assert list(lines["final (summary)"].get_ydata()) == [0.77]
    assert not any(label.startswith("us-") or label.startswith("eu-") for label in lines)  # no per-region lines


def test_consensus_distance_only_for_gossip(tmp_path):
    # DiLoCo's rounds.jsonl carries a (sketch) consensus distance too: near zero, and no panel.
    run_dir = fake_run_dir(tmp_path / "diloco", rounds=4, regions=REGIONS[:3])
    _rewrite_jsonl(run_dir / "rounds.jsonl", lambda r: {**r, "consensus_distance": 1e-7})
    html = write_report(run_dir)
    assert not (html.parent / "consensus.png").exists() and "consensus.png" not in html.read_text()
    gossip = write_report(fake_run_dir(tmp_path / "gossip", rounds=4, regions=REGIONS[:3], algorithm="gossip"))
    assert (gossip.parent / "consensus.png").exists()


def test_events_are_a_readable_table(tmp_path):
    run_dir = fake_run_dir(tmp_path / "run", rounds=3, regions=REGIONS[:2])
    events = [{"t": 0.0, "round": 0, "event": "started", "driver_pid": 4242, "resume": False,
               "regions": {r: {"pid": 1, "grpc_address": "127.0.0.1:1", "node_ip": "127.0.0.1"} for r in REGIONS[:2]}},
              {"t": 0.1, "round": 0, "event": "links_probed", "links": {"a->b": {"rtt_ms": 80.0}, "b->a": {"rtt_ms": 81.0}}},
              {"t": 0.2, "round": 0, "event": "setup_done", "setup_s": 7.25, "phases_s": {"tls": 0.25, "ray": 5.0}},
              {"t": 3.0, "round": 2, "event": "refused", "region": "us-east-1", "by_reason": {"round_window": 2}}]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    text = write_report(run_dir).read_text()
    events_html = text[text.index('id="events"'):]
    assert "driver pid 4242, 2 regions" in events_html
    assert "2 links measured before round 0" in events_html
    assert "set-up 7.2 s (tls 0.2 s, ray 5.0 s)" in events_html
    assert "region: us-east-1; by reason: round_window=2" in events_html
    assert "{&quot;" not in events_html and '{"' not in events_html  # no JSON dumps


def test_config_table_has_H_codecs_and_learning_rates(tmp_path):
    run_dir = fake_run_dir(tmp_path / "run", rounds=6, regions=REGIONS[:3])
    import yaml

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    cfg["sync"].update(inner={"kind": "adamw", "lr": 0.003, "lr_decay": "none"},
                       outer={"lr": 0.7, "momentum": 0.9, "nesterov": True},
                       policy={"kind": "bandwidth", "H_min": 5, "H_max": 500})
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = dict(config_highlights(load_run(run_dir)))
    assert rows["H (local steps)"] == "20–60 (bandwidth, bounds 5–500)"
    assert rows["codecs used"] == "fp16, int8"
    assert rows["inner lr"] == "0.003 (adamw)"
    assert rows["outer lr / momentum"] == "0.7 / 0.9, Nesterov"
    assert "inner lr" in write_report(run_dir).read_text()


def test_rtt_panels_share_one_y_axis(tmp_path, monkeypatch):
    figs = _capture(monkeypatch, plots_links)
    run = load_run(fake_run_dir(tmp_path / "run", rounds=4, regions=REGIONS[:3]))
    out = tmp_path / "out"
    out.mkdir()
    assert plots_links.plot_link(run, out, "rtt") is not None
    limits = {ax.get_ylim() for ax in figs["links_rtt.png"].axes if ax.get_visible()}
    assert len(limits) == 1, limits
    top = max(v.get("rtt_ms", 0) for r in run.rounds for v in r.links.values())
    assert limits.pop()[1] >= top
