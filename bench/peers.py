"""keel against the tools people know, side by side in one invocation: the same job (the one
`--scenario` names through keel's job API: keel's GPT for bench/peers-4.toml, the default; the
transformers example for bench/peers-4-llama.toml), the same data (keel's sampler, one slot per
worker), 4 workers, the same seed and the same fault (worker 1 SIGKILLed once `--kill-at` steps
are committed):

- `torchrun`: torch.distributed.run `--max-restarts 1`, DDP on gloo, a checkpoint every
  `--checkpoint-every` steps (torch.save, fsynced, renamed), resume on restart;
- `torchft`: torchft 0.2.0 (Lighthouse, Manager, its DDP and optimizer wrappers), one replica
  group per worker, each under its own torchrun `--max-restarts 1` as torchft deploys them
  (skipped, with the reason, where torchft is not installed: `pip install -e '.[peers]'`);
- `keel_absorb` and `keel_restart`: keel's runtime (runtime.api.run_scenario) on
  the scenario, policy `absorb` (no hot spare: the 3 survivors take the slot) and
  `checkpoint_restart`.

Plain DDP (the same script as torchrun, no checkpoints, no fault) is the step-time baseline.
Step time: one session per tool (and one of DDP against itself, the check that the method finds
no difference where there is none). The tool's job and a DDP job start together; once both are
past WARMUP_STEPS they take turns on the machine, the other frozen (SIGSTOP): D T D T ... D,
`--window` seconds each, `--cycles` T windows. A window's time per step is its span over the
steps committed in it (throughput: a checkpoint's cost counts); a cycle's ratio is T's over the
geometric mean of the two DDP windows around it, measured within a second of each other, so the
machine's other load moves both alike. Reported: the geometric mean of the cycles' ratios with
its 95 % interval (Student t on the logs), and every two tools compared (ranked where the
interval of their quotient leaves out 1).

Faults: `--repeats` rounds, each of every tool's fault-free run (30 steps) and its run with the
fault: downtime (the fault to the first step committed after it, from each tool's own commit
times), steps committed again, processes restarted, and whether the final weights (bitwise) and
the data every step trained on equal the same round's fault-free run's. A run that fails or
hangs (120 s) is recorded under "failures" and retried once.

    .venv/bin/python bench/peers.py [--repeats 3] [--cycles 16] [--window 1] [--tools torchrun,torchft,keel_absorb,keel_restart] [--json]
    .venv/bin/python bench/peers.py --scenario bench/peers-4-llama.toml --repeats 0   # step time only, the transformers example
    .venv/bin/python bench/peers.py --resume-trace   # torchrun's resume against its fault-free run, step by step

`--json` prints one object: {"tools": {NAME: {"downtime_s", "downtime_s_range", "step_ratio_to_ddp",
"step_ratio_to_ddp_ci95", "steps_recomputed", "processes_restarted", "weights_equal_fault_free",
"data_equal_fault_free", ...}}, "sessions", "step_ranking", "machine", "date", "skipped", "failures", ...}.

torchft's settings: a Lighthouse with min_replicas 3 and its default 5 s heartbeat timeout, the
Manager and ProcessGroupGloo with a 5 s timeout (`--torchft-timeout`; the Manager's default is
60 s), min_replica_size 3, the data of a step keyed by the manager's step (the best a user can do).

Workarounds the harness applies to peers (printed with the results):
- torchrun: the workers build the default group on the agent's store under a prefix per
  restart attempt (bench/peers_train.py `init_group`): with torch 2.13.0 the relaunched workers'
  `init_process_group("gloo")` read the first attempt's gloo addresses and failed
  ("Gloo connectFullMesh failed ... Connection refused") or hung;
- torchft: its DDP comm hook is patched (bench/peers_train.py `patch_torchft_comm_hook`): 0.2.0
  asserts on the future of a failed all-reduce, so a peer's death crashed every survivor;
- torchft: the four replicas wait for each other (a file each) before their first step, so the
  first quorum holds all four (with `min_replicas` 3 the Lighthouse may form it without a
  replica that is still importing torch, and the fault-free run's data would change run to run).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from keel.stats import mean_ci95, t95  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "bench" / "peers_train.py"
SCENARIO = ROOT / "bench" / "peers-4.toml"
TOOLS = ("torchrun", "torchft", "keel_absorb", "keel_restart")
# not a peer: torchrun resuming the weights but not the optimizer state, a tool whose weights
# must come out different from its fault-free run (tests/test_peers.py)
CHECK_TOOLS = ("torchrun_weights_only",)
WORKAROUNDS = {
    "torchrun": "default group on the agent's store under a prefix per restart attempt (torch 2.13.0's "
                "relaunched gloo group read the first attempt's addresses: connectFullMesh refused or hung)",
    "torchft": "DDP comm hook patched (0.2.0 asserts on a failed all-reduce's future, which crashed every "
               "survivor); the 4 replicas wait for each other before their first step (a file each), so the "
               "first quorum holds all four",
}
RUN_TIMEOUT_S = 120  # a run takes 10-40 s here; one that hangs is recorded, retried once
WARMUP_STEPS = 5  # a run's step time leaves out its first steps (DDP rebuilds its buckets, caches fill)


@dataclasses.dataclass
class Config:
    scenario: str = str(SCENARIO)  # keel's scenario; its job is every tool's (bench/peers_train.py)
    keel_sets: tuple[str, ...] = ()  # further overrides of keel's scenario, keel's runs only (reduction.format=int64)
    steps: int = 30
    kill_at: int = 15
    checkpoint_every: int = 10
    workers: int = 4
    torchft_timeout_s: float = 5.0
    lighthouse_heartbeat_ms: int = 5000  # torchft's default (1000 dropped live replicas on this loaded machine)

    def overrides(self) -> list[str]:
        return [f"run.steps={self.steps}", f"checkpoint.interval_steps={self.checkpoint_every}",
                f"faults.schedule.0.at_step={self.kill_at}"]


TINY = Config(steps=8, kill_at=5, checkpoint_every=2)


# ----------------------------------------------------------------------------- a run's timeline

@dataclasses.dataclass
class Run:
    """What every tool's run comes down to: commits (t, step, slot, samples, took part),
    the kill's time, the pids per slot and the final weights' sha256."""
    commits: list[tuple[float, int, int, tuple, bool]]
    kill_t: float | None
    pids: dict[int, list[int]]
    sha: str
    wall_s: float
    kill_step: int | None = None  # steps committed when the fault struck
    restart_t: float | None = None  # the first relaunched process's start (peers)

    def committed_at(self) -> dict[int, float]:
        """Step -> the time it was first committed by all its participants (the last of them)."""
        first: dict[int, dict[int, float]] = {}
        for t, step, slot, _, part in self.commits:
            if part:
                first.setdefault(step, {}).setdefault(slot, t)
        return {s: max(by_slot.values()) for s, by_slot in first.items()}

    def step_time_s(self) -> float:
        """The median interval between consecutive commits past the first WARMUP_STEPS."""
        at = sorted(self.committed_at().items())
        xs = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(at, at[1:]) if b[0] > a[0]]
        past = [x for (a, _), x in zip(at, xs) if a >= WARMUP_STEPS]
        return statistics.median(past or xs)

    def data(self) -> dict[int, tuple]:
        """Step -> what its update was computed from: (slot, samples) of every participant, as
        the step was last committed."""
        last: dict[int, dict[int, tuple]] = {}
        for t, step, slot, samples, part in sorted(self.commits):
            if part:
                last.setdefault(step, {})[slot] = samples
        return {s: tuple(sorted(v.items())) for s, v in last.items()}

    def fault_figures(self) -> dict:
        assert self.kill_t is not None and self.kill_step is not None, "a run without a fault"
        last_before = self.kill_step
        # a commit after the kill: a step beyond the one reached, or one recomputed by a relaunched
        # process (a survivor's log line for the step reached can land just after the kill)
        after = sorted((t, step) for t, step, _, _, part in self.commits if part and t > self.kill_t and (
            step > last_before or (self.restart_t is not None and t > self.restart_t)))
        downtime = after[0][0] - self.kill_t if after else float("nan")
        recomputed = len({step for _, step in after if step <= last_before})
        back = next((t for t, step in after if step > last_before), float("nan")) - self.kill_t
        return {"downtime_s": downtime, "steps_recomputed": recomputed, "back_to_pace_s": back,
                "processes_restarted": sum(len(p) - 1 for p in self.pids.values())}


def read_peer_logs(out: Path, wall_s: float) -> Run:
    commits, pids, kill_t, kill_step, restart_t, shas = [], {}, None, None, None, {}
    for path in sorted(out.glob("log-*.jsonl")):
        slot = int(path.stem.split("-")[1])
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            if r["kind"] == "start":
                pids.setdefault(slot, []).append(r["pid"])
                if r["attempt"] > 0:
                    restart_t = min(restart_t or r["t"], r["t"])
            elif r["kind"] == "commit":
                commits.append((r["t"], r["step"], slot, tuple(r["samples"]), bool(r["part"])))
            elif r["kind"] == "kill":
                kill_t, kill_step = r["t"], r["step"]
            elif r["kind"] == "end":
                shas[slot] = r["sha"]
    if len(set(shas.values())) != 1 or 0 not in shas:
        raise RuntimeError(f"{out}: the workers ended with different weights, or worker 0 did not end: {shas}")
    return Run(commits, kill_t, pids, shas[min(shas)], wall_s, kill_step, restart_t)


# ----------------------------------------------------------------------------- launching peers

def count_lines(path: Path, mark: bytes) -> int:
    """How many times `mark` occurs in `path` (0 while it does not exist)."""
    try:
        return path.read_bytes().count(mark)
    except FileNotFoundError:
        return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(nproc: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "--max-restarts=1", "--monitor-interval=0.1", str(TRAIN), *extra]


def wait_all(procs: list[subprocess.Popen], what: str, timeout: float = RUN_TIMEOUT_S,
             done=lambda: False, out: Path | None = None) -> None:
    """Wait for every launcher to exit 0, or until `done()` says the run has all it needs
    (the launchers left are then killed)."""
    deadline = time.monotonic() + timeout
    try:
        while not done():
            if all(p.poll() is not None for p in procs):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: did not finish in {timeout:.0f} s")
            time.sleep(0.1)
        for p in procs:
            if p.poll() not in (None, 0):
                raise RuntimeError(f"{what}: a launcher exited with {p.returncode}; see the logs there")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if out is not None:
            reap(out)


def reap(out: Path) -> None:
    """SIGKILL every process still running with `out` on its command line: a launcher's workers
    can outlive it (torchrun's agent exited and left two workers running for an hour, 4 Dec)."""
    mark = str(out).encode()

    def running() -> list[int]:
        found = []
        for pid in (int(d) for d in os.listdir("/proc") if d.isdigit() and int(d) != os.getpid()):
            try:
                if mark in Path(f"/proc/{pid}/cmdline").read_bytes():  # a zombie's is empty
                    found.append(pid)
            except OSError:
                pass
        return found

    deadline = time.monotonic() + 10.0
    while (pids := running()) and time.monotonic() < deadline:  # SIGKILL is not instant: wait it out
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def spawn(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    f = open(log, "w")
    return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})})


