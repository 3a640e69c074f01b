"""Policy search on the twin.

Seeded Optuna TPE over the policy space (checkpoint interval and mode, hot spares, heartbeat
and detection timeout, straggler factor and window, absorb vs checkpoint_restart), two
objectives: goodput (maximise) and cost = node-hours paid, spares included, per useful step
(minimise). Common random numbers: every candidate is scored on the same twin seeds, hence
the same sampled fault traces, so differences between candidates come from the policy.

The recommended policy is the highest-goodput point of the Pareto front among those that cost
at most `cost_slack` more per useful step than the front's cheapest point. Where the interval
matters (the fit below finds curvature), it is then refined by fitting Young/Daly's
first-order model goodput(tau) = a - b/tau - c*tau to the candidate evaluated on a grid of
intervals (common seeds again): near its optimum goodput is flat, so the fitted optimum
sqrt(b/c) is a better estimate than the noisy argmax. The baseline is `checkpoint_restart` at
Young/Daly's interval sqrt(2 delta M), scored on the same seeds.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from keel import scenario as S
from keel.stats import mean_ci95
from planner import scenarios as PS
from planner.replicas import SerialRunner, seeds_for

INTERVAL = "checkpoint.interval_steps"
ALL_KEYS = (INTERVAL, "checkpoint.mode", "policy.kind", "policy.hot_spares", "policy.heartbeat_s",
            "policy.detect_timeout_s", "policy.straggler_factor", "policy.straggler_window")


# ----------------------------------------------------------------------------- the space

@dataclass(frozen=True, kw_only=True, slots=True)
class Param:
    """One searched key: `kind` is int, float or cat; `log` samples on a log scale."""
    key: str
    kind: str
    low: float = 0.0
    high: float = 0.0
    log: bool = False
    choices: tuple = ()

    def suggest(self, trial: Any, name: str | None = None) -> Any:
        name = name or self.key
        if self.kind == "cat":
            return trial.suggest_categorical(name, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(name, int(self.low), int(self.high), log=self.log)
        return trial.suggest_float(name, self.low, self.high, log=self.log)


def default_space(scenario: S.Scenario, yd_interval_steps: int,
                  keys: Sequence[str] = ALL_KEYS) -> dict[str, Param]:
    """The ranges searched, derived from the scenario: intervals from 1/8 to 8 times
    Young/Daly's, a few more spares than the scenario has, heartbeats from a quarter to four
    times its own, detection after 2 to 10 missed heartbeats."""
    steps = scenario.run.steps
    p = scenario.policy
    lo = max(1, int(yd_interval_steps / 8))
    hi = max(lo + 1, min(steps, int(math.ceil(yd_interval_steps * 8))))
    spares_lo, spares_hi = PS.spares_range(scenario)
    space = {
        INTERVAL: Param(key=INTERVAL, kind="int", low=lo, high=hi, log=True),
        "checkpoint.mode": Param(key="checkpoint.mode", kind="cat", choices=("async", "sync")),
        "policy.kind": Param(key="policy.kind", kind="cat", choices=("absorb", "checkpoint_restart")),
        "policy.hot_spares": Param(key="policy.hot_spares", kind="int", low=spares_lo, high=spares_hi),
        "policy.heartbeat_s": Param(key="policy.heartbeat_s", kind="float", low=p.heartbeat_s / 4,
                                    high=p.heartbeat_s * 4, log=True),
        # sampled as missed heartbeats, so detect_timeout_s >= heartbeat_s always holds
        "policy.detect_timeout_s": Param(key="policy.detect_timeout_s", kind="float", low=2.0, high=10.0),
        "policy.straggler_factor": Param(key="policy.straggler_factor", kind="float", low=1.1, high=3.0),
        "policy.straggler_window": Param(key="policy.straggler_window", kind="int", low=1, high=10),
    }
    unknown = set(keys) - set(space)
    assert not unknown, f"unknown search keys {unknown}"
    return {k: space[k] for k in keys}


def suggest_policy(trial: Any, space: Mapping[str, Param], scenario: S.Scenario) -> dict[str, Any]:
    policy: dict[str, Any] = {}
    for key, param in space.items():
        if key == "policy.detect_timeout_s":
            continue
        policy[key] = param.suggest(trial)
    if "policy.detect_timeout_s" in space:
        beats = space["policy.detect_timeout_s"].suggest(trial, "detect_timeout_beats")
        hb = policy.get("policy.heartbeat_s", scenario.policy.heartbeat_s)
        policy["policy.detect_timeout_s"] = hb * beats
    for key, value in policy.items():
        if isinstance(value, float):
            policy[key] = float(f"{value:.4g}")
    return policy


def current_policy(scenario: S.Scenario, space: Mapping[str, Param]) -> dict[str, Any]:
    """The scenario's own values of the searched keys, as Optuna params (for enqueueing)."""
    values = {}
    for key, param in space.items():
        section, name = key.split(".")
        value = getattr(getattr(scenario, section), name)
        if key == "policy.detect_timeout_s":
            values["detect_timeout_beats"] = min(param.high, max(param.low, value / scenario.policy.heartbeat_s))
            continue
        if param.kind != "cat":
            value = min(param.high, max(param.low, value))
        values[key] = value
    return values


