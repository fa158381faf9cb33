"""What the planner measures or reads: the task's step time and size, each codec's wire bytes and
time, and the link matrix (the config's emulation/preset, or a links file such as summary.json).

Errors in a file the user gives are PlanInputError naming the file and the dotted key (exit 2).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from geofed.compression import CodecSpec
from geofed.p2p.topology import make_topology
from geofed.p2p.wan.config import EmulationConfig
from geofed.p2p.wan.links import LinkTable
from geofed.p2p.wan.presets import load_preset
from geofed.p2p.wan.prices import EgressPricer

from ..config import RunConfig
from ..policies.types import LinkEstimate
from .model import Link, Segment


class PlanInputError(ValueError):
    """A malformed input file: the message names the file and the dotted key."""


@dataclass(frozen=True, kw_only=True)
class TaskFacts:
    """The task's model as the planner needs it: its update's tensors and one inner step's time."""

    shapes: tuple[tuple[int, ...], ...]
    numel: int
    step_s: float | None            # None: not probed (--step-time given)


def probe_task(cfg: RunConfig, *, steps: int = 30, probe: bool = True) -> TaskFacts:
    """Build the task's model; with `probe`, time `steps` inner steps (median, after 5 warm-up steps)
    on this machine with the regions' thread count, as a region actor runs them."""
    from geofed.regions.tasks import make_task

    torch.set_num_threads(cfg.regions.torch_threads)
    task = make_task(cfg.task, batch_size=cfg.sync.inner.batch_size, seed=cfg.run.seed)
    model = task.build_model(cfg.run.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    shapes = tuple(tuple(p.shape) for p in params)
    numel = sum(p.numel() for p in params)
    if not probe:
        return TaskFacts(shapes=shapes, numel=numel, step_s=None)
    inner = cfg.sync.inner
    opt = (torch.optim.AdamW(params, lr=inner.lr) if inner.kind == "adamw"
           else torch.optim.SGD(params, lr=inner.lr, momentum=inner.momentum))
    batches = task.shard(0, len(cfg.regions.names), cfg.run.seed).batches(torch.Generator().manual_seed(cfg.run.seed))
    times = []
    for i in range(steps + 5):
        batch = next(batches)
        t = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        task.loss(model, batch).backward()
        opt.step()
        if i >= 5:
            times.append(time.perf_counter() - t)
    slowdown = max([1.0, *cfg.regions.emulation.slowdown.values()])
    return TaskFacts(shapes=shapes, numel=numel, step_s=statistics.median(times) * slowdown)


def codec_facts(spec: CodecSpec, shapes: Sequence[tuple[int, ...]], *, chunk_bytes: int, sender: str,
                in_peers: int, reps: int = 3) -> tuple[int, float]:
    """(wire bytes of one update on one link, seconds to encode one and decode `in_peers`), by
    encoding a random update of the model's shapes: the transport's framing (header message,
    chunk messages) counted as p2p's gRPC transport counts it."""
    from geofed.compression import CodecState, decode_update, encode_update, make_codec
    from geofed.p2p.proto import gossip_pb2
    from geofed.p2p.service import encode_chunk

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g) * 1e-3 for s in shapes]
    codec = make_codec(spec)
    enc, dec, payload = [], [], b""
    for _ in range(reps):
        t = time.perf_counter()
        payload = encode_update(codec, tensors, CodecState())
        enc.append(time.perf_counter() - t)
        t = time.perf_counter()
        decode_update(payload, max_bytes=8 * sum(t.numel() for t in tensors) + (1 << 20), expected_shapes=list(shapes))
        dec.append(time.perf_counter() - t)
    n = len(payload)
    header = gossip_pb2.PushMessage(header=gossip_pb2.PushHeader(sender=sender, round=1, total_bytes=n)).SerializeToString()
    full, rest = divmod(n, chunk_bytes)
    chunk = len(encode_chunk(memoryview(bytes(chunk_bytes)))) + 5 if full else 0
    tail = len(encode_chunk(memoryview(bytes(rest)))) + 5 if rest else 0
    wire = len(header) + 5 + full * chunk + tail
    return wire, min(enc) + in_peers * min(dec)


def out_links(cfg: RunConfig, regions: Sequence[str], rounds: int = 8) -> list[str]:
    """The directed links that carry updates, as the topology sends them over its first rounds
    (a time-varying topology: every link it uses; the planner then counts each every round,
    which overstates its bytes: docs/plan.md)."""
    topo = make_topology(cfg.sync.topology, len(regions), seed=cfg.run.seed)
    links = {f"{regions[i]}->{regions[j]}" for r in range(rounds) for i in range(len(regions))
             for j in topo.out_neighbours(i, r)}
    return sorted(links)