def run_torchrun(cfg: Config, out: Path, *, fault: bool, checkpoints: bool = True, weights_only: bool = False,
                 train_args: tuple[str, ...] = ()) -> Run:
    out.mkdir(parents=True)
    extra = ["--mode", "torchrun", "--out", str(out), "--scenario", cfg.scenario,
             "--checkpoint-every", str(cfg.checkpoint_every if checkpoints else 0),
             *sum((["--set", s] for s in cfg.overrides()), []), *train_args]
    if fault:
        extra += ["--kill-at", str(cfg.kill_at)]
    if weights_only:
        extra += ["--resume-weights-only"]
    t0 = time.monotonic()
    wait_all([spawn(torchrun_cmd(cfg.workers, extra), out / "torchrun.log")], f"torchrun ({out})", out=out,
             done=lambda: all_ended(out, cfg.workers))
    return read_peer_logs(out, time.monotonic() - t0)


def run_torchft(cfg: Config, out: Path, *, fault: bool) -> Run:
    from torchft._torchft import LighthouseServer
    out.mkdir(parents=True)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=cfg.workers - 1,
                                  heartbeat_timeout_ms=cfg.lighthouse_heartbeat_ms)
    try:
        env = {"TORCHFT_LIGHTHOUSE": lighthouse.address()}
        procs = []
        t0 = time.monotonic()
        for r in range(cfg.workers):
            extra = ["--mode", "torchft", "--out", str(out), "--scenario", cfg.scenario, "--replica", str(r),
                     "--replicas", str(cfg.workers),
                     "--torchft-timeout", str(cfg.torchft_timeout_s), *sum((["--set", s] for s in cfg.overrides()), [])]
            if fault:
                extra += ["--kill-at", str(cfg.kill_at)]
            procs.append(spawn(torchrun_cmd(1, extra), out / f"replica-{r}.log", env))
        wait_all(procs, f"torchft ({out})", done=lambda: torchft_done(out, cfg, fault), out=out)
        return read_peer_logs(out, time.monotonic() - t0)
    finally:
        lighthouse.shutdown()


