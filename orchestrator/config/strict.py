"""Strict YAML -> frozen dataclass loading with errors that name the file and the dotted key.

Lower layers (regions, p2p, compression) define plain frozen keyword-only dataclasses and
validate their own values in ``__post_init__`` by raising ``ValueError("field: message")``;
this module turns a mapping into those dataclasses and prefixes every error with the dotted
path of where it happened, so the user sees ``configs/x.yaml: sync.policy.H: must be >= 1``.

Value types are not sections: YAML spells one as a scalar or a mapping and its own parser reads
it (``VALUE_TYPES``: a codec spec is ``int8``, ``{kind: topk, fraction: 0.01}`` or
``topk(fraction=0.01,inner=int8)``); its ValueError becomes a ConfigError at the field's key.

Discriminated sections (a policy, a task, a link spec with a ``kind``) are declared with
``field(metadata={"choose": fn})``: ``fn(kind) -> dataclass`` picks the class from the mapping's
``kind`` key and raises ``KeyError`` with the known names when the kind is unknown.

Reading the YAML itself (files, limits, duplicate keys, --set) is orchestrator/config/yamlconfig.py;
its entry points are re-exported here.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

from geofed.compression import CodecSpec

from .errors import ConfigError, one_line  # noqa: F401 - re-exported: every layer imports it from here
from .errors import join_key as _join
from .yamlconfig import (  # noqa: F401 - re-exported: the loader's entry points
    MAX_CONFIG_BYTES, MAX_DEPTH, MAX_INT_DIGITS, MAX_NODES, apply_override, parse_yaml, parse_yaml_file,
    read_config_bytes,
)


# type -> parser(value) -> instance, for values that YAML spells as scalars or mappings.
VALUE_TYPES: dict[type, Any] = {CodecSpec: CodecSpec.parse}

# Field metadata `path="config"`: a local file or folder the driver reads; a relative one names a
# file beside the config file (with --set: from the working directory). orchestrator/config/paths.py.
CONFIG_RELATIVE = "config"
_PATH_NOTE = "A relative path is relative to the config file's folder (given with --set: to the working directory)."


def build(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass `cls` from `data`, strictly. Errors are ConfigError with a dotted key."""
    return _convert(cls, data, path)


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if isinstance(tp, type) and tp in VALUE_TYPES:
        return tp.__name__
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(tp: Any, value: Any, path: str) -> Any:  # one dispatch over type forms
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if isinstance(tp, type) and tp in VALUE_TYPES:
        return _convert_value_type(tp, value, path)
    if dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, value, path)
    if origin in (Union, types.UnionType):
        return _convert_union(tp, value, path)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            known = ", ".join(str(c) for c in choices)
            raise ConfigError(path, f"unknown value {value!r} (known: {known})")
        return value
    if origin in (tuple, list) or tp in (tuple, list):
        return _convert_sequence(tp, value, path)
    if origin in (dict, Mapping) or tp is dict:
        return _convert_mapping(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer() and abs(value) < 2**62:
                return int(value)
            raise ConfigError(path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        return _convert_float(value, path)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {value!r}")
        return value
    if tp is type(None):
        if value is not None:
            raise ConfigError(path, f"expected null, got {value!r}")
        return None
    raise TypeError(f"strict loader: unsupported annotation {tp!r} at {path}")  # our bug, not the user's


def _convert_value_type(tp: type, value: Any, path: str) -> Any:
    try:
        return VALUE_TYPES[tp](value)
    except (ValueError, TypeError) as exc:
        raise ConfigError(path, str(exc)) from None


def _convert_float(value: Any, path: str) -> float:
    if isinstance(value, str):
        try:
            value = float(value)  # PyYAML reads 1e6 (no dot) as a string
        except ValueError:
            raise ConfigError(path, f"expected a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(path, f"expected a number, got {value!r}")
    try:
        out = float(value)
    except OverflowError:  # an integer with hundreds of digits
        raise ConfigError(path, f"expected a finite number, got an integer of {len(str(value))} digits") from None
    if math.isnan(out):
        raise ConfigError(path, "expected a number, got NaN")
    if math.isinf(out):
        raise ConfigError(path, f"expected a finite number, got {out}")
    return out


def _convert_union(tp: Any, value: Any, path: str) -> Any:
    args = typing.get_args(tp)
    if value is None:
        if type(None) in args:
            return None
        raise ConfigError(path, "must not be null")
    non_null = [a for a in args if a is not type(None)]
    if len(non_null) == 1:
        return _convert(non_null[0], value, path)
    # Try the members in order; the first that accepts wins. Report the first member's error.
    first: ConfigError | None = None
    for arg in non_null:
        try:
            return _convert(arg, value, path)
        except ConfigError as exc:
            first = first or exc
    assert first is not None
    names = " or ".join(_type_name(a) for a in non_null)
    raise ConfigError(path, f"expected {names}, got {value!r}")


def _convert_sequence(tp: Any, value: Any, path: str) -> tuple:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(path, f"expected a list, got {value!r}")
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple and args and (len(args) != 2 or args[1] is not Ellipsis):
        if len(value) != len(args):
            raise ConfigError(path, f"expected a list of {len(args)} items, got {len(value)}")
        return tuple(_convert(a, v, _join(path, i)) for i, (a, v) in enumerate(zip(args, value)))
    item = args[0] if args else Any
    return tuple(_convert(item, v, _join(path, i)) for i, v in enumerate(value))


def _convert_mapping(tp: Any, value: Any, path: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(path, f"expected a mapping, got {value!r}")
    args = typing.get_args(tp)
    ktp, vtp = (args if args else (Any, Any))
    out = {}
    for k, v in value.items():
        key = _convert(ktp, k, _join(path, str(k)))
        out[key] = _convert(vtp, v, _join(path, str(k)))
    return out


def _build_dataclass(cls: type, value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(value) and isinstance(value, cls):
        return value
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ConfigError(path, f"expected a mapping, got {value!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in value if k not in fields]
    if unknown:
        known = ", ".join(fields)
        raise ConfigError(_join(path, str(unknown[0])), f"unknown key (known: {known})")
    kwargs = {}
    for name, f in fields.items():
        sub = _join(path, name)
        if name not in value:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(sub, "required key is missing")
            continue
        choose = f.metadata.get("choose")
        if choose is not None:
            kwargs[name] = _build_chosen(choose, value[name], sub, default_kind(f))
        else:
            kwargs[name] = _convert(hints[name], value[name], sub)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(_join(path, exc.key) if exc.key else path, exc.message) from None
    except (ValueError, TypeError) as exc:
        raise _prefixed(exc, path, fields) from None


def default_kind(f: dataclasses.Field) -> str | None:
    """The kind a discriminated field builds when its mapping names none (its default's kind)."""
    if f.default_factory is not dataclasses.MISSING:
        return getattr(f.default_factory(), "kind", None)
    return getattr(f.default, "kind", None) if f.default is not dataclasses.MISSING else None


def section_class(f: dataclasses.Field, hint: Any, value: Any) -> type | None:
    """The dataclass that field `f` (annotated `hint`) builds from `value`, or None when it builds
    none: a plain value, a value type, or a discriminated section whose kind is missing or unknown
    (building it reports that). For walks over a mapping before it is built (paths, --set)."""
    choose = f.metadata.get("choose")
    if choose is not None:
        kind = value if isinstance(value, str) else value.get("kind") if isinstance(value, dict) else None
        kind = default_kind(f) if kind is None else kind
        try:
            return choose(kind) if isinstance(kind, str) else None
        except KeyError:
            return None
    members = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    nested = [a for a in members if dataclasses.is_dataclass(a) and a not in VALUE_TYPES]
    return nested[0] if len(nested) == 1 else None


def _build_chosen(choose, value: Any, path: str, default_kind: str | None = None) -> Any:
    """A discriminated section: ``choose(kind)`` names the dataclass for ``value['kind']``.

    Without a ``kind`` the field's default kind applies, so ``--set sync.policy.H=7`` works on a
    config that never mentioned the policy.
    """
    if isinstance(value, str):
        value = {"kind": value}
    if not isinstance(value, dict):
        raise ConfigError(path, f"expected a mapping with a 'kind', got {value!r}")
    if "kind" not in value and default_kind is not None:
        value = {"kind": default_kind, **value}
    kind = value.get("kind")
    if not isinstance(kind, str):
        raise ConfigError(_join(path, "kind"), "required key is missing" if kind is None else f"expected a string, got {kind!r}")
    try:
        cls = choose(kind)
    except KeyError as exc:
        raise ConfigError(_join(path, "kind"), str(exc.args[0]) if exc.args else f"unknown kind {kind!r}") from None
    return _build_dataclass(cls, value, path)


def _prefixed(exc: Exception, path: str, fields: Mapping[str, Any]) -> ConfigError:
    msg = str(exc)
    head, sep, rest = msg.partition(": ")
    if sep and head.split(".")[0] in fields:
        return ConfigError(_join(path, head), rest)
    return ConfigError(path, msg)


def field_docs(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, doc) for every field, recursively; feeds docs/CONFIG.md."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = _join(prefix, f.name)
        tp = hints[f.name]
        if f.default is not dataclasses.MISSING:
            default = repr(str(f.default)) if type(f.default) in VALUE_TYPES else repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            made = f.default_factory()
            default = "(section)" if dataclasses.is_dataclass(made) else repr(made)
        else:
            default = "(required)"
        doc = f.metadata.get("doc", "")
        if f.metadata.get("path") == CONFIG_RELATIVE:
            doc = f"{doc}. {_PATH_NOTE}" if doc else _PATH_NOTE
        rows.append((key, str(tp).replace("typing.", ""), default, doc))
        members = typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)
        nested = [a for a in members if dataclasses.is_dataclass(a) and a not in VALUE_TYPES]
        if len(nested) == 1 and "choose" not in f.metadata:  # a section, or an optional one
            rows.extend(field_docs(nested[0], key))
    return rows
