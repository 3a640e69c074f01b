"""Issue 28 (and 25, part 2): what a run needs of this machine, decided before any process
starts. The decisions on given figures (the same verdict on any machine), and the refusal
path through the CLI with runs that fit no machine."""
from __future__ import annotations

import math
import subprocess

import pytest

from keel import capacity
from keel.capacity import Machine
from runtime_helpers import REPO, keel

pytestmark = pytest.mark.timeout(120)
TWO_CORES = Machine(cores=2, available_bytes=22_000_000_000, process_limit=None)  # the probe machine


def test_processes_and_memory():
    assert capacity.processes_fit(46, TWO_CORES) is None
    why = capacity.processes_fit(1030, TWO_CORES)  # the 1,000-node probe: it grew until a watchdog killed it
    assert why.startswith("1030 nodes need 1030 worker processes, about 41.8 GB") and "at most 535 nodes fit" in why
    limited = Machine(cores=2, available_bytes=10**12, process_limit=100)
    assert "at most 92 nodes fit" in capacity.processes_fit(200, limited)
    assert capacity.processes_fit(92, limited) is None


def test_time_scale_from_a_measured_slot():
    # multiregion-46 (44 training nodes, 6 s a slot at time scale 0.25) with a 13.5 ms slot on 2 cores: fits
    assert capacity.time_scale_fits(0.25, 0.0135, 6.0, 1.0, 44, 2) is None
    # the same cluster with 428 training nodes: 214 workers a core
    why = capacity.time_scale_fits(0.25, 0.0135, 6.0, 1.0, 428, 2)
    assert "needs time_scale >= 0.97 for the compute alone (--set emulation.time_scale=0.97 or more" in why
    # local-8: 20 ms a slot at time scale 1, 7 workers, a 4 ms slot measured on 2 cores: 28 ms needed
    assert "needs time_scale >= 1.4" in capacity.time_scale_fits(1.0, 0.004, 0.02, 1.0, 7, 2)
    assert capacity.time_scale_fits(1.4, 0.004, 0.02, 1.0, 7, 2) is None
    assert capacity.time_scale_fits(1.0, 0.004, 0.02, 1.0, 7, 16) is None  # a machine with cores enough
    assert capacity.min_time_scale(0.01, 1.0, 2.0, 1, 8) == pytest.approx(2 * 0.01 * 2.0)  # a faster region's nodes


def _refused(*args: str, out) -> str:
    p = subprocess.run(keel(*args, "--out", str(out)), capture_output=True, text=True, cwd=str(REPO), timeout=100)
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert not out.exists()  # nothing written, nothing started
    return p.stderr


def test_an_emulation_no_machine_keeps_is_refused_before_it_starts(tmp_path):
    # a slot given a nanosecond: no machine computes one that fast
    err = _refused("run", "scenarios/multiregion-46.toml", "--emulate", "--set", "workload.step_compute_s=1e-9",
                   "--steps", "3", out=tmp_path / "run")
    assert "is faster than this machine keeps" in err and "--set emulation.time_scale=" in err
    err = _refused("validate", "scenarios/multiregion-46.toml", "--set", "workload.step_compute_s=1e-9",
                   out=tmp_path / "validate")
    assert "refused before keel validate starts anything" in err


def test_a_cluster_no_machine_holds_is_refused_before_it_starts(tmp_path):
    err = _refused("run", "scenarios/multiregion-46.toml", "--emulate", "--set", "regions.0.nodes=99000",
                   "--steps", "3", out=tmp_path / "run")
    assert "99032 worker processes, about 3961.9 GB" in err and "nodes fit" in err


