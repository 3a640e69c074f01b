"""`data_shard_skew` in the twin: a shard yields non-finite values in the step in flight (a
`nan` cause), which the trainer (twin/model.py) ends at its flag's all-reduce (`step_done`:
the quarantine). A quarantined shard strikes no more (keel.recovery.shard_skipped)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generator

from keel import recovery as R
from twin.faults import DAY, Cause, FaultInfo

if TYPE_CHECKING:
    from twin.faults import Faults
    from twin.model import Simulation

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


def step_done(sim: Simulation) -> None:
    """The step in flight came out non-finite: it is not committed; each shard that struck is
    quarantined (absorb: resampled, the episode over; checkpoint_restart: then the job
    restarts), or the run fails where policy.quarantine is false."""
    fids, sim.nan_pending = sim.nan_pending, []
    sim.warm = False  # every worker waits for the quarantine, then redoes the step together
    for fid in fids:
        info = sim.faults.info[fid]
        sim.emit_episode("detect", fid, non_finite_step=sim.committed + 1)
        if info.action == R.FAIL_ACTION:
            sim.failure = (f"step {sim.committed + 1}: {info.target} yields non-finite values "
                           "and policy.quarantine is false")
            continue
        sim.quarantined.add(info.target)
        sim.emit_episode("quarantine", fid, shard=info.target)
        if info.action != R.RESTART_ACTION:  # absorb: quarantined and resampled
            sim.emit_episode("recover_end", fid)
        else:  # checkpoint_restart: the shard is quarantined, then the job restarts
            sim.restart_for.append(fid)
