"""The validation sweep (issue 25; a benchmark, not a test): `keel validate`, emulated, on N
members of a seeded family of scenarios the twin was never tuned on (planner/scenario_gen.py).

    .venv/bin/python bench/validate_sweep.py N [--seed S] [--max-nodes M] [--out runs/validate-sweep]
        [--quick] [--timeout S] [--svg FILE] [--json] [--again [--rejudge] | --resume]
    make validate-sweep [N=30] [SEED=1]

Each member is written to OUT/scenarios/NAME.toml (its features in a comment) and validated by
the `keel` command as a user runs it (`keel validate FILE --out OUT/NAME`; time scale "auto":
measured here first; `--quick`: the calibration's quick mode). A member's verdict:
- pass / fail: the validation judged the twin (exit 0 / 1 with a comparison);
- unfaithful: a repetition's emulation could not keep its time and the validation stopped
  (exit 1, "validation stopped"): the twin is not judged;
- refused: refused before anything ran (exit 2: this machine cannot run it faithfully);
- error: the runtime or the calibration failed (exit 1 without a comparison).
The report: the pass rate over the judged members, the downtime error per fault class and per
feature of the scenarios (so a failure points at the twin's weak spot), where the time went
(calibration, runtime repetitions, the rest), a plot of predicted against observed downtime of
every fault, and every member that did not pass copied to
OUT/failing/ to replay (`keel validate OUT/failing/NAME.toml`). Writes OUT/sweep.json and
OUT/sweep.md; `--again` runs nothing and reports the members already in OUT/members.jsonl;
`--resume` keeps those and runs the rest (a sweep stopped part way, the members it finished kept);
`--again --rejudge` judges the stored repetitions again with the twin as it is now (a twin change
measured on a whole sweep in a minute, bench/rejudge.py), keeping each verdict at run time.
Progress goes to stderr: a bar on a terminal, a line now and then otherwise.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from keel.progress import progress_bar  # noqa: E402
from planner.scenario_gen import generate, toml_text  # noqa: E402

VERDICTS = ("pass", "fail", "unfaithful", "refused", "error")


def keel_command() -> list[str]:
    return [sys.executable, "-m", "keel.cli"]


def run_member(seed: int, index: int, out: Path, max_nodes: int, quick: bool, timeout_s: float) -> dict:
    """Generate, write and validate one member; its record."""
    scenario, features = generate(seed, index, max_nodes)
    name = scenario.run.name
    path = out / "scenarios" / f"{name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(toml_text(scenario, features))
    vdir = out / name
    if vdir.exists():
        shutil.rmtree(vdir)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if quick:
        env["KEEL_CALIBRATE_QUICK"] = "1"
    t0 = time.monotonic()
    try:
        p = subprocess.run([*keel_command(), "validate", str(path), "--out", str(vdir), "--json"], cwd=str(ROOT),
                           env=env, capture_output=True, text=True, timeout=timeout_s)
        rc, stderr = p.returncode, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, stderr = None, (e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or "") + \
            f"\nsweep: timed out after {timeout_s:.0f} s"
    seconds = time.monotonic() - t0
    (out / "logs").mkdir(exist_ok=True)
    (out / "logs" / f"{name}.stderr").write_text(stderr)
    comparison = vdir / "comparison.json"
    c = json.loads(comparison.read_text()) if comparison.exists() and rc in (0, 1) else None
    tail = stderr.strip().splitlines()[-1:] if rc != 0 else []
    last = tail[0] if tail and tail[0].startswith(("keel:", "sweep:")) else ""  # why it stopped
    if rc == 0 and c:
        verdict = "pass"
    elif rc == 1 and c:
        verdict = "fail"
    elif rc == 1 and "validation stopped" in last:
        verdict = "unfaithful"
    elif rc == 2:
        verdict = "refused"
    else:
        verdict = "error"
    chosen = next((line.split("->")[1].split()[0] for line in stderr.splitlines()
                   if "emulation.time_scale auto ->" in line), None)
    record = {"index": index, "name": name, "file": str(path), "features": features, "verdict": verdict,
              "exit_code": rc, "seconds": round(seconds, 1), "time_scale": float(chosen) if chosen else None,
              "reason": last}
    if c:
        record.update(judged(c))
    record["time"] = time_parts(vdir, seconds)
    if verdict != "pass":
        (out / "failing").mkdir(exist_ok=True)
        shutil.copy(path, out / "failing" / path.name)
    return record


def rejudged(vdir: Path, scenario_file: Path, stored: dict) -> dict:
    """A member's stored repetitions judged by the twin as it is now (bench/rejudge.py), at the
    time scale it ran at, with its own calibration; written to comparison-rejudged.json."""
    from keel import scenario as S
    from planner import validate as V
    from rejudge import as_run, rejudge
    sc = as_run(V.prepare(S.load(scenario_file)), stored)
    c = rejudge(sc, json.loads((vdir / "calibration.json").read_text()), vdir, 16)
    (vdir / "comparison-rejudged.json").write_text(json.dumps(c, indent=1))
    return c


def time_parts(vdir: Path, seconds: float) -> dict | None:
    """Where a member's `seconds` went, from what its validation wrote: the calibration's runs
    (calibration.json's own duration_s), the runtime repetitions (from the calibration's write
    to the last repetition's summary), and the rest (the time scale's probe, the twin, the
    processes' start). None where the validation ran no repetition."""
    cal = vdir / "calibration.json"
    reps = list((vdir / "runtime").glob("rep-*/summary.json"))
    if not (cal.exists() and reps):
        return None
    calibration = float(json.loads(cal.read_text()).get("duration_s") or 0.0)
    repetitions = max(p.stat().st_mtime for p in reps) - cal.stat().st_mtime
    return {"calibration_s": round(calibration, 1), "repetitions_s": round(repetitions, 1),
            "other_s": round(max(0.0, seconds - calibration - repetitions), 1)}


def judged(c: dict) -> dict:
    """What the report keeps of a comparison.json."""
    return {"downtime_median_rel_err": c["downtime_median_rel_err"], "wall_rel_err": c["wall_s"]["rel_err"],
            "step_rel_err": c["step_time_s"]["rel_err"], "passes": c["pass"], "tolerances": c["tolerances"],
            "faults": [{"class": f["class"], "target": f["target"], "action": f.get("action"),
                        "downtime_rel_err": f["downtime_rel_err"], "cost_rel_err": f["cost_rel_err"],
                        "predicted_s": f["predicted"]["downtime_s"], "observed_s": f["observed"]["downtime_s"]}
                       for f in c["faults"]]}


# ----------------------------------------------------------------------------- the report

def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _parts(s: dict) -> str:
    t = s["time_parts"]
    whole = t["calibration_s"] + t["repetitions_s"] + t["other_s"]
    if not t["members"] or whole <= 0:
        return ""
    return (f"; of the {t['members']} members timed part by part: calibration {t['calibration_s'] / whole:.0%}, "
            f"runtime repetitions {t['repetitions_s'] / whole:.0%}, the rest (probe, twin, start-up) "
            f"{t['other_s'] / whole:.0%}")


def _stats(xs: list[float]) -> str:
    return f"{_pct(statistics.median(xs))} ({_pct(min(xs))}-{_pct(max(xs))})" if xs else "-"


def summarise(records: list[dict], seed: int) -> dict:
    judged = [r for r in records if r["verdict"] in ("pass", "fail")]
    counts = {v: sum(r["verdict"] == v for r in records) for v in VERDICTS}
    by_class: dict[str, list[tuple[float, bool]]] = {}
    for r in judged:
        tol = r["tolerances"]["fault_rel_tol"]
        for f in r["faults"]:
            by_class.setdefault(f["class"], []).append((f["downtime_rel_err"], f["downtime_rel_err"] <= tol))
    by_feature: dict[str, dict[str, list[dict]]] = {}
    for r in judged:
        for key, value in r["features"].items():
            for v in (value if isinstance(value, list) else [value]):
                by_feature.setdefault(key, {}).setdefault(v, []).append(r)
    timed = [r["time"] for r in records if r.get("time")]
    spent = {k: sum(t[k] for t in timed) for k in ("calibration_s", "repetitions_s", "other_s")}
    return {
        "seed": seed, "members": len(records), "counts": counts,
        "seconds": round(sum(r["seconds"] for r in records), 1),
        "time_parts": {"members": len(timed), **{k: round(v, 1) for k, v in spent.items()}},
        "pass_rate": counts["pass"] / len(judged) if judged else None,
        "by_class": {k: {"faults": len(v), "within_tolerance": sum(ok for _, ok in v),
                         "median_rel_err": statistics.median(e for e, _ in v), "max_rel_err": max(e for e, _ in v)}
                     for k, v in sorted(by_class.items())},
        "by_feature": {k: {v: {"members": len(rs), "passed": sum(r["verdict"] == "pass" for r in rs),
                               "median_of_median_rel_err": statistics.median(r["downtime_median_rel_err"] for r in rs),
                               "median_wall_rel_err": statistics.median(r["wall_rel_err"] for r in rs),
                               "median_step_rel_err": statistics.median(r.get("step_rel_err", math.nan) for r in rs)}
                           for v, rs in sorted(vals.items())}
                       for k, vals in by_feature.items()},
    }


def _time(r: dict) -> str:
    t = r.get("time")
    return f"{r['seconds']:.0f} s" + (f" (calibration {t['calibration_s']:.0f}, repetitions {t['repetitions_s']:.0f})"
                                      if t else "")


def markdown(records: list[dict], s: dict) -> str:
    lines = [f"# Validation sweep: seed {s['seed']}, {s['members']} members", "",
             "verdicts: " + ", ".join(f"{v} {n}" for v, n in s["counts"].items()),
             f"pass rate over the judged members: {_pct(s['pass_rate'])}",
             f"time: {s['seconds'] / 60:.0f} min ({s['seconds'] / max(1, s['members']):.0f} s a member)" + _parts(s), "",
             "| member | verdict | time scale | downtime median error | worst fault | wall | fault-free step | faults | time |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        worst = max((f["downtime_rel_err"] for f in r.get("faults", [])), default=None)
        faults = ", ".join(r["features"]["faults"])
        at_run = r.get("verdict_at_run", r["verdict"])
        verdict = r["verdict"] if at_run == r["verdict"] else f"{r['verdict']} ({at_run} at run time)"
        lines.append(f"| {r['name']} | {verdict} | {r['time_scale'] or '-'} | "
                     f"{_pct(r.get('downtime_median_rel_err'))} | {_pct(worst)} | {_pct(r.get('wall_rel_err'))} | "
                     f"{_pct(r.get('step_rel_err'))} | {faults} | {_time(r)} |")
    lines += ["", "| fault class | faults | within fault_rel_tol | downtime error: median (max) |", "|---|---|---|---|"]
    for k, v in s["by_class"].items():
        lines.append(f"| {k} | {v['faults']} | {v['within_tolerance']} | {_pct(v['median_rel_err'])} "
                     f"({_pct(v['max_rel_err'])}) |")
    lines += ["", "| feature | value | members | passed | median downtime error | median wall error | median step error |",
              "|---|---|---|---|---|---|---|"]
    for k, vals in s["by_feature"].items():
        for v, x in vals.items():
            lines.append(f"| {k} | {v} | {x['members']} | {x['passed']} | {_pct(x['median_of_median_rel_err'])} | "
                         f"{_pct(x['median_wall_rel_err'])} | {_pct(x['median_step_rel_err'])} |")
    not_judged = [r for r in records if r["verdict"] not in ("pass", "fail")]
    if not_judged:
        lines += ["", "Not judged:"] + [f"- {r['name']} ({r['verdict']}): {r['reason']}" for r in not_judged]
    return "\n".join(lines) + "\n"


def plot(records: list[dict], path: Path, seed: int) -> None:
    from validate_repeat import svg
    points = [(f["class"], f["observed_s"], f["predicted_s"]) for r in records for f in r.get("faults", [])]
    if points:
        tol = max(r["tolerances"]["fault_rel_tol"] for r in records if r.get("tolerances"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(svg(points, tol, f"validation sweep, seed {seed}: downtime of every fault"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("n", type=int, help="members of the family to validate")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--first", type=int, default=0, help="index of the first member (default 0)")
    ap.add_argument("--max-nodes", type=int, default=40, help="largest cluster drawn (4-40; default 40)")
    ap.add_argument("--out", default="runs/validate-sweep")
    ap.add_argument("--quick", action="store_true", help="each calibration in its quick mode (two runs)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one member may take (default 1800)")
    ap.add_argument("--svg", default=None, help="the plot (default OUT/sweep.svg)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    ap.add_argument("--again", action="store_true", help="run nothing: report OUT/members.jsonl")
    ap.add_argument("--rejudge", action="store_true",
                    help="with --again: judge the members' stored repetitions again with the twin as it is now "
                         "(bench/rejudge.py; OUT/NAME/comparison-rejudged.json), the verdict at run time kept")
    ap.add_argument("--resume", action="store_true",
                    help="keep the members OUT/members.jsonl already has (a sweep stopped part way) and run the rest")
    args = ap.parse_args(argv)
    if args.n < 1 or not 4 <= args.max_nodes <= 40:
        print("validate_sweep: expected N >= 1 and --max-nodes in 4-40", file=sys.stderr)
        return 2
    out = Path(args.out) / f"seed-{args.seed}"
    out.mkdir(parents=True, exist_ok=True)
    log = out / "members.jsonl"
    if args.again:  # the members' comparisons re-read: a report of the same runs by a newer version of this script
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        for r in records:
            comparison = out / r["name"] / "comparison.json"
            if r["verdict"] in ("pass", "fail") and comparison.exists():
                c = rejudged(out / r["name"], out / "scenarios" / f"{r['name']}.toml", json.loads(comparison.read_text())) if args.rejudge \
                    else json.loads(comparison.read_text())
                r.setdefault("time", time_parts(out / r["name"], r["seconds"]))
                r.setdefault("verdict_at_run", r["verdict"])
                r["verdict"] = "pass" if c["pass"]["all"] else "fail"
                r.update(judged(c))
    else:
        kept = {}
        if args.resume and log.exists():  # a member's record is written once it is over: those are whole
            kept = {r["index"]: r for r in (json.loads(line) for line in log.read_text().splitlines() if line.strip())}
        records = [kept[i] for i in range(args.first, args.first + args.n) if i in kept]
        log.write_text("".join(json.dumps(r) + "\n" for r in records))
        with progress_bar(total=args.n, initial=len(records), desc=f"validate-sweep seed {args.seed}",
                          unit="scenario") as bar:
            for index in range(args.first, args.first + args.n):
                if index in kept:
                    continue
                r = run_member(args.seed, index, out, args.max_nodes, args.quick, args.timeout)
                records.append(r)
                with log.open("a") as f:
                    f.write(json.dumps(r) + "\n")
                bar.set_postfix(**{r["name"]: r["verdict"]})
                bar.update()
    records.sort(key=lambda r: r["index"])
    s = summarise(records, args.seed)
    (out / "sweep.json").write_text(json.dumps({"summary": s, "members": records}, indent=1))
    text = markdown(records, s)
    (out / "sweep.md").write_text(text)
    plot(records, Path(args.svg) if args.svg else out / "sweep.svg", args.seed)
    if args.json:
        print(json.dumps(s, indent=1))
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
