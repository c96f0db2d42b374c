"""The runner's results file, checked before anything trusts it: what deploy fetches from the device and
what `report --results FILE` imports from a board run by hand.

Users act on the verdict these figures give, so a file is refused (ResultsError, one line naming the file
and the field) unless, in this order:

1. it is a regular file of at most MAX_BYTES (a FIFO, /dev/zero or a huge file is refused before a byte is
   read, as it would hang or fill the memory);
2. it parses as JSON into the runner's schema (`SCHEMA`): every key known,
   accuracies and rates in [0, 1], every number finite (no NaN, Infinity), latencies positive, finite and below an hour, counts integers, the
   percentiles in order (min <= p50 <= p90 <= p99 <= max), schema 1;
3. its figures agree with those the runner derives them from (`_consistent`): accuracy and ECE with the
   reliability bins, percentiles with the histogram of every timed run, the best and median round with
   the rounds, throughput with runs and seconds;
4. it is of this bundle and this device (`identity`): the sha256 of the model the runner measured, the
   artifact, its format, precision and runtime, M, the device's name (the runner's `--tag device=`), the
   budget's batch size and the bundle's reference figures all equal what this run's selection chose for
   the profile. A results file of another model, bundle, runtime or device is never shown as measured.
"""

import json
import math
import os
import stat

import numpy as np

from edgebayes.errors import InputError
from edgebayes.ondevice.bundle import SCHEMA_VERSION, select_artifact, unique_keys

MAX_BYTES = 8 << 20          # a runner's results are ~100 kB (2000 latency samples)
MAX_MS = 3.6e6               # an hour per inference: anything above is not a latency this runner measured
MAX_MB = 1e7                 # 10 TB of memory
MAX_COUNT = 10 ** 12


class ResultsError(InputError):
    """A results file that is not the runner's results of this bundle on this device (exit 2)."""


# Field kinds: each a function (value) -> None when the value fits, else what was expected.
def _number(lo, hi, lo_open=False, what=None):
    def check(v):
        ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
              and (v > lo if lo_open else v >= lo) and v <= hi)
        return None if ok else what or f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    return check


def _int(lo=0, hi=MAX_COUNT):
    def check(v):
        ok = isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi
        return None if ok else f"an integer in {lo}..{hi:g}"
    return check


def _optional(kind):
    return lambda v: None if v is None else (None if kind(v) is None else f"{kind(v)} or null")


def _text(v):
    return None if isinstance(v, str) and len(v) <= 4096 else "a string (at most 4096 characters)"


def _flag(v):
    return None if isinstance(v, bool) else "true or false"


def _sha256(v):
    ok = isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)
    return None if ok else "a sha256 (64 hex digits)"


def _facts(v):
    """Free-form facts (device, runtime extras, tags): names to short strings, numbers, flags, lists of strings."""
    if not isinstance(v, dict) or len(v) > 64:
        return "a mapping of at most 64 names to values"
    for key, value in v.items():
        if not (value is None or isinstance(value, (bool, int)) or _text(value) is None
                or (isinstance(value, float) and math.isfinite(value))
                or (isinstance(value, list) and len(value) <= 64 and all(_text(x) is None for x in value))):
            return f"a mapping of names to strings, numbers or lists of strings ({key!r} is not)"
    return None


RATE = _number(0, 1)
MS = _number(0, MAX_MS, lo_open=True, what=f"a latency in ms: positive, finite, at most {MAX_MS:g}")
DURATION = _number(0, MAX_MS, what=f"a duration in ms in [0, {MAX_MS:g}]")
NONNEG = _number(0, 1e12)
MB = _optional(_number(0, MAX_MB))
COUNT, POSITIVE = _int(0), _int(1)
PERCENTILES = {k: MS for k in ("p50", "p90", "p99", "mean", "min", "max")}
METRICS = {"accuracy": RATE, "nll": NONNEG, "ece": RATE, "brier": _number(0, 2), "n": POSITIVE}


class ListOf:
    def __init__(self, item, max_len=10_000):
        self.item, self.max_len = item, max_len


class Maybe:
    """null, or a mapping of `spec`."""

    def __init__(self, spec):
        self.spec = spec


class Open:
    """A mapping whose listed keys are checked and whose other keys are free-form facts (runtime extras)."""

    def __init__(self, keys):
        self.keys = keys


