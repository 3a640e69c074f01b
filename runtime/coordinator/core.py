"""The coordinator's process (a child of the supervisor, runtime/supervisor.py): its state
(state.CoordinatorState: every field its decisions use, in plain view), the event log it
writes, the event loop with one handler per message type the protocol declares
(runtime/protocol.py), and the few operations every part of it uses (events, episodes' ends,
aborting a generation, starting a worker).

What it decides lives beside it, as functions of the Coordinator: who may join
(admission.py), the handlers of each message (messages.py), generations and commits
(generations.py, on the pure slot planner in planning.py), faults and their episodes
(faults.py, on episodes.py and the straggler watch in stragglers.py), a successor
(succession.py); the supervisor's link (link.py), the worker processes (procs.py) and what
it knows of each (workers.py). Those modules call each other one way (admission ->
succession -> faults; messages -> generations -> faults -> injections) and back into the
Coordinator only for what all of them use: events, episodes, the abort, starting a worker.
"""
from __future__ import annotations

import selectors
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from keel import recovery as R
from keel.errors import InputError, RunFailed
from keel.events import Event, EventLog
from keel.metrics import median_full_membership_interval_s, open_at_end, summarize
from keel.scenario import Scenario, region_of

from runtime.coordinator import admission, faults, generations, messages, snapshot, succession
from runtime.coordinator.episodes import Episode, Stage
from runtime.coordinator.link import SupervisorLink
from runtime.coordinator.procs import SupervisedProcess
from runtime.coordinator.stall import stall_report
from runtime.coordinator.state import EMU_STATS, JOIN_TIMEOUT_S, CoordinatorState, Phase
from runtime.coordinator.stragglers import StragglerWatch
from runtime.coordinator.workers import WorkerState
from runtime.inject import planned_faults, poison_schedule
from runtime.protocol import (Channel, ProtocolError, check_worker_message, confirm_due, env_secret,
                              heartbeat_period, hello_timeout_s, silence_s)

STALL_MIN_S = 60.0


