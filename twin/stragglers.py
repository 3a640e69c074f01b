"""A latency spike's straggler under absorb: judged, parked on a spare or faster nodes, and
back once its probes are good (a repaired node rejoining as a spare: twin/rejoin.py).

The watch predicts the runtime's step by step, with its function (keel.recovery.judge_step)
on the times the scenario's draws make (`keel.scenario.compute_factor`, `spike_factor`: pure
functions of the run's seed, the node and the step). A spike delays the gate of every step that
starts while it lasts (and of the step in flight at its start, where that has not reached its
gate): the step in flight at its end is judged at its commit, after the spike. The first member
slow `straggler_window` steps in a row is parked, one node at a time; judging starts over in
the new generation. A park after its spike's episode ended is a re-slot of no fault, as in the
runtime. The generators run inside the trainer process (twin/model.py), through its `wait`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generator

from keel import recovery as R
from keel.events import Event
from keel.scenario import compute_factor, compute_factor_range, spike_factor
from twin.cluster import Spike, merge
from twin.faults import Cause

if TYPE_CHECKING:
    from twin.model import Simulation

# The watch predicts this many steps ahead at a time; a spike that lasts longer is looked at
# again from there (a segment bound), so a long spike on short steps costs no more per look.
LOOKAHEAD_STEPS = 256
# Up to this many members the watch draws every member's compute for the median pace, as the
# runtime measures it (Stragglers._judge); beyond, the nominal pace.
EXACT_MEDIAN_MEMBERS = 64


@dataclass
class Gating:
    """The steps whose communication gate a spike delays: `first` to `last` (1-based step
    numbers; `last` None while the spike lasts)."""
    spike: Spike
    first: int
    last: int | None = None

    def gates(self, step: int) -> bool:
        return self.first <= step and (self.last is None or step <= self.last)


@dataclass
class Park:
    """A parked straggler: its slots' moves (from, to, slots), the spares among the receivers,
    and the spike episode it belongs to (None: a re-slot of no fault)."""
    node: str
    fid: int | None
    moves: list[tuple[str, str, int]]
    spare_receivers: set[str] = field(default_factory=set)


class Stragglers:
    """The straggler watch's prediction, the parked stragglers, and the re-slots they lead to."""

    def __init__(self, sim: Simulation):
        self.sim = sim
        self.cluster = sim.cluster
        self.cost = sim.cost
        self.params = sim.params
        self.policy = sim.scenario.policy
        self.seed = sim.scenario.run.seed
        self.gating: dict[int, Gating] = {}     # fault id -> the steps its spike delays
        self.slow: dict[str, int] = {}          # slow steps in a row per member, through step `judged`
        self.judged = R.first_judged_step(0) - 1
        self.park: tuple[int, str, int | None] | None = None  # the next park: (step, node, fault id)
        self.fine: dict[int, int] = {}          # fault id -> fine steps in a row of a detected, unparked spike
        self.detect_at: dict[int, int] = {}     # fault id -> the step whose commit detects it
        self.end_at: dict[int, int] = {}        # fault id -> the step whose commit ends it (keel.recovery.spike_settled)
        self.look_until: int | None = None      # predicted through this step: look again there
        self.parks: list[Park] = []             # stragglers standing by
        self.returning: list[Park] = []         # ... whose probes are good: back at the next chance
        self.ends_at_commit: list[int] = []     # spikes over that made no straggler: closed at the next commit
        self.drawn: dict[tuple, tuple] = {}     # (step, layout, gates) -> each member's time per slot, speeds, median

    # ------------------------------------------------------------------ what the trainer asks
    def spike_started(self, fid: int) -> None:
        sim = self.sim
        self._catch_in_flight(fid)
        sp = self.cluster.spikes[fid]
        in_flight = sim.carry_s is not None
        self.gating[fid] = Gating(sp, sim.committed + 1 + (1 if in_flight and not sp.in_flight else 0))
        self.predict()

    def spike_ended(self, fid: int) -> None:
        """The spike is over: the step in flight (it started with the spike on) is the last it
        delays, and is still judged at its commit."""
        sim = self.sim
        self.gating[fid].last = sim.committed + (1 if sim.carry_s is not None else 0)
        self.predict()
        sp = self.cluster.spikes[fid]
        if sp.closed:  # its episode is over already (spike_settled)
            self.cluster.spikes.pop(fid)
        elif not sp.detected and not self._parking(fid):
            # it never made a straggler: its episode ends just before the first commit after the
            # spike, as the runtime's does (runtime/coordinator/episodes.py), not after the step
            # in flight, which put one more step into its cost (sweep member 7/4: +93 %)
            sp.closed = True
            self.cluster.spikes.pop(fid)
            self.ends_at_commit.append(fid)
        # else the episode ends with its last straggler's return, or once its nodes are fine
        # for a window of steps (predicted: end_at)

    def _parking(self, fid: int) -> bool:
        """A straggler of this spike is parked or about to be."""
        return any(p.fid == fid for p in self.parks) or (self.park is not None and self.park[2] == fid)

    def flush_ends(self, t: float, before: int) -> None:
        """The `recover_end` of each spike in ends_at_commit, just before the commit at `t`
        (`before`: the steps committed until then), as the runtime writes it."""
        for fid in self.ends_at_commit:
            info = self.sim.faults.info[fid]
            self.sim.events.append(Event(round(t, 6), before, "recover_end", info.fault, info.target, info.action,
                                         {"fault_id": fid}))
        self.ends_at_commit.clear()

    def due(self) -> bool:
        """The next park's step is committed."""
        return self.park is not None and self.park[0] <= self.sim.committed

    def bounds(self, committed: int) -> list[int]:
        """Steps after `committed` at which a detection, an episode's end, a park or a new look is due."""
        out = [at for at in [*self.detect_at.values(), *self.end_at.values()] if at > committed]
        if self.park is not None and self.park[0] > committed:
            out.append(self.park[0])
        if self.look_until is not None and self.look_until > committed:
            out.append(self.look_until)
        return out

    def catch_up(self) -> None:
        """At each of the trainer's turns: `detect` what is due, and predict on from here where
        the prediction's horizon is reached."""
        if self.detect_at or self.end_at:
            self._episodes_due()
        if self.look_until is not None and self.sim.committed >= self.look_until:
            self.predict()

    def new_generation(self) -> None:
        """The runtime starts each member's count again and skips the generation's first
        steps (keel.recovery.first_judged_step)."""
        self.slow = {}
        self.judged = R.first_judged_step(self.sim.gen_start) - 1
        self.predict()

    def clear(self) -> None:
        """The job stopped (a restart from a checkpoint): the steps after it are done again,
        and a spike still on delays each of them from the first."""
        first = self.sim.committed + 1
        self.gating = {f: Gating(g.spike, first) for f, g in self.gating.items() if g.spike.active}
        self.park = None
        self.detect_at.clear()
        self.end_at.clear()
        self.look_until = None

    # ------------------------------------------------------------------ the prediction
    def _judge(self, step: int, slow: dict[str, int], spiked: dict[int, list[str]]) -> list[R.Verdict]:
        """keel.recovery.judge_step on step `step` (1-based) as the scenario's draws make it:
        each member's compute and its gate's delay (spike_s x the runtime's own draw for that
        node and step), over its slots; `spiked`: fault id -> the members its spike covers. Over
        EXACT_MEDIAN_MEMBERS members only the spiked ones are drawn (the compute alone is never
        slow), against the nominal pace: their median is within ~compute_jitter / sqrt(members)."""
        gates: dict[str, float] = {}
        for fid, names in spiked.items():
            g = self.gating[fid]
            if g.gates(step):
                for name in names:
                    gates[name] = g.spike.spike_s * spike_factor(self.seed, name, step - 1)
        if not gates:  # no gate delayed: nobody is slow (the compute's jitter alone never is)
            slow.clear()
            return []
        members = [n for n in self.cluster.active() if n.slots > 0]
        if len(members) < 2:
            return []
        jitter, base = self.params.compute_jitter, self.params.slot_compute_s
        lo = compute_factor_range(jitter)[0]
        exact = len(members) <= EXACT_MEDIAN_MEMBERS
        key = (step, self.cluster.layout_version, tuple(sorted(gates.items())))
        if key not in self.drawn:  # the same step is judged again as it commits, and by each new look
            def per_slot(n) -> float:
                factor = compute_factor(self.seed, n.name, step - 1, jitter)
                return (n.slots * base / n.speed * factor + gates.get(n.name, 0.0)) / n.slots
            spiked_per = {n.name: per_slot(n) for n in members if n.name in gates}
            # slow at no draw of the others: no median can be under their compute's least
            if not any(R.is_straggler(spiked_per[n.name], R.own_pace_s(base * lo, n.speed), self.policy.straggler_factor)
                       for n in members if n.name in gates):
                self.drawn[key] = None
            else:
                per = {n.name: spiked_per[n.name] if n.name in gates else per_slot(n)
                       for n in members if exact or n.name in gates}
                speeds = {n.name: n.speed for n in members if n.name in per}
                self.drawn[key] = per, speeds, R.median_pace_s(per, speeds) if exact else base
        if self.drawn[key] is None:
            slow.clear()
            return []
        per, speeds, median = self.drawn[key]
        if not exact:
            for name in [m for m in slow if m not in per]:
                del slow[name]
        return R.judge_step(per, speeds, slow, self.policy.straggler_factor, self.policy.straggler_window,
                            self.sim.absorb, median)

    def _open(self, fid: int, step: int, detected: set[int], closed: set[int]) -> bool:
        """Whether a spike's episode is open at the commit of `step`: one that never made a
        straggler closed just before the first commit after its end."""
        g = self.gating[fid]
        if g.spike.closed or fid in closed:
            return False
        return g.last is None or step < g.last or g.spike.detected or fid in detected or self._parking(fid)

    def _episode(self, node: str, step: int, detected: set[int], closed: set[int]) -> int | None:
        """The open spike episode a judged `node` at `step` belongs to (the runtime's
        `jitter_on`): the latest spike covering it whose episode is open at that commit."""
        return next((f for f in sorted(self.gating, reverse=True)
                     if self.gating[f].spike.covers(node) and self._open(f, step, detected, closed)), None)

    def _step(self, k: int, slow: dict[str, int], fine: dict[int, int], spiked: dict[int, list[str]],
              detected: set[int], closed: set[int]) -> tuple[tuple[int, str, int | None] | None, list[int], list[int]]:
        """Step `k` judged at its commit, as the runtime's watch (runtime/coordinator/faults.py
        `watch_stragglers`): the park it makes, if any, the spikes it detects and the episodes
        it ends (a detected spike that parked no one, once its nodes are fine for a window)."""
        verdicts = self._judge(k, slow, spiked)
        any_slow: dict[int, bool] = {}
        detects: list[int] = []
        if not verdicts:  # no gate delayed: every member fine
            any_slow = {f: False for f, names in spiked.items() if names and self._open(f, k, detected, closed)}
        covered = {name for names in spiked.values() for name in names}
        for v in verdicts:
            fid = self._episode(v.node, k, detected, closed) if v.node in covered else None
            if fid is not None:
                any_slow[fid] = any_slow.get(fid, False) or v.slow
                if v.slow and fid not in detected and not self.gating[fid].spike.detected:
                    detected.add(fid)
                    detects.append(fid)
            if v.park:
                return (k, v.node, fid), detects, []
        ends = []
        for fid, hit in any_slow.items():
            if (self.gating[fid].spike.detected or fid in detected) and not self._parking(fid):
                fine[fid], over = R.spike_settled(fine.get(fid, 0), hit, self.policy.straggler_window)
                if over:
                    closed.add(fid)
                    ends.append(fid)
        return None, detects, ends

    def predict(self) -> None:
        """From the committed steps (folded into the members' and the spikes' counts) on: the
        next park, each spike's detection and end, up to LOOKAHEAD_STEPS ahead or a window past
        the last step a spike can delay (an active one: as many steps as fit in what is left
        of it at the healthy pace)."""
        sim = self.sim
        committed = sim.committed
        spiked = {f: [n.name for n in self.cluster.spiked_holders(g.spike)] for f, g in self.gating.items()}
        k = self.judged + 1
        while k <= committed:  # the committed steps, into the counts; a stretch no spike delays at once
            if any(g.gates(k) for g in self.gating.values()):
                self._step(k, self.slow, self.fine, spiked, set(), set())
                k += 1
                continue
            upto = min([g.first for g in self.gating.values() if g.first > k] + [committed + 1])
            self.slow.clear()  # nobody slow: each open, detected spike that parked no one had so many fine steps
            for f, names in spiked.items():
                if names and self._open(f, upto - 1, set(), set()) and not self._parking(f):
                    self.fine[f] = self.fine.get(f, 0) + upto - k
            k = upto
        self.judged = max(self.judged, committed)
        self.drawn = {key: v for key, v in self.drawn.items() if key[0] > committed}
        self.gating = {f: g for f, g in self.gating.items() if g.last is None or g.last > committed or (
            not g.spike.closed and (g.spike.detected or self._parking(f)))}
        spiked = {f: spiked[f] for f in self.gating}
        self.park, self.detect_at, self.end_at, self.look_until = None, {}, {}, None
        if not self.gating:
            return
        end = committed
        for g in self.gating.values():
            if g.last is not None:
                end = max(end, g.last)
            else:
                left = max(0.0, g.spike.ends_at - sim.env.now)
                end = max(end, committed + 2 + math.ceil(left / sim.healthy_step_s))
        end += self.policy.straggler_window  # a detected spike's fine steps after it
        stop = min(end, committed + LOOKAHEAD_STEPS)
        if stop < end:
            self.look_until = stop
        slow, fine = dict(self.slow), dict(self.fine)
        detected: set[int] = set()
        closed: set[int] = set()
        for k in range(max(committed, self.judged) + 1, stop + 1):
            park, detects, ends = self._step(k, slow, fine, spiked, detected, closed)
            for fid in detects:
                self.detect_at[fid] = k
            for fid in ends:
                self.end_at[fid] = k
            if park is not None:
                self.park = park
                return

    def _episodes_due(self) -> None:
        """`detect` every spike whose first slow step is committed; `recover_end` every detected
        spike that parked no one whose window of fine steps is (after that commit, as the
        runtime's watch ends it)."""
        sim, c = self.sim, self.cluster
        for fid in [f for f, at in self.detect_at.items() if at <= sim.committed]:
            del self.detect_at[fid]
            sp = c.spikes.get(fid)
            if sp is not None and not sp.detected:
                sp.detected = True
                self.fine[fid] = 0
                sim.emit_episode("detect", fid, slow_steps=1)
        for fid in [f for f, at in self.end_at.items() if at <= sim.committed]:
            del self.end_at[fid]
            sp = c.spikes.get(fid)
            if sp is not None and not sp.closed:
                sp.closed = True
                if not sp.active:
                    c.spikes.pop(fid)
                sim.emit_episode("recover_end", fid)

    # ------------------------------------------------------------------ a spike starts
    def _catch_in_flight(self, fid: int) -> None:
        """The runtime's gate delays a spiked worker's next collective at once: a step in flight
        whose target has not reached its collectives yet (still computing) is late by the delay."""
        sim = self.sim
        sp = self.cluster.spikes[fid]
        if sim.carry_s is None or not sp.active:
            return
        holders = self.cluster.spiked_holders(sp)
        if not holders:
            return
        compute = max(n.slots * self.params.slot_compute_s / n.speed for n in holders)
        if sim.carry_elapsed_s < compute:
            sim.carry_s += self.cost.spike_delay(sp, self.cluster.active_per_region(), step=sim.committed)
            sp.in_flight = True

    # ------------------------------------------------------------------ parking and back
    def _emit(self, kind: str, fid: int | None, node: str, **detail) -> None:
        if fid is not None:
            self.sim.emit_episode(kind, fid, **detail)
        else:  # after its spike's episode ended: a re-slot of no fault, as the runtime logs it
            self.sim.emit(kind, None, node, self.sim.faults.action("network_jitter"), reason="straggler", **detail)

    def straggler(self) -> Generator:
        """The judged straggler's slots go to a spare or the faster members; the step in flight
        (it had started) is drained and redone with the new slots."""
        sim, c = self.sim, self.cluster
        _, name, fid = self.park
        self.park = None
        node = c.nodes[name]
        if not node.up or node.slots == 0 or c.holders() < 2:
            self.predict()
            return
        # the runtime judges at this commit and aborts at once; the next step had started with
        # it, so the holders finish its compute before they see the abort (StepCost.drain_s)
        inflight = (sim.env.now, self.cost.compute_by_node())
        if fid is not None and not any(p.fid == fid for p in self.parks):
            sim.emit_episode("recover_start", fid)
        spares = c.spare_nodes(1)
        others = [n for n in c.active() if n.name != name and n.slots > 0]
        plan = R.park_destinations([(name, node.slots)], c.as_holders(others), [s.name for s in spares],
                                   self.cost.topology.region_names)
        c.update(node, slots=0, role="parked")
        for _, to, k in plan:
            receiver = c.nodes[to]
            c.update(receiver, role="train", slots=receiver.slots + k)
        receivers = merge([(to, k) for _, to, k in plan])
        park = Park(name, fid, plan, {x.name for x in spares} & {to for to, _ in receivers})
        self.parks.append(park)
        self._emit("reslot", fid, name, parked=name, slots=sum(k for _, _, k in plan),
                   to=[f"{n}:{k}" for n, k in receivers])
        sim.env.process(self._probes(park))
        takeover = self.params.spare_takeover_s if park.spare_receivers else 0.0
        behind = [(n, k) for n, k in receivers if n in park.spare_receivers]  # members hold the state
        yield from sim.wait(self.cost.reformed_s(inflight, sim.env.now, self.params.reform_s + takeover)
                            + self.cost.transfer_s(behind), "paused")
        sim.new_generation()

    def _probes(self, park: Park) -> Generator:
        """A parked straggler probes its path every heartbeat and comes back after
        straggler_window good probes in a row: none is good while a spike covers it, and one
        that starts meanwhile makes them start over once it is over (StepCost.probe_wait_s)."""
        env, c = self.sim.env, self.cluster
        last_s = 0.0  # the spike over when the probes start: none is in progress
        while True:
            while (on := next((o for o in c.spikes.values() if o.active and o.covers(park.node)), None)) is not None:
                yield on.over
                last_s = on.spike_s
            since = env.now
            yield env.timeout(self.cost.probe_wait_s(last_s))
            struck = [o for t, o in c.spike_starts if t > since and o.covers(park.node)]
            if not struck:
                break
            last_s = struck[-1].spike_s
        self.returning.append(park)
        self.sim.notify(Cause("probes_good", park.fid, interrupts_run=True))

    def moving_back(self) -> Park | None:
        """A parked straggler whose probes are good: the runtime aborts the generation when they
        say so, mid-step, so the trainer takes it before the step in flight ends."""
        return self.returning[0] if self.returning else None

    def move_back(self, park: Park) -> Generator:
        """Its slots go home (what their receivers still hold); the generation is aborted: the
        step in flight is lost (its holders finish their compute first, StepCost.drain_s) and
        redone. The spike's episode ends with its last straggler's return."""
        sim, c = self.sim, self.cluster
        self.returning.remove(park)
        self.parks.remove(park)
        inflight = sim.inflight if sim.carry_s is not None else None  # its start, its holders' compute
        sim.carry_s = None  # the step in flight is lost
        back: list[tuple[str, int]] = []
        home = c.nodes[park.node]
        for _, to, k in park.moves:
            holder = c.nodes[to]
            if not home.up or home.role != "parked":
                continue
            take = min(k, holder.slots) if holder.up else 0
            left = holder.slots - take
            c.update(holder, slots=left,
                     role="spare" if left == 0 and holder.up and to in park.spare_receivers else None)
            c.update(home, slots=home.slots + take)
            back.append((park.node, take))
        if home.up and home.role == "parked":  # home again, even if robbed meanwhile
            c.update(home, role="train")
        short = c.slot_count - c.held_slots - c.orphaned_slots()
        if short > 0:
            back += c.place(short, c.active())
        back = [(n, k) for n, k in merge(back) if k > 0]
        self._emit("reslot", park.fid, park.node, back=True, to=[f"{n}:{k}" for n, k in back])
        # a returning straggler is behind: the runtime sends it the whole state, not a slot's share
        # (and nothing to the members that take slots: they hold it)
        copy = [(n, c.slot_count) for n, _ in back if n == park.node]
        yield from sim.wait(self.cost.reformed_s(inflight, sim.env.now, self.params.reform_s)
                            + self.cost.transfer_s(copy), "paused")
        sim.new_generation()
        fid = park.fid
        if fid is not None and fid in c.spikes and not c.spikes[fid].active and not self._parking(fid):
            c.spikes.pop(fid).closed = True
            sim.emit_episode("recover_end", fid)
