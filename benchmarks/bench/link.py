"""``geofed bench link``: gRPC push rate on loopback, and sync time over an emulated WAN link.

The measuring (two real GrpcTransports, the shaping proxy) is link_core.py's; this is
the command around it: arguments, a throwaway PKI, tables or JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from .link_core import emulated, loopback
from geofed.p2p.tls import make_pki


def _table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _print(doc: dict) -> None:
    print("loopback (payload MB/s, send -> ack, median of runs)")
    print(_table(["size MB", "TLS", "MB/s", "runs"],
                 [[f"{r['size_mb']:g}", "mTLS" if r["tls"] else "plain", r["mb_s"], " ".join(map(str, r["mb_s_runs"]))]
                  for r in doc["loopback"]]))
    if doc["emulated"]:
        print("\nemulated WAN link (mTLS through the shaping proxy; targets goodput/configured >= 0.95, "
              "sync/limit <= 1.15)")
        print(_table(["Mbit/s", "RTT ms", "size MB", "goodput Mbit/s", "goodput/configured", "sync s (median)", "limit s",
                      "sync/limit", "estimated Mbit/s", "sync s (runs)"],
                     [[f"{r['configured_mbps']:g}", r["rtt_ms"], f"{r['size_mb']:g}", r["goodput_mbps"], r["goodput_ratio"],
                       r["sync_s"], r["limit_s"],
                       r["ratio"], "-" if r["estimated_mbps"] is None else r["estimated_mbps"], " ".join(map(str, r["sync_runs"]))] for r in doc["emulated"]]))
    elif doc.get("emulated_skipped"):
        print(f"\nemulated: skipped ({doc['emulated_skipped']})")


def main(argv: list[str]) -> int:
    """`geofed bench link ARGS`: loopback and emulated rows as tables or one JSON document; returns 0."""
    p = argparse.ArgumentParser(prog="geofed bench link", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.add_argument("--sizes", type=float, nargs="+", default=[1, 8, 64], help="loopback sizes, MB")
    p.add_argument("--repeats", type=int, default=5, help="measured transfers per row (median reported)")
    p.add_argument("--mbps", type=float, nargs="*", default=[50, 200], help="emulated link bandwidths (none: skip)")
    p.add_argument("--latency-ms", type=float, default=40.0, help="emulated one-way latency")
    p.add_argument("--emulated-sizes", type=float, nargs="+", default=[1, 8, 32], help="emulated sizes, MB")
    p.add_argument("--emulated-repeats", type=int, default=5, help="measured transfers per emulated row")
    p.add_argument("--max-transfer-s", type=float, default=6.0, help="skip emulated sizes slower than this")
    args = p.parse_args(argv)
    if min(args.repeats, args.emulated_repeats) < 1 or min(args.sizes + args.emulated_sizes) <= 0 or args.latency_ms < 0:
        p.error("--repeats and --emulated-repeats must be >= 1, sizes > 0, --latency-ms >= 0")
    with tempfile.TemporaryDirectory(prefix="geofed-bench-") as tmp:
        pki_dir = make_pki(Path(tmp) / "tls", ["a", "b"]).directory
        doc: dict = {"loopback": loopback(args.sizes, args.repeats, pki_dir), "emulated": []}
        if args.mbps:
            doc["emulated"] = emulated(args.mbps, args.latency_ms, args.emulated_sizes, args.emulated_repeats, pki_dir,
                                       args.max_transfer_s)
    if args.json:
        json.dump(doc, sys.stdout)
        print()
    else:
        _print(doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
