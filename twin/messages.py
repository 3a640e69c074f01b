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
                     # many equal nodes sharing its NICs' capacity (Topology._coarse), so the cost of
                     # pricing a membership stays bounded on clusters of thousands of nodes
PLAN_LENGTH = 1 << 20  # the vector's elements in the plans the twin prices (bytes are per element of it)


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
        level (`node_collective_s`, a region's nodes alike, `_coarse`), once per set of active
        regions, each with the nodes the scenario trains on in it: the delay comes from the
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
                names, _, resources = self._coarse({r: self._trained[r] or self._regions[r].nodes for r in regions})
                groups = [[n for n in names if region_of(n) == r] for r in ring]
                times = self.node_collective_s(groups, wire.scenario_rounds(self.scenario), draws=JITTER_DRAWS,
                                               resources=resources)
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

    def _shared_per_byte(self, names: Sequence[str], step: collective.Step, resources=None) -> list[float]:
        """Per message of a plan step (over PLAN_LENGTH elements, ranks named by `names`): its
        transfer in seconds per byte of the vector, every resource it crosses shared with the
        step's other messages (keel.hardware.shared_transfers_s, the emulation's formula)."""
        return hardware.shared_transfers_s([(names[m.src], names[m.dst], m.length / PLAN_LENGTH) for m in step.msgs],
                                           resources or self._resources)

    def _shared_cached(self, names: Sequence[str], exchange: bool, step: collective.Step, resources) -> list[float]:
        """`_shared_per_byte`, kept per membership and step (a spike is priced with and without)."""
        key = (tuple(names), exchange, step.index, resources is None)
        got = self._shared_cache.get(key)
        if got is None:
            if len(self._shared_cache) > 4096:
                self._shared_cache.clear()
            got = self._shared_cache[key] = self._shared_per_byte(names, step, resources)
        return got

    def _coarse(self, shape: dict[str, int]):
        """(node names in ring order, ranks per region, resources) for pricing the reduction
        over `shape` at node level, a region's nodes alike: up to NODE_LEVEL_CAP nodes a region
        as they are; a larger region of n as NODE_LEVEL_CAP nodes, each with n / NODE_LEVEL_CAP
        times a node's NIC (the region injects what its n nodes do, over as many flows as the
        cap)."""
        ring = self.region_ring(list(shape))
        names: list[str] = []
        ranks: list[tuple[int, ...]] = []
        factor: dict[str, float] = {}
        for r in ring:
            m = min(shape[r], NODE_LEVEL_CAP)
            factor[r] = shape[r] / m
            ranks.append(tuple(range(len(names), len(names) + m)))
            names += [f"{r}/{i}" for i in range(m)]
        if all(f == 1.0 for f in factor.values()):
            return names, ranks, self._resources

        def resources(src: str, dst: str) -> tuple[tuple[tuple, float], ...]:
            return tuple((res, bw * factor[region_of(res[1])] if res[0] in ("tx", "rx") else bw)
                         for res, bw in self._resources(src, dst))
        return names, ranks, resources

    def node_collective_s(self, groups: Sequence[Sequence[str]], rounds: Sequence[tuple[float, bool]],
                          spike: tuple[str, float] | None = None, draws: int = 0, resources=None):
        """The step's all-reduces at node level over the ring `groups` (keel.hardware.ring_members):
        the reduction's own plan (keel.collective), each message costing an intra hop (as
        `_step_costs` gives it) or, across regions, its latency and its transfer shared with the
        step's other messages (`_shared_per_byte`), a latency spike `(node, seconds)` added to
        the node's messages; every node starting at 0. With `draws`, an array: the time on quiet
        links, then `draws` times with every message between regions drawing its latency's
        jitter (the route's, normal, the latency never below zero; seeded, so the same each call).
        `resources`: the NICs' and links' bandwidths where not the nodes' own (`_coarse`)."""
        names = [n for g in groups for n in g]
        costs = self._step_costs({region_of(g[0]): len(g) for g in groups})
        ranks, first = [], 0
        for g in groups:
            ranks.append(tuple(range(first, first + len(g))))
            first += len(g)
        rng = np.random.default_rng(0) if draws else None
        # one clock per node: a float, or with draws an array (quiet links first, then the draws)
        clock = [np.zeros(1 + draws) if draws else 0.0 for _ in names]
        for nbytes, exchange in rounds:
            for step in collective.plan_for(tuple(ranks), PLAN_LENGTH, exchange):
                sent = list(clock)
                intra = step.phase.startswith("intra")
                shared = [] if intra else self._shared_cached(names, exchange, step, resources)
                for i, m in enumerate(step.msgs):
                    a, b = region_of(names[m.src]), region_of(names[m.dst])
                    if intra:
                        cost = costs.hop_latency[a] + nbytes * costs.hop_per_byte[a]
                    else:  # its share of the NICs and links the step's messages cross
                        latency = costs.x_fixed[a, b]
                        jitter = self.route(a, b)[2]
                        if rng is not None and jitter > 0:
                            latency = np.maximum(0.0, latency + jitter * np.concatenate(
                                ([0.0], rng.standard_normal(draws))))
                        cost = latency + nbytes * shared[i]
                    if spike is not None and names[m.src] == spike[0]:
                        cost = cost + spike[1]
                    clock[m.dst] = np.maximum(clock[m.dst], sent[m.src] + cost) if draws else \
                        max(clock[m.dst], sent[m.src] + cost)
        if draws:
            return np.max(clock, axis=0) if names else np.zeros(1 + draws)
        return max(clock, default=0.0)
