"""The cluster as a networkx graph, and the costs that come from it.

Graph: one vertex per machine (`kind="node"`, with `region`, `gpus`, `speed`) and one switch
vertex per region (`kind="region"`). Each machine hangs off its region's switch by an edge
carrying half the intra-region latency and the node's bandwidth; the scenario's `[[links]]`
join the switches (one-way latency = rtt/2, bandwidth, jitter). A star per region keeps the
graph linear in the number of machines (a full mesh of 16,384 nodes would not be).

The gradient reduction is hierarchical over the *active* training nodes (a membership):
  1. reduce-scatter inside every region (ring of its n_r active nodes): n_r - 1 phases, each
     one intra-region hop and B / n_r bytes per node;
  2. all-reduce across the R active regions over a ring of regions (keel.hardware.region_ring:
     nearest neighbour on routed latency), every ring edge routed over the links by shortest
     latency (keel.hardware.route):
     2 (R - 1) phases, each moving B / R bytes of the region's shards over the routed path,
     one message from each owner to each owner of the next region whose chunk overlaps it
     (keel.collective's plan); the messages of a phase share every NIC and link (one resource
     per direction) they cross as flows do (keel.hardware.shared_transfers_s, the emulation's
     formula), and the region's piece is as late as its slowest message;
  3. all-gather inside every region: n_r - 1 phases again.
No phase waits for the previous one to end everywhere: a node sends its next piece once it has
received the one before, so the time is the longest chain of dependent messages
(`collective_s`), as the runtime's emulated reduction (runtime/emulation/hier.py) runs it
message by message. It is kept affine in the bytes: latency_s + bytes * s_per_byte.

This module owns the graph and its routed costs (reduction, spike delay); twin/cost.py scales
them to the calibration and the cluster's membership and prices state copies.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import networkx as nx

from keel import collective, hardware, wire
from keel.scenario import Scenario, is_node, region_of
from twin.messages import PLAN_LENGTH, SPIKE_NODE_CAP, MessageLevel, ring_ranks

GBIT = hardware.GBIT


@dataclass(frozen=True, slots=True)
class ReductionCost:
    """One all-reduce over a membership: `latency_s + bytes * s_per_byte` on quiet links; the
    links' jitter adds `jitter_delay_s` on average with standard deviation `jitter_s`
    (Topology.jitter_delay_s)."""
    latency_s: float
    s_per_byte: float
    jitter_s: float
    jitter_delay_s: float = 0.0

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes * self.s_per_byte


NO_REDUCTION = ReductionCost(0.0, 0.0, 0.0)


@dataclass(frozen=True)
class StepCosts:
    """One message's cost in each step of the hierarchical all-reduce (Topology._step_costs)."""
    ring: tuple[str, ...]                         # the active regions in ring order
    nxt: dict[str, str]                           # region -> the next in the ring
    pairs: list[tuple[str, str]]                  # every ordered pair of active regions
    hop_latency: dict[str, float]                 # region -> an intra hop's latency, s
    hop_per_byte: dict[str, float]                # region -> an intra hop's s per byte of the vector
    fixed: dict[str, float]                       # region -> its ring step's latency to the next, s
    ring_per_byte: tuple[dict[str, float], ...]   # per inter-region ring step: region -> s per byte of the vector
    x_fixed: dict[tuple[str, str], float]         # a -> b, any two active regions: a message's latency, s
    x_per_byte: dict[tuple[str, str], float]      # exchange a -> b: s per byte of the vector


