"""`network_partition` in the twin: a node or a whole region cut off from the rest of the
cluster. Nothing is reset, so unlike a crash seen as connection loss it is found only by the
heartbeat timeout, whatever a calibration measured: `policy.detect_timeout_s` from its last
message (its step report, for a cut right after a commit), or detect_timeout_s - heartbeat_s / 2
on average for a cut at a random moment. Its nodes are then lost like a rack's (their slots
spread over the other regions, keel.recovery.place_lost_slots): a cut-off worker commits
nothing and, after the heal, is told to leave; its node rejoins as a spare `rejoin_hours` after
the heal, or not within the run where the cut does not heal (`duration_s` 0). A cut that heals
before it is found is a stall, not a loss: the scenario refuses it (keel/fault_classes.py).
A drawn cut takes one node, drawn uniformly among the live ones."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generator

from keel.scenario import is_node
from twin.faults import DAY, HOUR

if TYPE_CHECKING:
    from twin.faults import Faults

NAME = "network_partition"


def strike(faults: Faults, target: str, duration_s: float, scheduled: bool) -> None:
    table = faults.scenario.faults.network_partition
    policy = faults.scenario.policy
    names = [target] if is_node(target) else [n.name for n in faults.cluster.order if n.region == target]
    back_s = duration_s + table.rejoin_hours * HOUR if duration_s > 0 else None
    faults.strike_nodes(NAME, target, names, scheduled, repair_s=back_s, list_nodes=True,
                        detect_mean_s=policy.detect_timeout_s - policy.heartbeat_s / 2,
                        at_commit_s=policy.detect_timeout_s)


def fire_scheduled(faults: Faults, entry: Any) -> None:
    strike(faults, entry.target, entry.duration_s, True)


def arrivals(faults: Faults, table: Any, rng: Any) -> Generator:
    order = faults.cluster.order
    while True:
        yield faults.env.timeout(rng.exponential(DAY / table.per_day))
        live = [n for n in order if n.up]
        if live:
            strike(faults, live[int(rng.integers(len(live)))].name, table.duration_s, False)
