"""The DFGL bench's runtime arms: equal epochs whatever the geofed arm's sync policy."""

from geofed.bench.dfgl import arm_config, base_config, nominal_H


def test_the_geofed_arm_keeps_its_adaptive_policy_and_stops_after_the_epochs():
    base = base_config("cora")
    assert base.sync.policy.kind == "adacomm" and nominal_H(base) == 8
    cfg = arm_config(base, "geofed", seed=1, epochs=200)
    assert cfg.sync.policy == base.sync.policy and cfg.compression.codec == base.compression.codec
    assert cfg.run.max_steps == 200 and cfg.run.rounds >= 200 // 2 and cfg.run.seed == 1


def test_the_uncompressed_arm_is_exact_gossip_every_epoch_with_evals_spaced_like_geofeds():
    base = base_config("cora")
    cfg = arm_config(base, "gossip_uncompressed", seed=0, epochs=200)
    assert cfg.sync.policy.kind == "fixed" and cfg.sync.policy.H == 1
    assert cfg.compression.codec.key == "identity" and not cfg.run.max_steps and cfg.run.rounds == 200
    assert cfg.run.eval_every == base.run.eval_every * 8


def test_a_fixed_policy_still_works():
    base = base_config("cora", overrides=["sync.policy={kind: fixed, H: 5}"])
    assert nominal_H(base) == 5
    assert arm_config(base, "geofed", seed=0, epochs=200).run.max_steps == 200
