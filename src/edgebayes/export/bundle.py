"""The deployment bundle: model file, eval set and `manifest.json` with hashes.

The device runner needs nothing else (../shared/DESIGN.md). The bundle is assembled in a temporary folder,
checked with the runner's own `verify_bundle`, and only then renamed into place.
"""

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

from edgebayes.deploy.runner import sha256_file, verify_bundle

MODEL_FILE, EVAL_FILE = "model.onnx", "eval.npz"


def write_bundle(bundle_dir, model_file, x, y, reference_probs, *, classes, mc_samples, knob_name, knob_value,
                 reference_metrics, provenance, fmt="onnx", precision="fp32") -> dict:
    """Assemble the bundle at `bundle_dir` (replacing any old one); returns the manifest."""
    bundle_dir = Path(bundle_dir)
    bundle_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=bundle_dir.parent, prefix=f".{bundle_dir.name}."))
    try:
        shutil.copyfile(model_file, tmp / MODEL_FILE)
        np.savez(tmp / EVAL_FILE, x=np.ascontiguousarray(x, dtype=np.float32), y=np.asarray(y, dtype=np.int64),
                 reference_probs=np.asarray(reference_probs, dtype=np.float32))
        manifest = {
            "schema": 1, "format": fmt, "precision": precision,
            "model_file": MODEL_FILE, "eval_file": EVAL_FILE,
            "input": {"name": "input", "shape": [None, *x.shape[1:]], "dtype": "float32"},
            "output": {"name": "probs", "shape": [None, len(classes)]},
            "classes": list(classes), "mc_samples": mc_samples,
            "knob": {"name": knob_name, "value": knob_value},
            "reference": reference_metrics,
            "files": {name: {"sha256": sha256_file(tmp / name), "bytes": (tmp / name).stat().st_size}
                      for name in (MODEL_FILE, EVAL_FILE)},
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
