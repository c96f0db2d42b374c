"""The runner's command line: verify a bundle, run its model on this device, write one JSON results file.

    python runner.pyz --bundle ./bundle --out results.json

(runner.pyz is this package as a zipapp, shipped inside the bundle; `python -m edgebayes.ondevice` is the
same where edgebayes is installed). In this order:

1. verifies the bundle (manifest keys, file sizes, sha256 hashes: bundle.verify_bundle);
2. loads the model (session creation and the first inference timed apart: the cold start, as TFLite's
   benchmark_model reports it), then times single-batch inference (warm-up, then at least --min-runs runs
   AND at least --min-seconds seconds, in the spirit of MLPerf "single stream"), split into --rounds
   rounds; each percentile is over every timed sample, the best round's kept beside it
   (timing.latency_summary); the model's own memory is the peak RSS from loading to the end of the
   warm-up minus the RSS before it was loaded (see `main`);
3. runs the whole evaluation set through the model: accuracy, NLL, ECE, Brier score, the largest
   difference from the PyTorch reference, and where the bundle has out-of-distribution inputs, OOD AUROC /
   AUPR and the accuracy-vs-rejection curve by predictive entropy;
4. writes one JSON results file, atomically.

`--time-models SPEC` times several model files instead (selection and `edgebayes devices profile`).
Defaults of the timing protocol are tables.PROTOCOL, the same as config.BenchmarkConfig's.

Exit codes: 0 success, 1 could not write the results, 2 invalid bundle (or bad command line), 3 runtime
problem (unknown/unavailable runtime, model failed to load or run), 4 the device is busy: another runner
kept its timing lock (machine.timing_lock) longer than --lock-wait-s.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from .atomic import write_json
from .backends import RuntimeProblem
from .bundle import (MANIFEST_NAME, SCHEMA_VERSION, BundleError, load_eval_set, load_ood_set, select_artifact, sha256_file,
                     verify_bundle)
from .machine import DeviceBusy, current_rss_mb, device_info, peak_rss_mb, reset_peak_rss, timing_lock, utc_now
from .metrics import classification_metrics, ood_detection, reliability_bins, selective_prediction
from .runtimes import BACKENDS, load_runtime, make_backend, predict_all
from .tables import PROTOCOL
from .timing import latency_summary, measure_rounds, timed_round

EXIT_OK, EXIT_WRITE, EXIT_BUNDLE, EXIT_RUNTIME, EXIT_BUSY = 0, 1, 2, 3, 4


def _non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


MAX_THREADS = 1024   # past any board's cores: a larger count hung the runtime's thread pool creation


def _thread_count(text):
    value = _non_negative_int(text)
    if value > MAX_THREADS:
        raise argparse.ArgumentTypeError("must be <= {}, got {}".format(MAX_THREADS, value))
    return value


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_float(text):
    value = float(text)
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_parser():
    parser = argparse.ArgumentParser(
        prog="runner.pyz", description="Verify an edgebayes bundle, measure its accuracy/calibration "
                                      "and latency on this device, and write a JSON report.")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--bundle", help="bundle directory (holds manifest.json)")
    mode.add_argument("--time-models", metavar="SPEC",
                      help="latency only: a JSON file listing model files to time one after another "
                           "(`edgebayes devices profile` and selection on a remote device); see time_models")
    parser.add_argument("--out", required=True, help="results JSON path (written atomically)")
    parser.add_argument("--warmup", type=_non_negative_int, default=PROTOCOL["warmup"], help="untimed warm-up runs")
    parser.add_argument("--min-runs", type=positive_int, default=PROTOCOL["min_runs"], help="minimum timed runs")
    parser.add_argument("--min-seconds", type=_non_negative_float, default=PROTOCOL["min_seconds"],
                        help="minimum timed seconds")
    parser.add_argument("--rounds", type=positive_int, default=PROTOCOL["rounds"],
                        help="timed rounds; percentiles over all their samples, the best round's beside them "
                             "(latency_summary)")
    parser.add_argument("--batch-size", type=positive_int, default=1,
                        help="rows per timed run (of --time-models too)")
    parser.add_argument("--threads", type=_thread_count, default=0, help="intra-op threads, 0 = runtime default")
    parser.add_argument("--runtime", default=None,
                        help=f"runtime to use ({', '.join(sorted(BACKENDS))}); default: from the manifest's format")
    parser.add_argument("--providers", default=None,
                        help="onnxruntime execution providers, comma-separated in priority order "
                             "(e.g. CUDAExecutionProvider,CPUExecutionProvider); default CPU only")
    parser.add_argument("--artifact", default=None,
                        help="which of the bundle's artifacts to run (e.g. onnx-int8, tflite-fp16); "
                             "default: the manifest's model_file")
    parser.add_argument("--workspace-mb", type=positive_int, default=1024,
                        help="TensorRT builder workspace in MiB (engines are built on this device)")
    parser.add_argument("--engine-cache", default=None,
                        help="folder of cached TensorRT engines (default: trt-engines/ beside the bundle)")
    parser.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE",
                        help="a fact to copy into the results' tags (e.g. device=jetson-orin-nano)")
    parser.add_argument("--lock-wait-s", type=_non_negative_float, default=1800.0,
                        help="how long to wait for another runner timing models on this device (exit 4 after)")
    parser.add_argument("--quiet", action="store_true", help="no progress or summary on stderr")
    parser.add_argument("--progress", action="store_true",
                        help="draw the timing progress bar even when stderr is not a terminal (deploy passes "
                             "it when its own terminal shows the device's stderr)")
    return parser


def command_line(runner, out, *, bundle=None, time_models=None, tags=None, **options):
    """The runner's argument list: the one place it is assembled (deploy, the steps to run it by hand, and
    selection's timing). `runner` is the zipapp's path as the device sees it; give `bundle` or
    `time_models`; options are the parser's own by name (warmup=20, batch_size=4, quiet=True), None or
    False leave one out; tags: {key: value} for --tag. An unknown option raises TypeError here, not on the
    device."""
    known = {action.dest: action for action in build_parser()._actions}
    argv = [runner, *(["--bundle", bundle] if bundle is not None else ["--time-models", time_models]), "--out", out]
    for name, value in options.items():
        if name not in known or name in ("bundle", "time_models", "out", "tag", "help"):
            raise TypeError(f"the runner has no option {name!r}")
        if value is None or value is False:
            continue
        argv += [known[name].option_strings[0]] + ([] if value is True else [value])
    for key, value in (tags or {}).items():
        argv += ["--tag", f"{key}={value}"]
    return [str(a) for a in argv]


def _tags(pairs):
    tags = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            print(f"runner: --tag expects KEY=VALUE, got {pair!r}", file=sys.stderr)
            raise SystemExit(EXIT_BUNDLE)   # a bad command line: 2, as argparse's own errors
        tags[key] = value
    return tags


def time_models(spec_path, out, warmup, min_runs, min_seconds, threads, tags, rounds, batch_size, lock=None,
                say=None):
    """Time each model a spec lists, with the same protocol as a bundle's benchmark.

    The spec is JSON: {"example": "x.npy", "models": [{"id": ..., "file": ..., "runtime": "onnxruntime"},
    ...]}, paths relative to the spec's folder; the batch size is --batch-size's (one channel, as for a
    bundle). The example rows are read with allow_pickle=False. Writes {"models": [{"id", "latency_ms",
    "runs", ...}], "runtime", "device", "memory", ...}.

    memory: what selection's memory estimate needs from the device. runtime_baseline_mb is the RSS with
    the runtimes imported and no model; runtime_setup_mb the one-off cost of a runtime's first session and
    inference (thread pools, kernel tables, the arena's first chunk: about 16 MB for onnxruntime 1.31 on
    x86), measured as the RSS the smallest model adds when it is loaded and run first, less twice its file
    (see select.memory_estimate). Both are per process, not per model.
    """
    base = os.path.dirname(os.path.abspath(spec_path))
    with open(spec_path, "r", encoding="utf-8") as fh:
        spec = json.load(fh)
    if "batch_size" in spec:
        raise ValueError("the batch size is the command line's --batch-size, not a key of the spec")
    example = np.load(os.path.join(base, spec["example"]), allow_pickle=False).astype(np.float32)
    batch = np.ascontiguousarray(example[np.arange(batch_size) % len(example)])
    entries = [dict(entry, path=os.path.join(base, entry["file"]), runtime=entry.get("runtime", "onnxruntime"))
               for entry in spec["models"]]
    for runtime in sorted({e["runtime"] for e in entries}):
        load_runtime(runtime)
    with lock or timing_lock(0):
        timed, memory, runtime_info = _time_entries(spec, entries, batch, threads, rounds, warmup, min_runs,
                                                    min_seconds, batch_size, say)
    write_json(out, {
        "schema": SCHEMA_VERSION, "models": timed, "runtime": runtime_info, "device": device_info(),
        "memory": memory,
        "protocol": {"warmup": warmup, "min_runs": min_runs, "min_seconds": min_seconds, "rounds": rounds,
                     "batch_size": batch_size, "threads": threads},
        "tags": tags, "finished_at": utc_now()})


def _time_entries(spec, entries, batch, threads, rounds, warmup, min_runs, min_seconds, batch_size, say=None):
    baseline = current_rss_mb()
    memory = {"runtime_baseline_mb": baseline, "runtime_setup_mb": None, "setup_measured_with": None}
    # The smallest model first: what its loading and first run add beyond its own bytes is the runtime's.
    order = sorted(range(len(entries)), key=lambda i: os.path.getsize(entries[i]["path"]))
    backends = [None] * len(entries)
    for k, i in enumerate(order):
        backends[i] = make_backend(entries[i]["runtime"], entries[i]["path"], threads)
        if k == 0 and baseline is not None:
            backends[i].run(batch)
            own = 2 * os.path.getsize(entries[i]["path"]) / 1e6
            memory.update(runtime_setup_mb=max(0.0, current_rss_mb() - baseline - own),
                          setup_measured_with=entries[i]["id"])
    # Models are timed in interleaved rounds, so a slow spell of the device falls on a few rounds of every
    # model instead of on all rounds of the model that happened to run then (latency_summary).
    timings = [[] for _ in backends]
    start = time.monotonic()
    for r in range(rounds):
        for i, backend in enumerate(backends):
            timings[i].append(timed_round(backend, batch, r, rounds, warmup, min_runs, min_seconds))
        if say is not None:   # one line a round: a sweep of tens of models takes tens of seconds
            spent = time.monotonic() - start
            say(f"timing {len(backends)} models: round {r + 1}/{rounds} in {spent:.0f} s, "
                f"about {spent / (r + 1) * (rounds - r - 1):.0f} s left")
    timed = []
    for entry, model_rounds in zip(spec["models"], timings):
        summary = latency_summary(model_rounds, batch_size)
        del summary["samples_ms"], summary["histogram"]
        timed.append({"id": entry["id"], **summary})
    return timed, memory, backends[-1].info() if backends else None


def main(argv=None):
    """Run the benchmark; returns the process exit code (see module docstring)."""
    args = build_parser().parse_args(argv)
    started_at = utc_now()
    tags = _tags(args.tag)

    def say(message):
        if not args.quiet:
            print(f"runner: {message}", file=sys.stderr)

    if args.time_models:
        try:
            time_models(args.time_models, args.out, args.warmup, args.min_runs, args.min_seconds, args.threads,
                        tags, args.rounds, args.batch_size, timing_lock(args.lock_wait_s, say),
                        say=None if args.quiet else say)
        except RuntimeProblem as exc:
            print(f"runner: {exc}", file=sys.stderr)
            return EXIT_RUNTIME
        except DeviceBusy as exc:
            print(f"runner: {exc}", file=sys.stderr)
            return EXIT_BUSY
        except (OSError, ValueError, KeyError) as exc:
            print(f"runner: {args.time_models}: {exc}", file=sys.stderr)
            return EXIT_WRITE if isinstance(exc, OSError) else EXIT_BUNDLE
        say(f"timed {args.time_models} -> {args.out}")
        return EXIT_OK

    try:
        manifest = verify_bundle(args.bundle)
        artifact = select_artifact(args.bundle, manifest, args.artifact)
    except BundleError as exc:
        print(f"runner: {exc}", file=sys.stderr)
        return EXIT_BUNDLE
    # --out onto a file of the bundle (its manifest, or any file the manifest hashes) would destroy the bundle
    bundle_dir = Path(args.bundle).resolve()
    if any(Path(args.out).resolve() == (bundle_dir / n).resolve() for n in (MANIFEST_NAME, *manifest["files"])):
        print(f"runner: --out {args.out} is a file of the bundle {args.bundle}; writing the results there would "
              f"destroy it: give another path (e.g. --out results.json)", file=sys.stderr)
        return EXIT_BUNDLE
    runtime = args.runtime or artifact["runtime"]
    # Memory, in this order: the runtime imported with no model (its baseline); the eval set loaded; the
    # peak reset; the model loaded, run and warmed up at the benchmark's batch size. The model's own memory is
    # that phase's peak minus the RSS before it, so neither the eval set nor its loading counts, and the
    # memory a deployment needs is the baseline plus the model's own (`memory` in the results).
    try:
        load_runtime(runtime)
    except RuntimeProblem as exc:
        print(f"runner: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    runtime_baseline = current_rss_mb()
    try:
        x, y, reference_probs = load_eval_set(args.bundle, manifest)
        ood_x = load_ood_set(args.bundle, manifest, x)
    except BundleError as exc:
        print(f"runner: {exc}", file=sys.stderr)
        return EXIT_BUNDLE
    say(f"bundle {args.bundle} verified ({artifact['name']}: {artifact['format']}/{artifact['precision']}, "
        f"{len(y)} eval rows" + (f", {len(ood_x)} OOD rows" if ood_x is not None else "") + ")")

    providers = [p.strip() for p in args.providers.split(",") if p.strip()] if args.providers else None
    model_path = os.path.join(args.bundle, artifact["model_file"])
    options = {}
    if runtime == "tensorrt":
        options = {"precision": artifact["precision"], "workspace_mb": args.workspace_mb,
                   "engine_cache": args.engine_cache, "example_shape": x.shape[1:]}
    # A fixed batch, reused every run; wrap around if the eval set is smaller.
    batch = np.ascontiguousarray(x[np.arange(args.batch_size) % len(x)])
    n_classes = reference_probs.shape[1]
    # The sha256 of the model measured, taken again just before it is loaded and after the last inference:
    # the results name the model they measured, and a file replaced meanwhile (another run writing the
    # same folder) is an error, not a mix of two models' figures.
    expected_sha = manifest["files"][artifact["model_file"]]["sha256"]
    measured_sha = sha256_file(model_path)
    peak_before = peak_rss_mb()
    before_model = current_rss_mb()
    peak_reset = reset_peak_rss()
    lock = timing_lock(args.lock_wait_s, say)
    try:
        lock.__enter__()   # released below, once the last inference is done
        # Cold start, as TFLite's benchmark_model reports it: creating the session (a TensorRT engine
        # built now included, and also given apart), then the first inference, before any warm-up.
        t0 = time.perf_counter()
        backend = make_backend(runtime, model_path, args.threads, providers, **options)
        t1 = time.perf_counter()
        try:
            first = np.asarray(backend.run(batch))
        except RuntimeProblem:
            raise
        except Exception as exc:   # the runtime's own error type (onnxruntime's InvalidArgument, LiteRT's ValueError)
            raise RuntimeProblem("{}: the model failed its first inference on this runtime ({}: {})".format(
                artifact["model_file"], type(exc).__name__, str(exc)[:300])) from exc
        t2 = time.perf_counter()
        if first.shape != (len(batch), n_classes):
            print(f"runner: bundle {args.bundle}: {artifact['model_file']}: model output shape "
                  f"{list(first.shape)} for a batch of {len(batch)} does not match the {n_classes} classes of "
                  f"reference_probs", file=sys.stderr)
            return EXIT_BUNDLE
        cold_start = {"session_create_ms": 1000.0 * (t1 - t0), "first_inference_ms": 1000.0 * (t2 - t1),
                      "engine_build_ms": getattr(backend, "engine_build_ms", None)}
        for _ in range(args.warmup):   # caches, lazy allocations, JIT/graph setup, CPU clocks
            backend.run(batch)
        # The model loaded and warm at the benchmark's batch size: its memory is all there now (the timed
        # runs below allocate nothing of the model's, only the runner's list of latencies).
        model_peak = peak_rss_mb()
        timing = measure_rounds(backend, batch, warmup=0, min_runs=args.min_runs,
                                min_seconds=args.min_seconds, rounds=args.rounds,
                                progress=not args.quiet and (args.progress or sys.stderr.isatty()))

        probs = predict_all(backend, x)
        if probs.shape != reference_probs.shape:
            print(f"runner: bundle {args.bundle}: {artifact['model_file']}: model output shape "
                  f"{list(probs.shape)} does not match reference_probs {list(reference_probs.shape)}",
                  file=sys.stderr)
            return EXIT_BUNDLE
        ood_probs = None if ood_x is None else predict_all(backend, ood_x)
        # A model that runs but computes nothing usable here: every metric would be NaN, exit 0; on the OOD
        # inputs a NaN entropy sorts as the most uncertain, and the AUROC would reward the broken output.
        for what, p in (("eval", probs), ("OOD", ood_probs)):
            bad = 0 if p is None else int((~np.isfinite(p)).any(axis=1).sum())
            if bad:
                print(f"runner: bundle {args.bundle}: {artifact['model_file']}: the model's output holds NaN or "
                      f"infinite values for {bad} of {len(p)} {what} inputs on this runtime", file=sys.stderr)
                return EXIT_RUNTIME
        metrics = classification_metrics(probs, y)
        max_diff = float(np.max(np.abs(probs - reference_probs.astype(np.float64))))
        ood = None if ood_probs is None else ood_detection(probs, ood_probs)
        say(f"accuracy {metrics['accuracy']:.4f}  nll {metrics['nll']:.4f}  ece {metrics['ece']:.4f}  "
            f"max |p - p_ref| {max_diff:.2e}" + (f"  OOD AUROC {ood['auroc']:.4f}" if ood else ""))
    except RuntimeProblem as exc:
        print(f"runner: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    except DeviceBusy as exc:
        print(f"runner: {exc}", file=sys.stderr)
        return EXIT_BUSY
    finally:
        lock.__exit__(None, None, None)
    if not measured_sha == sha256_file(model_path) == expected_sha:
        print(f"runner: bundle {args.bundle}: {artifact['model_file']} changed after the bundle was verified "
              f"(another run writing the same folder?); nothing written", file=sys.stderr)
        return EXIT_BUNDLE

    def minus(a, b):
        return None if a is None or b is None else max(0.0, a - b)

    model_mb = minus(model_peak, before_model)
    peak_all = peak_rss_mb()
    runtime_info = backend.info()
    runtime_info["threads"] = args.threads
    results = {
        "schema": SCHEMA_VERSION,
        "bundle": {
            "artifact": artifact["name"],
            "format": artifact["format"],
            "precision": artifact["precision"],
            "mc_samples": manifest["mc_samples"],
            "knob": manifest["knob"],
            "model_file": artifact["model_file"],
            "model_sha256": measured_sha,   # of the file loaded and measured (checked above)
        },
        "runtime": runtime_info,
        "device": device_info(),
        "latency_ms": timing["latency_ms"],
        "latency_ms_best_round": timing["latency_ms_best_round"],
        "latency_ms_median": timing["latency_ms_median"],
        "latency_spread": timing["spread"],
        "latency_rounds_ms": timing["round_ms"],
        "cold_start": cold_start,
        "rounds": timing["rounds"],
        "runs": timing["runs"],
        "seconds": timing["seconds"],
        "warmup": args.warmup,
        "batch_size": args.batch_size,
        # The protocol the figures were measured under (MLPerf single-stream style: warm-up, then at
        # least min_runs queries AND min_seconds), and the caller's facts (device profile, ...).
        "protocol": {"warmup": args.warmup, "min_runs": args.min_runs, "min_seconds": args.min_seconds,
                     "rounds": args.rounds, "batch_size": args.batch_size, "threads": args.threads},
        "tags": tags,
        "throughput_per_s": timing["throughput_per_s"],
        # The whole runner's peak, its eval set and accuracy pass (batches of ACCURACY_BATCH) included.
        "peak_rss_mb": max((v for v in (peak_before, peak_all) if v is not None), default=None),
        "memory": {
            "runtime_baseline_mb": runtime_baseline,   # python, numpy and the runtime imported, no model
            "model_mb": model_mb,                      # peak while loading, running, warming it up - RSS before
            "deployed_mb": None if model_mb is None or runtime_baseline is None else runtime_baseline + model_mb,
            "batch_size": args.batch_size,
            # Without a peak reset (not Linux) the model's peak may include the eval set's loading.
            "peak_reset": peak_reset,
        },
        "metrics": metrics,
        "reliability": reliability_bins(probs, y),
        "ood": ood,
        "selective": selective_prediction(probs, y),
        "latency_samples_ms": timing["samples_ms"],
        "latency_histogram": timing["histogram"],   # every timed run, counted (timing.run_histogram)
        "reference": manifest["reference"],
        "max_abs_prob_diff": max_diff,
        "started_at": started_at,
        "finished_at": utc_now(),
    }
    try:
        write_json(args.out, results)
    except OSError as exc:
        print(f"runner: cannot write results to {args.out}: {exc}", file=sys.stderr)
        return EXIT_WRITE
    lat = timing["latency_ms"]
    say(f"p50 {lat['p50']:.4g} ms  p90 {lat['p90']:.4g} ms  p99 {lat['p99']:.4g} ms  max {lat['max']:.4g} ms "
        f"(all {timing['runs']} runs, {timing['throughput_per_s']:.1f}/s)  -> {args.out}")
    return EXIT_OK
