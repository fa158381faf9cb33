"""`geofed bench NAME ...`: the bench distribution's command, found by the core CLI through the
entry point `geofed.commands: bench` (benchmarks/pyproject.toml), so the core never imports it.

Each NAME's module has ``main(argv) -> int`` and parses its own options, -h included.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Imported lazily: each pulls in torch, gRPC or Ray, which `geofed bench -h` should not pay for.
BENCHES = {
    "codecs": ("geofed.bench.codecs", "codec speed, ratio and error against the memory-bandwidth ceiling"),
    "link": ("geofed.bench.link", "gRPC transfer rate on loopback and over an emulated WAN link"),
    "wan": ("geofed.bench.wan", "per-step sync vs fixed H vs adaptive over the emulated WAN"),
    "dfgl": ("geofed.bench.dfgl", "decentralized federated graph learning against centralized"),
    "cluster": ("geofed.bench.cluster", "time to target on a multi-node Ray cluster over shaped links (root)"),
    "hetero": ("geofed.bench.hetero", "barrier vs time-budget vs quorum rounds with a slow or flaky region"),
    "soak": ("geofed.bench.soak", "a run under a hostile peer for N minutes: refusals and memory slope"),
    "privacy": ("geofed.bench.privacy", "plain vs record-level DP at epsilon 1, 4, 8 on digits (accuracy, epsilon)"),
    "plan": ("geofed.bench.plan", "geofed plan's predicted vs measured round time, utilisation and bytes"),
    "attack": ("geofed.bench.attack", "one member of 4 turns hostile (withhold, poisoned state, flips, secagg x1e30) vs undisturbed"),
    "churn": ("geofed.bench.churn", "one fault every 30 s (region kill, stop, link outage, leave/join, driver kill) vs undisturbed"),
    "memory": ("geofed.bench.memory", "a region's peak RSS per parameter (gpt 1M-100M, 8 arms) against the 32 B/param floor"),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="geofed bench",
                                description="Benchmarks that print comparison tables; `geofed bench NAME -h` for NAME's options.")
    sub = p.add_subparsers(dest="name", required=True, metavar="NAME")
    for name, (_, text) in sorted(BENCHES.items()):
        sub.add_parser(name, help=text, add_help=False)
    return p


def main(argv: Sequence[str]) -> int:
    """`geofed bench ARGV`; NAME's exit code, 0 after -h, 2 for a missing or unknown NAME."""
    argv = list(argv)
    if not argv or argv[0] not in BENCHES:  # -h, nothing, or an unknown name: argparse says which
        try:
            _parser().parse_args(argv)
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else 2
        raise AssertionError(argv)  # a known NAME never reaches argparse
    try:
        return int(importlib.import_module(BENCHES[argv[0]][0]).main(argv[1:]))
    except SystemExit as exc:  # NAME's argparse: 0 after -h, 2 on bad arguments
        return exc.code if isinstance(exc.code, int) else 1 if exc.code else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