def all_ended(out: Path, workers: int) -> bool:
    """Every worker has written its final weights: the run has all it needs. (Twice in about 50
    runs the torchrun agent did not exit after its relaunched workers had all ended.)"""
    logs = [out / f"log-{r}.jsonl" for r in range(workers)]
    return all(p.exists() and '"kind": "end"' in p.read_text() for p in logs)


def torchft_done(out: Path, cfg: Config, fault: bool) -> bool:
    """The survivors have ended and the killed replica's torchrun has started it again. The
    survivors go on with 3 replicas and finish before the relaunched one can rejoin (its torch
    import alone takes longer than the steps left), which would then wait out its quorum timeout."""
    if not fault:
        return False
    ended = [p for p in out.glob("log-*.jsonl") if '"kind": "end"' in p.read_text()]
    victim = out / "log-1.jsonl"
    restarted = victim.exists() and '"attempt": 1' in victim.read_text()
    return len(ended) >= cfg.workers - 1 and restarted


def run_keel(cfg: Config, out: Path, *, policy: str, fault: bool) -> Run:
    from keel.events import read_events
    from keel.scenario import load
    from runtime.api import run_scenario
    from runtime.job_run import BoundJob, load_spec

    sc = load(cfg.scenario, [f"policy.kind={policy}", *cfg.overrides(), *cfg.keel_sets])
    summary = run_scenario(sc, out, progress=False, no_faults=not fault, hangs="")
    events = read_events(out / "events.jsonl")
    sampler = BoundJob(load_spec(sc), sc).loader.sampler  # the job's data under keel's sampler, as the workers drew it
    quarantine = frozenset(summary.get("quarantine") or ())
    slots = set(range(sc.slot_count))  # the first generation holds every slot
    commits, kill_t, kill_step = [], None, None
    for e in events:
        if e.kind == "fault":  # the coordinator's SIGKILL, once `kill_step` steps are committed
            kill_t, kill_step = e.t, e.step
        elif e.kind == "reslot" and "slot_map" in e.detail:
            slots = {s for held in e.detail["slot_map"].values() for s in held}
        elif e.kind == "step":  # one record per slot the committed step reduced
            for s in sorted(slots):
                commits.append((e.t, e.step, s, tuple(sampler.indices(e.step - 1, s, quarantine)), True))
    pids = {i: list(p) for i, p in enumerate(summary["pids"].values())}
    # the coordinator commits a step once every member reported it: every step event after the
    # fault is one committed after it (restart_t = kill_t)
    return Run(commits, kill_t, pids, summary["final_weights_sha256"], summary["wall_s"], kill_step, kill_t)


# ----------------------------------------------------------------------------- a tool's runs