# ----------------------------------------------------------------------------- scoring

@dataclass(kw_only=True)
class Evaluator:
    """Scores policies on the twin with a fixed list of seeds (common random numbers)."""
    scenario: S.Scenario
    seeds: list[int]
    runner: SerialRunner
    calibration: Mapping[str, Any] | None = None
    cache: dict[str, dict] = field(default_factory=dict)
    evaluations: int = 0

    def key(self, policy: Mapping[str, Any]) -> str:
        """A policy's identity: the config hash of the scenario it makes. Two policies that
        set the same values (spelt with more keys or fewer) are one candidate."""
        return PS.with_policy(self.scenario, policy).config_hash()

    def score_many(self, policies: Sequence[Mapping[str, Any]]) -> list[dict]:
        todo, keys = [], []
        for policy in policies:
            sc = PS.with_policy(self.scenario, policy)
            key = sc.config_hash()
            keys.append(key)
            if key not in self.cache and key not in [k for k, _ in todo]:
                todo.append((key, sc))
        jobs = [(sc, seed, self.calibration) for _, sc in todo for seed in self.seeds]
        results = self.runner.map(jobs) if jobs else []
        n = len(self.seeds)
        for i, (key, sc) in enumerate(todo):
            self.cache[key] = self._aggregate(sc, results[i * n:(i + 1) * n])
            self.evaluations += 1
        return [dict(self.cache[k]) for k in keys]

    def score(self, policy: Mapping[str, Any]) -> dict:
        return self.score_many([policy])[0]

    def _aggregate(self, sc: S.Scenario, reps: list[dict]) -> dict:
        """The mean over the seeds and its 95 % interval (Student t) of goodput and cost."""
        nodes = PS.paid_nodes(sc)
        goodput, goodput_ci = mean_ci95([r["goodput"] for r in reps])
        cost, cost_ci = mean_ci95([nodes * r["wall_s"] / 3600.0 / sc.run.steps for r in reps])
        return {
            "goodput": goodput,
            "goodput_ci95": goodput_ci,
            "cost_node_hours_per_step": cost,
            "cost_ci95": cost_ci,
            "wall_s": statistics.fmean(r["wall_s"] for r in reps),
            "restarts": statistics.fmean(r.get("restarts") or 0 for r in reps),
            "paid_nodes": nodes,
            "replicas": len(reps),
        }


def pareto(points: Sequence[dict]) -> list[dict]:
    """Non-dominated points: no other has goodput >= and cost <= with one strictly better."""
    front = []
    for p in points:
        dominated = any(
            q["goodput"] >= p["goodput"] and q["cost_node_hours_per_step"] <= p["cost_node_hours_per_step"]
            and (q["goodput"] > p["goodput"] or q["cost_node_hours_per_step"] < p["cost_node_hours_per_step"])
            for q in points)
        if not dominated:
            front.append(p)
    return sorted(front, key=lambda p: -p["goodput"])


def recommend(front: Sequence[dict], cost_slack: float) -> dict:
    cheapest = min(p["cost_node_hours_per_step"] for p in front)
    affordable = [p for p in front if p["cost_node_hours_per_step"] <= cheapest * (1.0 + cost_slack)]
    return max(affordable, key=lambda p: (p["goodput"], -p["cost_node_hours_per_step"]))


def fit_interval(points: Sequence[tuple[float, float]]) -> dict | None:
    """Least squares of goodput = a - b/tau - c*tau over (tau, goodput); the optimum
    sqrt(b/c) where both b and c come out positive (else None: no interior optimum)."""
    import numpy as np
    if len(points) < 4:
        return None
    tau = np.array([p[0] for p in points], dtype=float)
    g = np.array([p[1] for p in points], dtype=float)
    A = np.stack([np.ones_like(tau), -1.0 / tau, -tau], axis=1)
    (a, b, c), *_ = np.linalg.lstsq(A, g, rcond=None)
    if b <= 0 or c <= 0:
        return None
    return {"a": float(a), "b": float(b), "c": float(c), "tau": float(math.sqrt(b / c))}


