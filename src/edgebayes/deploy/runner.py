#!/usr/bin/env python3
"""On-device benchmark runner for an edgebayes deployment bundle.

This one file is copied to an edge device (Jetson, Raspberry Pi, ...) next to
a bundle directory and run there:

    python runner.py --bundle ./bundle --out results.json

It does four things, in this order:

1. verifies the bundle (manifest keys, file sizes, sha256 hashes);
3. loads the model (session creation and the first inference timed apart:
   the cold start, as TFLite's benchmark_model reports it), then times
   single-batch inference (warm-up, then at least --min-runs runs AND at
   least --min-seconds seconds, in the spirit of MLPerf "single stream"),
   split into --rounds rounds; each percentile is over every timed sample,
   the best round's kept beside it (see `latency_summary`); the model's
   own memory is the peak RSS from loading to the end of the warm-up
   minus the RSS before it was loaded (see `main`);
4. runs the whole evaluation set through the model: accuracy, NLL, ECE,
   Brier score, the largest difference from the PyTorch reference, and
   where the bundle has out-of-distribution inputs, OOD AUROC / AUPR and
   the accuracy-vs-rejection curve by predictive entropy;
5. writes one JSON results file, atomically.

Self-containment rule: this file imports only the standard library, numpy and
(lazily, inside a Backend) the inference runtime it uses.  It never imports
torch or edgebayes, and never unpickles anything, because the device usually
has neither PyTorch nor the edgebayes package installed, and a bundle is data
that should not be able to run code.  The edgebayes package imports the
metric functions and `verify_bundle` from here, so they are defined once.

Exit codes: 0 success, 1 could not write the results, 2 invalid bundle (or
bad command line), 3 runtime problem (unknown/unavailable runtime, model
failed to load or run).
"""

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import platform
import re
import socket
import sys
import tempfile
import time

import numpy as np

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
REQUIRED_KEYS = (
    "schema", "format", "precision", "model_file", "eval_file", "input",
    "output", "classes", "mc_samples", "knob", "reference", "files",
)
EVAL_ARRAYS = ("x", "y", "reference_probs")
OOD_ARRAY = "ood_x"   # optional in eval.npz: out-of-distribution inputs of the same shape
ARTIFACT_KEYS = ("model_file", "format", "precision", "runtime")  # each entry of the optional "artifacts"
ACCURACY_BATCH = 256  # big enough to be fast, small enough for a Pi's memory
NLL_CLIP = 1e-12      # log(0) would make one bad example dominate the mean
MAX_SAMPLES = 2000    # latency samples kept in the results file
DEFAULT_ROUNDS = 10   # timed rounds, interleaved with the other models' (time_models)
# Fractions of the evaluation set rejected (most uncertain first) for the accuracy-vs-rejection curve.
REJECTION_FRACTIONS = tuple(round(0.05 * i, 2) for i in range(19))   # 0 .. 0.9

EXIT_OK, EXIT_WRITE, EXIT_BUNDLE, EXIT_RUNTIME = 0, 1, 2, 3

# Lines TensorFlow / LiteRT's native code writes at start-up that say nothing about the run (absl INFO lines:
# oneDNN notes, op counts; the delegate notice). Warnings and errors are not in it.
NATIVE_NOISE = (
    re.compile(r"^I\d{4} \d\d:\d\d:[\d.]+ +\d+ [\w./-]+\.cc:\d+\] "),
    re.compile(r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$"),
    re.compile(r"^INFO: Created TensorFlow Lite XNNPACK delegate for CPU\.$"),
)


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------

class BundleError(Exception):
    """The bundle is missing, malformed, corrupted or inconsistent.

    The message names the bundle and the offending file, e.g.
    ``bundle /x/b: model.onnx: sha256 mismatch (...)``.
    """


class RuntimeProblem(Exception):
    """The requested runtime is unknown, not installed, or failed on the model."""


# --------------------------------------------------------------------------
# Metrics: plain numpy, shared with the rest of edgebayes.
# `probs` is [N, C] predictive probabilities (already MC-averaged), `y` is
# [N] integer labels.  All sums are done in float64 so that fp16/fp32 model
# outputs do not change the metric definitions.
# --------------------------------------------------------------------------

def _check_probs_labels(probs, y):
    probs = np.asarray(probs, dtype=np.float64)
    y = np.asarray(y)
    if probs.ndim != 2:
        raise ValueError(f"probs must be 2-D [N, C], got shape {probs.shape}")
    if y.ndim != 1 or y.shape[0] != probs.shape[0]:
        raise ValueError(f"y must be 1-D with N={probs.shape[0]} entries, got shape {y.shape}")
    if probs.shape[0] == 0:
        raise ValueError("metrics of an empty set are undefined")
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"y must hold integer class labels, got dtype {y.dtype}")
    if y.min() < 0 or y.max() >= probs.shape[1]:
        raise ValueError(f"labels must lie in [0, {probs.shape[1]}), got [{y.min()}, {y.max()}]")
    return probs, y.astype(np.int64)


def accuracy(probs, y):
    """Fraction of examples whose argmax class equals the label: mean(argmax_c p = y)."""
    probs, y = _check_probs_labels(probs, y)
    return float(np.mean(probs.argmax(axis=1) == y))


def negative_log_likelihood(probs, y):
    """Mean negative log-likelihood: mean_i -log(max(p_i[y_i], 1e-12)), natural log."""
    probs, y = _check_probs_labels(probs, y)
    p_true = probs[np.arange(len(y)), y]
    return float(np.mean(-np.log(np.clip(p_true, NLL_CLIP, 1.0))))


def _confidence_bins(probs, y, n_bins):
    """Per-bin count, summed confidence and summed correctness over equal-width confidence bins.

    confidence_i = max_c p_i[c]; bins are (k/n, (k+1)/n] (the first also holds 0).
    """
    probs, y = _check_probs_labels(probs, y)
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    conf = probs.max(axis=1)
    correct = (probs.argmax(axis=1) == y).astype(np.float64)
    # searchsorted on the inner edges puts conf into (lo, hi] bins, exactly
    # like the usual `lo < conf <= hi` loop, but in one vectorised step.
    inner_edges = np.linspace(0.0, 1.0, n_bins + 1)[1:-1]
    bin_idx = np.searchsorted(inner_edges, conf, side="left")
    counts = np.bincount(bin_idx, minlength=n_bins)
    sum_conf = np.bincount(bin_idx, weights=conf, minlength=n_bins)
    sum_correct = np.bincount(bin_idx, weights=correct, minlength=n_bins)
    return counts, sum_conf, sum_correct


