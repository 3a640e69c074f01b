"""`data_shard_skew`: the poison itself is data (runtime/inject.py's poison schedule, part of
every generation's description); firing opens its episode, unless the shard is quarantined
already (it yields nothing bad again; the twin fires nothing either). The coordinator finds
the non-finite step and quarantines the shard (faults.py, `_try_nonfinite`)."""
from __future__ import annotations

from typing import Any

from keel import recovery as R


def fire(coord: Any, p: Any, planned: int) -> bool:
    if R.shard_skipped(coord.policy.quarantine, {f"shard/{s}" for s in coord.state.quarantine}, p.target):
        return False
    coord.new_episode(p.cls, p.target, shard=p.params["shard"], from_step=p.at_step + 1, planned=planned)
    return False
