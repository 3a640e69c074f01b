"""The cluster's bookkeeping: which node is up, what it does, which slots it holds, and the
latency spikes on it, with the aggregates the step-cost model reads kept current.

`Cluster.update` is the one way to change a node: it takes the node's contribution out of the
aggregates, changes it, and puts it back, so a fault costs O(nodes it touches), not O(cluster).
Every change bumps `layout_version`, which keys the step-shape cache (twin/cost.py).

Where slots go is decided by keel.recovery (`fastest_finish` here; `place_lost_slots` and
`park_destinations` by the callers, through `as_holders`): nothing here re-decides it.
No SimPy: this is plain state, changed by the processes in twin/model.py, twin/faults.py and
twin/stragglers.py.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from keel import recovery as R
from keel.scenario import Scenario, is_node, region_of


@dataclass(slots=True)
class Node:
    name: str
    region: str
    speed: float
    index: int
    up: bool = True
    role: str = "train"        # train | spare | parked | down
    slots: int = 0
    incarnation: int = 0


@dataclass(slots=True)
class Spike:
    """A latency spike (network_jitter) on a node or a region's links, while it lasts."""
    target: str
    spike_s: float
    active: bool = True
    in_flight: bool = False    # it caught the step in flight before the target's gate
    detected: bool = False
    closed: bool = False       # its episode has ended (the spike may still be on)
    ends_at: float = float("inf")  # simulated seconds
    over: Any = None           # a SimPy event, set when the spike ends

    def covers(self, node: str) -> bool:
        """Whether the spike's target (a node, or a region) covers `node` ("region/i")."""
        return node == self.target if is_node(self.target) else region_of(node) == self.target


