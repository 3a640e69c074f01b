"""Parity: the twin and the runtime decide the same on the same inputs (keel/recovery.py is
the one place the rules live; these tests run both sides on one scenario and compare).

The runtime's slot decisions are checked through its pure planner (runtime.coordinator.planning,
what the coordinator calls when a generation ends); its per-fault actions through a real run."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

import twin
from keel.errors import RunFailed
from keel.events import read_events
from keel.scenario import loads
from runtime.coordinator.planning import Loss, View, WorkerView, initial_slot_map, plan_generation

REPO = Path(__file__).resolve().parents[1]

# three regions with different GPU counts and speeds: a region's capacity is its nodes' speed
REGIONS = [("r0", 2, 8, 1.0), ("r1", 2, 1, 2.0), ("r2", 3, 4, 1.0)]


def mixed(faults: str, *, slots: int = 14, hot_spares: int = 0, extra: str = "") -> str:
    text = f'[run]\nname = "parity"\nseed = 3\nsteps = 30\n[workload]\nslots = {slots}\nstep_compute_s = 1.0\n'
    for name, nodes, gpus, speed in REGIONS:
        text += f'[[regions]]\nname = "{name}"\nnodes = {nodes}\ngpus_per_node = {gpus}\nspeed = {speed}\n'
    text += '[[links]]\na = "r0"\nb = "r1"\nrtt_ms = 10.0\n[[links]]\na = "r1"\nb = "r2"\nrtt_ms = 10.0\n'
    text += f"[policy]\nhot_spares = {hot_spares}\n{extra}\n{faults}"
    return text


def twin_moves(sc, kind: str = "reslot") -> Counter:
    """Slots per receiver in the twin's first `reslot` event."""
    e = next(e for e in twin.simulate(sc).events if e.kind == kind)
    return Counter({name: int(k) for name, k in (x.rsplit(":", 1) for x in e.detail["to"])})


def runtime_view(sc, dead=(), losses=None, **kw) -> tuple[View, dict]:
    nodes = tuple(sc.node_names)
    workers = {n: WorkerView(committed=5) for n in nodes}
    base = View(nodes=nodes, region_speed={r.name: r.speed for r in sc.regions}, slot_map={}, workers=workers,
                committed=5)
    layout = initial_slot_map(base, sc.training_nodes, sc.slot_count)
    workers.update({n: WorkerView(alive=False) for n in dead})
    return View(nodes=nodes, region_speed=base.region_speed, slot_map={m: tuple(s) for m, s in layout.items()},
                workers=workers, committed=5, losses=losses or {}, **kw), layout


def runtime_moves(plan, fault_id) -> Counter:
    return Counter(dst for _, _, dst in plan.moves[fault_id])


def test_a_rack_loss_is_split_the_same_with_mixed_gpus_per_node():
    """Failed before keel/recovery.py: the twin split by speed x GPUs (r0 took all four slots),
    the runtime by nodes x speed over every surviving region, the stricken one included."""
    sc = loads(mixed('[[faults.schedule]]\nat_step = 5\nclass = "partial_cluster_loss"\ntarget = "r2"\nnodes = 2\n',
                     slots=28))
    predicted = twin_moves(sc)
    view, _ = runtime_view(sc, dead=("r2/0", "r2/1"),
                           losses={n: Loss(0, "shard_reweight_failover", "r2") for n in ("r2/0", "r2/1")})
    decided = runtime_moves(plan_generation(view), 0)
    assert predicted == decided
    assert set(decided) <= {"r0/0", "r0/1", "r1/0", "r1/1"}  # not the stricken region's survivor
    by_region = Counter()
    for n, k in decided.items():
        by_region[n.split("/")[0]] += k
    assert by_region["r1"] > by_region["r0"]  # r1's nodes are twice as fast; GPUs do not count