def torchft_missing() -> str | None:
    import importlib
    try:
        importlib.import_module("torchft")
        importlib.import_module("torchft._torchft").LighthouseServer
    except Exception as e:  # ImportError, or a build that does not load with this torch
        return f"torchft not importable ({type(e).__name__}: {e}); install the extra: pip install -e '.[peers]'"
    return None


def fault_free(tool: str, cfg: Config, out: Path) -> Run:
    if tool in ("torchrun", "torchrun_weights_only"):
        return run_torchrun(cfg, out, fault=False)
    if tool == "torchft":
        return run_torchft(cfg, out, fault=False)
    return run_keel(cfg, out, policy="absorb", fault=False)


def faulted(tool: str, cfg: Config, out: Path) -> Run:
    if tool == "torchrun":
        return run_torchrun(cfg, out, fault=True)
    if tool == "torchrun_weights_only":
        return run_torchrun(cfg, out, fault=True, weights_only=True)
    if tool == "torchft":
        return run_torchft(cfg, out, fault=True)
    return run_keel(cfg, out, policy="absorb" if tool == "keel_absorb" else "checkpoint_restart", fault=True)


def attempt(run, where: Path, failures: list[dict]):
    """`run(directory)`, once more (in a fresh directory) if it fails; each failure is recorded
    (and reported: a peer that hangs after a restart is a result too). None if both fail."""
    for k in range(2):
        d = where if k == 0 else where.with_name(where.name + "-retry")
        try:
            return run(d)
        except Exception as e:  # a hang, a launcher's failure, keel's RunFailed: recorded
            failures.append({"run": where.name, "try": k + 1, "error": str(e)[:300]})
            print(f"peers.py: {where.name}: {e}", file=sys.stderr)
    return None


def median_range(xs: list[float]) -> tuple[float, list[float]]:
    return statistics.median(xs), [min(xs), max(xs)]


def geometric_mean_ci(ratios: list[float]) -> tuple[float, list[float]]:
    """The geometric mean of `ratios` and its 95 % confidence interval (Student t on the logs)."""
    mean, (lo, hi) = mean_ci95([math.log(r) for r in ratios])
    return math.exp(mean), [math.exp(lo), math.exp(hi)]


# ----------------------------------------------------------------------------- step time: paired, alternating windows

class Job:
    """A tool's run launched for a timing session (process trees under `roots`), whose
    processes are frozen (SIGSTOP) and thawed (SIGCONT) together; `committed()` counts the
    steps it has committed so far."""

    def __init__(self, roots: list[subprocess.Popen], committed, closing=None) -> None:
        self.roots, self.committed, self.closing = roots, committed, closing
        self.pids: list[int] = []

    def tree(self) -> list[int]:
        """The roots and every descendant of theirs, now."""
        children: dict[int, list[int]] = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    raw = Path(f"/proc/{d}/stat").read_bytes()
                except OSError:
                    continue
                children.setdefault(int(raw[raw.rindex(b")") + 2:].split()[1]), []).append(int(d))
        out, todo = [], [p.pid for p in self.roots]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += children.get(pid, ())
        return out

    def signal(self, sig: int) -> None:
        for pid in self.pids or self.tree():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        # SIGKILL before SIGCONT: a frozen job let run first could log one more commit, a window
        # of its own after the last turn (a timing session saw one, 4 Dec)
        for pid in self.tree():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.signal(signal.SIGCONT)
        for p in self.roots:
            p.wait()
        if self.closing is not None:
            self.closing()


LONG_RUN = 100_000  # steps a timing session's jobs are given: they are stopped long before


def launch(tool: str, cfg: Config, out: Path) -> Job:
    """`tool` fault-free, as in its fault-free runs but with no end in sight. keel's run
    detects a dead worker after 30 s instead of 1 (a frozen window must not look like one)."""
    out.mkdir(parents=True)
    sets = [f"run.steps={LONG_RUN}", f"checkpoint.interval_steps={cfg.checkpoint_every}"]
    peer_commits = lambda: count_lines(out / "log-0.jsonl", b'"kind": "commit"')  # noqa: E731
    if tool == "ddp" or tool.startswith("torchrun"):
        extra = ["--mode", "torchrun", "--out", str(out), "--scenario", cfg.scenario, "--checkpoint-every",
                 "0" if tool == "ddp" else str(cfg.checkpoint_every), *sum((["--set", x] for x in sets), [])]
        return Job([spawn(torchrun_cmd(cfg.workers, extra), out / "torchrun.log")], peer_commits)
    if tool == "torchft":
        from torchft._torchft import LighthouseServer
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=cfg.workers - 1,
                                      heartbeat_timeout_ms=cfg.lighthouse_heartbeat_ms)
        env = {"TORCHFT_LIGHTHOUSE": lighthouse.address()}
        roots = [spawn(torchrun_cmd(1, ["--mode", "torchft", "--out", str(out), "--scenario", cfg.scenario,
                                        "--replica", str(r), "--replicas",
                                        str(cfg.workers), "--torchft-timeout", str(cfg.torchft_timeout_s),
                                        *sum((["--set", x] for x in sets), [])]), out / f"replica-{r}.log", env)
                 for r in range(cfg.workers)]
        return Job(roots, peer_commits, closing=lighthouse.shutdown)
    cmd = [sys.executable, "-m", "keel.cli", "run", cfg.scenario, "--out", str(out / "run"), "--no-faults",
           *sum((["--set", x] for x in ["policy.kind=absorb", "policy.detect_timeout_s=30", *sets, *cfg.keel_sets]), [])]
    return Job([spawn(cmd, out / "keel.log")], lambda: count_lines(out / "run" / "events.jsonl", b'"kind":"step"'))


