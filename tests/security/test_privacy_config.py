"""Issue 22's config keys: security.secure_aggregation refuses codecs that leak or do not sum
(top-k above all), naming both keys, with exit 2 from the CLI; privacy.dp validates its budget."""

from __future__ import annotations

import pytest

from geofed.orchestrator.cli import main
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.config.strict import ConfigError, parse_yaml

BASE = "task: {kind: mlp-digits}\nnetwork: {emulation: {mode: none}}\n"
SECAGG = BASE + "security: {secure_aggregation: true}\n"


def _load(text: str, *overrides: str):
    return config_from_mapping(parse_yaml(text, source="c.yaml"), list(overrides), source="c.yaml")


def _refused(text: str, *overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as exc:
        _load(text, *overrides)
    assert "\n" not in str(exc.value)
    return exc.value


def test_secure_aggregation_with_int8_loads():
    cfg = _load(SECAGG + "compression: {codec: int8}\n")
    assert cfg.security.secure_aggregation and cfg.security.secagg_bits == 32
    assert _load(SECAGG + "compression: {codec: {kind: randomk, fraction: 0.1, inner: int8}}\n")


@pytest.mark.parametrize("codec, key", [
    ("topk", "compression.codec"),
    ("{kind: topk, fraction: 0.05, inner: int8}", "compression.codec"),
    ("sign", "compression.codec"),
    ("powersgd", "compression.codec"),
])
def test_codecs_that_leak_or_do_not_sum_are_refused_naming_both_keys(codec, key):
    err = _refused(SECAGG + f"compression: {{codec: {codec}}}\n")
    assert err.key == key and "security.secure_aggregation" in err.message


def test_a_topk_rung_of_the_ladder_is_refused_by_its_key():
    err = _refused(SECAGG + "compression: {codec: int8, ladder: [int8, topk]}\n")
    assert err.key == "compression.ladder.1" and "top-k sends the indices" in err.message


@pytest.mark.parametrize("extra, key", [
    ("sync: {topology: ring}\n", "security.secure_aggregation"),
    ("sync: {algorithm: gossip, gossip: {choco: false}}\n", "security.secure_aggregation"),
    ("regions: {names: [a, b]}\n", "security.secure_aggregation"),
    ("compression: {codec: int8, ladder: [int8, int4]}\n", "compression.ladder"),
])
def test_secure_aggregation_needs_full_diloco_three_regions_and_one_codec(extra, key):
    text = SECAGG.replace("security: {secure_aggregation: true}\n", "") + extra
    assert _refused(text, "security.secure_aggregation=true").key == key


def test_secure_aggregation_needs_tls_and_refuses_per_peer_robust_mixes():
    assert "security.tls" in _refused(SECAGG, "security.tls=false").message
    assert _refused(SECAGG, "security.robust_aggregation=median").key == "security.robust_aggregation"
    assert _refused(SECAGG, "security.secagg_bits=12").key == "security.secagg_bits"
    assert _load(SECAGG, "security.secagg_bits=8").security.secagg_bits == 8


def test_the_retired_secagg_threshold_is_refused_not_ignored():
    """security.secagg_threshold configured the per-round Shamir protocol that was deleted (1e08a3a);
    a value was then accepted and did nothing. It is refused naming the key and why; null still loads."""
    for text in (SECAGG, BASE):
        err = _refused(text, "security.secagg_threshold=3")
        assert err.key == "security.secagg_threshold" and "retired" in err.message
    assert _load(SECAGG, "security.secagg_threshold=null").security.secagg_threshold is None


@pytest.mark.parametrize("override, key", [
    ("sync.overlap=true", "sync.overlap"),
    ("sync.overlap=eager", "sync.overlap"),
    ("sync.pacing.mode=quorum", "sync.pacing.mode"),
])
def test_secure_aggregation_refuses_overlap_and_quorum_rounds(override, key):
    err = _refused(SECAGG, override)
    assert err.key == key and "security.secure_aggregation" in err.message


def test_a_mid_round_drop_needs_secure_aggregation():
    drop = "regions: {emulation: {availability: {mid_round: true, absent_p: 0.1}}}\n"
    assert _refused(BASE + drop).key == "regions.emulation.availability.mid_round"
    assert _load(SECAGG + drop).regions.emulation.availability.mid_round


@pytest.mark.parametrize("command", ["validate", "run"])
def test_topk_with_secure_aggregation_exits_2_naming_both_keys(tmp_path, monkeypatch, capsys, command):
    path = tmp_path / "bad.yaml"
    path.write_text(SECAGG + "compression: {codec: topk}\n")
    monkeypatch.chdir(tmp_path)
    argv = [command, str(path)] + (["--quiet", "--no-report"] if command == "run" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"geofed: {path}: compression.codec: topk "), err
    assert "security.secure_aggregation" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]  # nothing started, nothing written


def test_dp_sections():
    cfg = _load(BASE + "privacy: {dp: {mode: record, target_epsilon: 8, delta: 1e-5}}\n")
    assert cfg.privacy.dp.mode == "record" and cfg.privacy.dp.noise_multiplier is None
    assert _load(BASE).privacy.dp.mode == "off"
    assert _refused(BASE + "privacy: {dp: {mode: update}}\n").key == "privacy.dp.noise_multiplier"
    assert _refused(BASE + "privacy: {dp: {mode: fuzzy}}\n").key == "privacy.dp.mode"
    assert _refused(BASE + "privacy: {dp: {delta: 0.5}}\n").key == "privacy.dp.delta"
    assert _refused(BASE + "privacy: {dp: {clip: 0}}\n").key == "privacy.dp.clip"
    assert _refused(BASE + "privacy: {dp: {on_target: ignore}}\n").key == "privacy.dp.on_target"
    assert _refused(BASE + "privacy: {dp: {eps: 1}}\n").key == "privacy.dp.eps"


@pytest.mark.usefixtures("cora_npz")  # the graph config names cora, which the config checks first
def test_dp_modes_refuse_what_they_cannot_protect():
    graph = "task: {kind: gcn-planetoid}\nnetwork: {emulation: {mode: none}}\n"
    err = _refused(graph + "privacy: {dp: {mode: record, noise_multiplier: 1.0}}\n")
    assert err.key == "privacy.dp.mode" and "graph" in err.message
    assert _load(graph + "privacy: {dp: {mode: update, noise_multiplier: 1.0}}\n")
    err = _refused(BASE + "sync: {algorithm: allreduce}\nprivacy: {dp: {mode: update, noise_multiplier: 1.0}}\n")
    assert err.key == "privacy.dp.mode"