class Coordinator:
    """Holds one control connection per worker, tracks the workers by heartbeat, process exit
    and EOF, makes every decision, is the single writer of `events.jsonl`, and keeps what a
    successor would need in `coordinator.json` (snapshot.py). Its supervisor holds the port,
    the rendezvous store and the worker processes (runtime/supervisor.py).

    `self.state` is what it decides with; the rest of `self` is the scenario's figures, fixed
    for the run, and its connections."""

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
        self.config = scenario.plain()
        self.config_hash = scenario.config_hash()
        self.policy = scenario.policy
        self.total = scenario.run.steps
        self.nodes = scenario.node_names
        self.region_of = {n: region_of(n) for n in self.nodes}
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self.training = self.nodes[: scenario.training_nodes]
        self.planned = planned_faults(scenario, no_faults, hangs)
        self.poison = poison_schedule(self.planned)
        faults.check_planned(self.planned)
        self.log = EventLog(self.out / "events.jsonl")
        self.events_start = len(self.log.events)
        self.state = CoordinatorState(
            t0=time.monotonic(),
            watch=StragglerWatch(self.policy.straggler_factor, self.policy.straggler_window, scenario.node_speeds),
            pid_history={n: [] for n in self.nodes}, emu_stats=dict(EMU_STATS))
        self.bar = None
        self.sup = SupervisorLink(link)
        self.recover = recover
        self.incarnation = incarnation
        self.dirty = False        # something the snapshot holds changed this loop turn
        self.dirty_commits = False  # steps were committed since the last snapshot (the log has them)
        self.saved_t = 0.0
        if resume is not None and recover is None:
            self._prepare_resume(Path(resume))
        if recover is not None:
            self.state = snapshot.restore(self, snapshot.load(self.out))
        self.sel = selectors.DefaultSelector()
        self.strangers: dict[Channel, tuple[str, float]] = {}  # not yet admitted: (nonce, deadline)
        self.silence_s = silence_s()
        self.hb_period, self.hb_sent, self.hb_committed = heartbeat_period(self.silence_s), 0.0, 0
        self.host = host
        # the control port and the store a supervisor holds: they outlive this coordinator, so a
        # successor is found where it was
        self.listener = socket.socket(fileno=int(endpoints["listener_fd"]))
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.store_port = int(endpoints["store_port"])
        self.hello_timeout_s = hello_timeout_s()
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        link.sock.setblocking(False)
        self.sel.register(link.sock, selectors.EVENT_READ, "link")

    # ------------------------------------------------------------------------- events

    def now(self) -> float:
        """Seconds since the run started: emulated seconds in an emulated cluster."""
        return (time.monotonic() - self.state.t0) / self.scale

    def emit(self, kind: str, *, fault: str | None = None, target: str | None = None,
             action: str | None = None, t: float | None = None, step: int | None = None,
             **detail: Any) -> Event:
        """`step` defaults to the steps committed now (design.md); checkpoint events carry
        the checkpoint's step instead (the writer reports it before the commit can land)."""
        e = Event(t=round(max(0.0, self.now() if t is None else t), 6),
                  step=self.state.committed if step is None else step, kind=kind,
                  fault=fault, target=target, action=action, detail=detail)
        self.log.emit(e)
        self.state.last_event_was_commit = kind == "step"
        if kind == "step":  # the log has it: the snapshot may lag a commit by SNAPSHOT_EVERY_S
            self.dirty_commits = True
        else:
            self.dirty = True
        return e

    def emit_ep(self, kind: str, ep: Episode, t: float | None = None, **detail: Any) -> Event:
        return self.emit(kind, fault=ep.cls, target=ep.target, action=ep.action, t=t,
                         fault_id=ep.fault_id, **detail)

    def new_episode(self, cls: str, target: str, t: float | None = None, **detail: Any) -> Episode:
        """A fault: its episode, and its `fault` event (its action: keel.recovery.action_for)."""
        action = R.action_for(cls, self.policy.kind, self.policy.quarantine)
        ep = self.state.book.new(cls, target, action, self.now() if t is None else t)
        self.emit_ep("fault", ep, t=ep.t, **detail)
        return ep

    def end_episode(self, ep: Episode) -> None:
        """`recover_end`, with the current generation's timings where it ended the episode."""
        st = self.state
        ep.stage = Stage.ENDED
        t = st.gen_t.get(st.gen, {})
        detail: dict[str, Any] = {"downtime_s": self.now() - ep.t}
        if ep.t_detect is not None:
            detail["detect_s"] = ep.t_detect - ep.t
        if ep.end_gen == st.gen and ep.end_step is None and "announced" in t:
            detail["reform_s"] = t.get("abort_s", 0.0) + t.get("pg_s", 0.0)
            detail["ack_s"] = t.get("abort_s", 0.0)
            detail["state_s"] = t.get("state_s", 0.0)
            if "ready" in t:
                detail["redo_s"] = self.now() - t["ready"]
        detail["gen"] = st.gen
        self.emit_ep("recover_end", ep, **detail)

    # ------------------------------------------------------------------------- aborting

    def abort(self) -> None:
        """End the current generation: every live member leaves its collective and says at
        which step it stands (messages.on_aborted); the loop then plans the next one
        (generations.next_generation), or counts lost who did not leave in time."""
        st = self.state
        if st.phase == Phase.ABORTING:
            return
        st.enter(Phase.ABORTING)
        st.t_abort = self.now()
        st.pending_acks = {m for m in st.members if st.workers[m].alive}
        for m in st.pending_acks:
            if st.workers[m].chan is not None:
                st.workers[m].chan.send({"type": "abort", "gen": st.gen})
        st.abort_deadline = time.monotonic() + self.abort_wait_s()

    def abort_wait_s(self) -> float:
        """How long the members of an aborted generation have to acknowledge (wall seconds)."""
        return max(2.0, 2 * self.policy.detect_timeout_s * self.scale)

    # ------------------------------------------------------------------------- resume

    def _prepare_resume(self, resume: Path) -> None:
        from runtime import checkpoint as ck
        st = self.state
        latest = ck.resolve_resume(resume)  # says on stderr which newer ones it refused, and why
        loaded = ck.load_checkpoint(latest, config_hash=self.config_hash, config=self.config,
                                    allow_config_change=self.allow_config_change, log_warnings=False)
        for w in loaded.warnings:  # once, as keel says things
            print(f"keel: warning: {w}", file=sys.stderr)
        st.load_path = str(latest)
        st.committed = st.start_step = int(loaded.step)
        st.quarantine = set(loaded.data_state.get("quarantine", ()))
        if st.committed >= self.total:
            raise InputError(f"--resume {resume}: the checkpoint is at step {st.committed}, run.steps is {self.total}")

    # ------------------------------------------------------------------------- workers

    def live(self, node: str) -> bool:
        w = self.state.workers.get(node)
        return bool(w and w.alive)

    def spawn(self, node: str, fresh_interpreter: bool = False) -> None:
        """Have the supervisor start the worker of `node` (procs.start_worker). On a GPU every worker
        is a fresh interpreter: CUDA cannot be used in a process forked from one that has
        touched it, and the fork server has (measured on an H200 with torch 2.11, 4 Dec)."""
        st = self.state
        fresh_interpreter = fresh_interpreter or str(self.welcome.get("device", "cpu")).startswith("cuda")
        proc = SupervisedProcess(self.sup, self.sup.spawn(node, fresh_interpreter))
        old = st.workers.get(node)
        if old is not None and old.chan is not None:
            self.drop_channel(old)
        st.book.killed.pop(node, None)
        st.watch.forget(node)
        st.workers[node] = WorkerState(node=node, proc=proc, pid=proc.pid, last_seen=time.monotonic())
        st.pid_history[node].append(proc.pid)
        self.dirty = True

    def drop_channel(self, w: WorkerState) -> None:
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
        st = self.state
        self.bar = progress_bar(total=self.total, initial=st.committed, desc=self.sc.run.name, unit="step",
                                enabled=self.progress)
        try:
            if self.recover is not None:  # a successor: the run goes on (succession.py)
                succession.begin(self)
            else:
                st.t0 = time.monotonic()
                self.emit("run_start", nodes=len(self.nodes), slots=self.sc.slot_count, policy=self.policy.kind,
                          hot_spares=self.policy.hot_spares, config_hash=self.config_hash, seed=self.sc.run.seed,
                          start_step=st.start_step, resume_from=st.load_path,
                          coordinator=f"{self.host}:{self.port}",
                          **({"emulated": True, "time_scale": self.scale} if self.emulated else {}))
                if self.spawn_local:
                    for n in self.nodes:
                        self.spawn(n)
                st.join_deadline = time.monotonic() + JOIN_TIMEOUT_S
            while st.phase != Phase.FINISHED:
                self.tick()
                if self.sup.gone and not st.failure:
                    st.failure = "the supervisor (keel run) is gone"
                if st.failure:
                    raise RunFailed(st.failure)
            return self.finish()
        finally:
            self.bar.close()
            self.shutdown()

    def tick(self) -> None:
        st = self.state
        timeout = 0.002 if st.phase == Phase.ABORTING else min(0.02, self.policy.heartbeat_s / 2)
        for key, _ in self.sel.select(timeout):
            if key.data is None:
                admission.accept(self)
            elif key.data == "link":
                self.sup.serve()
            else:
                self._read(key)
        now = time.monotonic()
        admission.drop_strangers(self, now)
        self.sup.beat()
        if now - self.hb_sent > self.hb_period or confirm_due(st.committed, self.hb_committed,
                                                              self.sc.checkpoint.interval_steps):
            self.hb_sent, self.hb_committed = now, st.committed  # silence, commit lead, publication (protocol.py)
            for w in st.workers.values():
                if w.chan is not None:
                    w.chan.send({"type": "hb", "committed": st.committed})
        for w in list(st.workers.values()):
            if not w.alive:
                continue
            if w.proc is not None and not w.machine_down and w.proc.poll() is not None:
                faults.lost(self, w, f"process exited ({w.proc.returncode})")
            elif w.joined and now - w.last_seen > self.policy.detect_timeout_s * self.scale:
                faults.lost(self, w, f"no heartbeat for {(now - w.last_seen) / self.scale:.2f} s")
        if st.phase == Phase.JOINING:
            generations.check_joined(self)
        elif st.phase == Phase.ABORTING:
            if not st.pending_acks:
                generations.next_generation(self)
            elif now > st.abort_deadline:
                for n in sorted(st.pending_acks):  # where it said it was: what held it
                    w = st.workers[n]
                    faults.lost(self, w, "did not leave the aborted generation in time"
                                + (f" (its last heartbeat: {w.at})" if w.at else ""))
        stall = max(STALL_MIN_S, 20 * self.policy.detect_timeout_s)
        if st.phase in (Phase.RUNNING, Phase.ABORTING, Phase.FINISHING) and now - st.last_progress > stall:
            st.failure = self._stall(stall)
        if self.dirty or (self.dirty_commits and now - self.saved_t > snapshot.SNAPSHOT_EVERY_S):
            snapshot.save(self)  # what a successor would need
            self.dirty = self.dirty_commits = False
            self.saved_t = now

    def _read(self, key: selectors.SelectorKey) -> None:
        chan, node = key.data if isinstance(key.data, tuple) else (key.data, None)
        try:
            msgs = chan.recv_ready()
        except ProtocolError as e:
            admission.close(self, chan, node, f"sent {e}")
            return
        if msgs is None:  # EOF: the connection is gone
            admission.close(self, chan, node)
            return  # a crashed machine's (emulated) sends nothing: its heartbeats just stop
        for msg in msgs:
            if node is None:  # an authentic hello before anything else counts
                node = admission.on_hello(self, chan, msg)
                if node is None:
                    return
                continue
            try:
                check_worker_message(msg)
            except ProtocolError as e:
                admission.close(self, chan, node, f"sent {e}")
                return
            self.on_message(self.state.workers[node], msg)

    def on_message(self, w: WorkerState, msg: dict) -> None:
        now = time.monotonic()
        if self.emulated and w.joined:  # how long past its heartbeat a member went unheard (wall)
            es = self.state.emu_stats
            late = now - w.last_seen - self.policy.heartbeat_s * self.scale
            es["heartbeat_late_s"] = max(es.get("heartbeat_late_s", 0.0), late)
        w.last_seen = now
        kind = msg.get("type")
        if kind == "hb":
            w.last_hb_t = w.last_seen
            w.at = msg.get("at", w.at)
        else:
            w.last_msg, w.last_msg_t = msg, w.last_seen
            self.dirty = self.dirty or kind != "step"
        handler = messages.HANDLERS.get(kind)
        if handler is not None:
            handler(self, w, msg)

    # ------------------------------------------------------------------------- stalls

    def _stall(self, stall: float) -> str:
        """The stall report (stall.stall_report); local workers also dump every thread's stack
        into their logs (SIGUSR1, faulthandler). Written next to events.jsonl as well."""
        st = self.state
        lines = stall_report(stall=stall, phase=st.phase, gen=st.gen, committed=st.committed,
                             gen_start_step=st.gen_start_step, nodes=self.nodes, workers=st.workers,
                             members=st.members, next_reports=st.reports.get(st.committed + 1, {}),
                             pending_acks=st.pending_acks, now=time.monotonic())
        dumped = [w.node for w in st.workers.values()
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

    def fault_free_step_time(self) -> float | None:
        """The fault-free pace the metrics compare with: the median clean commit interval at
        the run's full training membership (keel.metrics.median_full_membership_interval_s)."""
        return median_full_membership_interval_s(self.state.intervals, len(self.training))

    def finish(self) -> dict[str, Any]:
        st = self.state
        if not any(e.kind == "run_end" for e in self.log.events[self.events_start:]):  # a successor's may be written
            for ep in filter(None, map(st.book.get, open_at_end(self.log.events[self.events_start:]))):
                ep.stage = Stage.ENDED  # a spike that outlasts the run, its straggler still parked
                self.emit_ep("recover_end", ep, at_run_end=True)
            self.emit("run_end", step_time_s=self.fault_free_step_time(), restarts=st.restarts,
                      generations=st.gen + 1, final_weights_sha256=st.final_sha)
        summary = summarize(self.log.events[self.events_start:])
        if st.start_step:
            summary["steps"] = st.committed
        summary.update({
            "tool": "runtime", "scenario": self.sc.run.name, "config_hash": self.config_hash,
            "seed": self.sc.run.seed, "nodes": len(self.nodes), "regions": [r.name for r in self.sc.regions],
            "policy": self.policy.kind, "start_step": st.start_step,
            "losses": [st.losses[k] for k in range(st.start_step + 1, st.committed + 1)],
            "final_weights_sha256": st.final_sha, "checkpoints": st.checkpoints,
            "pids": {n: list(p) for n, p in st.pid_history.items()},
            "generations": st.gen + 1, "quarantine": sorted(st.quarantine),
            "coordinator_restarts": self.incarnation,
            "slot_map": {m: st.slot_map[m] for m in st.members},
            "job": job_of(self.sc, st.job_params),
        })
        if self.emulated:
            es = dict(st.emu_stats)
            es["overrun_fraction"] = es["overruns"] / es["reports"] if es["reports"] else 0.0
            es.update(time_scale=self.scale, max_overrun_fraction=self.sc.emulation.max_overrun_fraction,
                      faithful=es["overrun_fraction"] <= self.sc.emulation.max_overrun_fraction
                      and not es.get("relaunch_overruns"))  # a relaunch that outran restart_s: not the cluster's
            summary["emulation"] = es
        return summary

    def shutdown(self) -> None:
        workers = self.state.workers
        for w in workers.values():
            if w.alive and w.chan is not None:
                w.chan.send({"type": "stop"})
        deadline = time.monotonic() + 10.0
        for w in workers.values():
            if w.proc is not None:
                w.proc.stop(deadline - time.monotonic())
        for w in workers.values():
            self.drop_channel(w)
        admission.drop_strangers(self)  # connections that never said an authentic hello
        try:
            self.listener.close()
        except OSError:
            pass
        self.log.close()


def job_of(scenario: Scenario, params: int | None) -> dict[str, Any]:
    """The summary's `job`: its entry, its config and its trainable parameters (as the workers
    counted them; None when no worker reported)."""
    import dataclasses
    if scenario.job.entry:
        return {"entry": scenario.job.entry, "config": scenario.job.config, "params": params}
    return {"entry": "runtime.job_gpt:job", "config": dataclasses.asdict(scenario.model), "params": params}