def commit_times(out: Path) -> list[float]:
    """A timing job's commit times: rank 0's `commit` lines (a peer's, epoch seconds) or keel's
    `step` events (seconds since its run started)."""
    events = out / "run" / "events.jsonl"
    if events.exists():
        lines = [json.loads(x) for x in events.read_text().splitlines() if '"kind":"step"' in x]
        return [r["t"] for r in lines]
    lines = [json.loads(x) for x in (out / "log-0.jsonl").read_text().splitlines() if '"kind": "commit"' in x]
    return [r["t"] for r in lines]


def windows(times: list[float], gap_s: float) -> list[list[float]]:
    """`times` cut wherever the job stood still longer than `gap_s` (it was frozen)."""
    out: list[list[float]] = []
    for t in times:
        if out and t - out[-1][-1] <= gap_s:
            out[-1].append(t)
        else:
            out.append([t])
    return out


def paired_session(tool: str, cfg: Config, out: Path, cycles: int, window_s: float, min_commits: int = 5) -> dict:
    """`tool` and plain DDP launched together; once both are past WARMUP_STEPS they take turns
    on the machine, the other one frozen: D T D T ... D, `window_s` each. A window's time per
    step is its span over the steps committed in it (the job's log cut where it stood still); a
    cycle's ratio is T's over the geometric mean of the DDP windows either side of it: measured
    within a second of each other, so the machine's other load moves them alike."""
    ddp, job = launch("ddp", cfg, out / "baseline"), launch(tool, cfg, out / "timed")
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while ddp.committed() < WARMUP_STEPS or job.committed() < WARMUP_STEPS:
            if time.monotonic() > deadline or any(p.poll() is not None for p in ddp.roots + job.roots):
                raise RuntimeError(f"timing session {tool} ({out}): a job did not reach step {WARMUP_STEPS}")
            time.sleep(0.1)
        ddp.pids, job.pids = ddp.tree(), job.tree()
        job.signal(signal.SIGSTOP)
        start = time.time()
        active, idle = ddp, job
        for turn in range(2 * cycles + 1):
            time.sleep(window_s)
            active.signal(signal.SIGSTOP)
            if turn < 2 * cycles:
                idle.signal(signal.SIGCONT)
            active, idle = idle, active
    finally:
        ddp.close()
        job.close()
        reap(out)
    # each job's last windows: the turns (the timed job's own clock may not be ours: keel's)
    d = windows([t for t in commit_times(out / "baseline") if t >= start], window_s / 2)[-(cycles + 1):]
    t = windows(commit_times(out / "timed"), window_s / 2)[-cycles:]
    spans = [w[-1] - w[0] for w in d + t]
    if (len(d) != cycles + 1 or len(t) != cycles or min(map(len, d + t)) < min_commits
            or max(spans) > 1.2 * window_s):
        raise RuntimeError(f"timing session {tool} ({out}): {len(d)} DDP and {len(t)} {tool} windows of "
                           f"{min(map(len, d + t), default=0)}+ commits over at most {max(spans, default=0):.2f} s "
                           f"(expected {cycles + 1} and {cycles}, {min_commits}+ commits each, none longer than a turn)")
    ds, ts = [(w[-1] - w[0]) / (len(w) - 1) for w in d], [(w[-1] - w[0]) / (len(w) - 1) for w in t]
    ratios = [x / math.sqrt(ds[i] * ds[i + 1]) for i, x in enumerate(ts)]
    mean, ci = geometric_mean_ci(ratios)
    return {"ratio": mean, "ci95": ci, "range": [min(ratios), max(ratios)], "ratios": ratios,
            "ddp_ms": 1000 * statistics.median(ds), "ddp_ms_range": [1000 * min(ds), 1000 * max(ds)],
            "tool_ms": 1000 * statistics.median(ts), "window_s": window_s, "cycles": cycles,
            "log_se": statistics.stdev(math.log(r) for r in ratios) / math.sqrt(len(ratios))}


def rank_step_times(sessions: dict[str, dict]) -> list[dict]:
    """Every two tools' step times compared through their sessions' ratios to DDP: a's over
    b's, with the 95 % interval of the difference of the two mean logs (their standard errors
    added in quadrature, Student t at the smaller session's degrees of freedom); ranked where
    the interval leaves out 1."""
    out = []
    names = list(sessions)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            sa, sb = sessions[a], sessions[b]
            diff = math.log(sa["ratio"]) - math.log(sb["ratio"])
            half = t95(min(len(sa["ratios"]), len(sb["ratios"])) - 1) * math.hypot(sa["log_se"], sb["log_se"])
            ci = [math.exp(diff - half), math.exp(diff + half)]
            out.append({"a": a, "b": b, "a_over_b": math.exp(diff), "ci95": ci, "ranked": ci[1] < 1.0 or ci[0] > 1.0})
    return out


# ----------------------------------------------------------------------------- the comparison

