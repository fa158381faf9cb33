"""Strict YAML -> frozen dataclass loading with errors that name the file and the dotted key.

Lower layers (regions, p2p, compression) define plain frozen keyword-only dataclasses and
validate their own values in ``__post_init__`` by raising ``ValueError("field: message")``;
this module turns a mapping into those dataclasses and prefixes every error with the dotted
path of where it happened, so the user sees ``configs/x.yaml: sync.policy.H: must be >= 1``.

Discriminated sections (a policy, a task, a link spec with a ``kind``) are declared with
``field(metadata={"choose": fn})``: ``fn(kind) -> dataclass`` picks the class from the mapping's
``kind`` key and raises ``KeyError`` with the known names when the kind is unknown.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

import yaml

from geofed.regions.inputfiles import InputFileError, read_regular

MAX_CONFIG_BYTES = 1 << 20  # a config is a page of YAML, not a data file
MAX_NODES = 20_000
MAX_DEPTH = 64  # PyYAML composes recursively: 3000 nested brackets were a RecursionError
# Python refuses int() of more than 4300 digits with a ValueError; no setting needs more than
# about 20 (2**64), so a config integer wider than this is refused before it is converted.
MAX_INT_DIGITS = 32
MAX_KEY_SHOWN = 120  # characters of a dotted key an error message shows

_TAG = "tag:yaml.org,2002:"
# What a config may hold: JSON's values. No !!binary, !!set, !!omap, !!python/..., local tags.
_PLAIN_TAGS = frozenset(_TAG + t for t in ("null", "bool", "int", "float", "str", "seq", "map"))
_CONVERTED_TAGS = frozenset(_TAG + t for t in ("null", "bool", "int", "float"))


class ConfigError(ValueError):
    """A user error in a config: one line, naming the file and the dotted key."""

    def __init__(self, key: str, message: str, *, source: str | None = None):
        self.key = key
        self.message = message
        self.source = source
        super().__init__(self._render())

    def with_source(self, source: str) -> "ConfigError":
        return ConfigError(self.key, self.message, source=source)

    def _render(self) -> str:
        key = self.key if len(self.key) <= MAX_KEY_SHOWN else self.key[:MAX_KEY_SHOWN] + "..."
        where = f"{key}: " if key else ""
        src = f"{self.source}: " if self.source else ""
        return one_line(f"{src}{where}{self.message}")


def one_line(text: str) -> str:
    """`text` with line breaks and other control characters escaped: a key or a file name from a
    hostile config cannot break the one-line error into several."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


class _NoAliasLoader(yaml.SafeLoader):
    """SafeLoader that refuses aliases (billion-laughs bombs) and counts nodes and nesting."""

    def __init__(self, stream):
        super().__init__(stream)
        self._nodes = 0
        self._depth = 0

    def compose_node(self, parent, index):  # noqa: D401 - PyYAML hook
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise ConfigError("", f"line {event.start_mark.line + 1}: YAML aliases (*{event.anchor}) are not allowed in configs")
        self._nodes += 1
        if self._nodes > MAX_NODES:
            raise ConfigError("", f"more than {MAX_NODES} YAML nodes; a config this large is refused")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                line = self.peek_event().start_mark.line + 1
                raise ConfigError("", f"line {line}: nested deeper than {MAX_DEPTH} levels; a config this deep is refused")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


# YAML 1.1 reads an unquoted 2024-01-01 as a date (and 2024-13-45 as a crash in datetime); a
# config holds no dates, so such a value stays the string it looks like.
_NoAliasLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _TAG + "timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def _load(text: str | bytes, path: str = "") -> Any:
    """One YAML document, checked node by node before anything is constructed from it."""
    loader = _NoAliasLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_node(loader, node, path)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_node(loader: yaml.SafeLoader, node: yaml.Node, path: str) -> None:
    """Refuse what a config must not hold, naming the dotted key and the line: tags beyond plain
    values, duplicate keys (the last would silently win), merge and non-string keys, integers
    too wide to convert, scalars that do not convert under their tag (``!!int abc``)."""
    line = node.start_mark.line + 1
    if node.tag not in _PLAIN_TAGS:
        tag = node.tag.replace(_TAG, "!!")
        raise ConfigError(path, f"line {line}: invalid YAML: tag {tag[:80]} is not allowed in configs (plain values only)")
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = _mapping_key(key_node, path)
            sub = _join(path, key)
            key_line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(sub, f"line {key_line}: duplicate key (first on line {seen[key]}); "
                                       "YAML would silently keep only the last")
            seen[key] = key_line
            _check_node(loader, value_node, sub)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_node(loader, item, _join(path, i))
    elif node.tag in _CONVERTED_TAGS:
        _check_scalar(loader, node, path, line)


def _mapping_key(node: yaml.Node, path: str) -> str:
    line = node.start_mark.line + 1
    if node.tag == _TAG + "merge":
        raise ConfigError(path, f"line {line}: YAML merge keys (<<) are not allowed in configs")
    if not isinstance(node, yaml.ScalarNode):
        kind = "mapping" if isinstance(node, yaml.MappingNode) else "list"
        raise ConfigError(path, f"line {line}: a {kind} as a key; keys must be strings")
    if node.tag != _TAG + "str":
        tag = node.tag.replace(_TAG, "")
        raise ConfigError(path, f"line {line}: key {node.value[:40]!r} reads as {tag}; keys must be strings (quote it)")
    return node.value