# ----------------------------------------------------------------------------- the plan

def fault_free_step_time(scenario: S.Scenario, runner: SerialRunner,
                         calibration: Mapping[str, Any] | None) -> float:
    """The twin's fault-free step time for the scenario (a short run with no faults)."""
    quiet = scenario.with_overrides({"faults": {}, "run.steps": min(scenario.run.steps, 50),
                                     "checkpoint.interval_steps": scenario.run.steps})
    (r,) = runner.map([(quiet, scenario.run.seed, calibration)])
    return float(r["step_time_s"])


@dataclass(kw_only=True)
class Candidates:
    """Every distinct policy a plan scored, numbered in the order first scored. A policy met
    again (TPE asking for one twice, a grid point equal to a trial, the baseline equal to the
    enqueued Young/Daly trial) is the same candidate, listed once with its first source."""
    ev: Evaluator
    by_key: dict[str, dict] = field(default_factory=dict)

    def add(self, policy: Mapping[str, Any], score: Mapping[str, Any], source: str) -> dict:
        key = self.ev.key(policy)
        if key not in self.by_key:
            self.by_key[key] = {"number": len(self.by_key), "source": source, "policy": dict(policy), **score}
        return self.by_key[key]

    def all(self) -> list[dict]:
        return list(self.by_key.values())


SOURCES = {"scenario": "the scenario's own", "young-daly": "checkpoint_restart at Young/Daly's interval",
           "tpe": "searched", "baseline": "baseline", "interval grid": "on the interval grid",
           "interval fit": "the fitted interval"}