def compare(tools: list[str], cfg: Config, repeats: int, work: Path, progress: bool = True, ddp: bool = True,
            cycles: int = 16, window_s: float = 1.0) -> dict:
    """Step time (with `ddp`): one paired session per tool against plain DDP (`paired_session`),
    and one of DDP against itself, the check that the method finds no difference where there is
    none. Faults: `repeats` rounds, each of every tool's fault-free run then its run with the
    fault (keel's fault-free run serves both keel policies: the policy acts only on a fault)."""
    from keel.progress import progress_bar

    ff_key = {t: ("keel" if t.startswith("keel") else "torchrun" if t.startswith("torchrun") else t) for t in tools}
    ff_names = list(dict.fromkeys(ff_key.values()))
    timed = ["ddp", *ff_names] if ddp else []
    rows: dict[str, list[dict]] = {t: [] for t in tools}
    ff_shas: dict[str, set[str]] = {name: set() for name in ff_names}
    ff_ms: dict[str, list[float]] = {name: [] for name in ff_names}
    sessions: dict[str, dict] = {}
    failures: list[dict] = []
    total = len(timed) + repeats * (len(ff_names) + len(tools))
    with progress_bar(total=total, desc="peers", unit="run", enabled=progress, every_s=15.0) as bar:
        for name in timed:
            got = attempt(lambda d: paired_session(name, cfg, d, cycles, window_s), work / f"timing-{name}", failures)
            if got is not None:
                sessions[name] = got
            bar.update()
        for rep in range(repeats):
            ff: dict[str, Run] = {}
            for name in ff_names:
                tool = next(t for t in tools if ff_key[t] == name)
                run = attempt(lambda d: fault_free(tool, cfg, d), work / f"r{rep}-{name}-ff", failures)
                if run is not None:
                    ff[name] = run
                    ff_shas[name].add(run.sha)
                    ff_ms[name].append(1000 * run.step_time_s())
                bar.update()
            for tool in tools:
                run = attempt(lambda d: faulted(tool, cfg, d), work / f"r{rep}-{tool}-fault", failures)
                bar.update()
                if run is None or ff_key[tool] not in ff:
                    continue
                base = ff[ff_key[tool]]
                rows[tool].append({**run.fault_figures(), "weights_equal_fault_free": run.sha == base.sha,
                                   "data_equal_fault_free": run.data() == base.data()})
                bar.set_postfix(**{tool: f"{rows[tool][-1]['downtime_s']:.2f} s"})
    out = {}
    for tool, rs in rows.items():
        if not rs:
            continue
        name = ff_key[tool]
        down, down_range = median_range([r["downtime_s"] for r in rs])
        back, back_range = median_range([r["back_to_pace_s"] for r in rs])
        session = sessions.get(name)
        out[tool] = {
            "downtime_s": down, "downtime_s_range": down_range,
            "step_ratio_to_ddp": session["ratio"] if session else None,
            "step_ratio_to_ddp_ci95": session["ci95"] if session else None,
            "step_ratio_to_ddp_range": session["range"] if session else None,
            "back_to_step_s": back, "back_to_step_s_range": back_range,
            "step_ms": statistics.median(ff_ms[name]) if ff_ms[name] else None,
            "steps_recomputed": int(statistics.median(r["steps_recomputed"] for r in rs)),
            "processes_restarted": int(statistics.median(r["processes_restarted"] for r in rs)),
            "weights_equal_fault_free": all(r["weights_equal_fault_free"] for r in rs),
            "data_equal_fault_free": all(r["data_equal_fault_free"] for r in rs),
            "repeats": len(rs), "per_repeat": rs,
            # every fault-free run of the tool ended with the same weights (the reference is stable)
            "fault_free_reproducible": len(ff_shas[name]) == 1,
        }
        if tool in WORKAROUNDS:
            out[tool]["workaround"] = WORKAROUNDS[tool]
    ddp_session = sessions.get("ddp")
    return {"tools": out, "failures": failures, "sessions": sessions,
            "step_ranking": rank_step_times({k: v for k, v in sessions.items() if k != "ddp"}),
            "timing": {"cycles": cycles, "window_s": window_s, "warmup_steps": WARMUP_STEPS},
            "ddp_step_ms": ddp_session["ddp_ms"] if ddp_session else None,
            "ddp_step_ms_range": ddp_session["ddp_ms_range"] if ddp_session else None}


# ----------------------------------------------------------------------------- torchrun's resume, traced

RESUME_VARIANTS = {"DDP defaults": {}, "find_unused_parameters=True": {"find_unused_parameters": True}}


def read_traces(out: Path, workers: int) -> tuple[dict[int, dict[int, dict]], dict | None]:
    """Slot -> step -> the last `trace` line for that step (a relaunched process's, where the
    step was done again), and rank 0's `resumed` line (None without a restart)."""
    traces: dict[int, dict[int, dict]] = {}
    resumed = None
    for slot in range(workers):
        for line in (out / f"log-{slot}.jsonl").read_text().splitlines():
            r = json.loads(line)
            if r["kind"] == "trace":
                traces.setdefault(slot, {})[r["step"]] = r
            elif r["kind"] == "resumed" and slot == 0:
                resumed = r
    return traces, resumed


