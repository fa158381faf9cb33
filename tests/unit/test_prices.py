"""Egress prices (p2p/wan/prices.yaml): the table loads, every figure has a source, bad files name the key."""

from __future__ import annotations

import pytest
import yaml

from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.config.strict import ConfigError
from geofed.orchestrator.driver.egress import add_egress
from geofed.orchestrator.plan.inputs import price_file
from geofed.p2p.wan.prices import GB, PROVIDERS, EgressConfig, EgressPricer, PriceError, load_prices, parse_prices
from geofed.p2p.wan.presets import load_preset


def test_every_provider_loads_and_every_figure_has_a_dated_source():
    tables = load_prices()
    assert set(tables) == set(PROVIDERS)
    for t in tables.values():
        prices = list(t.pairs.values()) + [r.price for r in t.rules]
        assert prices
        for p in prices:
            assert p.url.startswith("https://") and len(p.as_of) == 10 and 0 < p.usd_per_gb < 1


def test_aws_prices_every_pair_of_the_aws_preset_by_source_region():
    aws = load_prices()["aws"]
    for (a, b) in load_preset("aws").pairs:
        assert aws.price(a, b) is not None, (a, b)
    assert aws.price("us-east-1", "ap-southeast-2").usd_per_gb == 0.02   # priced by the source region
    assert aws.price("ap-southeast-2", "us-east-1").usd_per_gb == 0.098
    assert aws.price("us-east-2", "us-east-1").usd_per_gb == 0.01        # a pair exception, both ways
    assert aws.price("us-east-1", "mars-1") is None


def test_gcp_rules_tell_same_from_other_geography():
    gcp = load_prices()["gcp"]
    assert gcp.price("us-central1", "us-east1").usd_per_gb == 0.02
    assert gcp.price("us-central1", "europe-west4").usd_per_gb == 0.08
    assert gcp.price("asia-east1", "asia-northeast1").usd_per_gb == 0.05


def test_config_overrides_win_directed_over_both_ways_then_default():
    cfg = EgressConfig(usd_per_gb={"us-east-1<->eu-west-1": 0.5, "us-east-1->eu-west-1": 0.25}, default_usd_per_gb=0.3)
    p = EgressPricer(cfg)
    assert p.price("us-east-1", "eu-west-1").usd_per_gb == 0.25
    assert p.price("eu-west-1", "us-east-1").usd_per_gb == 0.5
    assert p.price("us-east-1", "mars-1").usd_per_gb == 0.3
    assert p.usd("eu-west-1", "us-east-1", 2 * GB) == pytest.approx(1.0)


@pytest.mark.parametrize("mutate, key", [
    (lambda d: d["aws"]["rules"][0].update(usd_per_gb="cheap"), "aws.rules.0.usd_per_gb"),
    (lambda d: d["aws"]["rules"][1].update(source="nowhere"), "aws.rules.1.source"),
    (lambda d: d["gcp"]["rules"][0].update(to="elsewhere"), "gcp.rules.0.to"),
    (lambda d: d["sources"]["gcp-vpc"].pop("as_of"), "sources.gcp-vpc.as_of"),
    (lambda d: d["aws"]["pairs"].update({"us-east-1<->us-east-1": {"usd_per_gb": 0.1, "source": "aws-ec2-dt"}}),
     "aws.pairs.us-east-1<->us-east-1"),
])
def test_a_malformed_price_file_names_the_key(tmp_path, mutate, key):
    data = yaml.safe_load((load_prices.__globals__["resources"].files("geofed.p2p.wan") / "prices.yaml").read_text())
    mutate(data)
    path = tmp_path / "prices.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(PriceError, match=f"{path}: {key}"):
        price_file(str(path))
    with pytest.raises(PriceError, match="prices.yaml: sources"):
        parse_prices({"aws": {}}, "prices.yaml")


def test_network_egress_in_a_run_config_is_strict():
    with pytest.raises(ConfigError, match="network.egress.usd_per_gb"):
        config_from_mapping({"task": {"kind": "mlp-digits"}, "network": {"egress": {"usd_per_gb": {"a-b": 0.1}}}})
    with pytest.raises(ConfigError, match="network.egress.provider"):
        config_from_mapping({"task": {"kind": "mlp-digits"}, "network": {"egress": {"provider": "oracle"}}})


def test_summary_egress_prices_the_transport_counts_per_directed_link():
    cfg = config_from_mapping({"task": {"kind": "mlp-digits"}, "regions": {"names": ["us-east-1", "ap-southeast-2"]},
                               "network": {"egress": {"usd_per_gb": {"us-east-1->ap-southeast-2": 1.0}}}})
    links = {"us-east-1->ap-southeast-2": {"bytes": 10, "transfers": 1}}
    stats = {"us-east-1": {"bytes_sent": {"ap-southeast-2": GB // 2}, "probe_bytes_sent": {"ap-southeast-2": GB // 2}},
             "ap-southeast-2": {"bytes_sent": {"us-east-1": GB}, "probe_bytes_sent": {}}}
    out = add_egress(cfg, links, stats)
    assert links["us-east-1->ap-southeast-2"]["egress_usd"] == pytest.approx(1.0)
    assert "ap-southeast-2->us-east-1" not in links                      # carried no update: priced apart
    assert out["egress"]["other_links"]["ap-southeast-2->us-east-1"]["egress_usd"] == pytest.approx(0.098)
    assert out["egress_usd"] == pytest.approx(1.098) and out["egress"]["unpriced_links"] == []


@pytest.mark.parametrize("text, words", [
    ("a: &x [1, 2]\nb: [*x, *x, *x]\n", "aliases"),             # a billion-laughs bomb starts this way
    ("aws: !!python/object/apply:os.system [true]\n", "tag"),
    ("[" * 3000 + "]" * 3000, "nested deeper"),                     # was a RecursionError traceback
    ("aws: {}\naws: {}\n", "duplicate key"),
])
def test_a_users_price_file_is_read_as_strictly_as_a_config(tmp_path, text, words):
    """`geofed plan --prices FILE` read the file with yaml.safe_load (aliases, any depth, the last
    duplicate key winning) and unbounded; it now goes through the config reader (issue 36: strict
    YAML everywhere, with a recursion guard)."""
    path = tmp_path / "prices.yaml"
    path.write_text(text)
    with pytest.raises(PriceError, match=words):
        price_file(str(path))


def test_a_price_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    import os

    path = tmp_path / "prices.yaml"
    os.mkfifo(path)
    with pytest.raises(PriceError, match="regular file|not a file|FIFO|fifo"):
        price_file(str(path))
