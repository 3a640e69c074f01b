"""The recovery decisions the twin predicts and the runtime makes, each one pure function of
plain data (standard library only). Both sides call these; tests/test_recovery.py runs both
on the same inputs and checks they decide the same.

- `action_for`: the recovery action of a fault class under a policy.
- `shard_skipped`: whether a fault on a data shard can no longer strike (it is quarantined).
- Slot placement (`Holder`, `fastest_finish`, `spread_over_regions`, `place_lost_slots`,
  `park_destinations`): where slots go when a node is lost, a straggler is parked, or the run
  starts. A node's capacity is its region's `speed`: a node computes one slot's micro-batch in
  `workload.step_compute_s / speed` whatever its `gpus_per_node` (which the scenario already
  folds into those two figures); a region's capacity is the sum over its live nodes.
- The straggler rule (`is_straggler` on a time per slot, `straggler_excess_s` on a delay per
  slot: one inequality in two forms; `probe_recovered`), each worker judged against its own
  pace (`own_pace_s`: the median nominal pace over its speed), and `judge_step`: one committed
  step's verdicts, on the runtime's measured times and on the twin's predicted ones.
- `state_source_region`: where the state comes from for members that are behind (a spare
  taking over, a node coming back).
- `resolve_schedule`: each scheduled fault with its class's parameters filled in (and a
  coordinator_loss's target, "coordinator", where the entry leaves it out).
"""
from __future__ import annotations

import heapq
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

from keel import fault_classes as FC
from keel.fault_classes import COORDINATOR  # noqa: F401  (re-exported: its home is the registry)


class _AbsorbActions(Mapping[str, str]):
    """fault class -> its action under policy absorb, read from the registry (so a class
    registered later is in it too)."""
    def __getitem__(self, name: str) -> str:
        return FC.REGISTRY[name].absorb_action

    def __iter__(self) -> Iterator[str]:
        return iter(FC.REGISTRY)

    def __len__(self) -> int:
        return len(FC.REGISTRY)


ABSORB_ACTION: Mapping[str, str] = _AbsorbActions()
RESTART_ACTION = "checkpoint_restart"
# a class that does not stop the job (network_jitter) under checkpoint_restart: nothing
# moves, the run sits the spike out
ENDURE_ACTION = "endure"
# a class that fails without quarantine (data_shard_skew) with policy.quarantine = false:
# the shard keeps yielding non-finite values at the same step (it is data, not a transient), so neither redoing the step nor restarting
# from a checkpoint gets past it; the run stops there, failed, and says why
FAIL_ACTION = "fail_run"

# A worker is a straggler when its per-slot time to reach the collective exceeds
# straggler_factor x the median and the median by at least this much (a noise floor) ...
STRAGGLER_MIN_EXCESS_S = 0.04
# ... and the first steps of a generation (connection set-up) are not judged.
STRAGGLER_WARMUP_STEPS = 2


def action_for(fault_class: str, policy_kind: str, quarantine: bool) -> str:
    """The recovery action (an event's `action`) for a fault of `fault_class`."""
    fc = FC.get(fault_class)  # an unknown class raises ValueError
    if fc.fails_without_quarantine and not quarantine:
        return FAIL_ACTION
    if policy_kind == "checkpoint_restart":
        return RESTART_ACTION if fc.stops_job else ENDURE_ACTION
    return fc.absorb_action


def shard_skipped(quarantine: bool, quarantined: Sequence[str] | set[str], shard: str) -> bool:
    """A quarantined shard's samples are replaced: it yields nothing bad again."""
    return quarantine and shard in quarantined


# ----------------------------------------------------------------------------- slots

class Holder(NamedTuple):
    """A live node that can take slots: its name, region, capacity (`speed`, or a measured
    1 / seconds per slot), the slots it holds now, and its place in scenario order. (A tuple:
    the twin builds one per node at every node fault of a 16,384-node cluster.)"""
    name: str
    region: str
    speed: float
    held: int
    order: int


