"""`partial_cluster_loss`: SIGKILL of `nodes` live workers of one region, in one loop: the
region's first live ones in scenario order (keel.recovery.rack_victims, as in the twin)."""
from __future__ import annotations

from typing import Any

from keel import recovery as R

from runtime.coordinator.injections import kill_nodes


def fire(coord: Any, p: Any, planned: int) -> bool:
    live = [n for n in coord.nodes if coord.region_of[n] == p.target and coord.live(n)]
    return kill_nodes(coord, p, planned, R.rack_victims(live, p.params["nodes"]))
