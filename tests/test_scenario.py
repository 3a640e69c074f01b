"""The scenario language: loading, overrides, hashing and every class of error."""
import json
import subprocess
import sys

import pytest

from keel import scenario as S
from keel.cli import main
from conftest import SCENARIOS, keel_cmd

MINIMAL = """
[[regions]]
name = "a"
nodes = 2
[[regions]]
name = "b"
nodes = 3
[[links]]
a = "a"
b = "b"
"""


def test_example_scenarios_load():
    big = S.load(SCENARIOS / "multiregion-46.toml")
    assert big.total_nodes == 46 and len(big.regions) == 4
    assert [r.nodes for r in big.regions] == [14, 12, 12, 8]
    assert all(r.gpus_per_node == 8 for r in big.regions)
    assert big.checkpoint.weights_bytes == 1_200_000_000_000
    assert big.checkpoint.optimizer_bytes == 480_000_000_000
    hw = [e for e in big.faults.schedule if e.class_ == "hardware_fault"]
    assert len(hw) == 1 and hw[0].at_step < 20
    local = S.load(SCENARIOS / "local-8.toml")
    assert local.total_nodes == 8 and local.policy.hot_spares == 1
    # every class but the coordinator's loss and the cut (scenarios/partition-12.toml has cuts)
    assert {e.class_ for e in local.faults.schedule} >= set(S.FAULT_CLASSES) - {"coordinator_loss", "network_partition"}


def test_coordinator_loss_in_the_schema():
    """A fifth fault class: drawn at faults.coordinator_loss.per_day (default off), scheduled with
    no target or target "coordinator", its successor's time in policy.coordinator_restart_s."""
    s = S.loads(MINIMAL)
    assert s.faults.coordinator_loss.per_day == 0.0 and s.policy.coordinator_restart_s == 1.0
    text = MINIMAL + ('[faults.coordinator_loss]\nper_day = 2.5\n[policy]\ncoordinator_restart_s = 4.0\n'
                      '[[faults.schedule]]\nat_step = 1\nclass = "coordinator_loss"\n'
                      '[[faults.schedule]]\nat_step = 2\nclass = "coordinator_loss"\ntarget = "coordinator"\n')
    s = S.loads(text)
    assert s.faults.coordinator_loss.per_day == 2.5 and s.policy.coordinator_restart_s == 4.0
    assert [(e.class_, e.target) for e in s.faults.schedule] == [("coordinator_loss", None),
                                                                 ("coordinator_loss", "coordinator")]
    assert S.loads(S.dumps(s)).config_hash() == s.config_hash() == S.from_dict(s.plain()).config_hash()
    keys = {key for key, _, _ in S.describe_schema()}
    assert {"faults.coordinator_loss.per_day", "policy.coordinator_restart_s"} <= keys


def test_defaults_fill_everything_but_regions():
    s = S.loads(MINIMAL)
    assert s.run.steps == 1000 and s.policy.kind == "absorb"
    assert s.slot_count == 5 and s.node_names == ["a/0", "a/1", "b/0", "b/1", "b/2"]


def test_override_reaches_into_arrays_and_wins_over_file():
    s = S.loads(MINIMAL, overrides=["regions.1.nodes=10", "policy.kind=checkpoint_restart",
                                    "run.name=what-if", "links.0.rtt_ms=3"])
    assert s.regions[1].nodes == 10 and s.policy.kind == "checkpoint_restart"
    assert s.run.name == "what-if" and s.links[0].rtt_ms == 3.0


def test_config_hash_is_canonical_and_sensitive():
    a, b = S.loads(MINIMAL), S.loads(MINIMAL.replace('name = "a"\nnodes = 2', 'nodes = 2\nname = "a"'))
    assert a.config_hash() == b.config_hash()
    assert len(a.config_hash()) == 64 and int(a.config_hash(), 16) >= 0
    c = S.loads(MINIMAL, overrides=["regions.0.nodes=3"])
    assert c.config_hash() != a.config_hash()
    assert S.diff_configs(a.to_dict(), c.to_dict()) == ["regions.0.nodes: 2 -> 3"]