def expected_calibration_error(probs, y, n_bins=15):
    """Expected calibration error with `n_bins` equal-width confidence bins.

    ECE = sum_b |b|/N * |accuracy(b) - mean confidence(b)|, empty bins
    contribute 0 (Guo et al., 2017); bins as in `_confidence_bins`.
    """
    counts, sum_conf, sum_correct = _confidence_bins(probs, y, n_bins)
    # |bin|/N * |acc - conf| == |sum_correct - sum_conf| / N per bin.
    return float(np.sum(np.abs(sum_correct - sum_conf)) / counts.sum())


def reliability_bins(probs, y, n_bins=15):
    """The reliability diagram behind the ECE: per bin, mean confidence,
    accuracy (None for an empty bin) and count."""
    counts, sum_conf, sum_correct = _confidence_bins(probs, y, n_bins)
    safe = np.maximum(counts, 1)
    return {
        "bin_confidence": [float(c) if n else None for c, n in zip(sum_conf / safe, counts)],
        "bin_accuracy": [float(a) if n else None for a, n in zip(sum_correct / safe, counts)],
        "bin_count": [int(n) for n in counts],
    }


def brier_score(probs, y):
    """Multi-class Brier score: mean_i sum_c (p_i[c] - onehot(y_i)[c])^2 (range 0..2)."""
    probs, y = _check_probs_labels(probs, y)
    onehot = np.zeros_like(probs)
    onehot[np.arange(len(y)), y] = 1.0
    return float(np.mean(np.sum((probs - onehot) ** 2, axis=1)))


def classification_metrics(probs, y):
    """All metrics above as a dict: accuracy, nll, ece (15 bins), brier, n."""
    return {
        "accuracy": accuracy(probs, y),
        "nll": negative_log_likelihood(probs, y),
        "ece": expected_calibration_error(probs, y, n_bins=15),
        "brier": brier_score(probs, y),
        "n": int(len(y)),
    }


def predictive_entropy(probs):
    """Entropy of the MC-averaged predictive distribution, -sum_c p[c] log p[c] (nats): the uncertainty
    score for OOD detection and selective prediction (train/metrics.ood_scores uses the same)."""
    probs = np.asarray(probs, dtype=np.float64)
    return -(probs * np.log(np.clip(probs, NLL_CLIP, 1.0))).sum(axis=1)


def auroc(scores, labels):
    """Area under the ROC curve of `scores` for binary `labels` (1 = positive): the Mann-Whitney statistic
    with tied scores given their average rank, so it equals scikit-learn's roc_auc_score."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels).astype(bool)
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUROC needs positives and negatives")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    counts = np.diff(np.r_[starts, len(scores)])
    ranks = np.empty(len(scores))
    ranks[order] = np.repeat(starts + (counts + 1) / 2.0, counts)   # 1-based average rank of each tie group
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def average_precision(scores, labels):
    """Area under the precision-recall curve as scikit-learn's average_precision_score computes it:
    sum over distinct thresholds of (recall step) x precision, positives = label 1."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels).astype(np.float64)
    if labels.sum() == 0:
        raise ValueError("average precision needs positives")
    order = np.argsort(-scores, kind="mergesort")
    sorted_scores, sorted_labels = scores[order], labels[order]
    last = np.r_[np.flatnonzero(sorted_scores[1:] != sorted_scores[:-1]), len(scores) - 1]  # end of each tie group
    tps = np.cumsum(sorted_labels)[last]
    precision, recall = tps / (last + 1), tps / tps[-1]
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def ood_detection(probs_in, probs_out):
    """OOD detection by predictive entropy, the OOD inputs as positives: AUROC and AUPR (as in training's
    metrics.json, here on the device's own outputs)."""
    scores = np.concatenate([predictive_entropy(probs_in), predictive_entropy(probs_out)])
    labels = np.concatenate([np.zeros(len(probs_in)), np.ones(len(probs_out))])
    return {"auroc": auroc(scores, labels), "aupr": average_precision(scores, labels), "score": "predictive entropy",
            "n_in": int(len(probs_in)), "n_out": int(len(probs_out))}


def selective_prediction(probs, y, fractions=REJECTION_FRACTIONS):
    """Accuracy against the fraction rejected: the examples with the highest predictive entropy are
    refused first (a Bayesian net's point: it can say "not sure"). Per fraction r, the accuracy on the
    ceil((1 - r) N) most certain examples and the entropy threshold that keeps them."""
    probs, y = _check_probs_labels(probs, y)
    entropy = predictive_entropy(probs)
    order = np.argsort(entropy, kind="mergesort")            # most certain first
    correct = (probs.argmax(axis=1) == y)[order]
    rows = {"rejected": [], "kept": [], "accuracy": [], "max_entropy": []}
    for r in fractions:
        kept = max(1, int(np.ceil((1.0 - r) * len(y))))
        rows["rejected"].append(float(r))
        rows["kept"].append(kept)
        rows["accuracy"].append(float(correct[:kept].mean()))
        rows["max_entropy"].append(float(entropy[order[kept - 1]]))
    return {**rows, "score": "predictive entropy", "n": int(len(y))}


# --------------------------------------------------------------------------
# Bundle verification and loading
# --------------------------------------------------------------------------