def plan(scenario: S.Scenario, *, trials: int = 60, replicas: int = 8, runner: SerialRunner,
         calibration: Mapping[str, Any] | None = None, keys: Sequence[str] = ALL_KEYS,
         fixed: Mapping[str, Any] | None = None, cost_slack: float = 0.02, refine: bool = True,
         seed: int | None = None, progress: bool = True) -> dict[str, Any]:
    """Search the policy space on the twin; the object `keel plan --json` prints.
    `keys` limits the searched keys; `fixed` sets others on every candidate.

    `trials` lists every distinct candidate scored (the searched ones, the baseline, the
    interval grid and its fitted optimum), once each, so `evaluations == len(trials)`;
    `recommended` and `baseline` carry the `number` of their row in `trials`."""
    seed = scenario.run.seed if seed is None else seed
    base = PS.with_policy(scenario, fixed) if fixed else scenario
    step_time = fault_free_step_time(base, runner, calibration)
    yd = PS.young_daly(base, step_time, calibration)
    space = default_space(base, yd["interval_steps"], keys)
    ev = Evaluator(scenario=base, seeds=seeds_for(seed, replicas), runner=runner, calibration=calibration)
    cands = Candidates(ev=ev)

    batch = max(1, getattr(runner, "processes", 1) * 2 // max(1, replicas))
    _tpe_search(ev, cands, space, yd["interval_steps"], trials=trials, seed=seed, batch=batch, progress=progress)
    baseline_policy = {"policy.kind": "checkpoint_restart", INTERVAL: yd["interval_steps"]}
    (score,) = ev.score_many([baseline_policy])
    baseline = {**cands.add(baseline_policy, score, "baseline"), "policy": baseline_policy, "source": "baseline"}
    recommended, refinement = _choose(ev, cands, space, cost_slack, refine, scenario.run.steps)
    records = cands.all()
    assert ev.evaluations == len(records), (ev.evaluations, len(records))
    front = pareto(records)

    ranked = sorted(records, key=lambda r: (-r["goodput"], r["cost_node_hours_per_step"], r["number"]))
    sources: dict[str, int] = {}
    for r in records:
        sources[r["source"]] = sources.get(r["source"], 0) + 1
    return {
        "scenario": scenario.run.name,
        "config_hash": scenario.config_hash(),
        "seeds": ev.seeds,
        "replicas": replicas,
        "trials_requested": trials,
        "evaluations": len(records),
        "sources": sources,
        "calibrated": calibration is not None,
        "searched": list(space),
        "fixed": dict(fixed or {}),
        "rule": f"highest goodput on the Pareto front among points costing at most {cost_slack:.0%} "
                "more per useful step than its cheapest; interval refined by fitting a - b/tau - c*tau",
        "young_daly": yd,
        "recommended": _flat(recommended),
        "baseline": _flat(baseline),
        "improvement": {
            "goodput": recommended["goodput"] - baseline["goodput"],
            "cost_ratio": recommended["cost_node_hours_per_step"] / baseline["cost_node_hours_per_step"],
        },
        "interval_refinement": refinement,
        "pareto": [_trial(r) for r in front],
        "trials": [_trial(r) for r in ranked],
    }


def _tpe_search(ev: Evaluator, cands: Candidates, space: Mapping[str, Param], yd_interval_steps: int, *,
                trials: int, seed: int, batch: int, progress: bool) -> None:
    """`trials` candidates from seeded TPE, asked `batch` at a time; the first is the
    scenario's own policy, the second (where the kind and interval are searched)
    checkpoint_restart at Young/Daly's interval. Each goes into `cands` (a policy TPE asks
    for again is told its score and listed once)."""
    import optuna
    from keel.progress import progress_bar

    base = ev.scenario
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(10, max(2, trials // 3)),
                                         multivariate=True, constant_liar=True)
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
    study.enqueue_trial(current_policy(base, space))
    enqueued = {0: "scenario"}
    if "policy.kind" in space and INTERVAL in space:
        enqueued[1] = "young-daly"
        study.enqueue_trial({**current_policy(base, space), "policy.kind": "checkpoint_restart",
                             INTERVAL: min(space[INTERVAL].high, max(space[INTERVAL].low, yd_interval_steps))})
    bar = progress_bar(total=trials, desc="plan", unit="trial", enabled=progress)
    done, best = 0, -math.inf
    while done < trials:
        asked = [study.ask() for _ in range(min(batch, trials - done))]
        policies = [suggest_policy(t, space, base) for t in asked]
        for t, policy, res in zip(asked, policies, ev.score_many(policies)):
            study.tell(t, [res["goodput"], res["cost_node_hours_per_step"]])
            cands.add(policy, res, enqueued.get(t.number, "tpe"))
            best = max(best, res["goodput"])
        done += len(asked)
        bar.set_postfix(best_goodput=f"{best:.4f}")
        bar.update(len(asked))
    bar.close()


def _choose(ev: Evaluator, cands: Candidates, space: Mapping[str, Param], cost_slack: float,
            refine: bool, steps: int) -> tuple[dict, dict | None]:
    """The recommended candidate and the interval refinement (None where not refined): the
    rule's choice on the Pareto front of the candidates so far, then, where the interval is
    searched, its interval refined. The grid and the fitted optimum become candidates; the
    fitted optimum is recommended, and where the fit finds none the rule chooses again on
    the front with the grid in it (a grid point may dominate the first choice)."""
    chosen = recommend(pareto(cands.all()), cost_slack)
    if not (refine and INTERVAL in space):
        return chosen, None
    rest = {k: v for k, v in chosen["policy"].items() if k != INTERVAL}
    same_rest = [r for r in cands.all() if {k: v for k, v in r["policy"].items() if k != INTERVAL} == rest]
    refinement, refined = _refine_interval(ev, cands, chosen, same_rest, steps)
    return (refined or recommend(pareto(cands.all()), cost_slack)), refinement


def _refine_interval(ev: Evaluator, cands: Candidates, chosen: dict, same_rest: Sequence[dict],
                     steps: int) -> tuple[dict, dict | None]:
    """Evaluate the chosen policy on a grid of intervals around its own, fit (grid points and
    the trials that differ from it in the interval only), and evaluate the fitted optimum.
    Returns (the fit, with the candidate numbers of the grid and the fitted point; the
    refined candidate or None where the fit has no interior optimum)."""
    tau0 = chosen["policy"][INTERVAL]
    grid = sorted({max(1, min(steps, int(round(tau0 * f)))) for f in (0.5, 0.65, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0)})
    policies = [{**chosen["policy"], INTERVAL: t} for t in grid]
    scored = ev.score_many(policies)
    points = [cands.add(p, r, "interval grid") for p, r in zip(policies, scored)]
    seen = {p[INTERVAL] for p in policies}
    pairs = [(p[INTERVAL], r["goodput"]) for p, r in zip(policies, scored)]
    # the first-order model holds near the optimum only: trials far from the grid stay out
    pairs += [(r["policy"][INTERVAL], r["goodput"]) for r in same_rest
              if r["policy"][INTERVAL] not in seen and grid[0] <= r["policy"][INTERVAL] <= grid[-1]]
    fit = fit_interval(pairs)
    info: dict[str, Any] = {"from": chosen["number"], "grid": grid, "grid_numbers": [r["number"] for r in points],
                            "fit": fit}
    if fit is None:
        return info, None
    tau = int(round(min(max(fit["tau"], grid[0]), grid[-1])))
    policy = {**chosen["policy"], INTERVAL: tau}
    refined = cands.add(policy, ev.score(policy), "interval fit")
    info["fitted"] = refined["number"]
    return info, refined


def _flat(r: dict) -> dict:
    out = dict(r["policy"])
    out.update({k: r[k] for k in ("number", "goodput", "goodput_ci95", "cost_node_hours_per_step", "cost_ci95",
                                  "wall_s", "restarts", "paid_nodes") if k in r})
    out["set"] = [S.override_text(k, v) for k, v in r["policy"].items()]
    out["source"] = r.get("source")
    return out


def _trial(r: dict) -> dict:
    return {k: r[k] for k in ("number", "source", "policy", "goodput", "goodput_ci95",
                              "cost_node_hours_per_step", "wall_s", "restarts", "paid_nodes") if k in r}


def counts_text(result: Mapping[str, Any]) -> str:
    """'31 candidates (24 searched, 6 on the interval grid, 1 the fitted interval)': how many
    distinct policies were scored and where they came from (CLI and dashboard say the same)."""
    n = len(result.get("trials", []))
    sources = result.get("sources") or {}
    searched = sum(sources.get(k, 0) for k in ("scenario", "young-daly", "tpe"))
    parts = [f"{searched} searched"] if searched else []
    parts += [f"{sources[k]} {SOURCES[k]}" for k in ("interval grid", "interval fit") if sources.get(k)]
    if sources.get("baseline"):
        parts.append("the baseline")
    asked = result.get("trials_requested")
    if asked and searched and searched < asked:
        parts.append(f"{asked - searched} of the {asked} asked for repeated an earlier one")
    return f"{n} candidate{'s' * (n != 1)}" + (f" ({', '.join(parts)})" if parts else "")


# ----------------------------------------------------------------------------- printing

def _number(r: Mapping[str, Any]) -> str:
    return f"  (#{r['number']})" if r.get("number") is not None else ""


def table(result: Mapping[str, Any], top: int = 10) -> str:
    def row(name: str, r: Mapping[str, Any]) -> str:
        pol = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in r.items() if "." in k)
        lo, hi = r.get("goodput_ci95", [r["goodput"]] * 2)
        return (f"{name:<12} goodput {r['goodput']:.4f} [{lo:.4f}, {hi:.4f}]  "
                f"cost {r['cost_node_hours_per_step']:.5f} node-h/step  {pol}")
    yd = result["young_daly"]
    lines = [f"plan {result['scenario']}: {counts_text(result)} x {result['replicas']} "
             f"replica{'s' * (result['replicas'] != 1)} "
             f"(common seeds {result['seeds'][0]}..{result['seeds'][-1]})",
             f"Young/Daly: delta {yd['delta_s']:.3g} s, MTBF {yd['mtbf_s'] or float('inf'):.4g} s, "
             f"interval {yd['interval_steps']} steps",
             row("recommended", result["recommended"]) + _number(result["recommended"]),
             row("baseline", result["baseline"]) + _number(result["baseline"]),
             f"pareto front ({len(result['pareto'])}):"]
    for r in result["pareto"][:top]:
        lines.append("  " + row(f"#{r['number']}", {**r["policy"], **r}))
    lines.append(f"top {min(top, len(result['trials']))} of {len(result['trials'])}:")
    for r in result["trials"][:top]:
        lines.append("  " + row(f"#{r['number']}", {**r["policy"], **r}))
    return "\n".join(lines)


def run_plan(scenario: S.Scenario, *, trials: int, replicas: int, ray_address: str | None = None,
             processes: int | None = None, calibration: Mapping[str, Any] | None = None,
             progress: bool = True, runner_fn: Callable | None = None, **kw: Any) -> dict[str, Any]:
    from planner.replicas import make_runner, twin_summary
    with make_runner(ray_address, processes, runner_fn or twin_summary) as runner:
        return plan(scenario, trials=trials, replicas=replicas, runner=runner,
                    calibration=calibration, progress=progress, **kw)
