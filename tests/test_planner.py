"""The planner: policy search on the twin (Young/Daly, the 46-node cluster, Pareto, CRN, Ray),
and the pieces of calibrate and validate that need no runtime (test_planner_runtime.py has
the ones that do)."""
import importlib.util
import json
import math
import subprocess

import pytest

from keel import scenario as S
from conftest import SCENARIOS, keel_cmd
from planner import scenarios as PS
from planner import search
from planner.replicas import SerialRunner, seeds_for, twin_summary

# One node, exponential failures (MTBF 2 h), a sync checkpoint of 40 GB at 2 GB/s (delta = 20 s),
# 5 s steps, ~110 failures a replica: Young/Daly's interval is sqrt(2 * 20 * 7200) = 537 s = 107 steps.
SINGLE_NODE = """
[run]
name = "single-node-exp"
seed = 3
steps = 144000
[workload]
step_compute_s = 5.0
gradient_bytes = 0
compute_jitter = 0.0
[checkpoint]
interval_steps = 50
mode = "sync"
weights_bytes = 20_000_000_000
optimizer_bytes = 20_000_000_000
write_gbyte_s = 2.0
read_gbyte_s = 4.0
[[regions]]
name = "solo"
nodes = 1
[faults.hardware_fault]
mtbf_node_hours = 2.0
repair_hours = 0.1
[policy]
kind = "checkpoint_restart"
restart_s = 60.0
replace_node_s = 0.0
"""


def big() -> S.Scenario:
    return S.load(SCENARIOS / "multiregion-46.toml")


# ----------------------------------------------------------------------------- closed forms, helpers

def test_young_daly_closed_form():
    s = S.loads(SINGLE_NODE)
    yd = PS.young_daly(s, step_time_s=5.0)
    assert yd["delta_s"] == pytest.approx(20.0)
    assert yd["mtbf_s"] == pytest.approx(7200.0)
    assert yd["interval_s"] == pytest.approx(math.sqrt(2 * 20.0 * 7200.0))
    assert yd["interval_steps"] == 107
    # the 46-node cluster: 44 training nodes at 5000 h, 0.05 rack losses and 0.5 NaN shards a day
    b = big()
    rate_h = 44 / 5000 + 0.05 / 24 + 0.5 / 24
    assert PS.job_mtbf_s(b, 8.0) == pytest.approx(3600 / rate_h)
    assert PS.checkpoint_write_s(b) == pytest.approx(1.68e12 / 44 / 2e9)


def test_hot_spares_are_extra_paid_nodes():
    b = big()
    more = PS.with_policy(b, {"policy.hot_spares": 4})
    assert more.training_nodes == b.training_nodes == 44
    assert more.total_nodes == 48 and more.regions[-1].nodes == 10
    assert PS.paid_nodes(more) == 48
    assert PS.spares_range(b)[0] == 0
    local = S.load(SCENARIOS / "local-8.toml")  # its rack loss takes both ap-southeast nodes
    assert PS.spares_range(local) == (1, 5)
    quiet = PS.schedule_only(b)
    assert quiet.faults.hardware_fault.mtbf_node_hours == 0 and quiet.faults.schedule == b.faults.schedule


def test_pareto_and_recommendation():
    pts = [{"goodput": 0.9, "cost_node_hours_per_step": 1.0}, {"goodput": 0.95, "cost_node_hours_per_step": 1.01},
           {"goodput": 0.97, "cost_node_hours_per_step": 1.2}, {"goodput": 0.94, "cost_node_hours_per_step": 1.05}]
    front = search.pareto(pts)
    assert [p["goodput"] for p in front] == [0.97, 0.95, 0.9]
    assert search.recommend(front, cost_slack=0.02)["goodput"] == 0.95
    assert search.recommend(front, cost_slack=0.5)["goodput"] == 0.97


def test_interval_fit_recovers_the_optimum():
    a, b, c = 1.0, 3.0, 3e-4  # optimum sqrt(b / c) = 100
    pts = [(t, a - b / t - c * t) for t in (50, 70, 90, 110, 150, 200)]
    assert search.fit_interval(pts)["tau"] == pytest.approx(100.0)
    assert search.fit_interval([(t, 0.9 + 1e-4 * t) for t in (10, 20, 30, 40)]) is None  # no interior optimum


