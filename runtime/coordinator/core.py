"""The coordinator's process (a child of the supervisor, runtime/supervisor.py): the workers it
tracks, the event log it writes, and the event loop with one handler per message type the
protocol declares (runtime/protocol.py).

What it decides lives beside it: who may join (admission.py), the handlers of each message
(messages.py), generations and commits (generations.py, on the pure slot planner in
planning.py), faults and their episodes (faults.py, on episodes.py and the straggler watch in
stragglers.py), the worker processes (procs.py) and what it knows of each (workers.py).
"""
from __future__ import annotations

import selectors
import signal
import sys
import time
from pathlib import Path
from typing import Any

from keel.errors import InputError, RunFailed
from keel.events import Event, EventLog
from keel.metrics import open_at_end, summarize
from keel.scenario import Scenario, region_of

from runtime.coordinator import snapshot
from runtime.coordinator.admission import AdmissionMixin
from runtime.coordinator.workers import WorkerState
from runtime.coordinator.episodes import EpisodeBook, Stage
from runtime.coordinator.faults import FaultsMixin
from runtime.coordinator.generations import JOIN_TIMEOUT_S, GenerationsMixin
from runtime.coordinator.messages import MessagesMixin
from runtime.coordinator.stall import stall_report
from runtime.coordinator.stragglers import StragglerWatch
from runtime.coordinator.succession import SuccessionMixin
from runtime.inject import planned_faults, poison_schedule
from runtime.protocol import (confirm_due, Channel, ProtocolError, check_worker_message, env_secret,
                              heartbeat_period, silence_s)

STALL_MIN_S = 60.0


