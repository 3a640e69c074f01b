"""The hardware the scenario describes, as the twin and the runtime's emulation both read it
(standard library only): routes between regions, the order of the inter-region ring, the
bandwidth of a node, and how many bytes a node moves for a checkpoint or a state copy.

A route is the lowest-latency path over the scenario's `[[links]]` (Dijkstra; of equal-latency
paths the one found first in scenario link order): its one-way latency is the sum of the
links' rtt / 2, its jitter the root sum of squares of theirs. Inside a region two nodes are
`intra_latency_ms` apart; a message between regions also crosses half of each end's
intra-region latency (a node hangs off its region's switch).

The inter-region ring visits the active regions nearest-neighbour first, from the first of
them in scenario order (the greedy tour networkx's `greedy_tsp` builds; up to three regions
every order is the same ring).
"""
from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from keel.scenario import Scenario, region_of

GBIT = 1e9 / 8  # bytes per second in one Gbit/s


@dataclass(frozen=True, slots=True)
class Route:
    """The lowest-latency path from one region to another."""
    latency_s: float                   # one-way, over the links (switch to switch)
    hops: tuple[tuple[str, str], ...]  # the links crossed, each as (from, to)
    jitter_s: float                    # standard deviation of the one-way latency

    @property
    def links(self) -> tuple[frozenset, ...]:
        return tuple(frozenset(h) for h in self.hops)


def node_bytes_s(scenario: Scenario, region: str) -> float:
    """A node's network bandwidth in `region`, bytes/s."""
    return scenario.region(region).intra_gbit_s * GBIT


def link_bytes_s(scenario: Scenario, a: str, b: str) -> float:
    """The bandwidth of the link between regions a and b, bytes/s."""
    for link in scenario.links:
        if {link.a, link.b} == {a, b}:
            return link.gbit_s * GBIT
    raise KeyError(f"no link {a}-{b}")


def route(scenario: Scenario, a: str, b: str) -> Route:
    """The lowest-latency path from region a to region b (an empty route when a == b)."""
    if a == b:
        return Route(0.0, (), 0.0)
    adj: dict[str, list[tuple[str, float, float]]] = {}
    for link in scenario.links:
        one_way, jitter = link.rtt_ms / 2e3, link.jitter_ms / 1e3
        adj.setdefault(link.a, []).append((link.b, one_way, jitter))
        adj.setdefault(link.b, []).append((link.a, one_way, jitter))
    best: dict[str, float] = {a: 0.0}
    prev: dict[str, tuple[str, float]] = {}
    heap, order = [(0.0, 0, a)], 1
    done: set[str] = set()
    while heap:
        d, _, here = heapq.heappop(heap)
        if here in done:
            continue
        done.add(here)
        if here == b:
            break
        for there, w, jitter in adj.get(here, ()):
            if there not in done and d + w < best.get(there, math.inf):
                best[there] = d + w
                prev[there] = (here, jitter)
                heapq.heappush(heap, (d + w, order, there))
                order += 1
    if b not in done:
        raise ValueError(f"regions {a!r} and {b!r} are not connected")
    hops, jitters, here = [], [], b
    while here != a:
        back, jitter = prev[here]
        hops.append((back, here))
        jitters.append(jitter)
        here = back
    return Route(best[b], tuple(reversed(hops)), math.sqrt(sum(j * j for j in jitters)))


def region_ring(scenario: Scenario, regions: Iterable[str]) -> tuple[str, ...]:
    """The order in which the inter-region ring visits `regions` (any order in; scenario order
    first, then nearest neighbour by routed latency, ties to the earlier region)."""
    names = [r.name for r in scenario.regions]
    todo = sorted(set(regions), key=names.index)
    if len(todo) <= 3:
        return tuple(todo)
    ring = [todo.pop(0)]
    while todo:
        here = ring[-1]
        nxt = min(todo, key=lambda r: route(scenario, here, r).latency_s)
        todo.remove(nxt)
        ring.append(nxt)
    return tuple(ring)


