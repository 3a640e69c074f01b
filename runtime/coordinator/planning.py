"""Membership and slot planning: what the next generation is, as a pure function of what the
coordinator knows when the current one ends (`View`), so it is tested without processes.

The placement rules themselves are keel.recovery's (the twin predicts with the same ones);
this module applies them to the runtime's slot ids: a recovered straggler takes back the slots
it held, a straggler's slots are parked elsewhere, a lost worker's go to a spare or spread by
capacity. Slot ids never change what a step computes (the reduction is over slots, in a fixed
order), so which ids move where is bookkeeping; how many go where is the decision.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from keel import recovery as R
from keel.scenario import region_of


@dataclass(frozen=True)
class WorkerView:
    """One worker as the planner needs it."""
    alive: bool = True
    joined: bool = True
    committed: int = 0
    parked: tuple[int, ...] | None = None  # the slots it held before it was parked as a straggler
    per_slot_s: float | None = None        # its measured seconds per slot (smoothed)


@dataclass(frozen=True)
class Loss:
    """The episode that took a lost worker: its fault_id, action and target."""
    fault_id: int | None
    action: str
    target: str | None


@dataclass(frozen=True)
class View:
    nodes: tuple[str, ...]                        # every node, in scenario order
    region_speed: Mapping[str, float]             # region name -> speed, in scenario order
    slot_map: Mapping[str, tuple[int, ...]]       # the ending generation's
    workers: Mapping[str, WorkerView]
    committed: int                                # steps committed
    to_park: Mapping[str, int | None] = field(default_factory=dict)    # straggler -> fault_id
    to_unpark: Mapping[str, int | None] = field(default_factory=dict)  # recovered straggler -> fault_id
    losses: Mapping[str, Loss] = field(default_factory=dict)           # lost member -> its episode

    def region_of(self, node: str) -> str:
        return region_of(node)

    @property
    def order(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.nodes)}


@dataclass
class Plan:
    slot_map: dict[str, list[int]]
    start: int                                     # the step the new generation starts from
    moves: dict[int | None, list[tuple[int, str | None, str]]] = field(default_factory=dict)
    parked: dict[str, list[int]] = field(default_factory=dict)   # newly parked straggler -> its slots
    unparked: list[str] = field(default_factory=list)            # stragglers back in
    failure: str | None = None


class _Planner:
    def __init__(self, view: View):
        self.v = view
        self.order = view.order
        self.regions = list(view.region_speed)
        self.parked = {n: w.parked for n, w in view.workers.items()}

    def holders(self, slot_map: Mapping[str, list[int]], empty: bool = False,
                measured: bool = False) -> list[R.Holder]:
        def speed(m: str) -> float:
            if measured:
                return 1.0 / (self.v.workers[m].per_slot_s or 1.0)
            return self.v.region_speed[self.v.region_of(m)]
        return [R.Holder(m, self.v.region_of(m), speed(m), 0 if empty else len(slot_map[m]), self.order[m])
                for m in sorted(slot_map, key=self.order.get)]

    def free_spare(self, slot_map: Mapping[str, list[int]]) -> str | None:
        """The first live, joined node that holds no slots and is not a parked straggler."""
        for n in self.v.nodes:
            w = self.v.workers.get(n)
            if w and w.alive and w.joined and n not in slot_map and self.parked.get(n) is None:
                return n
        return None


def initial_slot_map(view: View, training: int, slots: int) -> dict[str, list[int]]:
    """The first generation: the slots over the live training nodes (spares fill in for
    training nodes already gone), by keel.recovery.fastest_finish."""
    alive = {n for n, w in view.workers.items() if w.alive}
    live = [n for n in view.nodes[:training] if n in alive]
    spares = [n for n in view.nodes[training:] if n in alive]
    if len(live) < training:
        live += spares[: training - len(live)]
    live.sort(key=view.order.get)
    slot_map: dict[str, list[int]] = {n: [] for n in live}
    planner = _Planner(view)
    for s, n in enumerate(R.fastest_finish(slots, planner.holders(slot_map, empty=True))):
        slot_map[n].append(s)
    return {n: v for n, v in slot_map.items() if v}


def plan_generation(view: View) -> Plan:
    """The next generation's slot map, the slots each episode moved, and the step it starts
    from (the most any live holder committed); or why there is none."""
    p = _Planner(view)
    w = view.workers
    old = {m: list(s) for m, s in view.slot_map.items()}
    slot_map = {m: list(s) for m, s in old.items() if w[m].alive}
    plan = Plan(slot_map={}, start=view.committed)

    def record(fid, slot, src, dst):
        plan.moves.setdefault(fid, []).append((slot, src, dst))

    for node, fid in view.to_unpark.items():  # a recovered straggler takes back the slots it held
        slots = p.parked.get(node)
        if not w[node].alive or slots is None:
            continue
        for slot in slots:
            holder = next((m for m, s in old.items() if slot in s), None)  # perhaps lost just now
            if holder in slot_map:
                slot_map[holder].remove(slot)
            record(fid, slot, holder, node)
        slot_map[node] = sorted(slots)
        p.parked[node] = None
        plan.unparked.append(node)
    for node, fid in view.to_park.items():  # a straggler's slots go to a spare or the faster workers
        if node not in slot_map or len(slot_map) < 2:
            continue
        slots = slot_map.pop(node)
        p.parked[node] = tuple(slots)
        plan.parked[node] = list(slots)
        spare = p.free_spare(slot_map)
        it = iter(slots)
        for _, dst, k in R.park_destinations([(node, len(slots))], p.holders(slot_map, measured=True),
                                             [spare] if spare else [], p.regions):
            for slot in [next(it) for _ in range(k)]:
                slot_map.setdefault(dst, []).append(slot)
                record(fid, slot, node, dst)
    _place_lost(p, old, slot_map, record)
    plan.slot_map = {m: sorted(s) for m, s in slot_map.items() if s}
    if not plan.slot_map:
        plan.failure = "every worker is lost; nothing left to train on"
        return plan
    assert sorted(s for v in plan.slot_map.values() for s in v) == sorted(s for v in old.values() for s in v), \
        f"slots lost or held twice: {old} -> {plan.slot_map}"
    plan.start = max(w[m].committed for m in plan.slot_map)
    if plan.start < view.committed:
        plan.failure = (f"every worker holding the state of step {view.committed} is lost "
                        f"(the live ones stand at step {plan.start}); use policy.kind = 'checkpoint_restart'")
    return plan


def _place_lost(p: _Planner, old: dict[str, list[int]], slot_map: dict[str, list[int]], record) -> None:
    """The lost workers' slots, episode by episode (keel.recovery.place_lost_slots). With no
    member left, the first free spare receives them."""
    v = p.v
    by_fault: dict[int | None, list[str]] = {}
    for node in sorted((m for m in old if not v.workers[m].alive), key=p.order.get):
        loss = v.losses.get(node, Loss(None, R.ABSORB_ACTION["hardware_fault"], None))
        by_fault.setdefault(loss.fault_id, []).append(node)
    for fid, nodes in by_fault.items():
        loss = v.losses.get(nodes[0], Loss(None, R.ABSORB_ACTION["hardware_fault"], None))
        held = {slot for s in slot_map.values() for slot in s}  # a returning straggler took its own back
        lost = sorted((slot, node) for node in nodes for slot in old[node] if slot not in held)
        spare = p.free_spare(slot_map)
        if not slot_map and spare is not None:
            slot_map[spare] = []
        survivors = p.holders(slot_map)
        if not survivors:
            return
        picks = R.place_lost_slots(loss.action, len(lost), survivors, [spare] if spare else [],
                                   p.regions, lost_region=loss.target)
        for (slot, node), dst in zip(lost, picks):
            slot_map.setdefault(dst, []).append(slot)
            record(fid, slot, node, dst)