def _check_scalar(loader: yaml.SafeLoader, node: yaml.ScalarNode, path: str, line: int) -> None:
    tag = node.tag.replace(_TAG, "")
    if tag == "int":
        digits = sum(c.isalnum() for c in node.value)
        if digits > MAX_INT_DIGITS:
            raise ConfigError(path, f"line {line}: an integer of {digits} digits; at most {MAX_INT_DIGITS} are accepted")
    try:
        loader.construct_object(node)
    except (ValueError, TypeError, LookupError, AttributeError, ArithmeticError):
        raise ConfigError(path, f"line {line}: invalid YAML: {node.value[:40]!r} is not a valid {tag}") from None


def parse_yaml(text: str | bytes, *, source: str) -> dict[str, Any]:
    """Parse one YAML document that must be a mapping; errors are ConfigError naming `source`."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError("", f"file is {len(text)} bytes; configs are limited to {MAX_CONFIG_BYTES}", source=source)
    try:
        data = _load(text)
    except ConfigError as exc:
        raise exc.with_source(source) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError("", f"{where}invalid YAML: {problem}", source=source) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("", f"top level must be a mapping of sections, got {type(data).__name__}", source=source)
    return data


def read_config_bytes(path: str | os.PathLike, *, source: str | None = None) -> bytes:
    """The bytes of a config file: a regular file (no FIFO, no device), its size checked before a
    byte is read, at most MAX_CONFIG_BYTES + 1 read. ConfigError names the file."""
    source = source or os.fspath(path)
    try:
        return read_regular(path, max_bytes=MAX_CONFIG_BYTES)
    except InputFileError as exc:
        if exc.size is not None:
            raise ConfigError("", f"file is {exc.size} bytes; configs are limited to {MAX_CONFIG_BYTES}",
                              source=source) from None
        if exc.strerror is not None:
            raise ConfigError("", f"cannot read config: {exc.strerror}", source=source) from None
        raise ConfigError("", exc.reason, source=source) from None


def parse_yaml_file(path: str | os.PathLike, *, source: str | None = None) -> dict[str, Any]:
    """`parse_yaml` of a config file read safely (`read_config_bytes`); for configs and a run
    directory's config.yaml alike."""
    source = source or os.fspath(path)
    return parse_yaml(read_config_bytes(path, source=source), source=source)


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply ``a.b.c=value`` (value parsed as YAML) to a nested mapping, in place."""
    if "=" not in assignment:
        raise ConfigError("", f"--set {assignment!r}: expected KEY.PATH=VALUE")
    key, raw = assignment.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ConfigError(key, f"--set {assignment!r}: empty key")
    try:
        value = _load(raw) if raw.strip() else ""
    except ConfigError as exc:  # YAML, but refused: a duplicate key, a 40-digit integer, a tag
        message = exc.message.split(": ", 1)[1] if exc.message.startswith("line ") else exc.message
        raise ConfigError(_join(key, exc.key) if exc.key else key, f"--set: {message}") from None
    except yaml.YAMLError:  # not YAML: the text itself is the value
        value = raw
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        here = ".".join(parts[: i + 1])
        if isinstance(node, list):
            node = node[_list_index(node, part, here)]
            continue
        if not isinstance(node, dict):
            raise ConfigError(here, f"--set: cannot descend into a {type(node).__name__}")
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
    last = parts[-1]
    if isinstance(node, list):
        node[_list_index(node, last, key)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError(key, f"--set: cannot set a key inside a {type(node).__name__}")


def _list_index(node: list, part: str, where: str) -> int:
    # isdigit() is also true of '²' and of 5000 digits, which int() refuses with a ValueError
    if not (part.isascii() and part.isdigit() and len(part) <= 9) or int(part) >= len(node):
        raise ConfigError(where, f"--set: list index {part!r} out of range (0..{len(node) - 1})")
    return int(part)


def build(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass `cls` from `data`, strictly. Errors are ConfigError with a dotted key."""
    return _convert(cls, data, path)


def _join(path: str, key: str | int) -> str:
    return f"{path}.{key}" if path else str(key)


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(tp: Any, value: Any, path: str) -> Any:  # noqa: C901 - one dispatch over type forms
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
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
            kwargs[name] = _build_chosen(choose, value[name], sub, _default_kind(f))
        else:
            kwargs[name] = _convert(hints[name], value[name], sub)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(_join(path, exc.key) if exc.key else path, exc.message) from None
    except (ValueError, TypeError) as exc:
        raise _prefixed(exc, path, fields) from None


def _default_kind(f: dataclasses.Field) -> str | None:
    if f.default_factory is not dataclasses.MISSING:
        return getattr(f.default_factory(), "kind", None)
    return getattr(f.default, "kind", None) if f.default is not dataclasses.MISSING else None


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
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            made = f.default_factory()
            default = "(section)" if dataclasses.is_dataclass(made) else repr(made)
        else:
            default = "(required)"
        rows.append((key, str(tp).replace("typing.", ""), default, f.metadata.get("doc", "")))
        members = typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)
        nested = [a for a in members if dataclasses.is_dataclass(a)]
        if len(nested) == 1 and "choose" not in f.metadata:  # a section, or an optional one
            rows.extend(field_docs(nested[0], key))
    return rows
