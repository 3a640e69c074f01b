"""A worker: one process per node. It joins a coordinator by address, trains the slots each
generation gives it, and survives the loss of its peers in place.

    python -m runtime.worker --coordinator HOST:PORT [--node REGION/I]

Launched by `keel run` (one per scenario node), by hand on other machines, or by torchrun
(the node is then taken from RANK: the coordinator maps rank i to the i-th scenario node).

Per generation it builds a fresh gloo group on `PrefixStore("gen{g}/", store)` (lazily
connected, so forming it never blocks), receives the state from a live peer if it is behind,
and steps: for each of its slots a forward/backward on that slot's micro-batch, then the
deterministic reduction over all slots (one collective in the common case, reduction.py), then the job's optimizer. Every wait
on a collective polls for the coordinator's abort, so a lost peer never costs a timeout.
"""
from __future__ import annotations

import argparse
import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any

import torch

from keel.scenario import region_of

from runtime.emulation.worker import EmulatedComms, warm_up
from runtime.groups import PG_TIMEOUT, WILDCARDS, GroupFactory
from runtime.inject import CommGate, kill_self, poisoned_at
from runtime.protocol import COORDINATOR_SILENCE_S, EXIT_COORDINATOR_LOST, SECRET_ENV, ProtocolError, env_secret, parse_address
from runtime.reduction import Layout, SlotReducer, moment_bounds, reduction_format
from runtime.waiting import Aborted, CollectiveError, Waiter
from runtime.worker_checkpoint import Checkpoints
from runtime.worker_link import CoordinatorLink, Refused, handshake, hold_commit, rejoin
from runtime.worker_state import load_checkpoint, transfer_state
from runtime.worker_process import error_text, freeze_self, pick_device, set_pdeathsig

JOIN_WAIT_S = 60.0  # how long a new worker retries a coordinator that refuses connections (not up yet)


