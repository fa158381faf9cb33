"""`--set KEY.PATH=VALUE` on a config's mapping, with a discriminator switching its section.

A discriminated section (a task, a sync policy, AdaComm's base policy, a codec in
compression.codec or compression.ladder, a codec's inner codec) is built by the class its
``kind`` names, and each kind has its own keys. `--set sync.policy.kind=fixed` on a config whose
policy is `bandwidth` therefore resets the section: the file's keys for the old kind go, the new
kind's defaults apply, and every key set on the same command line (before or after the kind)
still applies. Setting the kind a section already has keeps its keys. A `kind` that is not a
discriminator (sync.inner.kind: both optimizers share their keys) is an ordinary set.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Sequence
from typing import Any, Union

from geofed.compression import CodecSpec
from geofed.compression.spec import parse_key

from . import strict

_CODEC_PARAM = object()  # the schema inside a codec spec: its parameters, an inner codec among them


def apply_overrides(data: dict, overrides: Sequence[str], root: type) -> list[str]:
    """Apply the `--set` assignments to `data` (a mapping to be built into `root`) in place, after
    resetting every section whose kind they change; returns the dotted keys they set."""
    kinds: dict[tuple[str, ...], Any] = {}  # section -> the last kind the command line gives it
    keys = []
    for assignment in overrides:
        key = assignment.split("=", 1)[0].strip()
        keys.append(key)
        parts = tuple(key.split("."))
        if len(parts) >= 2 and parts[-1] == "kind" and "=" in assignment:
            kinds[parts[:-1]] = _value_of(assignment)
    for section, kind in kinds.items():
        if isinstance(kind, str):
            _reset_section(data, section, kind, root)
    for assignment in overrides:
        strict.apply_override(data, assignment)
    return keys


def _value_of(assignment: str) -> Any:
    """The value `--set` would store (YAML, or the text itself), read the way it will be."""
    scratch: dict[str, Any] = {}
    try:
        strict.apply_override(scratch, "v=" + assignment.split("=", 1)[1])
    except strict.ConfigError:
        return None  # applying it for real reports the error at its key
    return scratch["v"]


def _reset_section(data: dict, section: tuple[str, ...], kind: str, root: type) -> None:
    found = _locate(data, section, root)
    if found is None:
        return
    holder, name, default_kind, is_codec = found
    value = holder[name]
    if isinstance(value, str):  # the kind spelled alone (`policy: fixed`), or a codec key (`topk(fraction=0.01)`)
        try:
            value = parse_key(value) if is_codec else value
        except ValueError:
            return  # not a key: the loader reports it at its key
        value = value if isinstance(value, dict) else {"kind": value}
    elif not isinstance(value, dict):
        return
    current = value.get("kind", default_kind)
    holder[name] = dict(value) if current == kind else {}


def _locate(data: dict, parts: tuple[str, ...], root: type) -> tuple[Any, Any, str | None, bool] | None:
    """(the mapping or list holding the section, its key or index there, the field's default kind,
    whether it is a codec) for a discriminated section present in `data` at `parts`; None when
    there is none there (missing, or not a discriminator)."""
    tp: Any = root
    field: dataclasses.Field | None = None
    holder: Any = None
    name: Any = None
    node: Any = data
    for part in parts:
        tp = _unwrap(tp) if tp is not _CODEC_PARAM else tp
        if field is not None and "choose" in field.metadata:
            tp = strict.section_class(field, None, node)
        holder, name, node, tp, field = _step(tp, node, part)
        if holder is None:
            return None
    if node is None:
        return None
    if field is not None and "choose" in field.metadata:
        return holder, name, strict.default_kind(field), False
    tp = _unwrap(tp) if tp is not _CODEC_PARAM else tp
    if tp is CodecSpec:
        default = field.default if field is not None and isinstance(field.default, CodecSpec) else None
        return holder, name, default.kind if default is not None else None, True
    if tp is _CODEC_PARAM and isinstance(node, (str, dict)):
        return holder, name, None, True
    return None


def _step(tp: Any, node: Any, part: str) -> tuple[Any, Any, Any, Any, dataclasses.Field | None]:
    """One dotted part down: (holder, key, value, its schema, its field); holder None: no way down."""
    nothing = (None, None, None, None, None)
    if tp is CodecSpec or tp is _CODEC_PARAM:
        return (node, part, node.get(part), _CODEC_PARAM, None) if isinstance(node, dict) else nothing
    if dataclasses.is_dataclass(tp):
        fields = {f.name: f for f in dataclasses.fields(tp) if f.init}
        if part not in fields or not isinstance(node, dict):
            return nothing
        return node, part, node.get(part), typing.get_type_hints(tp)[part], fields[part]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (tuple, list) and isinstance(node, list):
        if not (part.isascii() and part.isdigit()) or int(part) >= len(node):
            return nothing
        return node, int(part), node[int(part)], args[0] if args else Any, None
    if origin is dict and isinstance(node, dict):
        return node, part, node.get(part), args[1] if args else Any, None
    return nothing


def _unwrap(tp: Any) -> Any:
    """X for `X | None`."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        return members[0] if len(members) == 1 else tp
    return tp
