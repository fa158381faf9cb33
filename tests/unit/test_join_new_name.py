"""A region that joins a run under a new name (issue 41, item 1; orchestrator/driver/membership.py), the
parts below the driver's control channel, without Ray: the emulator's links for it, the coordinator's
plans over it (RoundPlan.members), and the regions' topology and mixing following those plans: in
process, over the in-memory transport, a joiner that took a peer's state is mixed from its first
planned round and holds its peers' model after it."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver.coordinator import Coordinator
from geofed.orchestrator.driver.rundir import Clock
from geofed.p2p.memory import InMemoryTransport
from geofed.p2p.wan import WanEmulator
from geofed.p2p.wan.config import EmulationConfig, LinkSpec
from geofed.regions.inprocess import InProcessRegions
from geofed.regions.region import Region


def test_the_emulator_gives_a_new_region_the_default_link_or_its_label_regions():
    em = EmulationConfig(mode="proxy", default=LinkSpec(latency_ms=10.0, bandwidth_mbps=100.0),
                         links={"a<->b": LinkSpec(latency_ms=80.0, bandwidth_mbps=5.0)})
    emulator = WanEmulator(em, ["a", "b"])
    emulator.add_region("d")
    emulator.add_region("e", like="a")  # placed on a's label: a's links, both ways
    assert emulator.regions == ("a", "b", "d", "e")
    assert emulator.configured("d", "b").latency_ms == 10.0 and emulator.configured("b", "d").bandwidth_mbps == 100.0
    assert emulator.configured("e", "b") == emulator.configured("a", "b") and emulator.configured("e", "b").latency_ms == 80.0
    assert emulator.configured("b", "e").bandwidth_mbps == 5.0
    assert emulator.configured("e", "a").latency_ms == 10.0  # between the two: the default
    assert set(emulator.link_stats()) == {f"{s}->{d}" for s in "abde" for d in "abde" if s != d}
    try:
        emulator.add_region("a")
        raise AssertionError("a region added twice")
    except ValueError as exc:
        assert "already one of the run's regions" in str(exc)


def test_a_joiner_under_a_new_name_is_planned_probed_and_mixed_from_its_first_round(tmp_path):
    cfg = config_from_mapping({
        "run": {"name": "t", "seed": 0},
        "task": {"kind": "mlp-digits", "hidden": 8},
        "regions": {"names": ["a", "b"]},
        "sync": {"policy": {"kind": "fixed", "H": 5}, "deadline": {"initial_s": 3.0, "min_s": 0.5, "max_s": 4.0}},
        "network": {"emulation": {"mode": "none"}, "probe_s": 0.05, "probe_max_mb": 1},
    })
    grown = dataclasses.replace(cfg, regions=dataclasses.replace(cfg.regions, names=("a", "b", "d")))  # membership.grown_config
    with InProcessRegions(cfg, tmp_path) as group:
        coordinator = Coordinator(cfg, model_numel=1, clock=Clock())
        plans = coordinator.plan(0, alive=["a", "b"], evaluate=False)
        assert {p.members for p in plans.values()} == {None}  # regions.names: the plans say nothing
        group.run_round(plans)
        d = Region(grown, "d", tmp_path, transport=InMemoryTransport("d", group.hub, round_window=cfg.security.round_window))
        group.workers["d"] = d  # closed with the others
        d.start()
        for w in group.workers.values():
            w.connect({r: f"inmem:{r}" for r in ("a", "b", "d")})
        assert d.catch_up(["a"]) == ("a", 0)  # the rejoin path: the current model and outer state from a peer
        # Its links are measured before a round carries them: the others' to it too, before their plans name it.
        assert {t["peer"] for t in group.workers["a"].probe()["transfers"]} == {"b", "d"}
        assert {t["peer"] for t in d.probe()["transfers"]} == {"a", "b"}
        coordinator.add_region("d")
        plans = coordinator.plan(1, alive=["a", "b", "d"], evaluate=False)
        assert {p.members for p in plans.values()} == {("a", "b", "d")}
        assert sorted(coordinator.round_links(1, ["a", "b", "d"])) == ["a->b", "a->d", "b->a", "b->d", "d->a", "d->b"]
        with ThreadPoolExecutor(3) as pool:  # the group's own pool has a thread per region it was built with
            futures = {r: pool.submit(group.workers[r].run_round, plan) for r, plan in plans.items()}
            reports = {r: f.result() for r, f in futures.items()}
        assert {r: sorted(m.exchange.peers_missing) for r, m in reports.items()} == {"a": [], "b": [], "d": []}
        assert group.workers["a"].regions == ["a", "b", "d"] and group.workers["a"].in_weights(1) == {"b": 1 / 3, "d": 1 / 3}
        params = group.call(lambda w: w.get_params())
        apart = {r: max((x - y).abs().max().item() for x, y in zip(params["a"], params[r])) for r in ("b", "d")}
        assert max(apart.values()) < 1e-4, apart  # DiLoCo over full: one model (each region's own update is exact, the others' fp16)
        try:
            group.workers["b"].set_members(["b", "a", "d"])
            raise AssertionError("members reordered")
        except ValueError as exc:
            assert "does not extend" in str(exc)
