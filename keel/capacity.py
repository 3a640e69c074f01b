"""What a run needs of this machine, checked before any process starts: one worker process per
node, their memory, and (emulated) enough cores for the real compute to keep the emulated
time. Pure decisions on given figures (`Machine`, a measured slot time), so a test gives the
same verdict on any machine; `this_machine()` reads the figures of the one it runs on.

A worker's memory is documented, not guessed: WORKER_BYTES is what one emulated worker
process added in issue 28's probe (5 Dec, 2-core 24 GB machine: +17.1 GB for the 439 processes
of a 400-node emulation of scenarios/multiregion-46.toml, 39 MB a process; with 1,000 nodes
about 18 MB a worker before the machine ran out). Forked workers share the fork server's
pages, so a worker's resident size (about 270 MB, docs/reliability.md's soak) overstates it.
"""
from __future__ import annotations

import math
import os
import resource
from dataclasses import dataclass

WORKER_BYTES = 40_000_000        # one worker process (see above)
BASE_BYTES = 600_000_000         # the supervisor, the coordinator and its standby, the fork server
CORE_MARGIN = 2.0                # real work beside a slot's compute (reduction, link emulation, the coordinator)
PROCS_BESIDE_WORKERS = 8         # the supervisor, coordinators, fork server, resource tracker, ...


@dataclass(frozen=True)
class Machine:
    cores: int                   # usable by this process (its CPU affinity)
    available_bytes: int         # memory available without swapping (MemAvailable)
    process_limit: int | None    # RLIMIT_NPROC left for this user (None: unlimited)


def this_machine() -> Machine:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    return Machine(cores, available, None if soft == resource.RLIM_INFINITY else int(soft))


