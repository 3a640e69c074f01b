"""A repaired node rejoins as a spare: under absorb it relieves overloaded nodes (a `reslot`
with no fault, reason "rejoin"). A generator of the trainer process (twin/model.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Generator

if TYPE_CHECKING:
    from twin.model import Simulation


def rebalance(sim: Simulation) -> Generator:
    """Halve the load of the most loaded node onto a spare while the cluster is below its
    healthy layout and a spare is free."""
    c = sim.cluster
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
    yield from sim.wait(sim.params.reform_s + sim.params.spare_takeover_s + sim.cost.transfer_s(moved), "paused")
    sim.new_generation()
