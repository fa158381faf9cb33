"""`geofed bench privacy`'s configs and document (the runs themselves need Ray: the DP round loop
is tests/integration/test_privacy_rounds.py)."""

from __future__ import annotations

from geofed.orchestrator.bench.privacy import ARMS, arm_config, main, ratios, row


def test_arms_are_plain_and_record_level_dp_at_three_epsilons():
    assert ARMS == {"plain": None, "dp_eps1": 1.0, "dp_eps4": 4.0, "dp_eps8": 8.0}
    plain, dp = arm_config(None, rounds=3, H=5, emulation="none"), arm_config(8.0, rounds=3, H=5, emulation="proxy")
    assert plain.privacy.dp.mode == "off" and len(plain.regions.names) == 4
    assert (dp.privacy.dp.mode, dp.privacy.dp.target_epsilon, dp.privacy.dp.delta) == ("record", 8.0, 1e-5)
    assert dp.network.emulation.mode == "proxy" and dp.network.emulation.preset == "aws"


def test_rows_and_the_eps8_ratio():
    summary = {"eval": {"value": 0.9123456}, "rounds": 3, "bytes_sent": 10, "wall_s": 1.5,
               "privacy": {"epsilon": 7.987654, "noise_multiplier": 2.4912}}
    assert row(summary) == {"accuracy": 0.9123, "epsilon": 7.988, "noise_multiplier": 2.491, "rounds": 3,
                            "bytes_sent": 10, "wall_s": 1.5}
    assert row({**summary, "privacy": None})["epsilon"] is None
    assert ratios({"plain": {"accuracy": 0.96}, "dp_eps8": {"accuracy": 0.912}}) == {"dp_eps8_acc_ratio": 0.95}
    assert ratios({"plain": {"accuracy": None}})["dp_eps8_acc_ratio"] is None


def test_bad_options_exit_2():
    assert main(["--emulation", "netns"]) == 2
