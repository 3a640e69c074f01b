"""Where runs live: the run, validation and plan directories under the runs root, found
without following a symbolic link (out of the root, or round a loop) and without reading
more than their names and markers. A hostile root lists what is really there, once."""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from keel import rundir

RUN_KINDS = ("validation", "run", "plan")
_MARKERS = {"validation": "comparison.json", "run": rundir.SUMMARY, "plan": "plan.json"}


def runs_root() -> Path:
    """The runs directory: `KEEL_RUNS`, else `./runs`."""
    return Path(os.environ.get("KEEL_RUNS") or "runs")


def _regular(path: Path) -> os.stat_result | None:
    """`path`'s stat if it is a regular file and not a symbolic link, else None."""
    try:
        st = path.lstat()
    except (OSError, ValueError):
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def _real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(path.lstat().st_mode)
    except (OSError, ValueError):
        return False


def dir_kind(path: str | Path) -> str | None:
    """'validation' (comparison.json), 'run' (events.jsonl + summary.json), 'plan'
    (plan.json), or None for anything else (a marker that is a symbolic link counts for none)."""
    p = Path(path)
    if _regular(p / "comparison.json"):
        return "validation"
    if _regular(p / rundir.EVENTS) and _regular(p / rundir.SUMMARY):
        return "run"
    if _regular(p / "plan.json"):
        return "plan"
    return None


@dataclass(frozen=True, slots=True)
class RunDir:
    path: Path
    kind: str
    label: str
    mtime: float
    parent: Path | None = None  # the job this directory is part of (a validation's twin/, rep-K/)

    @property
    def is_job(self) -> bool:
        return self.parent is None


def list_runs(root: str | Path, kinds: Sequence[str] = RUN_KINDS, depth: int = 3) -> list[RunDir]:
    """Run, validation and plan directories under `root`, grouped by job: the jobs (those
    inside no other) newest first, each followed by its parts, a validation's twin/ and
    runtime/rep-K/ (in that order) or whatever job lies inside another. `kinds` filters
    the list, not the grouping. Symbolic links are not followed and no directory is listed
    twice."""
    root = Path(root)
    groups: list[list[RunDir]] = []
    if not root.is_dir():
        return []
    listed: set[Path] = set()

    def entry(p: Path, kind: str, parent: Path | None) -> RunDir:
        label = str(p.relative_to(root)) if p != root else p.name
        st = _regular(p / _MARKERS[kind])
        return RunDir(p, kind, label, st.st_mtime if st else 0.0, parent)

    def children(p: Path) -> list[Path]:
        try:
            return sorted(c for c in p.iterdir() if c.name != "checkpoints" and _real_dir(c))
        except OSError:
            return []

    def parts(job: Path, p: Path, level: int, out: list[RunDir]) -> None:
        if level >= depth + 2:
            return
        for c in children(p):
            kind = dir_kind(c)
            if kind is not None and c not in listed:
                listed.add(c)
                out.append(entry(c, kind, job))
            parts(job, c, level + 1, out)

    def walk(p: Path, level: int) -> None:
        kind = dir_kind(p)
        if kind is not None:
            listed.add(p)
            group = [entry(p, kind, None)]
            if kind == "validation":
                subs = validation_runs(p)
                listed.update(subs.values())
                group += [entry(sub, "run", p) for sub in subs.values()]
                parts(p, p, level, group)
            else:
                parts(p, p, level, group)
            groups.append(group)
            return
        if level >= depth:
            return
        for c in children(p):
            walk(c, level + 1)

    walk(root, 0)
    groups.sort(key=lambda g: (-max(r.mtime for r in g), g[0].label))
    return [r for g in groups for r in g if r.kind in kinds]


def jobs_first(runs: Sequence[RunDir]) -> list[RunDir]:
    """The same list with the jobs before the parts (for a picker's default: the newest job,
    never a validation's repetition)."""
    return sorted(runs, key=lambda r: not r.is_job)


def runs_table(runs: Sequence[RunDir]) -> list[dict[str, Any]]:
    """The Runs page's table: one row per directory, a job's parts indented under it."""
    import datetime as dt
    labels = {r.path: r.label for r in runs}
    rows = []
    for r in runs:
        part = r.parent is not None
        name = str(r.path.relative_to(r.parent)) if part else r.label
        rows.append({"job": ("    ↳ " + name) if part else name, "kind": r.kind,
                     "part of": labels.get(r.parent, str(r.parent)) if part else "",
                     "written": dt.datetime.fromtimestamp(r.mtime).strftime("%Y-%m-%d %H:%M:%S"),
                     "path": str(r.path)})
    return rows


def mtime(path: str | Path) -> float:
    """Cache key part: a file's modification time (0 when missing), so edits invalidate."""
    try:
        return Path(path).stat().st_mtime
    except OSError:
        return 0.0


def validation_runs(path: str | Path) -> dict[str, Path]:
    """The twin's and each runtime repetition's run directories of a validation:
    {'twin': DIR/twin, 'rep-0': DIR/runtime/rep-0, ...} (those present; no symbolic links)."""
    path = Path(path)
    out: dict[str, Path] = {}
    if _real_dir(path / "twin") and dir_kind(path / "twin") == "run":
        out["twin"] = path / "twin"
    runtime = path / "runtime"
    reps = sorted((p for p in runtime.glob("rep-*") if _real_dir(runtime) and _real_dir(p) and dir_kind(p) == "run"),
                  key=lambda p: int(p.name[4:]) if p.name[4:].isdigit() else 1 << 30)
    for p in reps:
        out[p.name] = p
    return out


def list_checkpoints(run: str | Path) -> list[Path]:
    """`DIR/checkpoints/step-NNNNNNNN/` folders (complete or not: the reader judges), oldest
    first. `run` may also be the checkpoints folder itself."""
    run = Path(run)
    folder = run if run.name == "checkpoints" else run / "checkpoints"
    if not _real_dir(folder):
        return []
    return sorted(p for p in folder.iterdir() if _real_dir(p) and p.name.startswith("step-"))


def checkpoint_runs(root: str | Path) -> list[RunDir]:
    """Run directories under `root` that hold a `checkpoints/` folder: the jobs newest
    first, then the parts of jobs (a validation's repetitions)."""
    return jobs_first([r for r in list_runs(root, kinds=("run",)) if _real_dir(r.path / "checkpoints")])
