"""keel.recovery's rules as plain functions (the parity of twin and runtime is in
tests/test_recovery_parity.py)."""
from __future__ import annotations

import pytest

from keel import recovery as R
from keel.scenario import from_dict, load
from tests.conftest import SCENARIOS


def holders(*specs):
    """('r0/0', 'r0', speed, held), ... -> Holders in the given (scenario) order."""
    return [R.Holder(n, r, s, h, i) for i, (n, r, s, h) in enumerate(specs)]


@pytest.mark.parametrize("cls,kind,quarantine,action", [
    ("hardware_fault", "absorb", True, "replicate_resume"),
    ("network_jitter", "absorb", True, "backpressure_reslot"),
    ("partial_cluster_loss", "absorb", True, "shard_reweight_failover"),
    ("data_shard_skew", "absorb", True, "quarantine_resample"),
    ("data_shard_skew", "absorb", False, "fail_run"),
    ("hardware_fault", "checkpoint_restart", True, "checkpoint_restart"),
    ("partial_cluster_loss", "checkpoint_restart", False, "checkpoint_restart"),
    ("network_jitter", "checkpoint_restart", True, "endure"),
    ("data_shard_skew", "checkpoint_restart", True, "checkpoint_restart"),
    ("data_shard_skew", "checkpoint_restart", False, "fail_run"),
    ("coordinator_loss", "absorb", True, "coordinator_failover"),
    ("coordinator_loss", "absorb", False, "coordinator_failover"),
    ("coordinator_loss", "checkpoint_restart", True, "checkpoint_restart"),
    ("coordinator_loss", "checkpoint_restart", False, "checkpoint_restart"),
])
def test_action_for_every_class_and_policy(cls, kind, quarantine, action):
    assert R.action_for(cls, kind, quarantine) == action


def test_action_for_an_unknown_class_is_an_error():
    with pytest.raises(ValueError, match="unknown fault class"):
        R.action_for("meteor", "absorb", True)


def test_shard_skipped_only_when_quarantining_and_quarantined():
    assert R.shard_skipped(True, {"shard/3"}, "shard/3")
    assert not R.shard_skipped(True, {"shard/3"}, "shard/4")
    assert not R.shard_skipped(False, {"shard/3"}, "shard/3")


def test_fastest_finish_is_round_robin_on_equal_nodes_and_favours_fast_ones():
    eq = holders(("a", "r", 1.0, 0), ("b", "r", 1.0, 0), ("c", "r", 1.0, 0))
    assert R.fastest_finish(7, eq) == ["a", "b", "c", "a", "b", "c", "a"]
    mixed = holders(("slow", "r", 1.0, 0), ("fast", "r", 2.0, 0))
    assert sorted(R.fastest_finish(6, mixed)).count("fast") == 4
    loaded = holders(("a", "r", 1.0, 3), ("b", "r", 1.0, 1))
    assert R.fastest_finish(2, loaded) == ["b", "b"]
    assert R.fastest_finish(0, []) == []
    with pytest.raises(ValueError):
        R.fastest_finish(1, [])


def test_region_shares_by_capacity_with_largest_remainder():
    hs = holders(("x/0", "x", 1.0, 0), ("x/1", "x", 1.0, 0), ("y/0", "y", 1.0, 0), ("z/0", "z", 2.0, 0))
    # capacities 2, 1, 2 of 5: 7 slots -> quotas 2.8, 1.4, 2.8 -> 2, 1, 2 + remainders to x, z
    assert R.region_shares(7, hs, ["x", "y", "z"]) == {"x": 3, "y": 1, "z": 3}
    # a tie in remainders goes to the first region in order
    assert R.region_shares(1, holders(("x/0", "x", 1.0, 0), ("y/0", "y", 1.0, 0)), ["y", "x"]) == {"x": 0, "y": 1}


def test_place_lost_slots_hardware_takes_a_spare_else_fastest_finish():
    survivors = holders(("a", "r0", 1.0, 2), ("b", "r1", 1.0, 1))
    assert R.place_lost_slots("replicate_resume", 2, survivors, ["s"], ["r0", "r1"]) == ["s", "s"]
    assert R.place_lost_slots("replicate_resume", 2, survivors, [], ["r0", "r1"]) == ["b", "a"]


