"""Regions that outlive their driver (issue 41, item 3; orchestrator/driver/reattach.py): what a
resume does with each live region's state, the run id its actor names come from, who detaches,
and the orphan timer (regions/warm.py WarmSlot with run.orphan_timeout_s) without Ray."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from geofed.orchestrator.config import config_from_mapping
from geofed.orchestrator.driver import reattach
from geofed.orchestrator.driver.reattach import actor_names, decide, detached, joined_regions, run_id
from geofed.regions import warm

REGIONS = ["a", "b", "c"]


def test_every_region_at_the_checkpoint_is_kept_and_nothing_restored():
    d = decide(5, REGIONS, {"a": 5, "b": 5, "c": 5}, {"a": 5, "b": 5, "c": 5})
    assert d.kept == ("a", "b", "c") and d.restore == () and d.replay is None and d.why is None


def test_regions_one_round_ahead_with_their_reports_replay_that_round():
    d = decide(5, REGIONS, {"a": 6, "b": 6, "c": 6}, {"a": 6, "b": 6, "c": 6})
    assert d.kept == ("a", "b", "c") and d.restore == () and d.replay == 6


def test_ahead_without_every_report_restores_everyone_in_place():
    d = decide(5, REGIONS, {"a": 6, "b": 6, "c": 6}, {"a": 6, "b": None, "c": 6})
    assert d.kept == () and d.restore == tuple(REGIONS) and d.replay is None and "report" in d.why


def test_a_gone_region_is_restored_and_the_live_ones_at_the_checkpoint_kept():
    d = decide(5, REGIONS, {"a": 5, "c": 5}, {"a": 5, "c": 5})
    assert d.kept == ("a", "c") and d.restore == ("b",) and d.replay is None


def test_live_regions_ahead_while_one_is_gone_all_restore_the_checkpoint():
    d = decide(5, REGIONS, {"a": 6, "c": 6}, {"a": 6, "c": 6})
    assert d.kept == () and d.restore == tuple(REGIONS) and "b" in d.why


def test_rounds_that_differ_restore_everyone():
    d = decide(5, REGIONS, {"a": 5, "b": 6, "c": 5}, {"a": 5, "b": 6, "c": 5})
    assert d.kept == () and d.restore == tuple(REGIONS) and "differ" in d.why
    assert decide(5, REGIONS, {}, {}).restore == tuple(REGIONS)  # nothing live: as before
    assert decide(5, REGIONS, {"a": 3, "b": 3, "c": 3}, {}).kept == ()  # behind the checkpoint


def test_the_run_id_is_made_once_and_names_each_region(tmp_path):
    rid = run_id(tmp_path)
    assert rid == run_id(tmp_path) and rid.isalnum()
    assert actor_names(tmp_path, ["a", "b"]) == {"a": f"geofed/{rid}/a", "b": f"geofed/{rid}/b"}
    (tmp_path / reattach.RUN_ID_FILE).write_text('{"run_id": "../x"}')  # not ours: a new one
    assert run_id(tmp_path) != "../x"


def test_a_resume_looks_up_the_regions_that_joined_under_new_names_and_had_not_left():
    # the driver checkpoint's membership (membership.py state_dict): d joined and is in, e joined and left
    state = {"membership": {"grown": [["d", None], ["e", "zone-9"]], "out": ["b", "e"]}}
    assert joined_regions(state) == ["d"]
    assert joined_regions({}) == [] and joined_regions({"membership": {}}) == []


def test_only_a_task_run_on_a_cluster_that_outlives_its_driver_detaches():
    base = {"regions": {"names": REGIONS}, "task": {"kind": "mlp-digits"}}
    assert not detached(config_from_mapping(base))  # its own local Ray dies with it
    on = config_from_mapping({**base, "ray": {"address": "10.0.0.1:6379"}})
    assert detached(on) and not detached(on, train_fn=print) and not detached(on, hostile={"a": object()})
    assert not detached(config_from_mapping({**base, "ray": {"address": "10.0.0.1:6379"}, "run": {"orphan_timeout_s": 0}}))
    assert not detached(config_from_mapping({**base, "ray": {"address": "10.0.0.1:6379", "warm_pool_s": 60}}))
    with pytest.raises(Exception, match="orphan_timeout_s"):
        config_from_mapping({**base, "run": {"orphan_timeout_s": -1}})


def _slot(monkeypatch, alive: dict[str, bool], idle_s: float) -> tuple[warm.WarmSlot, threading.Event]:
    """A WarmSlot held by job "j1" with the orphan timeout `idle_s`, its KV and Ray calls faked."""
    monkeypatch.setattr(warm, "save_assignment", lambda name, a: None)
    monkeypatch.setattr(warm, "job_alive", lambda job: alive.get(job, False))
    monkeypatch.setattr(warm, "_TICK_S", 0.02)
    monkeypatch.setattr(warm, "_OWNER_CHECK_S", 0.05)
    ended = threading.Event()
    monkeypatch.setattr(warm.WarmSlot, "_end", lambda self: ended.set())
    cfg = SimpleNamespace(ray=SimpleNamespace(warm_pool_s=0.0))
    return warm.WarmSlot("geofed/r1/a", {"cfg": cfg, "job": "j1", "idle_s": idle_s}), ended


def test_an_orphan_ends_itself_the_timeout_after_its_driver_died(monkeypatch):
    alive = {"j1": True}
    slot, ended = _slot(monkeypatch, alive, idle_s=0.3)
    assert not ended.wait(0.4)  # its driver lives: held, whatever the time without a call
    t0 = time.monotonic()
    alive["j1"] = False  # the driver is SIGKILLed
    assert ended.wait(3.0)
    assert 0.3 <= time.monotonic() - t0 < 2.0


def test_a_resumed_driver_claims_an_orphan_before_its_timeout_and_keeps_it(monkeypatch):
    alive = {"j1": True, "j2": True}
    slot, ended = _slot(monkeypatch, alive, idle_s=0.3)
    assert not slot.claim("j2")  # another live driver holds it
    alive["j1"] = False
    assert slot.claim("j2") and slot.job == "j2"  # taken over at once, before the watch noticed the death
    assert not ended.wait(0.6)  # held by a live driver again: never ends
    alive["j2"] = False
    assert ended.wait(3.0)


def test_a_resume_skips_the_set_up_probes_only_when_every_region_was_reattached_with_its_links_known():
    from geofed.orchestrator.driver.setup import links_kept
    from geofed.orchestrator.policies.links import LinkView

    view = LinkView()
    for src in REGIONS:
        for dst in REGIONS:
            if src != dst:
                view.observe(f"{src}->{dst}", {"bandwidth_mbps": 50.0, "rtt_ms": 80.0})

    def ready(*, live=REGIONS, alive=REGIONS, restored=(4, {}, [], [])):
        return SimpleNamespace(restored=restored, live={g: object() for g in live}, regions=SimpleNamespace(alive=alive),
                               coordinator=SimpleNamespace(link_view=view))

    assert links_kept(ready())
    assert not links_kept(ready(restored=None))  # a fresh run measures its links
    assert not links_kept(ready(live=["a", "b"]))  # c in a new actor: its estimators start empty
    assert links_kept(ready(alive=["a", "b"], live=["a", "b"]))  # c is out of the run
    assert not links_kept(ready(alive=[*REGIONS, "d"], live=[*REGIONS, "d"]))  # no estimate of d's links
    view.observe("d->a", {"rtt_ms": 20.0})  # an RTT alone (bandwidth unknown): measured, as the run knew it
    assert not links_kept(ready(alive=["a", "d"], live=["a", "d"]))  # a->d never measured
    view.observe("a->d", {"bandwidth_mbps": None, "rtt_ms": None})  # reported with nothing in it
    assert not links_kept(ready(alive=["a", "d"], live=["a", "d"]))
    view.observe("a->d", {"bandwidth_mbps": 40.0})
    assert links_kept(ready(alive=["a", "d"], live=["a", "d"]))
