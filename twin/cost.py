"""The step-cost maths: what a step, a state copy and a checkpoint share cost for the cluster
as it is now (or for a trial layout), from TwinParams, the Topology and the Cluster.

`StepCost.shape` builds the `StepShape` (twin/steps.py) a segment of steps is drawn from: the
nodes' compute per group (region and load), each group with its region's chain of the
hierarchical reduction (twin/topology.py) scaled to the calibration's reference membership,
the per-step overhead, and the delay of every unmitigated latency spike. Reads state, never
changes it (the caches aside).
"""
from __future__ import annotations

from collections import Counter

from keel import hardware, recovery as R
from keel.scenario import Scenario, is_node, spike_factor
from twin.cluster import Cluster, Node, Spike
from twin.params import TwinParams
from twin.steps import StepShape, max_cycle_mean, next_end, settled_ends
from twin.topology import Topology


class StepCost:
    def __init__(self, scenario: Scenario, params: TwinParams, topology: Topology, cluster: Cluster):
        self.scenario = scenario
        self.params = params
        self.topology = topology
        self.cluster = cluster
        self.state_bytes = scenario.checkpoint.weights_bytes + scenario.checkpoint.optimizer_bytes
        self._shape_cache: tuple[int, StepShape] | None = None
        self._expected_cache: dict[tuple, float] = {}
        self._ends_cache: dict[tuple, dict[str, float]] = {}
        reference: dict[str, int] = {}  # the membership TwinParams' reduction figures refer to
        for n in cluster.order[: scenario.training_nodes]:
            reference[n.region] = reference.get(n.region, 0) + 1
        self.reference_reduction = topology.reduction(reference)
        self.healthy_step_s = self.expected_s(self.shape(with_spikes=False))

    # ------------------------------------------------------------------ steps
    def current_shape(self) -> StepShape:
        """The step model for the cluster now (cached per layout version)."""
        c = self.cluster
        if self._shape_cache is None or self._shape_cache[0] != c.layout_version:
            self._shape_cache = (c.layout_version, self.shape())
        return self._shape_cache[1]

    def expected_s(self, shape: StepShape) -> float:
        key = (shape.groups, shape.fixed_s)
        if key not in self._expected_cache:
            self._expected_cache[key] = shape.expected_s()
        return self._expected_cache[key]

    def shape(self, with_spikes: bool = True, nodes: list[Node] | None = None,
              slots: dict[str, int] | None = None, without: Spike | None = None) -> StepShape:
        """The step model for the cluster now, or for a trial layout (`nodes` with `slots`);
        every active spike in it but `without`."""
        p = self.params
        c = self.cluster
        if nodes is None:
            groups = c.groups
            per_region = dict(c.holders_per_region)

            def is_member(name: str) -> bool:
                n = c.nodes[name]
                return n.up and n.role == "train" and n.slots > 0
        else:
            assert slots is not None
            groups = Counter()
            members = [n for n in nodes if slots[n.name] > 0]
            for n in members:
                groups[(n.region, slots[n.name] * p.slot_compute_s / n.speed)] += 1
            member_names = {n.name for n in members}
            per_region = c.active_per_region(members)

            def is_member(name: str) -> bool:
                return name in member_names
        red = self.topology.reduction(per_region)
        lat_scale, byte_scale = self._reduction_scales()
        # each region's slowest node starts the reduction's chains from its region: a group's
        # offset is its region's chain (Topology.chains_s), scaled as the calibration scales
        # the reduction
        ends = {r: {s: zero * lat_scale + (full - zero) * byte_scale for s, (zero, full) in row.items()}
                for r, row in self.topology.reduction_chains(per_region).items()}
        offset = {r: max(row.values()) for r, row in ends.items()}
        spike = 0.0  # a node's spike: its delay to the step (node level); a region's: per region's chain
        spiked: dict[str, float] = {}
        if with_spikes:
            for sp in c.spikes.values():
                if not sp.active or sp is without or not c.spiked_holders(sp):  # parked: delays no one
                    continue
                if not is_node(sp.target):
                    for r, d in self.topology.spike_chain_deltas_s(sp.target, sp.spike_s, per_region).items():
                        spiked[r] = max(spiked.get(r, 0.0), d)
                elif is_member(sp.target):
                    spike = max(spike, self.spike_delay(sp, per_region, members=[n for n in c.nodes if is_member(n)]))
        offset = {r: o + spiked.get(r, 0.0) for r, o in offset.items()}
        a = self._cycle(groups, ends, spiked)
        return StepShape(tuple(sorted((n, base, offset.get(region, 0.0)) for (region, base), n in groups.items())),
                         p.compute_jitter, p.step_overhead_s + spike + red.jitter_delay_s, red.latency_s * lat_scale,
                         red.jitter_s, self._overlap_s(a),
                         tuple((u, tuple(row.items())) for u, row in a.items()) if len(a) > 1 else ())

    @staticmethod
    def _cycle(groups: Counter, ends: dict[str, dict[str, float]],
               spiked: dict[str, float]) -> dict[str, dict[str, float]]:
        """a[u][v]: region u's slowest compute (its spike's delay too) + its reduction chain to
        region v's result, without the compute jitter (which the draws keep)."""
        compute: dict[str, float] = {}
        for (region, base), _ in groups.items():
            compute[region] = max(compute.get(region, 0.0), base)
        return {r: {s: compute.get(r, 0.0) + spiked.get(r, 0.0) + t for s, t in row.items()} for r, row in ends.items()}

    @staticmethod
    def _overlap_s(a: dict[str, dict[str, float]]) -> float:
        """What a step saves when the one before it ran on (issue 25): a region starts its next
        step as soon as it has its own result, not when the last region has, so steps that
        run on settle to the max-plus cycle mean of `a` (twin/steps.py `max_cycle_mean`), below
        the step from a common start, max over regions of compute + chain (sweep member 1/6:
        1.41 s against 1.53 s; the emulation ran 1.44 s)."""
        if len(a) < 2:
            return 0.0
        start = max(max(row.values()) for row in a.values())
        return max(0.0, start - max_cycle_mean(a))

    def checkpoint_s(self, writer_region: str | None, stall_s: float, write_s: float,
                     sync: bool) -> tuple[float, float, float]:
        """What a checkpoint taken at a commit costs (issue 25): the pause it adds to the step
        after it, when its writer starts that step and when the checkpoint is durable, all from
        the commit. The writer (the lowest rank) starts at its own result, which in a step that
        ran on its region has before the last region (`settled_ends`), stalls `stall_s` (sync:
        the write, `write_s` 0; async: the snapshot), and publishes once `write_s` more is
        written and the commit confirmed (runtime/protocol.py); a sync writer waits for that
        too. The others run on into the next step; it ends later only where the writer's
        region, starting late, is on its longest chain (`next_end`). One region: the pause is
        the stall (sync: the write)."""
        cycle = self.current_shape().cycle
        a = {u: dict(row) for u, row in cycle}
        if writer_region not in a:  # one region (or a writer holding no slot): everyone waits
            return stall_s, stall_s, stall_s + write_s
        ends = self._ends_cache.get(cycle)
        if ends is None:
            ends = self._ends_cache[cycle] = settled_ends(a)
        durable = max(0.0, ends[writer_region] + stall_s + write_s)
        free = durable if sync else ends[writer_region] + stall_s
        late = {**ends, writer_region: free}
        return max(0.0, next_end(a, late) - next_end(a, ends)), free, durable

    def _reduction_scales(self) -> tuple[float, float]:
        """How the calibration scales the topology's reduction: its latency part, its bytes part."""
        p, ref = self.params, self.reference_reduction
        lat_scale = p.reduce_latency_s / ref.latency_s if ref.latency_s > 0 else 1.0
        byte_scale = (1.0 / (ref.s_per_byte * 1e9)) / p.reduce_gbyte_s if ref.s_per_byte > 0 else 1.0
        return lat_scale, byte_scale

    def nonfinite_saving_s(self) -> float:
        """What a non-finite step does not spend of a step: the all-reduces after the one that
        carries the flag (Topology.nonfinite_skip_s), scaled as the calibration scales them."""
        latency, nbytes = self.topology.nonfinite_skip_s(dict(self.cluster.holders_per_region))
        lat_scale, byte_scale = self._reduction_scales()
        return latency * lat_scale + nbytes * byte_scale

    def spike_delay(self, spike: Spike, per_region: dict[str, int], step: int | None = None,
                    members: list[str] | None = None) -> float:
        """A spike's delay to one step (a node's: Topology.spike_delay_s; a region's: what its
        per-region chains, `shape`, add to the step's expectation now): at its mean, or,
        for 0-based step `step`, at the runtime's own draw for that step
        (`keel.scenario.spike_factor`): a node's own draw; for a region, the mean of its
        holders' draws (each node's messages carry its own draw, and which of them the
        reduction's longest chain crosses is not known in advance; the largest overstated the
        emulated steps by ~20 %)."""
        factor = 1.0
        if step is not None:
            draws = [spike_factor(self.scenario.run.seed, n.name, step) for n in self.cluster.spiked_holders(spike)]
            factor = sum(draws) / len(draws) if draws else 1.0
        if not is_node(spike.target):  # per region's chain (shape): what it adds to the step's expectation
            return factor * max(0.0, self.expected_s(self.shape()) - self.expected_s(self.shape(without=spike)))
        if members is None:
            members = [n.name for n in self.cluster.active() if n.slots > 0]
        return self.topology.spike_delay_s(spike.target, spike.spike_s * factor, per_region, members)

    def probe_wait_s(self, spike_s: float) -> float:
        """Mean time from a spike's end (of `spike_s`; 0: none was on when the probes began)
        to the straggler_window-th good probe: a standing-by straggler probes its path every
        heartbeat (each probe waits the gate's delay while the spike lasts). The first good
        probe comes after the probe in progress, if any, and a heartbeat, else after what is
        left of the heartbeat; then one a heartbeat."""
        h, d = self.params.heartbeat_s, spike_s
        first = (d * (d / 2 + h) + h * (h / 2)) / (d + h) if d + h > 0 else 0.0
        return first + (self.scenario.policy.straggler_window - 1) * h

    # ------------------------------------------------------------------ the compute in flight
    def compute_by_node(self) -> dict[str, float]:
        """Each slot holder's compute of one step now: slots x slot_compute_s / speed."""
        return {n.name: n.slots * self.params.slot_compute_s / n.speed for n in self.cluster.active() if n.slots > 0}

    def reformed_s(self, inflight: tuple[float, dict[str, float]] | None, now: float, formed_s: float) -> float:
        """The pause before the redone step of a generation formed `formed_s` after `now`: that,
        and what the compute in flight adds to it (`drain_s`)."""
        return formed_s + self.drain_s(inflight, now + formed_s)

    def drain_s(self, inflight: tuple[float, dict[str, float]] | None, formed_at: float) -> float:
        """What the compute in flight adds to a recovery whose group is formed at `formed_at`
        (issue 25): a worker learns of an abort only at its collective, so it first finishes
        the compute it is in (`inflight`: when the step started, each holder's compute), and
        only then redoes the step with its new slots. The redone step then ends at the latest
        holder's (its wait + its new compute), not at its slowest new compute alone; the
        difference, added to the pause."""
        new = self.compute_by_node()
        if inflight is None or not new:
            return 0.0
        start, old = inflight
        finish = max(max(0.0, start + old.get(n, 0.0) - formed_at) + c for n, c in new.items())
        return max(0.0, finish - max(new.values()))

    # ------------------------------------------------------------------ moving state
    def transfer_s(self, receivers: list[tuple[str, int]]) -> float:
        """The slowest state copy to `receivers` (node, slots it takes), each getting the slots'
        share of the state, all sent together by one up-to-date member: the first of the region
        keel.recovery.state_source_region picks, as the runtime picks it. A copy takes the
        route's latency plus its bytes over the narrowest of the sender's NIC, the links and
        the receiver's NIC, and never less than all the copies' bytes over the sender's NIC,
        which they share."""
        if not receivers:
            return 0.0
        c, sc = self.cluster, self.scenario
        taking = Counter(c.nodes[name].region for name, _ in receivers
                         if c.nodes[name].up and c.nodes[name].role in ("train", "parked"))
        regions = [r for r in self.topology.region_names if c.live_per_region.get(r, 0) - taking.get(r, 0) > 0]
        if not regions:
            return 0.0
        src = R.state_source_region(regions, [c.nodes[name].region for name, _ in receivers],
                                    lambda a, b: hardware.message_latency_s(sc, a, b))
        scale = self.params.state_transfer_gbyte_s / self.topology.reference_transfer_gbyte_s()
        nic = hardware.node_bytes_s(sc, src) * scale
        sizes = [(c.nodes[name].region, hardware.state_copy_bytes(sc, k)) for name, k in receivers]
        total = sum(b for _, b in sizes)
        worst = 0.0
        for region, nbytes in sizes:
            narrowest = min(nic, hardware.node_bytes_s(sc, region) * scale,
                            *(hardware.link_bytes_s(sc, *hop) * scale for hop in hardware.route(sc, src, region).hops))
            worst = max(worst, hardware.message_latency_s(sc, src, region) + max(total / nic, nbytes / narrowest))
        return worst

    def share_s(self, gbyte_s: float) -> float:
        """Seconds for each training node to move its share of the checkpoint."""
        holders = max(1, self.current_shape().holders)
        return self.state_bytes / holders / (gbyte_s * 1e9)
