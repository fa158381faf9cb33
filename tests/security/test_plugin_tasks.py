"""Issue 15, finding 1: a config could make geofed call any function (`python:os:system`).
A plug-in task is now only a callable its author marked (`@task_factory`, or a `geofed.tasks`
entry point), and the mark is checked before anything is called, in `geofed validate` as in
the driver and every region. Importing the named module still runs its top-level code: a
config that names a plug-in is code (regions/tasks/base.py)."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

from geofed.orchestrator.cli import main
from geofed.orchestrator.config import load_config
from geofed.orchestrator.config.strict import ConfigError
from geofed.regions.tasks import Task, make_task
from geofed.regions.tasks.base import PluginTaskConfig

ROOT = Path(__file__).resolve().parents[2]
UNMARKED = "is not a geofed task factory; mark it with @geofed.regions.tasks.task_factory or declare it as a 'geofed.tasks' entry point"


def _module(folder: Path, body: str) -> str:
    """A fresh module in `folder` (a unique name: nothing cached from another test)."""
    name = f"plugin_{uuid.uuid4().hex[:12]}"
    (folder / f"{name}.py").write_text("from pathlib import Path\n" + body)
    return name


def _config(tmp_path: Path, kind: str, **task) -> Path:
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"task": {"kind": kind, **task}, "network": {"emulation": {"mode": "none"}}}))
    return path


def test_os_system_is_refused_by_validate_and_never_runs(tmp_path, capsys):
    """The issue's case, through validate and through make_task (the driver's and every region's
    path): the command never runs."""
    marker = tmp_path / "pwned"
    cfg = _config(tmp_path, "python:os:system", options={"command": f"touch {marker}"})
    assert main(["validate", str(cfg)]) == 2
    assert capsys.readouterr().err == (f"geofed: {cfg}: task.kind: 'python:os:system' names 'os', which holds no geofed "
                                       "task factory (a plug-in task is a function in your own module, marked @task_factory)\n")
    with pytest.raises(ValueError, match="names 'os'"):
        make_task(PluginTaskConfig(kind="python:os:system", options={"command": f"touch {marker}"}))
    assert not marker.exists()


def test_a_standard_library_module_is_refused_before_it_is_imported(tmp_path):
    sys.modules.pop("this", None)  # `import this` prints; any stdlib import may act
    with pytest.raises(ConfigError, match=r"task.kind: 'python:this:s' names 'this'"):
        load_config(_config(tmp_path, "python:this:s"))
    assert "this" not in sys.modules


def test_an_unmarked_function_is_refused_before_it_is_called(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(tmp_path))
    marker = tmp_path / "called"
    name = _module(tmp_path, f"IMPORTED = True\n\ndef make(**options):\n    Path({str(marker)!r}).touch()\n")
    cfg = _config(tmp_path, f"python:{name}:make")
    assert main(["validate", str(cfg)]) == 2
    assert capsys.readouterr().err == f"geofed: {cfg}: task.kind: 'python:{name}:make' {UNMARKED} (a config may only name marked factories)\n"
    with pytest.raises(ValueError, match=UNMARKED):
        make_task(PluginTaskConfig(kind=f"python:{name}:make"))
    assert not marker.exists()
    assert sys.modules[name].IMPORTED  # the trust model, stated: the module's top level did run


def test_look_alikes_of_the_mark_are_refused(tmp_path, monkeypatch):
    """The mark is identity in a registry, not an attribute: an object whose every attribute is
    truthy, a module __getattr__ that makes up any name, a marked function under another name
    that is not the one named."""
    monkeypatch.syspath_prepend(str(tmp_path))
    marker = tmp_path / "called"
    name = _module(tmp_path, (
        "from unittest import mock\n"
        "from geofed.regions.tasks import task_factory\n"
        f"proxy = mock.MagicMock(side_effect=lambda **kw: Path({str(marker)!r}).touch())\n"
        "def __getattr__(attr):\n"
        f"    return lambda **kw: Path({str(marker)!r}).touch()\n"
        "def original(**kw):\n"
        f"    Path({str(marker)!r}).touch()\n"
        "marked_copy = task_factory(lambda **kw: None)\n"))
    for attr, phrase in (("proxy", UNMARKED), ("made_up", "has no 'made_up'"), ("original", UNMARKED)):
        with pytest.raises(ValueError, match=phrase):
            make_task(PluginTaskConfig(kind=f"python:{name}:{attr}"))
    assert not marker.exists()


def test_a_marked_factory_loads_and_the_documented_example_is_marked(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_config(ROOT / "examples" / "my-task.yaml")
    task = make_task(cfg.task, batch_size=8, seed=0)
    assert isinstance(task, Task) and task.evaluate(task.build_model(0)).metric == "accuracy"
    with pytest.raises(ValueError, match=r"^options: 'python:my_task:make_task' does not take these options: .*'nope'"):
        make_task(PluginTaskConfig(kind="python:my_task:make_task", path="examples", options={"nope": 1}))


def test_an_entry_point_marks_a_factory_without_the_decorator(tmp_path, monkeypatch):
    """A distribution declaring `[project.entry-points."geofed.tasks"]` marks its factory; read
    from the installed metadata (a real .dist-info on sys.path), before any import."""
    site = tmp_path / "site"
    dist = site / "mytasks-1.0.dist-info"
    dist.mkdir(parents=True)
    name = _module(site, "from geofed.regions.tasks.digits import DigitsConfig, DigitsTask\n\n"
                         "def make(hidden=8):\n    return DigitsTask(DigitsConfig(hidden=hidden))\n")
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mytasks\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[geofed.tasks]\nmine = {name}:make\n")
    monkeypatch.syspath_prepend(str(site))
    task = make_task(PluginTaskConfig(kind=f"python:{name}:make", options={"hidden": 8}))
    assert isinstance(task, Task)
    (dist / "entry_points.txt").write_text(f"[other.group]\nmine = {name}:make\n")
    with pytest.raises(ValueError, match=UNMARKED):
        make_task(PluginTaskConfig(kind=f"python:{name}:make"))


@pytest.mark.parametrize("kind", ["python:.relative:f", "python:os:system\n", "python:a:b:c", "python:a-b:c",
                                  "python:a..b:c", "python::f", "python:a:"])
def test_a_kind_that_is_not_dotted_python_names_is_refused_before_any_import(tmp_path, kind):
    with pytest.raises(ConfigError, match=r"task.kind: expected python:module:function \(dotted Python names\)"):
        load_config(_config(tmp_path, kind))


def test_a_plugin_module_that_fails_to_import_is_one_line(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    name = _module(tmp_path, "raise RuntimeError('no GPU here')\n")
    with pytest.raises(ConfigError) as exc:
        load_config(_config(tmp_path, f"python:{name}:make"))
    assert f"task.kind: cannot import '{name}' for 'python:{name}:make': RuntimeError: no GPU here" in str(exc.value)
    assert "\n" not in str(exc.value)


def test_task_factory_needs_a_callable():
    from geofed.regions.tasks import task_factory  # new with the fix

    with pytest.raises(TypeError):
        task_factory(42)
