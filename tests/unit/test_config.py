"""The strict config loader: good configs load, every kind of bad input is one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest

from geofed.orchestrator.cli import main
from geofed.orchestrator.config import RunConfig, config_from_mapping, default_config_path, load_config
from geofed.orchestrator.config.strict import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_there_are_configs():
    assert any(p.name == "local-wan.yaml" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    assert cfg.run.rounds >= 1 and len(cfg.regions.names) >= 1


def test_embedded_default_is_the_shipped_local_wan():
    assert default_config_path().read_bytes() == (ROOT / "configs" / "local-wan.yaml").read_bytes()
    cfg = load_config()
    assert cfg.run.name == "local-wan" and len(cfg.regions.names) == 4


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "x.yaml"
    p.write_text(text)
    return p


def _err(tmp_path, text, *overrides) -> str:
    p = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(p, list(overrides))
    msg = str(info.value)
    assert msg.startswith(f"{p}: "), msg
    assert "\n" not in msg
    return msg[len(str(p)) + 2:]


BASE = "task: {kind: mlp-digits}\n"


@pytest.mark.parametrize("text, expected", [
    (BASE + "sync: {policy: {kind: adaptve}}", "sync.policy.kind: unknown policy 'adaptve' (known: adacomm, bandwidth, fixed)"),
    (BASE + "run: {rounds: 0}", "run.rounds: must be in [1, 10000000], got 0"),
    (BASE + "run: {rounds: ten}", "run.rounds: expected an integer, got 'ten'"),
    (BASE + "run: {roundz: 3}", "run.roundz: unknown key"),
    (BASE + "sync: {topology: donut}", "sync.topology: unknown topology 'donut'"),
    (BASE + "compression: {codec: zip}", "compression.codec: kind: unknown codec 'zip' (known: bf16, fp16, identity"),
    ("task: {kind: resnet}", "task.kind: unknown task 'resnet'"),
    ("run: {rounds: 3}", "task: required key is missing"),
    (BASE + "sync: {algorithm: ps}", "sync.algorithm: unknown value 'ps' (known: diloco, allreduce, gossip)"),
    (BASE + "security: {tls: yes please}", "security.tls: expected true/false"),
    (BASE + "regions: {names: [a, a]}", "regions.names: region names must be unique"),
    (BASE + "network: {emulation: {default: {bandwidth_mbps: -5}}}", "network.emulation.default.bandwidth_mbps: must be >= 0"),
    (BASE + "sync: {inner: {lr: .nan}}", "sync.inner.lr: expected a number, got NaN"),
    (BASE + "task: {kind: mlp-digits, hidden: 0}", None),
])
def test_bad_values_name_the_dotted_key(tmp_path, text, expected):
    if expected is None:  # duplicate key `task`: YAML itself is ambiguous -> any clear error
        p = _write(tmp_path, text)
        with pytest.raises(ConfigError):
            load_config(p)
        return
    msg = _err(tmp_path, text)
    assert msg.startswith(expected) or expected in msg, msg


def test_absurd_region_count_is_refused_without_building_it(tmp_path):
    msg = _err(tmp_path, BASE + "regions: {names: [" + ", ".join(f"r{i}" for i in range(300)) + "]}")
    assert msg.startswith("regions.names: need 1..256 regions, got 300")


def test_yaml_that_is_not_a_mapping(tmp_path):
    assert _err(tmp_path, "- a\n- b\n").startswith("top level must be a mapping")


def test_broken_yaml_names_the_line(tmp_path):
    assert "line 3: invalid YAML" in _err(tmp_path, "run:\n  rounds: 3\n bad: [\n")


def test_alias_bomb_is_refused(tmp_path):
    bomb = 'a: &a ["x","x","x","x","x","x","x","x","x"]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n'
    assert "aliases" in _err(tmp_path, bomb)


def test_huge_file_is_refused(tmp_path):
    assert "configs are limited to" in _err(tmp_path, "# " + "x" * (2 << 20))


def test_overrides_apply_and_are_validated(tmp_path):
    p = _write(tmp_path, BASE)
    cfg = load_config(p, ["run.rounds=2", "sync.policy.H=7", "network.emulation.mode=none"])
    assert cfg.run.rounds == 2 and cfg.sync.policy.H == 7 and cfg.network.emulation.mode == "none"
    with pytest.raises(ConfigError, match=r"sync\.policy\.H: must be in"):
        load_config(p, ["sync.policy.H=0"])
    with pytest.raises(ConfigError, match="expected KEY.PATH=VALUE"):
        load_config(p, ["run.rounds"])


def test_list_overrides_by_index(tmp_path):
    p = _write(tmp_path, BASE + "regions: {names: [a, b]}\n")
    assert load_config(p, ["regions.names.1=c"]).regions.names == ("a", "c")
    with pytest.raises(ConfigError, match="out of range"):
        load_config(p, ["regions.names.5=c"])


def test_scientific_notation_reads_as_a_float():
    cfg = config_from_mapping({"task": {"kind": "mlp-digits"}, "sync": {"inner": {"lr": "1e-3"}}})
    assert cfg.sync.inner.lr == pytest.approx(1e-3)


def test_config_is_frozen():
    cfg = config_from_mapping({"task": {"kind": "mlp-digits"}})
    with pytest.raises(AttributeError):
        cfg.run.rounds = 5  # type: ignore[misc]


def test_cli_validate_exit_codes(tmp_path, capsys):
    good = _write(tmp_path, BASE)
    assert main(["validate", str(good)]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(BASE + "sync: {policy: {kind: adaptve}}\n")
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"geofed: {bad}: sync.policy.kind: unknown policy 'adaptve' (known: adacomm, bandwidth, fixed)"]


def test_cli_missing_file_and_bad_arguments(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read config" in capsys.readouterr().err
    assert main(["frobnicate"]) == 2


def test_config_docs_are_current():
    from geofed.orchestrator.config.docs import config_docs_markdown

    doc = ROOT / "docs" / "CONFIG.md"
    assert doc.read_text() == config_docs_markdown(), "docs/CONFIG.md is stale: run `geofed config-docs > docs/CONFIG.md`"