def resume_trace(cfg: Config, work: Path) -> dict:
    """torchrun fault-free and killed-then-resumed, every step traced (bench/peers_train.py
    --trace), once with DDP's defaults and once with find_unused_parameters=True (DDP then
    never rebuilds its buckets): where the two runs first differ, and in what."""
    import torch
    out = {}
    for name, kwargs in RESUME_VARIANTS.items():
        args = ("--trace", "--ddp-kwargs", json.dumps(kwargs))
        where = work / ("resume-" + "".join(c if c.isalnum() else "-" for c in name))
        ff = run_torchrun(cfg, where / "ff", fault=False, train_args=args)
        fault = run_torchrun(cfg, where / "fault", fault=True, train_args=args)
        a, _ = read_traces(where / "ff", cfg.workers)
        b, resumed = read_traces(where / "fault", cfg.workers)
        assert resumed is not None, "the killed run did not resume from a checkpoint"
        start = resumed["step"]
        steps = sorted(a[0])
        first = next((st for st in steps if any(a[k][st]["reduced"] != b[k][st]["reduced"] for k in a)), None)
        row = {"resumed_from": start, "resumed_weights_equal": resumed["weights"] == a[0][start]["weights"],
               "first_reduced_diff_step": first, "final_weights_equal": ff.sha == fault.sha,
               "steps_weights_differ": sum(a[0][st]["weights"] != b[0][st]["weights"] for st in steps)}
        if first is not None:
            g_ff = torch.load(where / "ff" / f"grads-{first}-a0.pt")
            g_re = torch.load(where / "fault" / f"grads-{first}-a{b[0][first]['attempt']}.pt")
            differ = g_ff["reduced"] != g_re["reduced"]
            row.update({
                "local_equal_at_first": all(a[k][first]["local"] == b[k][first]["local"] for k in a),
                "rebuilt_at_first": {"fault_free": a[0][first]["rebuilt"], "resumed": b[0][first]["rebuilt"]},
                "elements_differing": int(differ.sum()), "elements": int(differ.numel()),
                "max_relative_diff": float(((g_ff["reduced"] - g_re["reduced"]).abs()[differ]
                                            / g_ff["reduced"].abs()[differ]).max()) if differ.any() else 0.0})
        out[name] = row
    return out


def print_resume_trace(res: dict) -> None:
    for name, r in res.items():
        print(f"torchrun, {name}: resumed from step {r['resumed_from']} "
              f"(weights = the fault-free run's there: {r['resumed_weights_equal']}); ", end="")
        if r["first_reduced_diff_step"] is None:
            print(f"every step's reduced gradients equal the fault-free run's; final weights equal: {r['final_weights_equal']}")
            continue
        print(f"first step whose reduced gradients differ: {r['first_reduced_diff_step']} (every rank's own gradients "
              f"equal there: {r['local_equal_at_first']}; DDP buckets rebuilt: fault-free {r['rebuilt_at_first']['fault_free']}, "
              f"resumed {r['rebuilt_at_first']['resumed']}); {r['elements_differing']:,} of {r['elements']:,} elements "
              f"differ, by at most {r['max_relative_diff']:.1e} relative; weights differ after {r['steps_weights_differ']} "
              f"steps; final weights equal: {r['final_weights_equal']}")


def job_of(cfg: Config) -> dict:
    """The job every tool trains: keel's scenario, its job's entry and parameter count, and
    the format keel's runs reduce in (with `--keel-set`)."""
    from keel.scenario import load
    from runtime.job_run import load_spec
    from runtime.reduction import reduction_format
    sc = load(cfg.scenario, list(cfg.keel_sets))
    spec = load_spec(sc)
    params = sum(p.numel() for p in spec.job.model(sc.run.seed, spec.config).parameters())
    where = Path(cfg.scenario).resolve()
    return {"scenario": str(where.relative_to(ROOT) if where.is_relative_to(ROOT) else where),
            "entry": spec.name, "params": params, "keel_reduction": reduction_format(sc), "keel_sets": list(cfg.keel_sets)}


def machine() -> str:
    import torch
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{platform.node()}, {os.cpu_count()} CPU cores, {platform.machine()}, Python {platform.python_version()}, "
            f"torch {torch.__version__}, load average {load:.1f} at start")


