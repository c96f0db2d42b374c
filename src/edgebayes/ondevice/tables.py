"""The one table of formats and runtimes, and the defaults of the timing protocol.

Both sides need them: the device to run a bundle's artifacts (a format's runtime, the modules that provide
it), the host to export, select and check configs (config.py takes its choices and BenchmarkConfig's
defaults from here). Standard library only: config.py imports this before any heavy module.
"""

from typing import NamedTuple


# A NamedTuple, not a dataclass: this module runs on the device too (runner.pyz), and dataclasses arrived in
# Python 3.7; JetPack 4 boards (jetson-nano) have 3.6.
class Format(NamedTuple):
    name: str
    runtime: str      # the runner backend that runs it (RUNTIME_MODULES)
    precision: str    # one of PRECISIONS
    suffix: str       # of the model file in the bundle
    bundle_format: str  # the manifest's "format": onnx | tflite | tensorrt
    families: tuple = ()  # the model families it applies to; () = every family


# Target formats of the exported MC-averaged model (export/formats.py says how each one is made).
FORMATS = {f.name: f for f in (
    Format("onnx", "onnxruntime", "fp32", ".onnx", "onnx"),
    # SQS only: codebook-quantized weights as bit-packed level indices + codebook (export/lowbit.py)
    Format("onnx-codebook", "onnxruntime", "fp32", ".onnx", "onnx", families=("sqs",)),
    # any family: the fp32 graph with fp16-stored weights, Cast to fp32 at load (export/lowbit.py weight_storage)
    Format("onnx-fp16w", "onnxruntime", "fp16", ".onnx", "onnx"),
    Format("onnx-int8", "onnxruntime", "int8", ".onnx", "onnx"),
    Format("tflite-fp32", "tflite", "fp32", ".tflite", "tflite"),
    Format("tflite-fp16", "tflite", "fp16", ".tflite", "tflite"),
    Format("tflite-int8", "tflite", "int8", ".tflite", "tflite"),
    Format("tensorrt-fp16", "tensorrt", "fp16", ".onnx", "tensorrt"),
    Format("tensorrt-int8", "tensorrt", "int8", ".onnx", "tensorrt"),
)}

PRECISIONS = ("fp32", "fp16", "int8")

# Modules that provide each runtime on a device, tried in order: the backends import the same, and the
# deploy preflight probes them.
RUNTIME_MODULES = {
    "onnxruntime": ("onnxruntime",),
    "tflite": ("ai_edge_litert.interpreter", "tflite_runtime.interpreter", "tensorflow.lite"),
    "tensorrt": ("tensorrt",),
}
RUNTIMES = tuple(RUNTIME_MODULES)
# What a board installs for each runtime (the finishing steps of a report of predictions say it).
RUNTIME_PACKAGES = {
    "onnxruntime": "pip install onnxruntime",
    "tflite": "pip install ai-edge-litert (or tflite-runtime)",
    "tensorrt": "JetPack's TensorRT >= 8.0 Python bindings (python3-libnvinfer, JetPack >= 4.6) and pip install "
                "cuda-python (pycuda on JetPack 4's Python 3.6)",
}

# The channel block of each runtime's fast convolution kernels: surgery keeps a multiple of it in every convolution it
# prunes (compressed/surgery.py, _round_width), a profile may override it (runtime.channel_multiple).
# onnxruntime 4: on x86 its convolutions of 57-63 channels took 1.4-1.7x those of 56, 60 or 64 (NCHWc blocks;
# benchmarks/results/channel_multiple.md); tflite 1: XNNPACK's time followed the width smoothly there;
# tensorrt 8: its fp16 tensor-core formats hold channels in blocks of 8 (NVIDIA's performance guide).
CHANNEL_MULTIPLE = {"onnxruntime": 4, "tflite": 1, "tensorrt": 8}

# The runtime of a manifest's "format" (a bundle without "artifacts").
FORMAT_TO_RUNTIME = {f.bundle_format: f.runtime for f in FORMATS.values()}

# The timing protocol's defaults: the runner's command line and config.BenchmarkConfig both take them.
# Warm-up runs, then at least min_runs runs AND min_seconds seconds, in `rounds` interleaved rounds.
PROTOCOL = {"warmup": 20, "min_runs": 200, "min_seconds": 1.0, "rounds": 10}


def get_format(fmt: str) -> Format:
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; available: {', '.join(FORMATS)}")
    return FORMATS[fmt]
