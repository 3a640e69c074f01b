"""`hardware_fault` in the twin: one node dies (a crashed machine: found by the heartbeat
timeout, `detect_kill_s`), and is repaired `repair_hours` later to rejoin as a spare."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generator

from twin.faults import HOUR

if TYPE_CHECKING:
    from twin.faults import Faults

NAME = "hardware_fault"


def strike(faults: Faults, node: str, scheduled: bool) -> None:
    table = faults.scenario.faults.hardware_fault
    faults.strike_nodes(NAME, node, [node], scheduled, repair_s=table.repair_hours * HOUR,
                        detect_mean_s=faults.params.detect_kill_s)


def fire_scheduled(faults: Faults, entry: Any) -> None:
    strike(faults, entry.target, True)


def arrivals(faults: Faults, table: Any, rng: Any) -> Generator:
    order = faults.cluster.order
    rate = len(order) / (table.mtbf_node_hours * HOUR)
    while True:
        yield faults.env.timeout(rng.exponential(1.0 / rate))
        node = order[int(rng.integers(len(order)))]
        if node.up:
            strike(faults, node.name, False)