class Coordinator(AdmissionMixin, MessagesMixin, GenerationsMixin, FaultsMixin, SuccessionMixin):
    """Holds one control connection per worker, tracks the workers by heartbeat, process exit
    and EOF, makes every decision, is the single writer of `events.jsonl`, and keeps what a
    successor would need in `coordinator.json` (snapshot.py). Its supervisor holds the port,
    the rendezvous store and the worker processes (runtime/supervisor.py)."""

    def __init__(self, scenario: Scenario, out_dir: str | Path, *, link: Channel, endpoints: dict,
                 resume: str | Path | None = None, no_faults: bool = False, allow_config_change: bool = False,
                 progress: bool = True, host: str = "127.0.0.1", spawn: bool = True, hangs: str | None = None,
                 device: str = "cpu", backend: str = "gloo", data_root: str | None = None,
                 job_dir: str | None = None, recover: dict | None = None, incarnation: int = 0):
        """A child of the supervisor (runtime/supervisor.py): `link` to it, `endpoints` it
        holds (the control port's listening fd on `host`, the store's port), the job's secret
        in KEEL_JOB_SECRET, and for a successor `recover` (succession.py)."""
        self.sc = scenario
        self.secret = env_secret()
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "logs").mkdir(exist_ok=True)
        self.ckpt_dir = self.out / "checkpoints"
        self.progress = progress
        self.spawn_local = spawn
        self.welcome = {"device": device, "backend": backend, "data_root": data_root, "job_dir": job_dir,
                        "allow_config_change": allow_config_change}
        self.allow_config_change = allow_config_change
        self.emulated = scenario.emulation.enabled
        self.scale = scenario.emulation.time_scale if self.emulated else 1.0  # wall s per emulated s
        self.emu_stats = {"reports": 0, "overruns": 0, "compute_overruns": 0, "late_s": 0.0, "worst_late_s": 0.0,
                          "warmup_reports": 0, "warmup_late_s": 0.0, "relaunches": 0, "relaunch_overruns": 0,
                          "relaunch_late_s": 0.0}
        self.config = scenario.plain()
        self.job_params: int | None = None  # the job's trainable parameters, as the workers' `done` says
        self.config_hash = scenario.config_hash()
        self.policy = scenario.policy
        self.total = scenario.run.steps
        self.nodes = scenario.node_names
        self.region_of = {n: region_of(n) for n in self.nodes}
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self.training = self.nodes[: scenario.training_nodes]
        self.planned = planned_faults(scenario, no_faults, hangs)
        self.poison = poison_schedule(self.planned)
        self.log = EventLog(self.out / "events.jsonl")
        self.events_start = len(self.log.events)
        self.t0 = time.monotonic()
        self.workers: dict[str, WorkerState] = {}
        self.book = EpisodeBook()
        self.watch = StragglerWatch(self.policy.straggler_factor, self.policy.straggler_window)
        self.phase = "joining"
        self.failure: str | None = None
        self.bar = None
        self.pid_history: dict[str, list[int]] = {n: [] for n in self.nodes}
        self.checkpoints: list[dict[str, Any]] = []
        self.quarantine: set[int] = set()
        self.committed = self.start_step = 0
        self.load_path: str | None = None
        self.init_generations()
        self.init_faults()
        if resume is not None and recover is None:
            self._prepare_resume(Path(resume))
        self.init_succession(link, recover, incarnation)
        self.sel = selectors.DefaultSelector()
        self.strangers: dict[Channel, tuple[str, float]] = {}  # not yet admitted: (nonce, deadline)
        self.silence_s = silence_s()
        self.hb_period, self.hb_sent, self.hb_committed = heartbeat_period(self.silence_s), 0.0, 0
        self.host = host
        self._adopt(endpoints)
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        link.sock.setblocking(False)
        self.sel.register(link.sock, selectors.EVENT_READ, "link")

    # ------------------------------------------------------------------------- events

    def now(self) -> float:
        """Seconds since the run started: emulated seconds in an emulated cluster."""
        return (time.monotonic() - self.t0) / self.scale

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
        if kind == "step":  # the log has it: the snapshot may lag a commit by SNAPSHOT_EVERY_S
            self.dirty_commits = True
        else:
            self.dirty = True
        return e

    # ------------------------------------------------------------------------- resume

    def _prepare_resume(self, resume: Path) -> None:
        from runtime import checkpoint as ck
        latest = ck.resolve_resume(resume)  # says on stderr which newer ones it refused, and why
        loaded = ck.load_checkpoint(latest, config_hash=self.config_hash, config=self.config,
                                    allow_config_change=self.allow_config_change, log_warnings=False)
        for w in loaded.warnings:  # once, as keel says things
            print(f"keel: warning: {w}", file=sys.stderr)
        self.load_path = str(latest)
        self.committed = self.start_step = int(loaded.step)
        self.quarantine = set(loaded.data_state.get("quarantine", ()))
        if self.committed >= self.total:
            raise InputError(f"--resume {resume}: the checkpoint is at step {self.committed}, run.steps is {self.total}")

    # ------------------------------------------------------------------------- workers

    def spawn(self, node: str, fresh_interpreter: bool = False) -> None:
        """Have the supervisor start the worker of `node` (procs.start_worker). On a GPU every worker
        is a fresh interpreter: CUDA cannot be used in a process forked from one that has
        touched it, and the fork server has (measured on an H200 with torch 2.11, 4 Dec)."""
        fresh_interpreter = fresh_interpreter or str(self.welcome.get("device", "cpu")).startswith("cuda")
        proc = self.supervised_spawn(node, fresh_interpreter)
        old = self.workers.get(node)
        if old is not None and old.chan is not None:
            self._drop_channel(old)
        self.book.killed.pop(node, None)
        self.watch.forget(node)
        self.workers[node] = WorkerState(node=node, proc=proc, pid=proc.pid, last_seen=time.monotonic())
        self.pid_history[node].append(proc.pid)
        self.dirty = True

    def _drop_channel(self, w: WorkerState) -> None:
        if w.chan is not None:
            try:
                self.sel.unregister(w.chan.sock)
            except (KeyError, ValueError):
                pass
            w.chan.close()
            w.chan = None

    # ------------------------------------------------------------------------- the loop

    def run(self) -> dict[str, Any]:
        from keel.progress import progress_bar
        self.bar = progress_bar(total=self.total, initial=self.committed, desc=self.sc.run.name, unit="step",
                                enabled=self.progress)
        try:
            if self.recover is not None:  # a successor: the run goes on (succession.py)
                self.begin_succession()
            else:
                self.t0 = time.monotonic()
                self.emit("run_start", nodes=len(self.nodes), slots=self.sc.slot_count, policy=self.policy.kind,
                          hot_spares=self.policy.hot_spares, config_hash=self.config_hash, seed=self.sc.run.seed,
                          start_step=self.start_step, resume_from=self.load_path,
                          coordinator=f"{self.host}:{self.port}",
                          **({"emulated": True, "time_scale": self.scale} if self.emulated else {}))
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
            elif key.data == "link":
                self.on_link()
            else:
                self._read(key)
        now = time.monotonic()
        self._drop_strangers(now)
        self.link_beat()
        if now - self.hb_sent > self.hb_period or confirm_due(self.committed, self.hb_committed,
                                                              self.sc.checkpoint.interval_steps):
            self.hb_sent, self.hb_committed = now, self.committed  # silence, commit lead, publication (protocol.py)
            for w in self.workers.values():
                if w.chan is not None:
                    w.chan.send({"type": "hb", "committed": self.committed})
        for w in list(self.workers.values()):
            if not w.alive:
                continue
            if w.proc is not None and not w.machine_down and w.proc.poll() is not None:
                self._lost(w, f"process exited ({w.proc.returncode})")
            elif w.joined and now - w.last_seen > self.policy.detect_timeout_s * self.scale:
                self._lost(w, f"no heartbeat for {(now - w.last_seen) / self.scale:.2f} s")
        if self.phase == "joining":
            self._check_joined()
        elif self.phase == "aborting":
            if not self.pending_acks:
                self._next_generation()
            elif now > self.abort_deadline:
                for n in sorted(self.pending_acks):
                    self._lost(self.workers[n], "did not leave the aborted generation in time")
        stall = max(STALL_MIN_S, 20 * self.policy.detect_timeout_s)
        if self.phase in ("running", "aborting", "finishing") and now - self.last_progress > stall:
            self.failure = self._stall(stall)
        if self.dirty or (self.dirty_commits and now - self.saved_t > snapshot.SNAPSHOT_EVERY_S):
            snapshot.save(self)  # what a successor would need
            self.dirty = self.dirty_commits = False
            self.saved_t = now

    def _read(self, key: selectors.SelectorKey) -> None:
        chan, node = key.data if isinstance(key.data, tuple) else (key.data, None)
        try:
            msgs = chan.recv_ready()
        except ProtocolError as e:
            self._close(chan, node, f"sent {e}")
            return
        if msgs is None:  # EOF: the connection is gone
            self._close(chan, node)
            return  # a crashed machine's (emulated) sends nothing: its heartbeats just stop
        for msg in msgs:
            if node is None:  # an authentic hello before anything else counts
                node = self._on_hello(chan, msg)
                if node is None:
                    return
                continue
            try:
                check_worker_message(msg)
            except ProtocolError as e:
                self._close(chan, node, f"sent {e}")
                return
            self._on_message(self.workers[node], msg)

    # ------------------------------------------------------------------------- messages

    def _on_message(self, w: WorkerState, msg: dict) -> None:
        w.last_seen = time.monotonic()
        kind = msg.get("type")
        if kind == "hb":
            w.last_hb_t = w.last_seen
            w.at = msg.get("at", w.at)
        else:
            w.last_msg, w.last_msg_t = msg, w.last_seen
            self.dirty = self.dirty or kind != "step"
        handler = self.HANDLERS.get(kind)
        if handler is not None:
            handler(self, w, msg)

    # ------------------------------------------------------------------------- stalls

    def _stall(self, stall: float) -> str:
        """The stall report (stall.stall_report); local workers also dump every thread's stack
        into their logs (SIGUSR1, faulthandler). Written next to events.jsonl as well."""
        lines = stall_report(stall=stall, phase=self.phase, gen=self.gen, committed=self.committed,
                             gen_start_step=self.gen_start_step, nodes=self.nodes, workers=self.workers,
                             members=self.members, next_reports=self.reports.get(self.committed + 1, {}),
                             pending_acks=self.pending_acks, now=time.monotonic())
        dumped = [w.node for w in self.workers.values()
                  if w.alive and w.joined and w.proc is not None and w.proc.poll() is None
                  and w.proc.signal(signal.SIGUSR1)]
        if dumped:
            lines.append(f"  thread stacks of {len(dumped)} local workers dumped to {self.out / 'logs'}/<node>.log")
        report = "\n".join(lines)
        try:  # next to events.jsonl, for whoever finds the run's directory later
            (self.out / "stall.txt").write_text(report + "\n")
        except OSError:
            pass
        return report

    # ------------------------------------------------------------------------- the end

    def _finish(self) -> dict[str, Any]:
        if not any(e.kind == "run_end" for e in self.log.events[self.events_start:]):  # a successor's may be written
            for ep in filter(None, map(self.book.get, open_at_end(self.log.events[self.events_start:]))):
                ep.stage = Stage.ENDED  # a spike that outlasts the run, its straggler still parked
                self.emit_ep("recover_end", ep, at_run_end=True)
            self.emit("run_end", step_time_s=self.fault_free_step_time(), restarts=self.restarts,
                      generations=self.gen + 1, final_weights_sha256=self.final_sha)
        summary = summarize(self.log.events[self.events_start:])
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
            "coordinator_restarts": self.incarnation,
            "slot_map": {m: self.slot_map[m] for m in self.members},
            "job": job_of(self.sc, self.job_params),
        })
        if self.emulated:
            st = dict(self.emu_stats)
            st["overrun_fraction"] = st["overruns"] / st["reports"] if st["reports"] else 0.0
            st.update(time_scale=self.scale, max_overrun_fraction=self.sc.emulation.max_overrun_fraction,
                      faithful=st["overrun_fraction"] <= self.sc.emulation.max_overrun_fraction
                      and not st.get("relaunch_overruns"))  # a relaunch that outran restart_s: not the cluster's
            summary["emulation"] = st
        return summary

    def _shutdown(self) -> None:
        for w in self.workers.values():
            if w.alive and w.chan is not None:
                w.chan.send({"type": "stop"})
        deadline = time.monotonic() + 10.0
        for w in self.workers.values():
            if w.proc is not None:
                w.proc.stop(deadline - time.monotonic())
        for w in self.workers.values():
            self._drop_channel(w)
        self._drop_strangers()  # connections that never said an authentic hello
        try:
            self.listener.close()
        except OSError:
            pass
        self.log.close()