def test_place_lost_slots_rack_loss_skips_the_stricken_region_and_ignores_spares():
    survivors = holders(("a/0", "a", 1.0, 1), ("a/1", "a", 1.0, 1), ("b/0", "b", 1.0, 1), ("c/0", "c", 1.0, 1))
    picks = R.place_lost_slots("shard_reweight_failover", 4, survivors, ["spare"], ["a", "b", "c"], lost_region="c")
    assert sorted(picks) == ["a/0", "a/0", "a/1", "b/0"]  # capacity a 2 : b 1 -> 2.67, 1.33 -> 3, 1
    # nothing left outside the stricken region: its survivors take them
    alone = holders(("c/1", "c", 1.0, 1))
    assert R.place_lost_slots("shard_reweight_failover", 2, alone, [], ["c"], lost_region="c") == ["c/1", "c/1"]


def test_park_destinations_spares_one_for_one_else_over_the_others():
    others = holders(("a", "r0", 1.0, 1), ("b", "r1", 1.0, 2))
    assert R.park_destinations([("x", 2)], others, ["s"], ["r0", "r1"]) == [("x", "s", 2)]
    assert R.park_destinations([("x", 2)], others, [], ["r0", "r1"]) == [("x", "a", 2)]
    region = R.park_destinations([("x", 1), ("y", 1)], others, ["s"], ["r0", "r1"])
    assert region == [("x", "a", 1), ("y", "a", 1)]  # one spare for two: spread (ties to the first region)


def test_straggler_rule_needs_the_factor_and_the_noise_floor():
    assert R.is_straggler(0.30, 0.10, 1.5)
    assert not R.is_straggler(0.14, 0.10, 1.5)          # under the factor
    assert not R.is_straggler(0.012, 0.005, 1.5)        # over the factor, under the noise floor
    assert R.straggler_excess_s(0.02, 1.5) == R.STRAGGLER_MIN_EXCESS_S
    assert R.straggler_excess_s(0.2, 1.5) == pytest.approx(0.1)
    assert R.probe_recovered(0.01, 0.2, 1.5) and not R.probe_recovered(0.2, 0.2, 1.5)


def test_resolve_schedule_fills_in_the_class_parameters():
    sc = load(SCENARIOS / "local-8.toml", ["faults.network_jitter.duration_s=9", "faults.partial_cluster_loss.nodes=1"])
    got = {r.cls: r for r in R.resolve_schedule(sc)}
    assert got["network_jitter"].spike_ms == 150.0 and got["network_jitter"].duration_s == 2.0  # the entry's own
    assert got["partial_cluster_loss"].nodes == 2
    assert got["data_shard_skew"].shard == 3 and got["data_shard_skew"].params() == {"shard": 3}
    assert got["hardware_fault"].params() == {}
    raw = sc.plain()
    del raw["faults"]["schedule"][1]["duration_s"], raw["faults"]["schedule"][2]["nodes"]
    got = {r.cls: r for r in R.resolve_schedule(from_dict(raw))}
    assert got["network_jitter"].duration_s == 9.0 and got["partial_cluster_loss"].nodes == 1  # the class's
    assert R.rack_victims(["a/0", "a/2", "a/3"], 2) == ["a/0", "a/2"]


def test_resolve_schedule_gives_a_coordinator_loss_its_one_target():
    sc = load(SCENARIOS / "local-8.toml", ['faults.schedule.0.class="coordinator_loss"',
                                           'faults.schedule.0.target="coordinator"'])
    raw = sc.plain()
    raw["faults"]["schedule"].append({"at_step": 9, "class": "coordinator_loss"})  # no target: the same
    got = [r for r in R.resolve_schedule(from_dict(raw)) if r.cls == "coordinator_loss"]
    assert [(r.index, r.target, r.params()) for r in got] == [(0, "coordinator", {}), (4, "coordinator", {})]
