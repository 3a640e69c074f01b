"""Bytes on the wire: what one step's reduction sends, as one rule the twin, the emulation and
the benchmarks share (no torch here).

The runtime all-reduces per step every gradient element and the loss, encoded in the scenario's
reduction format (`rounds` lists the collectives of a common step):

| format    | element | exact | encoding (runtime/reduction.py)                                      |
|-----------|---------|-------|----------------------------------------------------------------------|
| `int64`   | 8 bytes | yes   | fixed point, one exponent per tensor                                  |
| `block32` | 4 bytes | yes   | fixed point in int32, one exponent per block of `BLOCK` elements,     |
|           |         |       | agreed first with one byte per block (+1/32 byte an element)          |
| `block16` | 2 bytes | yes   | the same in int16 (a study: coarse)                                   |
| `native`  | dtype   | no    | a plain all-reduce in the gradient dtype (what DDP sends); the twin   |
|           |         |       | prices it for comparison, the runtime does not run it                 |

An exact format needs ceil(log2 slots) bits of headroom so that no sum of `slots` values
overflows; each compact format stops at `max_slots` (where its resolution would fall below
what it is for) and a run with more slots reduces in `int64` instead (`effective_format`).
An int64 step whose values exceed their a priori bounds takes a second and third round (the
maxima, then the vector again); the rule prices the common step. The block formats always take
the same two: one byte per block to agree the exponents, then the vector.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, NoReturn

BLOCK = 32  # elements sharing one exponent in the block formats
EXTRA_ELEMENTS = 3  # the loss and the two counters, after the gradient
GRADIENT_DTYPES = {"float32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Format:
    element_bytes: int | None  # None: the gradient dtype's
    exact: bool
    max_slots: int             # beyond it the runtime reduces in int64
    block: int | None          # elements per shared exponent; None: one per tensor


FORMATS = {
    "int64": Format(8, True, 2 ** 40, None),
    "block32": Format(4, True, 2 ** 12, BLOCK),
    "block16": Format(2, True, 2 ** 6, BLOCK),
    "native": Format(None, False, 2 ** 40, None),
}
EXACT_FORMATS = tuple(k for k, f in FORMATS.items() if f.exact)


@dataclass(frozen=True, kw_only=True, slots=True)
class Reduction:
    format: str = field(default="block32", metadata={"doc": (
        "encoding of the per-step all-reduce: block32 (exact, 4 bytes an element), int64 (exact, 8), "
        "block16 (exact, 2, coarse), native (the twin only: a plain all-reduce in workload.gradient_dtype)")})


def effective_format(fmt: str, slots: int) -> str:
    """The format the runtime reduces in: `fmt`, or int64 where `slots` exceed its headroom."""
    return fmt if slots <= FORMATS[fmt].max_slots else "int64"


def element_bytes(fmt: str, gradient_dtype: str, slots: int) -> int:
    """Bytes one element of the reduced vector takes on the wire."""
    f = FORMATS[effective_format(fmt, slots)]
    return f.element_bytes if f.element_bytes is not None else GRADIENT_DTYPES[gradient_dtype]


def rounds(params: int, fmt: str, gradient_dtype: str, slots: int,
           blocks: int | None = None) -> list[tuple[str, int, int]]:
    """(op, elements, bytes per element) of each all-reduce of a common step, in order:
    - int64: one SUM of the gradient, the loss and two counters (a priori bounds hold);
    - block formats: one MAX of a byte per block (the exponents) and the non-finite flag, then
      one SUM of the gradient and the loss. `blocks`: the runtime's count (each tensor cut
      into blocks of BLOCK, the loss one more); by default ceil(params / BLOCK) + 1;
    - native: one SUM of the gradient in its dtype."""
    eff = effective_format(fmt, slots)
    size = element_bytes(eff, gradient_dtype, slots)
    if eff == "native":
        return [("sum", params, size)]
    if FORMATS[eff].block is None:
        return [("sum", params + EXTRA_ELEMENTS, size)]
    nblocks = blocks if blocks is not None else -(-params // FORMATS[eff].block) + 1
    return [("max", nblocks + 1, 1), ("sum", params + 1, size)]


def reduction_bytes(params: int, gradient_dtype: str, fmt: str, slots: int) -> int:
    """Bytes of the vectors one common step all-reduces (every round)."""
    return sum(n * size for _, n, size in rounds(params, fmt, gradient_dtype, slots))


def sent_per_worker(vector_bytes: float, workers: int) -> float:
    """Bytes each of `workers` sends in a ring all-reduce (reduce-scatter, then all-gather) of
    a vector of `vector_bytes`: 2 (n - 1) / n of it."""
    return 2.0 * (workers - 1) / workers * vector_bytes if workers > 1 else 0.0


def scenario_bytes(scenario: Any) -> int:
    """`reduction_bytes` for a scenario's model, dtype, format and slots."""
    w = scenario.workload
    return reduction_bytes(w.params, w.gradient_dtype, scenario.reduction.format, scenario.slot_count)


