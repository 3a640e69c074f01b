"""The metric functions every log goes through, on hand-made logs with known answers."""
import pytest

from keel.events import Event, EventLogError, read_events, validate_event, write_events
from keel import metrics
from keel.metrics import fault_free_step_time, summarize


def E(t, step, kind, fault=None, target=None, action=None, **detail):
    return Event(t, step, kind, fault, target, action, detail)


def absorbed_log():
    # 1 s a step; a node dies 0.5 s into step 4, detected at 1.5 s, resumed, step 4 redone.
    ev = [E(0.0, 0, "run_start", step_time_s=1.0)]
    ev += [E(float(k), k, "step") for k in range(1, 4)]
    ev += [E(3.5, 3, "fault", "hardware_fault", "a/1", fault_id=0),
           E(5.0, 3, "detect", "hardware_fault", "a/1", fault_id=0),
           E(5.0, 3, "recover_start", "hardware_fault", "a/1", "replicate_resume", fault_id=0),
           E(5.25, 3, "recover_end", "hardware_fault", "a/1", "replicate_resume", fault_id=0)]
    ev += [E(5.25 + k - 3, k, "step") for k in range(4, 11)]
    ev += [E(12.25, 10, "run_end")]
    return ev


def test_absorbed_fault_downtime_cost_goodput():
    s = summarize(absorbed_log())
    assert s["restarts"] == 0 and s["steps"] == 10 and s["wall_s"] == 12.25
    (f,) = s["faults"]
    assert f["action"] == "replicate_resume" and f["class"] == "hardware_fault"
    assert f["downtime_s"] == pytest.approx(6.25 - 3.5)
    # episode from the commit of step 3 (t=3) to the commit of step 4 (t=6.25): 3.25 s for 1 step
    assert f["cost_s"] == pytest.approx(2.25)
    assert f["lost_steps"] == 0
    assert s["goodput"] == pytest.approx(10 / 12.25)


def test_restart_counts_lost_steps_as_cost():
    ev = [E(0.0, 0, "run_start", step_time_s=1.0)]
    ev += [E(float(k), k, "step") for k in range(1, 6)]
    ev += [E(2.0, 2, "checkpoint_start"), E(2.0, 2, "checkpoint_end")]
    ev.sort(key=lambda e: (e.t, e.kind != "step"))
    ev += [E(5.5, 5, "fault", "hardware_fault", "a/0", fault_id=0),
           E(6.0, 5, "restart", "hardware_fault", "a/0", "checkpoint_restart", fault_id=0),
           E(16.0, 2, "recover_end", "hardware_fault", "a/0", "checkpoint_restart", fault_id=0)]
    ev += [E(16.0 + k - 2, k, "step") for k in range(3, 9)]
    ev += [E(22.0, 8, "run_end")]
    s = summarize(ev)
    (f,) = s["faults"]
    assert s["restarts"] == 1 and f["action"] == "checkpoint_restart"
    assert f["lost_steps"] == 3             # steps 3, 4, 5 recomputed
    assert f["downtime_s"] == pytest.approx(17.0 - 5.5)
    # from the commit of step 5 (t=5) to the commit of step 3 (t=17): 12 s, net -2 steps
    assert f["cost_s"] == pytest.approx(12.0 + 2.0)
    assert s["goodput"] == pytest.approx(8 / 22)


def test_step_time_estimated_from_clean_intervals():
    ev = [E(0.0, 0, "run_start")] + [E(2.0 * k, k, "step") for k in range(1, 6)]
    ev.insert(3, E(4.1, 2, "checkpoint_start"))
    ev += [E(10.0, 5, "run_end")]
    assert fault_free_step_time(ev) == pytest.approx(2.0)


def test_event_log_round_trip_and_schema_errors(tmp_path):
    path = tmp_path / "events.jsonl"
    write_events(path, absorbed_log())
    assert read_events(path) == absorbed_log()
    with pytest.raises(EventLogError, match="key 'kind': expected one of"):
        validate_event({"t": 0, "step": 0, "kind": "explode"})
    with pytest.raises(EventLogError, match="key 'fault'"):
        validate_event({"t": 0, "step": 0, "kind": "fault", "fault": "meteor"})
    path.write_text('{"t": 0, "step": 0, "kind": "run_start"}\nnot json\n')
    with pytest.raises(EventLogError, match=r"events.jsonl:2: not valid JSON"):
        read_events(path)


