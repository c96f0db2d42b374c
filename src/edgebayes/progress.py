"""Progress of the long loops (training epochs): a tqdm bar on a terminal, one plain line per step otherwise.

A bar redraws itself with carriage returns; written into a log file (`make pipeline > log`, CI) it becomes
one line of tens of kilobytes that says nothing until the end. Off a terminal each finished step is one
line on stderr instead, with what the loop last set as its postfix (loss, validation accuracy, ...).
"""

import sys
import time

from tqdm.auto import tqdm


def _duration(seconds: float) -> str:
    """12 s, 3 min 20 s, 2 h 05 min."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def progress(iterable, desc="", total=None, initial=0, unit="it", disable=False, interval=0.0, **kwargs):
    """tqdm(iterable, ...) on a terminal; a LineProgress (same use: iterate, set_postfix, close) otherwise, a line
    at most every `interval` seconds (and the last): a loop of thousands of short steps (decoding images) is
    a few lines of a log, not one per step."""
    if disable or sys.stderr.isatty():
        return tqdm(iterable, desc=desc, total=total, initial=initial, unit=unit, disable=disable, **kwargs)
    return LineProgress(iterable, desc, total, initial, unit, interval=interval)


class LineProgress:
    """One line per finished step: `train: epoch 12/150: loss=0.123, val_acc=0.951`."""

    def __init__(self, iterable, desc, total=None, initial=0, unit="it", file=None, interval=0.0):
        self.iterable, self.desc, self.unit, self.interval = iterable, desc, unit, interval
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.n, self.postfix, self.file, self.initial = initial, "", file, initial

    def __iter__(self):
        start = said = time.monotonic()
        for item in self.iterable:
            yield item
            self.n += 1   # the step's body has run: report it
            now = time.monotonic()
            if self.interval and now - said < self.interval and self.n != self.total:
                continue
            said = now
            of = f"/{self.total}" if self.total is not None else ""
            print(f"{self.desc}: {self.unit} {self.n}{of}" + (f": {self.postfix}" if self.postfix else "")
                  + self._eta(now - start), file=self.file or sys.stderr, flush=True)

    def _eta(self, spent):
        """`, 2.1 s/epoch, ETA 5 min` from the steps done in this process (a resumed run's earlier ones not)."""
        done = self.n - self.initial
        if not done or self.total is None:
            return ""
        per, left = spent / done, spent / done * (self.total - self.n)
        return f" ({per:.3g} s/{self.unit}, ETA {_duration(left)})" if self.n < self.total else f" ({_duration(spent)})"

    def set_postfix(self, ordered_dict=None, refresh=True, **kwargs):
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def close(self):
        pass
