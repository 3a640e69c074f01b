"""Fuzzing what a user types (issue 13): scenario files (keys, types, values, TOML syntax,
NaN and inf, zero and huge counts, duplicate and unknown regions and links) and the command
line (`--set` values, flags) of `keel simulate`, `keel run`, `keel plan` and `keel validate`.

The property: bad input ends in exit code 2 and one line on stderr that starts with `keel: `,
never a traceback, never a hang; input that is good gets as far as the work itself and no
further (the functions where work begins are replaced by one that raises `Launched`, so no
twin, run, plan or validation starts). Derandomized, so CI's verdict never moves.

Most examples call `keel.cli.main` in this process; a few subprocess runs show the real
command says the same.
"""
from __future__ import annotations

import copy
import datetime
import io
import json
import math
import subprocess
import tomllib
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import RELIABILITY_FULL, SCENARIOS, keel_cmd, reliability_count
from keel import scenario as S
from keel.cli import main

LOCAL = SCENARIOS / "local-8.toml"
BASE = tomllib.loads(LOCAL.read_text())
COMMANDS = ("simulate", "run", "plan", "validate")
SCALE = reliability_count(full=4, reduced=1)  # make reliability tries four times as many inputs
# `record` is made once per test, not per example: it sums over the examples, as meant
FUZZ = settings(derandomize=True, deadline=None, database=None, max_examples=150 * SCALE,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

pytestmark = [pytest.mark.timeout(1200 if RELIABILITY_FULL else 300), pytest.mark.reliability]


class Launched(Exception):
    """Raised where a command's work would begin: the input got through every check."""


@pytest.fixture(scope="module", autouse=True)
def no_work():
    """Every function where the four commands start work raises Launched instead."""
    import planner.search
    import planner.validate
    import runtime.api
    import twin

    def stop(*args, **kwargs):
        raise Launched

    patch = pytest.MonkeyPatch()
    for module, name in ((twin, "simulate"), (twin, "simulate_replicas"), (runtime.api, "run_scenario"),
                         (planner.validate, "validate"), (planner.search, "run_plan")):
        patch.setattr(module, name, stop)
    yield
    patch.undo()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def cli(argv: list[str]) -> tuple[int | None, str]:
    """(exit code, stderr) of `keel ARGV` in this process; code None: the work would start."""
    err = io.StringIO()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except Launched:
            code = None
    return code, err.getvalue()


def assert_refused_or_launched(argv: list[str]) -> tuple[int | None, str]:
    code, err = cli(argv)
    if code is None:
        assert err == "", (argv, err)
    else:
        assert code == 2, (argv, code, err)
        assert err.startswith("keel: ") and err.endswith("\n") and err.count("\n") == 1, (argv, err)
        assert "Traceback" not in err
    return code, err


# ----------------------------------------------------------------------------- TOML writing

def toml_value(v) -> str:
    """Any value as TOML (inline tables and arrays), NaN, inf and datetimes included."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # JSON's escapes are TOML's (a lone surrogate: a TOML error)
    if isinstance(v, (datetime.date, datetime.time)):
        return v.isoformat()
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise AssertionError(v)


def toml_document(d: dict) -> str:
    return "\n".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in d.items()) + "\n"


# ----------------------------------------------------------------------------- strategies

def _paths(node, prefix=()) -> list[tuple]:
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            out.append(prefix + (k,))
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.append(prefix + (i,))
            out += _paths(v, prefix + (i,))
    return out


def _schema_paths() -> list[tuple]:
    """Every key of the schema, arrays at their first element (keys local-8 leaves unset too)."""
    return [tuple(int(p) if p == "0" else p for p in key.replace("[]", ".0").split("."))
            for key, _, _ in S.describe_schema()]


PATHS = sorted(set(_paths(BASE)) | set(_schema_paths()), key=str)
DOTTED = sorted({".".join(str(p) for p in path) for path in PATHS})
REGIONS = [r["name"] for r in BASE["regions"]]

NASTY_NUMBERS = [0, -1, 1, 2 ** 63, 2 ** 64, 10 ** 30, -(10 ** 30), 10 ** 400, -(10 ** 400), 10 ** 11, 0.0, -0.0, 1e-300, 5e-324,
                 1e300, 1.7e308, math.nan, math.inf, -math.inf, 0.5, 1e12, 1e-9]
values = st.one_of(
    st.sampled_from(NASTY_NUMBERS),
    st.sampled_from(["", " ", "a/b", "x\ny", "é", "shard/²", "us-east", "us-east/9", "shard/99",
                     "hardware_fault", "network_jitter", "absorb", "sync", True, False]),
    st.sampled_from(REGIONS),
    st.integers(), st.floats(), st.text(max_size=12),
    st.sampled_from([datetime.date(1979, 5, 27), datetime.datetime(1979, 5, 27, 7, 32), datetime.time(7, 32)]),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.sampled_from(["a", "b", "name", "nodes", "x"]), st.integers(-2, 2), max_size=2),
)


def _set(doc: dict, path: tuple, value) -> None:
    node = doc
    for part in path[:-1]:
        if isinstance(node, list):
            if not isinstance(part, int) or part >= len(node):
                return
            node = node[part]
        elif isinstance(node, dict):
            node = node.setdefault(part, {})
        else:
            return
    if isinstance(node, dict):
        node[path[-1]] = value
    elif isinstance(node, list) and isinstance(path[-1], int) and path[-1] < len(node):
        node[path[-1]] = value


def _delete(doc: dict, path: tuple) -> None:
    node = doc
    for part in path[:-1]:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return
    try:
        del node[path[-1]]
    except (KeyError, IndexError, TypeError):
        pass


@st.composite
def mutated_scenarios(draw) -> dict:
    """local-8 with one to three mutations: a value replaced, a key removed, an unknown key,
    a region or link duplicated, a link to a region that does not exist, a table emptied."""
    doc = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["set", "set", "set", "delete", "unknown", "dup_region", "dup_link",
                                     "dangling_link", "rename_region", "empty"]))
        if kind == "set":
            _set(doc, draw(st.sampled_from(PATHS)), draw(values))
        elif kind == "delete":
            _delete(doc, draw(st.sampled_from(PATHS)))
        elif kind == "unknown":
            path = draw(st.sampled_from([p for p in PATHS if isinstance(p[-1], str)]))
            name = draw(st.one_of(st.text(min_size=1, max_size=8),
                                  st.sampled_from(["x\ny", "\t", "a.b", " ", "class_", "CLASS", "nodes "])))
            _set(doc, path[:-1] + (name,), draw(values))
        elif kind == "dup_region" and isinstance(doc.get("regions"), list) and doc["regions"]:
            doc["regions"].append(copy.deepcopy(draw(st.sampled_from(doc["regions"]))))
        elif kind == "dup_link" and isinstance(doc.get("links"), list) and doc["links"]:
            link = copy.deepcopy(draw(st.sampled_from(doc["links"])))
            if draw(st.booleans()) and isinstance(link, dict):
                link["a"], link["b"] = link.get("b"), link.get("a")
            doc["links"].append(link)
        elif kind == "dangling_link":
            doc.setdefault("links", []).append({"a": draw(st.sampled_from(REGIONS)),
                                                "b": draw(st.sampled_from(REGIONS + ["nowhere", ""]))})
        elif kind == "rename_region" and isinstance(doc.get("regions"), list) and doc["regions"]:
            region = draw(st.sampled_from(doc["regions"]))
            if isinstance(region, dict):
                region["name"] = draw(st.sampled_from(REGIONS + ["", "a/b", "x\ny"]))
        elif kind == "empty":
            doc[draw(st.sampled_from(sorted(BASE)))] = draw(st.sampled_from([{}, [], 0, ""]))
    return doc


@st.composite
def broken_toml(draw) -> str:
    """local-8's text with a character inserted, deleted or replaced, or cut short."""
    text = LOCAL.read_text()
    at = draw(st.integers(0, len(text) - 1))
    kind = draw(st.sampled_from(["insert", "delete", "replace", "truncate"]))
    char = draw(st.sampled_from(list("=[]{}\"'#.,\n\\ \t0") + ["\x00", "\x7f", "é", "nan", "inf"]))
    if kind == "insert":
        return text[:at] + char + text[at:]
    if kind == "delete":
        return text[:at] + text[at + 1:]
    if kind == "replace":
        return text[:at] + char + text[at + 1:]
    return text[:at]


set_values = st.one_of(
    st.sampled_from(["nan", "inf", "-inf", "-1", "0", "1e999", "1e308", "99999999999999999999999", "1e11",
                     "[1,2]", "{a=1}", '"', "", "0x10", "1979-05-27", "true", '"a/b"', "'x'", '"\\n"',
                     '"us-east"', '"shard/²"', "+nan", "1_000", "[]", "{}", "100000000000"]),
    st.text(max_size=12),
    st.integers().map(str),
    st.floats().map(repr),
)
set_keys = st.one_of(st.sampled_from(DOTTED), st.sampled_from(DOTTED).map(lambda k: k + ".x"),
                     st.text(max_size=10),
                     st.sampled_from(["regions.².nodes", "regions.١.nodes", "regions.-1.nodes", "regions.99.nodes",
                                      ".", "..", "run..steps", "links.0", "regions", "faults.schedule.3.target",
                                      "faults.schedule.0.class", "run.name", "regions.0.name", "links.1.b"]))
overrides = st.lists(st.one_of(st.tuples(set_keys, set_values).map(lambda kv: f"{kv[0]}={kv[1]}"),
                               st.text(max_size=8)), min_size=1, max_size=3)
flag_values = st.sampled_from(["0", "-1", "1", "3", "nan", "inf", "-inf", "1e999", "abc", "", "0.5",
                               "99999999999999999999", "١"])
FLAGS = {"simulate": ["--replicas", "--seed"], "run": ["--steps", "--time-scale"],
         "plan": ["--trials", "--replicas"], "validate": []}


# ----------------------------------------------------------------------------- properties

@FUZZ
@given(doc=mutated_scenarios())
@example(doc={**BASE, "run": {"name": datetime.date(1979, 5, 27)}})
@example(doc={**BASE, "workload": {"step_compute_s": 10 ** 400}})
@example(doc={**BASE, "regions": [{**BASE["regions"][0], "nodes": 10 ** 11}]})
@example(doc={**BASE, "data": {"shards": 10 ** 12}})
@example(doc={**BASE, "run": {"x\ny": 1}})
def test_a_scenario_loads_or_is_refused_in_one_line(doc, record):
    """The loader's verdict on any document: a Scenario that reads back from its own TOML,
    or a ScenarioError of one line naming the file; nothing else."""
    record(trials=1)
    try:
        sc = S.loads(toml_document(doc), "fuzz.toml")
    except S.ScenarioError as e:
        record(bad_inputs=1)
        message = str(e)
        assert message.startswith("fuzz.toml: ") and "\n" not in message and message.isprintable(), message
        return
    assert S.loads(S.dumps(sc), "again.toml") == sc


@FUZZ
@given(text=broken_toml())
def test_a_broken_file_is_refused_in_one_line(text, workdir, record):
    path = workdir / "broken.toml"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    for command in COMMANDS:
        code, _ = assert_refused_or_launched([command, str(path)])
        record(trials=1, bad_inputs=code == 2)


@FUZZ
@given(doc=mutated_scenarios(), command=st.sampled_from(COMMANDS))
def test_every_command_refuses_a_bad_scenario_before_any_work(doc, command, workdir, record):
    path = workdir / "mutated.toml"
    path.write_text(toml_document(doc))
    code, _ = assert_refused_or_launched([command, str(path)])
    record(trials=1, bad_inputs=code == 2)
    try:
        S.load(path)
        valid = True
    except S.ScenarioError:
        valid = False
    if not valid:
        assert code == 2  # no command starts on a scenario the loader refuses


@settings(FUZZ, max_examples=250 * SCALE)
@given(sets=overrides, command=st.sampled_from(COMMANDS),
       flags=st.lists(st.tuples(st.sampled_from(["simulate", "run", "plan", "validate"]), flag_values), max_size=2))
@example(sets=["regions.².nodes=3"], command="simulate", flags=[])
@example(sets=['faults.schedule.3.target="shard/²"'], command="run", flags=[])
@example(sets=["workload.step_compute_s=" + "9" * 400], command="plan", flags=[])
@example(sets=["regions.0.nodes=1e11"], command="validate", flags=[])
@example(sets=["faults.hardware_fault.repair_hours=1e-9"], command="simulate", flags=[])
@example(sets=["faults.hardware_fault.mtbf_node_hours=1e-9"], command="simulate", flags=[])
@example(sets=["faults.network_jitter.per_day=1e12"], command="plan", flags=[])
def test_set_values_and_flags_are_refused_in_one_line(sets, command, flags, record):
    argv = [command, str(LOCAL)]
    for text in sets:
        argv += ["--set", text]
    for owner, value in flags:
        if FLAGS[command] and owner == command:
            argv += [FLAGS[command][len(value) % len(FLAGS[command])], value]
    code, _ = assert_refused_or_launched(argv)
    record(trials=1, bad_inputs=code == 2)


@pytest.mark.parametrize("argv, message", [
    (["--set", "data.shards=1000000"], "key 'data.shards': expected at most 32,768 shards"),
    (["--set", "model.context=100000000"], "key 'model.context': expected a context shorter than a shard"),
    (["--steps", "1"], "--steps: expected at least 2 steps"),
])
def test_run_refuses_what_its_workers_would_refuse_before_any_starts(argv, message):
    """Found by hand beside the fuzzer: these ended as exit 1, "every worker process exited
    before joining the run", half a minute later (and --steps 1 in a traceback)."""
    code, err = cli(["run", str(LOCAL), *argv])
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_many_regions_are_checked_quickly():
    """A cluster of 2,000 one-node regions in a chain: the connectivity check is one search
    (it was one per pair of regions, 2 million of them)."""
    regions = [{"name": f"r{i}", "nodes": 1} for i in range(2000)]
    links = [{"a": f"r{i}", "b": f"r{i + 1}"} for i in range(1999)]
    sc = S.from_dict({"regions": regions, "links": links})
    assert sc.total_nodes == 2000
    with pytest.raises(S.ScenarioError, match="'r0' and 'r1000' are not connected"):
        S.from_dict({"regions": regions, "links": links[:999] + links[1000:]})


# ----------------------------------------------------------------------------- the real command

REAL_CASES = [
    ("run", "broken", "TOML syntax error"),
    ("plan", "--set regions.0.nodes=1e11", "key 'regions': expected at most 100,000 nodes in all"),
    ("validate", "duplicate region", "key 'regions.4.name': region 'us-east' is defined twice"),
    ("simulate", "newline key", r"key 'run.x\ny': unknown key"),
]


@pytest.mark.parametrize("command, case, message", REAL_CASES, ids=[c[1] for c in REAL_CASES])
def test_the_real_command_says_the_same(command, case, message, tmp_path):
    path = tmp_path / "scenario.toml"
    text, sets = LOCAL.read_text(), []
    if case == "broken":
        text = text.replace("[run]", "[run", 1)
    elif case == "duplicate region":
        text += '\n[[regions]]\nname = "us-east"\nnodes = 1\n'
    elif case == "newline key":
        text = text.replace("[run]\n", '[run]\n"x\\ny" = 1\n', 1)
    else:
        sets = case.split()
    path.write_text(text)
    argv = [command, str(path), *sets]
    proc = subprocess.run(keel_cmd(*argv), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
    assert message in proc.stderr and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert (2, proc.stderr) == cli(argv)