def fastest_finish(count: int, holders: Sequence[Holder]) -> list[str]:
    """Give `count` slots one at a time, each to the holder that would finish its slots
    soonest ((held + 1) / speed; ties to the first in scenario order). Returns the receiver
    of each slot, in the order they were given."""
    if count <= 0:
        return []
    if not holders:
        raise ValueError("no node to place slots on")
    got = {h.name: 0 for h in holders}
    heap = [((h.held + 1) / h.speed, h.order, h) for h in holders]
    heapq.heapify(heap)
    picks = []
    for _ in range(count):
        _, order, best = heap[0]
        picks.append(best.name)
        got[best.name] += 1
        heapq.heapreplace(heap, ((best.held + got[best.name] + 1) / best.speed, order, best))
    return picks


def region_shares(count: int, holders: Sequence[Holder], region_order: Sequence[str]) -> dict[str, int]:
    """Largest-remainder apportionment of `count` slots over the holders' regions by capacity
    (the sum of their holders' speed); remainders tie to the first region in `region_order`."""
    capacity: dict[str, float] = {}
    for h in holders:
        capacity[h.region] = capacity.get(h.region, 0.0) + h.speed
    total = sum(capacity.values())
    quotas = {r: count * c / total for r, c in capacity.items()}
    shares = {r: int(q) for r, q in quotas.items()}
    rest = count - sum(shares.values())
    rank = sorted(quotas, key=lambda r: (-(quotas[r] - shares[r]), region_order.index(r)))
    for r in rank[:rest]:
        shares[r] += 1
    return shares


def spread_over_regions(count: int, holders: Sequence[Holder], region_order: Sequence[str]) -> list[str]:
    """`region_shares`, then the fastest finish inside each region; receivers region by
    region in `region_order`."""
    if count <= 0:
        return []
    if not holders:
        raise ValueError("no node to place slots on")
    shares = region_shares(count, holders, region_order)
    picks: list[str] = []
    for r in region_order:
        if shares.get(r):
            picks += fastest_finish(shares[r], [h for h in holders if h.region == r])
    return picks


def place_lost_slots(action: str, count: int, survivors: Sequence[Holder] | Callable[[], Sequence[Holder]],
                     spares: Sequence[str], region_order: Sequence[str], lost_region: str | None = None) -> list[str]:
    """Where a lost node's (or rack's) `count` slots go under absorb, one receiver per slot.
    `replicate_resume`: all to the first idle hot spare, else the fastest finish over the
    survivors. `shard_reweight_failover`: spread over the surviving regions other than the
    stricken one (`lost_region`) by capacity, or over the survivors if no other region has one.
    `survivors` may be a function returning them, called only where they are needed (a spare
    taking over needs none: the twin asks this at every node fault of a 16,384-node cluster)."""
    if action != "shard_reweight_failover" and spares:
        return [spares[0]] * count
    if callable(survivors):
        survivors = survivors()
    if action == "shard_reweight_failover":
        others = [h for h in survivors if h.region != lost_region]
        return spread_over_regions(count, others or survivors, region_order)
    return fastest_finish(count, survivors)


def park_destinations(movers: Sequence[tuple[str, int]], others: Sequence[Holder], spares: Sequence[str],
                      region_order: Sequence[str]) -> list[tuple[str, str, int]]:
    """Where parked stragglers' slots go, as (from, to, slots): to idle spares one for one
    when there are enough, else, for one straggler, the fastest finish over the others, and
    for several (a region's), spread over the others' regions by capacity."""
    if len(spares) >= len(movers):
        return [(name, spare, k) for (name, k), spare in zip(movers, spares)]
    held = {h.name: h.held for h in others}
    order = {h.name: h.order for h in others}
    plan: list[tuple[str, str, int]] = []
    for name, k in movers:
        now = [Holder(h.name, h.region, h.speed, held[h.name], h.order) for h in others]
        picks = fastest_finish(k, now) if len(movers) == 1 else spread_over_regions(k, now, region_order)
        counts: dict[str, int] = {}
        for p in picks:
            counts[p] = counts.get(p, 0) + 1
            held[p] += 1
        plan += [(name, to, counts[to]) for to in sorted(counts, key=order.get)]
    return plan


