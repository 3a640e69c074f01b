"""The link emulator: when a message of the emulated cluster arrives.

Every inter-node message of an emulated run (a piece of the hierarchical gradient reduction,
hier.py; a state copy to a node that is behind) is priced here from the scenario alone:

    arrival = t_send + one-way latency + jitter + spike + transfer

- **latency**: inside a region `intra_latency_ms`; between regions the routed links' rtt / 2
  plus half of each end's intra-region latency (keel.hardware.message_latency_s);
- **jitter**: per message, a normal draw with the route's `jitter_ms` (root sum of squares over
  its links) as standard deviation, from a stream seeded by (run seed, message key), so a
  replayed run draws the same; latency plus jitter never goes below zero;
- **spike**: the sender's injected latency spike for this step, if any (a node target delays
  every message it sends; a region target the messages its nodes send to other regions);
- **transfer**: the bytes the message stands for (the scenario's: the real payload times the
  scenario's bytes per real element) through every resource on its path, the sender's NIC,
  each inter-region link on the route (one resource per direction) and the receiver's NIC. The
  messages sent together (one step of a collective) share each resource fairly, by processor
  sharing (keel.hardware.shared_transfers_s, which the twin prices the reduction by too). A
  message's transfer is its slowest resource's.

The runtime never imports the twin: this is the runtime's own account of the hardware, built
on the same scenario and the same routes (keel.hardware).
"""
from __future__ import annotations

import functools
import hashlib
import math
from typing import Sequence

from keel import hardware
from keel.scenario import Scenario, region_of


_region = region_of


def gauss(seed: int, key: str) -> float:
    """A standard normal draw, a pure function of (seed, key) (Box-Muller over blake2b)."""
    digest = hashlib.blake2b(f"{seed}/{key}/jitter".encode(), digest_size=16).digest()
    u1 = (int.from_bytes(digest[:8], "big") + 1) / (2.0 ** 64 + 1)
    u2 = int.from_bytes(digest[8:], "big") / 2.0 ** 64
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


class LinkEmulator:
    """The scenario's network, message by message."""

    def __init__(self, scenario: Scenario):
        self.scenario = scenario
        self.seed = scenario.run.seed

    @functools.lru_cache(maxsize=None)
    def latency(self, src_region: str, dst_region: str) -> tuple[float, float]:
        """(mean one-way latency s, jitter s) between nodes of the two regions."""
        mean = hardware.message_latency_s(self.scenario, src_region, dst_region)
        jitter = 0.0 if src_region == dst_region else hardware.route(self.scenario, src_region, dst_region).jitter_s
        return mean, jitter

    @functools.lru_cache(maxsize=None)
    def resources(self, src: str, dst: str) -> tuple[tuple[tuple, float], ...]:
        """The (resource, bytes/s) a message from node src to node dst passes through
        (keel.hardware.message_resources)."""
        return hardware.message_resources(self.scenario, src, dst)

    def transfers(self, msgs: Sequence[tuple[str, str, float]]) -> list[float]:
        """Transfer seconds of each of `msgs` ((src node, dst node, bytes), sent together):
        keel.hardware.shared_transfers_s, the formula the twin prices the reduction's steps by."""
        return hardware.shared_transfers_s(msgs, self.resources)

    def arrival(self, t_send: float, src: str, dst: str, transfer_s: float, key: str,
                spike_s: float = 0.0) -> float:
        """When a message sent at `t_send` arrives (see the module's formula); `key` names the
        message uniquely within the run (its jitter draw)."""
        mean, jitter = self.latency(_region(src), _region(dst))
        lat = mean + (jitter * gauss(self.seed, key) if jitter > 0 else 0.0)
        return t_send + max(0.0, lat) + spike_s + transfer_s


class CollectivePricer:
    """Prices the messages of one collective plan (hier.py) for the sending rank: `members` are
    the generation's nodes by rank, `bytes_per_element` what one element of the real payload
    stands for. Before each collective the worker sets `key` (unique per collective in the
    run) and `spike_s`/`spike_scope` (its spike now: None, "node" or "region")."""

    def __init__(self, links: LinkEmulator, members: Sequence[str]):
        self.links = links
        self.members = list(members)
        self.bytes_per_element = 1.0
        self.key = ""
        self.spike_s = 0.0
        self.spike_scope: str | None = None
        self._per_element: dict = {}  # step -> {msg: seconds per element}

    def _transfers(self, step) -> dict:
        """Per message of `step`: its transfer seconds per element (shares are linear in size)."""
        got = self._per_element.get(step)
        if got is None:
            times = self.links.transfers([(self.members[m.src], self.members[m.dst], float(m.length)) for m in step.msgs])
            got = self._per_element[step] = dict(zip(step.msgs, times))
        return got

    def __call__(self, step, msg, t_send: float) -> float:
        src, dst = self.members[msg.src], self.members[msg.dst]
        transfer = self._transfers(step)[msg] * self.bytes_per_element
        spike = 0.0
        if self.spike_s > 0 and (self.spike_scope == "node" or _region(src) != _region(dst)):
            spike = self.spike_s
        return self.links.arrival(t_send, src, dst, transfer, f"{self.key}/{step.index}/{msg.src}>{msg.dst}", spike)