SCHEMA = {
    "schema": _int(1, 1000),
    "bundle": {"artifact": _text, "format": _text, "precision": _text, "mc_samples": POSITIVE,
               "knob": {"name": _optional(_text), "value": _optional(_number(-1e12, 1e12))},
               "model_file": _text, "model_sha256": _sha256},
    "runtime": Open({"name": _text, "version": _text, "threads": COUNT}),
    "device": _facts,
    "latency_ms": PERCENTILES, "latency_ms_best_round": PERCENTILES, "latency_ms_median": PERCENTILES,
    "latency_spread": {k: NONNEG for k in ("p50", "p90", "p99")},
    "latency_rounds_ms": ListOf(PERCENTILES, 100_000),
    "cold_start": {"session_create_ms": DURATION, "first_inference_ms": DURATION,
                   "engine_build_ms": _optional(DURATION)},
    "rounds": POSITIVE, "runs": POSITIVE, "seconds": NONNEG, "warmup": COUNT, "batch_size": POSITIVE,
    "protocol": {"warmup": COUNT, "min_runs": POSITIVE, "min_seconds": NONNEG, "rounds": POSITIVE,
                 "batch_size": POSITIVE, "threads": COUNT},
    "tags": _facts,
    "throughput_per_s": NONNEG,
    "peak_rss_mb": MB,
    "memory": {"runtime_baseline_mb": MB, "model_mb": MB, "deployed_mb": MB, "batch_size": POSITIVE,
               "peak_reset": _flag},
    "metrics": METRICS,
    "reliability": {"bin_confidence": ListOf(_optional(RATE)), "bin_accuracy": ListOf(_optional(RATE)),
                    "bin_count": ListOf(COUNT)},
    "ood": Maybe({"auroc": RATE, "aupr": RATE, "score": _text, "n_in": POSITIVE, "n_out": POSITIVE}),
    "selective": {"rejected": ListOf(RATE), "kept": ListOf(COUNT), "accuracy": ListOf(_optional(RATE)),
                  "max_entropy": ListOf(_optional(NONNEG)), "score": _text, "n": POSITIVE},
    "latency_samples_ms": ListOf(MS, 100_000),
    "latency_histogram": {"edges_ms": ListOf(NONNEG, 10_001), "counts": ListOf(COUNT, 10_000)},   # every run
    "reference": METRICS,
    "max_abs_prob_diff": RATE,
    "started_at": _text, "finished_at": _text,
}


def _walk(value, spec, where):
    """The first problem as (field, what is wrong), or None. Every key of a mapping spec is required and
    no other is allowed (an Open mapping's others are free-form facts)."""
    field = where.rstrip(".") or "the file"
    if isinstance(spec, Maybe):
        return None if value is None else _walk(value, spec.spec, where)
    if isinstance(spec, (dict, Open)):
        keys = spec.keys if isinstance(spec, Open) else spec
        if not isinstance(value, dict):
            return field, f"expected a mapping (JSON object), got {_show(value)}"
        for key in keys:
            if key not in value:
                return f"{where}{key}", "missing (the runner writes it)"
        extra = [] if isinstance(spec, Open) else sorted(set(value) - set(spec))
        if extra:
            return f"{where}{extra[0]}", "unknown key (not one the runner writes)"
        for key, sub in keys.items():
            problem = _walk(value[key], sub, f"{where}{key}.")
            if problem:
                return problem
        if isinstance(spec, Open) and (fact := _facts({k: v for k, v in value.items() if k not in keys})):
            return field, f"expected {fact}"
        return None
    if isinstance(spec, ListOf):
        if not isinstance(value, list) or len(value) > spec.max_len:
            return field, f"expected a list of at most {spec.max_len} items, got {_show(value)}"
        for i, item in enumerate(value):
            problem = _walk(item, spec.item, f"{field}[{i}].")
            if problem:
                return problem
        return None
    expected = spec(value)
    return None if expected is None else (field, f"expected {expected}, got {_show(value)}")


def _show(value):
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:40] + "..." + text[-12:]