def main(argv: list[str] | None = None) -> int:
    """`python -m runtime.coordinator SCENARIO --listen HOST:PORT --out DIR`: a coordinator
    (under its supervisor, which restarts it) that waits for workers started elsewhere (by hand
    or by torchrun). It and its workers share the job's secret through KEEL_JOB_SECRET
    (runtime/protocol.py)."""
    import argparse

    from keel.rundir import write_summary
    from keel.scenario import load
    from runtime.supervisor import Supervisor
    p = argparse.ArgumentParser(prog="python -m runtime.coordinator")
    p.add_argument("scenario", help="scenario TOML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a scenario key (repeatable)")
    p.add_argument("--listen", default="127.0.0.1:29400", metavar="HOST:PORT",
                   help="where the coordinator and its rendezvous store listen (default: %(default)s, this "
                        "machine only; another address prints a warning naming what is exposed)")
    p.add_argument("--out", required=True, help="the run directory")
    p.add_argument("--no-faults", action="store_true", help="ignore faults.schedule")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue the run in DIR from its newest checkpoint (docs/multihost.md)")
    args = p.parse_args(argv)
    from runtime.api import job_dir_of
    try:
        sc = load(args.scenario, args.overrides)
        if args.resume:
            from keel.durable import check_resume_dir
            check_resume_dir(args.resume)
        sup = Supervisor(sc, args.out, listen=args.listen, spawn=False, options={"no_faults": args.no_faults, "resume": args.resume,
                                                                                 "job_dir": job_dir_of(sc)})
        print(f"coordinator listening on {sup.host}:{sup.port}", file=sys.stderr, flush=True)
        summary = sup.run()
    except InputError as e:
        print(f"keel: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"keel: run failed: {e}", file=sys.stderr)
        return 1
    write_summary(args.out, summary)
    return 0


def supervised_main(argv: list[str]) -> int:
    """`python -m runtime.coordinator --supervised FD --listener-fd FD`: the coordinator as its
    supervisor starts it; the run's verdict goes back over the link (runtime/supervisor.py)."""
    import socket

    from keel.scenario import from_dict
    link = Channel(socket.socket(fileno=int(argv[2])))
    init = link.recv()
    if init is None or init.get("type") != "init":
        return 2
    try:
        sc = from_dict(init["scenario"], source=init["source"])
        coord = Coordinator(sc, init["out_dir"], link=link, host=init["host"], spawn=init["spawn"],
                            endpoints={"listener_fd": int(argv[4]), "store_port": init["store_port"]},
                            recover=init["recover"], incarnation=init["incarnation"], **init["options"])
        summary = coord.run()
        verdict = {"type": "result", "summary": summary}
    except InputError as e:
        verdict = {"type": "failed", "error": "InputError", "message": str(e)}
    except RunFailed as e:
        verdict = {"type": "failed", "error": "RunFailed", "message": str(e)}
    except KeyboardInterrupt:
        return 130
    except Exception:  # a bug, not a death: a successor would meet it again
        import traceback
        verdict = {"type": "failed", "error": "RunFailed", "message": "the coordinator failed:\n" + traceback.format_exc()}
    link.sock.setblocking(True)
    link.send(verdict)
    return 0


def job_of(scenario: Scenario, params: int | None) -> dict[str, Any]:
    """The summary's `job`: its entry, its config and its trainable parameters (as the workers
    counted them; None when no worker reported)."""
    import dataclasses
    if scenario.job.entry:
        return {"entry": scenario.job.entry, "config": scenario.job.config, "params": params}
    return {"entry": "runtime.job_gpt:job", "config": dataclasses.asdict(scenario.model), "params": params}