def config_segments(em: EmulationConfig, regions: Sequence[str],
                    pricer: EgressPricer) -> tuple[list[Segment], list[str]]:
    """The link matrix the config's emulation (preset, overrides, bandwidth_scale) describes, cut at
    the schedule's `at_round` events; returns the segments and notes on what is not modelled.

    With emulation mode none the preset still gives the figures (they are the real links' measured
    shape); jitter and loss are not modelled."""
    preset = load_preset(em.preset) if em.preset else None
    table = LinkTable(em, list(regions), preset)
    notes = []
    by_round: dict[int, list] = {}
    for ev in em.schedule:
        if ev.at_round is None:
            notes.append(f"schedule event at_s={ev.at_s} on {ev.link}: not modelled (only at_round events are)")
            continue
        by_round.setdefault(ev.at_round, []).append(ev)
    if any((table.configured(a, b).loss or 0) > 0 for a, b in table.pairs):
        notes.append("link loss is not modelled (a loss stalls a stream one RTO)")
    segments = [Segment(start=0, links=_matrix(table, pricer))]
    for r in sorted(by_round):
        stall = 0.0
        for ev in by_round[r]:
            table.apply(ev, now_s=0.0, with_outage=False)
            stall = max(stall, ev.outage_s or 0.0) if ev.outage_s and ev.outage_s < 1e8 else stall
        seg = Segment(start=r, links=_matrix(table, pricer), stall_s=stall)
        if r == 0:
            segments[0] = seg
        else:
            segments.append(seg)
    return segments, notes


def _matrix(table: LinkTable, pricer: EgressPricer) -> dict[str, Link]:
    out = {}
    for a, b in table.pairs:
        fwd, back = table.configured(a, b), table.configured(b, a)
        price = pricer.price(a, b)
        est = LinkEstimate(bandwidth_bps=fwd.bandwidth_mbps * 1e6, rtt_s=((fwd.latency_ms or 0) + (back.latency_ms or 0)) / 1e3)
        out[f"{a}->{b}"] = Link(estimate=est, usd_per_gb=None if price is None else price.usd_per_gb)
    return out


def file_segments(path: str, regions: Sequence[str], pricer: EgressPricer) -> list[Segment]:
    """The link matrix of a links file: a run's summary.json (its measured `links`) or a mapping
    ``{"a->b": {bandwidth_mbps, rtt_ms}}``; every directed link between `regions` must be there."""
    from geofed.regions.inputfiles import InputFileError, read_regular

    from ..config.strict import ConfigError, parse_yaml

    try:  # a run's summary.json is anyone's file: a regular file, bounded; YAML by the strict loader
        text = read_regular(path, max_bytes=64 << 20)
        data = json.loads(text) if path.endswith(".json") else parse_yaml(text, source=path)
    except InputFileError as exc:
        raise PlanInputError(f"{path}: {exc.reason}") from None
    except ConfigError as exc:
        raise PlanInputError(str(exc)) from None
    except ValueError as exc:
        raise PlanInputError(f"{path}: not valid JSON: {exc}") from None
    prefix = "links."
    if isinstance(data, dict) and isinstance(data.get("links"), dict):
        data = data["links"]
    else:
        prefix = ""
    if not isinstance(data, dict):
        raise PlanInputError(f"{path}: links: must map 'a->b' to {{bandwidth_mbps, rtt_ms}}")
    out = {}
    for a in regions:
        for b in regions:
            if a == b:
                continue
            key = f"{a}->{b}"
            out[key] = _file_link(path, f"{prefix}{key}", data.get(key), pricer.price(a, b))
    return [Segment(start=0, links=out)]


def price_file(path: str) -> dict:
    """The provider tables of a user's egress price file (`geofed plan --prices`): read like a
    config (a regular file, bounded, strict YAML: no aliases, no tags, no duplicate keys, nesting
    capped), laid out as the packaged p2p/wan/prices.yaml. PriceError names the file and the key."""
    from geofed.p2p.wan.prices import PriceError, parse_prices

    from ..config.strict import ConfigError, parse_yaml_file

    try:
        data = parse_yaml_file(path)
    except ConfigError as exc:
        raise PriceError(str(exc)) from None
    return parse_prices(data, path)


def _file_link(path: str, key: str, row: Any, price) -> Link:
    if row is None:
        raise PlanInputError(f"{path}: {key}: missing (the plan needs every directed link between its regions)")
    if not isinstance(row, dict):
        raise PlanInputError(f"{path}: {key}: must be a mapping with bandwidth_mbps and rtt_ms")
    vals = {}
    for f in ("bandwidth_mbps", "rtt_ms"):
        v = row.get(f, row.get("configured_" + f))
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise PlanInputError(f"{path}: {key}.{f}: must be a number > 0, got {v!r}")
        vals[f] = float(v)
    est = LinkEstimate(bandwidth_bps=vals["bandwidth_mbps"] * 1e6, rtt_s=vals["rtt_ms"] / 1e3)
    return Link(estimate=est, usd_per_gb=None if price is None else price.usd_per_gb)