def read_results(path):
    """The parsed results file, once it is a regular file of at most MAX_BYTES holding strict JSON in the
    runner's schema; ResultsError naming the file and the field otherwise."""
    path = os.fspath(path)
    try:   # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then refuses it
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise ResultsError(f"{path}: cannot read it ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ResultsError(f"{path}: not a regular file (a runner's results.json is one)")
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise ResultsError(f"{path}: larger than {MAX_BYTES >> 20} MB: not a runner's results file")
    try:
        # NaN and Infinity parse, and the schema names their field; a key twice is refused (json keeps the last)
        res = json.loads(data.decode("utf-8"), object_pairs_hook=unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ResultsError(f"{path}: not a runner's results file: not JSON ({type(e).__name__}: {e})") from None
    if isinstance(res, dict) and res.get("schema") != SCHEMA_VERSION:   # first: another schema has other keys
        raise ResultsError(f"{path}: schema: expected {SCHEMA_VERSION} (the schema this edgebayes reads), got "
                           f"{_show(res.get('schema'))}")
    problem = _walk(res, SCHEMA, "") or _consistent(res)
    if problem:
        field, what = problem
        raise ResultsError(f"{path}: {field}: {what}")
    return res


def _consistent(res):
    """The first field that disagrees with the rest of the file, as (field, what is wrong), or None.

    The runner derives most figures from others it also writes (metrics.py, timing.py): the accuracy and
    the ECE from the reliability bins, the percentiles from every timed run (the histogram counts them
    all), the best and median round from the rounds, the throughput from runs and seconds. A file whose
    figures disagree was edited or corrupted, and the report must not show its figures as measured: an
    accuracy raised by hand while its bins, counts and hashes were kept read as the board's."""
    for key in ("latency_ms", "latency_ms_best_round", "latency_ms_median"):
        lat = res[key]
        if not lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]:
            return key, f"expected min <= p50 <= p90 <= p99 <= max, got {_show(lat)}"
    n = res["metrics"]["n"]
    if n != res["reference"]["n"]:
        return "metrics.n", f"expected the evaluation set's size {res['reference']['n']} (reference.n), got {n}"
    return _bins_agree(res, n) or _latency_agrees(res) or _counts_agree(res, n)


def _differs(got, want, tol=1e-6):
    return abs(got - want) > tol * max(1.0, abs(want))


def _bins_agree(res, n):
    """accuracy and ECE recomputed from the reliability bins (metrics.reliability_bins)."""
    rel = res["reliability"]
    counts, conf, acc = rel["bin_count"], rel["bin_confidence"], rel["bin_accuracy"]
    if not len(counts) == len(conf) == len(acc) >= 1:
        return "reliability", "expected bin_count, bin_confidence and bin_accuracy of one length"
    if sum(counts) != n:
        return "reliability.bin_count", f"expected counts summing to metrics.n ({n}), got {sum(counts)}"
    for b, (c, p, a) in enumerate(zip(counts, conf, acc)):
        if (c == 0) != (p is None) or (c == 0) != (a is None):
            return f"reliability.bin_count[{b}]", "expected null confidence and accuracy exactly for an empty bin"
        if c and not (b / len(counts) - 1e-9 <= p <= (b + 1) / len(counts) + 1e-9):
            return f"reliability.bin_confidence[{b}]", f"expected a confidence within bin {b}'s range, got {p:g}"
    correct = sum(a * c for a, c in zip(acc, counts) if c)
    ece = sum(abs(a - p) * c for a, p, c in zip(acc, conf, counts) if c) / n
    if _differs(res["metrics"]["accuracy"], correct / n):
        return "metrics.accuracy", (f"expected {correct / n:.6g}, the accuracy of the reliability bins, got "
                                    f"{res['metrics']['accuracy']:.6g}: not the figures the runner computed")
    if _differs(res["metrics"]["ece"], ece):
        return "metrics.ece", (f"expected {ece:.6g}, the ECE of the reliability bins, got {res['metrics']['ece']:.6g}: "
                               f"not the figures the runner computed")
    sel = res["selective"]
    if (sel["n"] != n or not sel["kept"] or sel["kept"][0] != n or not sel["accuracy"] or sel["accuracy"][0] is None
            or _differs(sel["accuracy"][0], correct / n)):
        return "selective", f"expected n and kept[0] equal to metrics.n ({n}) and accuracy[0] to metrics.accuracy"
    if res["ood"] is not None and res["ood"]["n_in"] != n:
        return "ood.n_in", f"expected metrics.n ({n}), got {res['ood']['n_in']}"
    return None


def _latency_agrees(res):
    """The pooled percentiles against the histogram of every timed run, and the best and median round
    against the rounds (timing.latency_summary)."""
    lat, hist = res["latency_ms"], res["latency_histogram"]
    edges, counts = hist["edges_ms"], hist["counts"]
    if len(edges) != len(counts) + 1 or sum(counts) != res["runs"]:
        return "latency_histogram", f"expected {res['runs']} runs (runs) in len(edges_ms) - 1 bins"
    if _differs(edges[0], lat["min"]) or (len(edges) > 2 and _differs(edges[-1], lat["max"])):
        return "latency_histogram.edges_ms", "expected the first and last edge at latency_ms's min and max"
    cumulative = np.cumsum(counts)
    for q in ("p50", "p90", "p99"):    # np.percentile interpolates between the order statistics lo and hi
        rank = float(q[1:]) / 100 * (res["runs"] - 1)
        lo, hi = (int(np.searchsorted(cumulative, k, side="right")) for k in (math.floor(rank), math.ceil(rank)))
        if not edges[lo] * (1 - 1e-6) <= lat[q] <= edges[min(hi + 1, len(edges) - 1)] * (1 + 1e-6):
            return f"latency_ms.{q}", (f"expected a value in [{edges[lo]:.6g}, {edges[min(hi + 1, len(edges) - 1)]:.6g}] "
                                       f"ms, where the histogram of every run puts it, got {lat[q]:.6g}")
    samples = res["latency_samples_ms"]
    if not samples or len(samples) > res["runs"] or min(samples) < lat["min"] or max(samples) > lat["max"]:
        return "latency_samples_ms", "expected at most `runs` samples within latency_ms's min and max"
    rounds = res["latency_rounds_ms"]
    if len(rounds) != res["rounds"]:
        return "latency_rounds_ms", f"expected {res['rounds']} rounds (rounds), got {len(rounds)}"
    for key, combine in (("latency_ms_best_round", min), ("latency_ms_median", lambda v: float(np.median(v)))):
        for stat, got in res[key].items():
            if _differs(got, combine([r[stat] for r in rounds])):
                return f"{key}.{stat}", f"expected {combine([r[stat] for r in rounds]):.6g} from latency_rounds_ms"
    if _differs(lat["min"], min(r["min"] for r in rounds)) or _differs(lat["max"], max(r["max"] for r in rounds)):
        return "latency_ms", "expected the min and max of latency_rounds_ms"
    return None


def _counts_agree(res, n):
    protocol = res["protocol"]
    for key in ("rounds", "batch_size", "warmup"):
        if protocol[key] != res[key]:
            return f"protocol.{key}", f"expected {key} ({res[key]}), got {protocol[key]}"
    if res["runs"] < protocol["min_runs"]:
        return "runs", f"expected at least protocol.min_runs ({protocol['min_runs']}), got {res['runs']}"
    if res["seconds"] > 0 and _differs(res["throughput_per_s"], res["batch_size"] * res["runs"] / res["seconds"]):
        return "throughput_per_s", "expected batch_size x runs / seconds"
    mem = res["memory"]
    if mem["batch_size"] != res["batch_size"]:
        return "memory.batch_size", f"expected batch_size ({res['batch_size']}), got {mem['batch_size']}"
    if None not in (mem["runtime_baseline_mb"], mem["model_mb"]) and (
            mem["deployed_mb"] is None or _differs(mem["deployed_mb"], mem["runtime_baseline_mb"] + mem["model_mb"])):
        return "memory.deployed_mb", "expected runtime_baseline_mb + model_mb"
    return None


def expected_identity(manifest, bundle_dir, profile, artifact=None):
    """What results of `artifact` (None: the bundle's primary one, the selection's choice) of this bundle on
    this device must say: {field: value}."""
    art = select_artifact(bundle_dir, manifest, artifact)
    return {"bundle.artifact": art["name"], "bundle.format": art["format"], "bundle.precision": art["precision"],
            "bundle.model_file": art["model_file"],
            "bundle.model_sha256": manifest["files"][art["model_file"]]["sha256"],
            "bundle.mc_samples": manifest["mc_samples"], "runtime.name": art["runtime"],
            "tags.device": profile.name, "protocol.batch_size": profile.budgets.batch_size,
            # latency depends on the intra-op threads: figures timed with another count than the profile's
            # runtime.threads must not be judged against its budget
            "protocol.threads": profile.runtime.threads,
            "reference": manifest["reference"]}


def identity(res, expected, path, device):
    """Refuse results whose model, artifact, format, precision, runtime, device or protocol differ from
    `expected` (expected_identity), naming the first field that differs."""
    for field, want in expected.items():
        got = res
        for part in field.split("."):
            got = got.get(part) if isinstance(got, dict) else None
        if got != want:
            shown = {"bundle.model_sha256": lambda v: f"{str(v)[:12]}..."}.get(field, _show)
            raise ResultsError(
                f"{path}: {field}: {shown(got) if got is not None else 'missing'}, but this run's "
                f"{'choice' if field.startswith(('bundle', 'runtime')) else 'profile'} for {device} has "
                f"{shown(want)}: results of another {_WHAT.get(field, 'run')}; run this run's bundle there "
                f"with the command the report gives")


_WHAT = {"bundle.model_sha256": "bundle's model", "bundle.model_file": "bundle", "bundle.artifact": "artifact",
         "bundle.format": "format", "bundle.precision": "precision", "bundle.mc_samples": "bundle",
         "runtime.name": "runtime", "tags.device": "device", "protocol.batch_size": "batch size",
         "protocol.threads": "thread count (runtime.threads)",
         "reference": "bundle (evaluation set)"}


def check_results(path, manifest, bundle_dir, profile, artifact=None):
    """read_results, then identity: the results of this bundle's `artifact` on this device, or ResultsError."""
    res = read_results(path)
    identity(res, expected_identity(manifest, bundle_dir, profile, artifact), path, profile.name)
    return res