def state_source_region(regions_with_state: Sequence[str], receiver_regions: Sequence[str],
                        latency: Callable[[str, str], float]) -> str:
    """The region whose first up-to-date member (in scenario order) sends the state to the
    members that are behind: the one nearest to them (the smallest latency to the farthest
    receiver's region; ties to the first in `regions_with_state`, which is in scenario order).
    A receiver in the same region is at latency 0, so a spare takes its state from a peer of
    its own region where there is one, never over an inter-region link."""
    if not regions_with_state:
        raise ValueError("no member holds the state")
    if not receiver_regions:
        return regions_with_state[0]
    return min(regions_with_state,
               key=lambda r: (max(0.0 if r == x else latency(r, x) for x in receiver_regions),
                              regions_with_state.index(r)))


# ----------------------------------------------------------------------------- stragglers

# A worker is judged against its own pace: the median over the members of their per-slot
# times at nominal speed (each times its region's `speed`), over the worker's speed. A node of
# a slow region is slow by design, not a straggler: judged against the raw median, one of a
# region at speed 0.8 with 5 % compute jitter crossed a factor of 1.3 about one step in five,
# and its slots moved away and back at once, each move aborting a step (sweep member 3/8, 7 Dec).

def nominal_per_slot_s(per_slot_s: float, speed: float) -> float:
    """A worker's measured time per slot at nominal speed (`speed` 1)."""
    return per_slot_s * speed


def own_pace_s(nominal_median_s: float, speed: float) -> float:
    """What a slot takes on a worker of `speed` at the members' median nominal pace: the
    `median_per_slot_s` the rule below judges that worker against."""
    return nominal_median_s / speed


def is_straggler(per_slot_s: float, median_per_slot_s: float, factor: float) -> bool:
    """A worker whose per-slot time to reach the collective is over `factor` x its own pace
    (`own_pace_s`) and over it by STRAGGLER_MIN_EXCESS_S."""
    return per_slot_s > factor * median_per_slot_s and per_slot_s - median_per_slot_s > STRAGGLER_MIN_EXCESS_S


def straggler_excess_s(median_per_slot_s: float, factor: float) -> float:
    """The delay per slot above which a worker at the median pace becomes a straggler."""
    return max(STRAGGLER_MIN_EXCESS_S, (factor - 1.0) * median_per_slot_s)


@dataclass(frozen=True, slots=True)
class Verdict:
    """One member's verdict on one committed step."""
    node: str
    slow: bool
    per_slot_s: float
    median_per_slot_s: float  # the pace it was judged against: the median nominal pace over its speed
    park: bool = False        # slow for straggler_window steps in a row: park it (the step's judging stops here)


def median_pace_s(per_slot_s: Mapping[str, float], speeds: Mapping[str, float]) -> float:
    """The members' median per-slot time at nominal speed (`speeds`: member -> its region's
    speed, 1.0 if absent): what `judge_step` judges each member's own pace by."""
    return statistics.median(nominal_per_slot_s(v, speeds.get(m, 1.0)) for m, v in per_slot_s.items())


def judge_step(per_slot_s: Mapping[str, float], speeds: Mapping[str, float], slow: dict[str, int],
               factor: float, window: int, may_park: bool, median_s: float) -> list[Verdict]:
    """The straggler rule on one committed step of two members or more. `per_slot_s`: each
    member's seconds per slot to reach the step's collective (its compute and its
    communication gate's delay), in the members' order (scenario order); `median_s`: their
    `median_pace_s`; `slow`: each member's slow steps in a row, updated here. Each member is
    judged against its own pace (`is_straggler`); the first one slow `window` steps in a row
    is parked (where `may_park`) and the members after it are not judged this step. The
    runtime's coordinator calls it on the measured step reports, the twin on the times it
    predicts from the scenario's draws (twin/stragglers.py)."""
    out = []
    for m, v in per_slot_s.items():
        pace = own_pace_s(median_s, speeds.get(m, 1.0))
        hit = is_straggler(v, pace, factor)
        slow[m] = in_a_row(slow.get(m, 0), hit)
        park = hit and may_park and window_full(slow[m], window)
        out.append(Verdict(m, hit, v, pace, park))
        if park:
            break
    return out


