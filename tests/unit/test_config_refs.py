"""Issue 37, item 3: every key that names a region names one of regions.names.

A schedule, a link override, a label, a slowdown, an absence window, a price override or the head
region that names a region the run does not have is a typo; `geofed validate` and `geofed run`
refuse it before anything starts (exit 2), in one line that names the file, the dotted key, the
unknown region and the known ones.

Before the fix `geofed validate` said ok to a schedule, a link override, a price override and a
head region naming an unknown region, and `geofed run` died after set-up (27 s, a 33-line
traceback, exit 1).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from geofed.orchestrator.cli import main
from geofed.orchestrator.config import load_config
from geofed.orchestrator.config.strict import ConfigError

BASE = ("task: {kind: mlp-digits}\nrun: {rounds: 1, report: false}\n"
        "regions: {names: [us-east-1, eu-west-1, ap-south-1]%s}\n")
KNOWN = "us-east-1, eu-west-1, ap-south-1"

# name: (config text, the dotted key, the unknown region)
CASES = {
    "emulation_schedule": (
        BASE % "" + "network: {emulation: {schedule: [{link: 'us-east-1->eu-west-1', at_round: 1, outage_s: 2},"
                    " {link: 'us-east-1<->eu-wst-1', at_round: 2, outage_s: 2}]}}\n",
        "network.emulation.schedule.1.link", "eu-wst-1"),
    "emulation_link": (
        BASE % "" + "network: {emulation: {links: {'us-east-1->mars-1': {latency_ms: 5}}}}\n",
        "network.emulation.links.us-east-1->mars-1", "mars-1"),
    "emulation_link_first_end": (
        BASE % "" + "network: {emulation: {links: {'mars-1<->us-east-1': {latency_ms: 5}}}}\n",
        "network.emulation.links.mars-1<->us-east-1", "mars-1"),
    "egress_price": (
        BASE % "" + "network: {egress: {usd_per_gb: {'us-east-1->mars-1': 0.01}}}\n",
        "network.egress.usd_per_gb.us-east-1->mars-1", "mars-1"),
    "head_region": (
        BASE % "" + "launch: {head_region: us-west-2}\n", "launch.head_region", "us-west-2"),
    "labels": (
        BASE % ", labels: {us-east-1: a, mars-1: b}", "regions.labels.mars-1", "mars-1"),
    "slowdown": (
        BASE % ", emulation: {slowdown: {mars-1: 2}}", "regions.emulation.slowdown.mars-1", "mars-1"),
    "availability_schedule": (
        BASE % ", emulation: {availability: {schedule: [{region: mars-1, from_round: 0, to_round: 1}]}}",
        "regions.emulation.availability.schedule.0.region", "mars-1"),
}


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "refs.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("name", sorted(CASES))
def test_validate_refuses_an_unknown_region_in_one_line(tmp_path, capsys, name):
    """Failed before with exit 0 ('ok') for the schedule, link, price and head-region cases, and
    with messages that did not list the known regions (or name the label's key) for the others."""
    text, key, unknown = CASES[name]
    path = _write(tmp_path, text)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"geofed: {path}: {key}: "), err
    assert f"{unknown!r} is not one of regions.names ({KNOWN})" in err, err


@pytest.mark.parametrize("name", sorted(CASES))
def test_load_config_raises_config_error_at_the_key(tmp_path, name):
    text, key, unknown = CASES[name]
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text))
    assert info.value.key == key
    assert unknown in info.value.message


def test_a_set_of_regions_names_is_checked_against_the_references(tmp_path, capsys):
    """--set regions.names that drops a region the file's schedule names is the same typo."""
    path = _write(tmp_path, BASE % "" + "network: {emulation: {schedule: [{link: 'ap-south-1->us-east-1', "
                                        "at_s: 5, outage_s: 2}]}}\n")
    assert main(["validate", str(path)]) == 0
    capsys.readouterr()
    assert main(["validate", str(path), "--set", "regions.names=[us-east-1, eu-west-1]"]) == 2
    err = capsys.readouterr().err
    assert "network.emulation.schedule.0.link: 'ap-south-1' is not one of regions.names (us-east-1, eu-west-1)" in err


def test_every_region_reference_that_is_right_validates(tmp_path, capsys):
    text = (BASE % ", labels: {eu-west-1: ireland}, emulation: {slowdown: {ap-south-1: 2}, availability: "
                   "{schedule: [{region: eu-west-1, from_round: 1, to_round: 1}]}}"
            + "network: {emulation: {links: {'us-east-1<->eu-west-1': {latency_ms: 5}}, schedule: "
              "[{link: '*', at_round: 1, set: {bandwidth_mbps: 10}}, {link: 'eu-west-1->ap-south-1', at_s: 1, outage_s: 1}]},"
              " egress: {usd_per_gb: {'us-east-1->ap-south-1': 0.02}}}\n"
              "launch: {head_region: eu-west-1}\n")
    path = _write(tmp_path, text)
    assert main(["validate", str(path)]) == 0, capsys.readouterr().err


def test_run_refuses_before_starting_anything(tmp_path, capsys):
    """`geofed run` loads the config the way validate does: exit 2 and no run directory, no Ray.
    Failed before: the run started Ray and the regions, then died in the emulator's set-up with a
    traceback (exit 1)."""
    text, key, unknown = CASES["emulation_schedule"]
    path = _write(tmp_path, text)
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path}: {key}: {unknown!r} is not one of regions.names" in err, err
    assert not out.exists()