class Worker:
    """One node's worker. Its parts: the job (runtime/job_run.py), the reducer, the link to its
    coordinator (worker_link.py, with `rejoin` and `hold_commit`), its checkpoints
    (worker_checkpoint.Checkpoints), the state sent to members behind (worker_state.py) and,
    emulated, its node and links (runtime/emulation/worker.py)."""

    def __init__(self, address: str, node: str | None, rank_hint: int | None):
        t_start = time.perf_counter()
        host, welcome = self._join(address, node, rank_hint)
        self._build(welcome)
        sc = self.scenario
        self.total_steps = sc.run.steps
        self.committed = 0  # a fresh worker holds the state of step 0 of a fresh run
        self.quarantine: frozenset[int] = frozenset()

        store_host = welcome.get("store_host") or host
        if store_host in WILDCARDS:  # a coordinator listening on every interface: the address dialled
            store_host = host
        self.groups = GroupFactory(self.backend, store_host, int(welcome["store_port"]),
                                   welcome.get("gloo_host") or self.chan.chan.sock.getsockname()[0])
        self.gate = CommGate(sc.run.seed, self.node, self.scale, sleeps=self.emu is None)
        self.abort_gen = -1
        self.stopping = False
        self.gen = -1
        self.acked_gen = -1
        self.rank = -1
        self.abort_event = threading.Event()
        self.inbox: queue.Queue = queue.Queue()
        self.standby = True
        self.checkpoints = Checkpoints(sc, self.run_info, self.chan, self.job, self.emu,
                                       aborted=self.abort_event.is_set, stopping=lambda: self.stopping)
        self._warmup = True                 # emulated: this process has not yet reported a step
        self.at = "joined, idle"  # where this worker is, sent with every heartbeat (stall reports)
        if self.emu is not None:
            warm_up(self.job)
        threading.Thread(target=self._reader, daemon=True, name="reader").start()
        threading.Thread(target=self._heartbeat, daemon=True, name="heartbeat").start()
        self.chan.send({"type": "joined", "committed": self.committed})
        print(f"worker {self.node} pid {os.getpid()}: joined {time.perf_counter() - t_start:.2f} s after start",
              file=sys.stderr, flush=True)

    def _join(self, address: str, node: str | None, rank_hint: int | None) -> tuple[str, dict[str, Any]]:
        """Answer the challenge of the coordinator at `address` with the job's secret
        (KEEL_JOB_SECRET, runtime/protocol.py); its welcome names this worker's node and carries
        the resolved scenario. The connection is kept across coordinator restarts (worker_link.py)."""
        deadline = time.monotonic() + JOIN_WAIT_S
        while True:  # workers may start before their coordinator listens (torchrun, Slurm, by hand)
            try:
                chan, welcome = handshake(address, {"node": node, "rank_hint": rank_hint}, timeout=60)
                break
            except (ConnectionRefusedError, ConnectionResetError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.25)
            except Refused as e:
                raise SystemExit(f"worker: not admitted by the coordinator at {address}: {e}") from None
            except (ProtocolError, TimeoutError) as e:
                raise SystemExit(f"worker: the peer at {address} is not a keel coordinator ({e})") from None
        self.chan = CoordinatorLink(address, chan, float(welcome.get("silence_s") or COORDINATOR_SILENCE_S))
        self.node = welcome["node"]
        self.coord_host = parse_address(address)[0]
        self.run_info = welcome
        return self.coord_host, welcome

    def _build(self, welcome: dict[str, Any]) -> None:
        """The scenario's job (runtime/job_run.py: model, optimizer, data) and the reducer on this
        worker's device, and its emulated node where the cluster is emulated."""
        from keel.scenario import from_dict
        self.scenario = from_dict(welcome["scenario"], source=welcome.get("source", "<coordinator>"))
        torch.set_num_threads(1)
        torch.manual_seed(self.scenario.run.seed)
        self.backend = welcome.get("backend") or "gloo"
        self.device = pick_device(welcome.get("device") or "cpu", self.backend, welcome.get("local_index", 0))

        from runtime.job_run import BoundJob, load_spec
        sc = self.scenario
        self.job = BoundJob(load_spec(sc, welcome.get("data_root"), welcome.get("job_dir")), sc, self.device)
        self.loader, self.model, self.optimizer, self.params = self.job.loader, self.job.model, self.job.optimizer, self.job.params
        self.layout = Layout(self.job.sizes + (1,))
        self.waiter = Waiter()
        emu = welcome.get("emulation")
        self.emu = None  # the emulated node (runtime/emulation/node.py), or None on real hardware
        self.scale = 1.0
        if emu:
            from runtime.emulation.node import NodeEmulation
            self.emu = NodeEmulation(sc, self.node, float(emu["anchor"]), float(emu["scale"]))
            self.scale = self.emu.scale
        self.comms = EmulatedComms(sc, self.emu, self.waiter) if self.emu else None  # its links, emulated
        self.reducer = SlotReducer(self.layout, sc.slot_count, self.device, self.waiter,
                                   collective=self.comms.collective if self.comms else None,
                                   fmt=reduction_format(sc))
        if self.comms:
            self.comms.reducer = self.reducer

    # ------------------------------------------------------------------------- control threads

    def _reader(self) -> None:
        while True:
            msg = self.chan.recv()
            if msg is None:  # the coordinator is gone (closed, or silent too long)
                if self.stopping:
                    os._exit(0)
                print(f"worker {self.node}: the coordinator's connection closed or went silent; rejoining",
                      file=sys.stderr, flush=True)
                if rejoin(self):
                    continue
                print(f"worker {self.node}: no coordinator took this worker back within "
                      f"{self.chan.silence_s:g} s; exiting (code {EXIT_COORDINATOR_LOST}) at step {self.committed}, "
                      f"{max(0, self.committed - self.chan.confirmed)} beyond the last the coordinator confirmed "
                      f"(applied here, never committed: no checkpoint of them was published)",
                      file=sys.stderr, flush=True)
                os._exit(EXIT_COORDINATOR_LOST)
            kind = msg.get("type")
            if kind == "hb":
                continue
            if kind == "stop":
                self.stopping = True
            if kind == "abort":
                self.abort(int(msg["gen"]))
                self.inbox.put(msg)
            elif kind == "jitter":
                self.gate.start(int(msg["index"]), float(msg["spike_ms"]), float(msg["duration_s"]),
                                msg.get("scope", "node"))
            elif kind == "kill":
                kill_self()
            elif kind == "partition":
                freeze_self(float(msg["heal_s"]))
            else:
                self.inbox.put(msg)

    def _heartbeat(self) -> None:
        period = self.scenario.policy.heartbeat_s * self.scale
        while True:
            msg: dict[str, Any] = {"type": "hb", "at": self.at}
            if self.standby:
                msg["probe_s"] = self.gate.pass_through()
            self.chan.send(msg)  # dropped while no coordinator is connected
            time.sleep(period)

    # ------------------------------------------------------------------------- main loop

    def serve(self) -> None:
        while True:
            msg = self.inbox.get()
            kind = msg.get("type")
            if kind == "abort":
                g = int(msg["gen"])
                if g == self.gen and self.acked_gen < g:  # aborted while idle (done, or between steps)
                    self.chan.send({"type": "aborted", "gen": g, "committed": self.committed})
                    self.acked_gen = g
            elif kind == "gen":
                self.run_generation(msg)
            elif kind == "standby":
                self.standby = True
                self.at = f"standing by (gen {msg.get('gen')})"
            elif kind == "stop":
                self.checkpoints.finish()
                self.chan.send({"type": "bye"})
                time.sleep(0.05)
                os._exit(0)

    def abort(self, gen: int) -> None:
        self.abort_gen = max(self.abort_gen, gen)
        self.abort_event.set()
        self.waiter.interrupt()

    def aborted(self, gen: int) -> bool:
        return self.abort_gen >= gen

    def run_generation(self, msg: dict[str, Any]) -> None:
        g, rank, world = int(msg["gen"]), int(msg["rank"]), int(msg["world"])
        self.gen = g
        if self.aborted(g):
            self.chan.send({"type": "aborted", "gen": g, "committed": self.committed})
            self.acked_gen = g
            return
        self.abort_event.clear()  # then re-check: an abort of g may have landed in between
        if self.abort_gen >= g:
            self.abort_event.set()
        self.gen = g
        self.standby = False
        self.quarantine = frozenset(msg.get("quarantine", ()))
        self.poison = [list(p) for p in msg.get("poison", [])]
        region = region_of(self.node)
        self.gate.expect([[index, from_step, spike_ms, duration_s, "node" if target == self.node else "region"]
                          for index, target, from_step, spike_ms, duration_s in msg.get("jitter", [])
                          if target in (self.node, region)])
        self.slots = list(msg["slots"])
        self.members = list(msg["members"])
        self.slot_map = msg["slot_map"]
        should_abort = lambda: self.abort_gen >= g  # noqa: E731
        t0 = time.perf_counter()
        try:
            self.at = f"gen {g} rank {rank}/{world}: forming the group"
            pg = self.groups.make(g, rank, world, retire=True)
            if self.comms is not None:
                self.comms.generation(g, rank, self.members)
                self.comms.connect(pg, should_abort)
            t_pg = (time.perf_counter() - t0) / self.scale
            if self.emu is not None:
                self.emu.start_generation(float(msg.get("not_before", 0.0)))
                self.emu.generation(self.members)
            c1 = self.emu.c if self.emu is not None else 0.0
            t1 = time.perf_counter()
            if msg.get("load") and rank == msg["source"]:
                self.at = f"gen {g}: loading {msg['load']}"
                load_checkpoint(self, msg["load"])
            if msg.get("behind"):
                transfer_state(self, g, rank, int(msg["source"]), list(msg["behind"]), should_abort,
                               loaded=bool(msg.get("load")))
            self.committed = int(msg["start_step"])
            self.chan.confirm(self.committed)
            t_state = time.perf_counter() - t1 if self.emu is None else self.emu.c - c1
            self.chan.send({"type": "ready", "gen": g, "pg_s": t_pg, "state_s": t_state})
            self.rank = rank
            self._train(pg, g, should_abort)
        except Aborted:
            self.at = f"gen {g}: aborted at step {self.committed}"
            self.chan.send({"type": "aborted", "gen": g, "committed": self.committed})
            self.acked_gen = g
            return
        except CollectiveError as e:  # a collective failed (a peer died): wait for the abort
            self.at = f"gen {g}: a collective failed at step {self.committed}, waiting for the abort"
            deadline = time.monotonic() + PG_TIMEOUT.total_seconds()
            while not should_abort() and time.monotonic() < deadline:
                self.abort_event.wait(0.01)
            self.chan.send({"type": "aborted", "gen": g, "committed": self.committed,
                            "error": str(e).splitlines()[0][:200]})
            self.acked_gen = g

    # ------------------------------------------------------------------------- training

    def _compute_slots(self, step: int) -> tuple[list[torch.Tensor], list[Any]]:
        """Forward and backward of each of this worker's slots on its micro-batch of `step`:
        per slot, the flat gradient with the loss appended, and the batch it saw."""
        poisoned = poisoned_at(self.poison, step)
        vectors, batches = [], []
        for slot in self.slots:
            v, b = self.job.slot_vector(step, slot, self.quarantine, poisoned)
            vectors.append(v)
            batches.append(b)
        return vectors, batches

    def _train(self, pg, g: int, should_abort) -> None:
        while self.committed < self.total_steps:
            step = self.committed  # 0-based index of the step being computed
            if should_abort():
                raise Aborted()
            t0 = time.perf_counter()
            emu = self.emu
            c0 = emu.c if emu is not None else 0.0
            if self.comms is not None:
                self.comms.begin_step(step)
            self.at = f"gen {g} step {step + 1}: computing {len(self.slots)} slot(s)"
            vectors, batches = self._compute_slots(step)
            t_compute = time.perf_counter() - t0
            compute_overrun = False
            if emu is not None:
                t_compute = emu.compute_s(len(self.slots), step)
                compute_overrun = emu.after_compute(c0, t_compute)
                c_computed = emu.c
            gate_s = [0.0]

            def before_comm() -> None:
                gate_s[0] = self.gate.pass_through(self.abort_event, step)
                if emu is not None:
                    emu.pricer.spike_s, emu.pricer.spike_scope = gate_s[0], self.gate.scope
                if should_abort():
                    raise Aborted()
                self.at = f"gen {g} step {step + 1}: in the reduction"
            mean = self.reducer.reduce(pg, vectors, should_abort, before_comm, bounds=self._bounds())
            t_ready = t_compute + gate_s[0]
            if mean is None:  # some slot somewhere is non-finite: which of my samples were?
                suspects = self.job.suspect_shards(step, self.slots, vectors, batches, self.quarantine)
                self._nonfinite(g, step, sorted(suspects), should_abort)
                continue  # redo the step with the new quarantine set
            if not self.chan.may_commit(step + 1):
                hold_commit(self, step + 1, should_abort)
            late_s = None
            if emu is not None:  # the update and the report wait for the step's emulated end (node.py)
                late_s = emu.commit(c0, self.abort_event)
                if late_s is None:  # aborted before it: the cluster was still in this step's reduction
                    emu.c = c_computed  # which the abort ends; its compute was done (the redo waits for it)
                    raise Aborted()
            self.job.apply(mean)
            self.committed = step + 1
            t_total = time.perf_counter() - t0
            report = {"type": "step", "gen": g, "step": self.committed, "loss": float(mean[-1]),
                      "ready_s": t_ready, "compute_s": t_compute, "total_s": t_total,
                      "rounds": self.reducer.last_rounds, "slots": len(self.slots)}
            if emu is not None:
                report["late_s"] = late_s
                report["compute_overrun"] = compute_overrun
                report["total_s"] = emu.c - c0
                report["warmup"] = self._warmup
                self._warmup = False
            self.chan.send(report)
            self.at = f"gen {g}: step {self.committed} done"
            if self.rank == 0 and self.committed % self.scenario.checkpoint.interval_steps == 0:
                self.at = f"gen {g}: checkpoint of step {self.committed}"
                self.checkpoints.write(g, self.committed, self.members, self.slot_map, self.quarantine)
        self.at = f"gen {g}: finishing the last checkpoint"
        self.checkpoints.finish()
        self.at = f"gen {g}: done at step {self.committed}"
        self.chan.send({"type": "done", "gen": g, "committed": self.committed,
                        "sha256": self.job.weights_sha256(), "params": sum(self.job.sizes)})

    def _bounds(self) -> list[float] | None:
        """A priori bounds on this step's slot values, per segment of the reducer's layout (a
        tensor, or a block of one), from the optimizer's replicated first moments where it keeps
        them (identical on every worker, restored by a checkpoint, sent to a spare): 256 x the
        largest |first moment| there, and 2^20 for the loss (reduction.moment_bounds). None
        before the first update, or for an optimizer without first moments: the step then takes
        the reduction's two rounds. Values beyond them only cost the step a second round. None
        for a block format, which agrees its exponents in its own first round and reads none."""
        if self.reducer.block is not None:
            return None
        moments = self.job.first_moments()
        return None if moments is None else self.reducer.bounds(moment_bounds(moments))

    def _nonfinite(self, g: int, step: int, suspects: list[int], should_abort) -> None:
        """No non-finite value reaches the weights: report, wait for the coordinator's
        quarantine decision, then the caller redoes the step."""
        if self.emu is not None:  # emulated: the reduction's flag is known at its emulated end, not before
            self.emu.wait_until(self.emu.c, self.abort_event)
        self.at = f"gen {g} step {step + 1}: non-finite, waiting for the quarantine decision"
        self.chan.send({"type": "nonfinite", "gen": g, "step": step, "suspects": suspects})
        deferred = []
        try:
            while True:
                if should_abort():
                    raise Aborted()
                try:
                    msg = self.inbox.get(timeout=0.005)
                except queue.Empty:
                    continue
                if msg.get("type") == "quarantine" and int(msg["gen"]) == g:
                    self.quarantine = frozenset(msg["shards"])
                    return
                deferred.append(msg)
        finally:
            for msg in deferred:
                self.inbox.put(msg)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.worker")
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT",
                   help="the coordinator to join (the job's secret comes from $KEEL_JOB_SECRET)")
    p.add_argument("--node", default=None, help="scenario node name (default: from RANK, or the coordinator's choice)")
    p.add_argument("--die-with-parent", action="store_true",
                   help="exit when the process that started this one dies (PR_SET_PDEATHSIG; keel run sets it)")
    args = p.parse_args(argv)
    import faulthandler
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` dumps every thread's stack to the log
    if args.die_with_parent:
        set_pdeathsig()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # its supervisor answers Ctrl-C and stops it
    rank_hint = int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else None
    if env_secret() is None:
        print(f"keel: {SECRET_ENV}: not set; the coordinator at {args.coordinator} admits only workers that "
              f"have the job's secret (the value its coordinator was started with)", file=sys.stderr)
        return 2
    try:
        worker = Worker(args.coordinator, args.node or os.environ.get("KEEL_NODE"), rank_hint)
    except (ConnectionError, OSError) as e:
        print(f"worker: cannot reach the coordinator at {args.coordinator}: {e}", file=sys.stderr)
        return 1
    try:
        worker.serve()
    except Exception as e:
        traceback.print_exc()  # the whole of it goes to the worker's log
        worker.chan.send({"type": "error", "message": error_text(e)})
        sys.stderr.flush()
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