def test_dump_and_dict_round_trip():
    for name in ("local-8.toml", "multiregion-46.toml"):
        s = S.load(SCENARIOS / name)
        assert S.loads(S.dumps(s)).config_hash() == s.config_hash()
        assert S.from_dict(s.to_dict()).config_hash() == s.config_hash()


@pytest.mark.parametrize("text, overrides, expected", [
    ("[run\nname=1", [], "TOML syntax error"),
    (MINIMAL + "[run]\nstepz = 3\n", [], "key 'run.stepz': unknown key; did you mean 'steps'?"),
    (MINIMAL + "[polcy]\n", [], "key 'polcy': unknown key; did you mean 'policy'?"),
    (MINIMAL, ["links.0.rtt_s=4"], "key 'links.0.rtt_s': unknown key; did you mean 'rtt_ms' (milliseconds)?"),
    (MINIMAL, ["run.steps=many"], "key 'run.steps': expected an integer, got 'many'"),
    (MINIMAL, ["workload.step_compute_s='1s'"], "key 'workload.step_compute_s': expected a number (seconds), got '1s'"),
    (MINIMAL, ["run.steps=0"], "key 'run.steps': expected a positive value"),
    (MINIMAL, ["regions.0.nodes=-1"], "key 'regions.0.nodes': expected a positive value"),
    (MINIMAL, ["links.0.b=mars"], "key 'links.0.b': expected one of the regions (a, b), got 'mars'"),
    (MINIMAL, ["regions.7.nodes=1"], "key 'regions.7' (from --set regions.7.nodes): expected an index below 2"),
    (MINIMAL, ["checkpoint.mode=lazy"], "key 'checkpoint.mode': expected one of 'async', 'sync'"),
    (MINIMAL, ["policy.hot_spares=5"], "key 'policy.hot_spares': expected fewer than the cluster's 5 nodes"),
    (MINIMAL, ["policy.straggler_factor=0.5"], "key 'policy.straggler_factor': expected a factor above 1.0"),
    (MINIMAL.replace('[[links]]\na = "a"\nb = "b"\n', ""), [], "regions 'a' and 'b' are not connected"),
    (MINIMAL + '[[faults.schedule]]\nat_step = 1\nclass = "hardware_fault"\ntarget = "a/9"\n', [],
     "key 'faults.schedule.0.target': expected a node 'region/i'"),
    (MINIMAL + '[[faults.schedule]]\nat_step = 1\nclass = "hardware_fualt"\ntarget = "a/0"\n', [],
     "did you mean 'hardware_fault'?"),
    (MINIMAL + '[[faults.schedule]]\nat_step = 1\nclass = "partial_cluster_loss"\ntarget = "c"\n', [],
     "key 'faults.schedule.0.target': expected a region name"),
    (MINIMAL + '[[faults.schedule]]\nat_step = 1\nclass = "data_shard_skew"\ntarget = "shard/99"\n', [],
     "expected 'shard/N' with N below data.shards (16)"),
    (MINIMAL + '[[faults.schedule]]\nat_step = 1\nclass = "partial_cluster_loss"\ntarget = "a"\nnodes = 3\n', [],
     "region 'a' has 2 nodes, cannot lose 3"),
    ("[run]\nsteps = 3\n", [], "key 'regions': missing"),
    (MINIMAL + '[[faults.schedule]]\nat_step = 1\nclass = "coordinator_loss"\ntarget = "a/0"\n', [],
     "key 'faults.schedule.0.target': expected 'coordinator' (or no target) for a coordinator_loss, got 'a/0'"),
    (MINIMAL + '[[faults.schedule]]\nat_step = 1\nclass = "hardware_fault"\n', [],
     "key 'faults.schedule.0.target': missing; a hardware_fault needs one (a node 'region/i')"),
    (MINIMAL + '[[faults.schedule]]\nat_step = 1\nclass = "coordinator_los"\n', [],
     "did you mean 'coordinator_loss'?"),
    (MINIMAL, ["faults.coordinator_loss.per_day=-1"], "key 'faults.coordinator_loss.per_day': expected a non-negative"),
    (MINIMAL, ["faults.coordinator_loss.per_day=1e6"], "key 'faults.coordinator_loss.per_day': expected drawn faults at most 1"),
    (MINIMAL, ["faults.coordinator_loss.nodes=2"], "key 'faults.coordinator_loss.nodes': unknown key"),
    (MINIMAL, ["policy.coordinator_restart_s=0"], "key 'policy.coordinator_restart_s': expected a positive value (seconds), got 0"),
])
def test_errors_name_file_and_key(text, overrides, expected):
    with pytest.raises(S.ScenarioError) as err:
        S.loads(text, "my.toml", overrides)
    message = str(err.value)
    assert message.startswith("my.toml: ")
    assert expected in message
    assert "\n" not in message


