"""N consecutive validations of one emulated cluster (a benchmark, not a test): how often the
twin passes its declared tolerances, and the spread of its errors.

    .venv/bin/python bench/validate_repeat.py 10 [--scenario scenarios/multiregion-46.toml]
        [--calibration FILE] [--out runs/validate-repeat] [--svg docs/figures/FILE.svg] [--json]
        [--again]

One calibration (measured first, once, unless given), then N `keel validate` runs back to
back with it, each in OUT/vK/. Prints one line per validation (verdict, the median and the
largest per-fault downtime error, the wall time's, late step reports, how long it took), then
the pass count and, per fault class, the errors' median and range. Writes OUT/repeat.json and,
with --svg FILE, plots of predicted against observed downtime (FILE) and cost (FILE's name with
-cost) of every fault of every validation, with the tolerance band. `--again` runs nothing:
it reads the N validations already in OUT/vK/ (their comparison.json) and prints and plots
them. Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from keel import fault_classes  # noqa: E402
from keel import scenario as S  # noqa: E402
from keel.calibration import write as write_calibration  # noqa: E402
from keel.paths import DEFAULT_SCENARIO  # noqa: E402
from planner import validate as V  # noqa: E402

COLOURS = {fc.name: fc.colour for fc in fault_classes.classes()}  # the charts' colours (keel/fault_classes.py)


def one_line(k: int, c: dict, seconds: float) -> str:
    worst = max(f["downtime_rel_err"] for f in c["faults"])
    late = sum(e["overruns"] for e in c["emulation"] if e)
    reports = sum(e["reports"] for e in c["emulation"] if e)
    return (f"validation {k + 1}: {'PASS' if c['pass']['all'] else 'FAIL'}  downtime median error "
            f"{c['downtime_median_rel_err']:.1%}, largest {worst:.1%}, wall {c['wall_s']['rel_err']:.1%}; "
            f"{late} of {reports} step reports late; {seconds:.0f} s")


def svg(points: list[tuple[str, float, float]], tol: float, title: str, what: str = "downtime") -> str:
    """Predicted (y) against observed (x) downtime, one dot per fault and validation, the
    diagonal and the +-tol band; plain SVG, no plotting library."""
    top = max(max(o, p) for _, o, p in points) * 1.1
    size, pad = 420, 50

    def xy(o: float, p: float) -> tuple[float, float]:
        return pad + o / top * size, pad + size - p / top * size

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{size + 2 * pad + 170}" height="{size + 2 * pad}" '
           'font-family="sans-serif" font-size="12">',
           f'<text x="{pad}" y="20" font-size="14">{title}</text>',
           f'<clipPath id="plot"><rect x="{pad}" y="{pad}" width="{size}" height="{size}"/></clipPath>',
           f'<rect x="{pad}" y="{pad}" width="{size}" height="{size}" fill="none" stroke="#999"/>']
    band = [xy(0, 0), xy(top, top * (1 + tol)), xy(top, top * (1 - tol))]
    out.append('<polygon points="' + " ".join(f"{x:.1f},{y:.1f}" for x, y in band)
               + '" fill="#ddd" opacity="0.6" clip-path="url(#plot)"/>')
    (x0, y0), (x1, y1) = xy(0, 0), xy(top, top)
    out.append(f'<line x1="{x0}" y1="{y0}" x2="{x1:.1f}" y2="{y1:.1f}" stroke="#666" stroke-dasharray="4,3"/>')
    step = 5 if top < 40 else 10
    for v in range(0, int(top) + 1, step):
        x, _ = xy(v, 0)
        _, y = xy(0, v)
        out.append(f'<text x="{x:.1f}" y="{pad + size + 15}" text-anchor="middle">{v}</text>')
        out.append(f'<text x="{pad - 6}" y="{y + 4:.1f}" text-anchor="end">{v}</text>')
    out.append(f'<text x="{pad + size / 2}" y="{pad + size + 35}" text-anchor="middle">observed {what} (emulated s)</text>')
    out.append(f'<text x="15" y="{pad + size / 2}" transform="rotate(-90 15 {pad + size / 2})" '
               f'text-anchor="middle">predicted {what} (s)</text>')
    for cls, o, p in points:
        x, y = xy(o, p)
        out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{COLOURS.get(cls, "#333")}" opacity="0.8"/>')
    shown = [cls for cls in COLOURS if any(c == cls for c, _, _ in points)]
    for i, cls in enumerate(shown):
        y = pad + 10 + 20 * i
        out.append(f'<circle cx="{pad + size + 20}" cy="{y}" r="5" fill="{COLOURS[cls]}"/>'
                   f'<text x="{pad + size + 30}" y="{y + 4}">{cls}</text>')
    y = pad + 5 + 20 * len(shown)
    out.append(f'<rect x="{pad + size + 14}" y="{y}" width="12" height="10" fill="#ddd"/>'
               f'<text x="{pad + size + 30}" y="{y + 9}">tolerance +-{tol:.0%}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("n", type=int, help="validations in a row")
    ap.add_argument("--scenario", default=str(DEFAULT_SCENARIO))
    ap.add_argument("--calibration", default=None, help="calibration.json (default: measured once, first)")
    ap.add_argument("--out", default="runs/validate-repeat")
    ap.add_argument("--svg", default=None, help="write the predicted-against-observed plot here")
    ap.add_argument("--json", action="store_true", help="print the record as one JSON object on stdout")
    ap.add_argument("--again", action="store_true", help="read the validations already in OUT instead of running")
    args = ap.parse_args(argv)
    scenario = V.emulated(S.load(args.scenario))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record: dict = {"scenario": scenario.run.name, "date": datetime.date.today().isoformat(),
                    "command": "bench/validate_repeat.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                    "validations": []}
    cal_path = args.calibration
    if cal_path is None and not args.again:
        from planner.calibrate import calibrate
        t0 = time.perf_counter()
        cal = calibrate(base=scenario, progress=True)
        cal_path = str(write_calibration(cal, out / "calibration.json"))
        record["calibration_s"] = round(time.perf_counter() - t0, 1)
        print(f"calibration: {record['calibration_s']} s -> {cal_path}", file=sys.stderr)
    record["calibration"] = cal_path
    earlier = []  # --again: what the run that made them recorded (their times)
    if args.again and (out / "repeat.json").exists():
        old = json.loads((out / "repeat.json").read_text())
        earlier = old["validations"]
        record.update({k: old[k] for k in ("date", "command", "calibration", "calibration_s") if k in old})
    points, costs = [], []
    for k in range(args.n):
        t0 = time.perf_counter()
        if args.again:
            c = json.loads((out / f"v{k}" / "comparison.json").read_text())
            seconds = earlier[k]["seconds"] if k < len(earlier) else float("nan")
        else:
            c = V.validate(scenario, out_dir=out / f"v{k}", calibration=cal_path, progress=False)
            seconds = time.perf_counter() - t0
        print(one_line(k, c, seconds), file=sys.stderr, flush=True)
        record["validations"].append({
            "pass": c["pass"], "seconds": round(seconds, 1),
            "downtime_median_rel_err": c["downtime_median_rel_err"], "wall_rel_err": c["wall_s"]["rel_err"],
            "faults": [{"class": f["class"], "target": f["target"], "predicted_s": f["predicted"]["downtime_s"],
                        "observed_s": f["observed"]["downtime_s"], "observed_reps_s": f["observed"]["downtime_s_reps"],
                        "rel_err": f["downtime_rel_err"], "cost_predicted_s": f["predicted"]["cost_s"],
                        "cost_observed_s": f["observed"]["cost_s"], "cost_rel_err": f["cost_rel_err"]}
                       for f in c["faults"]],
            "step_time_s": c["step_time_s"],
            "overruns": sum(e["overruns"] for e in c["emulation"] if e),
            "reports": sum(e["reports"] for e in c["emulation"] if e)})
        points += [(f["class"], f["observed"]["downtime_s"], f["predicted"]["downtime_s"]) for f in c["faults"]]
        costs += [(f["class"], f["observed"]["cost_s"], f["predicted"]["cost_s"]) for f in c["faults"]]
    vs = record["validations"]
    passed = sum(v["pass"]["all"] for v in vs)
    by_class: dict[str, list[float]] = {}
    cost_by_class: dict[str, list[float]] = {}
    for v in vs:
        for f in v["faults"]:
            by_class.setdefault(f["class"], []).append(f["rel_err"])
            cost_by_class.setdefault(f["class"], []).append(f["cost_rel_err"])
    record["summary"] = {
        "passed": passed, "of": len(vs),
        "downtime_median_rel_err": {"median": statistics.median(v["downtime_median_rel_err"] for v in vs),
                                    "max": max(v["downtime_median_rel_err"] for v in vs)},
        "wall_rel_err": {"median": statistics.median(v["wall_rel_err"] for v in vs),
                         "max": max(v["wall_rel_err"] for v in vs)},
        "by_class": {k: {"median": statistics.median(x), "min": min(x), "max": max(x)} for k, x in by_class.items()},
        "cost_by_class": {k: {"median": statistics.median(x), "min": min(x), "max": max(x)}
                          for k, x in cost_by_class.items()},
        "overruns": sum(v["overruns"] for v in vs), "reports": sum(v["reports"] for v in vs),
        "seconds_per_validation": {"median": statistics.median(v["seconds"] for v in vs),
                                   "max": max(v["seconds"] for v in vs)},
    }
    (out / "repeat.json").write_text(json.dumps(record, indent=1) + "\n")
    if args.svg:
        tol = scenario.validate.downtime_rel_tol
        path = Path(args.svg)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(svg(points, tol, f"{scenario.run.name}: {len(vs)} validations, {passed} passed"))
        path.with_name(f"{path.stem}-cost{path.suffix}").write_text(
            svg(costs, tol, f"{scenario.run.name}: cost of each fault (not judged)", "cost"))
    s = record["summary"]
    lines = [f"{scenario.run.name}: {passed} of {len(vs)} validations passed",
             f"  per-fault downtime, median error per validation: median {s['downtime_median_rel_err']['median']:.1%}, "
             f"max {s['downtime_median_rel_err']['max']:.1%}",
             f"  wall time error: median {s['wall_rel_err']['median']:.1%}, max {s['wall_rel_err']['max']:.1%}"]
    for k, e in s["by_class"].items():
        c = s["cost_by_class"][k]
        lines.append(f"  {k:<21} downtime error median {e['median']:.1%}, range {e['min']:.1%}-{e['max']:.1%}; "
                     f"cost error median {c['median']:.1%}, range {c['min']:.1%}-{c['max']:.1%}")
    lines.append(f"  late step reports: {s['overruns']} of {s['reports']}; "
                 f"{s['seconds_per_validation']['median']:.0f} s per validation (max {s['seconds_per_validation']['max']:.0f})")
    if args.json:
        print(json.dumps(record))
    else:
        print("\n".join(lines))
    return 0 if passed == len(vs) else 1


if __name__ == "__main__":
    sys.exit(main())
