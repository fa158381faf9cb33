"""CodecSpec: every spelling parses to one typed value with one canonical key that reads back."""

import copy
import pickle
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from geofed.compression import CodecSpec, codec_names, make_codec, spec_key
from geofed.orchestrator.config import config_from_mapping, to_mapping
from geofed.orchestrator.config.strict import ConfigError

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
TOPK = "topk(fraction=0.01,inner=int8)"


@pytest.mark.parametrize("spelling", [
    TOPK,
    {"kind": "topk", "fraction": 0.01, "inner": "int8"},
    {"inner": {"kind": "int8"}, "kind": "topk", "fraction": 0.01},          # any key order, inner as a mapping
    {"kind": "topk", "inner": "int8"},                                      # fraction at its default
    "  topk( fraction = 0.01 , inner = int8 )",                             # spaces around tokens
    "topk(inner=int8(chunk=4096,stochastic=False),fraction=1e-2)",          # a full inner, any order, 1e-2
    make_codec({"kind": "topk", "inner": "int8"}),                          # a Codec
])
def test_every_spelling_of_one_codec_is_one_spec(spelling):
    spec = CodecSpec.parse(spelling)
    assert spec.key == TOPK and str(spec) == TOPK
    assert spec == CodecSpec.parse(TOPK) and hash(spec) == hash(CodecSpec.parse(TOPK))
    assert spec.kind == "topk" and dict(spec.params)["inner"] == CodecSpec.parse("int8")
    assert make_codec(spec) == make_codec({"kind": "topk", "fraction": 0.01, "inner": "int8"})
    assert CodecSpec.parse(spec) is spec


@pytest.mark.parametrize("spelling, key", [
    ("int8", "int8"),
    ({"kind": "int8"}, "int8"),
    ({"kind": "int8", "chunk": 4096}, "int8"),                               # defaults written out: the same codec
    ({"kind": "int8", "stochastic": True}, "int8(chunk=4096,stochastic=True)"),
    ("int8(stochastic=true)", "int8(chunk=4096,stochastic=True)"),          # YAML's booleans too
    ({"kind": "topk", "fraction": 1}, "topk(fraction=1.0,inner=fp16)"),      # a YAML int for a float
    ({"kind": "topk", "fraction": 0.001, "inner": {"kind": "int8", "chunk": 256}},
     "topk(fraction=0.001,inner=int8(chunk=256,stochastic=False))"),
    ({"kind": "powersgd", "rank": 8}, "powersgd(rank=8)"),
])
def test_the_key_is_the_kind_alone_or_every_parameter_sorted(spelling, key):
    spec = CodecSpec.parse(spelling)
    assert spec.key == key and spec_key(spelling) == key and make_codec(spec).name == key
    assert CodecSpec.parse(key) == spec and CodecSpec.parse(spec.to_data()) == spec


def test_every_registered_codec_round_trips_by_name_key_data_and_codec():
    for name in codec_names():
        spec = CodecSpec.parse(name)
        assert spec.key == name and spec.to_data() == name and spec == CodecSpec(kind=name)
        assert CodecSpec.of(make_codec(spec)) == spec and make_codec(spec) == make_codec(name)


@given(st.sampled_from(["topk", "randomk"]), st.floats(1e-6, 1.0, allow_nan=False), st.sampled_from(
    [None, "fp16", "int4", {"kind": "int8", "chunk": 64}, {"kind": "int4", "stochastic": True}, "sign"]))
def test_any_valid_spec_reads_back_from_its_key(kind, fraction, inner):
    data = {"kind": kind, "fraction": fraction, **({} if inner is None else {"inner": inner})}
    spec = CodecSpec.parse(data)
    again = CodecSpec.parse(spec.key)
    assert again == spec and again.key == spec.key and hash(again) == hash(spec)
    assert make_codec(again) == make_codec(data)


def test_specs_are_values_that_pickle_copy_and_key_dicts():
    a, b = CodecSpec.parse("int8"), CodecSpec.parse({"kind": "int8"})
    c = CodecSpec.parse({"kind": "int8", "chunk": 1024})
    assert a == b and a != c and len({a, b, c}) == 2 and {a: 1}[b] == 1
    assert a != "int8"  # a spec is not its key: code compares specs, or keys
    for spec in (a, c, CodecSpec.parse(TOPK)):
        for twin in (pickle.loads(pickle.dumps(spec)), copy.deepcopy(spec)):
            assert twin == spec and twin.key == spec.key and twin.to_data() == spec.to_data()
    with pytest.raises(AttributeError):
        a.kind = "fp16"
    assert repr(c) == "CodecSpec.parse('int8(chunk=1024,stochastic=False)')"