def spike_settled(fine_steps: int, any_slow: bool, window: int) -> tuple[int, bool]:
    """A detected spike that parked no one, after one more judged step: the steps in a row on
    which none of its nodes was slow, and whether they fill the window (its episode is over).
    Counted per step, not per member's verdict: a region's six fine verdicts on one step are one
    fine step (the runtime counted six, and ended such an episode on the step that detected it)."""
    fine = in_a_row(fine_steps, not any_slow)
    return fine, window_full(fine, window)


def probe_recovered(probe_s: float, median_per_slot_s: float, factor: float) -> bool:
    """A parked straggler's probe of its path is good when that delay would no longer make it
    a straggler; `straggler_window` good probes in a row bring it back."""
    return probe_s < straggler_excess_s(median_per_slot_s, factor)


# The straggler window: `policy.straggler_window` slow steps in a row park a straggler, as many
# good probes in a row bring it back, as many fine steps in a row end a spike that never
# moved anything; the first STRAGGLER_WARMUP_STEPS steps of a generation are not judged.

def in_a_row(count: int, hit: bool) -> int:
    """A run's length after one more observation: one more where `hit`, else back to 0."""
    return count + 1 if hit else 0


def window_full(count: int, window: int) -> bool:
    """`count` in a row fill the straggler window."""
    return count >= window


def first_judged_step(gen_start_step: int) -> int:
    """The first step (a 1-based step number) of a generation, started after step
    `gen_start_step`, that the straggler rule judges."""
    return gen_start_step + STRAGGLER_WARMUP_STEPS + 1


def window_end_step(first_slow_step: int, window: int) -> int:
    """The step whose commit fills the window of slow steps that starts at `first_slow_step`."""
    return first_slow_step + window - 1


# ----------------------------------------------------------------------------- the schedule

@dataclass(frozen=True, slots=True)
class ResolvedFault:
    """A `[[faults.schedule]]` entry with its class's parameters filled in from the class
    table where the entry does not set them."""
    index: int
    at_step: int
    cls: str
    target: str
    spike_ms: float | None = None     # network_jitter
    duration_s: float | None = None   # network_jitter, network_partition
    nodes: int | None = None          # partial_cluster_loss: how many of the region's live nodes
    shard: int | None = None          # data_shard_skew: the shard's number

    def params(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("spike_ms", "duration_s", "nodes", "shard")
                if getattr(self, k) is not None}


def resolve_schedule(scenario: Any) -> list[ResolvedFault]:
    """Every scheduled fault of `scenario` (a keel.scenario.Scenario), in file order."""
    out = []
    for i, e in enumerate(scenario.faults.schedule):
        target, kw = FC.get(e.class_).resolve(e, scenario.faults)
        out.append(ResolvedFault(i, e.at_step, e.class_, target, **kw))
    return out


def rack_victims(live_in_region: Sequence[str], count: int) -> list[str]:
    """The nodes a scheduled rack loss takes: the region's first `count` live nodes, in
    scenario order."""
    return list(live_in_region[:count])


def relaunch_places(orphans: Sequence[str], free_spares: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """checkpoint_restart's relaunch starts the job again on machines that are up: each node
    that held slots and whose machine is down (`orphans`, in scenario order) hands its place to
    the next free spare (`free_spares`, up and idle, in scenario order); once they are used up,
    a new machine takes its place under its name (policy.replace_node_s). Returns
    {orphan: spare} and the orphans that new machines replace."""
    taken = dict(zip(orphans, free_spares))
    return taken, [n for n in orphans if n not in taken]
