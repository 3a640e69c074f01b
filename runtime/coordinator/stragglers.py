"""The straggler watch: from each committed step's measured timings, which member is slow,
which must be parked, and which has come back (keel.recovery's rule, applied to the
runtime's measurements). State in, verdicts out; no processes, no events."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from keel import recovery as R
from keel.recovery import Verdict


@dataclass
class StragglerWatch:
    factor: float
    window: int
    speeds: Mapping[str, float] = field(default_factory=dict)  # member -> its region's speed (1.0 if absent)
    median_per_slot: float | None = None                  # smoothed median seconds per slot at nominal speed
    per_slot: dict[str, float] = field(default_factory=dict)  # smoothed, per worker
    slow: dict[str, int] = field(default_factory=dict)         # slow steps in a row
    ok_probes: dict[str, int] = field(default_factory=dict)    # good probes in a row, while parked

    def state(self) -> dict:
        """What it measured, as JSON (snapshot.py); `restored` reads it back."""
        return {"median_per_slot": self.median_per_slot, "per_slot": dict(self.per_slot),
                "slow": dict(self.slow), "ok_probes": dict(self.ok_probes)}

    @classmethod
    def restored(cls, factor: float, window: int, speeds: Mapping[str, float], state: dict) -> StragglerWatch:
        return cls(factor, window, speeds, median_per_slot=state["median_per_slot"], per_slot=dict(state["per_slot"]),
                   slow=dict(state["slow"]), ok_probes=dict(state["ok_probes"]))

    def speed(self, member: str) -> float:
        return self.speeds.get(member, 1.0)

    def new_generation(self, members: list[str]) -> None:
        for m in members:
            self.slow[m] = 0

    def judge(self, reports: Mapping[str, Mapping], may_park: bool) -> list[Verdict]:
        """One committed step's reports ({member: {"ready_s", "slots"}}, in the members'
        order): keel.recovery.judge_step on the measured seconds per slot to reach the
        collective; the smoothed median (the probes' pace) and per-worker times follow."""
        per = {m: float(r["ready_s"]) / max(1, int(r["slots"])) for m, r in reports.items()}
        if len(per) < 2:
            return []
        med = R.median_pace_s(per, self.speeds)
        out = R.judge_step(per, self.speeds, self.slow, self.factor, self.window, may_park, med)
        self.median_per_slot = med if self.median_per_slot is None else 0.8 * self.median_per_slot + 0.2 * med
        for v in out:
            prev = self.per_slot.get(v.node)
            self.per_slot[v.node] = v.per_slot_s if prev is None else 0.7 * prev + 0.3 * v.per_slot_s
        return out

    def probe(self, node: str, probe_s: float) -> bool:
        """A parked straggler's probe of its path; True once `window` in a row were good."""
        good = R.probe_recovered(probe_s, R.own_pace_s(self.median_per_slot or 0.0, self.speed(node)), self.factor)
        self.ok_probes[node] = R.in_a_row(self.ok_probes.get(node, 0), good)
        return R.window_full(self.ok_probes[node], self.window)

    def back_in(self, node: str) -> None:
        self.ok_probes[node] = 0

    def forget(self, node: str) -> None:
        """A fresh process for `node`: nothing measured of the old one counts."""
        for book in (self.per_slot, self.slow, self.ok_probes):
            book.pop(node, None)
