"""The episode book: one entry per fault, from the `fault` event to its `recover_end`.

An episode moves through its stages in order (never back): STRUCK (the fault happened),
DETECTED (the coordinator knows), RECOVERING (its recovery started: slots re-planned, a
shard quarantined, a restart under way), ENDED (`recover_end` written). Every event of an
episode carries its `fault_id`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from keel import fault_classes as FC


class Stage(enum.IntEnum):
    STRUCK = 0
    DETECTED = 1
    RECOVERING = 2
    ENDED = 3


@dataclass
class Episode:
    fault_id: int
    cls: str
    target: str
    action: str
    t: float
    nodes: list[str] = field(default_factory=list)
    stage: Stage = Stage.STRUCK
    t_detect: float | None = None
    t_recover: float | None = None
    end_gen: int | None = None    # recover_end at the first commit of this generation
    end_step: int | None = None   # or when this step is committed
    parked: bool = False          # a straggler of this episode stands by (its spike is not over)
    ok: int = 0                   # healthy steps in a row of a detected, unmoved straggler
    member_lost: bool = False     # a member of the generation died (not only a spare)
    until: float | None = None    # a latency spike: when it is over (run seconds)

    @property
    def detected(self) -> bool:
        return self.stage >= Stage.DETECTED

    @property
    def recovering(self) -> bool:
        return self.stage == Stage.RECOVERING

    @property
    def ended(self) -> bool:
        return self.stage == Stage.ENDED

    @property
    def open(self) -> bool:
        """Not yet recovering nor ended."""
        return self.stage < Stage.RECOVERING

    def detect(self, t: float) -> bool:
        """Mark it detected at `t`; False if it already was."""
        if self.detected:
            return False
        self.stage, self.t_detect = Stage.DETECTED, t
        return True

    def start_recovery(self, t: float | None = None) -> bool:
        """Mark its recovery started (at `t`, if given); False if it already was, or ended."""
        if not self.open:
            return False
        self.stage = Stage.RECOVERING
        if t is not None:
            self.t_recover = t
        return True

    def due(self, gen: int, step: int | None, now: float | None = None) -> bool:
        """Its recovery is complete at generation `gen` (or once `step` is committed); a
        latency spike that never made a straggler ends with the spike (at `now` past `until`),
        as the twin ends it."""
        if self.stage == Stage.STRUCK and self.until is not None and now is not None:
            return now >= self.until
        if not self.recovering:
            return False
        return ((self.end_gen is not None and gen >= self.end_gen and not self.parked)
                or (step is not None and self.end_step is not None and step >= self.end_step))


class EpisodeBook:
    """The run's episodes by fault_id, in the order the faults happened."""

    def __init__(self) -> None:
        self.episodes: dict[int, Episode] = {}
        self.killed: dict[str, int] = {}   # node -> the episode that killed (or hung) it

    def new(self, cls: str, target: str, action: str, t: float) -> Episode:
        ep = Episode(len(self.episodes), cls, target, action, t)
        self.episodes[ep.fault_id] = ep
        return ep

    def get(self, fault_id: int | None) -> Episode | None:
        return self.episodes.get(fault_id) if fault_id is not None else None

    def __iter__(self):
        return iter(self.episodes.values())

    def of_killed(self, node: str) -> Episode | None:
        return self.get(self.killed.get(node))

    def jitter_on(self, node: str) -> Episode | None:
        """The latest unended latency spike on `node`."""
        for ep in reversed(list(self.episodes.values())):
            if FC.get(ep.cls).has_duration and node in ep.nodes and not ep.ended:
                return ep
        return None

    def bad_shard(self, suspects: list[int]) -> Episode | None:
        """The latest unended data fault on one of the `suspects` shards."""
        for ep in reversed(list(self.episodes.values())):
            if FC.get(ep.cls).shard_target and not ep.ended and FC.shard_number(ep.target) in suspects:
                return ep
        return None

    def node_recovery_under_way(self, members) -> bool:
        """A node fault has struck one of the generation's `members` and is not over (a kill due
        now waits for the next generation, to land during the recovery). One that struck only
        spares re-forms nothing: nothing waits for it (whether its loss is detected yet or not,
        which is a matter of timing)."""
        return any(not ep.ended and FC.get(ep.cls).node_loss is not None and any(n in members for n in ep.nodes)
                   for ep in self.episodes.values())

    def end_with_generation(self, gen: int) -> None:
        """Episodes under recovery whose end is not set end at the first commit of `gen`."""
        for ep in self.episodes.values():
            if ep.recovering and ep.end_gen is None:
                ep.end_gen = gen

    def due(self, gen: int, step: int | None, now: float | None = None) -> list[Episode]:
        return [ep for ep in self.episodes.values() if ep.due(gen, step, now)]
