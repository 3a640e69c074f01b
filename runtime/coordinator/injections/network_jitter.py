"""`network_jitter`: the target's live workers (a node, or a region's) are told to slow their
communication path (runtime/inject.py's `CommGate`) for `duration_s`; the episode's end is
the straggler watch's and the generations' (stragglers.py, generations.py)."""
from __future__ import annotations

from typing import Any

from keel.scenario import is_node


def fire(coord: Any, p: Any, planned: int) -> bool:
    targets = [n for n in coord.nodes if (n == p.target or coord.region_of[n] == p.target) and coord.live(n)]
    ep = coord.new_episode(p.cls, p.target, nodes=targets, planned=planned, **p.params)
    ep.nodes = targets
    ep.until = ep.t + float(p.params["duration_s"])
    scope = "node" if is_node(p.target) else "region"
    for n in targets:
        coord.state.workers[n].chan.send({"type": "jitter", "index": p.index, "scope": scope, **p.params})
    return False
