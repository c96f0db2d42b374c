"""The registry of runtime backends (one per row of tables.RUNTIME_MODULES), and the accuracy pass."""

import numpy as np

from .backends import ACCURACY_BATCH, OnnxRuntimeBackend, RuntimeProblem, TFLiteBackend
from .tensorrt_backend import TensorRTBackend

BACKENDS = {"onnxruntime": OnnxRuntimeBackend, "tflite": TFLiteBackend, "tensorrt": TensorRTBackend}


def _backend_class(runtime):
    if runtime not in BACKENDS:
        raise RuntimeProblem(f"runtime {runtime!r} is not supported by this runner "
                             f"(supported: {', '.join(sorted(BACKENDS))})")
    return BACKENDS[runtime]


def load_runtime(runtime):
    """Import `runtime` without loading a model (see Backend.load_runtime), or raise RuntimeProblem."""
    _backend_class(runtime).load_runtime()


def make_backend(runtime, model_path, threads=0, providers=None, **options):
    """Instantiate the backend registered under `runtime`, or raise RuntimeProblem.

    `options` go to backends that take them (TensorRT: precision, workspace_mb, engine_cache, example_shape).
    """
    cls = _backend_class(runtime)
    if providers:
        if cls is not OnnxRuntimeBackend:
            raise RuntimeProblem(f"--providers only applies to onnxruntime, not {runtime!r}")
        return cls(model_path, threads, providers=providers)
    if cls is TensorRTBackend:
        return cls(model_path, threads, **options)
    return cls(model_path, threads)


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
