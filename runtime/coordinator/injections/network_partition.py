"""`network_partition`: the target's live workers (a node, or a region's) cut off from the
rest. On one machine the cut is emulated at the process boundary: each is frozen (SIGSTOP)
in one loop, the same moment, so to its peers and its coordinator it is exactly a cut: it
sends nothing, resets no connection, and no collective completes with it; only the heartbeat
timeout finds it, and the coordinator then fences it (SIGKILL) as it does a hung worker. A
worker this coordinator did not spawn freezes itself and wakes at the heal, to be refused
(exit 3). What a frozen worker does not show, a cut-off one computing on and trying to
commit, the multi-host test bed shows for real (tests/test_multihost.py: a bridge port down)."""
from __future__ import annotations

from typing import Any

from runtime.coordinator.injections import kill_nodes


def fire(coord: Any, p: Any, planned: int) -> bool:
    targets = [n for n in coord.nodes if (n == p.target or coord.region_of[n] == p.target) and coord.live(n)]
    return kill_nodes(coord, p, planned, targets)