def sha256_file(path, chunk_size=1 << 20):
    """Hex sha256 of a file, read in chunks so large models fit in small RAM."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(chunk_size), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _safe_relative(name):
    """True if `name` is a relative path that stays inside the bundle."""
    if not isinstance(name, str) or not name or os.path.isabs(name):
        return False
    parts = name.replace("\\", "/").split("/")
    return ".." not in parts


def verify_bundle(bundle_dir):
    """Check a bundle directory and return its manifest (a dict).

    Checks: manifest.json exists and is a JSON object with every required
    key and schema 1; model_file and eval_file are listed in `files`; every
    listed file exists with the listed byte size and sha256.  Raises
    BundleError with a one-line message naming the bundle and the file.
    """
    bundle_dir = os.fspath(bundle_dir)

    def fail(what, detail):
        raise BundleError(f"bundle {bundle_dir}: {what}: {detail}")

    if not os.path.isdir(bundle_dir):
        raise BundleError(f"bundle {bundle_dir}: does not exist or is not a directory")
    manifest_path = os.path.join(bundle_dir, MANIFEST_NAME)
    if not os.path.isfile(manifest_path):
        fail(MANIFEST_NAME, "missing; this directory is not an edgebayes bundle")
    try:
        with open(manifest_path, "r", encoding="utf-8") as fh:
            manifest = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        fail(MANIFEST_NAME, f"not valid JSON ({exc})")
    if not isinstance(manifest, dict):
        fail(MANIFEST_NAME, f"must be a JSON object, got {type(manifest).__name__}")

    missing = [key for key in REQUIRED_KEYS if key not in manifest]
    if missing:
        fail(MANIFEST_NAME, f"missing required key(s): {', '.join(missing)}")
    if manifest["schema"] != SCHEMA_VERSION:
        fail(MANIFEST_NAME, f"unsupported schema {manifest['schema']!r} "
                            f"(this runner reads schema {SCHEMA_VERSION}); use a matching runner.py")
    for key, kind in (("files", dict), ("input", dict), ("output", dict),
                      ("classes", list), ("knob", dict), ("reference", dict)):
        if not isinstance(manifest[key], kind):
            fail(MANIFEST_NAME, f"key {key!r} must be a JSON {'object' if kind is dict else 'array'}")

    files = manifest["files"]
    for key in ("model_file", "eval_file"):
        if manifest[key] not in files:
            fail(MANIFEST_NAME, f"{key} {manifest[key]!r} is not listed in 'files', so it cannot be verified")

    artifacts = manifest.get("artifacts", {})
    if not isinstance(artifacts, dict):
        fail(MANIFEST_NAME, "key 'artifacts' must be a JSON object")
    for art, entry in artifacts.items():
        if not isinstance(entry, dict) or any(k not in entry for k in ARTIFACT_KEYS):
            fail(MANIFEST_NAME, f"artifacts[{art!r}] must be an object with {', '.join(ARTIFACT_KEYS)}")
        if entry["model_file"] not in files:
            fail(MANIFEST_NAME, f"artifacts[{art!r}] model_file {entry['model_file']!r} is not listed in 'files', "
                                "so it cannot be verified")

    for name, entry in files.items():
        # A manifest must not be able to point outside its own directory.
        if not _safe_relative(name):
            fail(MANIFEST_NAME, f"file name {name!r} must be a relative path inside the bundle")
        if (not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str)
                or not isinstance(entry.get("bytes"), int) or isinstance(entry.get("bytes"), bool)):
            fail(MANIFEST_NAME, f"files[{name!r}] must be an object with 'sha256' (hex string) and 'bytes' (integer)")
        path = os.path.join(bundle_dir, name)
        if not os.path.isfile(path):
            fail(name, "missing (listed in manifest.json); the bundle is incomplete")
        size = os.path.getsize(path)
        # Size first: it is free, and a truncated copy is the common failure.
        if size != entry["bytes"]:
            fail(name, f"size mismatch (manifest says {entry['bytes']} bytes, file has {size}); "
                       "the bundle is truncated, corrupted or was altered")
        actual = sha256_file(path)
        expected = entry["sha256"].lower()
        if actual != expected:
            fail(name, f"sha256 mismatch (manifest says {expected[:12]}..., file has {actual[:12]}...); "
                       "the bundle is corrupted or was altered")
    return manifest


def select_artifact(bundle_dir, manifest, name=None):
    """The artifact to run: {name, model_file, format, precision, runtime}.

    A bundle may carry several artifacts of one MC-averaged model (ONNX, TFLite, int8, ...) under
    "artifacts"; without a name the manifest's top-level model_file is run.
    """
    artifacts = manifest.get("artifacts", {})
    if name is None:
        for art, entry in artifacts.items():
            if entry["model_file"] == manifest["model_file"]:
                return {"name": art, **entry}
        return {"name": manifest["format"], "model_file": manifest["model_file"], "format": manifest["format"],
                "precision": manifest["precision"],
                "runtime": FORMAT_TO_RUNTIME.get(manifest["format"], manifest["format"])}
    if name not in artifacts:
        raise BundleError(f"bundle {os.fspath(bundle_dir)}: {MANIFEST_NAME}: no artifact {name!r} "
                          f"(the bundle has: {', '.join(artifacts) or 'none'})")
    return {"name": name, **artifacts[name]}


def load_eval_set(bundle_dir, manifest):
    """Load and sanity-check eval.npz; returns (x, y, reference_probs).

    allow_pickle=False: an npz is otherwise able to carry pickled objects,
    i.e. arbitrary code.  Raises BundleError on any inconsistency.
    """
    name = manifest["eval_file"]
    path = os.path.join(os.fspath(bundle_dir), name)

    def fail(detail):
        raise BundleError(f"bundle {os.fspath(bundle_dir)}: {name}: {detail}")

    try:
        with np.load(path, allow_pickle=False) as data:
            missing = [key for key in EVAL_ARRAYS if key not in data.files]
            if missing:
                fail(f"missing array(s): {', '.join(missing)}")
            x, y, ref = (data[key] for key in EVAL_ARRAYS)
    except BundleError:
        raise
    except ValueError as exc:  # includes "Object arrays cannot be loaded when allow_pickle=False"
        fail(f"cannot be read without unpickling or is malformed ({exc})")
    except (OSError, EOFError) as exc:
        fail(f"not a readable .npz file ({exc})")

    if not np.issubdtype(y.dtype, np.integer) or y.ndim != 1:
        fail(f"'y' must be a 1-D integer array, got dtype {y.dtype} shape {y.shape}")
    n = y.shape[0]
    if n == 0:
        fail("the evaluation set is empty")
    if x.shape[0] != n or ref.ndim != 2 or ref.shape[0] != n:
        fail(f"inconsistent lengths: x {x.shape}, y {y.shape}, reference_probs {ref.shape}")
    n_classes = len(manifest["classes"])
    if n_classes and ref.shape[1] != n_classes:
        fail(f"reference_probs has {ref.shape[1]} columns but the manifest lists {n_classes} classes")
    if y.min() < 0 or y.max() >= ref.shape[1]:
        fail(f"labels must lie in [0, {ref.shape[1]}), got [{y.min()}, {y.max()}]")
    # Compare per-example shape with the manifest, ignoring dynamic (null) dims.
    declared = manifest["input"].get("shape")
    if isinstance(declared, list) and len(declared) >= 1:
        expected = declared[1:]
        if len(expected) != x.ndim - 1 or any(
                d is not None and d != actual for d, actual in zip(expected, x.shape[1:])):
            fail(f"'x' rows have shape {list(x.shape[1:])} but manifest input shape is {declared}")
    dtype = manifest["input"].get("dtype", "float32")
    try:
        x = np.ascontiguousarray(x, dtype=np.dtype(dtype))
    except TypeError:
        raise BundleError(f"bundle {os.fspath(bundle_dir)}: {MANIFEST_NAME}: unknown input dtype {dtype!r}")
    return x, y.astype(np.int64), ref


def load_ood_set(bundle_dir, manifest, x):
    """The eval file's optional out-of-distribution inputs (`ood_x`, same per-example shape and dtype as
    `x`), or None when the bundle has none. Raises BundleError when they do not fit."""
    name = manifest["eval_file"]
    try:
        with np.load(os.path.join(os.fspath(bundle_dir), name), allow_pickle=False) as data:
            if OOD_ARRAY not in data.files:
                return None
            ood = data[OOD_ARRAY]
    except ValueError as exc:
        raise BundleError(f"bundle {os.fspath(bundle_dir)}: {name}: {OOD_ARRAY} cannot be read without "
                          f"unpickling or is malformed ({exc})") from None
    if ood.ndim != x.ndim or ood.shape[1:] != x.shape[1:] or len(ood) == 0:
        raise BundleError(f"bundle {os.fspath(bundle_dir)}: {name}: '{OOD_ARRAY}' rows have shape "
                          f"{list(ood.shape)}, the eval rows {list(x.shape)}")
    return np.ascontiguousarray(ood, dtype=x.dtype)


@contextlib.contextmanager
def native_noise_filtered(patterns=NATIVE_NOISE):
    """Native libraries write to file descriptor 2 directly, past sys.stderr and any log level: while the
    block runs, fd 2 goes to a temporary file, and afterwards every line of it except the known start-up
    noise (`patterns`) is written to stderr as it came. Where fd 2 cannot be redirected, nothing is."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            except ValueError:
                pass
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = [line for line in capture.read().decode(errors="replace").splitlines(keepends=True)
                    if not any(p.search(line.rstrip("\r\n")) for p in patterns)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


# --------------------------------------------------------------------------
# Runtime backends.  Each backend imports its runtime lazily, in __init__, so
# that this file imports fine on a device that only has one runtime.
# To add a runtime: subclass Backend, implement __init__/run/version/info,
# and register it in BACKENDS (and FORMAT_TO_RUNTIME for its bundle format).
# --------------------------------------------------------------------------

class Backend:
    """Interface: load a model once, then run(x) -> class probabilities."""

    name = "base"

    def __init__(self, model_path, threads=0):
        self.model_path = model_path
        self.threads = threads

    @property
    def version(self):
        raise NotImplementedError

    def run(self, x):
        """Run one batch `x` (np.ndarray) and return probabilities [batch, C]."""
        raise NotImplementedError

    def info(self):
        """JSON-ready description of the runtime for the results file."""
        return {"name": self.name, "version": self.version, "threads": self.threads}

    @staticmethod
    def load_runtime():
        """Import the runtime and nothing else: the process's memory then is the runtime's baseline (no
        model), which the model's own memory is measured against (see `main`)."""


class OnnxRuntimeBackend(Backend):
    """ONNX Runtime on CPU by default; other execution providers on request."""

    name = "onnxruntime"

    @staticmethod
    def load_runtime():
        try:
            import onnxruntime  # noqa: F401
        except ImportError as exc:
            raise RuntimeProblem(f"onnxruntime is not installed ({exc}); "
                                 "install it with: pip install onnxruntime") from exc

    def __init__(self, model_path, threads=0, providers=None):
        super().__init__(model_path, threads)
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise RuntimeProblem(f"onnxruntime is not installed ({exc}); "
                                 "install it with: pip install onnxruntime") from exc
        self._ort = ort
        providers = list(providers) if providers else ["CPUExecutionProvider"]
        available = ort.get_available_providers()
        unknown = [p for p in providers if p not in available]
        if unknown:
            # ORT would silently fall back to CPU; a benchmark must not.
            raise RuntimeProblem(f"onnxruntime execution provider(s) not available: {', '.join(unknown)} "
                                 f"(available: {', '.join(available)})")
        options = ort.SessionOptions()
        if threads > 0:
            options.intra_op_num_threads = threads
        try:
            self.session = ort.InferenceSession(model_path, sess_options=options, providers=providers)
        except Exception as exc:  # ORT raises its own exception types
            raise RuntimeProblem(f"onnxruntime could not load {model_path}: {exc}") from exc
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        if len(inputs) != 1 or len(outputs) != 1:
            raise RuntimeProblem(f"{model_path}: expected one input and one output, "
                                 f"got {len(inputs)} and {len(outputs)}")
        self.input_name = inputs[0].name
        self.output_name = outputs[0].name

    @property
    def version(self):
        return self._ort.__version__

    def run(self, x):
        return self.session.run([self.output_name], {self.input_name: x})[0]

    def info(self):
        info = super().info()
        info["providers"] = self.session.get_providers()  # what ORT actually uses
        return info


def _tflite_interpreter():
    """The TFLite Interpreter class: ai_edge_litert, else tflite_runtime, else tensorflow.lite.

    ai-edge-litert is the maintained runtime (numpy 2); tflite_runtime is what older Raspberry Pi images
    carry (numpy 1); full TensorFlow has it as tf.lite. Returns (Interpreter, package name, version).
    TensorFlow's C++ start-up messages (CPU feature notes, "Created TensorFlow Lite XNNPACK delegate")
    are not the benchmark's: their log level is raised unless the caller set one.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with native_noise_filtered():
        return _import_tflite_interpreter()


def _import_tflite_interpreter():
    tried = []
    try:
        import ai_edge_litert
        from ai_edge_litert import interpreter as litert
        return litert.Interpreter, "ai-edge-litert", getattr(ai_edge_litert, "__version__", "unknown")
    except ImportError as exc:
        tried.append(f"ai_edge_litert ({exc})")
    try:
        import tflite_runtime
        from tflite_runtime import interpreter as tflr
        return tflr.Interpreter, "tflite_runtime", getattr(tflite_runtime, "__version__", "unknown")
    except ImportError as exc:
        tried.append(f"tflite_runtime ({exc})")
    try:
        import tensorflow as tf
        return tf.lite.Interpreter, "tensorflow.lite", tf.__version__
    except ImportError as exc:
        tried.append(f"tensorflow ({exc})")
    raise RuntimeProblem("no TFLite runtime is installed (tried " + "; ".join(tried) +
                         "); install one with: pip install ai-edge-litert")


class TFLiteBackend(Backend):
    """A .tflite model on the CPU (XNNPACK) with LiteRT / tflite_runtime / tf.lite.

    Quantized input and output tensors (full-integer int8 models) are handled here: the input is
    quantized with the tensor's scale and zero point, the output dequantized, so run() always takes and
    returns float32. A model with a fixed batch (litert-torch exports batch 1) runs a larger batch in
    chunks of its batch size, the last one zero-padded.
    """

    name = "tflite"

    @staticmethod
    def load_runtime():
        _tflite_interpreter()

    def __init__(self, model_path, threads=0):
        super().__init__(model_path, threads)
        interpreter_cls, self.package, self._version = _tflite_interpreter()
        try:
            with native_noise_filtered():   # "Created TensorFlow Lite XNNPACK delegate for CPU."
                self.interpreter = interpreter_cls(model_path=model_path, num_threads=threads or None)
                self.interpreter.allocate_tensors()
        except Exception as exc:
            raise RuntimeProblem(f"{self.package} could not load {model_path}: {exc}") from exc
        inputs, outputs = self.interpreter.get_input_details(), self.interpreter.get_output_details()
        if len(inputs) != 1 or len(outputs) != 1:
            raise RuntimeProblem(f"{model_path}: expected one input and one output, "
                                 f"got {len(inputs)} and {len(outputs)}")
        self.input, self.output = inputs[0], outputs[0]
        signature = self.input.get("shape_signature", self.input["shape"])
        self.dynamic_batch = int(signature[0]) == -1
        self.batch = int(self.input["shape"][0])

    @property
    def version(self):
        return self._version

    @staticmethod
    def _quantize(x, detail):
        if detail["dtype"] == np.float32:
            return x.astype(np.float32, copy=False)
        scale, zero_point = detail["quantization"]
        info = np.iinfo(detail["dtype"])
        return np.clip(np.round(x / scale) + zero_point, info.min, info.max).astype(detail["dtype"])

    @staticmethod
    def _dequantize(y, detail):
        if detail["dtype"] == np.float32:
            return y
        scale, zero_point = detail["quantization"]
        return (y.astype(np.float32) - zero_point) * scale

    def _invoke(self, x):
        self.interpreter.set_tensor(self.input["index"], self._quantize(x, self.input))
        self.interpreter.invoke()
        return self._dequantize(self.interpreter.get_tensor(self.output["index"]), self.output)

    def run(self, x):
        n = len(x)
        if self.dynamic_batch:
            if n != self.batch:
                self.interpreter.resize_tensor_input(self.input["index"], [n, *x.shape[1:]])
                self.interpreter.allocate_tensors()
                self.batch = n
            return self._invoke(x).copy()
        outs = []
        for start in range(0, n, self.batch):
            chunk = x[start:start + self.batch]
            if len(chunk) < self.batch:
                chunk = np.concatenate([chunk, np.zeros((self.batch - len(chunk), *x.shape[1:]), x.dtype)])
            outs.append(self._invoke(chunk)[: n - start].copy())
        return np.concatenate(outs) if len(outs) > 1 else outs[0]

    def info(self):
        info = super().info()
        info.update({"package": self.package, "input_dtype": np.dtype(self.input["dtype"]).name,
                     "model_batch": None if self.dynamic_batch else self.batch})
        return info


# --- TensorRT -------------------------------------------------------------
# Engines are GPU- and TensorRT-version-specific, so the bundle ships ONNX (fp32, or NNCF's Q/DQ model for
# int8) and the engine is built here, on the target, once: it is cached under a key made of the ONNX's
# sha256, the build options and the TensorRT version. trtexec (JetPack ships it) builds when it is on the
# PATH, else the tensorrt Python API does.

TRT_PRECISIONS = ("fp32", "fp16", "int8")


def trt_build_options(precision, workspace_mb, input_name, example_shape, max_batch, opt_batch=1):
    """The options an engine is built with (and cached under): precision, workspace, shape profile."""
    if precision not in TRT_PRECISIONS:
        raise RuntimeProblem(f"TensorRT precision {precision!r} is not one of {', '.join(TRT_PRECISIONS)}")
    if workspace_mb < 1 or max_batch < opt_batch or opt_batch < 1:
        raise RuntimeProblem(f"TensorRT build options: workspace {workspace_mb} MiB, batch profile "
                             f"1..{opt_batch}..{max_batch} are not valid")
    example_shape = [int(d) for d in example_shape]
    return {"precision": precision, "workspace_mb": int(workspace_mb), "input_name": input_name,
            "min_shape": [1, *example_shape], "opt_shape": [int(opt_batch), *example_shape],
            "max_shape": [int(max_batch), *example_shape]}


def engine_cache_key(onnx_path, options, trt_version):
    """sha256 of the ONNX file, the build options and the TensorRT version: same key, same engine."""
    digest = hashlib.sha256()
    digest.update(sha256_file(onnx_path).encode())
    digest.update(json.dumps(options, sort_keys=True).encode())
    digest.update(str(trt_version).encode())
    return digest.hexdigest()


def trtexec_command(onnx_path, engine_path, options, trtexec="trtexec"):
    """The trtexec command line that builds `engine_path` from `onnx_path` with `options`."""
    def dims(shape):
        return "x".join(str(d) for d in shape)

    name = options["input_name"]
    cmd = [trtexec, f"--onnx={onnx_path}", f"--saveEngine={engine_path}",
           f"--memPoolSize=workspace:{options['workspace_mb']}",  # MiB
           f"--minShapes={name}:{dims(options['min_shape'])}",
           f"--optShapes={name}:{dims(options['opt_shape'])}",
           f"--maxShapes={name}:{dims(options['max_shape'])}",
           "--skipInference"]
    if options["precision"] == "fp16":
        cmd.append("--fp16")
    elif options["precision"] == "int8":
        cmd.append("--int8")  # explicit quantization: the scales come from the model's Q/DQ nodes
    return cmd


def build_engine_python(trt, onnx_path, engine_path, options):
    """Build and serialize an engine with the tensorrt Python API (TensorRT 8.6 / 10)."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    explicit_batch = getattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH", None)
    network = builder.create_network(0 if explicit_batch is None else 1 << int(explicit_batch))
    parser = trt.OnnxParser(network, logger)
    with open(onnx_path, "rb") as fh:
        if not parser.parse(fh.read()):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise RuntimeProblem(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options["workspace_mb"] << 20)
    if options["precision"] == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    elif options["precision"] == "int8":
        config.set_flag(trt.BuilderFlag.INT8)
    profile = builder.create_optimization_profile()
    profile.set_shape(options["input_name"], options["min_shape"], options["opt_shape"], options["max_shape"])
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeProblem(f"TensorRT failed to build an engine from {onnx_path}")
    _write_bytes_atomic(engine_path, bytes(serialized))


