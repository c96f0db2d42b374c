"""Export formats: which file a runtime loads, at which precision (the contract issue 8 fills in).

`FORMATS` maps a format name to a `Format` naming the runtime that loads it on the device and the precision
of its weights and arithmetic. Selection's precision axis goes through this table: a device profile lists
the precisions its runtime takes, and each (runtime, precision) that has a format here is a candidate.
This minimal version holds the ONNX fp32 format only; issue 8 adds TFLite, TensorRT and the quantised ones.
"""

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Format:
    name: str
    runtime: str        # "onnxruntime" | "tflite" | "tensorrt"
    precision: str      # "fp32" | "fp16" | "int8"
    suffix: str         # the model file's extension


FORMATS: dict[str, Format] = {
    "onnx": Format("onnx", "onnxruntime", "fp32", ".onnx"),
}


def export_artifact(mc_model, fmt: str, path, example_x, calib_x=None, opset: int = 17) -> Path:
    """Write `mc_model` in format `fmt` to `path`; calib_x is the calibration set of int8 formats."""
    from edgebayes.export.onnx_export import export_onnx

    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r} (known: {', '.join(FORMATS)})")
    export_onnx(mc_model, example_x, path, opset)
    return Path(path)