def test_a_killed_worker_without_a_spare_goes_to_the_same_nodes():
    """Failed before: the runtime spread a lone kill over regions, the twin gave it to the
    fastest finish."""
    sc = loads(mixed('[[faults.schedule]]\nat_step = 5\nclass = "hardware_fault"\ntarget = "r0/0"\n'))
    predicted = twin_moves(sc)
    view, layout = runtime_view(sc, dead=("r0/0",), losses={"r0/0": Loss(0, "replicate_resume", "r0/0")})
    assert sum(predicted.values()) == len(layout["r0/0"])
    assert predicted == runtime_moves(plan_generation(view), 0)


def test_a_straggler_goes_to_the_free_spare_on_both_sides():
    """Failed before: the runtime never parked a straggler on an idle spare."""
    sc = loads(mixed('[[faults.schedule]]\nat_step = 5\nclass = "network_jitter"\ntarget = "r0/0"\n'
                     'spike_ms = 3000.0\nduration_s = 900.0\n', slots=12, hot_spares=1))
    predicted = twin_moves(sc)
    view, layout = runtime_view(sc, to_park={"r0/0": 0})
    decided = runtime_moves(plan_generation(view), 0)
    assert predicted == decided == Counter({"r2/2": len(layout["r0/0"])})


def test_the_straggler_rule_in_the_form_each_side_uses():
    """The runtime judges a measured time per slot (is_straggler); the twin predicts a spike's
    extra delay per slot and asks whether it is over straggler_excess_s. Both forms are one rule."""
    from keel.recovery import is_straggler, straggler_excess_s
    from runtime.coordinator.stragglers import StragglerWatch
    for median in (0.003, 0.02, 0.08, 0.5, 2.0):
        for factor in (1.2, 1.5, 3.0):
            for extra in (0.001, 0.03, 0.05, 0.2, 0.9, 5.0):
                twin_says = extra > straggler_excess_s(median, factor)
                assert is_straggler(median + extra, median, factor) == twin_says, (median, factor, extra)
                watch = StragglerWatch(factor=factor, window=3)
                reps = {"a": {"ready_s": median, "slots": 1}, "b": {"ready_s": median, "slots": 1},
                        "c": {"ready_s": 2 * (median + extra), "slots": 2}}
                assert watch.judge(reps, may_park=False)[-1].slow == twin_says


def test_the_straggler_rule_judges_each_worker_against_its_own_speed():
    """On a cluster of mixed speeds each side judges a worker against its own pace: the runtime
    the measured time per slot against the median nominal pace over the worker's speed, the
    twin a spike's delay per slot against straggler_excess_s of the slot's compute on that node.
    A node slow by its region's speed is no straggler (sweep member 3/8, 7 Dec: a node of a
    region at speed 0.8, factor 1.3, 5 % compute jitter, judged against the raw median: parked
    and back at once, three times a run)."""
    from keel.recovery import own_pace_s, straggler_excess_s
    from runtime.coordinator.stragglers import StragglerWatch
    nominal = 0.5
    for speed in (0.5, 0.8, 1.0, 1.25, 2.0):
        for factor in (1.3, 1.5, 2.0):
            for extra in (0.0, 0.03, 0.1, 0.2, 0.4, 1.0):
                twin_says = extra > straggler_excess_s(own_pace_s(nominal, speed), factor)
                watch = StragglerWatch(factor=factor, window=1, speeds={"a": 1.0, "b": 1.25, "c": 1.0, "d": speed})
                reps = {"a": {"ready_s": nominal, "slots": 1}, "b": {"ready_s": 2 * nominal / 1.25, "slots": 2},
                        "c": {"ready_s": nominal, "slots": 1},
                        "d": {"ready_s": 2 * (nominal / speed + extra), "slots": 2}}
                assert {v.node: v.slow for v in watch.judge(reps, may_park=False)} == \
                    {"a": False, "b": False, "c": False, "d": twin_says}, (speed, factor, extra)
    # the member of 3/8: 5 % over its own pace at speed 0.8 is not slow, a factor of 1.3 over the raw median
    watch = StragglerWatch(factor=1.3, window=1, speeds={"a": 1.0, "b": 1.0, "c": 0.8})
    reps = {"a": {"ready_s": 1.0, "slots": 1}, "b": {"ready_s": 1.0, "slots": 1}, "c": {"ready_s": 1.05 / 0.8, "slots": 1}}
    assert not any(v.slow or v.park for v in watch.judge(reps, may_park=True))


