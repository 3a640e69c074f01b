"""Progress for long work: a bar on a terminal; in a log (stderr not a TTY), a plain line now
and then instead of carriage-return updates."""
from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class _Off:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **values: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "_Off":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Lines:
    """`desc: k/total unit (p %)` at most every `every_s` seconds, and once at the end."""

    def __init__(self, total: int, desc: str, unit: str, initial: int, stream: TextIO, every_s: float):
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self.stream, self.every_s = stream, every_s
        self.t0 = self.last = time.monotonic()
        self.closed = False
        self.postfix = ""

    def _line(self) -> None:
        pct = f" ({100.0 * self.n / self.total:.0f} %)" if self.total else ""
        self.stream.write(f"{self.desc}: {self.n}/{self.total} {self.unit}{pct}, "
                          f"{time.monotonic() - self.t0:.0f} s{self.postfix}\n")
        self.stream.flush()

    def set_postfix(self, **values: Any) -> None:
        """Shown at the end of the next line (as tqdm shows it beside the bar)."""
        self.postfix = "".join(f", {k} {v}" for k, v in values.items())

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            self._line()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._line()

    def __enter__(self) -> "_Lines":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def progress_bar(*, total: int, desc: str, unit: str = "it", initial: int = 0, enabled: bool = True,
                 stream: TextIO | None = None, every_s: float = 10.0) -> Any:
    """An object with `update(n=1)`, `set_postfix(**values)` and `close()`, usable as a
    context manager."""
    stream = stream or sys.stderr
    if not enabled:
        return _Off()
    if getattr(stream, "isatty", lambda: False)():
        from tqdm import tqdm
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=stream, dynamic_ncols=True)
    return _Lines(total, desc, unit, initial, stream, every_s)
