"""Downtime of a killed worker: `absorb` (replicate_resume from a hot spare, in place) against
`checkpoint_restart` (stop everything, relaunch fresh interpreters, load the last checkpoint,
recompute) on the same run, plus the absorb breakdown (detection, re-formation, state
transfer, redo) and a hung (SIGSTOPped) worker found by heartbeat timeout.

    .venv/bin/python bench/recovery.py [--scenario scenarios/local-8.toml] [--repeats 3]

Target: under 0.5 s of downtime for a killed worker under absorb."""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def one(scenario_path: str, policy: str, kill_at: int, steps: int, target: str, hang: bool = False) -> dict:
    from keel.scenario import load
    from runtime.api import run_scenario
    overrides = [f"policy.kind={policy}", "checkpoint.interval_steps=10"]
    sc = load(scenario_path, overrides)
    import dataclasses
    from keel.scenario import ScheduledFault
    sched = () if hang else (ScheduledFault(at_step=kill_at, class_="hardware_fault", target=target),)
    sc = dataclasses.replace(sc, faults=dataclasses.replace(sc.faults, schedule=sched))
    with tempfile.TemporaryDirectory() as d:
        s = run_scenario(sc, Path(d) / "run", steps=steps, progress=False, hangs=f"{target}@{kill_at}" if hang else "")
        from keel.events import read_events
        events = read_events(Path(d) / "run" / "events.jsonl")
    f = s["faults"][0]
    end = next((e for e in events if e.kind == "recover_end"), None)
    detect = next((e for e in events if e.kind == "detect"), None)
    return {"downtime_s": f["downtime_s"], "cost_s": f["cost_s"], "lost_steps": f["lost_steps"],
            "step_s": s["step_time_s"], "restarts": s["restarts"],
            "detect_s": detect.detail.get("detect_s") if detect else None,
            **({k: end.detail.get(k) for k in ("reform_s", "state_s", "redo_s")} if end else {})}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", default="scenarios/local-8.toml")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kill-at", type=int, default=15)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--target", default="us-east/1")
    a = p.parse_args()
    rows = {"absorb": [], "checkpoint_restart": [], "hang": []}
    for r in range(a.repeats):
        rows["absorb"].append(one(a.scenario, "absorb", a.kill_at, a.steps, a.target))
        rows["checkpoint_restart"].append(one(a.scenario, "checkpoint_restart", a.kill_at, a.steps, a.target))
        rows["hang"].append(one(a.scenario, "absorb", a.kill_at, a.steps, a.target, hang=True))
        print(f"repeat {r + 1}: " + ", ".join(f"{k} {v[-1]['downtime_s']:.3f} s" for k, v in rows.items()), file=sys.stderr)

    def med(k, key):
        xs = [x[key] for x in rows[k] if x.get(key) is not None]
        return statistics.median(xs) if xs else float("nan")
    print(f"scenario {a.scenario}: SIGKILL of {a.target} at step {a.kill_at}, checkpoint every 10 steps, "
          f"median of {a.repeats}")
    print(f"{'':28}{'downtime s':>12}{'cost s':>10}{'lost steps':>12}{'step ms':>10}")
    for k, label in (("absorb", "absorb (hot spare)"), ("checkpoint_restart", "checkpoint_restart"),
                     ("hang", "absorb, SIGSTOP (timeout)")):
        print(f"{label:28}{med(k, 'downtime_s'):12.3f}{med(k, 'cost_s'):10.3f}{med(k, 'lost_steps'):12.0f}"
              f"{med(k, 'step_s') * 1000:10.1f}")
    ratio = med("absorb", "downtime_s") / med("checkpoint_restart", "downtime_s")
    print(f"downtime ratio absorb / checkpoint_restart: {ratio:.3f}; "
          f"cost ratio: {med('absorb', 'cost_s') / med('checkpoint_restart', 'cost_s'):.3f}")
    print("absorb breakdown (median s): " + ", ".join(
        f"{k.removesuffix('_s')} {med('absorb', k):.3f}" for k in ("detect_s", "reform_s", "state_s", "redo_s")))
    print(f"target: absorb downtime < 0.5 s -> {'met' if med('absorb', 'downtime_s') < 0.5 else 'NOT met'}")


if __name__ == "__main__":
    main()