@pytest.mark.timeout(180)
def test_actions_for_jitter_under_restart_and_a_bad_shard_without_quarantine(tmp_path):
    """Failed before: under checkpoint_restart the runtime labelled a spike backpressure_reslot
    (the twin: None), and with policy.quarantine = false the twin predicted a restart while the
    runtime failed the run. Now both say `endure` and `fail_run`, and both stop at the bad step."""
    from runtime.api import run_scenario
    from runtime_helpers import scenario
    sc = scenario(steps=12, policy="checkpoint_restart", quarantine=False,
                  faults=[{"at_step": 2, "class": "network_jitter", "target": "a/0", "spike_ms": 50.0, "duration_s": 0.5},
                          {"at_step": 6, "class": "data_shard_skew", "target": "shard/2"}])
    result = twin.simulate(sc)
    predicted = {e.fault: e.action for e in result.events if e.kind == "fault"}
    with pytest.raises(RunFailed, match="policy.quarantine is false"):
        run_scenario(sc, tmp_path / "run", progress=False, hangs="")
    observed_events = read_events(tmp_path / "run" / "events.jsonl")
    observed = {e.fault: e.action for e in observed_events if e.kind == "fault"}
    assert predicted == observed == {"network_jitter": "endure", "data_shard_skew": "fail_run"}
    assert not result.summary["completed"]
    assert result.events[-1].step == max(e.step for e in observed_events if e.kind == "step") == 6


@pytest.mark.timeout(180)
def test_a_coordinator_loss_is_one_episode_of_the_same_shape_on_both_sides(tmp_path):
    """Issue 13: the coordinator killed at a step, in the twin and in the runtime (whose
    supervisor starts a successor): one episode, the same action and event kinds, a
    recover_end with the same detail just before the next commit, and calibrate_fit reads
    coordinator_restart_s (its ack_s) off either log."""
    from planner.calibrate_fit import run_samples
    from runtime_helpers import run, scenario
    kw = dict(steps=60, interval=100, faults=[{"at_step": 6, "class": "coordinator_loss"}])
    predicted = twin.simulate(scenario(**kw)).events
    summary, observed = run(tmp_path, "run", **kw)
    assert summary["restarts"] == 0
    for events in (predicted, observed):
        episode = [e for e in events if e.fault == "coordinator_loss"]
        assert [e.kind for e in episode] == ["fault", "detect", "recover_start", "recover_end"]
        assert {e.action for e in episode} == {"coordinator_failover"} and episode[0].detail["mode"] == "kill"
        end = episode[-1]
        assert {"downtime_s", "detect_s", "ack_s", "reform_s", "state_s", "redo_s", "gen"} <= set(end.detail)
        assert events[events.index(end) + 1].kind == "step"
        assert len(run_samples(events)["coordinator_restart_s"]) == 1


