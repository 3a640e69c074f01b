"""The coordinator: the fault-tolerant scheduler, and the single writer of `events.jsonl`.

It hosts the rendezvous store (a `torch.distributed.TCPStore`) and one control connection per
worker (protocol.py), tracks the workers by heartbeat, process exit and EOF, and decides
**generations**: a generation is a membership (ranks in scenario order) plus a slot map. A
loss, a straggler to move out or back, or a restart ends the current generation: the
coordinator sends `abort`, every live member leaves its collective at once and acknowledges
with its committed step, and the next generation is announced. Its members form a fresh gloo
group on `gen{g}/`; when someone is behind (a hot spare, a returning straggler) the live peer
that committed the most steps broadcasts weights and optimizer state.

A step is committed when every member of the generation has reported it (with identical
losses: the reduction is deterministic). Scheduled faults fire when `at_step` steps are
committed; a fault whose step is reached while another is being recovered fires as soon as
the new generation is announced (so schedule two faults at one step to hit a recovery).

Decisions and their events (all carry `detail.fault_id` within an episode):
fault -> detect -> recover_start -> reslot -> recover_end (first commit of the new
generation); data faults add `quarantine`; `checkpoint_restart` adds `restart`.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keel.errors import InputError, RunFailed
from keel.events import Event, EventLog
from keel import recovery as R
from keel.scenario import Scenario

from runtime.inject import Planned, jitter_schedule, planned_faults, poison_schedule, signal_pid
from runtime.protocol import Channel, parse_address

REPO_ROOT = Path(__file__).resolve().parents[1]
JOIN_TIMEOUT_S = 600.0


_FORKSERVER = None


def _forkserver():
    """A multiprocessing fork server that has imported the worker (and torch) once."""
    global _FORKSERVER
    if _FORKSERVER is None:
        import multiprocessing
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["runtime.preload"])
        _FORKSERVER = ctx
    return _FORKSERVER


def forked_worker(address: str, node: str, log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    from runtime import worker
    os._exit(worker.main(["--coordinator", address, "--node", node, "--die-with-parent"]) or 0)


class LocalProcess:
    """A worker process this coordinator started: a Popen or a multiprocessing Process."""

    def __init__(self, handle):
        self.handle = handle
        if not isinstance(handle, subprocess.Popen):
            # the worker needs nothing from __main__: keep multiprocessing from re-importing the
            # caller's main module in it (a script, pytest, or stdin, which cannot be)
            main = sys.modules["__main__"]
            saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
            main.__dict__.pop("__file__", None)
            main.__spec__ = None
            try:
                handle.start()
            finally:
                main.__dict__.pop("__spec__", None)
                main.__dict__.update(saved)
        self.pid = handle.pid

    def poll(self) -> int | None:
        if isinstance(self.handle, subprocess.Popen):
            return self.handle.poll()
        return self.handle.exitcode

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def wait(self, timeout: float | None = None) -> int | None:
        if isinstance(self.handle, subprocess.Popen):
            return self.handle.wait(timeout)
        self.handle.join(timeout)
        if self.handle.exitcode is None:
            raise subprocess.TimeoutExpired("worker", timeout)
        return self.handle.exitcode


def _strip_none(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip_none(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_strip_none(v) for v in obj]
    return obj


@dataclass
class WorkerState:
    node: str
    chan: Channel | None = None
    proc: LocalProcess | None = None
    pid: int | None = None
    alive: bool = True
    joined: bool = False
    last_seen: float = 0.0
    committed: int = 0
    role: str = "standby"  # member | standby | dead
    parked: list[int] | None = None  # slots of a straggler standing by
    slow: int = 0
    ok_probes: int = 0
    per_slot_s: float | None = None  # smoothed measured seconds per slot
    done_sha: str | None = None
    last_msg: dict | None = None  # the last message other than a heartbeat (for stall reports)
    last_msg_t: float = 0.0
    last_hb_t: float = 0.0
    at: str | None = None  # where the worker says it is (sent with each heartbeat)
    ready_gen: int = -1


def _brief(msg: dict) -> str:
    keys = ("gen", "step", "committed", "error")
    return msg.get("type", "?") + "".join(f" {k}={msg[k]}" for k in keys if k in msg)


@dataclass
class Episode:
    fault_id: int
    cls: str
    target: str
    action: str
    t: float
    nodes: list[str] = field(default_factory=list)
    detected: bool = False
    t_detect: float | None = None
    t_recover: float | None = None
    recovering: bool = False
    end_gen: int | None = None  # recover_end at the first commit of this generation
    end_step: int | None = None  # or when this step is committed
    parked: bool = False
    ended: bool = False
    ok: int = 0
    member_lost: bool = False
    breakdown: dict[str, float] = field(default_factory=dict)


class Coordinator:
    def __init__(self, scenario: Scenario, out_dir: str | Path, *, resume: str | Path | None = None,
                 no_faults: bool = False, allow_config_change: bool = False, progress: bool = True,
                 listen: str = "127.0.0.1:0", spawn: bool = True, hangs: str | None = None,
                 device: str = "cpu", backend: str = "gloo", data_root: str | None = None):
        self.sc = scenario
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "logs").mkdir(exist_ok=True)
        self.ckpt_dir = self.out / "checkpoints"
        self.progress = progress
        self.spawn_local = spawn
        self.device = device
        self.backend = backend
        self.data_root = data_root
        self.allow_config_change = allow_config_change
        self.config = _strip_none(scenario.to_dict())
        self.config_hash = scenario.config_hash()
        self.policy = scenario.policy
        self.total = scenario.run.steps
        self.nodes = scenario.node_names
        self.region_of = {n: n.rsplit("/", 1)[0] for n in self.nodes}
        self.region_names = [r.name for r in scenario.regions]
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self.training = self.nodes[: scenario.training_nodes]
        self.planned = planned_faults(scenario, no_faults, hangs)
        self.poison = poison_schedule(self.planned)
        self.log = EventLog(self.out / "events.jsonl")
        self.events_start = len(self.log.events)
        self.t0 = time.monotonic()
        self.workers: dict[str, WorkerState] = {}
        self.gen = -1
        self.members: list[str] = []
        self.slot_map: dict[str, list[int]] = {}
        self.committed = 0
        self.start_step = 0
        self.losses: dict[int, float] = {}
        self.reports: dict[int, dict[str, dict]] = {}
        self.nonfinite: dict[int, dict[str, list[int]]] = {}
        self.quarantine: set[int] = set()
        self.episodes: dict[int, Episode] = {}
        self.killed: dict[str, int] = {}
        self.phase = "joining"
        self.pending_acks: set[str] = set()
        self.abort_deadline = 0.0
        self.to_park: dict[str, int | None] = {}
        self.to_unpark: dict[str, int | None] = {}
        self.lost_since_gen: list[str] = []
        self.restarts = 0
        self.load_path: str | None = None
        self.median_per_slot: float | None = None
        self.intervals: list[tuple[int, float]] = []  # (members, seconds) per clean commit interval
        self.last_commit_t: float | None = None
        self.last_event_was_commit = False
        self.gen_t: dict[int, dict[str, float]] = {}
        self.checkpoints: list[dict[str, Any]] = []
        self.pid_history: dict[str, list[int]] = {n: [] for n in self.nodes}
        self.failure: str | None = None
        self.last_progress = time.monotonic()
        self.fired = 0
        self.fault_counter = 0
        self.bar = None
        self.final_sha: str | None = None
        self.gen_start_step = 0
        self.t_abort = time.monotonic()

        if resume is not None:
            self._prepare_resume(Path(resume))
        self.sel = selectors.DefaultSelector()
        host, port = parse_address(listen)
        self.host = host
        import torch.distributed as dist
        self.store = dist.TCPStore(host, 0, None, True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=300))
        self.listener = socket.create_server((host, port), backlog=256)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.sel.register(self.listener, selectors.EVENT_READ, None)

    # ------------------------------------------------------------------------- events

    def now(self) -> float:
        return time.monotonic() - self.t0

    def emit(self, kind: str, *, fault: str | None = None, target: str | None = None,
             action: str | None = None, t: float | None = None, step: int | None = None,
             **detail: Any) -> Event:
        """`step` defaults to the steps committed now (design.md); checkpoint events carry
        the checkpoint's step instead (the writer reports it before the commit can land)."""
        e = Event(t=round(max(0.0, self.now() if t is None else t), 6),
                  step=self.committed if step is None else step, kind=kind,
                  fault=fault, target=target, action=action, detail=detail)
        self.log.emit(e)
        self.last_event_was_commit = kind == "step"
        return e

    def emit_ep(self, kind: str, ep: Episode, t: float | None = None, **detail: Any) -> Event:
        return self.emit(kind, fault=ep.cls, target=ep.target, action=ep.action, t=t,
                         fault_id=ep.fault_id, **detail)

    # ------------------------------------------------------------------------- resume

    def _prepare_resume(self, resume: Path) -> None:
        from runtime import checkpoint as ck
        candidates = [resume / "checkpoints", resume]
        refused: list = []
        latest = None
        for c in candidates:
            latest = ck.find_latest(c, refused)
            if latest is not None:
                break
        if latest is None:
            why = "; ".join(f"{p.name}: {'; '.join(pr)}" for p, pr in refused) if refused else "none found"
            raise InputError(f"--resume {resume}: no complete checkpoint to resume from ({why})")
        loaded = ck.load_checkpoint(latest, config_hash=self.config_hash, config=self.config,
                                    allow_config_change=self.allow_config_change)
        for w in loaded.warnings:
            print(f"keel: warning: {w}", file=sys.stderr)
        self.load_path = str(latest)
        self.committed = self.start_step = int(loaded.step)
        self.quarantine = set(loaded.data_state.get("quarantine", ()))
        if self.committed >= self.total:
            raise InputError(f"--resume {resume}: the checkpoint is at step {self.committed}, run.steps is {self.total}")

    # ------------------------------------------------------------------------- workers

    def spawn(self, node: str, fresh_interpreter: bool = False) -> None:
        """Start the worker of `node` on this machine: forked from a fork server that has
        imported torch once (fast, the default), or as a fresh interpreter that imports
        everything again (what a torchrun relaunch pays; the checkpoint_restart baseline)."""
        log_path = self.out / "logs" / (node.replace("/", "_") + ".log")
        address = f"{self.host}:{self.port}"
        if fresh_interpreter:
            log = open(log_path, "ab")
            env = dict(os.environ)
            env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
            env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
            env.pop("RANK", None)
            cmd = [sys.executable, "-m", "runtime.worker", "--coordinator", address, "--node", node, "--die-with-parent"]
            proc = LocalProcess(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                                 cwd=str(REPO_ROOT)))
            log.close()
        else:
            proc = LocalProcess(_forkserver().Process(target=forked_worker, args=(address, node, str(log_path)),
                                                      name=f"keel-worker-{node}"))
        old = self.workers.get(node)
        if old is not None and old.chan is not None:
            self._drop_channel(old)
        self.killed.pop(node, None)
        self.workers[node] = WorkerState(node=node, proc=proc, pid=proc.pid, last_seen=time.monotonic())
        self.pid_history[node].append(proc.pid)

    def _drop_channel(self, w: WorkerState) -> None:
        if w.chan is not None:
            try:
                self.sel.unregister(w.chan.sock)
            except (KeyError, ValueError):
                pass
            w.chan.close()
            w.chan = None

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            sock.setblocking(True)
            chan = Channel(sock)
            self.sel.register(sock, selectors.EVENT_READ, chan)

    def _assign_node(self, msg: dict) -> str | None:
        node = msg.get("node")
        if node:
            return node if node in self.order else None
        free = [n for n in self.nodes if n not in self.workers or not self.workers[n].alive]
        hint = msg.get("rank_hint")
        if isinstance(hint, int) and 0 <= hint < len(self.nodes) and self.nodes[hint] in free:
            return self.nodes[hint]
        return free[0] if free else None

    def _on_hello(self, chan: Channel, msg: dict) -> None:
        node = self._assign_node(msg)
        if node is None:
            chan.send({"type": "refused", "reason": "no such node, or every node is taken"})
            self.sel.unregister(chan.sock)
            chan.close()
            return
        w = self.workers.get(node)
        if w is None or (not self.spawn_local and not w.alive):
            w = self.workers[node] = WorkerState(node=node, last_seen=time.monotonic())
        if w.chan is not None and w.chan is not chan:
            self._drop_channel(w)
        w.chan = chan
        self.sel.modify(chan.sock, selectors.EVENT_READ, (chan, node))
        w.pid = int(msg.get("pid") or 0) or w.pid
        if w.proc is None and w.pid and w.pid not in self.pid_history[node]:
            self.pid_history[node].append(w.pid)
        w.last_seen = time.monotonic()
        chan.send({"type": "welcome", "node": node, "scenario": self.config, "source": self.sc.source,
                   "store_port": self.store.port, "store_host": self.host, "config_hash": self.config_hash,
                   "out_dir": str(self.out.resolve()), "allow_config_change": self.allow_config_change,
                   "device": self.device, "backend": self.backend, "data_root": self.data_root,
                   "local_index": self.order[node]})

    # ------------------------------------------------------------------------- the loop

    def run(self) -> dict[str, Any]:
        from tqdm import tqdm
        self.t0 = time.monotonic()
        self.bar = tqdm(total=self.total, initial=self.committed, desc=self.sc.run.name, unit="step",
                        file=sys.stderr, disable=not self.progress, dynamic_ncols=True)
        self.emit("run_start", nodes=len(self.nodes), slots=self.sc.slot_count, policy=self.policy.kind,
                  hot_spares=self.policy.hot_spares, config_hash=self.config_hash, seed=self.sc.run.seed,
                  start_step=self.start_step, resume_from=self.load_path, coordinator=f"{self.host}:{self.port}")
        try:
            if self.spawn_local:
                for n in self.nodes:
                    self.spawn(n)
            self.join_deadline = time.monotonic() + JOIN_TIMEOUT_S
            while self.phase != "finished":
                self._tick()
                if self.failure:
                    raise RunFailed(self.failure)
            return self._finish()
        finally:
            self.bar.close()
            self._shutdown()

    def _tick(self) -> None:
        timeout = 0.002 if self.phase == "aborting" else min(0.02, self.policy.heartbeat_s / 2)
        for key, _ in self.sel.select(timeout):
            if key.data is None:
                self._accept()
                continue
            chan, node = key.data if isinstance(key.data, tuple) else (key.data, None)
            msgs = chan.recv_ready()
            if msgs is None:
                try:
                    self.sel.unregister(chan.sock)
                except (KeyError, ValueError):
                    pass
                chan.close()
                if node is not None and self.workers[node].chan is chan:
                    self.workers[node].chan = None
                    self._lost(self.workers[node], "connection closed")
                continue
            for msg in msgs:
                if node is None:
                    if msg.get("type") == "hello":
                        self._on_hello(chan, msg)
                        if isinstance(key.data, Channel):
                            node = next((n for n, w in self.workers.items() if w.chan is chan), None)
                    continue
                self._on_message(self.workers[node], msg)
        now = time.monotonic()
        for w in list(self.workers.values()):
            if not w.alive:
                continue
            if w.proc is not None and w.proc.poll() is not None:
                self._lost(w, f"process exited ({w.proc.returncode})")
            elif w.joined and now - w.last_seen > self.policy.detect_timeout_s:
                self._lost(w, f"no heartbeat for {now - w.last_seen:.2f} s")
        if self.phase == "joining":
            self._check_joined()
        elif self.phase == "aborting":
            if not self.pending_acks:
                self._next_generation()
            elif now > self.abort_deadline:
                for n in sorted(self.pending_acks):
                    self._lost(self.workers[n], "did not leave the aborted generation in time")
        stall = max(self.STALL_MIN_S, 20 * self.policy.detect_timeout_s)
        if self.phase in ("running", "aborting", "finishing") and now - self.last_progress > stall:
            self.failure = self._stall_report(stall)

    STALL_MIN_S = 60.0

    def _stall_report(self, stall: float) -> str:
        """What each worker last said, so a stall explains itself: its role, committed step,
        whether it got through the current generation's set-up (`ready`), its last message
        other than a heartbeat, and where its own heartbeat says it is. Local workers also
        dump every thread's stack into their logs (SIGUSR1, faulthandler)."""
        now = time.monotonic()
        lines = [f"no progress for {stall:.0f} s (phase {self.phase}, generation {self.gen}, "
                 f"committed {self.committed}, start step {self.gen_start_step}); workers:"]
        nxt = self.reports.get(self.committed + 1, {})
        for n in self.nodes:
            w = self.workers.get(n)
            if w is None:
                lines.append(f"  {n}: never started")
                continue
            rank = self.members.index(n) if n in self.members else None
            parts = [f"  {n}: {w.role}" + (f" rank {rank}" if rank is not None else ""),
                     "alive" if w.alive else "dead", f"committed {w.committed}"]
            if rank is not None:
                parts.append("ready" if w.ready_gen >= self.gen else "NOT ready (group/state set-up)")
                parts.append(f"reported step {self.committed + 1}" if n in nxt else f"no report of step {self.committed + 1}")
            if n in self.pending_acks:
                parts.append("abort not acknowledged")
            if w.last_msg is not None:
                parts.append(f"last message '{_brief(w.last_msg)}' {now - w.last_msg_t:.1f} s ago")
            if w.last_hb_t:
                parts.append(f"heartbeat {now - w.last_hb_t:.1f} s ago")
            if w.at:
                parts.append(f"at: {w.at}")
            lines.append(", ".join(parts))
        dumped = []
        for w in self.workers.values():
            if w.alive and w.joined and w.proc is not None and w.proc.poll() is None:
                if signal_pid(w.proc.pid, signal.SIGUSR1):
                    dumped.append(w.node)
        if dumped:
            lines.append(f"  thread stacks of {len(dumped)} local workers dumped to {self.out / 'logs'}/<node>.log")
        report = "\n".join(lines)
        try:  # next to events.jsonl, for whoever finds the run's directory later
            (self.out / "stall.txt").write_text(report + "\n")
        except OSError:
            pass
        return report

    # ------------------------------------------------------------------------- messages

    def _on_message(self, w: WorkerState, msg: dict) -> None:
        w.last_seen = time.monotonic()
        kind = msg.get("type")
        if kind == "hb":
            w.last_hb_t = w.last_seen
            w.at = msg.get("at", w.at)
        else:
            w.last_msg, w.last_msg_t = msg, w.last_seen
        if kind == "hb":
            if w.parked is not None and "probe_s" in msg:
                self._probe(w, float(msg["probe_s"]))
        elif kind == "joined":
            w.joined = True
            w.committed = int(msg.get("committed", 0))
        elif kind == "step":
            if int(msg["gen"]) == self.gen and w.role == "member":
                w.committed = int(msg["step"])
                self.reports.setdefault(int(msg["step"]), {})[w.node] = msg
                if self.phase == "running":
                    self._try_commit()
        elif kind == "ready":
            t = self.gen_t.setdefault(int(msg["gen"]), {})
            t["pg_s"] = max(t.get("pg_s", 0.0), float(msg["pg_s"]))
            t["state_s"] = max(t.get("state_s", 0.0), float(msg["state_s"]))
            t["ready"] = time.monotonic()
            w.ready_gen = max(w.ready_gen, int(msg["gen"]))
        elif kind == "nonfinite":
            if int(msg["gen"]) == self.gen and self.phase == "running":
                self.nonfinite.setdefault(int(msg["step"]), {})[w.node] = list(msg["suspects"])
                self._try_nonfinite(int(msg["step"]))
        elif kind == "aborted":
            w.committed = int(msg["committed"])
            if int(msg["gen"]) == self.gen:
                self.pending_acks.discard(w.node)
        elif kind == "ckpt_start":
            # the lowest rank reports its checkpoint right after its own step report, often before
            # the others' reports let the coordinator commit that step: the event carries the
            # checkpoint's step, never committed - 1
            k = int(msg["step"])
            self.emit("checkpoint_start", step=k, mode=msg.get("mode"), ckpt_step=k, node=w.node)
        elif kind == "ckpt_end":
            entry = {"step": int(msg["step"]), "path": msg.get("path"), "stall_s": msg.get("stall_s"),
                     "write_s": msg.get("write_s"), "node": w.node}
            if msg.get("error"):
                entry["error"] = msg["error"]
            self.checkpoints.append(entry)
            self.emit("checkpoint_end", step=max(self.committed, entry["step"]), ckpt_step=entry["step"],
                      stall_s=entry["stall_s"],
                      write_s=entry["write_s"], path=entry["path"], node=w.node,
                      **({"error": entry["error"]} if "error" in entry else {}))
        elif kind == "done":
            w.done_sha = msg["sha256"]
            w.committed = int(msg["committed"])
            if self.phase == "finishing":
                self._check_finished()
        elif kind == "error":
            self.failure = f"worker {w.node} failed:\n{msg.get('message', '')}"

    # ------------------------------------------------------------------------- joining

    def _check_joined(self) -> None:
        expected = [n for n in self.nodes if n in self.workers and self.workers[n].alive] if self.spawn_local else self.nodes
        if all(n in self.workers and self.workers[n].joined for n in expected) and expected:
            self._initial_generation()
        elif time.monotonic() > self.join_deadline:
            missing = [n for n in expected if not (n in self.workers and self.workers[n].joined)]
            self.failure = f"workers did not join within {JOIN_TIMEOUT_S:.0f} s: {', '.join(missing)}"

    def _initial_slot_map(self) -> dict[str, list[int]]:
        live = [n for n in self.training if self.workers.get(n) and self.workers[n].alive]
        spares = [n for n in self.nodes[len(self.training):] if self.workers.get(n) and self.workers[n].alive]
        if len(live) < len(self.training):  # a training node is gone already: spares fill in
            live += spares[: len(self.training) - len(live)]
        live.sort(key=self.order.get)
        slot_map: dict[str, list[int]] = {n: [] for n in live}
        for s, n in enumerate(R.fastest_finish(self.sc.slot_count, self._holders(slot_map, empty=True))):
            slot_map[n].append(s)
        return {n: v for n, v in slot_map.items() if v}

    def _holders(self, slot_map: dict[str, list[int]], empty: bool = False,
                 measured: bool = False) -> list[R.Holder]:
        """The nodes of `slot_map` as keel.recovery sees them; `measured`: capacity from the
        seconds per slot measured in this run (where known) instead of the region's speed."""
        def speed(m: str) -> float:
            if measured:
                return 1.0 / (self.workers[m].per_slot_s or 1.0)
            return self.sc.region(self.region_of[m]).speed
        return [R.Holder(m, self.region_of[m], speed(m), 0 if empty else len(slot_map[m]), self.order[m])
                for m in sorted(slot_map, key=self.order.get)]

    def _initial_generation(self) -> None:
        self.slot_map = self._initial_slot_map()
        for w in self.workers.values():
            if w.alive:
                w.committed = 0
        self._announce(load=self.load_path, start=self.committed, force_broadcast=self.load_path is not None)
        self.load_path = None

    # ------------------------------------------------------------------------- generations

    def _announce(self, *, load: str | None, start: int, force_broadcast: bool = False) -> None:
        self.gen += 1
        self.members = sorted(self.slot_map, key=self.order.get)
        live_members = [self.workers[m] for m in self.members]
        source = next((i for i, w in enumerate(live_members) if w.committed == start), 0)
        behind = [i for i, w in enumerate(live_members) if i != source and (force_broadcast or w.committed != start)]
        self.reports = {k: v for k, v in self.reports.items() if k <= start}
        self.nonfinite = {}
        base = {"type": "gen", "gen": self.gen, "world": len(self.members), "members": self.members,
                "slot_map": self.slot_map, "start_step": start, "source": source, "behind": behind,
                "load": load, "quarantine": sorted(self.quarantine), "poison": self.poison,
                "jitter": jitter_schedule(self.planned, start)}
        self.gen_t.setdefault(self.gen, {})["announced"] = time.monotonic()
        for rank, m in enumerate(self.members):
            w = self.workers[m]
            w.role = "member"
            w.slow = 0
            w.chan.send({**base, "rank": rank, "slots": self.slot_map[m]})
        for w in self.workers.values():
            if w.alive and w.joined and w.node not in self.slot_map:
                w.role = "standby"
                if w.chan is not None:
                    w.chan.send({"type": "standby", "gen": self.gen})
        self.gen_start_step = start
        self.last_progress = time.monotonic()
        if start >= self.total:
            # a generation formed after the last step (a straggler moving back, a loss at the
            # very end): its members only sync state and report done; nothing is left to run
            self._end_due_episodes(None)
            self.phase = "finishing"
            self._check_finished()
            return
        self.phase = "running"
        self._fire_due(after_announce=True)

    def _abort(self) -> None:
        """End the current generation: every live member leaves its collective and says at
        which step it stands."""
        if self.phase == "aborting":
            return
        self.phase = "aborting"
        self.t_abort = time.monotonic()
        self.pending_acks = {m for m in self.members if self.workers[m].alive}
        for m in self.pending_acks:
            self.workers[m].chan.send({"type": "abort", "gen": self.gen})
        self.abort_deadline = time.monotonic() + max(2.0, 2 * self.policy.detect_timeout_s)

    def _next_generation(self) -> None:
        old = {m: list(s) for m, s in self.slot_map.items()}
        slot_map = {m: list(s) for m, s in old.items() if self.workers[m].alive}
        moves: dict[int | None, list[tuple[int, str | None, str]]] = {}

        def record(fid, slot, src, dst):
            moves.setdefault(fid, []).append((slot, src, dst))

        # a recovered straggler takes back the slots it held
        for node, fid in self.to_unpark.items():
            w = self.workers[node]
            if not w.alive or w.parked is None:
                continue
            for slot in w.parked:
                holder = next((m for m, s in slot_map.items() if slot in s), None)
                if holder is not None:
                    slot_map[holder].remove(slot)
                record(fid, slot, holder, node)
            slot_map[node] = sorted(w.parked)
            w.parked = None
            w.ok_probes = 0
        self.to_unpark = {}
        # a straggler's slots move to the faster workers
        for node, fid in self.to_park.items():
            if node not in slot_map or len(slot_map) < 2:
                continue
            slots = slot_map.pop(node)
            self.workers[node].parked = list(slots)
            spare = self._free_spare(slot_map)
            plan = R.park_destinations([(node, len(slots))], self._holders(slot_map, measured=True),
                                       [spare] if spare else [], self.region_names)
            it = iter(slots)
            for _, dst, k in plan:
                for slot in [next(it) for _ in range(k)]:
                    slot_map.setdefault(dst, []).append(slot)
                    record(fid, slot, node, dst)
        self.to_park = {}
        # lost workers' slots: a hot spare takes them over, or they spread by capacity
        self._place_lost(old, slot_map, record)
        if not slot_map:
            spare = self._free_spare(slot_map)
            if spare is None:
                self.failure = "every worker is lost; nothing left to train on"
                return
        slot_map = {m: sorted(s) for m, s in slot_map.items() if s}
        start = max(self.workers[m].committed for m in slot_map)
        if start < self.committed:
            self.failure = (f"every worker holding the state of step {self.committed} is lost "
                            f"(the live ones stand at step {start}); use policy.kind = 'checkpoint_restart'")
            return
        # a step that some survivor committed before the abort is committed now
        while self.committed < start:
            k = self.committed + 1
            reps = self.reports.get(k, {})
            if not reps:
                self.failure = f"step {k} committed by a survivor but its report is missing"
                return
            self._commit(k, next(iter(reps.values()))["loss"], {}, check=False)
        for fid, mv in sorted(moves.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
            ep = self.episodes.get(fid) if fid is not None else None
            detail = {"gen": self.gen + 1, "moves": [[s, a, b] for s, a, b in mv],
                      "slot_map": {m: slot_map[m] for m in sorted(slot_map, key=self.order.get)}}
            if ep is not None:
                self.emit_ep("reslot", ep, **detail)
            else:
                self.emit("reslot", action="backpressure_reslot", **detail)
        self.slot_map = slot_map
        timings = self.gen_t.setdefault(self.gen + 1, {})
        timings["abort_s"] = time.monotonic() - self.t_abort
        for ep in self.episodes.values():
            if ep.recovering and ep.end_gen is None:
                ep.end_gen = self.gen + 1
        self._announce(load=None, start=start)

    def _free_spare(self, slot_map: dict[str, list[int]]) -> str | None:
        for n in self.nodes:
            w = self.workers.get(n)
            if w and w.alive and w.joined and n not in slot_map and w.parked is None:
                return n
        return None

    def _place_lost(self, old: dict[str, list[int]], slot_map: dict[str, list[int]], record) -> None:
        """The lost workers' slots, episode by episode (keel.recovery.place_lost_slots): a hot
        spare takes a lost worker's over, a rack's spread over the other regions by capacity.
        With no member left, the first free spare receives them all."""
        by_fault: dict[int | None, list[str]] = {}
        for node in sorted((m for m in old if not self.workers[m].alive), key=self.order.get):
            by_fault.setdefault(self.killed.get(node), []).append(node)
        for fid, nodes in by_fault.items():
            ep = self.episodes.get(fid) if fid is not None else None
            action = ep.action if ep is not None else R.ABSORB_ACTION["hardware_fault"]
            lost = sorted((slot, node) for node in nodes for slot in old[node])
            spare = self._free_spare(slot_map)
            if not slot_map and spare is not None:
                slot_map[spare] = []
            survivors = self._holders(slot_map)
            if not survivors:
                return  # every worker is lost: _next_generation fails the run
            picks = R.place_lost_slots(action, len(lost), survivors, [spare] if spare else [],
                                       self.region_names, lost_region=ep.target if ep is not None else None)
            for (slot, node), dst in zip(lost, picks):
                slot_map.setdefault(dst, []).append(slot)
                record(fid, slot, node, dst)

    # ------------------------------------------------------------------------- commits

    def _try_commit(self) -> None:
        while self.phase == "running":
            k = self.committed + 1
            reps = self.reports.get(k)
            if not reps or any(m not in reps for m in self.members):
                return
            losses = {repr(reps[m]["loss"]) for m in self.members}
            if len(losses) > 1:
                self.failure = f"members disagree on the loss of step {k}: {sorted(losses)} (non-deterministic reduction?)"
                return
            self._commit(k, reps[self.members[0]]["loss"], reps)

    def _commit(self, k: int, loss: float, reps: dict[str, dict], check: bool = True) -> None:
        now = time.monotonic()
        pace_ok = self.last_event_was_commit and self.last_commit_t is not None
        if self._end_due_episodes(k):  # recover_end just before the commit that ends the episode
            pace_ok = False
        self.committed = k
        self.losses[k] = loss
        self.emit("step", loss=loss, gen=self.gen)
        if pace_ok:
            self.intervals.append((len(self.members), now - self.last_commit_t))
        self.last_commit_t = now
        self.last_progress = now
        self.bar.update(1)
        if reps and check and k - self.gen_start_step > R.STRAGGLER_WARMUP_STEPS:
            self._watch_stragglers(reps)
        if k >= self.total:
            self.phase = "finishing"
            self._check_finished()
            return
        self._fire_due(after_announce=False)

    def _end_due_episodes(self, k: int | None) -> bool:
        """End every episode whose recovery is complete at this generation (or at step k)."""
        ended = False
        for ep in self.episodes.values():
            if ep.recovering and not ep.ended and ((ep.end_gen is not None and self.gen >= ep.end_gen and not ep.parked)
                                                   or (k is not None and ep.end_step is not None and k >= ep.end_step)):
                self._end_episode(ep)
                ended = True
        return ended

    def _end_episode(self, ep: Episode) -> None:
        ep.ended = True
        ep.recovering = False
        t = self.gen_t.get(self.gen, {})
        detail = dict(ep.breakdown)
        detail["downtime_s"] = self.now() - ep.t
        if ep.t_detect is not None:
            detail["detect_s"] = ep.t_detect - ep.t
        if ep.end_gen == self.gen and ep.end_step is None and "announced" in t:
            detail["reform_s"] = t.get("abort_s", 0.0) + t.get("pg_s", 0.0)
            detail["ack_s"] = t.get("abort_s", 0.0)
            detail["state_s"] = t.get("state_s", 0.0)
            if "ready" in t:
                detail["redo_s"] = time.monotonic() - t["ready"]
        detail["gen"] = self.gen
        self.emit_ep("recover_end", ep, **detail)

    # ------------------------------------------------------------------------- faults

    def _new_episode(self, cls: str, target: str, t: float | None = None, **detail: Any) -> Episode:
        fid = self.fault_counter
        self.fault_counter += 1
        action = R.action_for(cls, self.policy.kind, self.policy.quarantine)
        ep = Episode(fid, cls, target, action, self.now() if t is None else t)
        self.episodes[fid] = ep
        self.emit_ep("fault", ep, t=ep.t, **detail)
        return ep

    def _fire_due(self, after_announce: bool) -> None:
        """Fire the scheduled faults that are due; at most one that kills or hangs a worker
        per decision point, so a second one at the same step lands during the recovery."""
        while self.fired < len(self.planned) and self.phase == "running":
            p = self.planned[self.fired]
            if p.at_step > self.committed:
                return
            if p.at_step < self.start_step:  # before the checkpoint we resumed from
                self.fired += 1
                continue
            if p.mode in ("kill", "hang") and not after_announce and self._recovering():
                return  # it will land during the recovery, once the new generation is announced
            self.fired += 1
            if self._fire(p):
                return

    def _recovering(self) -> bool:
        return any(not ep.ended and ep.nodes and ep.cls != "network_jitter" for ep in self.episodes.values())

    def _fire(self, p: Planned) -> bool:
        if p.mode == "poison":
            self._new_episode(p.cls, p.target, shard=p.params["shard"], from_step=p.at_step + 1)
            return False
        if p.mode == "jitter":
            targets = [n for n in self.nodes if (n == p.target or self.region_of[n] == p.target)
                       and self.workers.get(n) and self.workers[n].alive]
            ep = self._new_episode(p.cls, p.target, nodes=targets, **p.params)
            ep.nodes = targets
            for n in targets:
                self.workers[n].chan.send({"type": "jitter", "index": p.index, **p.params})
            return False
        if p.cls == "partial_cluster_loss":
            live = [n for n in self.nodes if self.region_of[n] == p.target and self.workers.get(n) and self.workers[n].alive]
            targets = R.rack_victims(live, p.params["nodes"])
        else:
            targets = [p.target] if self.workers.get(p.target) and self.workers[p.target].alive else []
        ep = self._new_episode(p.cls, p.target, nodes=targets, mode=p.mode)
        ep.nodes = targets
        sig = signal.SIGSTOP if p.mode == "hang" else signal.SIGKILL
        for n in targets:  # one loop: the same moment
            self.killed[n] = ep.fault_id
            w = self.workers[n]
            if w.proc is not None:
                signal_pid(w.proc.pid, sig)
            elif p.mode == "kill" and w.chan is not None:
                w.chan.send({"type": "kill"})
        return bool(targets)

    def _lost(self, w: WorkerState, how: str) -> None:
        if not w.alive:
            return
        last_seen = w.last_seen
        w.alive = False
        w.role = "dead"
        if w.proc is not None and w.proc.poll() is None:
            signal_pid(w.proc.pid, signal.SIGKILL)  # fence: a hung worker never comes back
        self._drop_channel(w)
        self.pending_acks.discard(w.node)
        if self.phase in ("finishing", "finished", "restarting"):
            return
        fid = self.killed.get(w.node)
        if fid is None:
            ep = self._new_episode("hardware_fault", w.node, t=max(0.0, last_seen - self.t0),
                                   nodes=[w.node], mode="external")
            self.killed[w.node] = ep.fault_id
        else:
            ep = self.episodes[fid]
        now = self.now()
        if not ep.detected:
            ep.detected = True
            ep.t_detect = now
        self.emit_ep("detect", ep, node=w.node, how=how, detect_s=now - ep.t)
        was_member = w.node in self.slot_map and self.phase in ("running", "aborting")
        if self.phase == "joining":
            return
        if self.policy.kind == "checkpoint_restart":
            if was_member:
                self._restart(ep)
            return
        if not was_member:  # a spare or a parked straggler: nothing to re-form
            w.parked = None
            if not ep.member_lost and not ep.ended and all(not self.workers[n].alive for n in ep.nodes):
                ep.recovering = True
                self.emit_ep("recover_start", ep, gen=self.gen, lost=[w.node], spare=True)
                self._end_episode(ep)
            return
        ep.member_lost = True
        if not ep.recovering and not ep.ended:
            ep.recovering = True
            ep.t_recover = now
            self.emit_ep("recover_start", ep, gen=self.gen, lost=[w.node])
        self._abort()

    # ------------------------------------------------------------------------- stragglers

    def _watch_stragglers(self, reps: dict[str, dict]) -> None:
        per = {m: float(r["ready_s"]) / max(1, int(r["slots"])) for m, r in reps.items() if m in self.slot_map}
        if len(per) < 2:
            return
        med = statistics.median(per.values())
        self.median_per_slot = med if self.median_per_slot is None else 0.8 * self.median_per_slot + 0.2 * med
        f = self.policy.straggler_factor
        for m, v in per.items():
            w = self.workers[m]
            w.per_slot_s = v if w.per_slot_s is None else 0.7 * w.per_slot_s + 0.3 * v
            slow = R.is_straggler(v, med, f)
            ep = self._jitter_episode(m)
            if slow:
                w.slow += 1
                if ep is not None and not ep.detected:
                    ep.detected = True
                    ep.t_detect = self.now()
                    self.emit_ep("detect", ep, node=m, how="slow steps", per_slot_s=v, median_per_slot_s=med)
                if w.slow >= self.policy.straggler_window and self.policy.kind == "absorb" and len(self.slot_map) > 1:
                    if ep is not None and not ep.recovering:
                        ep.recovering = True
                        ep.parked = True
                        ep.t_recover = self.now()
                        self.emit_ep("recover_start", ep, node=m, gen=self.gen)
                    self.to_park[m] = ep.fault_id if ep is not None else None
                    self._abort()
                    return
            else:
                w.slow = 0
                if ep is not None and ep.detected and not ep.recovering and not ep.ended:
                    ep.ok += 1
                    if ep.ok >= self.policy.straggler_window:
                        ep.recovering = True
                        self._end_episode(ep)

    def _jitter_episode(self, node: str) -> Episode | None:
        for ep in reversed(list(self.episodes.values())):
            if ep.cls == "network_jitter" and node in ep.nodes and not ep.ended:
                return ep
        return None

    def _probe(self, w: WorkerState, probe_s: float) -> None:
        """A parked straggler's measured communication delay; back in once it would no longer
        be a straggler for `straggler_window` heartbeats in a row."""
        good = R.probe_recovered(probe_s, self.median_per_slot or 0.0, self.policy.straggler_factor)
        w.ok_probes = w.ok_probes + 1 if good else 0
        if w.ok_probes >= self.policy.straggler_window and self.phase == "running" and w.node not in self.to_unpark:
            ep = self._jitter_episode(w.node)
            if ep is not None:
                ep.parked = False
                ep.end_gen = self.gen + 1
            self.to_unpark[w.node] = ep.fault_id if ep is not None else None
            self._abort()

    # ------------------------------------------------------------------------- quarantine

    def _try_nonfinite(self, step: int) -> None:
        got = self.nonfinite.get(step, {})
        if any(m not in got for m in self.members):
            return
        suspects = sorted({s for v in got.values() for s in v})
        ep = None
        for e in reversed(list(self.episodes.values())):
            if e.cls == "data_shard_skew" and not e.ended and int(e.target.split("/")[1]) in suspects:
                ep = e
                break
        if ep is None:
            ep = self._new_episode("data_shard_skew", f"shard/{suspects[0]}" if suspects else "shard/?",
                                   mode="external")
        now = self.now()
        if not ep.detected:
            ep.detected, ep.t_detect = True, now
        self.emit_ep("detect", ep, step_index=step, shards=suspects, how="non-finite reduced gradient")
        if not suspects:
            self.failure = f"step {step + 1}: non-finite gradient not attributable to a data shard"
            return
        if ep.action == R.FAIL_ACTION:
            self.failure = f"step {step + 1}: shard(s) {suspects} yield non-finite values and policy.quarantine is false"
            return
        new = set(suspects) - self.quarantine
        self.quarantine |= set(suspects)
        if not ep.recovering:
            ep.recovering, ep.t_recover = True, now
            self.emit_ep("recover_start", ep, gen=self.gen)
        self.emit_ep("quarantine", ep, shards=sorted(new or suspects), quarantine=sorted(self.quarantine),
                     step_index=step)
        if self.policy.kind == "checkpoint_restart":
            self._restart(ep)
            return
        ep.end_step = step + 1
        self.nonfinite.pop(step, None)
        for m in self.members:
            self.workers[m].chan.send({"type": "quarantine", "gen": self.gen, "step": step,
                                       "shards": sorted(self.quarantine)})

    # ------------------------------------------------------------------------- checkpoint_restart

    def _restart(self, ep: Episode) -> None:
        """The baseline: stop every worker, relaunch them all, load the newest checkpoint."""
        from runtime import checkpoint as ck
        if self.phase == "restarting":
            return
        if not self.spawn_local:
            self.failure = "policy checkpoint_restart needs workers spawned by keel run"
            return
        self.phase = "restarting"
        self.restarts += 1
        latest = ck.find_latest(self.ckpt_dir)
        step = int(latest.name.split("-")[1]) if latest is not None else 0
        lost = self.committed - step
        self.emit_ep("restart", ep, from_step=step, checkpoint=str(latest) if latest else None, lost_steps=lost)
        ep.recovering = True
        for w in self.workers.values():
            if w.alive:
                w.alive = False
                if w.proc is not None:
                    signal_pid(w.proc.pid, signal.SIGKILL)
            self._drop_channel(w)
        for w in self.workers.values():
            if w.proc is not None:
                try:
                    w.proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass
        self.committed = step
        self.start_step = min(self.start_step, step)
        self.reports = {}
        self.load_path = str(latest) if latest is not None else None
        self.gen_t[self.gen + 1] = {"abort_s": 0.0}
        for n in self.nodes:
            self.spawn(n, fresh_interpreter=True)
        ep.end_gen = self.gen + 1
        self.phase = "joining"
        self.join_deadline = time.monotonic() + JOIN_TIMEOUT_S

    # ------------------------------------------------------------------------- the end

    def _check_finished(self) -> None:
        live = [m for m in self.members if self.workers[m].alive]
        if live and all(self.workers[m].done_sha for m in live):
            shas = {self.workers[m].done_sha for m in live}
            if len(shas) > 1:
                self.failure = f"members finished with different weights: {sorted(shas)}"
                return
            self.final_sha = shas.pop()
            self.phase = "finished"

    def fault_free_step_time(self) -> float | None:
        """The median interval between consecutive commits with nothing else between them, past
        the first two, taken where the generation had the run's full training membership: the
        fault-free pace the metrics compare with (steps with fewer workers, after a loss or with
        a straggler parked, are part of what the faults did). Every clean interval where there
        are too few of those."""
        healthy = [dt for members, dt in self.intervals if members == len(self.training)]
        xs = healthy if len(healthy) >= 3 else [dt for _, dt in self.intervals]
        xs = xs[2:] if len(xs) > 4 else xs
        return statistics.median(xs) if xs else None

    def _finish(self) -> dict[str, Any]:
        from keel.metrics import summarize
        step_time = self.fault_free_step_time()
        self.emit("run_end", step_time_s=step_time, restarts=self.restarts, generations=self.gen + 1,
                  final_weights_sha256=self.final_sha)
        events = self.log.events[self.events_start:]
        summary = summarize(events)
        if self.start_step:
            summary["steps"] = self.committed
        summary.update({
            "tool": "runtime", "scenario": self.sc.run.name, "config_hash": self.config_hash,
            "seed": self.sc.run.seed, "nodes": len(self.nodes), "regions": [r.name for r in self.sc.regions],
            "policy": self.policy.kind, "start_step": self.start_step,
            "losses": [self.losses[k] for k in range(self.start_step + 1, self.committed + 1)],
            "final_weights_sha256": self.final_sha, "checkpoints": self.checkpoints,
            "pids": {n: list(p) for n, p in self.pid_history.items()},
            "generations": self.gen + 1, "quarantine": sorted(self.quarantine),
            "slot_map": {m: self.slot_map[m] for m in self.members},
        })
        return summary

    def _shutdown(self) -> None:
        for w in self.workers.values():
            if w.alive and w.chan is not None:
                w.chan.send({"type": "stop"})
        deadline = time.monotonic() + 10.0
        for w in self.workers.values():
            if w.proc is not None and w.proc.poll() is None:
                try:
                    w.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    signal_pid(w.proc.pid, signal.SIGKILL)
                    w.proc.wait()
        for w in self.workers.values():
            self._drop_channel(w)
        try:
            self.listener.close()
        except OSError:
            pass
        self.log.close()


def main(argv: list[str] | None = None) -> int:
    """`python -m runtime.coordinator SCENARIO --listen HOST:PORT --out DIR`: a coordinator
    that waits for workers started elsewhere (by hand or by torchrun)."""
    import argparse
    import json

    from keel.scenario import load
    p = argparse.ArgumentParser(prog="python -m runtime.coordinator")
    p.add_argument("scenario")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--listen", default="127.0.0.1:29400")
    p.add_argument("--out", required=True)
    p.add_argument("--no-faults", action="store_true")
    args = p.parse_args(argv)
    sc = load(args.scenario, args.overrides)
    coord = Coordinator(sc, args.out, listen=args.listen, spawn=False, no_faults=args.no_faults)
    print(f"coordinator listening on {coord.host}:{coord.port}", file=sys.stderr, flush=True)
    summary = coord.run()
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
