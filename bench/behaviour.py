"""Fingerprints of seeded runs, to show a refactoring changed no behaviour.

    .venv/bin/python bench/behaviour.py record FILE [--runtime]
    .venv/bin/python bench/behaviour.py compare FILE [--runtime]

The twin part runs `twin.simulate` on both scenarios under both policies, with drawn faults on
and off, a few seeds each, and hashes every event log (the twin is deterministic: the same
scenario and seed give the same events byte for byte). The runtime part (`--runtime`, ~1 min)
runs local-8 with its fault schedule and without it and records the final weights' sha256, the
per-step losses and the sequence of (kind, step, fault, target, action) of the event log (the
times move from run to run, and so does where a straggler's slots go, the coordinator sends
them to the workers it measured fastest, and whether they come back before the run ends). `compare` prints each
entry that differs and exits 1 if any does.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from keel.scenario import load  # noqa: E402

TWIN_CASES = [
    # (name, scenario, overrides, seeds)
    ("46-absorb", "multiregion-46.toml", [], [1, 2, 3]),
    ("46-restart", "multiregion-46.toml", ["policy.kind=checkpoint_restart"], [1, 2]),
    ("46-drawn", "multiregion-46.toml", ["faults.hardware_fault.mtbf_node_hours=2000",
                                         "faults.network_jitter.per_day=400",
                                         "faults.partial_cluster_loss.per_day=60",
                                         "faults.data_shard_skew.per_day=200"], [1, 2, 3]),
    ("46-drawn-restart", "multiregion-46.toml", ["policy.kind=checkpoint_restart",
                                                 "faults.hardware_fault.mtbf_node_hours=2000",
                                                 "faults.network_jitter.per_day=400"], [1, 2]),
    ("8-absorb", "local-8.toml", [], [1, 2]),
    ("8-restart", "local-8.toml", ["policy.kind=checkpoint_restart"], [1]),
    ("8-nospare", "local-8.toml", ["policy.hot_spares=0"], [1]),
]


def twin_fingerprints() -> dict[str, str]:
    import twin
    out = {}
    for name, file, overrides, seeds in TWIN_CASES:
        sc = load(REPO_ROOT / "scenarios" / file, overrides)
        for seed in seeds:
            events = twin.simulate(sc, seed=seed).events
            text = "\n".join(json.dumps(e.to_dict(), sort_keys=True) for e in events)
            out[f"twin/{name}/seed-{seed}"] = hashlib.sha256(text.encode()).hexdigest()
    return out


def runtime_fingerprints() -> dict[str, object]:
    from runtime.api import run_scenario
    sc = load(REPO_ROOT / "scenarios" / "local-8.toml", ["run.steps=50"])
    out: dict[str, object] = {}
    for name, no_faults in (("faults", False), ("no-faults", True)):
        with tempfile.TemporaryDirectory() as d:
            summary = run_scenario(sc, d, no_faults=no_faults, progress=False)
            rows = []
            for line in (Path(d) / "events.jsonl").read_text().splitlines():
                e = json.loads(line)
                if e["kind"] in ("step", "checkpoint_start", "checkpoint_end"):
                    continue
                rows.append([e["kind"], e["step"], e.get("fault"), e.get("target"), e.get("action")])
            out[f"runtime/{name}/sha256"] = summary["final_weights_sha256"]
            out[f"runtime/{name}/losses"] = hashlib.sha256(json.dumps(summary["losses"]).encode()).hexdigest()
            out[f"runtime/{name}/events"] = _robust(rows)
    return out


def _robust(rows: list) -> list:
    """A parked straggler comes back once its spike (`duration_s` of wall time) is over, so
    whether that lands before the run ends moves with the machine's pace: of a latency
    spike's episode, keep what precedes the move back."""
    out, jitter_reslots = [], 0
    for row in rows:
        if row[2] == "network_jitter" and row[0] in ("reslot", "recover_end"):
            jitter_reslots += row[0] == "reslot"
            if row[0] == "recover_end" or jitter_reslots > 1:
                continue
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/behaviour.py", description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("record", "compare"))
    p.add_argument("file")
    p.add_argument("--runtime", action="store_true", help="also run local-8 for real (~1 min)")
    args = p.parse_args(argv)
    now = twin_fingerprints()
    if args.runtime:
        now.update(runtime_fingerprints())
    path = Path(args.file)
    if args.mode == "record":
        path.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
        print(f"recorded {len(now)} fingerprints in {path}")
        return 0
    before = json.loads(path.read_text())
    for k in before:
        if k.endswith("/events"):
            before[k] = _robust(before[k])
    differ = [k for k in sorted(now) if k in before and before[k] != now[k]]
    same = [k for k in sorted(now) if k in before and before[k] == now[k]]
    for k in differ:
        print(f"DIFFERS {k}:\n  before {before[k]}\n  now    {now[k]}")
    print(f"{len(same)} of {len(same) + len(differ)} fingerprints unchanged"
          + (f"; {len(differ)} differ" if differ else ""))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
