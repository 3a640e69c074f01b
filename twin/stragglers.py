"""Re-slotting under absorb that no node death forces: a latency spike's straggler detected,
its slots parked on faster nodes and brought back when the spike ends, and a repaired node
that rejoins as a spare relieving overloaded nodes.

The straggler rule's constants and test are keel.recovery's (`straggler_excess_s`,
`STRAGGLER_WARMUP_STEPS`), and so is where parked slots go (`park_destinations`); this module
only times them in the twin. The generators run inside the trainer process (twin/model.py),
through its `wait`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Generator

from keel import recovery as R
from keel.events import Event
from keel.scenario import is_node
from twin.cluster import Node, merge

if TYPE_CHECKING:
    from twin.model import Simulation


class Stragglers:
    """The spikes being watched for a straggler, and the re-slots they lead to."""

    def __init__(self, sim: Simulation):
        self.sim = sim
        self.cluster = sim.cluster
        self.cost = sim.cost
        self.params = sim.params
        self.policy = sim.scenario.policy
        self.watches: dict[int, int] = {}     # fault id -> committed steps at which its slots move
        self.detect_at: dict[int, int] = {}   # fault id -> committed steps at which it is detected
        self.spike_ends: list[int] = []       # spikes over, their episode still to close
        self.ends_at_commit: list[int] = []   # spikes over that made no straggler: closed at the next commit

    # ------------------------------------------------------------------ what the trainer asks
    def spike_started(self, fid: int) -> None:
        self._catch_in_flight(fid)
        self._watch(fid)

    def spike_ended(self, fid: int) -> None:
        self.watches.pop(fid, None)
        self.detect_at.pop(fid, None)
        sp = self.cluster.spikes[fid]
        if not sp.detected and not sp.moves:
            # it never made a straggler: its episode ends just before the first commit after the
            # spike, as the runtime's does (runtime/coordinator/episodes.py), not after the step
            # in flight, which put one more step into its cost (sweep member 7/4: +93 %)
            self.cluster.spikes.pop(fid)
            self.ends_at_commit.append(fid)
            return
        self.spike_ends.append(fid)

    def flush_ends(self, t: float, before: int) -> None:
        """The `recover_end` of each spike in ends_at_commit, just before the commit at `t`
        (`before`: the steps committed until then), as the runtime writes it."""
        for fid in self.ends_at_commit:
            info = self.sim.faults.info[fid]
            self.sim.events.append(Event(round(t, 6), before, "recover_end", info.fault, info.target, info.action,
                                         {"fault_id": fid}))
        self.ends_at_commit.clear()

    def due(self) -> list[int]:
        """Watched spikes whose straggler_window of slow steps is complete."""
        return [f for f, at in self.watches.items() if at <= self.sim.committed]

    def bounds(self, committed: int) -> list[int]:
        """Steps after `committed` at which a detection or a move is due."""
        return ([at for at in self.watches.values() if at > committed]
                + [at for at in self.detect_at.values() if at > committed])

    def clear(self) -> None:
        """The job stopped (a restart): nothing is watched any more."""
        self.watches.clear()
        self.detect_at.clear()

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

    def _watch(self, fid: int) -> None:
        """The runtime's straggler detection: a spiked worker is slow when its per-slot time to
        reach the collective (its compute + the gate's delay, over its slots) exceeds
        straggler_factor x its own pace (a healthy slot's compute on it: keel.recovery.own_pace_s
        of the nominal slot's) and that pace by STRAGGLER_MIN_EXCESS_S
        (keel.recovery.straggler_excess_s); `detect` at the first slow commit, the move after
        straggler_window slow steps; the first STRAGGLER_WARMUP_STEPS of a generation are not
        judged."""
        sim = self.sim
        if not sim.absorb:
            return
        sp = self.cluster.spikes[fid]
        holders = self.cluster.spiked_holders(sp)
        if not self.cluster.groups or not holders:  # nobody computing, or the target holds nothing
            return
        # the runtime measures the time to reach the collective: the compute plus the gate's
        # own delay (the spike), not what the spike then costs the collective
        delay = sp.spike_s
        p = self.policy
        def slow(n: Node) -> bool:
            pace = R.own_pace_s(self.params.slot_compute_s, n.speed)
            return delay / n.slots > R.straggler_excess_s(pace, p.straggler_factor)
        if delay <= 0 or not any(slow(n) for n in holders):
            return
        first = sim.committed + 1 + (1 if sim.carry_s is not None and not sp.in_flight else 0)
        first = max(first, R.first_judged_step(sim.gen_start))
        self.detect_at[fid] = first
        self.watches[fid] = R.window_end_step(first, p.straggler_window)

    def detect_due(self) -> None:
        """`detect` every watched spike whose first slow step is committed."""
        for fid in [f for f, at in self.detect_at.items() if at <= self.sim.committed]:
            del self.detect_at[fid]
            sp = self.cluster.spikes.get(fid)
            if sp is not None and sp.active and not sp.detected:
                sp.detected = True
                self.sim.emit_episode("detect", fid, slow_steps=1)

    # ------------------------------------------------------------------ parking and back
    def straggler(self, fid: int) -> Generator:
        """straggler_window slow steps: park the target's slots if that makes steps faster."""
        sim, c = self.sim, self.cluster
        del self.watches[fid]
        sp = c.spikes[fid]
        if not sp.active:
            return
        if not sp.detected:
            sp.detected = True
            sim.emit_episode("detect", fid, slow_steps=self.policy.straggler_window)
        if is_node(sp.target):
            movers = [c.nodes[sp.target]] if c.nodes[sp.target].up and c.nodes[sp.target].slots > 0 else []
        else:
            movers = [n for n in c.active() if n.region == sp.target and n.slots > 0]
        if not movers or len(movers) == c.holders():
            return
        before = self.cost.expected_s(self.cost.current_shape())
        spares = c.spare_nodes(len(movers))
        plan = self._plan_moves(movers, spares)
        moving = {n.name for n in movers}
        trial_nodes = [n for n in c.active() if n.name not in moving] + spares
        trial_slots = {n.name: n.slots for n in trial_nodes}
        for _, to, k in plan:
            trial_slots[to] += k
        if self.cost.expected_s(self.cost.shape(nodes=trial_nodes, slots=trial_slots)) >= before:
            return  # moving would not help: endure the spike
        # the runtime judges at this commit and aborts at once; the next step had started with
        # it, so the holders finish its compute before they see the abort (StepCost.drain_s),
        # and it is redone with the new slots
        inflight = (sim.env.now, self.cost.compute_by_node())
        sim.emit_episode("recover_start", fid)
        for n in movers:
            c.update(n, slots=0, role="parked")
        for _, to, k in plan:
            node = c.nodes[to]
            c.update(node, role="train", slots=node.slots + k)
        sp.moves = plan
        sp.spare_receivers = {x.name for x in spares}
        receivers = merge([(to, k) for _, to, k in plan])
        sim.emit_episode("reslot", fid, slots=sum(k for _, _, k in plan), to=[f"{n}:{k}" for n, k in receivers])
        takeover = self.params.spare_takeover_s if spares else 0.0
        formed = self.params.reform_s + takeover
        behind = [(n, k) for n, k in receivers if n in sp.spare_receivers]  # members hold the state
        yield from sim.wait(self.cost.reformed_s(inflight, sim.env.now, formed) + self.cost.transfer_s(behind),
                            "paused")
        sim.new_generation()

    def _plan_moves(self, movers: list[Node], spares: list[Node]) -> list[tuple[str, str, int]]:
        """(from, to, slots): keel.recovery.park_destinations."""
        moving = {n.name for n in movers}
        others = [n for n in self.cluster.active() if n.name not in moving]
        return R.park_destinations([(m.name, m.slots) for m in movers], self.cluster.as_holders(others),
                                   [s.name for s in spares], self.cost.topology.region_names)

    def moving_back(self) -> int | None:
        """A spike over whose parked slots go home: the runtime aborts the generation when the
        probes say so, mid-step, so the trainer takes it before the step in flight ends."""
        return next((f for f in self.spike_ends if self.cluster.spikes[f].moves), None)

    def end_spike(self, fid: int) -> Generator:
        """The spike is over: parked slots go home (what their receivers still hold), and the
        episode ends. Where slots move, the generation is aborted: the step in flight is lost
        (its holders finish their compute first, StepCost.drain_s) and redone."""
        sim, c = self.sim, self.cluster
        self.spike_ends.remove(fid)
        sp = c.spikes.pop(fid)
        if not sp.moves:
            sim.emit_episode("recover_end", fid)
            return
        inflight = sim.inflight if sim.carry_s is not None else None  # its start, its holders' compute
        sim.carry_s = None  # the step in flight is lost
        back: list[tuple[str, int]] = []
        for frm, to, k in sp.moves:
            home, holder = c.nodes[frm], c.nodes[to]
            if not home.up or home.role != "parked":
                continue
            take = min(k, holder.slots) if holder.up else 0
            left = holder.slots - take
            c.update(holder, slots=left,
                     role="spare" if left == 0 and holder.up and to in sp.spare_receivers else None)
            c.update(home, slots=home.slots + take)
            back.append((frm, take))
        for frm in dict.fromkeys(frm for frm, _, _ in sp.moves):  # home again, even if robbed meanwhile
            home = c.nodes[frm]
            if home.up and home.role == "parked":
                c.update(home, role="train")
        short = c.slot_count - c.held_slots - c.orphaned_slots()
        if short > 0:
            back += c.place(short, c.active())
        back = [(n, k) for n, k in merge(back) if k > 0]
        sim.emit_episode("reslot", fid, back=True, to=[f"{n}:{k}" for n, k in back])
        # a returning straggler is behind: the runtime sends it the whole state, not a slot's share
        # (and nothing to the members that take slots: they hold it)
        homes = {frm for frm, _, _ in sp.moves}
        copy = [(n, c.slot_count) for n, _ in back if n in homes]
        formed = self.params.reform_s
        yield from sim.wait(self.cost.reformed_s(inflight, sim.env.now, formed) + self.cost.transfer_s(copy),
                            "paused")
        sim.new_generation()
        sim.emit_episode("recover_end", fid)

    # ------------------------------------------------------------------ a spare rejoins
    def rebalance(self) -> Generator:
        """A repaired node rejoined as a spare: under absorb it relieves overloaded nodes."""
        sim, c = self.sim, self.cluster
        sim.rejoined = False
        if not sim.absorb:
            return
        moved: list[tuple[str, int]] = []
        while c.spares and c.overloaded():
            worst = max(c.active(), key=lambda n: (n.slots / n.speed, -n.index))
            if worst.slots < 2:
                break
            spare = c.spare_nodes(1)[0]
            give = worst.slots // 2
            c.update(worst, slots=worst.slots - give)
            c.update(spare, role="train", slots=give)
            moved.append((spare.name, give))
        if not moved:
            return
        sim.emit("reslot", None, moved[0][0], None, reason="rejoin", to=[f"{n}:{k}" for n, k in moved])
        yield from sim.wait(self.params.reform_s + self.params.spare_takeover_s + self.cost.transfer_s(moved), "paused")
        sim.new_generation()
