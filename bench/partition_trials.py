"""Partition trials on the multi-host test bed (tests/hostbed.py): seeded cuts while a job of
five workers on five hosts trains, its coordinator on a sixth, started as docs/multihost.md says.

    python bench/partition_trials.py [--trials N] [--seed S]      (root: network namespaces)

Each trial is tests/partition_trial.py's (a region, one way, a host, during a checkpoint,
during a re-formation; its counts are described there). `make reliability` runs ten of them
(tests/test_reliability_partition.py); this runs any number and prints one JSON line each.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from tempfile import TemporaryDirectory

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import hostbed  # noqa: E402
from partition_trial import KINDS, clean, trial  # noqa: E402
from test_multihost import WORKER_HOSTS, Job, _scenario  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(prog="python bench/partition_trials.py")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    why = hostbed.unavailable()
    if why:
        print(f"partition_trials: {why}", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    with TemporaryDirectory() as d:
        tmp = Path(d)
        path = _scenario(tmp)
        with hostbed.HostBed(1 + len(WORKER_HOSTS)) as bed:
            ref = Job(bed, tmp, "ref", path, ["--no-faults"])
            ref.keel_run(path, list(WORKER_HOSTS))
            reference = ref.finish()["final_weights_sha256"]
        rows = []
        for i in range(args.trials):
            kind = KINDS[i % len(KINDS)] if args.trials <= len(KINDS) else rng.choice(KINDS)
            sub = tmp / f"t{i}"
            sub.mkdir()
            rows.append(trial(sub, kind, rng, reference))
            print(json.dumps(rows[-1]), flush=True)
    bad = [r for r in rows if not clean(r)]
    print(f"{len(rows)} trials: {len(rows) - len(bad)} clean; minority commits "
          f"{sum(r['minority_commits'] for r in rows)}, steps lost or repeated {sum(r['lost_or_repeated'] for r in rows)}, "
          f"bit-identical {sum(r['bit_identical'] for r in rows)}/{len(rows)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
