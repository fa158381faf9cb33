"""Issue 37 item 1: the report's bandwidth panels show which estimates are of low confidence."""

from __future__ import annotations

import json

from geofed.orchestrator.report import load_run, plots_links
from test_report_fakerun import REGIONS, fake_run_dir


def test_low_confidence_estimates_are_drawn_hollow_and_the_caption_says_why(tmp_path, monkeypatch):
    """Before: every estimate drew alike (no hollow markers, nothing about age or confidence), so a
    stale or doubted estimate looked as sure as a fresh one."""
    run_dir = fake_run_dir(tmp_path / "run", rounds=6, regions=REGIONS[:2])
    path = run_dir / "rounds.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    low = {(1, "us-east-1->eu-west-1"), (2, "us-east-1->eu-west-1"), (4, "eu-west-1->us-east-1")}
    for i, rec in enumerate(recs):
        for link, est in rec["links"].items():
            est["confidence"], est["age_s"] = (0.25, 31.0) if (i, link) in low else (1.0, 0.5)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    figs = {}

    def save(fig, out, name):
        figs[name] = fig
        return name
    monkeypatch.setattr(plots_links, "save", save)
    out = tmp_path / "out"
    out.mkdir()
    plot = plots_links.plot_link(load_run(run_dir), out, "bandwidth")
    assert "hollow" in plot.caption and "confidence" in plot.caption
    hollow = {}
    for ax in figs["links_bandwidth.png"].axes:
        for line in ax.get_lines():
            if line.get_label() == "low confidence":
                assert line.get_markerfacecolor() == "none"
                hollow[ax.get_title().replace(" → ", "->")] = len(line.get_xdata())
    assert hollow == {"us-east-1->eu-west-1": 2, "eu-west-1->us-east-1": 1}
    # A run without confidence (older runs) draws as before: no hollow markers, no note.
    figs.clear()
    plain = plots_links.plot_link(load_run(fake_run_dir(tmp_path / "old", rounds=6, regions=REGIONS[:2])), out,
                                  "bandwidth")
    assert "hollow" not in plain.caption
    assert not [ln for ax in figs["links_bandwidth.png"].axes for ln in ax.get_lines()
                if ln.get_label() == "low confidence"]
