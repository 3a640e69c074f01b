"""`partial_cluster_loss` in the twin: several nodes of one region die at once (a rack:
`detect_rack_s`); a scheduled one takes the region's first `nodes` live nodes
(keel.recovery.rack_victims), a drawn one `nodes` of them at random, its region drawn in
proportion to the regions' node counts."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generator

import numpy as np

from keel import recovery as R
from twin.faults import DAY, HOUR

if TYPE_CHECKING:
    from twin.faults import Faults

NAME = "partial_cluster_loss"


def strike(faults: Faults, region: str, names: list[str], scheduled: bool) -> None:
    table = faults.scenario.faults.partial_cluster_loss
    faults.strike_nodes(NAME, region, names, scheduled, repair_s=table.repair_hours * HOUR,
                        detect_mean_s=faults.params.detect_rack_s, list_nodes=True)


def _live(faults: Faults, region: str) -> list[str]:
    return [n.name for n in faults.cluster.order if n.region == region and n.up]


def fire_scheduled(faults: Faults, entry: Any) -> None:
    strike(faults, entry.target, R.rack_victims(_live(faults, entry.target), entry.nodes), True)


def arrivals(faults: Faults, table: Any, rng: Any) -> Generator:
    regions = faults.scenario.regions
    weights = np.array([r.nodes for r in regions], dtype=float)
    weights /= weights.sum()
    while True:
        yield faults.env.timeout(rng.exponential(DAY / table.per_day))
        region = regions[int(rng.choice(len(regions), p=weights))].name
        live = _live(faults, region)
        if not live:
            continue
        picked = sorted(rng.choice(len(live), size=min(table.nodes, len(live)), replace=False))
        strike(faults, region, [live[i] for i in picked], False)
