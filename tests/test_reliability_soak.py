"""Reliability, soak (issue 13): one run of tests/reliability-8.toml with a fault every few
steps, of every class: 200 of them with `KEEL_RELIABILITY=full` (`make reliability`), 20
otherwise (`make test`).

The run cannot lose more workers than it has: the runtime brings no node back (a killed
worker stays dead for the run; `faults.*.repair_hours` is the twin's alone), so the soak kills
five of its eight workers (two region losses, two node crashes, one of them the checkpoint
writer, and the hot spare), spread over the run, and keeps three that no kill touches for the
latency spikes (round-robin, far enough apart that a node's spike is over before its next).
The rest are NaN shards: 256 shards, each poisoned once, picked among those the step after its
`at_step` draws (the loader is a pure function), so each is found at a known step.

What it must show: 0 restarts; every fault's episode complete (fault, detect, recovery,
recover_end, then a commit; tests/test_reliability_faults.py's check_run); the final weights
and every loss bit-identical to the reference run, which is the run of only its data faults
(a NaN shard changes the data by design, every other fault must change no bit); and the
survivors' memory flat: the resident set, open descriptors and threads of each worker that
lived through the whole run, sampled from /proc after the first steps, mid-run and at the end
(threads and descriptors at every count, the resident set at full counts). It held once each
generation's old gloo groups were aborted and dropped (runtime/groups.py): before, each survivor
kept ~3 threads and ~6 descriptors per generation.
"""
from __future__ import annotations

import json
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from test_reliability_faults import (FULL, SPIKE, Tally, check_run, data_faults, drawn_shards, note_run, run,
                                     same_trajectory, scenario_text)

FAULTS = 200 if FULL else 20
SPIKES = 30 if FULL else 3
SHARDS = 256
SPIKED = ["a/1", "b/1", "c/1"]  # never killed: the spikes' targets, and the run's last three workers
# (fraction of the run, fault): the kills, spread over the run
KILLS = [(0.10, {"class": "partial_cluster_loss", "target": "a", "nodes": 1}),   # a/0: the checkpoint writer
         (0.35, {"class": "hardware_fault", "target": "d/1"}),                     # the hot spare
         (0.60, {"class": "partial_cluster_loss", "target": "d", "nodes": 1}),   # d/0
         (0.85, {"class": "hardware_fault", "target": "b/0"})]
SPIKE_GAP = 30       # steps between spikes: the same node again only every 3 x 30 steps
TAIL = 80            # steps after the last fault (the last spike is 25 before it)
# growth of a survivor's resident set over the second half of the run that still counts as flat
RSS_SLACK_BYTES = 8 * 2**20

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(900 if FULL else 300)]


def soak_schedule(seed: int = 7) -> list[dict[str, Any]]:
    """FAULTS faults: the four kills, SPIKES spikes every SPIKE_GAP steps, and NaN shards
    every 2-6 steps in between."""
    rng = random.Random(seed)
    nan = FAULTS - SPIKES - len(KILLS)
    length = SPIKES * SPIKE_GAP
    steps_nan = sorted(rng.sample(range(2, length), nan))
    out: list[dict[str, Any]] = []
    for i in range(SPIKES):
        out.append({"at_step": 5 + i * SPIKE_GAP, "class": "network_jitter", "target": SPIKED[i % 3], **SPIKE})
    for frac, kill in KILLS:
        out.append({"at_step": int(frac * length) + 1, **kill})
    taken = {f["at_step"] for f in out}
    quarantine: set[int] = set()
    for at in steps_nan:
        while at in taken:  # one fault per step: each its own decision point
            at += 1
        taken.add(at)
        shard = rng.choice(sorted(drawn_shards(at, quarantine, SHARDS) - quarantine))
        quarantine.add(shard)
        out.append({"at_step": at, "class": "data_shard_skew", "target": f"shard/{shard}"})
    return sorted(out, key=lambda f: f["at_step"])


class MemorySampler(threading.Thread):
    """Every `every` seconds: resident set and open descriptors of each process below this
    one (the fork server's workers), and the steps committed so far (from the event log)."""

    def __init__(self, events: Path, every: float = 0.5):
        super().__init__(daemon=True)
        self.events, self.every = events, every
        self.samples: dict[int, list[tuple[int, int, int, int]]] = {}  # pid -> [(committed, rss, fds, threads)]
        self.stop = threading.Event()

    def committed(self) -> int:
        try:
            with open(self.events, "rb") as fh:
                fh.seek(max(0, os.path.getsize(self.events) - 4096))
                lines = fh.read().decode(errors="replace").splitlines()
        except OSError:
            return 0
        for line in reversed(lines):
            try:
                return int(json.loads(line)["step"])
            except (ValueError, KeyError):
                continue
        return 0

    def run(self) -> None:
        while not self.stop.wait(self.every):
            step = self.committed()
            for pid in descendants(os.getpid()):
                rss, fds, threads = usage(pid)
                if rss:
                    self.samples.setdefault(pid, []).append((step, rss, fds, threads))


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    kids = [int(x) for x in fh.read().split()]
                out += kids
                todo += kids
        except OSError:
            continue
    return out


