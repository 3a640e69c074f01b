"""The twin's SimPy model: `Simulation`, its trainer process and the event log, and the
semantics every part of the twin implements (below).

Where things live in twin/:
- model.py (here): `Simulation`: the trainer process (segments of steps, node-loss recovery
  under absorb, restarts from a checkpoint), the cause queue that wakes it, the event log.
- cluster.py: `Cluster`: nodes, their roles and slots, the spikes on them, and the aggregates
  the step model reads (plain state, no SimPy).
- cost.py: `StepCost`: the step-cost maths (a step's `StepShape`, state copies, checkpoint
  shares) over the cluster, TwinParams and the Topology.
- steps.py: `StepShape`, drawing a segment's step times, and `Segment`, steps drawn at once;
  topology.py (+ messages.py): the networkx graph and the routed costs (reduction, spike delay, transfers).
- faults.py: `Faults`: fault ids, the schedule, node faults' detection and repair.
- checkpoints.py: `Checkpoints`: when one is due, its pause, the background write. fault_kinds/: each class's
  strike and arrivals (coordinator_loss.py: also what the loss does to the trainer, a mixin of `Simulation`;
  data_shard_skew.py: the quarantine when the step comes out non-finite).
- stragglers.py: `Stragglers`: the straggler watch, a straggler parked and back; rejoin.py: a rejoined spare.
- params.py: `TwinParams`, the scenario's figures with a calibration's applied.
Every recovery decision is keel.recovery's; these modules only time it.

Cost grows with events, not with nodes x steps: the trainer draws the times of a whole
*segment* of steps at once (`StepShape.draw`, one draw per node group and step) and waits for
the segment in one SimPy timeout. Any fault interrupts it; the steps committed by then are found
by a search in the segment's cumulative times. Segments end at checkpoints, scheduled faults,
straggler-detection points, the end of the run, and every `MAX_SEGMENT_STEPS`.

Semantics (docs/design.md for step numbering and fault ids):
- A node fault (`hardware_fault`, `partial_cluster_loss`) stalls the whole job: the in-flight
  step is lost. Detection: `detect_kill_s` or `detect_rack_s` (twin/params.py), each drawn as
  mean + heartbeat_s x (1/2 - U), the last heartbeat a uniform phase before the fault (spread
  capped at twice the mean). A fault on an idle node (spare, or parked) is only logged.
- `absorb`: at detection the lost slots move (keel.recovery.place_lost_slots: hardware: to the
  first hot spare, else the fastest finish over the survivors; rack loss: over the other
  surviving regions in proportion to their capacity); the job pauses for reform_s +
  spare_takeover_s (if a spare took over) + what the compute in flight adds (the survivors
  finish it before they see the abort: StepCost.drain_s) + the slowest state copy, and redoes
  the interrupted step. With no live training node left there is no copy of the state: it
  falls back to a restart from the last checkpoint (a `restart` event).
- `network_jitter`: a spike delays every step that starts while it lasts (StepCost.shape: a
  node's by its messages, a region's per reduction chain). Each such step is judged at its
  commit as the runtime judges it (twin/stragglers.py): a spike is detected at its first slow
  step, a straggler parked after straggler_window of them and back after as many good probes,
  each move aborting the step in flight (drained, then redone). The episode ends at its last
  straggler's return; found slow, parking no one, once fine a window (recovery.spike_settled);
  else just before the first commit after the spike, or before `run_end` (`at_run_end`).
- `data_shard_skew`: the step in flight yields NaN at its end and is not committed. With
  policy.quarantine the shard is quarantined; absorb redoes the step, checkpoint_restart rolls
  back to the last checkpoint (a restart). A drawn NaN on a quarantined shard is skipped.
  Without policy.quarantine the run stops there, failed (`run_end` completed = false).
- `coordinator_loss`: twin/fault_kinds/coordinator_loss.py.
- `checkpoint_restart`: any node fault or NaN stops the job: a `restart` at detection, the
  dead nodes replaced by hot spares (else by a new node, + replace_node_s), a pause of
  restart_s + checkpoint load (per-node share / read bandwidth), and the steps since the last
  complete checkpoint recomputed. Faults strike during the restart (it starts over, and counts
  again); a checkpoint's pause and its background write go on unless its writer is lost.
  Latency spikes are endured.
- Failed nodes come back after repair_hours as spares; under absorb a rejoining spare takes
  slots from overloaded nodes (a `reslot` with no fault) when the cluster is below its
  healthy layout. Replaced nodes (checkpoint_restart) do not come back twice.
- Checkpoints at every multiple of interval_steps up to run.steps, bytes over the training nodes:
  the trainer pauses for what the writer's stall adds to the next step (twin/checkpoints.py),
  the write goes on behind; the next checkpoint and the run's end wait for it (as the runtime's). Only the loss of
  its writer (the lowest rank: every node holds the whole state) or a cause that stops the job
  breaks the pause or the write (`Cause.aborts_checkpoint`; a coordinator's death under
  checkpoint_restart never confirmed the step, so that checkpoint is never published,
  runtime/protocol.py).
- Drawn faults: each class is a Poisson process in wall time with its own seeded stream, so
  two policies with one seed see the same arrival times. Hardware faults strike a uniformly
  drawn node at rate nodes / mtbf (thinned: a down node is skipped); jitter a uniformly drawn
  node (skipped when it holds no slots); rack loss a region drawn by node count and nodes
  drawn among its live ones; NaN a uniformly drawn shard. Scheduled faults strike when at_step
  steps are committed, as the runtime fires them at that commit: as the checkpoint due at that
  step begins its pause (the runtime's writer starts at its step's end), else as step
  at_step + 1 starts; a scheduled rack loss takes the region's first live nodes
  (keel.recovery.rack_victims).
- Step events: every segment's last commit, and around every other event the last commit
  before it and the first commit after it, so `keel.metrics.summarize` sees every episode's
  edges exactly while fault-free stretches stay sampled.
- A run that would take more than WALL_LIMIT_FACTOR x its fault-free time is stopped there.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Generator

import numpy as np
import simpy

from keel import fault_classes as FC
from keel.events import Event
from keel import recovery as R
from keel.metrics import open_at_end
from keel.scenario import Scenario
from twin.checkpoints import Checkpoints
from twin import rejoin
from twin.fault_kinds import data_shard_skew
from twin.fault_kinds.coordinator_loss import CoordinatorLossMixin
from twin.cluster import Cluster
from twin.cost import StepCost
from twin.faults import Cause, Faults
from twin.params import TwinParams
from twin.steps import NormalPool, Segment
from twin.stragglers import Stragglers
from twin.topology import Topology

MAX_SEGMENT_STEPS = 1000
# A run that would take longer than this many times its fault-free time is stopped there
# (faults faster than it can recover, e.g. a restart longer than the cluster's MTBF): its
# `run_end` says completed = false, and the goodput counts only the steps it committed.
WALL_LIMIT_FACTOR = 20.0


class Simulation(CoordinatorLossMixin):
    """One seeded run: `Simulation(scenario, params, seed, topology=None).run()` -> events."""

    def __init__(self, scenario: Scenario, params: TwinParams, seed: int, topology: Topology | None = None):
        self.scenario = scenario
        self.params = params
        self.seed = seed
        self.topology = topology or Topology(scenario)
        self.absorb = scenario.policy.kind == "absorb"
        # one stream per use; a new one goes last, so the others' draws stay as they were
        streams = np.random.SeedSequence(seed).spawn(2 + len(FC.REGISTRY))
        rng_steps, rng_detect, *class_rngs = (np.random.Generator(np.random.PCG64(s)) for s in streams)
        self.step_noise = NormalPool(rng_steps)
        self.env = simpy.Environment()
        self.events: list[Event] = []
        self.cluster = Cluster(scenario, params.slot_compute_s)
        self.cost = StepCost(scenario, params, self.topology, self.cluster)
        self.healthy_step_s = self.cost.healthy_step_s
        self.faults = Faults(self, rng_detect, dict(zip(FC.REGISTRY, class_rngs)))
        self.stragglers = Stragglers(self)
        self.checkpoints = Checkpoints(self)

        self.finished = False
        self.committed = 0
        self.segment: Segment | None = None
        self.carry_s: float | None = None
        self.carry_elapsed_s = 0.0   # how far the interrupted step had got
        self.warm = False            # the next step follows one that ran on into it: StepShape.draw
        self.inflight: tuple[float, dict[str, float]] | None = None  # its start, each holder's compute
        self.gen_start = 0           # committed steps when the current generation started
        self.gen = 0                 # generations formed after the first (re-forms, restarts, re-slots)
        self.last_step_event_t = -1.0
        self.pending_first_since: float | None = None
        self.queue: deque[Cause] = deque()
        self.trainer_state = "busy"
        self.interrupt_sent = False
        self.undetected: set[int] = set()
        self.awaiting_recovery: list[int] = []
        self.recovery_s = 0.0
        self.restart_for: list[int] = []
        self.nan_pending: list[int] = []
        self.rejoined = False
        self.quarantined: set[str] = set()
        self.init_coordinator_loss()
        self.failure: str | None = None  # why the run stopped, failed (see keel.recovery.FAIL_ACTION)
        self.wall_limit_s = WALL_LIMIT_FACTOR * scenario.run.steps * self.healthy_step_s
        self.trainer = self.env.process(self._trainer())

    # ------------------------------------------------------------------ the public surface
    def run(self) -> list[Event]:
        self.faults.start_arrivals()
        self.env.run(until=self.trainer)
        return self.events

    # ------------------------------------------------------------------ the event log
    def committed_now(self) -> int:
        seg = self.segment
        return self.committed + (seg.committed_by(self.env.now) if seg else 0)

    def _emit_step(self, seg: Segment, index: int) -> bool:
        """Log the commit of the segment's step `index` (False: already logged, or held)."""
        t = seg.commit_time(index)
        if t <= self.last_step_event_t:
            return False
        if self.hold_from is not None and t > self.hold_from:
            self.held = True
            return False  # no coordinator to commit it: its successor does (_coordinator_up)
        step = seg.first_step + index + 1
        self._append_step(t, step, step - 1)
        return True

    def _append_step(self, t: float, step: int, before: int) -> None:
        """A `step` event, after the recover_ends due before it (`before`: the steps committed
        until then)."""
        self._flush_ends(t, before)
        self.stragglers.flush_ends(t, before)
        self.last_step_event_t = t
        self.events.append(Event(round(t, 6), step, "step"))

    def _sync(self, last_commit: bool = True) -> None:
        """Emit the step events an event at `now` needs before it: the first commit after the
        previous event and the last commit before this one (so every episode's edges are exact)."""
        seg = self.segment
        if seg is None:
            return
        now = self.env.now
        done = seg.committed_by(now)
        if self.pending_first_since is not None:
            first = seg.first_after(self.pending_first_since)
            if first < done and self._emit_step(seg, first):
                self.pending_first_since = None
        if last_commit and done > 0:
            self._emit_step(seg, done - 1)

    def emit(self, kind: str, fault: str | None = None, target: str | None = None,
             action: str | None = None, **detail: Any) -> None:
        if self.finished:  # a process woken at the very instant the run ended: the log is closed
            return
        self._sync()
        now = self.env.now
        self.events.append(Event(round(now, 6), self.committed_now(), kind, fault, target, action, detail))
        self.pending_first_since = now

    def emit_episode(self, kind: str, fault_id: int, **detail: Any) -> None:
        info = self.faults.info[fault_id]
        self.emit(kind, info.fault, info.target, info.action, fault_id=fault_id, **detail)

    # ------------------------------------------------------------------ talking to the trainer
    def notify(self, cause: Cause) -> None:
        """Queue `cause` for the trainer; interrupt it if what it waits on is affected."""
        if self.finished:
            return
        self.queue.append(cause)
        if self.interrupt_sent or not self.trainer.is_alive:
            return
        state = self.trainer_state
        if (state == "stalled" or (state == "running" and cause.interrupts_run)
                or (state == "paused" and cause.aborts_pause)
                or (state == "checkpoint" and cause.aborts_checkpoint)):
            self.interrupt_sent = True
            self.trainer.interrupt(cause.kind)

    def wait(self, duration: float | simpy.Event | None, state: str) -> Generator[Any, Any, bool]:
        """The trainer waits (`state`: running | paused | checkpoint | stalled); False if interrupted."""
        self.trainer_state = state
        try:
            if duration is None:
                yield self.env.event()
            elif isinstance(duration, simpy.Event):
                yield duration
            else:
                yield self.env.timeout(max(0.0, duration))
            done = True
        except simpy.Interrupt:
            self.interrupt_sent = False
            done = False
        self.trainer_state = "busy"
        return done

    # ------------------------------------------------------------------ the trainer
    def _trainer(self) -> Generator:
        s = self.scenario
        st = self.stragglers
        self.emit("run_start", step_time_s=self.healthy_step_s, nodes=len(self.cluster.order),
                  regions=len(s.regions), slots=self.cluster.slot_count, policy=s.policy.kind, seed=self.seed)
        completed = True
        while True:
            while self.queue:
                self._handle(self.queue.popleft())
            if self.failure is not None:
                completed = False
                break
            st.catch_up()
            if self.env.now > self.wall_limit_s:
                completed = False
                break
            if self.undetected or (self.outages and not self.absorb):
                yield from self.wait(None, "stalled")
            elif self.restart_for:
                yield from self._restart()
            elif self.awaiting_recovery:
                yield from self._recover()
            elif (back := st.moving_back()) is not None:
                yield from st.move_back(back)
            elif self.carry_s is not None or self.nan_pending:
                yield from self._segment(1)
            elif st.due():
                yield from st.straggler()
            elif self.committed >= s.run.steps:
                if self.outages:
                    yield from self.wait(None, "stalled")  # the run is over once a coordinator says so
                elif not (yield from self.checkpoints.finish()):  # its last checkpoint durable first
                    break
            elif self.rejoined:
                yield from rejoin.rebalance(self)
            elif self.checkpoints.due(self.committed):
                self.faults.fire_scheduled_at(self.committed)  # they strike at the commit, as it begins
                yield from self.checkpoints.take()
            else:
                yield from self._segment(self._steps_to_boundary())
        self.stragglers.ends_at_commit.clear()  # no commit came: open_at_end closes them below
        if completed:  # a spike that outlasts the run: its episode closes here (keel.metrics)
            for fid in open_at_end(self.events):
                self.emit_episode("recover_end", fid, at_run_end=True)
        self.emit("run_end", step_time_s=self.healthy_step_s, checkpoint_step=self.checkpoints.step,
                  completed=completed, **({"failure": self.failure} if self.failure else {}))
        self.finished = True

    def _handle(self, cause: Cause) -> None:
        fid = cause.fault_id
        if cause.kind == "loss":
            self.carry_s = None  # the step in flight is lost
            self.undetected.add(fid)
            self.checkpoints.nodes_lost(self.faults.info[fid].nodes)
        elif cause.kind == "detected":
            self.undetected.discard(fid)
            self._detected(fid)
        elif cause.kind == "spike_start":
            self.stragglers.spike_started(fid)
        elif cause.kind == "spike_end":
            self.stragglers.spike_ended(fid)
        elif cause.kind == "nan":
            self.nan_pending.append(fid)
        elif cause.kind == "rejoin":
            self.rejoined = True
        elif cause.kind == "coordinator_down":
            self.carry_s = None  # the job stops (checkpoint_restart)
        elif cause.kind == "coordinator_up":
            self._coordinator_up(fid)

    def new_generation(self) -> None:
        self.gen_start = self.committed
        self.gen += 1
        self.warm = False  # its members start its first step together
        self.stragglers.new_generation()

    # ------------------------------------------------------------------ node loss: absorb or restart
    def _detected(self, fid: int) -> None:
        """A node fault is detected: under absorb its slots move (keel.recovery.place_lost_slots)."""
        c = self.cluster
        info = self.faults.info[fid]
        dead = [c.nodes[n] for n in info.nodes if not c.nodes[n].up and c.nodes[n].slots > 0]
        if not self.absorb or c.held_slots == 0:  # no live copy of the state: restart
            self.restart_for.append(fid)
            return
        self.emit_episode("recover_start", fid)
        lost = sum(n.slots for n in dead)
        for n in dead:
            c.update(n, slots=0, role="down")
        spares = [n.name for n in c.spare_nodes(1)]
        picks = R.place_lost_slots(info.action, lost, lambda: c.as_holders(c.active()), spares,
                                   self.topology.region_names, lost_region=info.target)
        takeover, spare = 0.0, None
        if spares and spares[0] in picks:
            spare = spares[0]
            c.update(c.nodes[spare], role="train")
            takeover = self.params.spare_takeover_s
        receivers = c.give(c.counts(picks))
        assert c.held_slots + c.orphaned_slots() == c.slot_count, "slots lost"
        self.awaiting_recovery.append(fid)
        # survivors hold the state already: only a spare taking over needs a copy of it
        behind = [(name, k) for name, k in receivers if name == spare]
        formed = self.params.reform_s + takeover
        self.recovery_s = max(self.recovery_s, self.cost.reformed_s(self.inflight, self.env.now, formed)
                              + self.cost.transfer_s(behind))
        self.emit_episode("reslot", fid, slots=lost, to=[f"{name}:{k}" for name, k in receivers])

    def _recover(self) -> Generator:
        done = yield from self.wait(self.recovery_s, "paused")
        self.new_generation()
        if done:
            for fid in self.awaiting_recovery:
                if fid in self.failovers:  # a coordinator_loss (twin/fault_kinds/coordinator_loss.py)
                    self._failover_done(fid)
                else:
                    self.emit_episode("recover_end", fid)
            self.awaiting_recovery.clear()
            self.recovery_s = 0.0

    def _restart(self) -> Generator:
        """The job stops and restarts from the last complete checkpoint."""
        c = self.cluster
        fid = self.restart_for[-1]
        ckpt = self.checkpoints
        lost = self.committed - ckpt.step
        self.emit_episode("restart", fid, from_step=ckpt.step, lost_steps=lost)
        self.committed = ckpt.step
        ckpt.attempted = ckpt.step
        self.carry_s = None
        self.stragglers.clear()
        ckpt.abort("job stopped")
        orphans = [c.order[i] for i in sorted(c.orphans)]
        taken, new_machines = R.relaunch_places([n.name for n in orphans], [n.name for n in c.spare_nodes()])
        for n in orphans:
            if n.name in taken:
                c.update(c.nodes[taken[n.name]], role="train", slots=n.slots)
                c.update(n, slots=0, role="down")
            else:  # a new machine takes the dead one's place (its repair no longer matters)
                n.incarnation += 1
                c.update(n, up=True, role="train")
        replaced = bool(new_machines)
        load_s = self.cost.share_s(self.params.ckpt_read_gbyte_s) if ckpt.step > 0 else 0.0
        duration = self.params.restart_s + (self.params.replace_node_s if replaced else 0.0) + load_s
        done = yield from self.wait(duration, "paused")
        self.new_generation()
        if done:
            episodes = sorted(set(self.restart_for) | set(self.awaiting_recovery))
            for f in episodes:
                self.emit_episode("recover_end", f, from_step=ckpt.step)
            self.restart_for.clear()
            self.awaiting_recovery.clear()
            self.recovery_s = 0.0

    # ------------------------------------------------------------------ steps
    def _steps_to_boundary(self) -> int:
        c = self.committed
        s = self.scenario
        interval = s.checkpoint.interval_steps
        bounds = [s.run.steps, (c // interval + 1) * interval, c + MAX_SEGMENT_STEPS]
        bounds += self.faults.scheduled_bounds(c)
        bounds += self.stragglers.bounds(c)
        return max(1, min(bounds) - c)

    def _segment(self, count: int) -> Generator:
        """Draw `count` steps and wait for them; a cause that interrupts keeps what committed."""
        assert self.cluster.held_slots == self.cluster.slot_count and not self.cluster.orphans, "slots lost"
        durations = self.cost.current_shape().draw(self.step_noise, count, warm=self.warm)
        self.warm = True
        self.inflight = None
        if self.carry_s is not None:
            durations[0] = max(self.carry_s, 0.0)
            self.carry_s = None
        nan = bool(self.nan_pending)
        if nan:  # the last step stops at the flag's all-reduce (keel.wire.flag_rounds)
            durations[-1] = max(0.0, durations[-1] - self.cost.nonfinite_saving_s())
        cum = np.cumsum(durations)
        seg = Segment(self.env.now, self.committed, cum, nan)
        self.segment = seg
        self.faults.fire_scheduled_at(self.committed)
        done = yield from self.wait(float(cum[-1]), "running")
        if done:
            if nan:
                self.segment = None
                data_shard_skew.step_done(self)
                return
            self._sync(last_commit=False)  # its end is written just below
            self._emit_step(seg, count - 1)
            self.committed += count
        else:
            k = seg.committed_by(self.env.now)
            self._sync(last_commit=False)  # the cause's event wrote it
            self.committed += k
            if k < count:
                self.carry_s = seg.start + float(cum[k]) - self.env.now
                self.carry_elapsed_s = self.env.now - (seg.start + (float(cum[k - 1]) if k > 0 else 0.0))
                self.inflight = (self.env.now - self.carry_elapsed_s, self.cost.compute_by_node())
        self.segment = None
