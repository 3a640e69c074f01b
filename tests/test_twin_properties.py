"""Properties of the twin on random small scenarios: any policy, fault mix and layout gives an
ordered, schema-valid log that ends the run (or says it was stopped), with the summary
`keel.metrics` computes from it, and the same bytes twice."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import twin
from keel.events import validate_event
from keel.metrics import summarize
from keel.scenario import from_dict

pytestmark = pytest.mark.timeout(120)


@st.composite
def scenarios(draw):
    regions = [{"name": f"r{i}", "nodes": draw(st.integers(1, 5)), "speed": draw(st.sampled_from([1.0, 0.5, 2.0]))}
               for i in range(draw(st.integers(1, 3)))]
    links = [{"a": f"r{i}", "b": f"r{i + 1}", "rtt_ms": draw(st.sampled_from([1.0, 80.0]))}
             for i in range(len(regions) - 1)]
    nodes = sum(r["nodes"] for r in regions)
    steps = draw(st.integers(20, 600))
    kind = draw(st.sampled_from(["absorb", "checkpoint_restart"]))
    schedule = []
    for _ in range(draw(st.integers(0, 3))):
        cls = draw(st.sampled_from(["hardware_fault", "network_jitter", "partial_cluster_loss", "data_shard_skew",
                                    "coordinator_loss"]))
        region = draw(st.sampled_from(regions))
        target = {"hardware_fault": f"{region['name']}/{draw(st.integers(0, region['nodes'] - 1))}",
                  "network_jitter": f"{region['name']}/0", "partial_cluster_loss": region["name"],
                  "data_shard_skew": f"shard/{draw(st.integers(0, 15))}", "coordinator_loss": "coordinator"}[cls]
        entry = {"at_step": draw(st.integers(0, steps - 1)), "class": cls, "target": target}
        if cls == "network_jitter":
            entry.update(spike_ms=draw(st.sampled_from([50.0, 3000.0])), duration_s=draw(st.sampled_from([5.0, 200.0])))
        if cls == "partial_cluster_loss":
            entry["nodes"] = draw(st.integers(1, region["nodes"]))
        schedule.append(entry)
    raw = {
        "run": {"name": "prop", "seed": 0, "steps": steps},
        "workload": {"step_compute_s": 1.0, "compute_jitter": draw(st.sampled_from([0.0, 0.05])),
                     "gradient_bytes": 1_000_000_000, "slots": draw(st.integers(0, 2 * nodes))},
        "checkpoint": {"interval_steps": draw(st.integers(1, 300)), "mode": draw(st.sampled_from(["async", "sync"])),
                       "weights_bytes": 10_000_000_000, "optimizer_bytes": 0},
        "regions": regions,
        "links": links,
        "faults": {"hardware_fault": {"mtbf_node_hours": draw(st.sampled_from([0.0, 0.5, 20.0])),
                                      "repair_hours": draw(st.sampled_from([0.02, 1.0]))},
                   "network_jitter": {"per_day": draw(st.sampled_from([0.0, 300.0])), "duration_s": 30.0,
                                      "spike_ms": 2000.0},
                   "partial_cluster_loss": {"per_day": draw(st.sampled_from([0.0, 50.0])), "nodes": 2},
                   "data_shard_skew": {"per_day": draw(st.sampled_from([0.0, 100.0]))},
                   "coordinator_loss": {"per_day": draw(st.sampled_from([0.0, 200.0]))},
                   "schedule": schedule},
        "policy": {"kind": kind, "hot_spares": draw(st.integers(0, nodes - 1)), "restart_s": 20.0,
                   "replace_node_s": draw(st.sampled_from([0.0, 60.0])),
                   "quarantine": draw(st.booleans()),
                   "coordinator_restart_s": draw(st.sampled_from([0.5, 30.0]))},
    }
    return from_dict(raw, "prop"), draw(st.integers(0, 2**31))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_any_scenario_gives_a_consistent_log(case):
    scenario, seed = case
    result = twin.simulate(scenario, seed=seed)
    events = result.events
    assert [e.t for e in events] == sorted(e.t for e in events)
    for e in events:
        assert validate_event(e.to_dict()) == e
    assert events[0].kind == "run_start" and events[-1].kind == "run_end"
    s = result.summary
    if s["completed"]:
        assert events[-1].step == scenario.run.steps
    else:
        assert events[-1].step < scenario.run.steps
    assert {k: v for k, v in summarize(events).items()} == {k: s[k] for k in summarize(events)}
    assert s["restarts"] == sum(1 for e in events if e.kind == "restart")
    if scenario.policy.kind == "checkpoint_restart":
        assert all(f["action"] in ("checkpoint_restart", "endure", "fail_run") for f in s["faults"])
    fail_ids = {e.fault_id for e in events if e.kind == "fault" and e.action == "fail_run"}
    assert not fail_ids or not scenario.policy.quarantine
    if any(e.kind == "detect" and e.fault_id in fail_ids for e in events):
        assert not s["completed"]  # a bad shard without quarantine stops the run (FAIL_ACTION)
    ids = [e.fault_id for e in events if e.kind == "fault"]
    assert ids == list(range(len(ids)))
    if s["completed"]:  # a coordinator's successor always comes, and its episode ends
        lost = {e.fault_id for e in events if e.kind == "fault" and e.fault == "coordinator_loss"}
        assert lost <= {e.fault_id for e in events if e.kind == "recover_end"}
    again = twin.simulate(scenario, seed=seed)
    assert [e.to_json() for e in again.events] == [e.to_json() for e in events]
