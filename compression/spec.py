"""`CodecSpec`: which codec with which parameters, as one typed value with one canonical key.

Configs, policies, round plans, checkpoints and reports pass a spec around; `make_codec(spec)`
builds the codec. Three spellings parse to the same spec (`CodecSpec.parse`):

    int8                                        a kind: every parameter at its default
    {kind: topk, fraction: 0.01, inner: int8}   a mapping; an inner codec nests
    topk(fraction=0.01,inner=int8)              the key itself

The key is the kind alone when every parameter is at its default, else the kind and *every*
parameter, sorted by name, inner codecs by their own key: "int8", "int4",
"topk(fraction=0.01,inner=int8)", "int8(chunk=4096,stochastic=True)". Two spellings of one codec
have one key and compare equal. The key is what rounds.jsonl, summary.json, the report and the
error-feedback states of a checkpoint name a codec by, so it must not change between versions.

Torch-free: a spec is checked against the parameter classes of params.py; only `make_codec(spec)`
(base.py) imports the codecs (and torch), so the config loader and `geofed validate` never do.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

from .params import CodecParams, make_params

Param = Union[bool, int, float, "CodecSpec"]
MAX_KEY_CHARS = 1024
MAX_DEPTH = 4  # an inner codec of an inner codec is already refused by the codecs themselves


@dataclass(frozen=True, kw_only=True, repr=False)
class CodecSpec:
    """A valid codec spec: its kind and every parameter (sorted by name, inner codecs as specs).

    Build one with `CodecSpec.parse(...)`; `CodecSpec(kind=..., params=...)` also validates and
    fills in the defaults. A bad spec raises ValueError("key: message"), e.g.
    "fraction: must be in (0, 1], got 2.0" or "kind: unknown codec 'zip' (known: ...)".
    Frozen and hashable: it keys dicts, and it pickles (Ray carries it in every RoundPlan).
    """

    kind: str
    params: tuple[tuple[str, Param], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.params, (tuple, list, Mapping)):
            raise ValueError(f"params: expected (name, value) pairs, got {type(self.params).__name__}")
        pairs = self.params.items() if isinstance(self.params, Mapping) else self.params
        data = {k: v.to_data() if isinstance(v, CodecSpec) else v for k, v in pairs}
        if "kind" in data:
            raise ValueError("params: 'kind' is the spec's kind, not a parameter")
        codec = make_params({"kind": self.kind, **data})
        object.__setattr__(self, "params", _params_of(codec))
        object.__setattr__(self, "_default", _is_default(codec))

    # ---- building ----------------------------------------------------------------------
    @classmethod
    def parse(cls, spec: Any) -> CodecSpec:
        """A spec from any spelling: a CodecSpec, a Codec, a name or key string, a mapping."""
        if isinstance(spec, CodecSpec):
            return spec
        if isinstance(spec, str) and len(spec) > MAX_KEY_CHARS:
            raise ValueError(f"a codec spec of {len(spec)} characters, at most {MAX_KEY_CHARS}")
        if isinstance(spec, str) and ("(" in spec or not spec.strip() or spec != spec.strip()):
            spec = parse_key(spec)
        elif not isinstance(spec, (str, Mapping, CodecParams)):
            raise ValueError(f"expected a codec name, a mapping with 'kind' or a key like "
                             f"topk(fraction=0.01,inner=int8), got {type(spec).__name__}")
        return cls.of(spec if isinstance(spec, CodecParams) else make_params(spec))

    @classmethod
    def of(cls, codec: CodecParams) -> CodecSpec:
        """The spec of a codec or of its parameters (`make_codec(CodecSpec.of(c)) == c`)."""
        return cls(kind=codec.kind, params=_params_of(codec))

    def parameters(self) -> CodecParams:
        """The codec's parameters and class flags (contractive, linear, ...), without torch;
        `make_codec(spec)` builds the codec itself."""
        return make_params(self.to_data())

    # ---- naming ------------------------------------------------------------------------
    @property
    def key(self) -> str:
        """The canonical text: "int8", "topk(fraction=0.01,inner=int8)" (see the module doc)."""
        if self._default:  # type: ignore[attr-defined]
            return self.kind
        return f"{self.kind}({','.join(f'{k}={_value_text(v)}' for k, v in self.params)})"

    def to_data(self) -> str | dict[str, Any]:
        """The YAML/JSON spelling: the kind alone, or a mapping of the kind and every parameter."""
        if self._default:  # type: ignore[attr-defined]
            return self.kind
        return {"kind": self.kind, **{k: v.to_data() if isinstance(v, CodecSpec) else v for k, v in self.params}}

    def __str__(self) -> str:
        return self.key

    def __repr__(self) -> str:
        return f"CodecSpec.parse({self.key!r})"


def spec_key(spec: Any) -> str:
    """The canonical key of a spec in any spelling `CodecSpec.parse` takes."""
    return CodecSpec.parse(spec).key


def _params_of(codec: CodecParams) -> tuple[tuple[str, Param], ...]:
    out = []
    for f in dataclasses.fields(codec):
        value = getattr(codec, f.name)
        out.append((f.name, CodecSpec.of(value) if isinstance(value, CodecParams) else value))
    return tuple(sorted(out))


def _is_default(codec: CodecParams) -> bool:
    try:
        return codec == type(codec)()
    except (TypeError, ValueError):  # a codec without defaults for every parameter
        return False


def _value_text(v: Param) -> str:
    if isinstance(v, CodecSpec):
        return v.key
    if isinstance(v, bool):
        return "True" if v else "False"
    return repr(v)


# ---- the key grammar: kind | kind(name=value,...), value: number | true/false | key ----------
_TOKEN = re.compile(r"\s*(?:(?P<num>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)(?![\w.])"
                    r"|(?P<name>[A-Za-z_][A-Za-z0-9_-]*)|(?P<sym>[(),=]))")
_BOOLS = {"true": True, "True": True, "false": False, "False": False}


def parse_key(text: str) -> str | dict[str, Any]:
    """A key such as "topk(fraction=0.01,inner=int8)" as the mapping `make_codec` takes."""
    if len(text) > MAX_KEY_CHARS:
        raise ValueError(f"a codec spec of {len(text)} characters, at most {MAX_KEY_CHARS}")
    tokens = _tokens(text)
    value, pos = _spec_at(tokens, 0, text, depth=0)
    if pos != len(tokens):
        raise ValueError(f"cannot read {text!r}: unexpected {tokens[pos][1]!r} after the spec")
    return value


def _tokens(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ValueError(f"cannot read {text!r} at character {pos + 1} "
                             f"(a key is kind or kind(name=value,...))")
        kind = m.lastgroup
        assert kind is not None  # every alternative of _TOKEN is a named group
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


def _spec_at(tokens: list[tuple[str, str]], pos: int, text: str, *, depth: int) -> tuple[Any, int]:
    if depth > MAX_DEPTH:
        raise ValueError(f"{text!r} nests codecs more than {MAX_DEPTH} deep")
    if pos >= len(tokens) or tokens[pos][0] != "name":
        raise ValueError(f"cannot read {text!r}: expected a codec kind"
                         + (f", got {tokens[pos][1]!r}" if pos < len(tokens) else " at the end"))
    kind = tokens[pos][1]
    pos += 1
    if pos >= len(tokens) or tokens[pos] != ("sym", "("):
        return kind, pos
    out: dict[str, Any] = {"kind": kind}
    pos += 1
    while True:
        name, pos = _expect(tokens, pos, text, "name", "a parameter name")
        if name in out:
            raise ValueError(f"{name}: given twice in {text!r}")
        _, pos = _expect(tokens, pos, text, "sym", "'='", value="=")
        out[name], pos = _value_at(tokens, pos, text, depth=depth)
        sym, pos = _expect(tokens, pos, text, "sym", "',' or ')'")
        if sym == ")":
            return out, pos
        if sym != ",":
            raise ValueError(f"cannot read {text!r}: expected ',' or ')', got {sym!r}")


def _value_at(tokens: list[tuple[str, str]], pos: int, text: str, *, depth: int) -> tuple[Any, int]:
    if pos < len(tokens):
        kind, tok = tokens[pos]
        if kind == "num":
            return (int(tok) if re.fullmatch(r"[-+]?\d+", tok) else float(tok)), pos + 1
        if kind == "name" and tok in _BOOLS and (pos + 1 >= len(tokens) or tokens[pos + 1] != ("sym", "(")):
            return _BOOLS[tok], pos + 1
    return _spec_at(tokens, pos, text, depth=depth + 1)


def _expect(tokens: list[tuple[str, str]], pos: int, text: str, kind: str, what: str, *,
            value: str | None = None) -> tuple[str, int]:
    if pos >= len(tokens):
        raise ValueError(f"cannot read {text!r}: expected {what} at the end")
    k, tok = tokens[pos]
    if k != kind or (value is not None and tok != value):
        raise ValueError(f"cannot read {text!r}: expected {what}, got {tok!r}")
    return tok, pos + 1
