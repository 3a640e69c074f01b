"""Partition trials on the multi-host test bed (tests/hostbed.py): seeded cuts while a job of
five workers on five hosts trains, its coordinator on a sixth, started as docs/multihost.md says.

    python bench/partition_trials.py [--trials N] [--seed S]      (root: network namespaces)

Each trial draws a kind and its times from the seed:
- region: a region's two hosts cut off from everything else, healed `heal_s` later;
- oneway: one worker's packets to the coordinator dropped (the coordinator's still reach it);
- host: one worker's bridge port down, up again `heal_s` later.
Counted per trial: steps the cut-off side committed past the step in flight (must be 0), steps
lost or repeated in the coordinator's log (0), a collective that waited on the silent side past
`detect_timeout_s` + 5 s (0), and whether the final weights equal the fault-free run's.
Not yet in `make reliability`: a scheduled partition as a scenario fault class waits for the
fault-class registry (issue 23).
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import hostbed  # noqa: E402
from test_multihost import SILENCE_S, STEPS, WORKER_HOSTS, Job, _committed, _events, _scenario, _wait  # noqa: E402

KINDS = ("region", "oneway", "host")


def trial(tmp: Path, kind: str, rng: random.Random, reference: str) -> dict:
    path = _scenario(tmp)
    at = rng.randint(6, 30)
    heal_s = rng.uniform(0.5, 4.0)
    with hostbed.HostBed(1 + len(WORKER_HOSTS)) as bed:
        job = Job(bed, tmp, kind, path)
        job.torchrun(["a/0", "a/1", "b/0", "b/1"])
        job.keel_run(path, ["c/0"])
        _wait(f"step {at}", lambda: _committed(job.out) >= at, timeout=180, procs=[job.coord])
        if kind == "region":
            cut = ["b/0", "b/1"]
            bed.cut_region([WORKER_HOSTS[n] for n in cut])
        elif kind == "oneway":
            cut = [rng.choice(["a/0", "a/1", "b/0", "b/1"])]
            bed.cut_oneway(0, WORKER_HOSTS[cut[0]])
        else:
            cut = [rng.choice(list(WORKER_HOSTS))]
            bed.cut(WORKER_HOSTS[cut[0]])
        cut_step = _committed(job.out)
        t_cut = time.monotonic()
        time.sleep(heal_s)
        bed.heal()
        rc = job.coord.wait(timeout=240)
        detected_at = None
        events = _events(job.out)
        detects = [e["t"] for e in events if e["kind"] == "detect" and e["target"] in cut]
        for node in cut:
            try:
                job.workers[node].wait(timeout=SILENCE_S + 30)
            except Exception:  # noqa: BLE001 - counted below as not gone
                pass
        logs = {n: job.log(n).read_text() for n in cut}
    summary = json.loads((job.out / "summary.json").read_text()) if rc == 0 else {}
    steps = [e["step"] for e in events if e["kind"] == "step"]
    minority = 0
    for node, log in logs.items():
        m = re.search(rf"worker {node}: .*exiting \(code 3\) at step (\d+)", log)
        if m and kind != "oneway":  # one-way: the worker still hears the coordinator and may commit with the group
            minority += max(0, int(m.group(1)) - (cut_step + 1))
    t0 = next(e["t"] for e in events if e["kind"] == "run_start")
    if detects:
        detected_at = round(min(detects) - t0, 2)
    return {"kind": kind, "cut": cut, "at_step": cut_step, "heal_s": round(heal_s, 2), "rc": rc,
            "minority_commits": minority, "lost_or_repeated": int(steps != list(range(1, STEPS + 1))),
            "detected": len(detects) == len(cut), "restarts": summary.get("restarts"),
            "bit_identical": summary.get("final_weights_sha256") == reference,
            "cut_to_end_s": round(time.monotonic() - t_cut, 1), "detected_at_s": detected_at}


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
    bad = [r for r in rows if r["rc"] != 0 or r["minority_commits"] or r["lost_or_repeated"] or not r["bit_identical"]]
    print(f"{len(rows)} trials: {len(rows) - len(bad)} clean; minority commits "
          f"{sum(r['minority_commits'] for r in rows)}, steps lost or repeated {sum(r['lost_or_repeated'] for r in rows)}, "
          f"bit-identical {sum(r['bit_identical'] for r in rows)}/{len(rows)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