def processes_fit(nodes: int, machine: Machine) -> str | None:
    """Why `nodes` worker processes do not fit `machine` (memory, process limit), or None."""
    need = BASE_BYTES + nodes * WORKER_BYTES
    if need > machine.available_bytes:
        fits = max(0, (machine.available_bytes - BASE_BYTES) // WORKER_BYTES)
        return (f"{nodes} nodes need {nodes} worker processes, about {need / 1e9:.1f} GB "
                f"({WORKER_BYTES // 1_000_000} MB a worker), and this machine has {machine.available_bytes / 1e9:.1f} GB "
                f"available: at most {fits} nodes fit")
    if machine.process_limit is not None and nodes + PROCS_BESIDE_WORKERS > machine.process_limit:
        fits = max(0, machine.process_limit - PROCS_BESIDE_WORKERS)
        return (f"{nodes} nodes need {nodes + PROCS_BESIDE_WORKERS} processes and this user may start "
                f"{machine.process_limit} (ulimit -u): at most {fits} nodes fit")
    return None


def min_time_scale(slot_s: float, step_compute_s: float, speed: float, workers: int, cores: int) -> float:
    """The smallest time scale at which `workers` emulated workers on `cores` cores keep their
    emulated time: a worker computes each of its slots for real in `slot_s` (measured here),
    slowed by sharing the cores when all compute at once, with CORE_MARGIN for the rest of a
    step's real work, and has `step_compute_s / speed x time_scale` of wall time per slot."""
    share = max(1.0, workers / max(1, cores))
    return CORE_MARGIN * slot_s * share * speed / step_compute_s


# ----------------------------------------------------------------------------- the probe's figure

# Compute is not all of a step's real work: the reduction's messages (gloo over loopback, each
# round waiting on its peer), the link emulator, the step reports and the coordinator's
# confirmations cost real time too, and on a shared machine mostly as latency, not CPU
# (local-8, 7 workers, 5 Dec: a 4-5 ms slot, yet 0.1-0.19 s of wall per step flat out). So the
# emulated cluster itself is run briefly before the real run (runtime/capacity.py: a few
# fault-free steps at a time scale no machine keeps, every step late), and the wall time its
# steps take here, `probe_step_s`, is set against the wall time the scenario gives a step: its
# fault-free step as the emulation prices it, compute and reduction (a worker's real work runs
# ahead of its emulated clock and waits only at the commit, runtime/emulation/node.py; until
# issue 25's sweep it was the compute alone, which ran fast-step members with slow links at
# scales set by their compute: member 1/16 at 2 on 6 Dec, 0.7 on 7 Dec).

AUTO_HEADROOM = 1.5              # "auto" picks this much above the measured need: the machine's load moves
STALL_S = 0.3                    # "auto": wall seconds of slack a step keeps for a stall of the whole machine
                                 # (see stall_time_scale)
SCALE_LADDER = (1.0, 1.5, 2.0, 3.0, 5.0, 7.0)  # "auto" picks from these x 10^k, so repeated picks agree
                                               # (a calibration holds for one time scale)


def step_floor_s(slots: int, step_compute_s: float, speeds: list[float]) -> float:
    """A lower bound on the emulated cluster's fault-free compute (emulated seconds): its
    slots' compute spread over the training nodes at their speeds (the slowest holder takes
    at least that). runtime/capacity.emulated_step_floor_s adds the reduction."""
    return slots * step_compute_s / sum(speeds)


def probe_time_scale(probe_step_s: float, floor_s: float) -> float:
    """The smallest time scale at which a step's measured real work (`probe_step_s`, wall
    seconds, flat out) fits the wall time the scenario gives the step (at least `floor_s`)."""
    return probe_step_s / floor_s


def stall_time_scale(slowest_s: float, floor_s: float) -> float:
    """The smallest time scale "auto" takes for a step's sake: the slowest probed step's real
    work (`slowest_s`, wall) and STALL_S of slack beside it in the wall time the scenario gives
    a step (at least `floor_s`). A worker waits for its step's emulated end only at the commit
    (runtime/emulation/node.py), so a stall of the machine shorter than a step's slack is
    absorbed, and a longer one makes every worker's report late and moves the emulated clock
    by stall / scale: at small scales a stall costs whole steps. Slack in proportion to the
    real work (AUTO_HEADROOM) leaves a step of little real work none: sweep member 1/8
    (6 Dec), 31 workers at scale 0.07, 0.3 s of real work in a 0.47 s step, lost its second
    repetition to one 0.6 s stall of the machine (31 reports late: unfaithful)."""
    return probe_time_scale(slowest_s + STALL_S, floor_s)


def probe_fits(time_scale: float, probe_step_s: float, floor_s: float, workers: int, cores: int) -> str | None:
    """Why the emulation cannot keep its time at `time_scale`, by the probe (with the scale that
    would do), or None."""
    need = probe_time_scale(probe_step_s, floor_s)
    if time_scale >= need:
        return None
    return (f"emulation.time_scale {time_scale:g} is faster than this machine keeps: a step of {workers} emulated "
            f"workers on {cores} cores takes {probe_step_s * 1000:.3g} ms of real work here (measured, a short "
            f"fault-free probe), and the scenario gives a step {floor_s * time_scale * 1000:.3g} ms of wall time "
            f"(a lower bound on its fault-free step); a faithful emulation needs time_scale >= "
            f"{round_up_scale(need):g}; with headroom for this machine's load: --set "
            f"emulation.time_scale={auto_time_scale(need):g} (or emulation.time_scale = \"auto\")")


def relaunch_time_scale(launch_s: float, restart_s: float) -> float:
    """The smallest time scale at which a checkpoint_restart relaunch's real work (stopping
    the workers, starting, warming up and grouping them again: about the probe's launch,
    `launch_s` wall seconds) fits the scenario's `policy.restart_s` (emulated seconds); the
    emulation absorbs it there, and counts a relaunch that outran it as unfaithful."""
    return launch_s / restart_s if restart_s > 0 else math.inf


def relaunch_fits(time_scale: float, launch_s: float, restart_s: float, workers: int) -> str | None:
    """Why a checkpoint_restart relaunch cannot keep its emulated `restart_s` at `time_scale`
    here (with the scale that would do), or None."""
    need = relaunch_time_scale(launch_s, restart_s)
    if time_scale >= need:
        return None
    return (f"emulation.time_scale {time_scale:g} is faster than this machine keeps for policy.kind "
            f"checkpoint_restart: starting {workers} emulated workers takes {launch_s:.3g} s here (measured), and "
            f"policy.restart_s {restart_s:g} gives a relaunch {restart_s * time_scale:.3g} s of wall time; a faithful "
            f"emulation needs time_scale >= {round_up_scale(need):g} (--set emulation.time_scale="
            f"{auto_time_scale(need):g}, or emulation.time_scale = \"auto\")")


DETECT_MARGIN = 3.0    # "auto": the detection timeout's slack (the timeout less one heartbeat period, in wall
DETECT_FLOOR_S = 0.1   # time) at least this many times the probe's worst heartbeat lateness, and at least
                       # this many wall seconds (x AUTO_HEADROOM, as every need)


def detection_time_scale(heartbeat_late_s: float, heartbeat_s: float, detect_timeout_s: float) -> float:
    """The smallest time scale "auto" takes for the heartbeat's sake. A member is declared lost
    when it goes unheard for detect_timeout_s x scale of wall time; unheard it is for its
    heartbeat period (heartbeat_s x scale) plus however late this machine delivers the beat.
    The probe measures that lateness where it is worst, every worker flat out
    (`heartbeat_late_s`, wall seconds, at the coordinator, whose own starvation counts too);
    the slack left for it must be DETECT_MARGIN times as much (the probe is short: the run
    meets rarer stalls) and at least DETECT_FLOOR_S. Before (issue 25) this was 1.5 x the
    slowest probed step and 1/3 s, a guess at the stall that a measurement now gives: on the
    46 sweep members of 7 Dec the beat came 0-90 ms late where steps took 36-633 ms flat out, so
    slow-step members ran at twice the scale they needed. An explicit scale is not refused
    on it: a false detection fails the run."""
    slack = detect_timeout_s - heartbeat_s
    if detect_timeout_s <= 0:
        return 0.0
    if slack <= 0:
        return math.inf
    return max(DETECT_MARGIN * heartbeat_late_s, DETECT_FLOOR_S) / slack


def ladder_up(x: float) -> float:
    """The smallest SCALE_LADDER value x 10^k at or above `x`."""
    e = math.floor(math.log10(x))
    for k in (e, e + 1):
        for rung in SCALE_LADDER:
            v = round(rung * 10.0 ** k, 12)
            if v >= x * (1 - 1e-12):
                return v
    raise AssertionError(x)


def auto_time_scale(need: float) -> float:
    """The time scale "auto" picks for a measured need: AUTO_HEADROOM above it, on the ladder."""
    return ladder_up(AUTO_HEADROOM * need)


def round_up_scale(x: float) -> float:
    """A time scale to suggest: `x` rounded up to two significant figures."""
    if x <= 0:
        return x
    e = math.floor(math.log10(x)) - 1
    return math.ceil(x / 10 ** e) * 10 ** e


def time_scale_fits(time_scale: float, slot_s: float, step_compute_s: float, speed: float, workers: int,
                    cores: int) -> str | None:
    """Why the emulation cannot keep its time at `time_scale` here (with the scale that would
    do), or None."""
    need = min_time_scale(slot_s, step_compute_s, speed, workers, cores)
    if time_scale >= need:
        return None
    return (f"emulation.time_scale {time_scale:g} is faster than this machine keeps: a slot's real compute "
            f"takes {slot_s * 1000:.3g} ms here (measured), {workers} workers share {cores} cores, and the "
            f"scenario gives a slot {step_compute_s / speed * time_scale * 1000:.3g} ms of wall time; "
            f"a faithful emulation needs time_scale >= {round_up_scale(need):g} for the compute alone "
            f"(--set emulation.time_scale={round_up_scale(need):g} or more; emulation.time_scale = \"auto\" "
            f"measures the whole step)")