def message_latency_s(scenario: Scenario, src_region: str, dst_region: str) -> float:
    """One-way latency of a message from a node of one region to a node of another (or of the
    same): the route's plus half of each end's intra-region latency."""
    if src_region == dst_region:
        return scenario.region(src_region).intra_latency_ms / 1e3
    half = (scenario.region(src_region).intra_latency_ms + scenario.region(dst_region).intra_latency_ms) / 2e3
    return route(scenario, src_region, dst_region).latency_s + half


def message_resources(scenario: Scenario, src: str, dst: str) -> tuple[tuple[tuple, float], ...]:
    """The (resource, bytes/s) a message from node `src` to node `dst` passes through: the
    sender's NIC, the receiver's, and each inter-region link on the route (one resource per
    direction: a link is full duplex)."""
    a, b = region_of(src), region_of(dst)
    out = [(("tx", src), node_bytes_s(scenario, a)), (("rx", dst), node_bytes_s(scenario, b))]
    if a != b:
        out += [(("link",) + hop, link_bytes_s(scenario, *hop)) for hop in route(scenario, a, b).hops]
    return tuple(out)


def shared_transfers_s(msgs: Sequence[tuple[str, str, float]],
                       resources: Callable[[str, str], Sequence[tuple[tuple, float]]]) -> list[float]:
    """Transfer seconds of each of `msgs` ((src node, dst node, bytes), sent together), every
    resource (`resources(src, dst)`: `message_resources`, or a cache of it) shared fairly among
    the messages crossing it, as flows share a link: with k of sizes s_1 <= ... <= s_k on a
    resource of bandwidth B, processor sharing finishes the j-th at
    (s_1 + ... + s_{j-1} + (k - j + 1) s_j) / B. A message's transfer is its slowest
    resource's. One formula for the runtime's link emulator (every message it sends) and the
    twin (each step of the reduction's plan)."""
    on: dict[tuple, list[float]] = {}
    for src, dst, size in msgs:
        for res, _ in resources(src, dst):
            on.setdefault(res, []).append(size)
    prefix: dict[tuple, tuple[list[float], list[float]]] = {}
    for res, sizes in on.items():
        sizes.sort()
        sums, acc = [], 0.0
        for x in sizes:
            sums.append(acc)
            acc += x
        prefix[res] = (sizes, sums)
    out = []
    for src, dst, size in msgs:
        worst = 0.0
        for res, bw in resources(src, dst):
            sizes, sums = prefix[res]
            j = bisect.bisect_left(sizes, size)  # the smaller ones finish first
            worst = max(worst, (sums[j] + (len(sizes) - j) * size) / bw)
        out.append(worst)
    return out


def state_bytes(scenario: Scenario) -> int:
    """Bytes of the training state (weights and optimizer state)."""
    return scenario.checkpoint.weights_bytes + scenario.checkpoint.optimizer_bytes


def checkpoint_share_bytes(scenario: Scenario, holders: int) -> float:
    """Bytes each of the `holders` nodes holding slots snapshots, writes or reads of one
    checkpoint: the state, spread evenly over them."""
    return state_bytes(scenario) / max(1, holders)


def state_copy_bytes(scenario: Scenario, slots: int) -> float:
    """Bytes of the state a node taking over `slots` slots receives: the slots' share of it."""
    return state_bytes(scenario) * slots / scenario.slot_count


def ring_members(scenario: Scenario, members: Iterable[str]) -> list[list[str]]:
    """`members` (node names) grouped by region, the regions in ring order (`region_ring`),
    each region's nodes in scenario order: the layout of the hierarchical reduction."""
    members = set(members)
    by_region: dict[str, list[str]] = {}
    for n in scenario.node_names:
        if n in members:
            by_region.setdefault(region_of(n), []).append(n)
    return [by_region[r] for r in region_ring(scenario, by_region)]