def test_a_spare_gets_its_state_from_its_own_region_on_both_sides():
    """keel.recovery.state_source_region, as the runtime's coordinator applies it
    (generations.state_source: the sending rank) and as the twin prices the copy
    (StepCost.transfer_s: from the spare's own region, at the NIC's bandwidth, not over a
    200 Gbit/s link from us-east/0, the first member)."""
    from types import SimpleNamespace
    from keel import hardware, recovery as R
    from keel.scenario import load
    from runtime.coordinator import generations
    from twin.cluster import Cluster
    from twin.cost import StepCost
    from twin.params import TwinParams
    from twin.topology import Topology
    from conftest import SCENARIOS
    sc = load(SCENARIOS / "multiregion-46.toml")
    lat = lambda a, b: hardware.message_latency_s(sc, a, b)  # noqa: E731
    assert R.state_source_region(["us-east", "us-west", "ap-southeast"], ["ap-southeast"], lat) == "ap-southeast"
    assert R.state_source_region(["us-east", "us-west"], ["ap-southeast"], lat) == "us-west"  # 85 ms, not 107.5
    assert R.state_source_region(["us-east", "us-west"], [], lat) == "us-east"
    # the runtime: members in scenario order, the spare ap-southeast/6 behind
    members = [n for n in sc.node_names if n not in ("us-east/3", "ap-southeast/7")]
    live = [SimpleNamespace(node=n, committed=0 if n == "ap-southeast/6" else 5) for n in members]
    fake = SimpleNamespace(region_of={n: n.rsplit("/", 1)[0] for n in sc.node_names}, sc=sc)
    source = generations.state_source(fake, live, 5, False)
    assert live[source].node == "ap-southeast/0"
    # the twin: the same copy costs the spare's own NIC, not the inter-region link
    topo = Topology(sc)
    cluster = Cluster(sc, sc.workload.step_compute_s)
    cost = StepCost(sc, TwinParams.from_scenario(sc, topology=topo), topo, cluster)
    spare = cluster.nodes["ap-southeast/6"]
    cluster.update(cluster.nodes["us-east/3"], up=False, role="down", slots=0)
    cluster.update(spare, role="train", slots=1)
    nbytes = hardware.state_copy_bytes(sc, 1)
    assert cost.transfer_s([("ap-southeast/6", 1)]) == pytest.approx(
        lat("ap-southeast", "ap-southeast") + nbytes / hardware.node_bytes_s(sc, "ap-southeast"))


@pytest.mark.parametrize("window", [1, 2, 4])
def test_the_straggler_window_parks_after_as_many_slow_steps_on_both_sides(window):
    """The window (keel.recovery: in_a_row, window_full, window_end_step) is one rule: the twin
    moves a spiked node's slots and the runtime's watch parks a straggler at the step that
    fills `window` slow steps from the first slow one."""
    from keel import recovery as R
    from runtime.coordinator.stragglers import StragglerWatch
    base = loads((REPO / "scenarios/local-8.toml").read_text())
    k = next(i for i, e in enumerate(base.faults.schedule) if e.class_ == "network_jitter")
    # a spike that outlasts the widest window (each of a step's collectives pays it)
    sc = loads((REPO / "scenarios/local-8.toml").read_text(),
               overrides=[f"policy.straggler_window={window}", f"faults.schedule.{k}.duration_s=10.0"])
    spike = [e for e in twin.simulate(sc).events if e.fault == "network_jitter"]
    detect = next(e.step for e in spike if e.kind == "detect")
    moved = next(e.step for e in spike if e.kind == "recover_start")
    watch = StragglerWatch(sc.policy.straggler_factor, window)
    reports = {"a": {"ready_s": 0.1, "slots": 1}, "b": {"ready_s": 0.1, "slots": 1}, "c": {"ready_s": 0.5, "slots": 1}}
    first = R.first_judged_step(10)
    parked = next(k for k in range(first, first + 10) if any(v.park for v in watch.judge(reports, True)))
    assert moved == R.window_end_step(detect, window)
    assert parked == R.window_end_step(first, window)


# ----------------------------------------------------------------------------- the straggler watch, step by step

def _emulated_reports(sc, slots: dict[str, int], step: int, spike: tuple[str, float] | None) -> dict[str, dict]:
    """The step reports an emulated run's workers send for 1-based step `step` (runtime/worker.py):
    each one's emulated compute and its gate's delay, with `spike` = (target, spike_ms) on, in
    the members' order."""
    import time
    from keel.scenario import is_node, region_of
    from runtime.emulation.node import NodeEmulation
    from runtime.inject import CommGate
    reports = {}
    for node, k in slots.items():
        gate = CommGate(sc.run.seed, node, sleeps=False)
        if spike is not None and (node == spike[0] if is_node(spike[0]) else region_of(node) == spike[0]):
            gate.start(0, spike[1], 1e6, "node" if is_node(spike[0]) else "region")
        compute = NodeEmulation(sc, node, time.monotonic(), 1.0).compute_s(k, step - 1)
        reports[node] = {"ready_s": compute + gate.delay(step - 1), "slots": k}
    return reports