def scenario_rounds(scenario: Any) -> list[tuple[float, bool]]:
    """(bytes, exchange) of each all-reduce of a common step of the scenario's reduction, in
    order (each pays its own latency, and a latency spike strikes each). `exchange`: the
    collective crosses regions in one exchange, every region sending to every other at once,
    rather than the ring's 2 (R - 1) steps; the MAX of the block formats' exponents does
    (a vector of 1/128 of the gradient's bytes, for which latency, not bandwidth, decides)."""
    w = scenario.workload
    return [(float(n * size), op == "max") for op, n, size in rounds(
        w.params, scenario.reduction.format, w.gradient_dtype, scenario.slot_count)]


def flag_rounds(fmt: str, slots: int) -> int:
    """The leading all-reduces a step with a non-finite value takes before every worker knows:
    the flag rides in the first (int64's counters, the block formats' exponent bytes); the
    rest of the step is not sent."""
    return 1


# ----------------------------------------------------------------------------- the scenario

_NOTICED: set[str] = set()


def migrate(raw: dict, source: str, fail: Callable[[str, str], NoReturn]) -> None:
    """Reads an old scenario's `workload.gradient_bytes` (bytes all-reduced per step, which
    nothing tied to what the runtime sends) as `workload.params` = bytes / the gradient dtype's
    size, and says so once on stderr. Both keys at once are an error."""
    w = raw.get("workload")
    if not isinstance(w, dict) or "gradient_bytes" not in w:
        return
    old = w.pop("gradient_bytes")
    if "params" in w:
        fail("workload.gradient_bytes", "expected workload.params alone: gradient_bytes is the old key "
                                        "for the same figure (remove it)")
    dtype = w.get("gradient_dtype", "bf16")
    if isinstance(old, float) and old.is_integer():
        old = int(old)
    if isinstance(old, bool) or not isinstance(old, int) or old < 0 or dtype not in GRADIENT_DTYPES:
        fail("workload.gradient_bytes", f"expected a non-negative integer of bytes (read as workload.params "
                                        f"= bytes / the gradient dtype's size), got {old!r}")
    w["params"] = old // GRADIENT_DTYPES[dtype]
    if source not in _NOTICED:
        _NOTICED.add(source)
        print(f"{source}: workload.gradient_bytes changed meaning: it is read as workload.params = "
              f"{w['params']:,} ({old:,} bytes / {GRADIENT_DTYPES[dtype]} per {dtype} element); the bytes a "
              f"step sends now follow reduction.format (keel/wire.py). Write workload.params instead.",
              file=sys.stderr)


def check(scenario: Any, fail: Callable[[str, str], NoReturn]) -> None:
    w = scenario.workload
    if w.params < 0:
        fail("workload.params", f"expected a non-negative number of parameters, got {w.params!r}")
    if w.gradient_dtype not in GRADIENT_DTYPES:
        fail("workload.gradient_dtype", f"expected one of {', '.join(GRADIENT_DTYPES)}, got {w.gradient_dtype!r}")
    if scenario.reduction.format not in FORMATS:
        fail("reduction.format", f"expected one of {', '.join(FORMATS)}, got {scenario.reduction.format!r}")


def bits_of_resolution(fmt: str, slots: int) -> int:
    """Bits below each block's (or tensor's) bound that an exact format resolves."""
    base = {"int64": 61, "block32": 30, "block16": 14}[effective_format(fmt, slots)]
    return base - (math.ceil(math.log2(slots)) if slots > 1 else 0)
