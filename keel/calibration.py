"""The calibration file (`calibration.json`, written by `keel calibrate`, read by the twin):
its names and units, one primitive's record, and reading, checking and writing it. Standard
library only: the twin reads the file, the planner writes it, neither owns its format.

    {"format": "keel-calibration", "format_version": 1, "created": ISO time, "machine": {...},
     "versions": {...}, "reference": {"scenario", "nodes", "time_scale", ...}, "duration_s": s,
     "missing": [names], "runtime_failures": [...],
     "primitives": {NAME: {"median": x, "spread": [min, max], "iqr": [q1, q3],
                           "samples": [...], "n": k, "unit": "s" | "GB/s" | ..., ...}}}

A reader takes `primitives.NAME.median` of the names it knows (`NAMES`) and ignores the rest.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Mapping, Sequence

from keel.errors import InputError, read_input

FORMAT = "keel-calibration"
FORMAT_VERSION = 1
FILENAME = "calibration.json"

# what `keel calibrate` measures (the real part of an emulated run: planner/calibrate_fit.py)
MEASURED = {"reform_s": "s", "spare_takeover_s": "s", "coordinator_restart_s": "s", "coordinator_reform_s": "s"}
# every primitive the twin takes from a calibration where it has one (twin/params.py says what
# each is); the rest of a calibration's names are ignored
UNITS = {
    "slot_compute_s": "s", "step_overhead_s": "s", "reduce_latency_s": "s", "reduce_gbyte_s": "GB/s",
    "detect_kill_s": "s", "detect_rack_s": "s", "reform_s": "s",
    "state_transfer_gbyte_s": "GB/s", "spare_takeover_s": "s", "ckpt_snapshot_gbyte_s": "GB/s",
    "ckpt_write_gbyte_s": "GB/s", "ckpt_read_gbyte_s": "GB/s", "restart_s": "s",
    "coordinator_restart_s": "s", "coordinator_reform_s": "s",
}
NAMES = tuple(UNITS)
RATES = frozenset({"reduce_gbyte_s", "state_transfer_gbyte_s", "ckpt_snapshot_gbyte_s",
                   "ckpt_write_gbyte_s", "ckpt_read_gbyte_s", "slot_compute_s"})  # must be > 0


class CalibrationError(InputError):
    """A calibration file or dict that cannot be used; the message names the file and key."""


def unit(name: str) -> str:
    return UNITS.get(name, "s")


def entry(samples: Sequence[float], unit: str, **extra: Any) -> dict[str, Any]:
    """One primitive's record: its median, range, quartiles and every sample."""
    xs = sorted(float(x) for x in samples)
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0], xs[0], xs[0]]
    return {"median": statistics.median(xs), "spread": [xs[0], xs[-1]], "iqr": [q[0], q[2]],
            "samples": [float(x) for x in samples], "n": len(xs), "unit": unit, **extra}


def median(calibration: Mapping[str, Any] | None, name: str) -> float | None:
    """`primitives.NAME.median`, None where the calibration (or the name) is absent."""
    if not calibration:
        return None
    e = calibration.get("primitives", {}).get(name)
    return float(e["median"]) if e else None


def medians(calibration: Any, source: str = "calibration", names: Sequence[str] = NAMES) -> dict[str, float]:
    """The checked median of every primitive in `names` that the calibration has; any problem
    is a CalibrationError naming `source` and the key."""
    if not isinstance(calibration, dict):
        raise CalibrationError(f"{source}: expected a JSON object, got {type(calibration).__name__}")
    primitives = calibration.get("primitives")
    if not isinstance(primitives, dict):
        raise CalibrationError(f"{source}: key 'primitives': expected an object of measured primitives, got {primitives!r}")
    out = {}
    for name in names:
        if name not in primitives:
            continue
        e = primitives[name]
        key = f"primitives.{name}.median"
        if not isinstance(e, dict) or "median" not in e:
            raise CalibrationError(f"{source}: key '{key}': missing; expected an object with a 'median'")
        value = e["median"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise CalibrationError(f"{source}: key '{key}': expected a finite number, got {value!r}")
        if value < 0 or (value == 0 and name in RATES):
            kind = "positive" if name in RATES else "non-negative"
            raise CalibrationError(f"{source}: key '{key}': expected a {kind} number, got {value!r}")
        out[name] = float(value)
    return out


def load(path: str | Path) -> dict:
    """Read a calibration.json; any problem is a CalibrationError naming the file."""
    path = Path(path)
    text = read_input(path, "calibration", CalibrationError)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CalibrationError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    medians(data, str(path))
    return data


def write(calibration: Mapping[str, Any], path: str | Path) -> Path:
    """Write it atomically (a reader never sees half a file): `keel.rundir.write_json`."""
    from keel.rundir import write_json
    return write_json(path, calibration)


def table(calibration: Mapping[str, Any]) -> str:
    """The calibration for a terminal: one line per measured primitive."""
    ref = calibration.get("reference", {})
    lines = [f"calibration on {calibration['machine']['hostname']} ({calibration['machine']['cpu_count']} CPUs, "
             f"torch {calibration['versions']['torch']}), {calibration['duration_s']} s; "
             f"{ref.get('scenario', '?')} emulated ({ref.get('nodes', '?')} nodes, time scale {ref.get('time_scale', '?')})"]
    for name, e in calibration["primitives"].items():
        lines.append(f"  {name:<24} {e['median']:>12.6g} {e['unit']:<5} range [{e['spread'][0]:.4g}, "
                     f"{e['spread'][1]:.4g}]  n={e['n']}")
    for name in calibration.get("missing", []):
        lines.append(f"  {name:<24} (not measured: no run gave a sample)")
    lines.append("  everything else: the scenario's (an emulated cluster's hardware is the scenario's)")
    return "\n".join(lines)
