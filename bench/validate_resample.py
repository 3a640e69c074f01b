"""How sure a validation's verdict is (a benchmark of the judge, not a test).

    .venv/bin/python bench/validate_resample.py DIR [DIR ...] [--draws 4000] [--reps 3 5 7 9]

For each `keel validate --out DIR`: resampling its own runtime repetitions (per fault, with
replacement, the twin's prediction held), the chance that the median per-fault downtime error
exceeds the scenario's tolerance with 3, 5, 7, 9 repetitions.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path


def fail_chance(comparison: dict, repetitions: int, draws: int, rng: random.Random) -> float:
    tol = comparison["tolerances"]["downtime_rel_tol"]
    fails = 0
    for _ in range(draws):
        errs = []
        for f in comparison["faults"]:
            reps = f["observed"]["downtime_s_reps"]
            observed = statistics.median(rng.choice(reps) for _ in range(repetitions))
            errs.append(abs(f["predicted"]["downtime_s"] - observed) / observed)
        fails += statistics.median(errs) > tol
    return fails / draws


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", help="keel validate output directories (holding comparison.json)")
    ap.add_argument("--draws", type=int, default=4000)
    ap.add_argument("--reps", type=int, nargs="+", default=[3, 5, 7, 9])
    args = ap.parse_args()
    for d in args.dirs:
        path = Path(d) / "comparison.json"
        try:
            c = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            print(f"validate_resample: {path}: expected the comparison.json of a keel validate --out "
                  f"directory ({e.__class__.__name__}: {e})", file=sys.stderr)
            sys.exit(2)
        rng = random.Random(0)
        chances = ", ".join(f"{n} reps {fail_chance(c, n, args.draws, rng):.1%}" for n in args.reps)
        print(f"{d}: downtime median error {c['downtime_median_rel_err']:.1%} with {c['repetitions']} reps; "
              f"chance over the tolerance when resampled: {chances}")


if __name__ == "__main__":
    main()