def test_common_random_numbers():
    """Same seeds: one policy scores identically twice; two policies see the same fault times."""
    b = big()
    seeds = seeds_for(b.run.seed, 2)
    ev = search.Evaluator(scenario=b, seeds=seeds, runner=SerialRunner(twin_summary))
    policy = {"checkpoint.interval_steps": 150}
    first = ev.score(policy)
    ev.cache.clear()
    assert ev.score(policy) == first
    import twin
    stormy = S.loads(SINGLE_NODE, overrides=["run.steps=20000"])
    t1 = twin.simulate(PS.with_policy(stormy, {"checkpoint.interval_steps": 60}), seed=5).events
    t2 = twin.simulate(PS.with_policy(stormy, {"checkpoint.interval_steps": 200}), seed=5).events
    first_fault = lambda ev: next(e.t for e in ev if e.kind == "fault")  # noqa: E731
    assert first_fault(t1) == first_fault(t2)


# ----------------------------------------------------------------------------- the search

@pytest.mark.timeout(240)
def test_plan_single_node_finds_young_daly_interval():
    s = S.loads(SINGLE_NODE)
    result = search.run_plan(s, trials=12, replicas=8, processes=2, keys=["checkpoint.interval_steps"],
                             progress=False)
    yd = math.sqrt(2 * 20.0 * 7200.0) / 5.0  # steps, computed here from the closed form
    found = result["recommended"]["checkpoint.interval_steps"]
    assert abs(found - yd) / yd <= 0.10, (found, yd, result["interval_refinement"]["fit"])
    assert result["baseline"]["checkpoint.interval_steps"] == round(yd)


@pytest.mark.timeout(240)
def test_plan_46_nodes_beats_the_baseline():
    result = search.run_plan(big(), trials=16, replicas=4, processes=2, progress=False)
    rec, base = result["recommended"], result["baseline"]
    assert base["policy.kind"] == "checkpoint_restart"
    assert base["checkpoint.interval_steps"] == result["young_daly"]["interval_steps"]
    assert rec["goodput"] > base["goodput"]
    assert rec["cost_node_hours_per_step"] < base["cost_node_hours_per_step"]
    assert result["pareto"] and len(result["trials"]) >= 16
    front = {(p["goodput"], p["cost_node_hours_per_step"]) for p in result["pareto"]}
    for t in result["trials"]:  # nothing in the trials dominates a front point
        for g, c in front:
            assert not (t["goodput"] > g and t["cost_node_hours_per_step"] < c)
    # every candidate carries its policy as dotted keys, the seeds are common
    assert all(set(t["policy"]) <= set(search.ALL_KEYS) for t in result["trials"])
    assert result["seeds"] == seeds_for(7, 4)


@pytest.mark.timeout(120)
def test_plan_lists_each_policy_once_and_counts_agree():
    """Every candidate scored is one row: a policy met twice (the baseline and the enqueued
    Young/Daly trial, a grid point and a trial) is listed once; the recommended and the
    baseline name their row; the CLI's counts are the rows' count."""
    s = S.load(SCENARIOS / "local-8.toml")
    result = search.run_plan(s, trials=10, replicas=2, processes=1, progress=False)
    trials = result["trials"]
    assert sorted(t["number"] for t in trials) == list(range(len(trials)))
    hashes = [PS.with_policy(s, t["policy"]).config_hash() for t in trials]
    assert len(set(hashes)) == len(hashes)
    assert result["evaluations"] == len(trials) == sum(result["sources"].values())
    by_number = {t["number"]: t for t in trials}
    for tag in ("recommended", "baseline"):
        row = by_number[result[tag]["number"]]
        assert (row["goodput"], row["cost_node_hours_per_step"]) == (result[tag]["goodput"], result[tag]["cost_node_hours_per_step"])
    baseline = {"policy.kind": "checkpoint_restart", "checkpoint.interval_steps": result["young_daly"]["interval_steps"]}
    assert PS.with_policy(s, baseline).config_hash() == hashes[[t["number"] for t in trials].index(result["baseline"]["number"])]
    fit = (result["interval_refinement"] or {}).get("fit")
    front = {p["number"] for p in result["pareto"]}
    if fit is None:  # no fitted interval: the rule's choice on the front, grid included
        assert result["recommended"]["number"] in front
    text = search.table(result)
    assert f"{len(trials)} candidates (" in text.splitlines()[0]
    assert f"top 10 of {len(trials)}:" in text


