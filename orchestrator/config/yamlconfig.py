"""A config's YAML, read safely: text or a file -> a plain mapping, or one ConfigError.

The file is a regular file (no FIFO, no device) whose size is checked before it is read
(geofed.regions.inputfiles). The YAML is composed with aliases refused and nodes and nesting
counted, then every node is checked before anything is constructed from it: plain values only
(no !!binary, !!set, !!python/..., local tags), no duplicate keys (YAML keeps the last, so a
second `security:` could turn TLS off), string keys only, no merge keys, integers at most
MAX_INT_DIGITS wide (Python's int() refuses 4300 digits with a ValueError), and scalars that
convert under their tag (`!!int abc` was a ValueError). The errors name the dotted key and the
line. `--set` values go through the same checks.
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from geofed.regions.inputfiles import InputFileError, read_regular

from .errors import ConfigError
from .errors import join_key as _join

MAX_CONFIG_BYTES = 1 << 20  # a config is a page of YAML, not a data file
MAX_NODES = 20_000
MAX_DEPTH = 64  # PyYAML composes recursively: 3000 nested brackets were a RecursionError
# No setting needs more than about 20 digits (2**64); a wider integer is refused unconverted.
MAX_INT_DIGITS = 32

_TAG = "tag:yaml.org,2002:"
# What a config may hold: JSON's values. No !!binary, !!set, !!omap, !!python/..., local tags.
_PLAIN_TAGS = frozenset(_TAG + t for t in ("null", "bool", "int", "float", "str", "seq", "map"))
_CONVERTED_TAGS = frozenset(_TAG + t for t in ("null", "bool", "int", "float"))


class _NoAliasLoader(yaml.SafeLoader):
    """SafeLoader that refuses aliases (billion-laughs bombs) and counts nodes and nesting."""

    def __init__(self, stream):
        super().__init__(stream)
        self._nodes = 0
        self._depth = 0

    def compose_node(self, parent, index):  # a PyYAML hook
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