def _write_bytes_atomic(path, data):
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".engine-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def cached_engine(trt, onnx_path, options, cache_dir, run=None, which=None):
    """Path of the engine for (ONNX, options): built with trtexec or the Python API on a cache miss."""
    import shutil
    import subprocess

    os.makedirs(cache_dir, exist_ok=True)
    engine_path = os.path.join(cache_dir, engine_cache_key(onnx_path, options, trt.__version__) + ".engine")
    if os.path.isfile(engine_path):
        return engine_path, False
    trtexec = (which or shutil.which)("trtexec")
    if trtexec:
        tmp = engine_path + ".partial"
        done = (run or subprocess.run)(trtexec_command(onnx_path, tmp, options, trtexec),
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode != 0 or not os.path.isfile(tmp):
            tail = (done.stdout or "").strip().splitlines()[-3:]
            raise RuntimeProblem(f"trtexec failed to build an engine from {onnx_path} "
                                 f"(exit {done.returncode}): {' | '.join(tail)}")
        os.replace(tmp, engine_path)
    else:
        build_engine_python(trt, onnx_path, engine_path, options)
    return engine_path, True


class CudaMemory:
    """Device buffers and copies through CUDA's runtime API (cuda-python), the way TensorRT's samples do."""

    def __init__(self):
        try:
            from cuda.bindings import runtime as cudart
        except ImportError:
            try:
                from cuda import cudart
            except ImportError as exc:
                raise RuntimeProblem(f"the TensorRT backend needs cuda-python ({exc}); "
                                     "install it with: pip install cuda-python") from exc
        self.cudart = cudart
        self.stream = self._check(cudart.cudaStreamCreate())

    def _check(self, result):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            raise RuntimeProblem(f"CUDA error {err}")
        return rest[0] if rest else None

    def malloc(self, nbytes):
        return int(self._check(self.cudart.cudaMalloc(nbytes)))

    def free(self, ptr):
        self._check(self.cudart.cudaFree(ptr))

    def to_device(self, ptr, array):
        self._check(self.cudart.cudaMemcpyAsync(ptr, array.ctypes.data, array.nbytes,
                                                self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream))

    def to_host(self, array, ptr):
        self._check(self.cudart.cudaMemcpyAsync(array.ctypes.data, ptr, array.nbytes,
                                                self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.stream))

    def synchronize(self):
        self._check(self.cudart.cudaStreamSynchronize(self.stream))


class TensorRTBackend(Backend):
    """A TensorRT engine built on this device from the bundle's ONNX (cached), run with explicit buffers.

    Buffers: one device buffer for the input and one for the output, sized for `max_batch` rows of the
    engine's own dtypes, allocated once; run() sets the input shape, copies the batch in, enqueues, copies
    the [batch, C] output back and waits for the stream. Larger batches run in chunks of max_batch.
    `trt` and `memory` can be injected (tests use fakes; TensorRT cannot be installed on the CI machines).
    """

    name = "tensorrt"

    @staticmethod
    def load_runtime():
        try:
            import tensorrt  # noqa: F401
        except ImportError as exc:
            raise RuntimeProblem(f"TensorRT is not installed ({exc}); on Jetson it comes with JetPack "
                                 "(python3-libnvinfer), elsewhere: pip install tensorrt") from exc

    def __init__(self, model_path, threads=0, precision="fp16", workspace_mb=1024, engine_cache=None,
                 example_shape=None, max_batch=ACCURACY_BATCH, opt_batch=1, trt=None, memory=None):
        super().__init__(model_path, threads)
        if trt is None:
            try:
                import tensorrt as trt
            except ImportError as exc:
                raise RuntimeProblem(f"TensorRT is not installed ({exc}); on Jetson it comes with JetPack "
                                     "(python3-libnvinfer), elsewhere: pip install tensorrt") from exc
        self.trt = trt
        if example_shape is None:
            raise RuntimeProblem("the TensorRT backend needs the per-example input shape (from the manifest)")
        options = trt_build_options(precision, workspace_mb, "input", example_shape, max_batch, opt_batch)
        cache_dir = engine_cache or os.path.join(os.path.dirname(os.path.abspath(model_path)), "..", "trt-engines")
        t0 = time.perf_counter()
        self.engine_path, self.built = cached_engine(trt, model_path, options, cache_dir)
        # Building an engine takes seconds to minutes on a board and happens once per (ONNX, options,
        # TensorRT version): recorded apart from the session's cold start; None when it came from the cache.
        self.engine_build_ms = 1000.0 * (time.perf_counter() - t0) if self.built else None
        self.options, self.max_batch = options, int(max_batch)
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        with open(self.engine_path, "rb") as fh:
            self.engine = runtime.deserialize_cuda_engine(fh.read())
        if self.engine is None:
            raise RuntimeProblem(f"TensorRT could not load the engine {self.engine_path}; delete it to rebuild")
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        outputs = [n for n in names if n not in inputs]
        if len(inputs) != 1 or len(outputs) != 1:
            raise RuntimeProblem(f"{self.engine_path}: expected one input and one output, "
                                 f"got {len(inputs)} and {len(outputs)}")
        self.input_name, self.output_name = inputs[0], outputs[0]
        self.input_dtype = np.dtype(trt.nptype(self.engine.get_tensor_dtype(self.input_name)))
        self.output_dtype = np.dtype(trt.nptype(self.engine.get_tensor_dtype(self.output_name)))
        self.context = self.engine.create_execution_context()
        self.memory = memory or CudaMemory()
        self.example_shape = tuple(int(d) for d in example_shape)
        # The output row size is known once the input shape is set: ask at max batch.
        self.context.set_input_shape(self.input_name, (self.max_batch, *self.example_shape))
        out_row = int(np.prod(tuple(self.context.get_tensor_shape(self.output_name))[1:]))
        self.d_input = self.memory.malloc(self.max_batch * int(np.prod(self.example_shape)) * self.input_dtype.itemsize)
        self.d_output = self.memory.malloc(self.max_batch * out_row * self.output_dtype.itemsize)
        self.context.set_tensor_address(self.input_name, self.d_input)
        self.context.set_tensor_address(self.output_name, self.d_output)

    @property
    def version(self):
        return self.trt.__version__

    def _run_chunk(self, x):
        x = np.ascontiguousarray(x, dtype=self.input_dtype)
        self.context.set_input_shape(self.input_name, x.shape)
        out = np.empty(tuple(self.context.get_tensor_shape(self.output_name)), dtype=self.output_dtype)
        self.memory.to_device(self.d_input, x)
        if not self.context.execute_async_v3(getattr(self.memory, "stream", 0)):
            raise RuntimeProblem(f"TensorRT failed to run {self.engine_path}")
        self.memory.to_host(out, self.d_output)
        self.memory.synchronize()
        return out.astype(np.float32, copy=False)

    def run(self, x):
        if len(x) <= self.max_batch:
            return self._run_chunk(x)
        return np.concatenate([self._run_chunk(x[i:i + self.max_batch]) for i in range(0, len(x), self.max_batch)])

    def close(self):
        for ptr in (self.d_input, self.d_output):
            self.memory.free(ptr)
        self.d_input = self.d_output = None

    def info(self):
        info = super().info()
        info.update({"engine": os.path.basename(self.engine_path), "engine_built_now": self.built,
                     "engine_build_ms": self.engine_build_ms,
                     "precision": self.options["precision"], "workspace_mb": self.options["workspace_mb"]})
        return info


BACKENDS = {"onnxruntime": OnnxRuntimeBackend, "tflite": TFLiteBackend, "tensorrt": TensorRTBackend}
FORMAT_TO_RUNTIME = {"onnx": "onnxruntime", "tflite": "tflite", "tensorrt": "tensorrt"}


def load_runtime(runtime):
    """Import `runtime` without loading a model (see Backend.load_runtime), or raise RuntimeProblem."""
    if runtime not in BACKENDS:
        raise RuntimeProblem(f"runtime {runtime!r} is not supported by this runner "
                             f"(supported: {', '.join(sorted(BACKENDS))})")
    BACKENDS[runtime].load_runtime()


def make_backend(runtime, model_path, threads=0, providers=None, **options):
    """Instantiate the backend registered under `runtime`, or raise RuntimeProblem.

    `options` go to backends that take them (TensorRT: precision, workspace_mb, engine_cache, example_shape).
    """
    if runtime not in BACKENDS:
        raise RuntimeProblem(f"runtime {runtime!r} is not supported by this runner "
                             f"(supported: {', '.join(sorted(BACKENDS))})")
    cls = BACKENDS[runtime]
    if providers:
        if cls is not OnnxRuntimeBackend:
            raise RuntimeProblem(f"--providers only applies to onnxruntime, not {runtime!r}")
        return cls(model_path, threads, providers=providers)
    if cls is TensorRTBackend:
        return cls(model_path, threads, **options)
    return cls(model_path, threads)


# --------------------------------------------------------------------------
# Passes
# --------------------------------------------------------------------------

def predict_all(backend, x, batch_size=ACCURACY_BATCH):
    """Run the whole array through the backend in batches; returns [N, C] float64."""
    chunks = []
    for start in range(0, len(x), batch_size):
        try:
            out = backend.run(x[start:start + batch_size])
        except Exception as exc:
            raise RuntimeProblem(f"{backend.name} failed on eval rows {start}..: {exc}") from exc
        chunks.append(np.asarray(out, dtype=np.float64))
    return np.concatenate(chunks, axis=0)


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


def measure_latency(backend, batch, warmup=10, min_runs=100, min_seconds=2.0, progress=True):
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
        # Every k-th latency (at most MAX_SAMPLES, in run order) for a histogram in the report.
        "samples_ms": [float(v) for v in pooled[:: max(1, len(pooled) // MAX_SAMPLES)]],
    }


def measure_rounds(backend, batch, warmup=10, min_runs=100, min_seconds=2.0, rounds=DEFAULT_ROUNDS,
                   progress=True):
    """The protocol of a benchmark: warm-up, then `rounds` rounds that together make at least `min_runs`
    runs and `min_seconds` seconds; returns latency_summary of them."""
    timings = [timed_round(backend, batch, r, rounds, warmup, min_runs, min_seconds, progress) for r in range(rounds)]
    return latency_summary(timings, len(batch))


def timed_round(backend, batch, r, rounds, warmup, min_runs, min_seconds, progress=False):
    """Round r of `rounds`: the warm-up before the first, and each round a 1/rounds share of the minimum
    runs (rounded up) and seconds."""
    return measure_latency(backend, batch, warmup=warmup if r == 0 else 0, min_runs=max(1, -(-min_runs // rounds)),
                           min_seconds=min_seconds / rounds, progress=progress)


def _proc_status_mb(key):
    """A VmRSS / VmHWM line of /proc/self/status in MB, or None where there is none (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return float(line.split()[1]) / 1024.0  # kB -> MB
    except OSError:
        pass
    return None


def current_rss_mb():
    """Resident set size of this process now, in MB (None where unsupported)."""
    return _proc_status_mb("VmRSS")


def reset_peak_rss():
    """Reset this process's peak RSS to its current RSS (Linux >= 4.0: "5" to /proc/self/clear_refs), so
    that a later peak_rss_mb() is the peak of what came after. Returns whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb():
    """Peak resident set size of this process in MB (None where unsupported).

    On Linux VmHWM from /proc/self/status: it belongs to this address space only. ru_maxrss is kept by
    a forked child across exec, so a runner started by a big parent (edgebayes with torch loaded)
    would report the parent's peak.
    """
    peak = _proc_status_mb("VmHWM")
    if peak is not None:
        return peak
    try:
        import resource  # Unix only
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS reports bytes.
    divisor = 1024.0 * 1024.0 if sys.platform == "darwin" else 1024.0
    return float(peak / divisor)


def device_info():
    """Where the numbers came from; the board model helps on Jetson/Pi."""
    board = None
    try:
        with open("/proc/device-tree/model", "rb") as fh:
            board = fh.read().rstrip(b"\x00\n").decode("utf-8", "replace")
    except OSError:
        pass
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "numpy": np.__version__,
        "board": board,
    }


def write_json_atomic(path, obj):
    """Write JSON via a temp file in the same directory + os.replace, so a
    crash never leaves a half-written results file behind."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".runner-", suffix=".json.tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(obj, fh, indent=2)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _utc_now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------

def _non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
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
        prog="runner.py", description="Verify an edgebayes bundle, measure its accuracy/calibration "
                                      "and latency on this device, and write a JSON report.")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--bundle", help="bundle directory (holds manifest.json)")
    mode.add_argument("--time-models", metavar="SPEC",
                      help="latency only: a JSON file listing model files to time one after another "
                           "(`edgebayes devices profile` and selection on a remote device); see time_models")
    parser.add_argument("--out", required=True, help="results JSON path (written atomically)")
    parser.add_argument("--warmup", type=_non_negative_int, default=10, help="untimed warm-up runs")
    parser.add_argument("--min-runs", type=positive_int, default=100, help="minimum timed runs")
    parser.add_argument("--min-seconds", type=_non_negative_float, default=2.0, help="minimum timed seconds")
    parser.add_argument("--rounds", type=positive_int, default=DEFAULT_ROUNDS,
                        help="timed rounds; percentiles over all their samples, the best round's beside them "
                             "(latency_summary)")
    parser.add_argument("--batch-size", type=positive_int, default=1, help="rows per timed run")
    parser.add_argument("--threads", type=_non_negative_int, default=0, help="intra-op threads, 0 = runtime default")
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
    parser.add_argument("--quiet", action="store_true", help="no progress or summary on stderr")
    parser.add_argument("--progress", action="store_true",
                        help="draw the timing progress bar even when stderr is not a terminal (deploy passes "
                             "it when its own terminal shows the device's stderr)")
    return parser


def _tags(pairs):
    tags = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"runner: --tag expects KEY=VALUE, got {pair!r}")
        tags[key] = value
    return tags


def time_models(spec_path, out, warmup, min_runs, min_seconds, threads, tags, rounds=DEFAULT_ROUNDS):
    """Time each model a spec lists, with the same protocol as a bundle's benchmark.

    The spec is JSON: {"example": "x.npy", "batch_size": 1, "models": [{"id": ..., "file": ...,
    "runtime": "onnxruntime"}, ...]}, paths relative to the spec's folder. The example rows are read with
    allow_pickle=False. Writes {"models": [{"id", "latency_ms", "runs", ...}], "runtime", "device",
    "memory", ...}.

    memory: what selection's memory estimate needs from the device. runtime_baseline_mb is the RSS with
    the runtimes imported and no model; runtime_setup_mb the one-off cost of a runtime's first session and
    inference (thread pools, kernel tables, the arena's first chunk: about 16 MB for onnxruntime 1.31 on
    x86), measured as the RSS the smallest model adds when it is loaded and run first, less twice its file
    (see select.memory_estimate). Both are per process, not per model.
    """
    base = os.path.dirname(os.path.abspath(spec_path))
    with open(spec_path, "r", encoding="utf-8") as fh:
        spec = json.load(fh)
    example = np.load(os.path.join(base, spec["example"]), allow_pickle=False).astype(np.float32)
    batch_size = int(spec.get("batch_size", 1))
    batch = np.ascontiguousarray(example[np.arange(batch_size) % len(example)])
    entries = [dict(entry, path=os.path.join(base, entry["file"]), runtime=entry.get("runtime", "onnxruntime"))
               for entry in spec["models"]]
    for runtime in sorted({e["runtime"] for e in entries}):
        load_runtime(runtime)
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
    for r in range(rounds):
        for i, backend in enumerate(backends):
            timings[i].append(timed_round(backend, batch, r, rounds, warmup, min_runs, min_seconds))
    timed = []
    for entry, model_rounds in zip(spec["models"], timings):
        summary = latency_summary(model_rounds, batch_size)
        del summary["samples_ms"]
        timed.append({"id": entry["id"], **summary})
    runtime_info = backends[-1].info() if backends else None
    write_json_atomic(out, {
        "schema": SCHEMA_VERSION, "models": timed, "runtime": runtime_info, "device": device_info(),
        "memory": memory,
        "protocol": {"warmup": warmup, "min_runs": min_runs, "min_seconds": min_seconds, "rounds": rounds,
                     "batch_size": batch_size, "threads": threads},
        "tags": tags, "finished_at": _utc_now()})


def main(argv=None):
    """Run the benchmark; returns the process exit code (see module docstring)."""
    args = build_parser().parse_args(argv)
    started_at = _utc_now()
    tags = _tags(args.tag)

    def say(message):
        if not args.quiet:
            print(f"runner: {message}", file=sys.stderr)

    if args.time_models:
        try:
            time_models(args.time_models, args.out, args.warmup, args.min_runs, args.min_seconds, args.threads,
                        tags, args.rounds)
        except RuntimeProblem as exc:
            print(f"runner: {exc}", file=sys.stderr)
            return EXIT_RUNTIME
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
    peak_before = peak_rss_mb()
    before_model = current_rss_mb()
    peak_reset = reset_peak_rss()
    try:
        # Cold start, as TFLite's benchmark_model reports it: creating the session (a TensorRT engine
        # built now included, and also given apart), then the first inference, before any warm-up.
        t0 = time.perf_counter()
        backend = make_backend(runtime, model_path, args.threads, providers, **options)
        t1 = time.perf_counter()
        first = np.asarray(backend.run(batch))
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
        metrics = classification_metrics(probs, y)
        max_diff = float(np.max(np.abs(probs - reference_probs.astype(np.float64))))
        ood = None if ood_x is None else ood_detection(probs, predict_all(backend, ood_x))
        say(f"accuracy {metrics['accuracy']:.4f}  nll {metrics['nll']:.4f}  ece {metrics['ece']:.4f}  "
            f"max |p - p_ref| {max_diff:.2e}" + (f"  OOD AUROC {ood['auroc']:.4f}" if ood else ""))
    except RuntimeProblem as exc:
        print(f"runner: {exc}", file=sys.stderr)
        return EXIT_RUNTIME

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
            "model_sha256": manifest["files"][artifact["model_file"]]["sha256"],
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
        "reference": manifest["reference"],
        "max_abs_prob_diff": max_diff,
        "started_at": started_at,
        "finished_at": _utc_now(),
    }
    try:
        write_json_atomic(args.out, results)
    except OSError as exc:
        print(f"runner: cannot write results to {args.out}: {exc}", file=sys.stderr)
        return EXIT_WRITE
    lat = timing["latency_ms"]
    say(f"p50 {lat['p50']:.4g} ms  p90 {lat['p90']:.4g} ms  p99 {lat['p99']:.4g} ms  max {lat['max']:.4g} ms "
        f"(all {timing['runs']} runs, {timing['throughput_per_s']:.1f}/s)  -> {args.out}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
