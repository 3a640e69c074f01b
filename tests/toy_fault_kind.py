"""A toy fault class for tests/test_fault_registry.py: its registry entry, and its twin and
runtime behaviour in this one module (a real class has a module on each side). It strikes
nothing: its episode opens and ends at once in the twin; the runtime records the call."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator

from keel import fault_classes as FC
from keel.scenario_base import _doc

NAME = "toy_fault"
FIRED: list[tuple[str, int]] = []  # the runtime's injections, (target, planned)


@dataclass(frozen=True, kw_only=True, slots=True)
class ToyFault:
    per_day: float = _doc("toy faults per day; 0 = off", 0.0)
    strength: float = _doc("how hard it strikes", 1.0)


ENTRY = FC.FaultClass(
    name=NAME, table=ToyFault, doc="a toy", absorb_action="toy_absorb", target_hint="a region name",
    check_target=FC.region_target, rate_key="per_day", rate_per_s=FC.per_day, rate_label="toy: per day",
    colour="#000000", injection="toy", twin=__name__, runtime=__name__,
    positive=(("per_day", True), ("strength", False)), stops_job=False)


# ------------------------------------------------------------------ twin
def fire_scheduled(faults: Any, entry: Any) -> None:
    from twin.faults import FaultInfo
    fid = faults.new_fault(FaultInfo(NAME, entry.target, faults.action(NAME)))
    for kind in ("fault", "detect", "recover_start", "recover_end"):
        faults.sim.emit_episode(kind, fid, scheduled=True)


def arrivals(faults: Any, table: Any, rng: Any) -> Generator:
    yield faults.env.timeout(float("inf"))


# ------------------------------------------------------------------ runtime
def fire(coord: Any, p: Any, planned: int) -> bool:
    FIRED.append((p.target, planned))
    return False
