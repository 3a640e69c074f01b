"""The fault-class registry (keel/fault_classes.py): a new class needs its entry and its
modules only; an unknown class is an error everywhere; no code outside a class's own modules
compares class names; and no source file outgrows 450 lines."""
from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

import twin
from keel import fault_classes as FC
from keel import recovery as R
from keel.metrics import open_at_end
from keel.scenario import ScenarioError, loads
from tests import toy_fault_kind as toy
from tests.runtime_helpers import scenario_text

REPO = Path(__file__).resolve().parents[1]
TOY = '''
[faults.toy_fault]
strength = 2.0

[[faults.schedule]]
at_step = 3
class = "toy_fault"
target = "b"
'''


def test_a_toy_class_is_picked_up_by_the_loader_the_twin_and_the_runtime():
    from runtime.coordinator import faults
    from runtime.inject import planned_faults
    text = scenario_text(steps=8, extra=TOY)
    with pytest.raises(ScenarioError, match="faults"):  # not registered: unknown
        loads(text)
    with FC.registered(toy.ENTRY):
        sc = loads(text)
        assert sc.faults.toy_fault.strength == 2.0 and "toy_fault" in FC.FAULT_CLASSES
        with pytest.raises(ScenarioError, match=r"faults.schedule.0.target': expected a region name"):
            loads(text.replace('target = "b"', 'target = "nowhere"'))
        with pytest.raises(ScenarioError, match=r"faults.toy_fault.strength': expected a positive"):
            loads(text.replace("strength = 2.0", "strength = 0.0"))
        assert R.action_for("toy_fault", "absorb", True) == "toy_absorb"
        assert R.action_for("toy_fault", "checkpoint_restart", True) == R.ENDURE_ACTION
        events = twin.simulate(sc).events
        toys = [(e.kind, e.step, e.target, e.action) for e in events if e.fault == "toy_fault"]
        assert toys[0] == ("fault", 3, "b", "toy_absorb") and [k for k, *_ in toys][-1] == "recover_end"
        assert open_at_end(events) == []
        planned = planned_faults(sc)
        assert [(p.cls, p.mode) for p in planned] == [("toy_fault", "toy")]
        toy.FIRED.clear()
        assert faults.fire(SimpleNamespace(), planned[0], 0) is False  # the coordinator's dispatch
        assert toy.FIRED == [("b", 0)]
    assert "toy_fault" not in FC.REGISTRY and "toy_fault" not in FC.FAULT_CLASSES
    with pytest.raises(ScenarioError):
        loads(text)


def test_an_unknown_class_is_an_error_never_another_classs_behaviour():
    from runtime.coordinator import injections
    from twin import fault_kinds
    for call in (lambda: FC.get("nope"), lambda: R.action_for("nope", "absorb", True),
                 lambda: fault_kinds.module("nope"), lambda: injections.module("nope")):
        with pytest.raises(ValueError, match="unknown fault class 'nope'"):
            call()


# ------------------------------------------------------------------ sources
PACKAGES = ("keel", "twin", "runtime", "planner", "app")


def _own_modules() -> set[Path]:
    """The registry and each class's twin and runtime module."""
    own = {REPO / "keel" / "fault_classes.py"}
    for fc in FC.classes():
        own |= {REPO / (fc.twin.replace(".", "/") + ".py"), REPO / (fc.runtime.replace(".", "/") + ".py")}
    return own


def _compared_names(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, class name) of every comparison with a fault class's name (==, !=, in, not in)."""
    names = set(FC.REGISTRY)

    def consts(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Constant) and node.value in names:
            return [node.value]
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [c for elt in node.elts for c in consts(elt)]
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                out += [(node.lineno, c) for c in consts(side)]
        elif isinstance(node, ast.match_case) and isinstance(node.pattern, ast.MatchValue):
            out += [(node.pattern.lineno, c) for c in consts(node.pattern.value)]
    return out


def test_no_string_comparison_on_a_class_name_outside_its_own_modules():
    own = _own_modules()
    found = [f"{path.relative_to(REPO)}:{line}: {name}"
             for pkg in PACKAGES for path in sorted((REPO / pkg).rglob("*.py")) if path not in own
             for line, name in _compared_names(ast.parse(path.read_text(), str(path)))]
    assert found == []


def test_the_source_search_finds_a_comparison():
    assert _compared_names(ast.parse('if c == "network_jitter" or c in ("data_shard_skew",): pass')) == [
        (1, "network_jitter"), (1, "data_shard_skew")]


MAX_LINES = 450


def test_no_source_file_is_over_450_lines():
    long = {str(p.relative_to(REPO)): n for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
