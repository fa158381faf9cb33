"""`geofed bench codecs`: ratio, encode/decode speed and error of every codec, side by side with
a bf16 cast into a preallocated buffer (the memory-bandwidth ceiling) and a per-tensor int8.

The measuring is codecs_core.py's; this is the command around it:
arguments, torch threads, tables or JSON, and ``--check``'s exit code.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import torch

from geofed.compression import CodecSpec
from .codecs_core import DEFAULT_CODECS, TARGET_NUMEL, run


def _print_table(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    t = Table(title=f"codecs ({doc['threads']} torch thread, best of {doc['repeat']} rounds; MB/s of fp32)")
    for col in ("codec", "numel", "ratio", "encode MB/s", "encode+EF MB/s", "decode MB/s", "decode→buf MB/s", "rel error"):
        t.add_column(col, justify="left" if col == "codec" else "right")
    for r in doc["results"]:
        ef = f"{r['encode_ef_mb_s']:.0f}" if r["encode_ef_mb_s"] else "-"
        t.add_row(r["codec"], f"{r['numel']:,}", f"{r['ratio']:.2f}", f"{r['encode_mb_s']:.0f}", ef,
                  f"{r['decode_mb_s']:.0f}", f"{r['decode_into_buffer_mb_s']:.0f}", f"{r['rel_error']:.4f}")
    for ref in doc["reference"]:
        t.add_row(f"[dim]ref: {ref['name']}[/dim]", f"{ref['numel']:,}", "", f"{ref['encode_mb_s']:.0f}", "", "", "", "")
    console.print(t)
    tt = Table(title=f"targets (speed targets apply at {TARGET_NUMEL:,} floats)")
    for col in ("target", "numel", "value", "threshold", "result"):
        tt.add_column(col, justify="left" if col == "target" else "right")
    held = [g for g in doc["targets"] if g["applies"]]
    for g in held:
        verdict = "[green]pass[/green]" if g["pass"] else "[red]FAIL[/red]"
        tt.add_row(g["target"], f"{g['numel']:,}", f"{g['value']:.2f}", f"{g['threshold']:g}", verdict)
    if held:
        console.print(tt)
    console.print(f"{sum(g['pass'] for g in held)}/{len(held)} applicable targets hold"
                  + ("" if any(g["numel"] >= TARGET_NUMEL for g in held) else
                     f" (speed targets are judged at --numel {TARGET_NUMEL}; --json lists every measured ratio)"))


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="geofed bench codecs", description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, nargs="+", default=[1_000_000, TARGET_NUMEL], metavar="N",
                   help="update sizes in floats (default: 1000000 25000000)")
    p.add_argument("--codec", nargs="+", default=None, metavar="SPEC",
                   help='codecs as names, keys or JSON specs, e.g. int8 "topk(fraction=0.001,inner=int8)" '
                        '\'{"kind":"topk","fraction":0.001}\' (default: all)')
    p.add_argument("--repeat", type=int, default=7, help="timed rounds over every codec; the best counts (default 7)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: codecs run on one thread)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.add_argument("--check", action="store_true", help="exit 1 when an applicable target fails")
    return p.parse_args(list(argv))


def main(argv: Sequence[str]) -> int:
    """`geofed bench codecs ARGS`; returns the exit code (2: bad arguments, 1: --check and a target missed)."""
    try:
        args = _parse(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if any(n < 1 for n in args.numel) or args.repeat < 1 or args.threads < 1:
        print("geofed bench codecs: --numel, --repeat and --threads must be >= 1")
        return 2
    specs = DEFAULT_CODECS
    if args.codec:
        try:
            specs = [CodecSpec.parse(json.loads(s) if s.lstrip().startswith("{") else s) for s in args.codec]
        except ValueError as exc:
            print(f"geofed bench codecs: --codec: {exc}")
            return 2
    torch.set_num_threads(args.threads)
    doc = run(args.numel, specs, args.repeat)
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        _print_table(doc)
    failed = [g for g in doc["targets"] if g["applies"] and not g["pass"]]
    return 1 if args.check and failed else 0
