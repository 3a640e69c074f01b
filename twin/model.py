"""The SimPy model: one trainer process over an aggregated step model, plus event-level processes
for faults, detection, repairs and background checkpoint writes.

Cost grows with events, not with nodes x steps: the trainer draws the times of a whole
*segment* of steps at once (`StepShape.draw`, one draw per node group and step) and waits for
the segment in one SimPy timeout. Any fault interrupts it; the steps committed by then are found
by a search in the segment's cumulative times. Segments end at checkpoints, scheduled faults,
straggler-detection points, the end of the run, and every `MAX_SEGMENT_STEPS`.

Semantics (docs/design.md for step numbering and fault ids):
- A node fault (`hardware_fault`, `partial_cluster_loss`) stalls the whole job: the in-flight
  step is lost. Detection takes `detect_kill_s` (hardware) or `detect_rack_s` (a rack's nodes
  killed at once; both are deaths the runtime sees as connection loss, twin/params.py), each drawn as mean + heartbeat_s x (1/2 - U): the timeout runs from the last
  heartbeat, which came a uniform phase before the fault (the spread is capped at twice the
  mean, so a calibrated small mean stays non-negative). A fault on an idle node (spare, or a node
  parked by a re-slot) costs nothing and is only logged.
- `absorb`: at detection the lost slots move (keel.recovery.place_lost_slots: hardware: to the
  first hot spare, else the fastest finish over the survivors; rack loss: over the other
  surviving regions in proportion to their capacity, the sum of their nodes' speed); then the job pauses for reform_s + spare_takeover_s (if a spare took over) + the
  slowest state copy (the slots' share of weights + optimizer at the routed peer bandwidth), and
  redoes the interrupted step. With no live training node left there is no copy of the state:
  it falls back to a restart from the last checkpoint (a `restart` event).
- `network_jitter`: a spike adds `Topology.spike_delay_s` to every step while it lasts. Under
  absorb, if (healthy + delay) / healthy > straggler_factor, the straggler is detected after
  straggler_window steps that ran slow; its slots move (to a spare, else to the least-loaded
  nodes; a region's to the other regions) if that makes steps faster, and move back when the
  spike ends. The episode always ends with a `recover_end` when the spike is over.
- `data_shard_skew`: the step in flight yields NaN at its end and is not committed. With
  policy.quarantine the shard is quarantined; absorb redoes the step, checkpoint_restart rolls
  back to the last checkpoint (a restart). A drawn NaN on a quarantined shard is skipped.
  Without policy.quarantine the run stops there, failed (`run_end` completed = false).
- `checkpoint_restart`: any node fault or NaN stops the job: a `restart` at detection, the
  dead nodes replaced by hot spares (else by a new node, + replace_node_s), a pause of
  restart_s + checkpoint load (per-node share / read bandwidth), and the steps since the last
  complete checkpoint recomputed. Faults strike during the restart (it starts over, and counts
  again) and during checkpoints (an unfinished checkpoint is lost). Latency spikes are endured.
- Failed nodes come back after repair_hours as spares; under absorb a rejoining spare takes
  slots from overloaded nodes (a `reslot` with no fault) when the cluster is below its
  healthy layout. Replaced nodes (checkpoint_restart) do not come back twice.
- Checkpoints at every multiple of interval_steps below run.steps, bytes spread over the
  training nodes: `sync` pauses for the write; `async` pauses for the snapshot and writes in the
  background (`checkpoint_end` when the write is done; a node fault aborts it). The next
  checkpoint waits for the previous write.
- Drawn faults: each class is a Poisson process in wall time with its own seeded stream, so
  two policies with one seed see the same arrival times. Hardware faults strike a uniformly
  drawn node at rate nodes / mtbf (thinned: a down node is skipped); jitter a uniformly drawn
  node (skipped when it holds no slots); rack loss a region drawn by node count and nodes
  drawn among its live ones; NaN a uniformly drawn shard. Scheduled faults strike when at_step
  steps are committed, as step at_step + 1 starts (the runtime fires them at that commit); a scheduled rack loss takes the region's first live nodes.
- Step events: every segment's last commit, and around every other event the last commit
  before it and the first commit after it, so `keel.metrics.summarize` sees every episode's
  edges exactly while fault-free stretches stay sampled.
- A run that would take more than WALL_LIMIT_FACTOR x its fault-free time is stopped there.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Generator

import numpy as np
import simpy

from keel.events import Event
from keel import recovery as R
from keel.scenario import Scenario, spike_factor
from twin.params import TwinParams
from twin.steps import NormalPool, StepShape
from twin.topology import Topology

MAX_SEGMENT_STEPS = 1000
# A run that would take longer than this many times its fault-free time is stopped there
# (faults faster than it can recover, e.g. a restart longer than the cluster's MTBF): its
# `run_end` says completed = false, and the goodput counts only the steps it committed.
WALL_LIMIT_FACTOR = 20.0
HOUR = 3600.0
DAY = 86400.0


# ----------------------------------------------------------------------------- state

@dataclass(slots=True)
class Node:
    name: str
    region: str
    speed: float
    gpus: int
    index: int
    up: bool = True
    role: str = "train"        # train | spare | parked | down
    slots: int = 0
    incarnation: int = 0


@dataclass(slots=True)
class Spike:
    target: str
    spike_s: float
    active: bool = True
    in_flight: bool = False    # it caught the step in flight before the target's gate
    detected: bool = False
    moves: list[tuple[str, str, int]] = field(default_factory=list)  # (from, to, slots)
    spare_receivers: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class Cause:
    """Something the trainer must react to. `interrupts_run`: it changes the steps in flight;
    `aborts_pause`: it breaks a recovery, restart or checkpoint pause too."""
    kind: str               # loss | detected | spike_start | spike_end | nan | rejoin
    fault_id: int | None = None
    interrupts_run: bool = False
    aborts_pause: bool = False


@dataclass(slots=True)
class Segment:
    start: float
    first_step: int
    cum: np.ndarray
    nan: bool = False

    def committed_by(self, t: float) -> int:
        if self.nan:
            return 0
        return int(np.searchsorted(self.cum, t - self.start, side="right"))

    def first_after(self, t: float) -> int:
        return int(np.searchsorted(self.cum, t - self.start, side="right"))

    def commit_time(self, index: int) -> float:
        return self.start + float(self.cum[index])


@dataclass(frozen=True, slots=True)
class FaultInfo:
    fault: str
    target: str
    action: str | None
    nodes: tuple[str, ...] = ()
    shard: str | None = None


# ----------------------------------------------------------------------------- the simulation

class Simulation:
    def __init__(self, scenario: Scenario, params: TwinParams, seed: int, topology: Topology | None = None):
        self.scenario = scenario
        self.params = params
        self.seed = seed
        self.topology = topology or Topology(scenario)
        self.absorb = scenario.policy.kind == "absorb"
        streams = np.random.SeedSequence(seed).spawn(6)
        (self.rng_steps, self.rng_detect, self.rng_hardware, self.rng_jitter,
         self.rng_rack, self.rng_skew) = (np.random.Generator(np.random.PCG64(s)) for s in streams)
        self.step_noise = NormalPool(self.rng_steps)
        self.env = simpy.Environment()
        self.events: list[Event] = []

        self._shape_cache: tuple[int, StepShape] | None = None
        self.memberships: set[int] = set()  # how many nodes held slots, in each layout it trained with
        self._expected_cache: dict[tuple, float] = {}
        self.layout_version = 0
        # kept up to date by _update, so a fault costs O(nodes it touches), not O(cluster)
        self.groups: Counter[float] = Counter()          # compute s -> up nodes holding slots
        self.holders_per_region: Counter[str] = Counter()
        self.live_per_region: Counter[str] = Counter()   # up nodes with state (train or parked)
        self.held_slots = 0                              # slots on up nodes
        self.spares: set[int] = set()                    # indices of up idle spares
        self.orphans: set[int] = set()                   # indices of dead nodes still holding slots
        self.nodes: dict[str, Node] = {}
        for r in scenario.regions:
            for i in range(r.nodes):
                name = f"{r.name}/{i}"
                self.nodes[name] = Node(name, r.name, r.speed, r.gpus_per_node, len(self.nodes), role="down")
        self.order = list(self.nodes.values())
        for node in self.order:
            self._update(node, role="train" if node.index < scenario.training_nodes else "spare")
        self.slot_count = scenario.slot_count
        self._place(self.slot_count, [n for n in self.order if n.role == "train"])
        self.healthy_max_load = max(n.slots / n.speed for n in self.order)
        self.state_bytes = scenario.checkpoint.weights_bytes + scenario.checkpoint.optimizer_bytes
        reference: dict[str, int] = {}  # the membership TwinParams' reduction figures refer to
        for n in self.order[: scenario.training_nodes]:
            reference[n.region] = reference.get(n.region, 0) + 1
        self.reference_reduction = self.topology.reduction(reference)
        self.healthy_step_s = self._expected_s(self._shape(with_spikes=False))

        self.finished = False
        self.committed = 0
        self.segment: Segment | None = None
        self.carry_s: float | None = None
        self.carry_elapsed_s = 0.0   # how far the interrupted step had got
        self.gen_start = 0           # committed steps when the current generation started
        self.last_step_event_t = -1.0
        self.pending_first_since: float | None = None
        self.queue: deque[Cause] = deque()
        self.trainer_state = "busy"
        self.interrupt_sent = False
        self.fault_seq = 0
        self.info: dict[int, FaultInfo] = {}
        self.undetected: set[int] = set()
        self.awaiting_recovery: list[int] = []
        self.recovery_s = 0.0
        self.restart_for: list[int] = []
        self.nan_pending: list[int] = []
        self.spikes: dict[int, Spike] = {}
        self.watches: dict[int, int] = {}
        self.detect_at: dict[int, int] = {}
        self.spike_ends: list[int] = []
        self.rejoined = False
        self.quarantined: set[str] = set()
        self.failure: str | None = None  # why the run stopped, failed (see keel.recovery.FAIL_ACTION)
        self.ckpt_step = 0
        self.ckpt_attempted = 0
        self.writer: simpy.Process | None = None
        self.schedule_fired: set[int] = set()
        self.schedule = R.resolve_schedule(scenario)
        self.schedule_at: dict[int, list[int]] = {}
        for entry in self.schedule:
            self.schedule_at.setdefault(entry.at_step, []).append(entry.index)
        self.wall_limit_s = WALL_LIMIT_FACTOR * scenario.run.steps * self.healthy_step_s
        self.trainer = self.env.process(self._trainer())

    # ------------------------------------------------------------------ running
    def run(self) -> list[Event]:
        faults = self.scenario.faults
        if faults.hardware_fault.mtbf_node_hours > 0:
            self.env.process(self._hardware_arrivals())
        if faults.network_jitter.per_day > 0:
            self.env.process(self._jitter_arrivals())
        if faults.partial_cluster_loss.per_day > 0:
            self.env.process(self._rack_arrivals())
        if faults.data_shard_skew.per_day > 0:
            self.env.process(self._skew_arrivals())
        self.env.run(until=self.trainer)
        return self.events

    # ------------------------------------------------------------------ the event log
    def committed_now(self) -> int:
        seg = self.segment
        return self.committed + (seg.committed_by(self.env.now) if seg else 0)

    def _emit_step(self, seg: Segment, index: int) -> None:
        t = seg.commit_time(index)
        if t <= self.last_step_event_t:
            return
        self.last_step_event_t = t
        self.events.append(Event(round(t, 6), seg.first_step + index + 1, "step"))

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
            if first < done:
                self._emit_step(seg, first)
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
        info = self.info[fault_id]
        self.emit(kind, info.fault, info.target, info.action, fault_id=fault_id, **detail)

    # ------------------------------------------------------------------ the cluster
    def _active(self) -> list[Node]:
        return [n for n in self.order if n.up and n.role == "train"]

    def _active_per_region(self, nodes: list[Node] | None = None) -> dict[str, int]:
        """Nodes holding slots per region (of `nodes`, or of the cluster now)."""
        if nodes is None:
            return dict(self.holders_per_region)
        out: dict[str, int] = {}
        for n in nodes:
            out[n.region] = out.get(n.region, 0) + 1
        return out

    def _contribute(self, n: Node, sign: int) -> None:
        if not n.up:
            if n.slots > 0:
                (self.orphans.add if sign > 0 else self.orphans.discard)(n.index)
            return
        if n.role == "train" and n.slots > 0:
            _count(self.groups, n.slots * self.params.slot_compute_s / n.speed, sign)
            _count(self.holders_per_region, n.region, sign)
            self.held_slots += sign * n.slots
        if n.role in ("train", "parked"):
            _count(self.live_per_region, n.region, sign)
        if n.role == "spare":
            (self.spares.add if sign > 0 else self.spares.discard)(n.index)

    def _update(self, n: Node, *, up: bool | None = None, role: str | None = None,
                slots: int | None = None) -> None:
        """The one way to change a node: keeps the aggregates the step model reads current."""
        self._contribute(n, -1)
        if up is not None:
            n.up = up
        if role is not None:
            n.role = role
        if slots is not None:
            n.slots = slots
        self._contribute(n, +1)
        self.layout_version += 1

    def _spare_nodes(self, count: int | None = None) -> list[Node]:
        """Up idle spares, in scenario order."""
        return [self.order[i] for i in sorted(self.spares)[:count]]

    def _holders(self) -> int:
        return sum(self.holders_per_region.values())

    @staticmethod
    def _as_holders(candidates: list[Node], empty: bool = False) -> list[R.Holder]:
        return [R.Holder(n.name, n.region, n.speed, 0 if empty else n.slots, n.index) for n in candidates]

    def _counts(self, picks: list[str]) -> list[tuple[str, int]]:
        """(node, slots) per receiver of `picks`, in scenario order."""
        return sorted(Counter(picks).items(), key=lambda kv: self.nodes[kv[0]].index)

    def _placement(self, count: int, candidates: list[Node], empty: bool = False) -> list[tuple[str, int]]:
        """Where `count` more slots go among `candidates` (holding what they hold, or nothing
        if `empty`): keel.recovery.fastest_finish. Changes nothing."""
        return self._counts(R.fastest_finish(count, self._as_holders(candidates, empty)))

    def _give(self, placed: list[tuple[str, int]]) -> list[tuple[str, int]]:
        for name, k in placed:
            self._update(self.nodes[name], slots=self.nodes[name].slots + k)
        return placed

    def _place(self, count: int, candidates: list[Node]) -> list[tuple[str, int]]:
        """Give `count` slots to `candidates`, each to the node that would finish soonest."""
        return self._give(self._placement(count, candidates))

    def fault_free_step_s(self, holders: int) -> float:
        """The expected fault-free step with the run's slots placed over the first `holders`
        nodes in scenario order, as a fault-free run with that many training nodes has them,
        host sharing included."""
        nodes = self.order[:holders]
        slots = {n.name: 0 for n in nodes} | dict(self._placement(self.slot_count, nodes, empty=True))
        return self._expected_s(self._shape(with_spikes=False, nodes=nodes, slots=slots))


    def _shape(self, with_spikes: bool = True, nodes: list[Node] | None = None,
               slots: dict[str, int] | None = None) -> StepShape:
        """The step model for the cluster now, or for a trial layout (`nodes` with `slots`)."""
        p = self.params
        if nodes is None:
            groups = self.groups
            per_region = dict(self.holders_per_region)

            def is_member(name: str) -> bool:
                n = self.nodes[name]
                return n.up and n.role == "train" and n.slots > 0
        else:
            assert slots is not None
            groups = Counter()
            members = [n for n in nodes if slots[n.name] > 0]
            for n in members:
                groups[slots[n.name] * p.slot_compute_s / n.speed] += 1
            member_names = {n.name for n in members}
            per_region = self._active_per_region(members)

            def is_member(name: str) -> bool:
                return name in member_names
        red = self.topology.reduction(per_region)
        ref = self.reference_reduction
        hf = self._host_factor(sum(per_region.values()))
        if p.host_pace_per_worker is not None:
            # the workers share one machine: the calibrated reduction is that machine's, and how
            # it changes with the membership is the host factor's, not the scenario's topology
            latency, per_byte = p.reduce_latency_s * hf, hf / (p.reduce_gbyte_s * 1e9)
        else:
            latency = red.latency_s * (p.reduce_latency_s / ref.latency_s if ref.latency_s > 0 else 1.0)
            per_byte = red.s_per_byte * ((1.0 / (ref.s_per_byte * 1e9)) / p.reduce_gbyte_s if ref.s_per_byte > 0 else 1.0)
        spike = floor = 0.0
        if with_spikes:
            for sp in self.spikes.values():
                if sp.active and not sp.moves and ("/" not in sp.target or is_member(sp.target)):
                    delay = self._spike_delay(sp, per_region)
                    if p.spike_tail_s is None:  # uncalibrated: the delay adds to the whole step
                        spike = max(spike, delay)
                    else:  # the others' work overlaps the target's wait (see _spiked_step_s)
                        floor = max(floor, self._spiked_step_s(sp, delay, hf, nodes, slots))
        fixed = latency + self.scenario.workload.gradient_bytes * per_byte + p.step_overhead_s * hf + spike
        if p.host_pace_per_worker is not None and groups:
            # workers time-sharing a machine's cores finish a step when the cores have done all
            # of its work: the compute is the slots' total spread evenly, whoever holds them
            # (a 3-2-2-1 layout steps as fast as 2-2-2-2 here, not one slot slower)
            holders = sum(groups.values())
            groups = Counter({sum(base * n for base, n in groups.items()) / holders: holders})
        return StepShape(tuple(sorted((n, base * hf) for base, n in groups.items())), p.compute_jitter,
                         fixed, latency, red.jitter_s, floor)

    def _spiked_step_s(self, sp: Spike, delay: float, hf: float, nodes: list[Node] | None = None,
                       slots: dict[str, int] | None = None) -> float:
        """With a calibrated `spike_tail_s`: a spiked step lasts at least the target's compute,
        then the gate's delay, then the collective once everyone has reached it (the others
        compute and wait meanwhile, so their part of the step hides under the delay)."""
        if nodes is None:
            holders = [(n, n.slots) for n in self._spiked_holders(sp)]
        else:
            assert slots is not None
            holders = [(n, slots[n.name]) for n in nodes if slots[n.name] > 0
                       and (n.name == sp.target or ("/" not in sp.target and n.region == sp.target))]
        if not holders:
            return 0.0
        compute = max(k * self.params.slot_compute_s / n.speed for n, k in holders) * hf
        return compute + delay + self.params.spike_tail_s

    def _host_factor(self, holders: int) -> float:
        """Workers sharing one machine's cores (calibrated `host_pace_per_worker`; None for
        independent nodes): the fault-free step relative to the reference membership's, per
        worker holding slots more or fewer. A sleep (a spike's delay) is not scaled."""
        slope = self.params.host_pace_per_worker
        if not slope or holders <= 0:
            return 1.0
        return max(0.05, 1.0 + slope * (holders - self.scenario.training_nodes))

    def _expected_s(self, shape: StepShape) -> float:
        key = (shape.groups, shape.fixed_s, shape.floor_s)
        if key not in self._expected_cache:
            self._expected_cache[key] = shape.expected_s()
        return self._expected_cache[key]

    def _spike_delay(self, spike: Spike, per_region: dict[str, int], step: int | None = None) -> float:
        """A spike's delay per step: its mean, or, for 0-based step `step`, the runtime's own
        draw for that step (`keel.scenario.spike_factor`, the slowest of the target's holders)."""
        factor = 1.0
        if step is not None:
            factor = max((spike_factor(self.scenario.run.seed, n.name, step) for n in self._spiked_holders(spike)),
                         default=1.0)
        rounds = self.params.spike_rounds
        if rounds is not None:  # calibrated: latency-bound rounds a spike delays per step
            touched = per_region.get(spike.target.split("/", 1)[0], 0) > 0
            return spike.spike_s * factor * rounds if touched else 0.0
        return self.topology.spike_delay_s(spike.target, spike.spike_s * factor, per_region)

    def _current_shape(self) -> StepShape:
        if self._shape_cache is None or self._shape_cache[0] != self.layout_version:
            self._shape_cache = (self.layout_version, self._shape())
            self.memberships.add(self._holders())
        return self._shape_cache[1]

    def _transfer_s(self, receivers: list[tuple[str, int]]) -> float:
        """Slowest state copy of the slots' share of the state to each receiver."""
        if not receivers:
            return 0.0
        scale = self.params.state_transfer_gbyte_s / self.topology.reference_transfer_gbyte_s()
        per_slot = self.state_bytes / self.slot_count

        def peer_regions(receiver: Node) -> set[str]:
            own = 1 if receiver.up and receiver.role in ("train", "parked") else 0
            return {r for r, c in self.live_per_region.items() if c - (own if r == receiver.region else 0) > 0}
        return max(k * per_slot / (self.topology.transfer_gbyte_s(name, peer_regions(self.nodes[name])) * scale * 1e9)
                   for name, k in receivers)

    def _detect_delay(self, mean: float) -> float:
        spread = min(self.params.heartbeat_s, 2 * mean)
        return max(0.0, mean + spread * (0.5 - float(self.rng_detect.random())))

    # ------------------------------------------------------------------ talking to the trainer
    def notify(self, cause: Cause) -> None:
        if self.finished:
            return
        self.queue.append(cause)
        if self.interrupt_sent or not self.trainer.is_alive:
            return
        state = self.trainer_state
        if (state == "stalled" or (state == "running" and cause.interrupts_run)
                or (state == "paused" and cause.aborts_pause)):
            self.interrupt_sent = True
            self.trainer.interrupt(cause.kind)

    def _wait(self, duration: float | simpy.Event | None, state: str) -> Generator[Any, Any, bool]:
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

    # ------------------------------------------------------------------ faults
    def _new_fault(self, info: FaultInfo) -> int:
        fid = self.fault_seq
        self.fault_seq += 1
        self.info[fid] = info
        return fid

    def _action(self, fault: str) -> str:
        p = self.scenario.policy
        return R.action_for(fault, p.kind, p.quarantine)

    def strike_nodes(self, fault: str, target: str, names: list[str], scheduled: bool) -> None:
        nodes = [self.nodes[n] for n in names if self.nodes[n].up]
        if not nodes:
            return
        holding = [n for n in nodes if n.slots > 0]
        fid = self._new_fault(FaultInfo(fault, target, self._action(fault), tuple(n.name for n in nodes)))
        detail: dict[str, Any] = {"scheduled": scheduled}
        if fault == "partial_cluster_loss":
            detail["nodes"] = [n.name for n in nodes]
        if not holding:
            detail["idle"] = True
        self.emit_episode("fault", fid, **detail)
        repair_h = (self.scenario.faults.hardware_fault.repair_hours if fault == "hardware_fault"
                    else self.scenario.faults.partial_cluster_loss.repair_hours)
        for n in nodes:
            self._update(n, up=False, role=None if n.role == "train" else "down")
            self.env.process(self._repair(n, n.incarnation, repair_h * HOUR))
        if holding:
            # killed nodes: the runtime sees each death as connection loss / process exit
            mean = self.params.detect_kill_s if fault == "hardware_fault" else self.params.detect_rack_s
            self.env.process(self._detector(fid, self._detect_delay(mean)))
            self.notify(Cause("loss", fid, interrupts_run=True, aborts_pause=True))

    def strike_spike(self, target: str, spike_s: float, duration_s: float, scheduled: bool) -> None:
        fid = self._new_fault(FaultInfo("network_jitter", target, self._action("network_jitter")))
        self.emit_episode("fault", fid, scheduled=scheduled, spike_ms=spike_s * 1e3, duration_s=duration_s)
        self.spikes[fid] = Spike(target, spike_s)
        self.layout_version += 1  # the step model changed
        self.notify(Cause("spike_start", fid, interrupts_run=True))
        self.env.process(self._spike_end(fid, duration_s))

    def strike_shard(self, shard: str, scheduled: bool) -> None:
        fid = self._new_fault(FaultInfo("data_shard_skew", shard, self._action("data_shard_skew"), shard=shard))
        self.emit_episode("fault", fid, scheduled=scheduled)
        self.notify(Cause("nan", fid, interrupts_run=True))

    def _fire_scheduled(self, index: int, delay: float) -> Generator:
        yield self.env.timeout(delay)
        entry = self.schedule[index]
        if entry.cls == "hardware_fault":
            self.strike_nodes("hardware_fault", entry.target, [entry.target], True)
        elif entry.cls == "partial_cluster_loss":
            live = [n.name for n in self.order if n.region == entry.target and n.up]
            self.strike_nodes("partial_cluster_loss", entry.target, R.rack_victims(live, entry.nodes), True)
        elif entry.cls == "network_jitter":
            self.strike_spike(entry.target, entry.spike_ms / 1e3, entry.duration_s, True)
        elif not R.shard_skipped(self.scenario.policy.quarantine, self.quarantined, entry.target):
            self.strike_shard(entry.target, True)

    def _hardware_arrivals(self) -> Generator:
        rate = len(self.order) / (self.scenario.faults.hardware_fault.mtbf_node_hours * HOUR)
        rng = self.rng_hardware
        while True:
            yield self.env.timeout(rng.exponential(1.0 / rate))
            node = self.order[int(rng.integers(len(self.order)))]
            if node.up:
                self.strike_nodes("hardware_fault", node.name, [node.name], False)

    def _jitter_arrivals(self) -> Generator:
        cfg = self.scenario.faults.network_jitter
        rng = self.rng_jitter
        while True:
            yield self.env.timeout(rng.exponential(DAY / cfg.per_day))
            node = self.order[int(rng.integers(len(self.order)))]
            if node.up and node.role == "train" and node.slots > 0:
                self.strike_spike(node.name, cfg.spike_ms / 1e3, cfg.duration_s, False)

    def _rack_arrivals(self) -> Generator:
        cfg = self.scenario.faults.partial_cluster_loss
        rng = self.rng_rack
        regions = self.scenario.regions
        weights = np.array([r.nodes for r in regions], dtype=float)
        weights /= weights.sum()
        while True:
            yield self.env.timeout(rng.exponential(DAY / cfg.per_day))
            region = regions[int(rng.choice(len(regions), p=weights))].name
            live = [n.name for n in self.order if n.region == region and n.up]
            if not live:
                continue
            picked = sorted(rng.choice(len(live), size=min(cfg.nodes, len(live)), replace=False))
            self.strike_nodes("partial_cluster_loss", region, [live[i] for i in picked], False)

    def _skew_arrivals(self) -> Generator:
        rng = self.rng_skew
        shards = self.scenario.data.shards
        while True:
            yield self.env.timeout(rng.exponential(DAY / self.scenario.faults.data_shard_skew.per_day))
            shard = f"shard/{int(rng.integers(shards))}"
            if not R.shard_skipped(self.scenario.policy.quarantine, self.quarantined, shard):
                self.strike_shard(shard, False)

    def _detector(self, fid: int, delay: float) -> Generator:
        yield self.env.timeout(delay)
        self.emit_episode("detect", fid, after_s=round(delay, 6))
        self.notify(Cause("detected", fid))

    def _repair(self, node: Node, incarnation: int, after_s: float) -> Generator:
        yield self.env.timeout(after_s)
        if node.incarnation != incarnation or node.up:
            return
        self._update(node, up=True, role="spare", slots=0)
        self.notify(Cause("rejoin", interrupts_run=self.absorb and self._overloaded()))

    def _spike_end(self, fid: int, after_s: float) -> Generator:
        yield self.env.timeout(after_s)
        sp = self.spikes[fid]
        sp.active = False
        self.layout_version += 1
        if sp.moves:  # parked: back once straggler_window of its heartbeat probes come back good
            yield self.env.timeout(self._probe_wait_s(sp))
        self.notify(Cause("spike_end", fid, interrupts_run=True))

    # ------------------------------------------------------------------ the trainer
    def _trainer(self) -> Generator:
        s = self.scenario
        self.emit("run_start", step_time_s=self.healthy_step_s, nodes=len(self.order),
                  regions=len(s.regions), slots=self.slot_count, policy=s.policy.kind, seed=self.seed)
        completed = True
        while True:
            while self.queue:
                self._handle(self.queue.popleft())
            if self.failure is not None:
                completed = False
                break
            if self.detect_at:
                self._detect_due()
            if self.env.now > self.wall_limit_s:
                completed = False
                break
            if self.undetected:
                yield from self._wait(None, "stalled")
            elif self.restart_for:
                yield from self._restart()
            elif self.awaiting_recovery:
                yield from self._recover()
            elif self.carry_s is not None or self.nan_pending:
                yield from self._segment(1)
            elif self.spike_ends:
                yield from self._end_spike(self.spike_ends.pop(0))
            elif (due := [f for f, at in self.watches.items() if at <= self.committed]):
                yield from self._straggler(due[0])
            elif self.committed >= s.run.steps:
                break
            elif self.rejoined:
                yield from self._rebalance()
            elif self._checkpoint_due():
                yield from self._checkpoint()
            else:
                yield from self._segment(self._steps_to_boundary())
        self.emit("run_end", step_time_s=self.healthy_step_s, checkpoint_step=self.ckpt_step,
                  completed=completed, **({"failure": self.failure} if self.failure else {}))
        self.finished = True

    def _handle(self, cause: Cause) -> None:
        fid = cause.fault_id
        if cause.kind == "loss":
            self.carry_s = None  # the step in flight is lost
            self.undetected.add(fid)
            if self.writer is not None and self.writer.is_alive:
                self.writer.interrupt("node lost")
        elif cause.kind == "detected":
            self.undetected.discard(fid)
            self._detected(fid)
        elif cause.kind == "spike_start":
            self._catch_in_flight(fid)
            self._watch(fid)
        elif cause.kind == "spike_end":
            self.watches.pop(fid, None)
            self.detect_at.pop(fid, None)
            self.spike_ends.append(fid)
        elif cause.kind == "nan":
            self.nan_pending.append(fid)
        elif cause.kind == "rejoin":
            self.rejoined = True

    def _detected(self, fid: int) -> None:
        info = self.info[fid]
        dead = [self.nodes[n] for n in info.nodes if not self.nodes[n].up and self.nodes[n].slots > 0]
        if not self.absorb or self.held_slots == 0:  # no live copy of the state: restart
            self.restart_for.append(fid)
            return
        self.emit_episode("recover_start", fid)
        lost = sum(n.slots for n in dead)
        for n in dead:
            self._update(n, slots=0, role="down")
        spares = [n.name for n in self._spare_nodes(1)]
        picks = R.place_lost_slots(info.action, lost, self._as_holders(self._active()), spares,
                                   self.topology.region_names, lost_region=info.target)
        takeover = 0.0
        if spares and spares[0] in picks:
            self._update(self.nodes[spares[0]], role="train")
            takeover = self.params.spare_takeover_s
        receivers = self._give(self._counts(picks))
        assert self.held_slots + sum(self.order[i].slots for i in self.orphans) == self.slot_count, "slots lost"
        self.awaiting_recovery.append(fid)
        self.recovery_s = max(self.recovery_s, self.params.reform_s + takeover + self._transfer_s(receivers))
        self.emit_episode("reslot", fid, slots=lost, to=[f"{name}:{k}" for name, k in receivers])

    def _recover(self) -> Generator:
        done = yield from self._wait(self.recovery_s, "paused")
        self.gen_start = self.committed  # a new generation
        if done:
            for fid in self.awaiting_recovery:
                self.emit_episode("recover_end", fid)
            self.awaiting_recovery.clear()
            self.recovery_s = 0.0

    def _restart(self) -> Generator:
        fid = self.restart_for[-1]
        lost = self.committed - self.ckpt_step
        self.emit_episode("restart", fid, from_step=self.ckpt_step, lost_steps=lost)
        self.committed = self.ckpt_step
        self.ckpt_attempted = self.ckpt_step
        self.carry_s = None
        self.watches.clear()
        self.detect_at.clear()
        if self.writer is not None and self.writer.is_alive:
            self.writer.interrupt("job stopped")
        replaced = False
        for n in [self.order[i] for i in sorted(self.orphans)]:
            spares = self._spare_nodes(1)
            if spares:
                self._update(spares[0], role="train", slots=n.slots)
                self._update(n, slots=0, role="down")
            else:  # a new machine takes the dead one's place (its repair no longer matters)
                n.incarnation += 1
                self._update(n, up=True, role="train")
                replaced = True
        load_s = self._share_s(self.params.ckpt_read_gbyte_s) if self.ckpt_step > 0 else 0.0
        duration = self.params.restart_s + (self.params.replace_node_s if replaced else 0.0) + load_s
        done = yield from self._wait(duration, "paused")
        self.gen_start = self.committed
        if done:
            episodes = sorted(set(self.restart_for) | set(self.awaiting_recovery))
            for f in episodes:
                self.emit_episode("recover_end", f, from_step=self.ckpt_step)
            self.restart_for.clear()
            self.awaiting_recovery.clear()
            self.recovery_s = 0.0

    def _share_s(self, gbyte_s: float) -> float:
        """Seconds for each training node to move its share of the checkpoint."""
        holders = max(1, self._current_shape().holders)
        return self.state_bytes / holders / (gbyte_s * 1e9)

    # ------------------------------------------------------------------ straggler handling
    def _spiked_holders(self, sp: Spike) -> list[Node]:
        if "/" in sp.target:
            n = self.nodes[sp.target]
            return [n] if n.up and n.role == "train" and n.slots > 0 else []
        return [n for n in self._active() if n.region == sp.target and n.slots > 0]

    def _catch_in_flight(self, fid: int) -> None:
        """The runtime's gate delays a spiked worker's next collective at once: a step in flight
        whose target has not reached its collectives yet (still computing) is late by the delay."""
        sp = self.spikes[fid]
        if self.carry_s is None or not sp.active:
            return
        holders = self._spiked_holders(sp)
        if not holders:
            return
        hf = self._host_factor(self._holders())
        compute = max(n.slots * self.params.slot_compute_s / n.speed for n in holders) * hf
        if self.carry_elapsed_s < compute:
            delay = self._spike_delay(sp, self._active_per_region(), step=self.committed)
            if self.params.spike_tail_s is None:
                self.carry_s += delay
            else:
                self.carry_s = max(self.carry_s, compute + delay + self.params.spike_tail_s - self.carry_elapsed_s)
            sp.in_flight = True

    def _watch(self, fid: int) -> None:
        """The runtime's straggler detection: a spiked worker is slow when its per-slot time to
        reach the collective (its compute + the gate's delay, over its slots) exceeds
        straggler_factor x the median (a healthy slot's compute) and the median by
        STRAGGLER_MIN_EXCESS_S (keel.recovery.straggler_excess_s); `detect` at the first slow
        commit, the move after straggler_window slow steps; the first STRAGGLER_WARMUP_STEPS of
        a generation are not judged."""
        if not self.absorb:
            return
        sp = self.spikes[fid]
        holders = self._spiked_holders(sp)
        if not self.groups or not holders:  # nobody computing, or the target holds nothing
            return
        delay = self._spike_delay(sp, self._active_per_region())
        med = self.params.slot_compute_s * self._host_factor(self._holders())
        p = self.scenario.policy
        excess = max(delay / n.slots for n in holders)
        if delay <= 0 or excess <= R.straggler_excess_s(med, p.straggler_factor):
            return
        first = self.committed + 1 + (1 if self.carry_s is not None and not sp.in_flight else 0)
        first = max(first, self.gen_start + R.STRAGGLER_WARMUP_STEPS + 1)
        self.detect_at[fid] = first
        self.watches[fid] = first + p.straggler_window - 1

    def _detect_due(self) -> None:
        for fid in [f for f, at in self.detect_at.items() if at <= self.committed]:
            del self.detect_at[fid]
            sp = self.spikes.get(fid)
            if sp is not None and sp.active and not sp.detected:
                sp.detected = True
                self.emit_episode("detect", fid, slow_steps=1)

    def _straggler(self, fid: int) -> Generator:
        del self.watches[fid]
        sp = self.spikes[fid]
        if not sp.active:
            return
        p = self.scenario.policy
        if not sp.detected:
            sp.detected = True
            self.emit_episode("detect", fid, slow_steps=p.straggler_window)
        if "/" in sp.target:
            movers = [self.nodes[sp.target]] if self.nodes[sp.target].up and self.nodes[sp.target].slots > 0 else []
        else:
            movers = [n for n in self._active() if n.region == sp.target and n.slots > 0]
        if not movers or len(movers) == self._holders():
            return
        before = self._expected_s(self._current_shape())
        spares = self._spare_nodes(len(movers))
        plan = self._plan_moves(movers, spares)
        moving = {n.name for n in movers}
        trial_nodes = [n for n in self._active() if n.name not in moving] + spares
        trial_slots = {n.name: n.slots for n in trial_nodes}
        for _, to, k in plan:
            trial_slots[to] += k
        if self._expected_s(self._shape(nodes=trial_nodes, slots=trial_slots)) >= before:
            return  # moving would not help: endure the spike
        self.emit_episode("recover_start", fid)
        for n in movers:
            self._update(n, slots=0, role="parked")
        for _, to, k in plan:
            node = self.nodes[to]
            self._update(node, role="train", slots=node.slots + k)
        sp.moves = plan
        sp.spare_receivers = {x.name for x in spares}
        receivers = _merge([(to, k) for _, to, k in plan])
        self.emit_episode("reslot", fid, slots=sum(k for _, _, k in plan), to=[f"{n}:{k}" for n, k in receivers])
        takeover = self.params.spare_takeover_s if spares else 0.0
        yield from self._wait(self.params.reform_s + takeover + self._transfer_s(receivers), "paused")
        self.gen_start = self.committed

    def _plan_moves(self, movers: list[Node], spares: list[Node]) -> list[tuple[str, str, int]]:
        """(from, to, slots): keel.recovery.park_destinations."""
        moving = {n.name for n in movers}
        others = [n for n in self._active() if n.name not in moving]
        return R.park_destinations([(m.name, m.slots) for m in movers], self._as_holders(others),
                                   [s.name for s in spares], self.topology.region_names)

    def _end_spike(self, fid: int) -> Generator:
        sp = self.spikes.pop(fid)
        if not sp.moves:
            self.emit_episode("recover_end", fid)
            return
        back: list[tuple[str, int]] = []
        for frm, to, k in sp.moves:
            home, holder = self.nodes[frm], self.nodes[to]
            if not home.up or home.role != "parked":
                continue
            take = min(k, holder.slots) if holder.up else 0
            left = holder.slots - take
            self._update(holder, slots=left,
                         role="spare" if left == 0 and holder.up and to in sp.spare_receivers else None)
            self._update(home, slots=home.slots + take)
            back.append((frm, take))
        for frm in dict.fromkeys(frm for frm, _, _ in sp.moves):  # home again, even if robbed meanwhile
            home = self.nodes[frm]
            if home.up and home.role == "parked":
                self._update(home, role="train")
        short = self.slot_count - self.held_slots - sum(self.order[i].slots for i in self.orphans)
        if short > 0:
            back += self._place(short, self._active())
        back = [(n, k) for n, k in _merge(back) if k > 0]
        self.emit_episode("reslot", fid, back=True, to=[f"{n}:{k}" for n, k in back])
        # a returning straggler is behind: the runtime sends it the whole state, not a slot's share
        homes = {frm for frm, _, _ in sp.moves}
        copy = [(n, self.slot_count if n in homes else k) for n, k in back]
        yield from self._wait(self.params.reform_s + self._transfer_s(copy), "paused")
        self.gen_start = self.committed
        self.emit_episode("recover_end", fid)

    def _probe_wait_s(self, sp: Spike) -> float:
        """Mean time from a spike's end to the straggler_window-th good probe: a standing-by
        straggler probes its path every heartbeat (each probe waits the gate's delay while the
        spike lasts). The first good probe comes after the probe in progress, if any, and a
        heartbeat, else after what is left of the heartbeat; then one a heartbeat."""
        h, d = self.params.heartbeat_s, sp.spike_s
        first = (d * (d / 2 + h) + h * (h / 2)) / (d + h) if d + h > 0 else 0.0
        return first + (self.scenario.policy.straggler_window - 1) * h

    def _overloaded(self) -> bool:
        """Some node carries more than the healthy layout's heaviest load."""
        heaviest = max(self.groups, default=0.0) / self.params.slot_compute_s
        return heaviest > self.healthy_max_load + 1e-12

    def _rebalance(self) -> Generator:
        """A repaired node rejoined as a spare: under absorb it relieves overloaded nodes."""
        self.rejoined = False
        if not self.absorb:
            return
        moved: list[tuple[str, int]] = []
        while self.spares and self._overloaded():
            worst = max(self._active(), key=lambda n: (n.slots / n.speed, -n.index))
            if worst.slots < 2:
                break
            spare = self._spare_nodes(1)[0]
            give = worst.slots // 2
            self._update(worst, slots=worst.slots - give)
            self._update(spare, role="train", slots=give)
            moved.append((spare.name, give))
        if not moved:
            return
        self.emit("reslot", None, moved[0][0], None, reason="rejoin", to=[f"{n}:{k}" for n, k in moved])
        yield from self._wait(self.params.reform_s + self.params.spare_takeover_s + self._transfer_s(moved), "paused")
        self.gen_start = self.committed

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_due(self) -> bool:
        c = self.committed
        return (c > 0 and c % self.scenario.checkpoint.interval_steps == 0
                and c > self.ckpt_attempted and c < self.scenario.run.steps)

    def _checkpoint(self) -> Generator:
        if self.writer is not None and self.writer.is_alive:
            done = yield from self._wait(self.writer, "paused")  # the previous write first
            if not done:
                return
        step = self.committed
        mode = self.scenario.checkpoint.mode
        self.emit("checkpoint_start", mode=mode)
        if mode == "sync":
            done = yield from self._wait(self._share_s(self.params.ckpt_write_gbyte_s), "paused")
            if done:
                self.ckpt_attempted = step
                self.ckpt_step = step
                self.emit("checkpoint_end", checkpoint_step=step)
        else:
            done = yield from self._wait(self._share_s(self.params.ckpt_snapshot_gbyte_s), "paused")
            if done:
                self.ckpt_attempted = step
                self.writer = self.env.process(self._write(step, self._share_s(self.params.ckpt_write_gbyte_s)))

    def _write(self, step: int, duration: float) -> Generator:
        try:
            yield self.env.timeout(duration)
        except simpy.Interrupt:
            return
        self.ckpt_step = step
        self.emit("checkpoint_end", checkpoint_step=step)

    # ------------------------------------------------------------------ steps
    def _steps_to_boundary(self) -> int:
        c = self.committed
        s = self.scenario
        interval = s.checkpoint.interval_steps
        bounds = [s.run.steps, (c // interval + 1) * interval, c + MAX_SEGMENT_STEPS]
        bounds += [at for at in self.schedule_at if at > c and any(i not in self.schedule_fired for i in self.schedule_at[at])]
        bounds += [at for at in self.watches.values() if at > c]
        bounds += [at for at in self.detect_at.values() if at > c]
        return max(1, min(bounds) - c)

    def _segment(self, count: int) -> Generator:
        assert self.held_slots == self.slot_count and not self.orphans, "slots lost"
        durations = self._current_shape().draw(self.step_noise, count)
        if self.carry_s is not None:
            durations[0] = max(self.carry_s, 0.0)
            self.carry_s = None
        nan = bool(self.nan_pending)
        cum = np.cumsum(durations)
        seg = Segment(self.env.now, self.committed, cum, nan)
        self.segment = seg
        for index in self.schedule_at.get(self.committed, ()):
            if index not in self.schedule_fired:
                self.schedule_fired.add(index)
                self.env.process(self._fire_scheduled(index, 0.0))
        done = yield from self._wait(float(cum[-1]), "running")
        if done:
            if nan:
                self.segment = None
                self._nan_step_done()
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
        self.segment = None

    def _nan_step_done(self) -> None:
        """The step in flight came out non-finite: it is not committed."""
        fids, self.nan_pending = self.nan_pending, []
        for fid in fids:
            info = self.info[fid]
            self.emit_episode("detect", fid, non_finite_step=self.committed + 1)
            if info.action == R.FAIL_ACTION:
                self.failure = (f"step {self.committed + 1}: {info.target} yields non-finite values "
                                "and policy.quarantine is false")
                continue
            self.quarantined.add(info.target)
            self.emit_episode("quarantine", fid, shard=info.target)
            if info.action == R.ABSORB_ACTION["data_shard_skew"]:
                self.emit_episode("recover_end", fid)
            else:  # checkpoint_restart: the shard is quarantined, then the job restarts
                self.restart_for.append(fid)


def _count(counter: Counter, key: Any, sign: int) -> None:
    counter[key] += sign
    if counter[key] == 0:
        del counter[key]


def _merge(pairs: list[tuple[str, int]]) -> list[tuple[str, int]]:
    out: dict[str, int] = {}
    for name, k in pairs:
        out[name] = out.get(name, 0) + k
    return list(out.items())