class Cluster:
    """The nodes in scenario order, the spikes on them, and the aggregates over them."""

    def __init__(self, scenario: Scenario, slot_compute_s: float):
        self.slot_compute_s = slot_compute_s
        self.layout_version = 0
        self.spikes: dict[int, Spike] = {}               # fault id -> spike, while it matters
        self.spike_starts: list[tuple[float, Spike]] = []  # (time, spike): every spike, as it started
        # kept up to date by update()
        self.groups: Counter[tuple[str, float]] = Counter()  # (region, compute s) -> up nodes holding slots
        self.holders_per_region: Counter[str] = Counter()
        self.live_per_region: Counter[str] = Counter()   # up nodes with state (train or parked)
        self.held_slots = 0                              # slots on up nodes
        self.spares: set[int] = set()                    # indices of up idle spares
        self.orphans: set[int] = set()                   # indices of dead nodes still holding slots
        self.nodes: dict[str, Node] = {}
        for r in scenario.regions:
            for i in range(r.nodes):
                name = f"{r.name}/{i}"
                self.nodes[name] = Node(name, r.name, r.speed, len(self.nodes), role="down")
        self.order = list(self.nodes.values())
        for node in self.order:
            self.update(node, role="train" if node.index < scenario.training_nodes else "spare")
        self.slot_count = scenario.slot_count
        self.place(self.slot_count, [n for n in self.order if n.role == "train"])
        self.healthy_max_load = max(n.slots / n.speed for n in self.order)

    # ------------------------------------------------------------------ reading
    def active(self) -> list[Node]:
        """Up nodes in the job (holding slots or about to), in scenario order."""
        return [n for n in self.order if n.up and n.role == "train"]

    def writer(self) -> Node | None:
        """The node that writes a checkpoint: the runtime's lowest rank, the first up node
        holding slots in scenario order (every node holds the whole state)."""
        return next((n for n in self.order if n.up and n.slots > 0), None)

    def active_per_region(self, nodes: list[Node] | None = None) -> dict[str, int]:
        """Nodes holding slots per region (of `nodes`, or of the cluster now)."""
        if nodes is None:
            return dict(self.holders_per_region)
        out: dict[str, int] = {}
        for n in nodes:
            out[n.region] = out.get(n.region, 0) + 1
        return out

    def holders(self) -> int:
        """Up nodes holding slots."""
        return sum(self.holders_per_region.values())

    def orphaned_slots(self) -> int:
        """Slots still on dead nodes (not yet moved)."""
        return sum(self.order[i].slots for i in self.orphans)

    def spare_nodes(self, count: int | None = None) -> list[Node]:
        """Up idle spares, in scenario order."""
        return [self.order[i] for i in sorted(self.spares)[:count]]

    def spiked_holders(self, sp: Spike) -> list[Node]:
        """The nodes holding slots that a spike's target covers (a node, or a region's)."""
        if is_node(sp.target):
            n = self.nodes[sp.target]
            return [n] if n.up and n.role == "train" and n.slots > 0 else []
        return [n for n in self.active() if n.region == sp.target and n.slots > 0]

    def overloaded(self) -> bool:
        """Some node carries more than the healthy layout's heaviest load."""
        heaviest = max((compute for _, compute in self.groups), default=0.0) / self.slot_compute_s
        return heaviest > self.healthy_max_load + 1e-12

    # ------------------------------------------------------------------ changing
    def _contribute(self, n: Node, sign: int) -> None:
        if not n.up:
            if n.slots > 0:
                (self.orphans.add if sign > 0 else self.orphans.discard)(n.index)
            return
        if n.role == "train" and n.slots > 0:
            _count(self.groups, (n.region, n.slots * self.slot_compute_s / n.speed), sign)
            _count(self.holders_per_region, n.region, sign)
            self.held_slots += sign * n.slots
        if n.role in ("train", "parked"):
            _count(self.live_per_region, n.region, sign)
        if n.role == "spare":
            (self.spares.add if sign > 0 else self.spares.discard)(n.index)

    def update(self, n: Node, *, up: bool | None = None, role: str | None = None,
               slots: int | None = None) -> None:
        """The one way to change a node: keeps the aggregates the step model reads current."""
        self._contribute(n, -1)
        if up is not None:
            n.up = up
        if role is not None:
            n.role = role
        if slots is not None:
            n.slots = slots
        self._contribute(n, +1)
        self.layout_version += 1

    def touch(self) -> None:
        """Something the step model reads changed without a node changing (a spike)."""
        self.layout_version += 1

    # ------------------------------------------------------------------ placing slots
    @staticmethod
    def as_holders(candidates: list[Node], empty: bool = False) -> list[R.Holder]:
        """`candidates` as keel.recovery sees them (holding nothing if `empty`)."""
        return [R.Holder(n.name, n.region, n.speed, 0 if empty else n.slots, n.index) for n in candidates]

    def counts(self, picks: list[str]) -> list[tuple[str, int]]:
        """(node, slots) per receiver of `picks`, in scenario order."""
        return sorted(Counter(picks).items(), key=lambda kv: self.nodes[kv[0]].index)

    def placement(self, count: int, candidates: list[Node], empty: bool = False) -> list[tuple[str, int]]:
        """Where `count` more slots go among `candidates` (holding what they hold, or nothing
        if `empty`): keel.recovery.fastest_finish. Changes nothing."""
        return self.counts(R.fastest_finish(count, self.as_holders(candidates, empty)))

    def give(self, placed: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """Add each (node, slots) of `placed` to what the node holds; returns `placed`."""
        for name, k in placed:
            self.update(self.nodes[name], slots=self.nodes[name].slots + k)
        return placed

    def place(self, count: int, candidates: list[Node]) -> list[tuple[str, int]]:
        """Give `count` slots to `candidates`, each to the node that would finish soonest."""
        return self.give(self.placement(count, candidates))


def _count(counter: Counter, key: Any, sign: int) -> None:
    counter[key] += sign
    if counter[key] == 0:
        del counter[key]


def merge(pairs: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Sum the slots of repeated names, keeping the first occurrence's order."""
    out: dict[str, int] = {}
    for name, k in pairs:
        out[name] = out.get(name, 0) + k
    return list(out.items())
