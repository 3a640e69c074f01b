"""`data_shard_skew` in the twin: a shard yields non-finite values in the step in flight (a
`nan` cause; the trainer's quarantine is twin/model.py's). A quarantined shard strikes no more
(keel.recovery.shard_skipped)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generator

from keel import recovery as R
from twin.faults import DAY, Cause, FaultInfo

if TYPE_CHECKING:
    from twin.faults import Faults

NAME = "data_shard_skew"


def strike(faults: Faults, shard: str, scheduled: bool) -> None:
    """`shard` yields non-finite values in the step in flight."""
    if R.shard_skipped(faults.scenario.policy.quarantine, faults.sim.quarantined, shard):
        return
    fid = faults.new_fault(FaultInfo(NAME, shard, faults.action(NAME)))
    faults.sim.emit_episode("fault", fid, scheduled=scheduled)
    faults.sim.notify(Cause("nan", fid, interrupts_run=True))


def fire_scheduled(faults: Faults, entry: Any) -> None:
    strike(faults, entry.target, True)


def arrivals(faults: Faults, table: Any, rng: Any) -> Generator:
    shards = faults.scenario.data.shards
    while True:
        yield faults.env.timeout(rng.exponential(DAY / table.per_day))
        strike(faults, f"shard/{int(rng.integers(shards))}", False)
