"""The twin's all-reduce and latency spikes against the emulated ones on members of the sweep's
family, without processes (a benchmark; issue 25): the runtime's own plan priced message by
message by its link emulator (tests/test_emulation.py::_emulated_collective_s) against
twin/topology.py, every node starting together.

    .venv/bin/python bench/sweep_parity.py [--seed 1] [--n 30] [--max-nodes 40] [--jitter-streams K]

Prints one line per member (the reduction, emulated and predicted) and per scheduled spike (its
delay to one step's all-reduces), then the median and the count within 5 %. The reduction of a
member whose links jitter is emulated on one jitter stream; with --jitter-streams K, also its
mean over K streams against the twin's quiet reduction plus its expected jitter delay
(Topology.jitter_delay_s), and the spreads.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from keel import wire  # noqa: E402
from planner.scenario_gen import generate  # noqa: E402
from test_emulation import _emulated_collective_s  # noqa: E402
from twin.model import Simulation  # noqa: E402
from twin.params import TwinParams  # noqa: E402
from twin.topology import Topology  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--max-nodes", type=int, default=40)
    ap.add_argument("--jitter-streams", type=int, default=0, metavar="K",
                    help="also emulate a jittery member's reduction over K jitter streams (default 0: not)")
    args = ap.parse_args(argv)
    reduction, spikes, overlap, jittery = [], [], [], []
    for i in range(args.n):
        sc, features = generate(args.seed, i, args.max_nodes)
        members = sc.node_names[: sc.training_nodes]
        active: dict[str, int] = {}
        for m in members:
            active[m.rsplit("/", 1)[0]] = active.get(m.rsplit("/", 1)[0], 0) + 1
        topo = Topology(sc)
        emulated = _emulated_collective_s(sc, members)
        twin = topo.reduction(active).seconds(wire.scenario_bytes(sc))
        reduction.append(abs(twin - emulated) / emulated)
        print(f"{args.seed}/{i} {sc.total_nodes} nodes, {len(active)} regions, {features['mesh']}: reduction "
              f"emulated {emulated:.3f} s, twin {twin:.3f} s ({(twin - emulated) / emulated:+.1%})")
        red = topo.reduction(active)
        if args.jitter_streams > 1 and red.jitter_delay_s > 0:
            draws = [_emulated_collective_s(sc, members, key=f"jitter-{k}") for k in range(args.jitter_streams)]
            mean, total = statistics.mean(draws), twin + red.jitter_delay_s
            jittery.append(abs(total - mean) / mean)
            print(f"    jitter over {args.jitter_streams} streams: emulated mean {mean:.3f} s (sd "
                  f"{statistics.stdev(draws):.3f}), twin {total:.3f} s ({(total - mean) / mean:+.1%}; sd "
                  f"{red.jitter_s:.3f}), twin without its jitter delay {twin:.3f} s ({(twin - mean) / mean:+.1%})")
        shape = Simulation(sc, TwinParams.from_scenario(sc), 1).cost.current_shape()
        cold = shape.expected_s() + shape.overlap_s
        overlap.append(shape.overlap_s / cold)
        print(f"    step from a common start {cold:.3f} s, steps that run on {shape.expected_s():.3f} s "
              f"({-shape.overlap_s / cold:+.1%})")
        for e in sc.faults.schedule:
            if e.class_ != "network_jitter" or ("/" in e.target and e.target not in members):
                continue
            s = e.spike_ms / 1e3
            em = _emulated_collective_s(sc, members, (e.target, s)) - emulated
            tw = topo.spike_delay_s(e.target, s, active, members)
            spikes.append(abs(tw - em) / em if em > 0 else 0.0)
            print(f"    spike {s:.3f} s on {e.target}: delay emulated {em:.3f} s, twin {tw:.3f} s")
    print(f"reduction: median |error| {statistics.median(reduction):.1%}, within 5 %: "
          f"{sum(x <= 0.05 for x in reduction)} of {len(reduction)}")
    print(f"steps that run on: {sum(x >= 0.05 for x in overlap)} of {len(overlap)} members 5 % or more below "
          f"the step from a common start (the twin's step until 6 Dec), largest {max(overlap):.1%}")
    if jittery:
        print(f"jittery reductions against the mean over {args.jitter_streams} streams: median |error| "
              f"{statistics.median(jittery):.1%}, within 1.5 %: {sum(x <= 0.015 for x in jittery)} of {len(jittery)}")
    if spikes:
        print(f"spikes: median |error| {statistics.median(spikes):.1%}, within 6 %: "
              f"{sum(x <= 0.06 for x in spikes)} of {len(spikes)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