def usage(pid: int) -> tuple[int, int, int]:
    """Resident bytes, open descriptors and threads of `pid` (zeros once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            status = dict(line.split(":", 1) for line in fh if ":" in line)
        rss = int(status["VmRSS"].split()[0]) * 1024
        return rss, len(os.listdir(f"/proc/{pid}/fd")), int(status["Threads"])
    except (OSError, KeyError, ValueError):
        return 0, 0, 0


@pytest.fixture(scope="module")
def soak(tmp_path_factory) -> dict[str, Any]:
    """The soak run (sampled) and its reference, once for the module's tests."""
    tmp = tmp_path_factory.mktemp("soak")
    schedule = soak_schedule()
    steps = schedule[-1]["at_step"] + TAIL
    (tmp / "soak.toml").write_text(scenario_text(schedule).replace("shards = 16", f"shards = {SHARDS}")
                                   .replace("steps = 100", f"steps = {steps}"))  # `keel run` replays it
    out = tmp / "soak"
    out.mkdir()
    sampler = MemorySampler(out / "events.jsonl")
    sampler.start()
    t0 = time.monotonic()
    try:
        summary, events = run(out, schedule, steps, f"data.shards={SHARDS}")
    finally:
        sampler.stop.set()
        sampler.join()
    wall = time.monotonic() - t0
    only_data, _ = run(tmp / "only-data", data_faults(schedule), steps, f"data.shards={SHARDS}")
    # the survivors' usage: the first sample after step 20 against the last one
    memory = {}
    for node in (n for n in SPIKED + ["c/0"] if len(summary["pids"][n]) == 1):
        (pid,) = summary["pids"][node]
        series = [s for s in sampler.samples.get(pid, []) if s[0] >= 20]
        assert len(series) >= 2, (node, sampler.samples.get(pid))
        (s0, rss0, _, _), (s1, rss1, _, _) = series[0], series[-1]
        # threads and descriptors: the fewest over the first and the last five samples (threads
        # that come and go: a store pool refill sleeps 2-10 s, a group reaper lives ~50 ms)
        fd0, th0 = min(x[2] for x in series[:5]), min(x[3] for x in series[:5])
        fd1, th1 = min(x[2] for x in series[-5:]), min(x[3] for x in series[-5:])
        mid = series[len(series) // 2]
        memory[node] = {"steps": [s0, mid[0], s1], "rss_mib": [round(x / 2**20, 1) for x in (rss0, mid[1], rss1)],
                        "fds": [fd0, fd1], "threads": [th0, th1]}
    print(json.dumps({"soak_memory": memory, "generations": summary["generations"]}))
    return {"schedule": schedule, "steps": steps, "summary": summary, "events": events, "wall_s": wall,
            "only_data": only_data, "memory": memory}


def test_soak(soak, record):
    schedule, steps, summary, events = soak["schedule"], soak["steps"], soak["summary"], soak["events"]
    assert len(schedule) == FAULTS and {f["class"] for f in schedule} == {
        "hardware_fault", "partial_cluster_loss", "network_jitter", "data_shard_skew"}
    tally: Tally = check_run(summary, events, schedule, steps)
    assert sum(tally.survived.values()) == FAULTS
    assert tally.parked >= SPIKES // 2, f"only {tally.parked} of {SPIKES} spikes parked their straggler"
    assert events[-1].kind == "run_end" and events[-1].detail["final_weights_sha256"]
    same_trajectory(summary, soak["only_data"], "the run of only its data faults")
    assert len(soak["memory"]) == 4  # a/1, b/1, c/1, c/0 lived through it all
    note_run(record, "soak", tally, soak["wall_s"], steps=steps, generations=summary["generations"],
             quarantined=len(summary["quarantine"]))
    record.note("survivors after step 20 -> at the end (MiB resident; open descriptors; threads)",
                ", ".join(f"{n} {m['rss_mib'][0]} -> {m['rss_mib'][2]}; {m['fds'][0]} -> {m['fds'][1]}; "
                          f"{m['threads'][0]} -> {m['threads'][1]}" for n, m in soak["memory"].items()))


def test_soak_survivors_flat(soak):
    """The survivors' threads and descriptors at the end of the soak are what they were after
    its first steps, with some slack: threads that may be alive at the end and not at the start
    (the checkpoint writer's, once a survivor becomes the writer; a store-pool refill; a group
    reaper) took a/1 from 8 to 11-12 at full counts (4-5 Dec), and descriptors rose 2-10. The
    old leak kept ~3 threads and ~6 descriptors per generation: +27 and +54 over the reduced
    soak's 9 generations, +120 and +250 over the full soak's 41, so this holds at every count.

    The resident set is judged at full counts only, on its second half: it rises in the first (a
    survivor's RSS +5-17 MiB by mid-run in the full soak, 4 Dec, then +0.2-3.5 MiB to the end:
    allocator arenas and caches filling, not a cost per generation), and the old leak, ~0.4 MiB a
    generation, would add ~11 MiB there. The reduced soak (make test) is 11 s and 9 generations:
    the old leak would add ~2 MiB over its second half, below what the allocator alone moves it
    (+14.8 MiB on the CI machine, 5 Dec, for the checkpoint writer, +3.7 MiB here): a check
    there could not see the leak and could fail without one, so it only reports the figures."""
    for node, m in soak["memory"].items():
        assert m["threads"][1] <= m["threads"][0] + 8, f"{node}: threads {m}"
        assert m["fds"][1] <= m["fds"][0] + 16, f"{node}: open descriptors {m}"
        if FULL:
            assert (m["rss_mib"][2] - m["rss_mib"][1]) * 2**20 < RSS_SLACK_BYTES, f"{node}: resident set {m}"