def print_table(result: dict, cfg: Config, repeats: int) -> None:
    t = result["timing"]
    job = result["job"]
    faults = (f"{cfg.steps} steps, worker 1 SIGKILLed at step {cfg.kill_at}, a checkpoint every {cfg.checkpoint_every} "
              f"steps; faults: median [min-max] of {repeats}; " if repeats else "fault-free step time only; ")
    print(f"peers side by side: 4 workers, the job of {job['scenario']} ({job['entry']}, {job['params']:,} parameters) "
          f"and keel's sampler, keel reducing in {job['keel_reduction']}, {faults}step / DDP: geometric mean [95 % "
          f"interval] of {t['cycles']} cycles, "
          f"{t['window_s']:g} s windows taking turns with DDP")
    print(f"{result['machine']}; {result['date']}")
    for name, sess in result["sessions"].items():
        print(f"timing session {name}: DDP {sess['ddp_ms']:.1f} ms a step [{sess['ddp_ms_range'][0]:.1f}-"
              f"{sess['ddp_ms_range'][1]:.1f}] over its windows, {name} {sess['tool_ms']:.1f}; ratio {sess['ratio']:.3f} "
              f"[{sess['ci95'][0]:.3f}-{sess['ci95'][1]:.3f}], cycles {sess['range'][0]:.2f}-{sess['range'][1]:.2f}")
    head = f"{'tool':22}{'step / DDP':>20}{'downtime s':>22}{'back to step s':>22}{'recomputed':>11}" \
           f"{'restarted':>10}{'weights =':>10}{'data =':>8}"
    print(head)
    print("-" * len(head))
    for tool, r in result["tools"].items():
        ratio = (f"{r['step_ratio_to_ddp']:>7.3f} [{r['step_ratio_to_ddp_ci95'][0]:.2f}-{r['step_ratio_to_ddp_ci95'][1]:.2f}]"
                 if r["step_ratio_to_ddp"] is not None else f"{'-':>20}")
        print(f"{tool:22}{ratio:>20}"
              f"{r['downtime_s']:>9.2f} [{r['downtime_s_range'][0]:.2f}-{r['downtime_s_range'][1]:.2f}]"
              f"{r['back_to_step_s']:>9.2f} [{r['back_to_step_s_range'][0]:.2f}-{r['back_to_step_s_range'][1]:.2f}]"
              f"{r['steps_recomputed']:>11}{r['processes_restarted']:>10}"
              f"{'yes' if r['weights_equal_fault_free'] else 'NO':>10}{'yes' if r['data_equal_fault_free'] else 'NO':>8}")
    print("weights = / data =: the final weights (bitwise) and the samples of every committed step equal the "
          "tool's own fault-free run; back to step: the fault to the first commit beyond the last step committed before it")
    for c in result["step_ranking"]:
        verdict = "ranked" if c["ranked"] else "not ranked: the interval holds 1"
        print(f"step time {c['a']} / {c['b']}: {c['a_over_b']:.3f} [{c['ci95'][0]:.3f}-{c['ci95'][1]:.3f}] ({verdict})")
    for tool, why in result["skipped"].items():
        print(f"skipped {tool}: {why}")
    for f in result["failures"]:
        print(f"failed run (retried once): {f['run']}, try {f['try']}: {f['error']}")
    for tool, r in result["tools"].items():
        if "workaround" in r:
            print(f"workaround applied to {tool}: {r['workaround']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="rounds of fault-free and faulted runs; 0: step time only")
    p.add_argument("--scenario", default=None,
                   help="keel's scenario, whose job every tool trains (default bench/peers-4.toml: keel's GPT; "
                        "bench/peers-4-llama.toml: the transformers example)")
    p.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated, among {', '.join(TOOLS + CHECK_TOOLS)}")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--checkpoint-every", type=int, default=None)
    p.add_argument("--keel-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of keel's scenario in keel's runs only (e.g. reduction.format=int64)")
    p.add_argument("--tiny", action="store_true", help=f"a tiny configuration for tests ({TINY.steps} steps)")
    p.add_argument("--torchft-timeout", type=float, default=None, help="torchft's process-group timeout (s)")
    p.add_argument("--no-ddp", action="store_true", help="leave out the plain DDP baseline (no step ratios)")
    p.add_argument("--cycles", type=int, default=16, help="timing: cycles of each tool's session against DDP")
    p.add_argument("--window", type=float, default=1.0, help="timing: seconds each job runs before the other's turn")
    p.add_argument("--work", default=None, help="keep the runs' logs here (default: a temporary directory)")
    p.add_argument("--resume-trace", action="store_true",
                   help="only trace torchrun's resume against its fault-free run, step by step (resume_trace)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    cfg = dataclasses.replace(TINY if args.tiny else Config(), **{k: v for k, v in (
        ("steps", args.steps), ("kill_at", args.kill_at), ("checkpoint_every", args.checkpoint_every),
        ("torchft_timeout_s", args.torchft_timeout),
        ("scenario", args.scenario and str(Path(args.scenario).resolve())),
        ("keel_sets", tuple(args.keel_set) or None)) if v is not None})
    if args.repeats < 0 or args.cycles < 2 or not 0.2 <= args.window <= 5.0 or (args.repeats == 0 and args.no_ddp):
        print(f"peers.py: --repeats {args.repeats}, --cycles {args.cycles}, --window {args.window}: expected at "
              "least 0 (0: step time only, which needs DDP), at least 2, and 0.2-5 s", file=sys.stderr)
        return 2
    if not Path(cfg.scenario).is_file():
        print(f"peers.py: --scenario {args.scenario}: no such file; expected a keel scenario (TOML)", file=sys.stderr)
        return 2
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    bad = [t for t in tools if t not in TOOLS + CHECK_TOOLS]
    if bad:
        print(f"peers.py: --tools: unknown tool {bad[0]!r}; expected among {', '.join(TOOLS + CHECK_TOOLS)}", file=sys.stderr)
        return 2
    skipped = {}
    if "torchft" in tools and (why := torchft_missing()):
        skipped["torchft"] = why
        tools.remove("torchft")
        print(f"peers.py: skipping torchft: {why}", file=sys.stderr)
    started = datetime.datetime.now(datetime.timezone.utc)
    mach = machine()
    job = job_of(cfg)
    with tempfile.TemporaryDirectory(prefix="keel-peers-") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        if args.work and work.exists():
            shutil.rmtree(work)
        if args.resume_trace:
            res = resume_trace(cfg, work)
            print(json.dumps(res, sort_keys=True)) if args.json else print_resume_trace(res)
            return 0
        result = compare(tools, cfg, args.repeats, work, ddp=not args.no_ddp, cycles=args.cycles, window_s=args.window)
    result = {**result, "machine": mach, "date": started.strftime("%Y-%m-%d %H:%M UTC"), "skipped": skipped, "job": job,
              "command": "bench/peers.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "config": dataclasses.asdict(cfg), "repeats": args.repeats,
              "wall_s": (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds()}
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print_table(result, cfg, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