def test_step_time_when_every_interval_holds_a_checkpoint():
    ev = [E(0.0, 0, "run_start")]
    for k in range(1, 6):
        ev += [E(2.0 * k, k, "step"), E(2.0 * k, k, "checkpoint_start"), E(2.0 * k + 0.1, k, "checkpoint_end")]
    assert fault_free_step_time(ev) == pytest.approx(2.0)


def test_one_episode_walker():
    """`fault_episodes`: what summarize, validate, calibrate and the app read of an episode."""
    ev = absorbed_log()
    ev.insert(5, E(4.0, 3, "reslot", "hardware_fault", "a/1", "replicate_resume"))  # no fault_id: by class and target
    (ep,) = metrics.fault_episodes(ev)
    assert (ep["fault_id"], ep["class"], ep["target"], ep["action"], ep["t"], ep["at_step"]) == \
        (0, "hardware_fault", "a/1", "replicate_resume", 3.5, 3)
    assert ev[ep["first"]].kind == "fault" and ev[ep["last"]].kind == "recover_end" and ep["end_t"] == 5.25
    assert sorted(ep["first_of"]) == ["detect", "fault", "recover_end", "recover_start", "reslot"]
    assert metrics.since_fault_s(ep, "detect") == pytest.approx(1.5)
    assert metrics.since_fault_s(ep, "restart") is None


def test_pace_estimators():
    ev = [E(0.0, 0, "run_start")] + [E(1.0 + 0.5 * k + (0.2 if k == 3 else 0.0), k, "step") for k in range(1, 7)]
    assert metrics.clean_intervals(ev) == pytest.approx([0.5, 0.7, 0.3, 0.5, 0.5])
    assert metrics.median_clean_interval_s(ev) == pytest.approx(0.5)
    # the commits past the first two over the time they took: steps 2..6
    assert metrics.mean_step_s_after_warmup(ev) == pytest.approx((ev[-1].t - ev[3].t) / 3)
    assert metrics.mean_step_s_after_warmup(ev, warmup=0) == pytest.approx((ev[-1].t - ev[1].t) / 5)
    full = [(7, 0.3), (7, 0.2), (5, 0.9), (7, 0.1), (7, 0.1), (7, 0.1)]
    assert metrics.median_full_membership_interval_s(full, 7) == pytest.approx(0.1)   # 5 at 7, past the first 2
    assert metrics.median_full_membership_interval_s(full[:3], 7) == pytest.approx(0.25)  # the 2 at 7
    assert metrics.median_full_membership_interval_s([(5, 0.9), (5, 0.7), (5, 0.8)], 7) == pytest.approx(0.8)  # none
    assert metrics.median_full_membership_interval_s([], 7) is None


def test_goodput_is_at_most_one():
    """Steps quicker than the declared fault-free pace are not more than useful work: a
    fault-free run whose steps came in under the pace has goodput 1, never above."""
    ev = [Event(0.0, 0, "run_start")] + [Event(0.9 * k, k, "step") for k in range(1, 11)] \
        + [Event(9.0, 10, "run_end")]
    assert summarize(ev, step_time_s=1.0)["goodput"] == 1.0
    assert summarize(ev, step_time_s=0.45)["goodput"] == pytest.approx(0.5)
    assert metrics.goodput(10, 1.0, 0.0) == 0.0 and metrics.goodput(4, 1.0, 8.0) == 0.5


def test_open_at_end_lists_only_spikes_left_open():
    """A run closes at its end the latency spikes still open (their straggler still parked);
    not a spike that ended, nor the twin's fault on an idle spare (a `fault` and nothing else)."""
    def ev(t, step, kind, fault=None, target=None, fid=None):
        return Event(t, step, kind, fault, target, "x" if fault else None, {} if fid is None else {"fault_id": fid})
    events = [ev(0, 0, "run_start"), ev(1, 1, "step"),
              ev(1.5, 1, "fault", "network_jitter", "a/0", 0), ev(2, 2, "step"),
              ev(2.5, 2, "fault", "hardware_fault", "b/1", 1),
              ev(3, 2, "fault", "network_jitter", "a/1", 2), ev(3.5, 3, "reslot", "network_jitter", "a/1", 2),
              ev(4, 3, "recover_end", "network_jitter", "a/0", 0), ev(5, 4, "step")]
    assert metrics.open_at_end(events) == [2]
