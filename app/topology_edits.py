"""The Topology page's edits of a scenario: widget values as `--set` overrides, and regions
and links added or removed (on the resolved scenario, a plain dict, checked by the schema like
any file)."""
from __future__ import annotations

import json
from typing import Any

from keel.scenario import Scenario, override_text


def edit_overrides(base: Scenario, values: dict[str, Any], extra: str = "") -> list[str]:
    """The Topology page's edits as `--set` overrides: the widget values (dotted key ->
    value) that differ from the scenario file, then the free-form `key=value` lines."""
    plain = base.to_dict()

    def in_file(key: str) -> Any:
        node: Any = plain
        for part in key.split("."):
            node = node[int(part)] if isinstance(node, list) else node[part]
        return node
    out = [override_text(k, v) for k, v in values.items() if v != in_file(k)]
    out += [line.strip() for line in extra.splitlines() if line.strip() and not line.strip().startswith("#")]
    return out


# ----------------------------------------------------------------------------- topology edits
# Adding or removing a region or a link changes the lists the scenario's dotted keys index
# into, so these edit the resolved scenario (a plain dict, `Scenario.plain()`) and the
# result is checked by the schema (`keel.scenario.from_dict`) like any file.

def _node_region(target: str | None) -> str | None:
    return target.split("/", 1)[0] if target and "/" in target and not target.startswith("shard/") else target


def remove_region(plain: dict[str, Any], name: str) -> dict[str, Any]:
    """Without region `name`: its links and the scheduled faults that target it or its nodes go too."""
    out = json.loads(json.dumps(plain))
    out["regions"] = [r for r in out["regions"] if r["name"] != name]
    out["links"] = [link for link in out.get("links", []) if name not in (link["a"], link["b"])]
    faults = out.get("faults", {})
    if "schedule" in faults:
        faults["schedule"] = [e for e in faults["schedule"] if _node_region(e.get("target")) != name]
    return out


def add_region(plain: dict[str, Any], name: str, nodes: int, link_to: str | None,
               rtt_ms: float, gbit_s: float) -> dict[str, Any]:
    """With a new region `name` of `nodes` nodes (the other keys as the first region has
    them), linked to `link_to`. The new region goes before the last one, so the hot spares
    (the last nodes in scenario order) stay where they were."""
    out = json.loads(json.dumps(plain))
    template = {k: v for k, v in out["regions"][0].items() if k not in ("name", "nodes")} if out["regions"] else {}
    region = {**template, "name": name.strip(), "nodes": int(nodes)}
    out["regions"].insert(max(0, len(out["regions"]) - 1), region)
    if link_to:
        out.setdefault("links", []).append(_link(out, name.strip(), link_to, rtt_ms, gbit_s))
    return out


def _link(plain: dict[str, Any], a: str, b: str, rtt_ms: float, gbit_s: float) -> dict[str, Any]:
    template = dict(plain["links"][0]) if plain.get("links") else {}
    return {**template, "a": a, "b": b, "rtt_ms": float(rtt_ms), "gbit_s": float(gbit_s)}


def add_link(plain: dict[str, Any], a: str, b: str, rtt_ms: float, gbit_s: float) -> dict[str, Any]:
    out = json.loads(json.dumps(plain))
    out.setdefault("links", []).append(_link(out, a, b, rtt_ms, gbit_s))
    return out


def remove_link(plain: dict[str, Any], a: str, b: str) -> dict[str, Any]:
    out = json.loads(json.dumps(plain))
    out["links"] = [link for link in out.get("links", []) if {link["a"], link["b"]} != {a, b}]
    return out


def structure_changes(before: Scenario, after: Scenario) -> list[str]:
    """Regions and links added or removed, in words, then the other keys that differ (as
    `keel.scenario.diff_configs` words them, over the regions and links both have)."""
    from keel.scenario import diff_configs
    old, new = before.to_dict(), after.to_dict()
    lines = []
    names_old, names_new = [r["name"] for r in old["regions"]], [r["name"] for r in new["regions"]]
    lines += [f"region {n} added ({after.region(n).nodes} nodes)" for n in names_new if n not in names_old]
    lines += [f"region {n} removed" for n in names_old if n not in names_new]
    pair = lambda link: frozenset((link["a"], link["b"]))  # noqa: E731
    links_old, links_new = {pair(x): x for x in old["links"]}, {pair(x): x for x in new["links"]}
    lines += [f"link {x['a']} - {x['b']} added ({x['rtt_ms']:g} ms, {x['gbit_s']:g} Gbit/s)"
              for k, x in links_new.items() if k not in links_old]
    lines += [f"link {x['a']} - {x['b']} removed" for k, x in links_old.items() if k not in links_new]
    sched_old, sched_new = old["faults"]["schedule"], new["faults"]["schedule"]
    if len(sched_new) < len(sched_old):
        gone = [e for e in sched_old if e not in sched_new]
        lines += [f"scheduled fault removed: {e['class']} on {e['target']} at step {e['at_step']}" for e in gone]
    # the rest, keyed by name where the lists changed
    for key, by in (("regions", "name"), ("links", None)):
        ident = (lambda x, by=by: x[by] if by else pair(x))
        if [ident(x) for x in old[key]] != [ident(x) for x in new[key]]:
            common_old = {ident(x): x for x in old[key]}
            common_new = {ident(x): x for x in new[key]}
            for k in common_old.keys() & common_new.keys():
                label = k if by else "-".join(sorted(k))
                lines += [f"{key}[{label}] {c}" for c in diff_configs(common_old[k], common_new[k], "")]
            old, new = {**old, key: []}, {**new, key: []}
    if sched_old != sched_new and len(sched_old) != len(sched_new):
        old = {**old, "faults": {**old["faults"], "schedule": []}}
        new = {**new, "faults": {**new["faults"], "schedule": []}}
    return lines + diff_configs(old, new)
