"""Across hosts for real: hosts are network namespaces on a bridge (tests/hostbed.py), the
coordinator listens on its host's address, workers are started on theirs by torchrun and by
`keel run --coordinator`, the job's secret comes through the environment, and gloo runs over
the hosts' interfaces. Faults: a worker SIGKILLed, a region cut off (its hosts' packets
dropped silently, its processes alive), the coordinator's host cut off."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hostbed
from runtime_helpers import REPO, write_scenario

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(hostbed.unavailable() is not None, reason=str(hostbed.unavailable()))]

PY = sys.executable
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
SECRET = "multihost-test-secret"
SILENCE_S = 6.0      # KEEL_COORDINATOR_SILENCE_S: a worker gives a silent coordinator up after this
REGIONS = [("a", 2), ("b", 2), ("c", 1)]
WORKER_HOSTS = {"a/0": 1, "a/1": 2, "b/0": 3, "b/1": 4, "c/0": 5}  # the coordinator is on host 0
STEPS = 60


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KEEL_", "GLOO_", "MASTER_", "RANK"))}
    return dict(env, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", KEEL_JOB_SECRET=SECRET,
                KEEL_COORDINATOR_SILENCE_S=str(SILENCE_S), **extra)


def _scenario(tmp: Path, interval: int = 20) -> Path:
    return write_scenario(tmp, steps=STEPS, regions=REGIONS, hot_spares=0, slots=4, interval=interval)


def _events(out: Path) -> list[dict]:
    try:
        text = (out / "events.jsonl").read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def _committed(out: Path) -> int:
    return max((e["step"] for e in _events(out) if e["kind"] == "step"), default=0)


def _wait(what: str, cond, timeout: float = 90.0, procs=()):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        for p in procs:
            assert p.poll() is None, f"{p.args[-6:]} exited {p.returncode} while waiting for {what}"
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


class Job:
    """A coordinator on host 0 of `bed` and one worker per scenario node on the hosts of
    WORKER_HOSTS, started the way docs/multihost.md says."""

    def __init__(self, bed: hostbed.HostBed, tmp: Path, name: str, scenario: Path, extra: list[str] = (),
                 listen: str | None = None):
        self.bed, self.tmp, self.name = bed, tmp, name
        self.out = tmp / name
        self.addr = f"{bed.addresses[0]}:29400"
        self.coord = bed.popen(0, [PY, "-m", "runtime.coordinator", str(scenario), "--listen", listen or self.addr,
                                   "--out", str(self.out), *extra],
                               log=tmp / f"{name}-coordinator.log", env=_env(), cwd=str(REPO))
        self.workers: dict[str, subprocess.Popen] = {}

    def log(self, node: str) -> Path:
        return self.tmp / f"{self.name}-{node.replace('/', '_')}.log"

    def torchrun(self, nodes: list[str]) -> None:
        """One torchrun agent per host, static rendezvous on the first node's host; RANK i is
        the scenario's i-th node (docs/multihost.md)."""
        master = self.bed.addresses[WORKER_HOSTS[nodes[0]]]
        for rank, node in enumerate(nodes):
            self.workers[node] = self.bed.popen(
                WORKER_HOSTS[node],
                [TORCHRUN, "--nproc-per-node", "1", "--nnodes", str(len(nodes)), "--node-rank", str(rank),
                 "--master-addr", master, "--master-port", "29500", "--monitor-interval", "0.5",
                 "-m", "runtime.worker", "--coordinator", self.addr],
                log=self.log(node), env=_env(GLOO_SOCKET_IFNAME="eth0"), cwd=str(REPO))

    def keel_run(self, scenario: Path, nodes: list[str]) -> None:
        for node in nodes:
            self.workers[node] = self.bed.popen(
                WORKER_HOSTS[node], [PY, "-m", "keel.cli", "run", str(scenario), "--coordinator", self.addr],
                log=self.log(node), env=_env(KEEL_NODE=node), cwd=str(REPO))

    def worker_pid(self, node: str) -> int:
        return int(_wait(f"{node}'s pid", lambda: re.search(rf"worker {node} pid (\d+): joined",
                                                            self.log(node).read_text()), procs=[self.coord]).group(1))

    def finish(self, timeout: float = 150.0) -> dict:
        rc = self.coord.wait(timeout=timeout)
        assert rc == 0, (self.tmp / f"{self.name}-coordinator.log").read_text()[-3000:]
        return json.loads((self.out / "summary.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fault-free run on the same hosts, its workers started by `keel run --coordinator`,
    its coordinator listening on every interface (README's `--listen 0.0.0.0:29400`)."""
    tmp = tmp_path_factory.mktemp("multihost-ref")
    path = _scenario(tmp)
    with hostbed.HostBed(1 + len(WORKER_HOSTS)) as bed:
        job = Job(bed, tmp, "ref", path, ["--no-faults"], listen="0.0.0.0:29400")
        job.keel_run(path, list(WORKER_HOSTS))
        summary = job.finish()
        codes = {n: p.wait(timeout=30) for n, p in job.workers.items()}
    assert codes == {n: 0 for n in WORKER_HOSTS}
    assert summary["steps"] == STEPS and summary["restarts"] == 0 and summary["faults"] == []
    return summary


def test_a_killed_worker_and_a_cut_off_region_are_absorbed_across_hosts(reference, tmp_path):
    """Six hosts: the coordinator on its own, five workers by torchrun (four) and keel run (one).
    a/1 is SIGKILLed; later region b's two hosts are cut off (nftables in the bridge: they
    still reach each other, nothing else). Both absorbed, 0 restarts, weights bit-identical to
    the fault-free run; the cut-off workers commit nothing after the cut, and after the heal
    they are told to leave (exit 3) instead of rejoining the group."""
    path = _scenario(tmp_path)
    with hostbed.HostBed(1 + len(WORKER_HOSTS)) as bed:
        job = Job(bed, tmp_path, "faults", path)
        job.torchrun(["a/0", "a/1", "b/0", "b/1"])
        job.keel_run(path, ["c/0"])
        victim = job.worker_pid("a/1")
        _wait("step 8", lambda: _committed(job.out) >= 8, procs=[job.coord])
        os.kill(victim, 9)
        _wait("the kill's recovery", lambda: any(e["kind"] == "recover_end" for e in _events(job.out)),
              procs=[job.coord])
        at = _committed(job.out) + 3
        _wait(f"step {at}", lambda: _committed(job.out) >= at, procs=[job.coord])
        bed.cut_region([WORKER_HOSTS["b/0"], WORKER_HOSTS["b/1"]])
        t_cut = time.monotonic()
        cut_step = _committed(job.out)
        _wait("b's loss detected", lambda: sum(e["kind"] == "detect" for e in _events(job.out)) >= 3,
              procs=[job.coord])
        _wait("the next commit", lambda: _committed(job.out) > cut_step + 1, procs=[job.coord])
        reformed_s = time.monotonic() - t_cut
        bed.heal()
        summary = job.finish()
        b_codes = {n: job.workers[n].wait(timeout=SILENCE_S + 30) for n in ("b/0", "b/1")}
        logs = {n: job.log(n).read_text() for n in ("b/0", "b/1")}
        events = _events(job.out)
    print(f"region b cut off at step {cut_step}: commits resumed {reformed_s:.2f} s after the cut")
    assert summary["steps"] == STEPS and summary["restarts"] == 0
    classes = sorted((f["class"], f["target"]) for f in summary["faults"])
    assert classes == [("hardware_fault", "a/1"), ("hardware_fault", "b/0"), ("hardware_fault", "b/1")], classes
    assert all(f["action"] == "replicate_resume" for f in summary["faults"])
    assert summary["final_weights_sha256"] == reference["final_weights_sha256"]
    assert summary["losses"] == reference["losses"]
    # safety: the cut-off workers never rejoined a generation and left with the documented code
    # (torchrun reports its worker's exit code 3 as a failure of its own)
    for node, code in b_codes.items():
        exit_line = re.search(rf"worker {node}: no coordinator took this worker back within {SILENCE_S:g} s; "
                              rf"exiting \(code 3\) at step (\d+)", logs[node])
        assert code != 0 and exit_line, logs[node][-2000:]
        assert int(exit_line.group(1)) <= cut_step + 1, "a cut-off worker committed past the step in flight"
    after = [e for e in events if e["kind"] == "reslot" and e["detail"]["fault_id"] > 0]
    assert after and all(not set(e["detail"]["slot_map"]) & {"b/0", "b/1"} for e in after)
    assert [e["step"] for e in events if e["kind"] == "step"] == list(range(1, STEPS + 1))


def test_the_coordinator_s_host_cut_off(reference, tmp_path):
    """The coordinator's host cut off (its bridge port down: both ways, silently) while five
    workers on five hosts train, a checkpoint every 4 steps: the workers still reach one another
    but apply at most COMMIT_LEAD_STEPS beyond what the coordinator confirmed, then hold, and
    exit with code 3 and one line saying so within silence_s (plus a margin for their last
    messages). Nothing they did alone is committed: no checkpoint of a step past the
    coordinator's log is published, so `keel run --resume` on the run directory starts at or
    before its last commit, and ends bit-identical to the fault-free run."""
    from runtime.checkpoint_read import verify_checkpoint
    from runtime.protocol import COMMIT_LEAD_STEPS, EXIT_COORDINATOR_LOST
    path = _scenario(tmp_path, interval=4)
    with hostbed.HostBed(1 + len(WORKER_HOSTS)) as bed:
        job = Job(bed, tmp_path, "cut", path)
        job.torchrun(["a/0", "a/1", "b/0", "b/1"])
        job.keel_run(path, ["c/0"])
        _wait("checkpoint 20", lambda: any(e["kind"] == "checkpoint_end" and e["detail"].get("ckpt_step") == 20
                                           for e in _events(job.out)), procs=[job.coord])
        bed.cut(0)
        t_cut = time.monotonic()
        codes = {}
        for node, proc in job.workers.items():
            codes[node] = proc.wait(timeout=SILENCE_S + 60)
        exit_s = time.monotonic() - t_cut
        logs = {n: job.log(n).read_text() for n in job.workers}
        taken = _committed(job.out)
        bed.heal()
    published = [int(p.name[5:]) for p in (job.out / "checkpoints").glob("step-*") if not verify_checkpoint(p)]
    applied = {}
    print(f"coordinator's host cut off at step {taken}: every worker gone {exit_s:.2f} s after the cut")
    assert codes["c/0"] == EXIT_COORDINATOR_LOST, logs["c/0"][-2000:]
    assert all(c != 0 for c in codes.values())
    for node, log in logs.items():
        line = re.search(rf"worker {node}: no coordinator took this worker back within {SILENCE_S:g} s; "
                         rf"exiting \(code 3\) at step (\d+), (\d+) beyond the last the coordinator confirmed", log)
        assert line, log[-2000:]
        assert int(line.group(1)) - taken <= COMMIT_LEAD_STEPS + 1 and int(line.group(2)) <= COMMIT_LEAD_STEPS
        applied[node] = int(line.group(1))
    print(f"steps applied by the workers alone: {applied}; checkpoints published: {sorted(published)}")
    assert exit_s < SILENCE_S + 15, f"workers outlived their coordinator's silence by {exit_s - SILENCE_S:.1f} s"
    # the workers reached a checkpoint step past the coordinator's last commit (a writer waits at
    # most 4 steps ahead of its confirmed step, and they may apply 16), and none was published
    assert max(applied.values()) >= (taken // 4 + 1) * 4, (applied, taken)
    assert published and max(published) <= taken, f"a checkpoint past the coordinator's last commit ({taken})"
    t0 = time.monotonic()
    resumed = subprocess.run([PY, "-m", "keel.cli", "run", str(path), "--resume", str(job.out), "--json"],
                             capture_output=True, text=True, cwd=str(REPO), env=_env(), timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    print(f"keel run --resume: {time.monotonic() - t0:.1f} s to the end of the run")
    summary = json.loads(resumed.stdout)
    assert summary["start_step"] == max(published) <= taken
    assert summary["final_weights_sha256"] == reference["final_weights_sha256"]
    assert summary["losses"] == reference["losses"][-len(summary["losses"]):]
