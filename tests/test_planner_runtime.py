"""The planner against the real runtime: calibrate measures a complete file, validate passes
its default tolerances on scenarios/local-8.toml, plan --validate confirms the predicted
ordering. Real processes; every test has a timeout."""
import datetime
import importlib.util
import json
import os
import subprocess

import pytest

from conftest import SCENARIOS, keel_cmd

pytestmark = pytest.mark.skipif(importlib.util.find_spec("runtime.api") is None,
                                reason="runtime.api (the runtime's entry point) is not there yet")

PRIMITIVES = ("slot_compute_s", "reduce_latency_s", "reduce_gbyte_s", "detect_kill_s", "detect_hang_s",
              "reform_s", "state_transfer_gbyte_s", "spare_takeover_s", "ckpt_snapshot_gbyte_s",
              "ckpt_write_gbyte_s", "ckpt_read_gbyte_s", "restart_s", "step_overhead_s")


def _keel(*args: str, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(keel_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    """One quick calibration, shared by the tests below (it takes a few real runs)."""
    path = tmp_path_factory.mktemp("calibration") / "calibration.json"
    p = _keel("calibrate", "--out", str(path), "--json", timeout=480, env={"KEEL_CALIBRATE_QUICK": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    return path, json.loads(p.stdout)


@pytest.mark.timeout(540)
def test_calibrate_writes_a_complete_file(calibration):
    path, printed = calibration
    cal = json.loads(path.read_text())
    assert cal == printed
    for name in PRIMITIVES:
        e = cal["primitives"][name]
        assert e["unit"] in ("s", "GB/s"), name
        assert e["samples"] and all(isinstance(x, float) for x in e["samples"]), name
        assert e["spread"][0] <= e["median"] <= e["spread"][1], name
        assert e["median"] >= 0 and (e["unit"] == "s" or e["median"] > 0), name
    assert cal["missing"] == []
    assert cal["primitives"]["detect_hang_s"]["median"] > cal["primitives"]["detect_kill_s"]["median"]
    assert {"platform", "cpu_count", "hostname"} <= set(cal["machine"])
    assert {"python", "torch", "numpy"} <= set(cal["versions"])
    assert datetime.datetime.fromisoformat(cal["created"]).tzinfo is not None
    from twin.params import TwinParams, load_calibration
    from keel import scenario as S
    params = TwinParams.from_scenario(S.load(SCENARIOS / "local-8.toml"), load_calibration(path))
    assert set(PRIMITIVES) <= set(params.calibrated)


@pytest.fixture(scope="module")
def validation(calibration, tmp_path_factory):
    """One `keel validate` of local-8 (its seven runtime repetitions), shared by the tests below."""
    path, _ = calibration
    out = tmp_path_factory.mktemp("validate") / "validate"
    p = _keel("validate", str(SCENARIOS / "local-8.toml"), "--calibration", str(path), "--out", str(out), "--json",
              timeout=900)
    assert p.returncode in (0, 1), p.stderr[-3000:]
    return out, p, json.loads(p.stdout)


@pytest.mark.timeout(1440)
def test_validate_writes_a_complete_comparison_and_a_consistent_verdict(validation):
    out, p, comparison = validation
    assert json.loads((out / "comparison.json").read_text()) == comparison
    assert (out / "twin" / "events.jsonl").exists() and (out / "twin" / "summary.json").exists()
    from keel import scenario as S
    local = S.load(SCENARIOS / "local-8.toml")
    n = local.validate.repetitions
    for k in range(comparison["repetitions"]):
        assert (out / "runtime" / f"rep-{k}" / "events.jsonl").exists()
    assert comparison["repetitions"] == n and comparison["calibration_source"] == "given"
    # every judged run is bracketed by pace runs; one across which the pace moved is set aside
    brackets, aside = comparison["pace_brackets"], comparison["set_aside"]
    assert len(brackets) == n and len(comparison["pace_runs"]) == n + len(aside) + 1
    assert len(aside) <= local.validate.reruns
    tol = local.validate.pace_steady_tol
    for a in aside:
        assert a["change"] > tol and (out / "runtime" / a["dir"].rsplit("/", 1)[-1] / "events.jsonl").exists()
    for b in brackets:
        assert b["after"] == b["before"] + 1 and b["steady"] == (b["change"] <= tol)
        assert b["steady"] or len(aside) == local.validate.reruns
    assert comparison["steady"] == all(b["steady"] for b in brackets)
    assert {f["class"] for f in comparison["faults"]} == {"hardware_fault", "network_jitter",
                                                           "partial_cluster_loss", "data_shard_skew"}
    for f in comparison["faults"]:
        assert len(f["observed"]["downtime_s_reps"]) == n
        lo, hi = f["predicted"]["downtime_ci95"]
        assert lo <= f["predicted"]["downtime_s"] <= hi
        assert f["downtime_rel_err"] == pytest.approx(
            abs(f["predicted"]["downtime_s"] - f["observed"]["downtime_s"]) / f["observed"]["downtime_s"])
    tol = comparison["tolerances"]
    verdict = comparison["pass"]
    assert verdict["downtime"] == (comparison["downtime_median_rel_err"] <= tol["downtime_rel_tol"])
    assert verdict["wall"] == (comparison["wall_s"]["rel_err"] <= tol["wall_rel_tol"])
    assert verdict["all"] == (verdict["downtime"] and verdict["wall"])
    assert p.returncode == (0 if verdict["all"] else 1)


@pytest.mark.timeout(1440)
def test_validate_local_8_passes_its_tolerances(validation):
    _, _, comparison = validation
    drift = comparison["calibration_load"]
    assert drift is not None and drift["calibration_step_s"] > 0 and drift["validation_step_s"] > 0
    if drift["warn"]:  # judging the twin needs a calibration measured under the load of the judged runs
        pytest.skip(f"the machine's load changed between calibration and validation: fault-free step "
                    f"{drift['calibration_step_s']:.3f} s then, {drift['validation_step_s']:.3f} s now")
    if not comparison["steady"]:  # the pace runs around a judged run disagree: no steady load to judge under
        pytest.skip(f"the machine's load moved across a judged run with no reruns left: "
                    f"{[round(b['change'], 3) for b in comparison['pace_brackets']]}")
    summary = "; ".join(f"{f['class']} {f['downtime_rel_err']:.0%}" for f in comparison["faults"])
    assert comparison["pass"]["all"], (f"downtime median error {comparison['downtime_median_rel_err']:.1%} "
                                       f"({summary}), wall error {comparison['wall_s']['rel_err']:.1%}")


# local-8's shape cut to two regions and one killed worker: the baseline's restart (a relaunch
# of every worker) is the slow part, so one fault keeps the test short. The checkpoint figures
# are the twin's (a 0.1 s write), so Young/Daly's interval is ~10 steps, not 1.
SMALL_LOCAL = """
[run]
name = "local-4"
seed = 1
steps = 30
[workload]
step_compute_s = 0.02
gradient_bytes = 500_000
slots = 4
micro_batch = 4
[checkpoint]
interval_steps = 10
weights_bytes = 50_000_000
optimizer_bytes = 100_000_000
write_gbyte_s = 0.5
read_gbyte_s = 1.0
[[regions]]
name = "us-east"
nodes = 2
gpus_per_node = 1
intra_gbit_s = 10.0
[[regions]]
name = "us-west"
nodes = 2
gpus_per_node = 1
intra_gbit_s = 10.0
[[links]]
a = "us-east"
b = "us-west"
rtt_ms = 0.1
gbit_s = 10.0
[[faults.schedule]]
at_step = 12
class = "hardware_fault"
target = "us-east/1"
[policy]
heartbeat_s = 0.1
detect_timeout_s = 1.0
hot_spares = 1
restart_s = 7.0
replace_node_s = 0.0
"""


@pytest.mark.timeout(540)
def test_plan_validate_confirms_the_ordering_on_the_runtime(tmp_path):
    scenario = tmp_path / "local-4.toml"
    scenario.write_text(SMALL_LOCAL)
    p = _keel("plan", str(scenario), "--trials", "6", "--replicas", "2", "--validate",
              "--out", str(tmp_path / "plan"), "--json", timeout=500)
    assert p.returncode == 0, p.stderr[-3000:]
    v = json.loads(p.stdout)["validation"]
    assert v["baseline"]["policy"]["policy.kind"] == "checkpoint_restart"
    assert v["predicted_order"] == v["observed_order"] == "recommended"
    assert v["ordering_matches"]
    assert v["baseline"]["restarts"] >= 1 and v["recommended"]["restarts"] == 0