def _runtime_watch(sc, gated: range, spike: tuple[str, float], ended_before: int | None = None) -> list[tuple]:
    """The runtime's straggler watch (runtime/coordinator/faults.py `watch_stragglers`, with a
    coordinator reduced to what it reads) over the first generation's steps, on the reports its
    emulated workers send with the spike delaying the steps in `gated`, its episode open from
    the start (and ended just before step `ended_before` commits, as the runtime ends a spike
    that made no straggler): [("detect", step), ("park", step, node, attributed),
    ("recover_end", step)], up to the first park (which aborts the generation)."""
    from types import SimpleNamespace
    from keel import recovery as R
    from keel.scenario import is_node, region_of
    from runtime.coordinator import faults
    from runtime.coordinator.episodes import EpisodeBook, Stage
    from runtime.coordinator.stragglers import StragglerWatch
    sim = twin.model.Simulation(sc, twin.params.TwinParams.from_scenario(sc), 1)
    slots = {n.name: n.slots for n in sim.cluster.active() if n.slots > 0}
    book = EpisodeBook()
    ep = book.new("network_jitter", spike[0], "backpressure_reslot", t=0.0)
    ep.nodes = [n for n in sc.node_names if (n == spike[0] if is_node(spike[0]) else region_of(n) == spike[0])]
    log: list[tuple] = []
    step = 0
    state = SimpleNamespace(watch=StragglerWatch(sc.policy.straggler_factor, sc.policy.straggler_window,
                                                 sc.node_speeds),
                            slot_map={n: [0] * k for n, k in slots.items()}, book=book, to_park={}, gen=0)
    state.watch.new_generation(list(slots))

    def end(e, before=False):  # an event's step: the steps committed when it is written
        e.stage = Stage.ENDED
        log.append(("recover_end", step - 1 if before else step))
    c = SimpleNamespace(state=state, policy=sc.policy, now=lambda: float(step), abort=lambda: None, end_episode=end,
                        emit_ep=lambda kind, e, **d: log.append((kind, step)) if kind == "detect" else None)
    for step in range(R.first_judged_step(0), sc.run.steps + 1):
        if step == ended_before and not ep.detected:
            end(ep, before=True)
        faults.watch_stragglers(c, _emulated_reports(sc, slots, step, spike if step in gated else None))
        if state.to_park:
            (node, fid), = state.to_park.items()
            return log + [("park", step, node, fid is not None)]
    return log


def _twin_watch(events) -> list[tuple]:
    """The same, from the twin's event log: its spike's detection, first park and its end."""
    out: list[tuple] = []
    for e in events:
        if e.fault == "network_jitter" and e.kind in ("detect", "recover_end") and not e.detail.get("at_run_end"):
            out.append((e.kind, e.step))
        elif e.kind == "reslot" and "parked" in e.detail:
            return out + [("park", e.step, e.detail["parked"], e.fault is not None)]
    return out


def _sweep_member_2_19(**overrides):
    from planner.scenario_gen import generate
    sc, _ = generate(2, 19, 40)
    return sc.with_overrides(overrides) if overrides else sc


def test_a_step_a_spike_slowed_is_judged_at_its_commit_after_the_spike_on_both_sides():
    """Sweep member 2/19 (seed 2, 7 Dec: wall 6.2 %, failed): a 282 ms spike on eu-west for
    0.59 s delays step 7's gate and is over before step 7 commits. The runtime judged step 7 at
    its commit on each worker's own draw of the delay, parked eu-west/2 (window 1) on the
    region's spare and brought it back at its first good probe; the twin dropped its watch at
    the spike's end and predicted nothing. Both sides now: the episode ends before that commit,
    and the park is a re-slot of no fault."""
    sc = _sweep_member_2_19()
    events = twin.simulate(sc).events
    jitter = [e for e in events if e.fault == "network_jitter"]
    assert [e.kind for e in jitter] == ["fault", "recover_end"] and jitter[1].step == 6  # ended before 7's commit
    parks = [e for e in events if e.kind == "reslot" and e.detail.get("reason") == "straggler"]
    assert [(e.step, e.fault, e.target, bool(e.detail.get("back"))) for e in parks] == \
        [(7, None, "eu-west/2", False), (7, None, "eu-west/2", True)]
    assert parks[0].detail["to"] == ["eu-west/5:1"]  # the region's spare
    assert _twin_watch(events) == _runtime_watch(sc, range(7, 8), ("eu-west", 282.0), ended_before=7) == \
        [("recover_end", 6), ("park", 7, "eu-west/2", False)]