def test_an_unfaithful_emulated_run_exits_1(monkeypatch, tmp_path, capsys):
    """Its times are the machine's, not the emulated cluster's: not a result."""
    import runtime.api
    import runtime.capacity
    from keel.cli import main
    summary = {"scenario": "s", "steps": 3, "wall_s": 1.0, "step_time_s": 0.1, "goodput": 0.3, "restarts": 0,
               "faults": [], "losses": [2.0], "final_weights_sha256": "0" * 64,
               "emulation": {"time_scale": 1.0, "overruns": 9, "reports": 10, "overrun_fraction": 0.9,
                             "max_overrun_fraction": 0.02, "worst_late_s": 0.5, "compute_overruns": 9,
                             "warmup_late_s": 0.1, "faithful": False}}
    monkeypatch.setattr(runtime.capacity, "check_machine", lambda sc, what="keel run": None)
    monkeypatch.setattr(runtime.api, "run_scenario", lambda *a, **k: summary)
    assert main(["run", "scenarios/local-8.toml", "--emulate", "--out", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert "keel: run failed: the emulation was not faithful (9 of 10 step reports late, limit 2%)" in err
    summary["emulation"].update(overruns=0, overrun_fraction=0.0, faithful=True)
    assert main(["run", "scenarios/local-8.toml", "--emulate", "--out", str(tmp_path / "r")]) == 0


# ----------------------------------------------------------------------------- issue 25: the probe and "auto"

def test_the_probe_judges_the_whole_step():
    # local-8 (8 slots of 20 ms over 7 training nodes): its compute floor is 22.9 ms a step
    floor = capacity.step_floor_s(8, 0.02, [1.0] * 7)
    assert floor == pytest.approx(8 * 0.02 / 7)
    assert capacity.step_floor_s(4, 1.0, [1.0, 3.0]) == pytest.approx(1.0)  # a faster region takes more
    # 5 Dec: the slot check let time scale 1.7 through, yet a step took ~0.1 s of real work
    why = capacity.probe_fits(1.7, 0.106, floor, 7, 2)
    assert why.startswith("emulation.time_scale 1.7 is faster than this machine keeps: a step of 7 emulated "
                          "workers on 2 cores takes 106 ms of real work here")
    assert "needs time_scale >= 4.7;" in why and "--set emulation.time_scale=7 " in why
    assert capacity.probe_fits(4.7, 0.106, floor, 7, 2) is None
    assert capacity.probe_fits(0.25, 0.43, 2.0, 11, 2) is None  # multiregion-12: 0.43 s against 0.5 s


def test_the_step_floor_is_the_emulated_step_compute_and_reduction():
    """runtime/capacity.emulated_step_floor_s prices a fault-free step as the emulation does:
    at least the compute, plus the reduction over the scenario's links; a lower bound on the
    step the twin predicts from the same scenario (parity: the two accounts of one cluster)."""
    import twin
    from keel.scenario import load
    from runtime.capacity import emulated_step_floor_s, training_speeds
    for name in ("multiregion-12", "multiregion-46"):
        sc = load(REPO / "scenarios" / f"{name}.toml")
        compute = capacity.step_floor_s(sc.slot_count, sc.workload.step_compute_s, training_speeds(sc))
        floor = emulated_step_floor_s(sc)
        predicted = next(e for e in twin.simulate(sc).events if e.kind == "run_start").detail["step_time_s"]
        assert compute < floor <= predicted * 1.01 and floor > 0.9 * predicted, (name, compute, floor, predicted)
        # the reduction is priced on the links: ten times slower links between regions, a longer step
        slow = sc.with_overrides({f"links.{i}.gbit_s": link.gbit_s / 10 for i, link in enumerate(sc.links)})
        assert emulated_step_floor_s(slow) > floor + 0.5
    # sweep member 2/15 (6 Dec): 2.05 s of compute, a 9.1 s step; its 0.58 s of real work flat out
    # was set against the compute and ran it at time scale 0.7; the step's own need is 0.1 (auto adds
    # the stall's slack, stall_time_scale)
    from planner.scenario_gen import generate
    member, _ = generate(2, 15)
    assert emulated_step_floor_s(member) == pytest.approx(9.17, rel=0.01)
    assert capacity.auto_time_scale(capacity.probe_time_scale(0.584, emulated_step_floor_s(member))) == 0.1


def test_auto_picks_from_a_ladder_with_headroom():
    assert [capacity.ladder_up(x) for x in (0.0013, 0.1, 0.1001, 0.26, 1.0, 1.2, 6.7, 7.1)] == \
        [0.0015, 0.1, 0.15, 0.3, 1.0, 1.5, 7.0, 10.0]
    assert capacity.auto_time_scale(3.3) == 5.0  # 4.95 -> 5
    assert capacity.auto_time_scale(0.2) == 0.3
    # repeated measurements that move by +-20 % mostly land on one rung (a calibration holds for one scale)
    assert {capacity.auto_time_scale(x) for x in (2.1, 2.5, 3.0)} == {5.0}


def test_check_machine_with_given_measurements(monkeypatch, capsys):
    """runtime/capacity.check_machine on injected figures: the same verdict on any machine."""
    import runtime.capacity as rc
    from keel.errors import InputError
    from keel.scenario import load
    monkeypatch.setattr(rc.capacity, "this_machine", lambda: TWO_CORES)
    monkeypatch.setattr(rc, "slot_seconds", lambda *a: 0.004)
    probes = []
    monkeypatch.setattr(rc, "probe_step_seconds", lambda sc: probes.append(sc) or rc.Probe(0.074, 0.09, 1.2, 0.01))
    local8 = load(REPO / "scenarios" / "local-8.toml", ["emulation.enabled=true"])
    with pytest.raises(InputError, match="for the compute alone"):  # 1.0 < 1.4: no probe needed
        rc.check_machine(local8)
    assert probes == []
    # local-8's fault-free step is 24.9 ms as the emulation prices it (22.9 ms of compute, its reduction)
    with pytest.raises(InputError, match=r"needs time_scale >= 3; .*--set emulation\.time_scale=5 "):
        rc.check_machine(local8.with_overrides({"emulation.time_scale": 1.7}))
    assert rc.check_machine(local8.with_overrides({"emulation.time_scale": 3.5})).emulation.time_scale == 3.5
    chosen = rc.check_machine(local8.with_overrides({"emulation.time_scale": "auto"}))
    # auto keeps the slowest probed step and 0.3 s of slack: 0.39 s against 24.9 ms, x1.5: 23.5 -> 30
    assert chosen.emulation.time_scale == 30.0 and chosen.workload == local8.workload
    assert "emulation.time_scale auto -> 30" in capsys.readouterr().err
    assert rc.check_machine(load(REPO / "scenarios" / "local-8.toml")) .emulation.time_scale == 1.0  # not emulated


def test_auto_in_the_scenario_and_on_the_command_line(tmp_path):
    from keel.scenario import ScenarioError, load
    assert load(REPO / "scenarios" / "local-8.toml", ["emulation.time_scale=auto"]).emulation.time_scale == "auto"
    with pytest.raises(ScenarioError, match="key 'emulation.time_scale': expected a number or one of 'auto', got 'fast'"):
        load(REPO / "scenarios" / "local-8.toml", ["emulation.time_scale=fast"])
    p = subprocess.run(keel("run", "scenarios/local-8.toml", "--emulate", "--time-scale", "soon", "--out",
                            str(tmp_path / "r")), capture_output=True, text=True, cwd=str(REPO), timeout=60)
    assert p.returncode == 2 and "expected a positive number of wall seconds per emulated second or auto" in p.stderr


def test_validate_stops_at_an_unfaithful_repetition(monkeypatch, tmp_path):
    """Its times are this machine's: the twin is not judged, the later repetitions not run."""
    from keel.errors import RunFailed
    from keel.scenario import load
    from planner import validate as V
    runs = []

    def observe(sc, rep_dir, progress):
        runs.append(rep_dir)
        return {"emulation": {"time_scale": 0.25, "overruns": 40, "reports": 100, "max_overrun_fraction": 0.02,
                              "faithful": False}}
    monkeypatch.setattr(V, "observe", observe)
    sc = V.prepare(load(REPO / "scenarios" / "multiregion-12.toml"))
    with pytest.raises(RunFailed, match=r"validation stopped after repetition 1 of 3: its emulation was not "
                                        r"faithful \(40 of 100 step reports late, limit 2%\).*time_scale=0\.5"):
        V.runtime_observation(sc, 3, tmp_path, progress=False)
    assert len(runs) == 1


def test_a_relaunch_must_fit_restart_s():
    """checkpoint_restart: the relaunch's real work (about the probe's launch) inside restart_s."""
    # sweep member 7/0 (5 Dec): 8 workers, restart_s 18.4 at time scale 0.07: 1.29 s of wall for a relaunch that
    # took ~2.7 s here; refused, and auto would pick from the launch
    why = capacity.relaunch_fits(0.07, 2.7, 18.4, 8)
    assert why.startswith("emulation.time_scale 0.07 is faster than this machine keeps for policy.kind "
                          "checkpoint_restart: starting 8 emulated workers takes 2.7 s here")
    assert "needs time_scale >= 0.15 " in why
    assert capacity.relaunch_fits(0.15, 2.7, 18.4, 8) is None
    assert capacity.auto_time_scale(capacity.relaunch_time_scale(2.7, 18.4)) == 0.3


def test_auto_keeps_slack_for_a_stall_of_the_machine():
    # sweep member 1/8: 0.295 s of real work flat out, a 6.72 s step: in proportion alone 0.07 (a 0.47 s
    # step, which one 0.6 s stall overran); with 0.3 s of slack 0.15 (1.0 s of wall a step)
    assert capacity.auto_time_scale(capacity.probe_time_scale(0.295, 6.72)) == 0.07
    assert capacity.stall_time_scale(0.295, 6.72) == pytest.approx((0.295 + capacity.STALL_S) / 6.72)
    assert capacity.auto_time_scale(capacity.stall_time_scale(0.295, 6.72)) == 0.15
    slack = capacity.auto_time_scale(capacity.stall_time_scale(0.295, 6.72)) * 6.72 - 0.295
    assert slack > 0.6


def test_auto_keeps_the_detection_timeout_above_the_machines_stalls():
    # a 2 s timeout, a heartbeat every 0.5 s: 1.5 s of slack, which must hold 3 x the probe's worst
    # lateness (sweep member 1/19, 39 workers flat out: 118 ms) -> scale 0.236, 0.5 with auto's headroom
    assert capacity.detection_time_scale(0.118, 0.5, 2.0) == pytest.approx(3 * 0.118 / 1.5)
    assert capacity.auto_time_scale(capacity.detection_time_scale(0.118, 0.5, 2.0)) == 0.5
    # a quiet machine: the floor, 0.1 s of slack (0.15 s with the headroom)
    assert capacity.detection_time_scale(0.0006, 0.2, 1.0) == pytest.approx(0.1 / 0.8)
    assert capacity.auto_time_scale(capacity.detection_time_scale(0.0006, 0.2, 1.0)) == 0.2
    assert capacity.detection_time_scale(0.05, 0.25, 0.0) == 0.0  # no detection
    assert capacity.detection_time_scale(0.05, 1.0, 1.0) == math.inf  # a beat no sooner than the timeout


def test_the_probe_measures_heartbeat_lateness(tmp_path):
    """A real emulated run reports how late its members' beats came at the coordinator (wall
    seconds), the figure auto's detection need is built on."""
    from keel.scenario import load
    from runtime import api
    sc = load(REPO / "scenarios" / "local-8.toml", ["emulation.enabled=true", "emulation.time_scale=7"])
    summary = api.run_scenario(sc, tmp_path / "r", steps=6, no_faults=True, progress=False)
    late = summary["emulation"]["heartbeat_late_s"]
    assert 0.0 <= late < sc.policy.detect_timeout_s * 7  # no member lost: never as late as the timeout