@pytest.mark.parametrize("bad, message", [
    ("zstd", "kind: unknown codec 'zstd' (known: bf16, fp16"),
    ({"fraction": 0.1}, "kind: missing"),
    ({"kind": "topk", "fraction": 2}, "fraction: must be in (0, 1], got 2.0"),
    ("topk(fraction=2)", "fraction: must be in (0, 1], got 2.0"),
    ({"kind": "int8", "chunks": 64}, "chunks: unknown parameter of codec 'int8' (known: chunk, stochastic)"),
    ("int8(chunk=abc)", "chunk: must be an integer, got 'abc'"),
    ({"kind": "topk", "inner": "zip"}, "inner.kind: unknown codec 'zip'"),
    ("topk(inner=topk)", "inner: 'topk' cannot be the inner codec of 'topk'"),
    ("topk(fraction=0.1,fraction=0.2)", "fraction: given twice"),
    ("topk(", "cannot read 'topk(': expected a parameter name at the end"),
    ("topk(fraction=)", "cannot read 'topk(fraction=)': expected a codec kind, got ')'"),
    ("topk(fraction=0.1))", "unexpected ')' after the spec"),
    ("topk(fraction 0.1)", "expected '=', got '0.1'"),
    ("int8; rm -rf", "kind: unknown codec 'int8; rm -rf'"),
    ("topk(fraction=0.1;x=1)", "cannot read 'topk(fraction=0.1;x=1)' at character 18"),
    ("x" * 2000, "a codec spec of 2000 characters, at most 1024"),
    (3, "expected a codec name, a mapping with 'kind' or a key"),
    (None, "expected a codec name"),
])
def test_a_bad_spec_is_a_value_error_naming_the_problem(bad, message):
    with pytest.raises(ValueError) as exc:
        CodecSpec.parse(bad)
    assert message in str(exc.value)


def test_building_a_spec_directly_validates_and_fills_in_the_defaults():
    assert CodecSpec(kind="topk", params={"inner": "int8"}).key == TOPK
    assert CodecSpec(kind="topk", params=(("inner", CodecSpec.parse("int8")),)) == CodecSpec.parse(TOPK)
    with pytest.raises(ValueError, match="fraction: must be in"):
        CodecSpec(kind="topk", params={"fraction": 0.0})
    with pytest.raises(ValueError, match="params: 'kind' is the spec's kind"):
        CodecSpec(kind="topk", params={"kind": "int8"})


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_keep_the_keys_their_runs_already_show(path):
    # rounds.jsonl / summary.json of existing run directories name these codecs this way.
    known = {"fp16", "int8", "int4", "int3", "topk(fraction=0.05,inner=int8)", "topk(fraction=0.01,inner=int8)"}
    c = yaml.safe_load(path.read_text()).get("compression", {})
    for spelling in [c.get("codec", "fp16"), *c.get("ladder", [])]:
        assert spec_key(spelling) in known


BASE = {"task": {"kind": "mlp-digits"}, "network": {"emulation": {"mode": "none"}}}


def test_the_config_parses_every_spelling_once_into_specs_and_writes_them_back():
    cfg = config_from_mapping({**BASE, "compression": {
        "codec": {"kind": "topk", "inner": "int8"},
        "ladder": ["int8", TOPK, {"kind": "topk", "fraction": 0.001, "inner": "int8"}]}})
    c = cfg.compression
    assert isinstance(c.codec, CodecSpec) and all(isinstance(s, CodecSpec) for s in c.ladder)
    assert c.codec == c.ladder[1] and [s.key for s in c.ladder] == ["int8", TOPK, "topk(fraction=0.001,inner=int8)"]
    written = to_mapping(cfg)["compression"]
    assert written["codec"] == {"kind": "topk", "fraction": 0.01, "inner": "int8"} and written["ladder"][0] == "int8"
    assert config_from_mapping(yaml.safe_load(yaml.safe_dump(to_mapping(cfg)))) == cfg
    assert config_from_mapping(BASE).compression.codec == CodecSpec.parse("fp16")


@pytest.mark.parametrize("compression, message", [
    ({"codec": "zip"}, "compression.codec: kind: unknown codec 'zip' (known: bf16, fp16"),
    ({"codec": {"kind": "topk", "fraction": 3}}, "compression.codec: fraction: must be in (0, 1], got 3.0"),
    ({"ladder": ["int8", "topk(fraction=0)"]}, "compression.ladder.1: fraction: must be in (0, 1], got 0.0"),
    ({"ladder": ["int8", "topk(fraction"]}, "compression.ladder.1: cannot read 'topk(fraction': expected '='"),
    ({"codec": ["int8"]}, "compression.codec: expected a codec name"),
])
def test_config_errors_name_the_dotted_key(compression, message):
    with pytest.raises(ConfigError) as exc:
        config_from_mapping({**BASE, "compression": compression}, source="x.yaml")
    assert str(exc.value).startswith(f"x.yaml: {message}")


def test_code_that_builds_a_section_must_pass_specs():
    from geofed.orchestrator.config import CompressionSection

    with pytest.raises(TypeError, match="codec: expected a CodecSpec"):
        CompressionSection(codec="int8")
