"""`geofed bench privacy`'s configs and document (the runs themselves need Ray: the DP round loop
is tests/integration/test_privacy_rounds.py)."""

from __future__ import annotations

from geofed.bench.privacy import ARMS, DROPPER, arm_config, main, median_row, ratios, row


def test_arms_are_plain_int8_secagg_a_dropout_and_record_level_dp_at_three_epsilons():
    assert list(ARMS) == ["plain", "int8", "secagg", "secagg_drop", "dp_eps1", "dp_eps4", "dp_eps8"]
    plain, dp = arm_config("plain", rounds=3, H=5, emulation="none"), arm_config("dp_eps8", rounds=3, H=5, emulation="proxy")
    assert plain.privacy.dp.mode == "off" and len(plain.regions.names) == 4
    assert (dp.privacy.dp.mode, dp.privacy.dp.target_epsilon, dp.privacy.dp.delta) == ("record", 8.0, 1e-5)
    assert (dp.privacy.dp.accountant, dp.privacy.dp.seeded_noise) == ("prv", True)
    assert plain.task.activation == dp.task.activation == "tanh" and plain.run.seed == 0
    assert arm_config("plain", rounds=3, H=5, emulation="none", seed=2).run.seed == 2
    assert dp.network.emulation.mode == "proxy" and dp.network.emulation.preset == "aws"
    int8, sec = arm_config("int8", rounds=6, H=5, emulation="none"), arm_config("secagg", rounds=6, H=5, emulation="none")
    assert int8.compression.codec.key == sec.compression.codec.key == "int8"
    assert not int8.security.secure_aggregation and sec.security.secure_aggregation and sec.security.secagg_bits == 8
    drop = arm_config("secagg_drop", rounds=6, H=5, emulation="none").regions.emulation.availability
    assert drop.mid_round and [(w.region, w.from_round, w.to_round) for w in drop.schedule] == [(DROPPER, 3, 3)]


def test_rows_and_the_eps8_ratio():
    summary = {"eval": {"value": 0.9123456}, "rounds": 3, "bytes_sent": 10, "wall_s": 1.5,
               "privacy": {"epsilon": 7.987654, "noise_multiplier": 2.4912}}
    assert row(summary) == {"accuracy": 0.9123, "epsilon": 7.988, "noise_multiplier": 2.491, "rounds": 3,
                            "bytes_sent": 10, "wall_s": 1.5}
    assert row({**summary, "privacy": None})["epsilon"] is None
    assert ratios({"plain": {"accuracy": 0.96}, "dp_eps8": {"accuracy": 0.912}})["dp_eps8_acc_ratio"] == 0.95
    assert ratios({"plain": {"accuracy": None}})["dp_eps8_acc_ratio"] is None
    r = ratios({"int8": {"bytes_sent": 100, "wall_s": 10.0, "accuracy": 0.97},
                "secagg": {"bytes_sent": 103, "wall_s": 11.0, "accuracy": 0.968},
                "secagg_drop": {"bytes_sent": 99, "wall_s": 12.0, "accuracy": 0.965}})
    assert r == {"secagg_bytes": 1.03, "secagg_time": 1.1, "dropout_acc_delta_points": -0.3, "dp_eps8_acc_ratio": None}


def test_repetitions_report_medians_and_every_value():
    reps = [{"accuracy": a, "epsilon": None, "bytes_sent": b, "wall_s": w}
            for a, b, w in [(0.9, 10, 3.0), (0.8, 12, 1.0), (0.95, 11, 2.0)]]
    m = median_row(reps)
    assert (m["accuracy"], m["bytes_sent"], m["wall_s"], m["epsilon"]) == (0.9, 11, 2.0, None)
    assert m["reps"]["wall_s"] == [3.0, 1.0, 2.0]
    assert median_row(reps[:1]) == reps[0]


def test_bad_options_exit_2():
    assert main(["--emulation", "netns"]) == 2
    assert main(["--arms", "plain,nope"]) == 2
