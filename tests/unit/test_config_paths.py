"""Issue 37, item 6: paths in a config and `--set` overrides.

* A relative path in a config file names a file beside the config (as docker-compose and most
  tools read one), whatever the working directory; a path given with `--set` comes from the
  command line and names one from the working directory. Both are absolute once loaded, so the
  run directory's config.yaml names the same files from anywhere. run.out_dir stays relative to
  the working directory (docs/CONFIG.md says why).
* `--set SECTION.kind=NEW` switches a discriminated section (a task, a policy, a codec): the
  file's keys for the old kind go, the new kind's defaults apply, and keys set on the same command
  line still apply.

Real YAML files in temporary folders, the real loader and the real CLI (`main(argv)`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from geofed.orchestrator.cli import main
from geofed.orchestrator.config import config_from_mapping, load_config, to_mapping
from geofed.orchestrator.config.strict import ConfigError
from geofed.orchestrator.policies.config import BandwidthPolicyConfig, FixedPolicyConfig

ROOT = Path(__file__).resolve().parents[2]
LOCAL_WAN = ROOT / "configs" / "local-wan.yaml"
TEXT = "To be, or not to be, that is the question.\n" * 40  # char-lm needs at least 1000 characters


@pytest.fixture
def layout(tmp_path, monkeypatch):
    """conf/ holds the config and its data; the working directory is work/, elsewhere."""
    conf, work = tmp_path / "conf", tmp_path / "work"
    (conf / "data").mkdir(parents=True)
    work.mkdir()
    (conf / "data" / "text.txt").write_text(TEXT)
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "path", list(sys.path))  # a plug-in's folder goes on sys.path
    return conf, work


def _config(conf: Path, text: str) -> Path:
    path = conf / "run.yaml"
    path.write_text(text)
    return path


# ---- paths -------------------------------------------------------------------------------


def test_task_path_resolves_against_the_config_files_folder(layout, capsys):
    """Failed before: task.path stayed 'data/text.txt' and the run looked for it in the working
    directory (the task failed to build: no such file)."""
    conf, work = layout
    path = _config(conf, "task: {kind: char-lm, path: data/text.txt}\n")
    cfg = load_config(path)
    assert cfg.task.path == str(conf / "data" / "text.txt")
    assert main(["validate", str(path)]) == 0, capsys.readouterr().err
    from geofed.orchestrator.driver.run import prepare_task

    assert prepare_task(cfg, source=str(path)).task.path == str(conf / "data" / "text.txt")  # the task builds


def test_a_config_given_by_a_relative_name_resolves_from_its_folder(layout):
    conf, work = layout
    _config(conf, "task: {kind: gcn-planetoid, path: ../conf/data/graph.npz}\n")
    cfg = load_config(Path("..") / "conf" / "run.yaml")
    assert cfg.task.path == str(conf / "data" / "graph.npz")  # '..' taken lexically, as docker-compose does


def test_every_local_file_key_of_the_tasks_resolves_from_the_config(layout):
    """gpt's tokenizer, hf-causal-lm's config and tokenizer: files the driver reads, beside the
    config. Failed before: hf-causal-lm refused its own config file ('no transformers config.json
    at 'model/config.json'') because it looked in the working directory."""
    conf, work = layout
    (conf / "tok.json").write_text("{}")
    (conf / "model").mkdir()
    (conf / "model" / "config.json").write_text("{}")
    gpt = load_config(_config(conf, "task: {kind: gpt, path: data/text.txt, tokenizer: tok.json}\n"))
    assert (gpt.task.path, gpt.task.tokenizer) == (str(conf / "data" / "text.txt"), str(conf / "tok.json"))
    pytest.importorskip("transformers", reason="hf-causal-lm needs transformers (pip install 'geofed[hf]')")
    hf = load_config(_config(conf, "task: {kind: hf-causal-lm, path: data/text.txt, config: model, tokenizer: tok.json}\n"))
    assert (hf.task.config, hf.task.tokenizer) == (str(conf / "model"), str(conf / "tok.json"))


def test_a_plugin_folder_beside_the_config_is_importable(layout, capsys):
    """A plug-in task's `path` (the folder put on sys.path) is the config's neighbour too.
    Failed before: validate could not import the module (exit 2, 'cannot import')."""
    conf, work = layout
    (conf / "plugins").mkdir()
    (conf / "plugins" / "issue37_paths_plugin.py").write_text(
        "from geofed.regions.tasks import task_factory\n\n@task_factory\ndef make(**options):\n    raise AssertionError\n")
    path = _config(conf, "task: {kind: 'python:issue37_paths_plugin:make', path: plugins}\n")
    try:
        assert main(["validate", str(path)]) == 0, capsys.readouterr().err
    finally:
        sys.modules.pop("issue37_paths_plugin", None)
    assert load_config(path).task.path == str(conf / "plugins")


def test_a_set_path_resolves_against_the_working_directory(layout):
    """`--set` comes from the command line: its relative path names a file from the working
    directory, not from the config's folder (before: kept relative, so the run directory's
    config.yaml named a file relative to wherever a resume ran)."""
    conf, work = layout
    (work / "mine.txt").write_text(TEXT)
    path = _config(conf, "task: {kind: char-lm, path: data/text.txt}\n")
    cfg = load_config(path, ["task.path=mine.txt"])
    assert cfg.task.path == str(work / "mine.txt")
    whole = load_config(path, ["task={kind: char-lm, path: mine.txt}"])
    assert whole.task.path == str(work / "mine.txt")


def test_absolute_home_and_empty_paths(layout, monkeypatch, tmp_path):
    conf, work = layout
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_config(_config(conf, f"task: {{kind: char-lm, path: {conf / 'data' / 'text.txt'}}}\n")).task.path == \
        str(conf / "data" / "text.txt")
    assert load_config(_config(conf, "task: {kind: gcn-planetoid, path: ~/g.npz}\n")).task.path == str(tmp_path / "g.npz")
    empty = load_config(_config(conf, "task: {kind: gpt, path: data/text.txt, tokenizer: null}\n"))
    assert empty.task.tokenizer is None


def test_out_dir_stays_relative_to_the_working_directory(layout):
    """Chosen, not an accident: run directories go where the user works (the embedded default
    config lives inside the installation), and --out is the way elsewhere."""
    conf, work = layout
    cfg = load_config(_config(conf, "task: {kind: mlp-digits}\nrun: {out_dir: results}\n"))
    assert cfg.run.out_dir == "results"


def test_the_run_directorys_config_names_the_same_files_from_anywhere(layout, tmp_path):
    """config.yaml in a run directory holds the resolved, absolute paths: loading it from its own
    folder, or a resume from another working directory, reads the same file."""
    import yaml

    conf, work = layout
    cfg = load_config(_config(conf, "task: {kind: char-lm, path: data/text.txt}\n"))
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_mapping(cfg)))
    assert load_config(run_dir / "config.yaml").task.path == cfg.task.path
    assert config_from_mapping(yaml.safe_load((run_dir / "config.yaml").read_text())).task.path == cfg.task.path