@pytest.mark.parametrize("target,spike_ms,factor,window", [
    ("eu-west", 282.0, 1.5, 1), ("eu-west", 282.0, 1.5, 2), ("eu-west", 330.0, 1.5, 3), ("eu-west", 250.0, 1.3, 2),
    ("us-west", 600.0, 2.0, 1), ("eu-west/3", 300.0, 1.5, 2), ("us-east/1", 200.0, 1.3, 1),
    # found slow, never a window in a row: the episode ends once its nodes are fine for a window
    ("eu-west", 240.0, 1.5, 2), ("eu-west", 255.0, 1.5, 3), ("eu-west/3", 255.0, 1.5, 2), ("eu-west", 270.0, 1.5, 3)])
def test_the_twin_judges_each_step_as_the_runtimes_watch_does(target, spike_ms, factor, window):
    """A spike that outlasts the run from step 7 on: the twin's detection, first park (step,
    node) or the episode's end where nothing is parked are those of the runtime's watch on the
    reports its emulated workers send (each one's compute and gate's delay of its own draws,
    keel.scenario), judged by the one rule (keel.recovery.judge_step, spike_settled) in the
    members' order."""
    sc = _sweep_member_2_19(**{
        "faults.schedule": [{"at_step": 6, "class": "network_jitter", "target": target, "spike_ms": spike_ms,
                             "duration_s": 1000.0}],
        "policy.straggler_factor": factor, "policy.straggler_window": window})
    predicted = _twin_watch(twin.simulate(sc).events)
    assert predicted == _runtime_watch(sc, range(7, sc.run.steps + 1), (target, spike_ms))
    assert predicted[0][0] == "detect" and predicted[-1][0] in ("park", "recover_end")


@pytest.mark.parametrize("spike_ms,window", [(900.0, 2), (60.0, 1)])
def test_a_big_cluster_is_judged_on_its_spiked_members_as_the_runtime_judges_it(monkeypatch, spike_ms, window):
    """Over twin.stragglers.EXACT_MEDIAN_MEMBERS members the twin draws the compute of the
    spiked members only and judges them against the nominal pace (drawing every member at
    every spiked step cost members x steps); the runtime's watch, on every member's report
    and their median, decides the same for a spike well over the rule (parked after the
    window) and one under it (never slow)."""
    from keel.scenario import from_dict
    import twin.stragglers as S
    raw = _sweep_member_2_19().to_dict()
    for region, nodes in zip(raw["regions"], (30, 30, 40)):
        region["nodes"] = nodes
    raw["workload"]["slots"] = 0  # one a training node
    raw["faults"]["schedule"] = [{"at_step": 6, "class": "network_jitter", "target": "eu-west/7",
                                  "spike_ms": spike_ms, "duration_s": 1000.0}]
    raw["policy"]["straggler_window"] = window
    sc = from_dict(raw, "big")
    drawn: set[str] = set()
    real = S.compute_factor
    monkeypatch.setattr(S, "compute_factor", lambda seed, node, *a: drawn.add(node) or real(seed, node, *a))
    predicted = _twin_watch(twin.simulate(sc).events)
    assert drawn == {"eu-west/7"}  # the spiked member's compute, no one else's
    assert predicted == _runtime_watch(sc, range(7, sc.run.steps + 1), ("eu-west/7", spike_ms))
    assert predicted == ([("detect", 7), ("park", 6 + window, "eu-west/7", True)] if spike_ms > 500 else [])
