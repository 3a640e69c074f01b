"""One seeded partition trial on the multi-host test bed (tests/hostbed.py): five workers on
five hosts (four started by torchrun, one by `keel run --coordinator`), the coordinator on a
sixth, real cuts in the bridge. Used by tests/test_reliability_partition.py (`make
reliability`) and bench/partition_trials.py.

Kinds, their times drawn from the trial's random stream:
- `region`: region b's two hosts cut off from everything else, healed `heal_s` later;
- `oneway`: one worker's packets to the coordinator dropped (the coordinator's still reach it);
- `host`: one worker's bridge port down, up again `heal_s` later (a heal before the timeout
  is a stall: nothing is lost);
- `checkpoint`: a host cut while the checkpoint of step 20 is being written;
- `reform`: a host cut, then a second one while the group re-forms after the first.
Counted: steps the cut-off side committed past the step in flight (0 allowed), steps lost or
repeated in the coordinator's log (0), the longest wait for a commit after a cut beyond its
bound, detect_timeout_s + REFORM_BOUND_S (0 allowed: no collective hangs on a silent peer), and
whether the final weights equal the fault-free run's."""
from __future__ import annotations

import random
import re
import time
from pathlib import Path

import hostbed
from test_multihost import SILENCE_S, STEPS, WORKER_HOSTS, Job, _committed, _events, _scenario, _wait

KINDS = ("region", "oneway", "host", "checkpoint", "reform")
DETECT_TIMEOUT_S = 1.0  # the scenario's (tests/runtime_helpers.scenario_text)
REFORM_BOUND_S = 5.0    # re-formation and the redone step, on a loaded 2-core machine


def _detects(out: Path) -> int:
    return sum(e["kind"] == "detect" for e in _events(out))


def _cut(bed: hostbed.HostBed, kind: str, nodes: list[str]) -> None:
    if kind == "region":
        bed.cut_region([WORKER_HOSTS[n] for n in nodes])
    elif kind == "oneway":
        bed.cut_oneway(0, WORKER_HOSTS[nodes[0]])
    else:
        bed.cut(WORKER_HOSTS[nodes[0]])


def trial(tmp: Path, kind: str, rng: random.Random, reference: str) -> dict:
    path = _scenario(tmp)
    at = 19 if kind == "checkpoint" else rng.randint(6, 30)
    heal_s = rng.uniform(0.5, 4.0)
    workers = ["a/0", "a/1", "b/0", "b/1"]
    cut = {"region": ["b/0", "b/1"], "checkpoint": [rng.choice(workers)]}.get(kind, [rng.choice(workers)])
    with hostbed.HostBed(1 + len(WORKER_HOSTS)) as bed:
        job = Job(bed, tmp, "trial", path)
        job.torchrun(workers)
        job.keel_run(path, ["c/0"])
        if kind == "checkpoint":  # the step 20 commit starts its write; cut while it is in flight
            _wait("checkpoint 20 started", lambda: any(e["kind"] == "checkpoint_start" and e["detail"].get("ckpt_step") == 20
                                                       for e in _events(job.out)), timeout=180, procs=[job.coord])
        else:
            _wait(f"step {at}", lambda: _committed(job.out) >= at, timeout=180, procs=[job.coord])
        cut_steps = [_committed(job.out)]
        _cut(bed, "host" if kind == "checkpoint" else kind, cut)
        if kind == "reform":  # a second host while the group re-forms after the first
            _wait("the first cut detected", lambda: _detects(job.out) >= 1, timeout=60, procs=[job.coord])
            second = rng.choice([n for n in workers if n not in cut])
            bed.cut(WORKER_HOSTS[second])
            cut.append(second)
            cut_steps.append(_committed(job.out))
        t_cut = time.monotonic()
        time.sleep(heal_s)
        bed.heal()
        rc = job.coord.wait(timeout=240)
        for node in cut:
            try:
                job.workers[node].wait(timeout=SILENCE_S + 30)
            except Exception:  # noqa: BLE001 - a worker still there is counted by its log below
                pass
        logs = {n: job.log(n).read_text() for n in cut}
        events = _events(job.out)
    summary = job.finish(timeout=1) if rc == 0 else {}
    commits = {e["step"]: e["t"] for e in events if e["kind"] == "step"}
    minority = 0
    for node, log in logs.items():
        m = re.search(rf"worker {node}: .*exiting \(code 3\) at step (\d+)", log)
        if m and kind != "oneway":  # one-way: it still hears the coordinator and may commit with the group
            minority += max(0, int(m.group(1)) - (max(cut_steps) + 1))
    # the longest wait between commits over the few steps after each cut (the step in flight
    # may have finished its collective before the cut: the stall then shows one step later)
    waits = [commits[k + 1] - commits[k] for s in cut_steps for k in range(s, s + 3)
             if k in commits and k + 1 in commits]
    # a cut is found after the timeout, or heals before it (a stall): either way the next commit
    # comes within the timeout and a re-formation, per cut since that commit
    bound = len(cut_steps) * DETECT_TIMEOUT_S + REFORM_BOUND_S
    return {"kind": kind, "cut": cut, "at_step": cut_steps, "heal_s": round(heal_s, 2), "rc": rc,
            "minority_commits": minority, "lost_or_repeated": int(sorted(commits) != list(range(1, STEPS + 1))),
            "longest_wait_s": round(max(waits, default=0.0), 2), "hung": int(max(waits, default=0.0) > bound),
            "restarts": summary.get("restarts"), "bit_identical": summary.get("final_weights_sha256") == reference,
            "cut_to_end_s": round(time.monotonic() - t_cut, 1)}


def clean(row: dict) -> bool:
    return (row["rc"] == 0 and not row["minority_commits"] and not row["lost_or_repeated"]
            and not row["hung"] and row["bit_identical"] and row["restarts"] == 0)
