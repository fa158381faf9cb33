"""Issue 15, findings 8, 9 and 10: the config loader. A config (or a run directory's
config.yaml) is a regular file read with its size checked first; duplicate keys, integers too
wide to convert and every other malformed YAML is one ConfigError naming the key and the line,
never another exception. The CLI's exit code 2 for the same inputs: tests/e2e/test_hostile_configs.py."""

from __future__ import annotations

import os

import pytest
from hostile_files import call_bounded
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geofed.orchestrator.config import RunConfig, config_from_mapping, load_config
from geofed.orchestrator.driver.resume import resume_config
from geofed.orchestrator.config.strict import MAX_CONFIG_BYTES, ConfigError, apply_override, parse_yaml

pytestmark = pytest.mark.timeout(300)

BASE = "task: {kind: mlp-digits}\nnetwork: {emulation: {mode: none}}\n"
WIDE = "9" * 5000


def _refused(text: str | bytes, *overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as exc:
        config_from_mapping(parse_yaml(text, source="c.yaml"), list(overrides), source="c.yaml")
    assert "\n" not in str(exc.value), str(exc.value)
    return exc.value


# -- finding 10: duplicate keys ----------------------------------------------------------------------

def test_a_second_security_section_cannot_turn_tls_off(tmp_path):
    """The issue's case: the second `security: {tls: false}` won, and validate passed."""
    path = tmp_path / "c.yaml"
    path.write_text(BASE + "security: {tls: true}\nsecurity: {tls: false}\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert str(exc.value) == (f"{path}: security: line 4: duplicate key (first on line 3); "
                              "YAML would silently keep only the last")


@pytest.mark.parametrize("text, key, line", [
    ("run: {rounds: 1, rounds: 2}\n", "run.rounds", 1),
    ("run:\n  rounds: 1\n  seed: 2\n  rounds: 3\n", "run.rounds", 4),
    ("network:\n  emulation:\n    links:\n      a->b: {latency_ms: 1}\n      a->b: {latency_ms: 900}\n",
     "network.emulation.links.a->b", 5),
    ("regions: {names: [a, b], labels: {a: x, 'a': y}}\n", "regions.labels.a", 1),
    ("task: {kind: 'python:m:f', options: {n: 1, n: 2}}\n", "task.options.n", 1),
    ("sync:\n  policy: [{H: 1, H: 2}]\n", "sync.policy.0.H", 2),
])
def test_duplicate_keys_name_the_dotted_key_and_the_line(text, key, line):
    with pytest.raises(ConfigError) as exc:
        parse_yaml(text, source="c.yaml")
    assert exc.value.key == key and exc.value.message.startswith(f"line {line}: duplicate key (first on line ")


def test_duplicate_keys_in_a_set_value_are_refused_too():
    err = _refused(BASE, "sync.policy={kind: fixed, H: 5, H: 500}")
    assert str(err) == "c.yaml: sync.policy.H: --set: duplicate key (first on line 1); YAML would silently keep only the last"


# -- finding 9: integers too wide to convert ---------------------------------------------------------

@pytest.mark.parametrize("text, key", [
    (BASE + f"run: {{rounds: {WIDE}}}\n", "run.rounds"),
    (BASE + f"sync: {{policy: {{kind: fixed, H: -{WIDE}}}}}\n", "sync.policy.H"),
    (BASE + f"regions: {{names: [a, {WIDE}]}}\n", "regions.names.1"),
    (f"task: {{kind: 'python:m:f', options: {{n: 0x{'f' * 5000}}}}}\n", "task.options.n"),
    (f"run: {{seed: {'1_' * 40}1}}\n", "run.seed"),
])
def test_integers_past_a_sane_width_name_the_key(text, key):
    with pytest.raises(ConfigError) as exc:
        parse_yaml(text, source="c.yaml")
    assert exc.value.key == key and "digits; at most 32 are accepted" in exc.value.message


def test_a_wide_integer_in_set_names_the_key():
    assert str(_refused(BASE, f"run.rounds={WIDE}")) == "c.yaml: run.rounds: --set: an integer of 5000 digits; at most 32 are accepted"
    # A list index past any list: was int() of 5000 digits, or of '²' (isdigit() is true of it).
    for index in (WIDE, "²"):
        assert "list index" in str(_refused(BASE + "regions: {names: [a, b]}\n", f"regions.names.{index}=c"))


def test_integers_of_sane_width_still_load():
    cfg = config_from_mapping(parse_yaml(BASE + "run: {seed: 4294967295, max_steps: 0x10}\n", source="c"), source="c")
    assert cfg.run.seed == 2**32 - 1 and cfg.run.max_steps == 16
    assert "run.seed: must be in [0, 2**32)" in str(_refused(BASE + f"run: {{seed: {'9' * 32}}}\n"))


# -- finding 10, the rest: malformed YAML is one line, never a traceback ----------------------------

MALFORMED = {
    # name: (text, key, phrase)
    "bad_date": ("a: 2001-13-45\nb: !!timestamp x\n", "b", "tag !!timestamp is not allowed"),
    "int_tag_on_text": ("a: !!int abc\n", "a", "'abc' is not a valid int"),
    "bool_tag_on_text": ("a: !!bool abc\n", "a", "'abc' is not a valid bool"),
    "float_tag_on_text": ("a: !!float abc\n", "a", "'abc' is not a valid float"),
    "float_tag_empty": ("a: [!!float ]\n", "a.0", "'' is not a valid float"),
    "int_tag_empty": ("a: {b: !!int }\n", "a.b", "'' is not a valid int"),
    "binary": ("a: !!binary AAAA\n", "a", "tag !!binary is not allowed"),
    "set": ("a: !!set {x, y}\n", "a", "tag !!set is not allowed"),
    "omap": ("a: !!omap [x: 1]\n", "a", "tag !!omap is not allowed"),
    "python_object": ("run: !!python/object:os.system {}\n", "run", "tag !!python/object:os.system is not allowed"),
    "local_tag": ("run: {name: !secret x}\n", "run.name", "tag !secret is not allowed"),
    "inline_merge": ("run: {<<: {rounds: 5}, report: false}\n", "run", "YAML merge keys (<<) are not allowed"),
    "int_key": ("run: {1: x}\n", "run", "key '1' reads as int; keys must be strings (quote it)"),
    "bool_key": ("regions: {labels: {on: x}}\n", "regions.labels", "key 'on' reads as bool"),
    "null_key": ("~: 1\n", "", "key '~' reads as null"),
    "list_key": ("? [a, b]\n: 1\n", "", "a list as a key; keys must be strings"),
    "mapping_key": ("{a: 1}: 2\n", "", "a mapping as a key"),
    "alias": ("a: &x 1\nb: *x\n", "", "YAML aliases (*x) are not allowed"),
    "deep": ("a: " + "[" * 3000 + "]" * 3000 + "\n", "", "nested deeper than 64 levels"),
    "invalid_utf8": (b"run: {name: \xff\xfe}\n", "", "invalid YAML"),
    "nul_bytes": (b"run: \x00\x01\x02\n", "", "invalid YAML"),
    "garbage": (bytes(range(256)) * 4, "", "invalid YAML"),
    "utf16_without_bom": ("run: {}\n".encode("utf-16-le"), "", "invalid YAML"),
    "tabs_and_junk": ("run:\n\t- ]]: [\n", "", "invalid YAML"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_yaml_is_one_config_error_naming_key_and_line(case):
    text, key, phrase = MALFORMED[case]
    with pytest.raises(ConfigError) as exc:
        parse_yaml(text, source="c.yaml")
    assert exc.value.key == key and phrase in exc.value.message, str(exc.value)
    assert "\n" not in str(exc.value) and str(exc.value).startswith("c.yaml: ")


def test_dates_are_plain_strings_not_crashes():
    # YAML 1.1 made 2001-13-45 a datetime (a ValueError); configs hold no dates.
    assert parse_yaml("a: 2001-13-45\nb: 2024-01-01\n", source="c") == {"a": "2001-13-45", "b": "2024-01-01"}


def test_a_key_holding_a_newline_stays_on_one_line():
    err = _refused(BASE + '"evil\\nkey: fake message": 1\n')
    assert str(err).startswith("c.yaml: evil\\nkey: fake message: unknown key"), str(err)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(
    st.binary(max_size=400),
    st.lists(st.sampled_from([
        "run", "task", "kind", "rounds", "mlp-digits", "a", ":", ": ", " ", "\n", "  ", "- ", "[", "]", "{", "}", ", ",
        "&x ", "*x", "!!int ", "!!float ", "!!bool ", "!!str ", "!!binary ", "!!timestamp ", "!!set ", "!!python/name:os.system ",
        "!x ", "<<: ", "? ", "'", '"', "#", "|", ">", "1", "9" * 40, "0x", "0o", "1:2", ".inf", ".nan", "~", "yes",
        "2001-13-45", "\t", "\x00", "\xff", "\ufeff", "\u2028", "\r", "%YAML 1.1\n", "---\n", "...\n", "=", "\\"]),
        max_size=50).map("".join)))
def test_any_input_is_a_config_or_one_config_error(data):
    """Fuzz: whatever the bytes, the loader and the builder return a config or raise a one-line
    ConfigError, never another exception."""
    try:
        cfg = config_from_mapping(parse_yaml(data, source="f.yaml"), source="f.yaml")
    except ConfigError as exc:
        assert "\n" not in str(exc)
    else:
        assert isinstance(cfg, RunConfig)


# -- finding 8: the config file is a regular file of at most 1 MiB ------------------------------------

def test_a_fifo_config_is_refused_instead_of_hanging(tmp_path):
    fifo = tmp_path / "c.yaml"
    os.mkfifo(fifo)
    error = call_bounded(lambda: load_config(fifo), fifo)
    assert isinstance(error, ConfigError) and str(error) == f"{fifo}: is a FIFO (named pipe), not a regular file"


def test_a_device_or_directory_config_is_refused_unread(tmp_path):
    from geofed.orchestrator.config.strict import read_config_bytes  # new with the fix

    for path, kind in (("/dev/zero", "a character device"), ("/dev/null", "a character device"), (tmp_path, "a directory")):
        with pytest.raises(ConfigError, match=f"is {kind}, not a regular file"):
            read_config_bytes(path)


def test_an_oversized_config_is_refused_by_its_size_before_it_is_read(tmp_path):
    sparse = tmp_path / "c.yaml"
    with open(sparse, "wb") as f:
        f.truncate(8 << 30)  # 8 GiB: reading it whole is what made the MemoryError
    with pytest.raises(ConfigError) as exc:
        load_config(sparse)
    assert str(exc.value) == f"{sparse}: file is {8 << 30} bytes; configs are limited to {MAX_CONFIG_BYTES}"


def test_a_resumed_runs_config_yaml_is_read_the_same_way(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    fifo = run_dir / "config.yaml"
    os.mkfifo(fifo)
    error = call_bounded(lambda: resume_config(run_dir, []), fifo)
    assert isinstance(error, ConfigError) and "config.yaml: is a FIFO (named pipe), not a regular file" in str(error)
    fifo.unlink()
    fifo.symlink_to("/dev/zero")
    with pytest.raises(ConfigError, match="config.yaml: is a character device, not a regular file"):
        resume_config(run_dir, [])


def test_apply_override_keeps_non_yaml_text_as_a_string():
    data: dict = {}
    apply_override(data, "run.name=foo: bar: baz")
    assert data == {"run": {"name": "foo: bar: baz"}}
