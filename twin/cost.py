"""The step-cost maths: what a step, a state copy and a checkpoint share cost for the cluster
as it is now (or for a trial layout), from TwinParams, the Topology and the Cluster.

`StepCost.shape` builds the `StepShape` (twin/steps.py) a segment of steps is drawn from: the
nodes' compute per group, the hierarchical reduction (twin/topology.py) scaled to the
calibration's reference membership, the per-step overhead, the host factor where the workers
share one machine's cores, and the delay of every unmitigated latency spike. Reads state,
never changes it (the caches and `memberships` aside).
"""
from __future__ import annotations

from collections import Counter

from keel.scenario import Scenario, spike_factor
from twin.cluster import Cluster, Node, Spike
from twin.params import TwinParams
from twin.steps import StepShape
from twin.topology import Topology


class StepCost:
    def __init__(self, scenario: Scenario, params: TwinParams, topology: Topology, cluster: Cluster):
        self.scenario = scenario
        self.params = params
        self.topology = topology
        self.cluster = cluster
        self.state_bytes = scenario.checkpoint.weights_bytes + scenario.checkpoint.optimizer_bytes
        self.memberships: set[int] = set()  # how many nodes held slots, in each layout it trained with
        self._shape_cache: tuple[int, StepShape] | None = None
        self._expected_cache: dict[tuple, float] = {}
        reference: dict[str, int] = {}  # the membership TwinParams' reduction figures refer to
        for n in cluster.order[: scenario.training_nodes]:
            reference[n.region] = reference.get(n.region, 0) + 1
        self.reference_reduction = topology.reduction(reference)
        self.healthy_step_s = self.expected_s(self.shape(with_spikes=False))

    # ------------------------------------------------------------------ steps
    def fault_free_step_s(self, holders: int) -> float:
        """The expected fault-free step with the run's slots placed over the first `holders`
        nodes in scenario order, as a fault-free run with that many training nodes has them,
        host sharing included."""
        c = self.cluster
        nodes = c.order[:holders]
        slots = {n.name: 0 for n in nodes} | dict(c.placement(c.slot_count, nodes, empty=True))
        return self.expected_s(self.shape(with_spikes=False, nodes=nodes, slots=slots))

    def current_shape(self) -> StepShape:
        """The step model for the cluster now (cached per layout version)."""
        c = self.cluster
        if self._shape_cache is None or self._shape_cache[0] != c.layout_version:
            self._shape_cache = (c.layout_version, self.shape())
            self.memberships.add(c.holders())
        return self._shape_cache[1]

    def expected_s(self, shape: StepShape) -> float:
        key = (shape.groups, shape.fixed_s, shape.floor_s)
        if key not in self._expected_cache:
            self._expected_cache[key] = shape.expected_s()
        return self._expected_cache[key]

    def shape(self, with_spikes: bool = True, nodes: list[Node] | None = None,
              slots: dict[str, int] | None = None) -> StepShape:
        """The step model for the cluster now, or for a trial layout (`nodes` with `slots`)."""
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
                groups[slots[n.name] * p.slot_compute_s / n.speed] += 1
            member_names = {n.name for n in members}
            per_region = c.active_per_region(members)

            def is_member(name: str) -> bool:
                return name in member_names
        red = self.topology.reduction(per_region)
        ref = self.reference_reduction
        hf = self.host_factor(sum(per_region.values()))
        if p.host_pace_per_worker is not None:
            # the workers share one machine: the calibrated reduction is that machine's, and how
            # it changes with the membership is the host factor's, not the scenario's topology
            latency, per_byte = p.reduce_latency_s * hf, hf / (p.reduce_gbyte_s * 1e9)
        else:
            latency = red.latency_s * (p.reduce_latency_s / ref.latency_s if ref.latency_s > 0 else 1.0)
            per_byte = red.s_per_byte * ((1.0 / (ref.s_per_byte * 1e9)) / p.reduce_gbyte_s if ref.s_per_byte > 0 else 1.0)
        spike = floor = 0.0
        if with_spikes:
            for sp in c.spikes.values():
                if sp.active and not sp.moves and ("/" not in sp.target or is_member(sp.target)):
                    delay = self.spike_delay(sp, per_region)
                    if p.spike_tail_s is None:  # uncalibrated: the delay adds to the whole step
                        spike = max(spike, delay)
                    else:  # the others' work overlaps the target's wait (see spiked_step_s)
                        floor = max(floor, self.spiked_step_s(sp, delay, hf, nodes, slots))
        fixed = latency + self.scenario.workload.gradient_bytes * per_byte + p.step_overhead_s * hf + spike
        if p.host_pace_per_worker is not None and groups:
            # workers time-sharing a machine's cores finish a step when the cores have done all
            # of its work: the compute is the slots' total spread evenly, whoever holds them
            # (a 3-2-2-1 layout steps as fast as 2-2-2-2 here, not one slot slower)
            holders = sum(groups.values())
            groups = Counter({sum(base * n for base, n in groups.items()) / holders: holders})
        return StepShape(tuple(sorted((n, base * hf) for base, n in groups.items())), p.compute_jitter,
                         fixed, latency, red.jitter_s, floor)

    def spiked_step_s(self, sp: Spike, delay: float, hf: float, nodes: list[Node] | None = None,
                      slots: dict[str, int] | None = None) -> float:
        """With a calibrated `spike_tail_s`: a spiked step lasts at least the target's compute,
        then the gate's delay, then the collective once everyone has reached it (the others
        compute and wait meanwhile, so their part of the step hides under the delay)."""
        if nodes is None:
            holders = [(n, n.slots) for n in self.cluster.spiked_holders(sp)]
        else:
            assert slots is not None
            holders = [(n, slots[n.name]) for n in nodes if slots[n.name] > 0
                       and (n.name == sp.target or ("/" not in sp.target and n.region == sp.target))]
        if not holders:
            return 0.0
        compute = max(k * self.params.slot_compute_s / n.speed for n, k in holders) * hf
        return compute + delay + self.params.spike_tail_s

    def host_factor(self, holders: int) -> float:
        """Workers sharing one machine's cores (calibrated `host_pace_per_worker`; None for
        independent nodes): the fault-free step relative to the reference membership's, per
        worker holding slots more or fewer. A sleep (a spike's delay) is not scaled."""
        slope = self.params.host_pace_per_worker
        if not slope or holders <= 0:
            return 1.0
        return max(0.05, 1.0 + slope * (holders - self.scenario.training_nodes))

    def spike_delay(self, spike: Spike, per_region: dict[str, int], step: int | None = None) -> float:
        """A spike's delay per step: its mean, or, for 0-based step `step`, the runtime's own
        draw for that step (`keel.scenario.spike_factor`, the slowest of the target's holders)."""
        factor = 1.0
        if step is not None:
            factor = max((spike_factor(self.scenario.run.seed, n.name, step)
                          for n in self.cluster.spiked_holders(spike)), default=1.0)
        rounds = self.params.spike_rounds
        if rounds is not None:  # calibrated: latency-bound rounds a spike delays per step
            touched = per_region.get(spike.target.split("/", 1)[0], 0) > 0
            return spike.spike_s * factor * rounds if touched else 0.0
        return self.topology.spike_delay_s(spike.target, spike.spike_s * factor, per_region)

    def probe_wait_s(self, sp: Spike) -> float:
        """Mean time from a spike's end to the straggler_window-th good probe: a standing-by
        straggler probes its path every heartbeat (each probe waits the gate's delay while the
        spike lasts). The first good probe comes after the probe in progress, if any, and a
        heartbeat, else after what is left of the heartbeat; then one a heartbeat."""
        h, d = self.params.heartbeat_s, sp.spike_s
        first = (d * (d / 2 + h) + h * (h / 2)) / (d + h) if d + h > 0 else 0.0
        return first + (self.scenario.policy.straggler_window - 1) * h

    # ------------------------------------------------------------------ moving state
    def transfer_s(self, receivers: list[tuple[str, int]]) -> float:
        """Slowest state copy of the slots' share of the state to each receiver."""
        if not receivers:
            return 0.0
        c = self.cluster
        scale = self.params.state_transfer_gbyte_s / self.topology.reference_transfer_gbyte_s()
        per_slot = self.state_bytes / c.slot_count

        def peer_regions(receiver: Node) -> set[str]:
            own = 1 if receiver.up and receiver.role in ("train", "parked") else 0
            return {r for r, k in c.live_per_region.items() if k - (own if r == receiver.region else 0) > 0}
        return max(k * per_slot / (self.topology.transfer_gbyte_s(name, peer_regions(c.nodes[name])) * scale * 1e9)
                   for name, k in receivers)

    def share_s(self, gbyte_s: float) -> float:
        """Seconds for each training node to move its share of the checkpoint."""
        holders = max(1, self.current_shape().holders)
        return self.state_bytes / holders / (gbyte_s * 1e9)