class Topology(MessageLevel):
    """The graph plus the routed costs the twin needs. Costs are cached per membership shape
    (active nodes per region), so thousands of calls over a run stay cheap."""

    def __init__(self, scenario: Scenario):
        self.scenario = scenario
        self.graph = build_graph(scenario)
        self.region_names = [r.name for r in scenario.regions]
        self._regions = {r.name: r for r in scenario.regions}
        self._route_cache: dict[tuple[str, str], tuple[float, tuple[tuple[str, str], ...], float]] = {}
        self._ring_cache: dict[tuple[str, ...], tuple[str, ...]] = {}
        self._cost_cache: dict[tuple[tuple[str, int], ...], ReductionCost] = {}
        self._spike_cache: dict[tuple, float] = {}
        self._ring_time_cache: dict[tuple, float] = {}
        self._chain_spike_cache: dict[tuple, dict[str, float]] = {}
        self._chain_cache: dict[tuple, dict[str, dict[str, tuple[float, float]]]] = {}
        self._resource_cache: dict[tuple[str, str], tuple[tuple[tuple, float], ...]] = {}
        self._jitter_cache: dict[tuple[str, ...], tuple[float, float]] = {}
        self._step_cache: dict[tuple[tuple[str, int], ...], StepCosts] = {}
        self._latency_cache: dict[tuple[str, str], float] = {}
        self._shared_cache: dict[tuple, list[float]] = {}
        self._trained: dict[str, int] = {r: 0 for r in self.region_names}
        for n in scenario.node_names[: scenario.training_nodes]:
            self._trained[region_of(n)] += 1

    # -- routing over the links between regions
    def route(self, a: str, b: str) -> tuple[float, tuple[tuple[str, str], ...], float]:
        """(one-way latency s, the links crossed as (from, to), jitter s) of the lowest-latency
        path a -> b (keel.hardware.route, the runtime's emulation routes its messages by it too).
        A link is full duplex: traffic a -> b and b -> a do not share its bandwidth, so the
        links are kept with their direction."""
        key = (a, b)
        if key not in self._route_cache:
            r = hardware.route(self.scenario, a, b)
            self._route_cache[key] = (r.latency_s, r.hops, r.jitter_s)
        return self._route_cache[key]

    def region_ring(self, regions: Iterable[str]) -> tuple[str, ...]:
        """The order in which the inter-region all-reduce ring visits the active regions
        (keel.hardware.region_ring, as the runtime's emulated reduction orders its ring)."""
        key = tuple(sorted(regions, key=self.region_names.index))
        if key not in self._ring_cache:
            self._ring_cache[key] = hardware.region_ring(self.scenario, key)
        return self._ring_cache[key]

    # -- the reduction
    def reduction(self, active_per_region: dict[str, int]) -> ReductionCost:
        """Cost of one hierarchical all-reduce over `active_per_region` (region -> nodes)."""
        shape = tuple((r, n) for r in self.region_names if (n := active_per_region.get(r, 0)) > 0)
        if shape not in self._cost_cache:
            self._cost_cache[shape] = self._reduction(dict(shape))
        return self._cost_cache[shape]

    def _reduction(self, active: dict[str, int]) -> ReductionCost:
        if sum(active.values()) <= 1:
            return NO_REDUCTION
        rounds = wire.scenario_rounds(self.scenario)  # the step's all-reduces, each paying its latency
        nbytes = max(1.0, float(sum(b for b, _ in rounds)))
        latency = self.collective_s(active, [(0.0, x) for _, x in rounds])
        per_byte = max(0.0, self.collective_s(active, rounds) - latency) / nbytes
        delay, jitter = self.jitter_delay_s(active)
        return ReductionCost(latency, per_byte, jitter, delay)

    def collective_s(self, active: dict[str, int], nbytes: float | Sequence[tuple[float, bool]], spike: tuple[str, float] | None = None) -> float:
        """Seconds of one hierarchical all-reduce of `nbytes` over `active` (region -> nodes),
        every node starting together, with a latency spike `(target, seconds)` on the
        messages a node sends (target `region/i`) or a region's nodes send to other regions
        (target a region).

        Nothing waits for a phase to end everywhere: a node sends its next piece once it has
        received the previous one (as a ring all-reduce runs), so the time is the longest
        chain of dependent messages, computed per region (its nodes alike):
        - inside region r of n nodes, each of the n - 1 steps of the reduce-scatter (and again
          of the all-gather) sends B / n bytes one hop: intra latency + B / n / node bandwidth;
        - across the R regions, 2 (R - 1) ring steps; at step s region a sends B / R bytes
          to the next region over the routed path (latency + its slowest message's transfer,
          the step's messages sharing the NICs and links they cross: `_step_costs`), and the
          receiver goes on when both its own previous step and that piece are done.
        A spike adds to every message its target sends, so it delays the chain once per
        step the chain crosses it."""
        chains = self.chains_s(active, nbytes, spike)
        return max(chains.values(), default=0.0)

    def chains_s(self, active: dict[str, int], nbytes: float | Sequence[tuple[float, bool]],
                 spike: tuple[str, float] | None = None) -> dict[str, float]:
        """Per active region r: the longest chain of `collective_s` that starts in r, i.e. the
        collective's end if r's nodes start at 0 and every other region's are already there
        (-inf). The collective is max-plus linear in its start times, so a step whose regions
        start their reduction at their own slowest node's end t_r ends at max_r(t_r + chain_r):
        the twin's step model (twin/cost.py) takes each region's compute with its own chain.
        Empty where at most one node is active. A sequence of (bytes, exchange) is a step's
        all-reduces one after the other (keel.wire.scenario_rounds): a region starts the next
        when it has the last; an exchange crosses regions once, every region sending its bytes
        to every other at once over the routed path (links shared by the pairs routed on them)."""
        return {start: max(t for t in ends.values() if t > -math.inf)
                for start, ends in self.chain_ends_s(active, nbytes, spike).items()}

    def chain_ends_s(self, active: dict[str, int], nbytes: float | Sequence[tuple[float, bool]],
                     spike: tuple[str, float] | None = None) -> dict[str, dict[str, float]]:
        """`chains_s` per region the chain ends in: [r][s] is when region s has the result if
        r's nodes start at 0 and every other region's are already there (-inf where none
        reaches s). A region starts its next step as soon as it has its own result, so the
        steps' period is the max-plus cycle mean of compute + this matrix (StepCost._overlap_s)."""
        rounds = [(float(nbytes), False)] if isinstance(nbytes, (int, float)) else list(nbytes)
        shape = {r: n for r, n in active.items() if n > 0}
        if sum(shape.values()) <= 1:
            return {}
        node_spike = region_spike = None
        if spike is not None:
            target, seconds = spike
            if is_node(target):
                node_spike = (region_of(target), seconds)
            else:
                region_spike = (target, seconds)
        k = self._step_costs(shape)
        ring, R = k.ring, len(k.ring)

        def extra(a: str) -> float:  # the spike on what region a sends (its nodes alike)
            return max((sp[1] for sp in (node_spike, region_spike) if sp is not None and sp[0] == a), default=0.0)

        def intra(r: str, nbytes: float) -> float:
            if shape[r] <= 1:
                return 0.0
            spiked = node_spike[1] if node_spike is not None and node_spike[0] == r else 0.0
            return (shape[r] - 1) * (k.hop_latency[r] + nbytes * k.hop_per_byte[r]) + spiked

        def chain(start: str) -> dict[str, float]:
            end = {r: 0.0 if r == start else -math.inf for r in shape}
            for nbytes, exchange in rounds:
                clock = {r: end[r] + intra(r, nbytes) for r in shape}
                if exchange:
                    sent = dict(clock)
                    for a, b in k.pairs:
                        clock[b] = max(clock[b], sent[a] + k.x_fixed[a, b] + extra(a) + nbytes * k.x_per_byte[a, b])
                for step in range(2 * (R - 1) if not exchange else 0):
                    sent = dict(clock)
                    for a in ring:
                        clock[k.nxt[a]] = max(clock[k.nxt[a]], sent[a] + k.fixed[a] + extra(a)
                                              + nbytes * k.ring_per_byte[step][a])
                end = {r: clock[r] + intra(r, nbytes) for r in shape}
            return end
        return {start: chain(start) for start in shape}

    def _step_costs(self, shape: dict[str, int]) -> "StepCosts":
        key = tuple((r, n) for r in self.region_names if (n := shape.get(r, 0)) > 0)
        got = self._step_cache.get(key)
        if got is None:
            got = self._step_cache[key] = self._price_steps(dict(key))
        return got

    def _latency(self, a: str, b: str) -> float:
        key = (a, b)
        got = self._latency_cache.get(key)
        if got is None:
            got = self._latency_cache[key] = hardware.message_latency_s(self.scenario, a, b)
        return got

    def _price_steps(self, shape: dict[str, int]) -> "StepCosts":
        """What each step of the hierarchical all-reduce over `shape` (region -> members) costs
        one message, without spikes: inside region r a hop of B / n bytes (intra latency + B / n
        over a node's NIC); across regions, each step of the reduction's own plan
        (keel.collective, a region's nodes alike) priced message by message: its owners'
        overlapping chunks, each sharing the NICs and the links it crosses with the step's other
        messages as flows do (keel.hardware.shared_transfers_s; a link has one resource per
        direction), a region's piece as late as its slowest message. Until 7 Dec a link was
        split evenly between the ring edges routed over it; but the edge with more, smaller
        messages has more of the flows and finishes first (sweep member 2/25: the reduction
        +6.9 % against the emulated one)."""
        ring = self.region_ring(list(shape))
        R = len(ring)
        edges = list(zip(ring, ring[1:] + ring[:1])) if R > 1 else []
        fixed = {a: self._latency(a, b) for a, b in edges}
        pairs = [(a, b) for a in ring for b in ring if a != b]
        x_fixed = {(a, b): self._latency(a, b) for a, b in pairs}
        groups, scale = self.coarse_ring([[f"{r}/{i}" for i in range(shape[r])] for r in ring])
        names = [n for g in groups for n in g]
        ranks = ring_ranks(groups)

        def slowest(step: collective.Step) -> dict[tuple[str, str], float]:
            out: dict[tuple[str, str], float] = {}
            for m, x in zip(step.msgs, self._shared_per_byte(names, step, scale)):
                key = (region_of(names[m.src]), region_of(names[m.dst]))
                out[key] = max(out.get(key, 0.0), x)
            return out

        ring_per_byte: tuple[dict[str, float], ...] = ()
        x_per_byte: dict[tuple[str, str], float] = {}
        if R > 1:
            steps = [st for st in collective.plan_for(ranks, PLAN_LENGTH) if st.phase.startswith("inter-")]
            ring_per_byte = tuple({a: got.get((a, b), 0.0) for a, b in edges} for got in map(slowest, steps))
            exchange = next(st for st in collective.plan_for(ranks, PLAN_LENGTH, True)
                            if st.phase == "inter-exchange")
            got = slowest(exchange)
            x_per_byte = {p: got.get(p, 0.0) for p in pairs}
        hop_latency = {r: self._regions[r].intra_latency_ms / 1e3 for r in shape}
        hop_per_byte = {r: 1.0 / n / (self._regions[r].intra_gbit_s * GBIT) for r, n in shape.items()}
        return StepCosts(tuple(ring), dict(edges), pairs, hop_latency, hop_per_byte, fixed, ring_per_byte, x_fixed,
                         x_per_byte)

    def reduction_chains(self, active_per_region: dict[str, int]) -> dict[str, dict[str, tuple[float, float]]]:
        """Per active region r and region s: (the latency part of r's chain to s, that chain
        with the scenario's gradient bytes) in seconds (`chain_ends_s` at 0 bytes and at the
        bytes keel.wire gives; -inf where r's chain never reaches s), cached per membership
        shape. r's chain (`chains_s`) is the largest over s."""
        shape = tuple((r, n) for r in self.region_names if (n := active_per_region.get(r, 0)) > 0)
        got = self._chain_cache.get(shape)
        if got is None:
            rounds = wire.scenario_rounds(self.scenario)
            zero = self.chain_ends_s(dict(shape), [(0.0, x) for _, x in rounds])
            full = self.chain_ends_s(dict(shape), rounds)
            got = self._chain_cache[shape] = {r: {s: (zero[r][s], full[r][s]) for s in full[r]} for r in full}
        return got

    def nonfinite_skip_s(self, active_per_region: dict[str, int]) -> tuple[float, float]:
        """(latency, bytes) parts of the all-reduces a non-finite step does not run
        (keel.wire.flag_rounds: those after the flag's), in seconds."""
        rounds = wire.scenario_rounds(self.scenario)
        k = wire.flag_rounds(self.scenario.reduction.format, self.scenario.slot_count)
        zero = [(0.0, x) for _, x in rounds]
        latency = self.collective_s(active_per_region, zero) - self.collective_s(active_per_region, zero[:k])
        total = self.collective_s(active_per_region, rounds) - self.collective_s(active_per_region, rounds[:k])
        return max(0.0, latency), max(0.0, total - latency)

    # -- latency spikes
    def spike_delay_s(self, target: str, spike_s: float, active_per_region: dict[str, int],
                      members: Sequence[str] | None = None) -> float:
        """Extra time a latency spike of `spike_s` on `target` (a node or a region's links)
        adds to one all-reduce over `active_per_region` (`collective_s` with and without it).
        A node's spike delays only the node's own messages, so it is priced at node level
        (`node_collective_s` over the ring of `members`, the nodes holding slots, where given,
        a region of more than SPIKE_NODE_CAP cut down by `coarse_ring`; issue 25: priced as its
        region's worst chain, every message the region sends spiked, it was 25-80 % too long on
        generated clusters; until 7 Dec every node of a 512-node region was priced, 7 s a spike)."""
        region = region_of(target)
        if active_per_region.get(region, 0) == 0 or spike_s <= 0:
            return 0.0
        shape = tuple(sorted((r, n) for r, n in active_per_region.items() if n > 0))
        ring = tuple(self._spike_ring(target, dict(shape), members)) if is_node(target) else ()
        key = (ring or shape, target, round(spike_s, 9))
        got = self._spike_cache.get(key)
        if got is None:  # the spike strikes each all-reduce of the step (keel.wire)
            rounds = wire.scenario_rounds(self.scenario)
            if is_node(target):  # the node's own messages, not its region's: at node level
                groups, scale = self.coarse_ring(ring, keep=target, cap=SPIKE_NODE_CAP)
                cut = (tuple(groups), scale)
                quiet = self._ring_time_cache.get(cut)
                if quiet is None:
                    quiet = self._ring_time_cache[cut] = self.node_collective_s(groups, rounds, scale=scale)
                got = self.node_collective_s(groups, rounds, (target, spike_s), scale=scale) - quiet
            else:
                got = self.collective_s(dict(shape), rounds, (target, spike_s)) - self.collective_s(dict(shape), rounds)
            got = self._spike_cache[key] = max(0.0, got)
        return got

    def spike_chain_deltas_s(self, region: str, spike_s: float, active_per_region: dict[str, int]) -> dict[str, float]:
        """What a latency spike on `region`'s links adds to the chain of the step's all-reduces
        that starts in each active region (`chains_s` with and without it). A chain that starts
        in the spiked region crosses its sends more often than one that starts elsewhere
        (multiregion-46, block32: 1.2 s from ap-southeast, 0.8 s from the others, for 0.4 s),
        and which region starts the longest chain depends on whose compute ends last, so the
        step model adds these per region (twin/cost.py), not the largest to every step."""
        shape = tuple(sorted((r, n) for r, n in active_per_region.items() if n > 0))
        if dict(shape).get(region, 0) == 0 or spike_s <= 0:
            return {}
        key = (shape, region, round(spike_s, 9))
        got = self._chain_spike_cache.get(key)
        if got is None:
            rounds = wire.scenario_rounds(self.scenario)
            base = self.chains_s(dict(shape), rounds)
            spiked = self.chains_s(dict(shape), rounds, (region, spike_s))
            got = self._chain_spike_cache[key] = {r: max(0.0, spiked[r] - base[r]) for r in base}
        return got

    def _spike_ring(self, node: str, active: dict[str, int], members: Sequence[str] | None) -> list[tuple[str, ...]]:
        """The reduction's ring (keel.hardware.ring_members) over `members`, or, without them,
        over each active region's first nodes in scenario order with `node` among them."""
        if members is None or node not in members:
            chosen = []
            for r in self.scenario.regions:
                names = [f"{r.name}/{i}" for i in range(r.nodes)][:active.get(r.name, 0)]
                if r.name == region_of(node) and node not in names and names:
                    names[-1] = node
                chosen += names
            members = chosen
        return [tuple(g) for g in hardware.ring_members(self.scenario, members)]

    # -- moving state between nodes
    def reference_transfer_gbyte_s(self) -> float:
        """The transfer bandwidth the calibration's `state_transfer_gbyte_s` corresponds to: a
        copy between two nodes of the first region."""
        return self._regions[self.region_names[0]].intra_gbit_s * GBIT / 1e9


def build_graph(scenario: Scenario) -> nx.Graph:
    g = nx.Graph()
    for r in scenario.regions:
        g.add_node(r.name, kind="region")
        for i in range(r.nodes):
            name = f"{r.name}/{i}"
            g.add_node(name, kind="node", region=r.name, gpus=r.gpus_per_node, speed=r.speed)
            g.add_edge(name, r.name, latency_s=r.intra_latency_ms / 2e3,
                       bandwidth_bytes_s=r.intra_gbit_s * GBIT, jitter_s=0.0)
    for link in scenario.links:
        g.add_edge(link.a, link.b, latency_s=link.rtt_ms / 2e3,
                   bandwidth_bytes_s=link.gbit_s * GBIT, jitter_s=link.jitter_ms / 1e3)
    return g