def test_cli_bad_input_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(MINIMAL + "[run]\nseed = 'x'\n")
    proc = subprocess.run(keel_cmd("simulate", str(bad)), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"keel: {bad}: key 'run.seed': expected an integer, got 'x'"
    assert "Traceback" not in proc.stderr
    missing = subprocess.run(keel_cmd("simulate", str(tmp_path / "nope.toml")), capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "no such scenario file" in missing.stderr
    bad_set = subprocess.run(keel_cmd("simulate", str(SCENARIOS / "local-8.toml"), "--set", "regions"),
                             capture_output=True, text=True, timeout=60)
    assert bad_set.returncode == 2 and "expected dotted.key=value" in bad_set.stderr


def test_inputs_that_used_to_end_in_tracebacks_exit_2_with_one_line(tmp_path, capsys):
    """A scenario file that is not UTF-8 (UnicodeDecodeError), a negative seed (numpy's
    ValueError), an empty run name, a directory given as the scenario: exit 2 and one line
    naming the input, never a traceback."""
    latin = tmp_path / "latin.toml"
    latin.write_bytes(MINIMAL.encode() + b'[run]\nname = "r\xe9gion"\n')
    local = str(SCENARIOS / "local-8.toml")
    cases = [
        (["simulate", str(latin)], f"{latin}: not UTF-8 text (byte "),
        (["simulate", local, "--seed", "-1"], "argument --seed: expected a non-negative integer, got -1"),
        (["simulate", local, "--set", "run.seed=-1"], "key 'run.seed': expected a non-negative value, got -1"),
        (["simulate", local, "--set", "run.name="], "key 'run.name': expected a non-empty name"),
        (["simulate", str(tmp_path)], f"{tmp_path}: is a directory; expected a scenario file"),
    ]
    for argv, message in cases:
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 2, (argv, err)
        assert message in err and "Traceback" not in err and err.count("\n") == 1, (argv, err)


def test_keel_imports_nothing_heavy():
    code = ("import sys, keel.cli, keel.scenario, keel.events, keel.metrics; "
            "print(sorted(m for m in ('torch','simpy','streamlit','networkx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_version_and_a_bad_flag_name_the_command(capsys):
    assert main(["--version"]) == 0 and capsys.readouterr().out.startswith("keel ")
    assert main(["simulate", str(SCENARIOS / "local-8.toml"), "--bogus"]) == 2
    err = capsys.readouterr().err
    assert "--bogus" in err and err.rstrip().endswith("(see keel simulate --help)")
    assert main(["simulate", "--replicas", "0"]) == 2
    err = capsys.readouterr().err
    assert err == "keel: argument --replicas: expected a positive integer, got 0 (see keel simulate --help)\n"


def _subparsers(parser, prefix="keel"):
    import argparse
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prefix} {name}", sub
                yield from _subparsers(sub, f"{prefix} {name}")


def test_every_option_of_every_command_has_help_and_its_default():
    """`keel COMMAND --help` explains every option; where an option has a default, the help
    shows it (`default: ...`), or says what leaving it out means."""
    from keel.cli import build_parser
    commands = dict(_subparsers(build_parser()))
    assert {"keel simulate", "keel run", "keel plan", "keel validate", "keel report", "keel app",
            "keel data prepare", "keel ckpt verify", "keel demo", "keel scenario"} <= set(commands)
    for name, sub in commands.items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if action.dest in ("help", "command", "data_command", "ckpt_command"):
                continue
            assert action.help, f"{name} {action.option_strings or action.dest}: no help text"
            shown = formatter._get_help_string(action) % {"default": action.default}
            if action.default not in (None, False, []) and action.nargs != 0:
                assert "default" in shown, f"{name} {action.option_strings or action.dest}: default not shown"
