"""The deployment bundle: model file(s), eval set, the runner and `manifest.json` with hashes.

One bundle holds one MC-averaged model in one or several formats ("artifacts": onnx, onnx-int8,
tflite-fp16, ...), each with its fidelity against the PyTorch MC average; the manifest's top-level
model_file is the primary artifact, and the runner runs any one of them with --artifact NAME.

The runner travels in the bundle as one zipapp (runner.pyz, ondevice/pack.py), hashed in the manifest like
the model files, so the code that measures a bundle is the code it was exported with; with python and numpy
the device needs nothing else. The bundle is assembled in a temporary folder, checked with the runner's
own `verify_bundle`, and only then renamed into place.
"""

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

from edgebayes.ondevice.bundle import RUNNER_FILE, sha256_file, verify_bundle
from edgebayes.ondevice.pack import write_runner

MODEL_FILE, EVAL_FILE = "model.onnx", "eval.npz"


def write_bundle(bundle_dir, model_file, x, y, reference_probs, *, classes, mc_samples, knob_name, knob_value,
                 reference_metrics, provenance, fmt="onnx", precision="fp32", artifacts=None, ood_x=None,
                 data=None) -> dict:
    """Assemble the bundle at `bundle_dir` (replacing any old one); returns the manifest.

    artifacts: optional {name: {"path": model file, "format", "precision", "runtime", ...more facts}};
    the one whose path is `model_file` is the primary artifact.
    data: optional data.describe of the run's data (the manifest's input.preprocessing, and data).
    ood_x: optional out-of-distribution inputs, stored in the eval file so that the runner measures OOD
    AUROC / AUPR on the device's own outputs (quantization can move the uncertainty they rest on).
    """
    bundle_dir = Path(bundle_dir)
    bundle_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=bundle_dir.parent, prefix=f".{bundle_dir.name}."))
    try:
        entries, primary = {}, MODEL_FILE
        for name, art in (artifacts or {}).items():
            file = MODEL_FILE if name == "onnx" else f"model-{name}{Path(art['path']).suffix}"
            shutil.copyfile(art["path"], tmp / file)
            entries[name] = {"model_file": file, **{k: v for k, v in art.items() if k != "path"}}
            if Path(art["path"]) == Path(model_file):
                primary, fmt, precision = file, art["format"], art["precision"]
        if not entries:
            shutil.copyfile(model_file, tmp / MODEL_FILE)
        write_runner(tmp / RUNNER_FILE)
        ood = {} if ood_x is None else {"ood_x": np.ascontiguousarray(ood_x, dtype=np.float32)}
        np.savez(tmp / EVAL_FILE, **_eval_inputs(x), y=np.asarray(y, dtype=np.int64),
                 reference_probs=np.asarray(reference_probs, dtype=np.float32), **ood)
        manifest = {
            "schema": 1, "format": fmt, "precision": precision,
            "model_file": primary, "eval_file": EVAL_FILE, "runner": RUNNER_FILE,
            "input": {"name": "input", "shape": [None, *x.shape[1:]], "dtype": "float32",
                      **({"preprocessing": data["preprocessing"]} if data else {})},
            # which data the model was trained and evaluated on (data.describe): source and its fingerprint
            **({"data": {k: v for k, v in data.items() if k != "preprocessing"}} if data else {}),
            "output": {"name": "probs", "shape": [None, len(classes)]},
            "classes": list(classes), "mc_samples": mc_samples,
            "knob": {"name": knob_name, "value": knob_value},
            "reference": reference_metrics,
            **({"artifacts": entries} if entries else {}),
            "files": {name: {"sha256": sha256_file(tmp / name), "bytes": (tmp / name).stat().st_size}
                      for name in sorted({primary, EVAL_FILE, RUNNER_FILE,
                                          *(e["model_file"] for e in entries.values())})},
            "provenance": provenance,
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        verify_bundle(tmp)
        if bundle_dir.exists():
            shutil.rmtree(bundle_dir)
        tmp.rename(bundle_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return manifest


def _eval_inputs(x) -> dict:
    """{"x": ...} for eval.npz: pixels the loaders scaled from uint8 (every value exactly k / 255) are stored as
    the uint8 k with x_scale 255, a quarter of the bytes; the runner divides them back, bit for bit. Others: fp32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    k = np.rint(x * np.float32(255))
    if x.size and k.min() >= 0 and k.max() <= 255:
        k = k.astype(np.uint8)
        if np.array_equal(k.astype(np.float32) / np.float32(255), x):
            return {"x": k, "x_scale": np.float32(255)}
    return {"x": x}
