"""`keel demo`'s closing summary, from the files its stages write (keel/demo.py)."""
import json
from pathlib import Path

from keel.demo import summary


def _write(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def _comparison(**passed):
    ok = {"downtime": True, "each_fault": True, "wall": True, "valid": True, **passed}
    ok["all"] = all(ok.values())
    return {"scenario": "multiregion-46", "repetitions": 2,
            "tolerances": {"downtime_rel_tol": 0.1, "fault_rel_tol": 0.15, "wall_rel_tol": 0.05},
            "faults": [{"downtime_rel_err": 0.049}, {"downtime_rel_err": 0.011}],
            "emulation": [{"overruns": 0, "reports": 815}, {"overruns": 1, "reports": 815}],
            "wall_s": {"rel_err": 0.007}, "downtime_median_rel_err": 0.022, "pass": ok}


def test_summary_says_what_ran_the_verdict_and_how_to_see_it(tmp_path):
    out = tmp_path / "demo"
    _write(out / "simulate" / "summary.json",
           {"scenario": "multiregion-46", "nodes": 46, "regions": 4, "steps": 3000, "faults_scheduled": 4,
            "faults_drawn": 2, "restarts": 0, "goodput": 0.9291, "faults": [{"action": "replicate_resume"}] * 6})
    _write(out / "plan" / "plan.json",
           {"scenario": "multiregion-46",
            "recommended": {"policy.kind": "absorb", "policy.hot_spares": 2, "checkpoint.interval_steps": 1377,
                            "checkpoint.mode": "async", "goodput": 0.9293},
            "baseline": {"policy.kind": "checkpoint_restart", "checkpoint.interval_steps": 281, "goodput": 0.8644}})
    _write(out / "run" / "summary.json",
           {"scenario": "local-8", "nodes": 8, "steps": 60, "wall_s": 5.96, "restarts": 0,
            "faults": [{"action": "replicate_resume"}, {"action": "quarantine_resample"}]})
    _write(out / "validate" / "comparison.json", _comparison())
    lines = summary(out).splitlines()
    assert lines[0] == f"== summary: everything is under {out}/"
    assert [line.split()[0] for line in lines[1:]] == ["simulated", "planned", "ran", "validated", "verdict",
                                                      "dashboard"]
    text = "\n".join(lines)
    assert "6 faults" not in text and "4 scheduled + 2 drawn faults, all absorbed, 0 restarts, goodput 0.929" in text
    assert "absorb with 2 hot spares, async checkpoints every 1377 steps, goodput 0.929 against 0.864" in text
    assert "checkpoint_restart every 281 steps" in text
    assert "local-8 for real: 8 worker processes, 60 steps in 6.0 s, 2 faults (2 absorbed), 0 restarts" in text
    assert "wall time error 0.7 % (tolerance 5.0 %)" in text and "worst fault 4.9 % (15.0 %)" in text
    assert "1 of 1630 step reports late" in text
    assert "verdict    PASS" in text
    assert f"keel app --runs {out}" in text and f"keel report {out / 'validate'}" in text

    _write(out / "validate" / "comparison.json", _comparison(each_fault=False))
    assert "verdict    FAIL: outside the declared tolerance on every fault's downtime" in summary(out)
    _write(out / "validate" / "comparison.json", _comparison(valid=False))
    assert "verdict    INVALID" in summary(out)


def test_summary_of_stages_that_did_not_run(tmp_path):
    text = summary(tmp_path)
    assert "simulated  not run" in text and "validated  not run" in text
    assert "verdict    none: the validation did not run to the end" in text
