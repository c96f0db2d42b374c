"""A deployment bundle on the device: its manifest checked, every listed file's size and sha256 verified
(the runner itself, runner.pyz, among them), the artifact to run chosen and the eval set loaded without
unpickling anything (a bundle is data that must not be able to run code)."""

import hashlib
import json
import os
import zipfile

import numpy as np

from .metrics import check_probabilities
from .tables import FORMAT_TO_RUNTIME

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
RUNNER_FILE = "runner.pyz"   # the zipapp of this package in the bundle (pack.write_runner), the manifest's "runner"
REQUIRED_KEYS = (
    "schema", "format", "precision", "model_file", "eval_file", "input",
    "output", "classes", "mc_samples", "knob", "reference", "files",
)
EVAL_ARRAYS = ("x", "y", "reference_probs")
OOD_ARRAY = "ood_x"   # optional in eval.npz: out-of-distribution inputs of the same shape
ARTIFACT_KEYS = ("model_file", "format", "precision", "runtime")  # each entry of the optional "artifacts"


class BundleError(Exception):
    """The bundle is missing, malformed, corrupted or inconsistent.

    The message names the bundle and the offending file, e.g.
    ``bundle /x/b: model.onnx: sha256 mismatch (...)``.
    """


def sha256_file(path, chunk_size=1 << 20):
    """Hex sha256 of a file, read in chunks so large models fit in small RAM."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(chunk_size), b""):
            digest.update(chunk)
    return digest.hexdigest()


def unique_keys(pairs):
    """json's object_pairs_hook: a key twice in one object is refused (json keeps the last one silently, so a
    second "metrics" or "files" could override what a reader checks first)."""
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError("key {!r} appears twice in one object".format(key))
        obj[key] = value
    return obj


def _safe_relative(name):
    """True if `name` is a relative path that stays inside the bundle."""
    if not isinstance(name, str) or not name or os.path.isabs(name):
        return False
    parts = name.replace("\\", "/").split("/")
    return ".." not in parts


def verify_bundle(bundle_dir):
    """Check a bundle directory and return its manifest (a dict).

    Checks: manifest.json exists and is a JSON object with every required
    key and schema 1; model_file, eval_file and the runner (where the manifest
    names one, as exported bundles do) are listed in `files`; every listed
    file exists with the listed byte size and sha256.  Raises
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
            manifest = json.load(fh, object_pairs_hook=unique_keys)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:   # ValueError: JSON's, a 5000-digit integer's
        fail(MANIFEST_NAME, f"not valid JSON ({str(exc)[:200] or type(exc).__name__})")
    if not isinstance(manifest, dict):
        fail(MANIFEST_NAME, f"must be a JSON object, got {type(manifest).__name__}")

    missing = [key for key in REQUIRED_KEYS if key not in manifest]
    if missing:
        fail(MANIFEST_NAME, f"missing required key(s): {', '.join(missing)}")
    if manifest["schema"] != SCHEMA_VERSION:
        fail(MANIFEST_NAME, f"unsupported schema {manifest['schema']!r} "
                            f"(this runner reads schema {SCHEMA_VERSION}); use a matching runner")
    for key, kind in (("files", dict), ("input", dict), ("output", dict),
                      ("classes", list), ("knob", dict), ("reference", dict)):
        if not isinstance(manifest[key], kind):
            fail(MANIFEST_NAME, f"key {key!r} must be a JSON {'object' if kind is dict else 'array'}")

    mc = manifest["mc_samples"]   # written into the results and checked against the choice: a count, or nothing
    if not isinstance(mc, int) or isinstance(mc, bool) or not 1 <= mc <= 1 << 16:
        fail(MANIFEST_NAME, f"key 'mc_samples' must be a positive integer (the MC samples in the model), got {mc!r}")

    files = manifest["files"]
    # The runner (exported bundles carry it) is verified like the model: the measuring code is the export's.
    for key in ("model_file", "eval_file", "format", *(("runner",) if "runner" in manifest else ())):
        if not isinstance(manifest[key], str):
            fail(MANIFEST_NAME, f"key {key!r} must be a string")
    for key in ("model_file", "eval_file", *(("runner",) if "runner" in manifest else ())):
        if manifest[key] not in files:
            fail(MANIFEST_NAME, f"{key} {manifest[key]!r} is not listed in 'files', so it cannot be verified")

    artifacts = manifest.get("artifacts", {})
    if not isinstance(artifacts, dict):
        fail(MANIFEST_NAME, "key 'artifacts' must be a JSON object")
    for art, entry in artifacts.items():
        if not isinstance(entry, dict) or any(not isinstance(entry.get(k), str) for k in ARTIFACT_KEYS):
            fail(MANIFEST_NAME, f"artifacts[{art!r}] must be an object with {', '.join(ARTIFACT_KEYS)} (strings)")
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
        # a link (of the file or of a folder on its way) must not lead the runner outside the bundle
        root = os.path.realpath(bundle_dir)
        if os.path.commonpath([os.path.realpath(path), root]) != root:
            fail(name, f"leads outside the bundle (a symbolic link to {os.path.realpath(path)}); copy the file in")
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
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):   # a bare .npy under the npz's name
            fail("not an .npz archive (a single array)")
        with data:
            missing = [key for key in EVAL_ARRAYS if key not in data.files]
            if missing:
                fail(f"missing array(s): {', '.join(missing)}")
            x, y, ref = (data[key] for key in EVAL_ARRAYS)
            if "x_scale" in data.files:   # pixels stored as uint8 (export/bundle.py _eval_inputs)
                scale = data["x_scale"]
                if scale.shape != () or not np.issubdtype(scale.dtype, np.floating) or not scale > 0:
                    fail(f"'x_scale' must be one positive number, got dtype {scale.dtype} shape {scale.shape}")
                x = x.astype(np.float32) / np.float32(scale)
    except BundleError:
        raise
    except ValueError as exc:  # includes "Object arrays cannot be loaded when allow_pickle=False"
        fail(f"cannot be read without unpickling or is malformed ({exc})")
    except (OSError, EOFError, zipfile.BadZipFile) as exc:   # BadZipFile: cut off, or a member's CRC is wrong
        fail(f"not a readable .npz file ({exc})")
    except MemoryError:   # an array header declaring a shape far beyond the file
        fail("an array declares a shape too large to load: the file is corrupted or not an edgebayes eval set")

    if x.ndim < 1 or ref.ndim < 1:
        fail(f"'x' and 'reference_probs' must have a row per example, got shapes {x.shape} and {ref.shape}")

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
    for key, a in (("x", x), ("reference_probs", ref)):   # a NaN would come back as every metric NaN, exit 0
        if np.issubdtype(a.dtype, np.inexact) and not np.isfinite(a).all():
            fail(f"'{key}' holds NaN or infinite values")
    try:   # the device's outputs are compared with these: they must be probabilities, as the export wrote them
        check_probabilities(ref)
    except ValueError as exc:
        fail(f"'reference_probs': {exc}")
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
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise BundleError(f"bundle {os.fspath(bundle_dir)}: {name}: {OOD_ARRAY} cannot be read without "
                          f"unpickling or is malformed ({exc})") from None
    if ood.ndim != x.ndim or ood.shape[1:] != x.shape[1:] or len(ood) == 0:
        raise BundleError(f"bundle {os.fspath(bundle_dir)}: {name}: '{OOD_ARRAY}' rows have shape "
                          f"{list(ood.shape)}, the eval rows {list(x.shape)}")
    return np.ascontiguousarray(ood, dtype=x.dtype)

