"""Judge stored validations again with the twin as it is now (a benchmark for twin changes):
the runtime's repetitions are read from each validation's directory, not run again, so a
change to the model is measured on the very runs it was judged on before, in seconds.

    .venv/bin/python bench/rejudge.py DIR... --calibration FILE [--scenario FILE] [--replicas 16]

DIR is a `keel validate --out` directory (comparison.json, runtime/rep-K/). Prints, per
validation, the verdict and per fault the downtime and cost errors before (the stored
comparison) and now; then the per-class medians. A validation of another configuration than
SCENARIO's (its config_hash, at the time scale it ran at) is skipped, saying so. Writes nothing.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from keel import scenario as S  # noqa: E402
from keel.paths import DEFAULT_SCENARIO  # noqa: E402
from keel.rundir import read_events, read_summary  # noqa: E402
from planner import validate as V  # noqa: E402


def as_run(scenario: S.Scenario, stored: dict) -> S.Scenario:
    """`scenario` (prepared) at the time scale the stored validation `stored` ran at."""
    scale = (stored.get("emulation") or [{}])[0].get("time_scale")
    return scenario if scale is None else scenario.with_overrides({"emulation.time_scale": scale})


def rejudge(scenario: S.Scenario, calibration: dict, out: Path, replicas: int) -> dict:
    reps = sorted((out / "runtime").glob("rep-*"), key=lambda p: int(p.name[4:]))
    observed = [V.observation(read_summary(r), read_events(r)) for r in reps]
    with tempfile.TemporaryDirectory() as tmp:
        predicted = V.twin_prediction(scenario, calibration, replicas, Path(tmp))
    return V.compare(scenario, predicted, observed, "given", "given")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--calibration", required=True, type=Path)
    ap.add_argument("--scenario", default=str(DEFAULT_SCENARIO))
    ap.add_argument("--replicas", type=int, default=16)
    args = ap.parse_args(argv)
    scenario = V.prepare(S.load(args.scenario))
    calibration = json.loads(args.calibration.read_text())
    by_class: dict[str, list[tuple[float, float, float, float]]] = {}
    passed = [0, 0, 0]  # before, now, judged
    for d in args.dirs:
        before = json.loads((d / "comparison.json").read_text())
        sc = as_run(scenario, before)
        if sc.config_hash() != before["config_hash"]:
            print(f"{d}: skipped: it ran another configuration (config_hash {before['config_hash'][:12]}, "
                  f"{args.scenario} gives {sc.config_hash()[:12]})")
            continue
        now = rejudge(sc, calibration, d, args.replicas)
        passed[2] += 1
        passed[0] += bool(before["pass"]["all"])
        passed[1] += bool(now["pass"]["all"])
        print(f"{d}: {'PASS' if before['pass']['all'] else 'FAIL'} -> {'PASS' if now['pass']['all'] else 'FAIL'}; "
              f"wall {before['wall_s']['rel_err']:.1%} -> {now['wall_s']['rel_err']:.1%}")
        for b, n in zip(before["faults"], now["faults"]):
            print(f"  {n['class']:22} downtime {b['downtime_rel_err']:6.1%} -> {n['downtime_rel_err']:6.1%}   "
                  f"cost {b.get('cost_rel_err', float('nan')):6.1%} -> {n.get('cost_rel_err', float('nan')):6.1%}")
            by_class.setdefault(n["class"], []).append((b["downtime_rel_err"], n["downtime_rel_err"],
                                                        b.get("cost_rel_err", 0.0), n.get("cost_rel_err", 0.0)))
    print(f"passed: {passed[0]} -> {passed[1]} of {passed[2]} judged")
    for cls, rows in by_class.items():
        med = [statistics.median(r[i] for r in rows) for i in range(4)]
        print(f"  {cls:22} downtime error median {med[0]:.1%} -> {med[1]:.1%}; cost error median {med[2]:.1%} -> {med[3]:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
