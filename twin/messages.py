"""The reduction at the level of its messages (issue 25, 7 Dec): the plan's steps priced message
by message, every NIC and link direction shared among a step's messages as flows share them
(keel.hardware.shared_transfers_s, the link emulator's formula), and the links' jitter drawn per
message. A mixin of twin.topology.Topology, whose caches and scenario it reads."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from keel import collective, hardware, wire
from keel.scenario import region_of

JITTER_DRAWS = 256  # seeded draws of every message's jitter (Topology.jitter_delay_s)
NODE_LEVEL_CAP = 16  # a region's nodes priced one by one up to this many; a larger region as this
                     # many of its nodes sharing its NICs' capacity (MessageLevel.coarse_ring), so the
                     # cost of pricing a membership stays bounded on clusters of thousands of nodes
SPIKE_NODE_CAP = 32  # the same for a node's latency spike, whose price depends on the parts of the vector
                     # the node sends across regions, which a cut ring keeps only roughly (coarse_ring);
                     # a region of 4 x 32 costs a pricing 4 x the cap of 16 (2,048 nodes x 54 days 10 -> 16 s)
PLAN_LENGTH = 1 << 20  # the vector's elements in the plans the twin prices (bytes are per element of it)

Scale = tuple[tuple[str, int, int], ...]  # (region, its nodes, the cut ring's): coarse_ring


class MessageLevel:
    def jitter_delay_s(self, active: dict[str, int]) -> tuple[float, float]:
        """(mean, standard deviation) of what the links' jitter adds to one reduction of the
        scenario's bytes over `active` (region -> nodes). Each message between regions draws
        its latency normal around the route's, with the route's jitter as standard deviation
        (never below zero), as the emulation draws it and as a real network delays packets;
        a node goes on when the last of the messages it needs has come, so the reduction
        waits for the slowest of many draws and the links' jitter lengthens it on average,
        not only spreads it (until 7 Dec the twin took zero-mean noise: sweep member 2/0,
        its 5 ms links, -5.7 % against the emulated reduction's mean; +0.1 % with the jitter
        removed from both). By JITTER_DRAWS seeded draws over the reduction's plan at node
        level (`node_collective_s`, a large region cut down by `coarse_ring`), once per set of
        active regions, each with the nodes the scenario trains on in it: the delay comes from the
        routes the ring crosses, and a node more or less in a region moves it little."""
        regions = tuple(r for r in self.region_names if active.get(r, 0) > 0)
        if sum(active.get(r, 0) for r in regions) <= 1 or len(regions) < 2:
            return 0.0, 0.0
        got = self._jitter_cache.get(regions)
        if got is None:
            ring = self.region_ring(list(regions))
            if not any(self.route(a, b)[2] > 0 for a in ring for b in ring if a != b):
                got = (0.0, 0.0)
            else:
                # a region that trains nothing at the start (its nodes spares) with all its nodes
                trained = {r: self._trained[r] or self._regions[r].nodes for r in ring}
                groups, scale = self.coarse_ring([[f"{r}/{i}" for i in range(trained[r])] for r in ring])
                times = self.node_collective_s(groups, wire.scenario_rounds(self.scenario), draws=JITTER_DRAWS,
                                               scale=scale)
                extra = times[1:] - times[0]
                got = (float(extra.mean()), float(extra.std()))
            self._jitter_cache[regions] = got
        return got

    def _resources(self, src: str, dst: str) -> tuple[tuple[tuple, float], ...]:
        key = (src, dst)
        got = self._resource_cache.get(key)
        if got is None:
            got = self._resource_cache[key] = hardware.message_resources(self.scenario, src, dst)
        return got

    def _shared_per_byte(self, names: Sequence[str], step: collective.Step, scale: Scale = ()) -> list[float]:
        """Per message of a plan step (over PLAN_LENGTH elements, ranks named by `names`): its
        transfer in seconds per byte of the vector, every resource it crosses shared with the
        step's other messages (keel.hardware.shared_transfers_s, the emulation's formula), a
        node's NIC in a region `scale` cuts down from n to m nodes (`coarse_ring`) n / m times a node's."""
        resources = self._resources
        if scale:
            factor = {r: n / m for r, n, m in scale}

            def resources(src: str, dst: str) -> tuple[tuple[tuple, float], ...]:
                return tuple((res, bw * factor.get(region_of(res[1]), 1.0) if res[0] in ("tx", "rx") else bw)
                             for res, bw in self._resources(src, dst))
        return hardware.shared_transfers_s([(names[m.src], names[m.dst], m.length / PLAN_LENGTH) for m in step.msgs],
                                           resources)

    def _shared_cached(self, names: Sequence[str], exchange: bool, step: collective.Step, scale: Scale) -> list[float]:
        """`_shared_per_byte`, kept per membership and step (a spike is priced with and without)."""
        key = (tuple(names), exchange, step.index, scale)
        got = self._shared_cache.get(key)
        if got is None:
            if len(self._shared_cache) > 4096:
                self._shared_cache.clear()
            got = self._shared_cache[key] = self._shared_per_byte(names, step, scale)
        return got

    def coarse_ring(self, groups: Sequence[Sequence[str]], keep: str | None = None,
                    cap: int = NODE_LEVEL_CAP) -> tuple[list[tuple[str, ...]], Scale]:
        """The ring `groups` (node names by region, keel.hardware.ring_members) as the twin prices
        it at node level, with its cost bounded on clusters of thousands of nodes (the plan has
        about n^2 messages in a region of n): a region of up to `cap` nodes as it is; a larger
        one of n as `cap` of its nodes, evenly spaced, `keep` in its place, each with n / cap times
        a node's NIC (the region injects what its n nodes do, over as many flows as the cap),
        each hop of its ring (n - 1) / (cap - 1) of the whole ring's (`_plan_messages`, so the
        cut ring takes as long as the whole), and the scale: (region, n, cap) per region cut.
        A node's latency spike costs the cut ring about what it costs the whole one when the
        node keeps its place in the vector: its chunk (keel.collective: rank i owns chunk i + 1)
        starts where the node's does, so it sends across regions in the same steps (over random
        regions of 20-90 nodes cut to 16, a scratch script not kept: the median error 0.00 %, but a few spikes of 0.02-0.1 s
        off by 16-200 %, a slack on one ring that the other lacks; hence SPIKE_NODE_CAP)."""
        out: list[tuple[str, ...]] = []
        scale: list[tuple[str, int, int]] = []
        for g in groups:
            n = len(g)
            if n <= cap:
                out.append(tuple(g))
                continue
            cut = [g[i * n // cap] for i in range(cap)]
            if keep in g:  # where its chunk of the vector starts where the node's does (keel.collective)
                j = list(g).index(keep)
                at = (round((j + 1) % n * cap / n) - 1) % cap
                if keep in cut:
                    cut[cut.index(keep)] = cut[at]
                cut[at] = keep
            out.append(tuple(cut))
            scale.append((region_of(g[0]), n, cap))
        return out, tuple(scale)

    def _plan_messages(self, groups: Sequence[Sequence[str]], rounds: Sequence[tuple[float, bool]],
                       scale: Scale = ()):
        """The step's all-reduces at node level over the ring `groups` (keel.hardware.ring_members),
        plan step by plan step (keel.collective): per step, its messages as (sender, receiver,
        latency s, transfer s, the latency's jitter s), the ranks indexing the ring's nodes. An
        intra hop costs what `_step_costs` gives it (all of it latency); a message across regions
        its route's latency and its transfer shared with the step's other messages
        (`_shared_per_byte`, the NICs of `scale`'s regions scaled: `coarse_ring`)."""
        names = [n for g in groups for n in g]
        regions = [region_of(n) for n in names]
        costs = self._step_costs({region_of(g[0]): len(g) for g in groups})
        stretch = {r: 1.0 for r in costs.hop_latency}  # a cut region's hop: (n - 1) / (m - 1) of the whole's
        per_byte = dict(costs.hop_per_byte)            # hops, each of B / n
        for r, n, m in scale:
            stretch[r], per_byte[r] = (n - 1) / (m - 1), costs.hop_per_byte[r] * m / n
        ranks = ring_ranks(groups)
        for nbytes, exchange in rounds:
            for step in collective.plan_for(ranks, PLAN_LENGTH, exchange):
                if step.phase.startswith("intra"):
                    yield [(m.src, m.dst, stretch[a] * (costs.hop_latency[a] + nbytes * per_byte[a]), 0.0, 0.0)
                           for m in step.msgs for a in (regions[m.src],)]
                    continue
                shared = self._shared_cached(names, exchange, step, scale)
                yield [(m.src, m.dst, costs.x_fixed[a, b], nbytes * shared[i], self.route(a, b)[2])
                       for i, m in enumerate(step.msgs) for a, b in ((regions[m.src], regions[m.dst]),)]

    def node_collective_s(self, groups: Sequence[Sequence[str]], rounds: Sequence[tuple[float, bool]],
                          spike: tuple[str, float] | None = None, draws: int = 0, scale: Scale = ()):
        """The step's all-reduces at node level over the ring `groups` (`_plan_messages`), every
        node starting at 0 and a receiver going on when its own previous step and the piece are
        done; a latency spike `(node, seconds)` added to the node's messages. With `draws`, an
        array: the time on quiet links, then `draws` times with every message between regions
        drawing its latency's jitter (the route's, normal, the latency never below zero; seeded,
        so the same each call)."""
        names = [n for g in groups for n in g]
        if not names:
            return np.zeros(1 + draws) if draws else 0.0
        spiked, spike_s = (names.index(spike[0]), spike[1]) if spike and spike[0] in names else (-1, 0.0)
        rng = np.random.default_rng(0) if draws else None
        # one clock per node: a float, or with draws an array (quiet links first, then the draws)
        clock = [np.zeros(1 + draws) if draws else 0.0 for _ in names]
        for msgs in self._plan_messages(groups, rounds, scale):
            sent = list(clock)
            for src, dst, latency, transfer, jitter in msgs:
                if rng is not None and jitter > 0:
                    latency = np.maximum(0.0, latency + jitter * np.concatenate(([0.0], rng.standard_normal(draws))))
                cost = latency + transfer
                if src == spiked:
                    cost = cost + spike_s
                clock[dst] = np.maximum(clock[dst], sent[src] + cost) if draws else max(clock[dst], sent[src] + cost)
        return np.max(clock, axis=0) if draws else max(clock)


def ring_ranks(groups: Sequence[Sequence[str]]) -> tuple[tuple[int, ...], ...]:
    """The ranks of the ring `groups` by region, numbered in ring order (keel.collective's input)."""
    ranks, first = [], 0
    for g in groups:
        ranks.append(tuple(range(first, first + len(g))))
        first += len(g)
    return tuple(ranks)
