"""The rooms' boundaries, read from the source with ast (docs/architecture.md, "House rules"; import
direction and cycles: test_layering.py):

- no module imports a private name (``_x``, or a module ``_x``) from another room;
- no module reaches into another object's private attribute (``other._x``; ``self._x`` and
  ``cls._x`` are the object's own), apart from the third-party names listed with their reason;
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from source_tree import ROOMS, ROOT, modules, named_imports

# obj._x reads that are not ours to rename, with why they are needed.
THIRD_PARTY_PRIVATE = {
    "_BatchNorm": "torch's batch-norm base class (DP refuses models with batch norm)",
    "_internal_kv_put": "Ray's internal KV store: the warm pool's handshake (no public API)",
    "_internal_kv_get": "Ray's internal KV store: the warm pool's handshake (no public API)",
    "_internal_kv_del": "Ray's internal KV store: the warm pool's handshake (no public API)",
    "_exit": "os._exit: the documented way to end a process at once (a spot notice past regions.leave_grace_s)",
    "_metadata": "torch's state_dict versions, which load_state_dict reads (rollback's copy keeps them)",
    "_connect_and_get_accessor": "Ray's GCS worker table: a dead region's exit type, which alone tells an OOM kill "
                                 "from a SIGKILL (no public API without Ray's dashboard; driver/failures.py)",
}


def _where(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(modules) -> list[str]:
    bad = []
    for name, (path, package) in modules.items():
        room = name.split(".")[1]
        for line, module, attr in named_imports(ast.parse(path.read_text(), str(path)), package):
            parts = module.split(".")
            if parts[0] != "geofed" or len(parts) < 2 or parts[1] == room or parts[1] not in ROOMS:
                continue
            if any(_private(p) for p in parts[2:] + ([attr] if attr else [])):
                bad.append(f"{_where(path)}:{line} imports {module}{'.' + attr if attr else ''}")
    return bad


def private_attribute_reads(modules) -> list[str]:
    bad = []
    for path, _ in modules.values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)) or node.attr in THIRD_PARTY_PRIVATE:
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue
            bad.append(f"{_where(path)}:{node.lineno} {ast.unparse(node)}")
    return bad


def test_no_module_imports_a_private_name_from_another_room():
    bad = private_imports(modules())
    assert not bad, "\n".join(bad)


def test_no_module_reads_another_objects_private_attribute():
    bad = private_attribute_reads(modules())
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("source, finds", [
    ("from geofed.p2p.wan.kernel import _run\n", "imports geofed.p2p.wan.kernel._run"),
    ("from geofed.p2p._hidden import x\n", "imports geofed.p2p._hidden.x"),
])
def test_the_private_import_check_sees_one(tmp_path, monkeypatch, source, finds):
    # A check that passes everything proves nothing.
    fake = tmp_path / "probe.py"
    fake.write_text(source)
    bad = private_imports({"geofed.regions.probe": (fake, ["geofed", "regions"])})
    assert bad and finds in bad[0]


def test_the_attribute_check_sees_a_reach_into_another_object(tmp_path):
    fake = tmp_path / "probe.py"
    fake.write_text("class A:\n    def f(self, ex):\n        return self._own, ex._pool, super()._x\n")
    assert [line.split(" ")[-1] for line in private_attribute_reads({"m": (fake, [])})] == ["ex._pool"]


# Class decorators that add (dataclass fields, a registry entry, isinstance support) and never
# rewrite the class's methods. Anything else is refused: a decorator that wraps every public method
# (the old @pausing of the region) hides what a call does from its reader.
ALLOWED_CLASS_DECORATORS = ("dataclass", "register", "runtime_checkable")


def class_shapes(found_modules) -> tuple[list[str], list[str]]:
    """(classes of the driver's and the regions' rooms with more than one base besides Protocol,
    classes anywhere in the core rooms with a decorator not in ALLOWED_CLASS_DECORATORS)."""
    mixins, decorated = [], []
    for name, (path, _) in found_modules.items():
        room = name.split(".")[1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [ast.unparse(b) for b in node.bases if ast.unparse(b) not in ("Protocol", "ABC")]
            if room in ("orchestrator", "regions") and len(bases) > 1:
                mixins.append(f"{_where(path)}:{node.lineno} {node.name}({', '.join(bases)})")
            for d in node.decorator_list:
                text = ast.unparse(d)
                if not text.startswith(ALLOWED_CLASS_DECORATORS):
                    decorated.append(f"{_where(path)}:{node.lineno} @{text} {node.name}")
    return mixins, decorated


def test_no_mixins_on_the_driver_or_the_region():
    mixins, _ = class_shapes(modules())
    assert not mixins, "classes with several bases (mixins share state through self):\n" + "\n".join(mixins)


def test_no_class_decorator_rewrites_methods():
    _, decorated = class_shapes(modules())
    assert not decorated, "\n".join(decorated)


def test_the_shape_check_sees_a_mixin_and_a_rewriting_decorator(tmp_path):
    fake = tmp_path / "probe.py"
    fake.write_text("@pausing\nclass RegionWorker(LocalSteps, RegionState):\n    pass\n\n"
                    "class Fine(Base, Protocol):\n    pass\n")
    mixins, decorated = class_shapes({"geofed.regions.probe": (fake, ["geofed", "regions"])})
    assert [m.split(" ", 1)[1] for m in mixins] == ["RegionWorker(LocalSteps, RegionState)"]
    assert [d.split(" ")[1] for d in decorated] == ["@pausing"]