def test_candidates_are_identified_by_the_scenario_they_make():
    s = S.load(SCENARIOS / "local-8.toml")
    ev = search.Evaluator(scenario=s, seeds=[1], runner=SerialRunner(twin_summary))
    cands = search.Candidates(ev=ev)
    own = {"policy.kind": s.policy.kind, "checkpoint.interval_steps": s.checkpoint.interval_steps}
    first = cands.add(own, {"goodput": 0.5, "cost_node_hours_per_step": 1.0}, "scenario")
    again = cands.add({"policy.kind": s.policy.kind}, {"goodput": 0.5, "cost_node_hours_per_step": 1.0}, "baseline")
    other = cands.add({"checkpoint.interval_steps": s.checkpoint.interval_steps + 1},
                      {"goodput": 0.4, "cost_node_hours_per_step": 1.0}, "tpe")
    assert again is first and first["source"] == "scenario" and other["number"] == 1
    assert len(cands.all()) == 2


@pytest.mark.timeout(240)
def test_plan_cli_json_and_out(tmp_path):
    out = tmp_path / "plan"
    p = subprocess.run(keel_cmd("plan", str(SCENARIOS / "multiregion-46.toml"), "--trials", "4", "--replicas", "2",
                                "--json", "--out", str(out)), capture_output=True, text=True, timeout=200)
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout)  # one JSON object on stdout, nothing else
    assert {"recommended", "baseline", "pareto", "trials"} <= set(result)
    assert "goodput" in result["recommended"] and "cost_node_hours_per_step" in result["baseline"]
    assert json.loads((out / "plan.json").read_text()) == result
    assert "plan: 4/4 trial (100 %)" in p.stderr  # progress on stderr: in a log, plain lines
    assert "\r" not in p.stderr
    bad = subprocess.run(keel_cmd("plan", str(SCENARIOS / "multiregion-46.toml"), "--trials", "0"),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--trials" in bad.stderr
    big_check = subprocess.run(keel_cmd("plan", str(SCENARIOS / "multiregion-46.toml"), "--validate"),
                               capture_output=True, text=True, timeout=60)
    assert big_check.returncode == 2 and "local scenario" in big_check.stderr


@pytest.mark.timeout(240)
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray (optional extra 'ray') is not installed")
def test_plan_replicas_as_ray_tasks():
    result = search.run_plan(big(), trials=3, replicas=2, ray_address="local", progress=False, refine=False)
    local = search.run_plan(big(), trials=3, replicas=2, processes=1, progress=False, refine=False)
    assert [t["goodput"] for t in result["trials"]] == [t["goodput"] for t in local["trials"]]


def test_twin_summary_job_is_small():
    r = twin_summary((S.loads(SINGLE_NODE, overrides=["run.steps=200"]), 1, None))
    assert set(r) >= {"goodput", "wall_s", "steps", "step_time_s", "restarts", "faults", "seed"}


# ----------------------------------------------------------------------------- validate's arithmetic

def _summary(downtimes, wall, goodput=0.8, step=0.1):
    classes = ["hardware_fault", "network_jitter", "partial_cluster_loss", "data_shard_skew"]
    return {"wall_s": wall, "goodput": goodput, "step_time_s": step, "restarts": 0, "steps": 60,
            "faults": [{"fault_id": i, "class": c, "target": f"t{i}", "action": "a", "at_step": 10 * i,
                        "downtime_s": d, "cost_s": d / 2} for i, (c, d) in enumerate(zip(classes, downtimes))]}


def test_compare_judges_median_downtime_error_and_wall_time():
    from planner.validate import compare
    s = S.load(SCENARIOS / "local-8.toml")
    predicted = {"reference": _summary([1, 1, 1, 1], 10.0), "seeds": [1, 2],
                 "replicas": [_summary([1.0, 1.0, 1.0, 1.0], 10.0), _summary([1.0, 1.0, 1.0, 1.0], 10.2)]}
    # one fault far off, three within 5 %: the median error passes; wall 10.1 vs 10.0 passes
    observed = [_summary([0.96, 1.04, 3.0, 1.0], 10.0), _summary([0.96, 1.04, 3.0, 1.0], 10.05),
                _summary([0.95, 1.05, 3.2, 1.0], 9.9)]
    c = compare(s, predicted, observed, "cal.json", "given")
    assert [f["observed"]["downtime_s"] for f in c["faults"]] == [0.96, 1.04, 3.0, 1.0]
    assert c["faults"][2]["downtime_rel_err"] == pytest.approx(2 / 3)
    assert c["downtime_median_rel_err"] == pytest.approx((1 - 0.96) / 0.96 / 2 + (1.04 - 1) / 1.04 / 2)
    assert c["wall_s"]["rel_err"] == pytest.approx(0.01)
    # the third fault is 67 % off: the median passes, every-fault does not
    assert c["pass"] == {"downtime": True, "each_fault": False, "wall": True, "valid": True, "all": False}
    close = [_summary([0.96, 1.04, 1.1, 1.0], 10.0)] * 3
    assert compare(s, predicted, close, "cal.json", "given")["pass"]["all"] is True
    late = [{**o, "emulation": {"faithful": False, "overruns": 9, "reports": 100}} for o in close]
    assert compare(s, predicted, late, "cal.json", "given")["pass"] == {
        "downtime": True, "each_fault": True, "wall": True, "valid": False, "all": False}
    slow = [_summary([0.96, 1.04, 3.0, 1.0], 11.0)] * 3
    assert compare(s, predicted, slow, "cal.json", "given")["pass"]["wall"] is False
    json.dumps(c, allow_nan=False)


def test_detect_times_come_from_the_episode_walker():
    from keel.events import Event
    from planner.validate import detect_times
    ev = [Event(0.0, 0, "run_start", None, None, None, {}),
          Event(1.0, 2, "fault", "hardware_fault", "a/1", None, {"fault_id": 0}),
          Event(1.25, 2, "detect", "hardware_fault", "a/1", None, {"fault_id": 0}),
          Event(1.5, 2, "detect", "hardware_fault", "a/1", None, {"fault_id": 0}),
          Event(2.0, 3, "fault", "network_jitter", "a/2", None, {"fault_id": 1}),
          Event(3.0, 3, "detect", "data_shard_skew", "shard/1", None, {"fault_id": 7})]  # no such fault
    assert detect_times(ev) == {0: 0.25}


def test_validate_uses_an_existing_calibration_of_the_same_emulated_cluster(tmp_path, monkeypatch):
    from keel.errors import InputError
    from planner.validate import emulated, resolve_calibration
    sc = emulated(S.load(SCENARIOS / "multiregion-12.toml"))
    cal = {"reference": {"nodes": sc.total_nodes, "time_scale": sc.emulation.time_scale},
           "primitives": {"reform_s": {"median": 1.0}}}
    (tmp_path / "calibration.json").write_text(json.dumps(cal))
    got, path, how = resolve_calibration(None, tmp_path, False, sc)
    assert got == cal and how == "existing" and path.endswith("calibration.json")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "fresh"
    got, path, how = resolve_calibration(None, out, False, sc, measure=lambda **kw: cal)
    assert how == "existing"  # ./calibration.json
    # one of another time scale is not this cluster's: measured anew, and refused when given
    other = {**cal, "reference": {"nodes": sc.total_nodes, "time_scale": 0.5}}
    (tmp_path / "calibration.json").write_text(json.dumps(other))
    got, path, how = resolve_calibration(None, out, False, sc, measure=lambda **kw: cal)
    assert how == "measured" and (out / "calibration.json").exists()
    with pytest.raises(InputError, match=r"reference.time_scale': measured at 0.5, this scenario has 0.25"):
        resolve_calibration(str(tmp_path / "calibration.json"), out, False, sc)


@pytest.mark.parametrize("command", ["validate", "calibrate"])
def test_validate_and_calibrate_refuse_what_the_runtime_would_before_any_run(command, tmp_path):
    """runtime.api.check_runnable, the check `keel run` makes, before a calibration or a
    repetition starts: exit 2 naming the key, and no run directory written."""
    out = tmp_path / "out"
    proc = subprocess.run(keel_cmd(command, str(SCENARIOS / "multiregion-12.toml"), "--set", "data.shards=100000",
                                   "--out", str(out)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "key 'data.shards': expected at most" in proc.stderr
    assert not (out / "runtime").exists()
