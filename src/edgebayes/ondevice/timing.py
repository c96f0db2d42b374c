"""The latency protocol (in the spirit of MLPerf "single stream"): warm-up, then timed runs until at least
min_runs runs AND min_seconds seconds have passed, split into interleaved rounds; each percentile over
every timed sample, the best round's beside it (latency_summary)."""

import sys
import time

import numpy as np

from .tables import PROTOCOL

MAX_SAMPLES = 2000    # latency samples kept in the results file


class _Progress:
    """Progress on stderr: tqdm if installed, else a throttled percentage line."""

    def __init__(self, enabled, desc):
        self.enabled, self.desc, self.shown, self.bar = enabled, desc, 0, None
        self.last_draw = 0.0
        if enabled:
            try:
                from tqdm import tqdm
                # Rate/ETA would be misleading: the target is runs AND seconds.
                self.bar = tqdm(total=100, desc=desc, file=sys.stderr, leave=False,
                                bar_format="{desc}: {percentage:3.0f}%|{bar}|")
            except ImportError:
                self.bar = None

    def update(self, fraction, runs):
        if not self.enabled:
            return
        pct = int(min(fraction, 1.0) * 100)
        now = time.monotonic()
        # Redrawing costs time between timed runs; keep it rare.
        if pct == self.shown or (now - self.last_draw < 0.1 and pct < 100):
            return
        self.last_draw = now
        if self.bar is not None:
            self.bar.set_description_str(f"{self.desc} ({runs} runs)", refresh=False)
            self.bar.update(pct - self.shown)  # also redraws
        else:
            sys.stderr.write(f"\r{self.desc}: {pct:3d}% ({runs} runs)")
            sys.stderr.flush()
        self.shown = pct

    def close(self):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        else:
            sys.stderr.write("\n")
            sys.stderr.flush()


def measure_latency(backend, batch, warmup=PROTOCOL["warmup"], min_runs=PROTOCOL["min_runs"],
                    min_seconds=PROTOCOL["min_seconds"], progress=True):
    """Time backend.run(batch): `warmup` untimed runs, then timed runs until
    at least `min_runs` runs AND `min_seconds` seconds have passed.

    Returns {"samples_ms": every latency in run order, "runs", "seconds"}.
    """
    for _ in range(warmup):  # caches, lazy allocations, JIT/graph setup, CPU clocks
        backend.run(batch)
    latencies = []
    bar = _Progress(progress, "runner: timing")
    clock = time.perf_counter
    loop_start = clock()
    try:
        while True:
            t0 = clock()
            backend.run(batch)
            t1 = clock()
            latencies.append(t1 - t0)
            elapsed = t1 - loop_start
            if len(latencies) >= min_runs and elapsed >= min_seconds:
                bar.update(1.0, len(latencies))
                break
            frac_runs = len(latencies) / min_runs if min_runs > 0 else 1.0
            frac_time = elapsed / min_seconds if min_seconds > 0 else 1.0
            bar.update(min(frac_runs, frac_time), len(latencies))
    finally:
        bar.close()
    return {"samples_ms": [1000.0 * v for v in latencies], "runs": len(latencies), "seconds": clock() - loop_start}


def _percentiles(ms):
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(ms.mean()),
            "min": float(ms.min()), "max": float(ms.max())}


def latency_summary(rounds, batch_size):
    """Latency figures from the timings of R rounds (each a measure_latency result).

    latency_ms: every timed sample of every round pooled. This is the figure budgets are judged on and the
    latency model is fitted to: a user who budgets p99 needs the tail the device shows, slow spells
    included, as MLPerf LoadGen counts every query. The rounds are interleaved with other models'
    (time_models), so a slow spell of the device falls on every model alike instead of on the one that
    happened to run then.
    latency_ms_best_round: each statistic the lowest over the rounds of that round's statistic (timeit's
    convention): the device undisturbed, shown beside the verdict's figure. The gap between the two says
    how much of the tail came from the device's other work.
    latency_ms_median is the typical round, round_ms each round's own, and spread the relative range
    (max - min) / min of the rounds' p50, p90 and p99: how far the device itself moved meanwhile.
    """
    per_round = [_percentiles(np.asarray(r["samples_ms"])) for r in rounds]
    pooled = np.concatenate([np.asarray(r["samples_ms"]) for r in rounds])
    best = {k: float(min(p[k] for p in per_round)) for k in per_round[0]}
    median = {k: float(np.median([p[k] for p in per_round])) for k in per_round[0]}
    runs, seconds = sum(r["runs"] for r in rounds), sum(r["seconds"] for r in rounds)

    def spread(key):
        values = [p[key] for p in per_round]
        return float((max(values) - best[key]) / best[key]) if best[key] > 0 else 0.0

    return {
        "latency_ms": _percentiles(pooled),
        "latency_ms_best_round": best,
        "latency_ms_median": median,
        "round_ms": per_round,
        "spread": {k: spread(k) for k in ("p50", "p90", "p99")},
        "rounds": len(rounds),
        "runs": runs,
        "seconds": float(seconds),
        "throughput_per_s": float(batch_size * runs / seconds) if seconds > 0 else 0.0,
        # Every k-th latency (at most MAX_SAMPLES, in run order), and the histogram of every run (the report's)
        "samples_ms": [float(v) for v in pooled[:: max(1, len(pooled) // MAX_SAMPLES)]],
        "histogram": run_histogram(pooled),
    }


HISTOGRAM_BINS = 200


def run_histogram(latencies_ms):
    """Counts of every timed run in HISTOGRAM_BINS geometric bins from the fastest to the slowest (each bin a
    fixed ratio wide: ~3 % for a 400x range), so the report's histogram holds every run, its tail included,
    and its total and maximum are the table's."""
    x = np.asarray(latencies_ms, dtype=float)
    lo, hi = float(x.min()), float(x.max())
    edges = np.geomspace(lo, hi, HISTOGRAM_BINS + 1) if 0 < lo < hi else np.array([lo, hi if hi > lo else lo + 1e-9])
    counts, _ = np.histogram(x, bins=edges)
    return {"edges_ms": [float(e) for e in edges], "counts": [int(c) for c in counts]}


def measure_rounds(backend, batch, warmup=PROTOCOL["warmup"], min_runs=PROTOCOL["min_runs"],
                   min_seconds=PROTOCOL["min_seconds"], rounds=PROTOCOL["rounds"], progress=True):
    """The protocol of a benchmark: warm-up, then `rounds` rounds that together make at least `min_runs`
    runs and `min_seconds` seconds; returns latency_summary of them."""
    timings = [timed_round(backend, batch, r, rounds, warmup, min_runs, min_seconds, progress) for r in range(rounds)]
    return latency_summary(timings, len(batch))


def timed_round(backend, batch, r, rounds, warmup, min_runs, min_seconds, progress=False):
    """Round r of `rounds`: the warm-up before the first, and each round a 1/rounds share of the minimum
    runs (rounded up) and seconds."""
    return measure_latency(backend, batch, warmup=warmup if r == 0 else 0, min_runs=max(1, -(-min_runs // rounds)),
                           min_seconds=min_seconds / rounds, progress=progress)