def test_config_docs_say_how_each_path_resolves():
    from geofed.orchestrator.config.docs import config_docs_markdown

    rows = {line.split("|")[1].strip(): line for line in config_docs_markdown().splitlines() if line.startswith("| `")}
    assert "config file's folder" in rows["`task.path`"] and "working directory" in rows["`task.path`"]
    assert "working directory" in rows["`run.out_dir`"]
    text = config_docs_markdown()
    assert "## Paths" in text and "## `--set`" in text


# ---- --set of a discriminator --------------------------------------------------------------


def test_set_policy_kind_switches_the_policy(capsys):
    """configs/local-wan.yaml sets a bandwidth policy's keys. Failed before: 'sync.policy.initial_H:
    unknown key (known: kind, H)', exit 2."""
    cfg = load_config(LOCAL_WAN, ["sync.policy.kind=fixed"])
    assert cfg.sync.policy == FixedPolicyConfig()
    assert main(["validate", str(LOCAL_WAN), "--set", "sync.policy.kind=fixed"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("order", ["kind first", "kind last"])
def test_keys_set_on_the_same_command_line_still_apply(order):
    sets = ["sync.policy.kind=fixed", "sync.policy.H=7"]
    cfg = load_config(LOCAL_WAN, sets if order == "kind first" else sets[::-1])
    assert cfg.sync.policy == FixedPolicyConfig(H=7)


def test_setting_the_same_kind_keeps_the_files_keys():
    cfg = load_config(LOCAL_WAN, ["sync.policy.kind=bandwidth"])
    assert isinstance(cfg.sync.policy, BandwidthPolicyConfig)
    assert (cfg.sync.policy.initial_H, cfg.sync.policy.H_min, cfg.sync.policy.H_max) == (200, 50, 2000)


def test_a_section_without_kind_has_its_default_kind(tmp_path):
    """`sync.policy: {H: 5}` is a fixed policy (the default kind): switching it drops H."""
    path = _config(tmp_path, "task: {kind: mlp-digits}\nsync: {policy: {H: 5}}\n")
    assert load_config(path, ["sync.policy.kind=bandwidth"]).sync.policy == BandwidthPolicyConfig()


def test_a_policy_spelled_as_its_kind_switches_too(tmp_path):
    """Failed before: "--set: cannot set a key inside a str"."""
    path = _config(tmp_path, "task: {kind: mlp-digits}\nsync: {policy: fixed}\n")
    cfg = load_config(path, ["sync.policy.kind=bandwidth", "sync.policy.H_max=300"])
    assert cfg.sync.policy == BandwidthPolicyConfig(H_max=300)


def test_adacomms_base_policy_switches(tmp_path):
    path = _config(tmp_path, "task: {kind: mlp-digits}\nsync: {policy: {kind: adacomm, H_max: 500, "
                             "base: {kind: bandwidth, initial_H: 100, H_max: 400}}}\n")
    cfg = load_config(path, ["sync.policy.base.kind=fixed", "sync.policy.base.H=30"])
    assert cfg.sync.policy.base == FixedPolicyConfig(H=30) and cfg.sync.policy.H_max == 500
    assert load_config(path, ["sync.policy.kind=fixed"]).sync.policy == FixedPolicyConfig()


def test_set_task_kind_switches_the_task(layout):
    """Failed before: 'task.path: unknown key' (mlp-digits has no path)."""
    conf, work = layout
    path = _config(conf, "task: {kind: char-lm, path: data/text.txt, max_chars: 5000, seq_len: 32}\n")
    cfg = load_config(path, ["task.kind=mlp-digits", "task.hidden=16"])
    assert (cfg.task.kind, cfg.task.hidden) == ("mlp-digits", 16)


@pytest.mark.parametrize("codec", ["{kind: topk, fraction: 0.05}", "'topk(fraction=0.05)'"])
def test_set_codec_kind_switches_the_codec(tmp_path, codec):
    """Failed before: 'compression.codec: int8 takes no parameter fraction' (a mapping) and
    '--set: cannot set a key inside a str' (the key spelling)."""
    path = _config(tmp_path, f"task: {{kind: mlp-digits}}\ncompression: {{codec: {codec}, error_feedback: true}}\n")
    assert load_config(path, ["compression.codec.kind=int8"]).compression.codec.key == "int8"
    assert load_config(path, ["compression.codec.kind=topk"]).compression.codec.to_data()["fraction"] == 0.05


def test_set_ladder_item_kind_switches_that_codec(tmp_path):
    path = _config(tmp_path, "task: {kind: mlp-digits}\ncompression: {codec: fp16, error_feedback: true, "
                             "ladder: [fp16, {kind: topk, fraction: 0.1}]}\n")
    cfg = load_config(path, ["compression.ladder.1.kind=int8"])
    assert [s.key for s in cfg.compression.ladder] == ["fp16", "int8"]


def test_an_unknown_kind_is_still_one_clear_line(capsys):
    assert main(["validate", str(LOCAL_WAN), "--set", "sync.policy.kind=adaptve"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sync.policy.kind: unknown policy 'adaptve' (known: adacomm, bandwidth, fixed)" in err


def test_a_kind_key_that_is_not_a_discriminator_is_a_plain_set():
    """sync.inner.kind picks an optimizer; its section's keys are shared, so nothing is reset."""
    cfg = load_config(LOCAL_WAN, ["sync.inner.kind=sgd"])
    assert (cfg.sync.inner.kind, cfg.sync.inner.lr, cfg.sync.inner.batch_size) == ("sgd", 0.003, 32)
    with pytest.raises(ConfigError, match=r"run\.kind: unknown key"):
        load_config(LOCAL_WAN, ["run.kind=x"])


def test_plan_write_config_keeps_naming_the_same_files(layout, tmp_path, capsys):
    """`geofed plan --write-config` writes a config derived from another into another folder: its
    paths must still name the files the original named. Failed before: the written file kept
    'data/text.txt', which then named a file beside the written config (and --set's kind switch
    did not apply there)."""
    conf, work = layout
    path = _config(conf, "task: {kind: char-lm, path: data/text.txt, max_chars: 2000}\n"
                         "regions: {names: [us-east-1, eu-west-1]}\nsync: {policy: {kind: bandwidth, H_max: 300}}\n")
    out = tmp_path / "elsewhere" / "chosen.yaml"
    out.parent.mkdir()
    assert main(["plan", str(path), "--H", "50", "--codecs", "int8", "--step-time", "0.01",
                 "--set", "sync.policy.kind=fixed", "--write-config", str(out)]) == 0, capsys.readouterr().err
    assert load_config(out).task.path == str(conf / "data" / "text.txt")


# Keys that hold a path but are not resolved on the driver, and why (docs/CONFIG.md, Paths).
NOT_RESOLVED = {
    "run.out_dir": "relative to the working directory on purpose: run directories go where the user works",
    "launch.auth_token_path": "an absolute path on every node of the cluster",
    "launch.setup.venv": "an absolute path on every node of the cluster",
    "launch.setup.python": "an interpreter on every node (a name on PATH or an absolute path)",
    "launch.setup.package": "a pip requirement, given to pip on every node as written",
}


def _path_like_fields():
    """(dotted key, field) of every key of every section, task kind and policy kind whose name says
    it may hold a path."""
    import dataclasses
    import re
    import typing

    from geofed.orchestrator.config import RunConfig
    from geofed.orchestrator.policies import policy_config_class, policy_kinds
    from geofed.regions.tasks.base import PluginTaskConfig, task_config_class, task_kinds

    looks = re.compile(r"path|dir|file|folder|tokenizer|venv|package|python|^config$")
    roots = [(RunConfig, "")] + [(task_config_class(k), "task") for k in task_kinds()] + \
        [(PluginTaskConfig, "task")] + [(policy_config_class(k), "sync.policy") for k in policy_kinds()]
    seen, out = set(), []
    while roots:
        cls, prefix = roots.pop()
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}.{f.name}" if prefix else f.name
            if looks.search(f.name) and (key, cls) not in seen:
                seen.add((key, cls))
                out.append((key, f))
            members = typing.get_args(hints[f.name]) or (hints[f.name],)
            roots += [(m, key) for m in members if dataclasses.is_dataclass(m) and isinstance(m, type)]
    return out


def test_every_key_that_holds_a_path_says_how_it_resolves():
    """A new key holding a local file must be marked path="config" (resolved beside the config) or
    be named here with the reason it is not."""
    unclassified = [key for key, f in _path_like_fields()
                    if f.metadata.get("path") != "config" and key not in NOT_RESOLVED]
    assert unclassified == []
    marked = {key for key, f in _path_like_fields() if f.metadata.get("path") == "config"}
    assert marked == {"task.path", "task.tokenizer", "task.config", "sync.outer.path"}
