"""One worker's emulated hardware: its clock, and the time each of its actions takes on the
node it stands for.

Time. The coordinator's monotonic anchor T0 (sent in the welcome; CLOCK_MONOTONIC is one
clock for every process of a machine) and `emulation.time_scale` s map emulated seconds to
wall: wall = T0 + c x s. Each worker keeps its own emulated clock c and moves it by what the
scenario's hardware would take: computing its slots, the messages of each collective
(hier.py, priced by netem.py), a checkpoint's snapshot, write and read, a state copy. It
sleeps only before what others can see, a step's report (the commit) and a checkpoint's
commit, until wall >= T0 + c x s, so the real work (the small model's compute, the real
messages, the real files) is absorbed by the emulated time it stands for. Work that outruns
its emulated time is an emulation fault: counted (`overruns`), reported with every step, and
summed in the run's summary; the clock then moves to the wall's (what others saw).

What is real and counts as itself, divided by s: forming a process group, the coordinator's
decisions, detection of a process death (connection loss), the real recovery protocol. A
generation starts at the wall's emulated time (`start_generation`), so those real costs are
part of every recovery, as the twin's calibration measures them.
"""
from __future__ import annotations

import threading
import time

from keel import hardware
from keel.scenario import Scenario, compute_factor, region_of

from runtime.emulation.netem import CollectivePricer, LinkEmulator

LATE_TOLERANCE = 0.01  # a report later than its emulated time by more than this fraction of
                       # the step's emulated duration (and by more than LATE_FLOOR_S) is an overrun
LATE_FLOOR_S = 0.002   # wall seconds: scheduling noise below it is not an overrun


class NodeEmulation:
    def __init__(self, scenario: Scenario, node: str, anchor: float, scale: float):
        self.sc = scenario
        self.node = node
        self.anchor = anchor
        self.scale = scale
        self.speed = scenario.region(region_of(node)).speed
        self.links = LinkEmulator(scenario)
        self.c = self.now()
        self.pricer: CollectivePricer | None = None
        self.overruns = 0           # step reports later than their emulated time
        self.compute_overruns = 0   # steps whose real compute outran the emulated compute
        self.worst_late_s = 0.0     # emulated seconds

    # ------------------------------------------------------------------ the clock
    def now(self) -> float:
        """The wall's emulated time."""
        return self.at(time.monotonic())

    def at(self, monotonic: float) -> float:
        """The emulated time of a wall instant (time.monotonic())."""
        return (monotonic - self.anchor) / self.scale

    def wall(self, c: float) -> float:
        return self.anchor + c * self.scale

    def wait_until(self, c: float, interrupt: threading.Event | None = None) -> float:
        """Sleep until emulated time `c` (cut short by `interrupt`); returns how late the wall
        already was, in emulated seconds (<= 0: on time)."""
        late = self.now() - c
        if late < 0:
            delay = self.wall(c) - time.monotonic()
            if delay > 0:
                if interrupt is not None:
                    interrupt.wait(delay)
                else:
                    time.sleep(delay)
        return late

    def start_generation(self, not_before: float = 0.0) -> None:
        """A generation starts now, on the wall's emulated time (real recovery work counts),
        and not before `not_before` (a relaunch's emulated `policy.restart_s`)."""
        self.c = max(self.c, self.now(), not_before)

    def generation(self, members: list[str]) -> None:
        self.pricer = CollectivePricer(self.links, members)

    # ------------------------------------------------------------------ costs
    def compute_s(self, slots: int, step: int) -> float:
        """Emulated compute of `slots` slots at 0-based step `step`: slots x step_compute_s /
        speed x keel.scenario.compute_factor (the scenario's compute_jitter)."""
        w = self.sc.workload
        return slots * w.step_compute_s / self.speed * compute_factor(self.sc.run.seed, self.node, step, w.compute_jitter)

    def after_compute(self, start: float, compute_s: float) -> bool:
        """The slots' real compute is done: the clock reaches the end of the emulated one.
        True (and counted) when the real compute outran it."""
        self.c = start + compute_s
        if self.now() > self.c + LATE_FLOOR_S / self.scale:
            self.compute_overruns += 1
            return True
        return False

    def commit(self, start: float, interrupt: threading.Event | None = None) -> float | None:
        """Before a step's effect (its update, its report): wait for its emulated end; returns
        the emulated seconds it was late (0 on time), counting an overrun beyond the tolerance,
        or None where `interrupt` (the generation's abort) cut the wait short: on the cluster
        the step was still in its reduction, which the abort ends, so it did not happen."""
        late = self.wait_until(self.c, interrupt)
        if interrupt is not None and interrupt.is_set() and self.now() < self.c:
            return None
        if late > max(LATE_TOLERANCE * (self.c - start), LATE_FLOOR_S / self.scale):
            self.overruns += 1
            self.worst_late_s = max(self.worst_late_s, late)
            self.c = self.now()
            return late
        return 0.0

    def storage_s(self, holders: int, gbyte_s: float) -> float:
        """A checkpoint's snapshot, write or read by one of `holders` nodes: its share of the
        state (keel.hardware.checkpoint_share_bytes) at the per-node bandwidth."""
        return hardware.checkpoint_share_bytes(self.sc, holders) / (gbyte_s * 1e9)

    def state_arrivals(self, t_send: float, source: str, receivers: dict[str, int], key: str) -> dict[str, float]:
        """When each receiver (node -> slots it takes) has its share of the state
        (keel.hardware.state_copy_bytes), sent together from `source` at `t_send`."""
        names = sorted(receivers)
        msgs = [(source, r, hardware.state_copy_bytes(self.sc, receivers[r])) for r in names]
        transfers = self.links.transfers(msgs)
        return {r: self.links.arrival(t_send, source, r, tr, f"{key}/state>{r}") for r, tr in zip(names, transfers)}

    def stats(self) -> dict:
        return {"overruns": self.overruns, "compute_overruns": self.compute_overruns,
                "worst_late_s": self.worst_late_s}
