"""Every target format of the MC-averaged graph, and `export_artifact` that writes one.

    onnx           fp32 ONNX (torch.onnx, TorchScript exporter), run with onnxruntime
    onnx-codebook  SQS models only: the fp32 ONNX with each codebook-quantized weight stored as bit-packed level
                   indices + its codebook, pruned inputs removed from the first layer (export/lowbit.py);
                   computed in fp32 (the dequantized weights are exact), run with onnxruntime
    onnx-fp16w     any family: the fp32 ONNX with its weights stored as fp16 and Cast back to fp32 at load
                   (export/lowbit.py weight_storage); half the bytes, fp32 compute, runs wherever `onnx` runs
    onnx-int8      the fp32 ONNX quantized by NNCF post-training quantization (Q/DQ nodes, int8 weights and
                   activations, calibrated on training inputs), run with onnxruntime
    tflite-fp32    TFLite through litert-torch (no TensorFlow), run with ai-edge-litert
    tflite-fp16    the same with fp16 weights (ai-edge-quantizer float casting of FULLY_CONNECTED and CONV_2D
                   weights), computed in fp32 on the CPU (fp16 on GPU delegates)
    tflite-int8    full-integer PT2E quantization (torchao observers calibrated on training inputs,
                   symmetric per-channel weights, int8 input and output tensors)
    tensorrt-fp16  ONNX shipped to the target; the runner builds an fp16 engine there (TensorRT engines are
                   GPU- and version-specific, ../shared/DEPENDENCIES.md)
    tensorrt-int8  the NNCF Q/DQ ONNX shipped to the target; the runner builds an int8 engine from it

TFLite models have a static batch of 1: litert-torch 0.10 cannot lower a dynamic batch dimension through
the reshapes of these graphs; the runner feeds larger batches row by row (ondevice/backends.py).

No graph simplifier runs on any of them (it would freeze or drop random ops of a Bayesian graph; ours has
none, the posterior samples are constants, but the rule holds). Export is deterministic: the graph holds
the M samples drawn from the run's seed, and the calibration inputs are the first `calib_x` rows.
"""

import collections
import contextlib
import io
import logging
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from edgebayes.errors import StageError
from edgebayes.export.lowbit import breakdown, lowbit_onnx, weight_storage
from edgebayes.export.onnx_export import AFFINE_OPS, export_onnx
from edgebayes.export.packed import UNROLLED_COST, mc_graph
from edgebayes.ondevice.backends import native_model_source, native_noise_filtered
from edgebayes.ondevice.metrics import classification_metrics
from edgebayes.ondevice.runtimes import make_backend, predict_all
from edgebayes.ondevice.tables import FORMATS, get_format  # noqa: F401 (the one table of formats)


class ExportError(StageError):
    pass


class _StartupNoise(logging.Filter):
    """litert-torch warns on the root logger that a PT2E graph 'is converted in training mode': it was put
    in evaluation mode (move_exported_model_to_eval), and the warning is about nothing the user can do."""

    def filter(self, record):
        return not record.getMessage().startswith("Your model is converted in training mode")


@contextlib.contextmanager
def _quiet():
    """litert-torch, TensorFlow (which it imports) and NNCF print progress and start-up notes to stdout,
    to stderr from native code, and to the logs: keep the pipeline's log readable. Their imports happen
    in here too (torch's 'No CUDA runtime is found', TensorFlow's oneDNN note, LiteRT's op counts)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    loggers = [logging.getLogger(name) for name in ("nncf", "absl", "litert_torch", "torch.export",
                                                    "torch.utils.cpp_extension", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    noise = _StartupNoise()
    logging.getLogger().addFilter(noise)
    try:
        with contextlib.redirect_stdout(io.StringIO()), native_noise_filtered():
            yield
    finally:
        logging.getLogger().removeFilter(noise)
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _calibration_rows(calib_x, n_min=1):
    if calib_x is None or len(calib_x) < n_min:
        raise ExportError("int8 export needs calibration inputs (export.calibration_size rows of the training split)")
    return np.ascontiguousarray(torch.as_tensor(calib_x).numpy(), dtype=np.float32)


def quantize_onnx_int8(fp32_path, out_path, calib_x):
    """NNCF post-training quantization of an ONNX model: Q/DQ int8 model that onnxruntime runs.

    Left in float (NNCF ignored scope):
      - the output softmaxes and the MC average after them: probabilities quantized to 8 bits (steps of 1/255)
        wreck calibration (measured on digits: NLL 0.39 -> 0.52, ECE 0.062 -> 0.13 at equal accuracy). They are
        the softmaxes from which the output is reached without another weighted layer; an attention block's
        softmax inside the network is not one of them (before, everything after a transformer's first
        attention stayed float);
      - a MatMul over the M samples' stacked weights (a packed Linear on tokens, [M, F, out]): onnxruntime's
        int8 MatMul kernels take a 2-D weight and fail on its per-channel zero points at run time.
    Every Gemm and Conv (the packed layout's too) is int8. Returns the float nodes' names in "float_ops", and
    those of them that are layers (the stacked MatMuls) in "float_layers".
    """
    import onnx

    with _quiet():
        import nncf
    model = onnx.load(str(fp32_path))
    constants = {t.name: len(t.dims) for t in model.graph.initializer}
    stacked = [n.name for n in model.graph.node
               if n.op_type == "MatMul" and len(n.input) > 1 and constants.get(n.input[1], 0) > 2]
    ignored = _output_probabilities(model.graph) + stacked
    rows = _calibration_rows(calib_x)
    input_name = model.graph.input[0].name
    dataset = nncf.Dataset([rows[i: i + 1] for i in range(len(rows))], lambda a: {input_name: a})
    with _quiet():
        quantized = nncf.quantize(model, dataset, subset_size=len(rows),
                                  ignored_scope=nncf.IgnoredScope(names=ignored, validate=False))
    _reduce_weight_range(quantized)
    onnx.save(quantized, str(out_path))
    onnx.checker.check_model(str(out_path))
    return {"calibration_rows": len(rows), "float_ops": ignored, "float_layers": stacked}


def _reduce_weight_range(model):
    """Every symmetric int8 weight of a DequantizeLinear to 7 bits (q -> round(q / 2) in [-64, 63], its scale x 2),
    in place: onnxruntime fuses Q/DQ into u8 x s8 kernels (QLinearConv, MatMulInteger), which on x86 CPUs without
    VNNI (AVX2, and AVX-512 before Cascade Lake) add pairs of u8 * s8 products in int16 with saturation: two products of
    255 x 127 overflow it. A network whose weights sit at the ends of their range (an SQS codebook's few levels, the
    largest mapped to +-127) then computed another function (digits MLP, M = 4: max |p - p_torch| 0.75, accuracy
    0.822 -> 0.889) that the accuracy floor let through. At 7 bits no pair can overflow (onnxruntime's reduce_range)."""
    from onnx import numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] not in inits or len(node.input) < 2:
            continue
        q = numpy_helper.to_array(inits[node.input[0]])
        zero = numpy_helper.to_array(inits[node.input[2]]) if len(node.input) > 2 and node.input[2] in inits else None
        if q.dtype != np.int8 or node.input[1] not in inits or (zero is not None and zero.any()):
            continue
        scale = numpy_helper.to_array(inits[node.input[1]])
        inits[node.input[0]].CopyFrom(numpy_helper.from_array(
            np.clip(np.round(q.astype(np.float32) / 2), -64, 63).astype(np.int8), node.input[0]))
        inits[node.input[1]].CopyFrom(numpy_helper.from_array((scale * 2).astype(scale.dtype), node.input[1]))


def _output_probabilities(graph):
    """Names of the output softmaxes (the graph's outputs are reached from them without a weighted layer) and
    of every node downstream of them: the probabilities and their MC average."""
    consumers = collections.defaultdict(list)
    for n in graph.node:
        for name in n.input:
            consumers[name].append(n)
    outputs = {o.name for o in graph.output}
    plain = set()   # nodes whose output reaches a graph output through no weighted layer
    for n in reversed(graph.node):   # ONNX graphs are topologically sorted
        if any(o in outputs for o in n.output) or any(
                c.name in plain and c.op_type not in AFFINE_OPS for o in n.output for c in consumers[o]):
            plain.add(n.name)
    names, produced = [], set()
    for n in graph.node:
        if (n.op_type == "Softmax" and n.name in plain) or produced.intersection(n.input):
            names.append(n.name)
            produced.update(n.output)
    return names


def _litert_convert(module, example, path, quant_config=None):
    # ai-edge-quantizer draws tqdm bars on stderr for a network of 100 operations or more (tflite-fp16 of a
    # mobilenet: "Generating Quantization Parameters:: 100%" in the pipeline's log and under eb.save: probe)
    with _quiet(), contextlib.redirect_stderr(io.StringIO()):
        import litert_torch

        # the bytes, written here: edge.export writes through LLVM, whose full disk ends the process at once
        # ("LLVM ERROR: IO failure on output stream"): exit 1, and that line swallowed here (probe)
        content = litert_torch.convert(module, (example,), quant_config=quant_config).model_content()
    Path(path).write_bytes(content)


def export_tflite(module, example, path, precision, calib_x=None):
    """litert-torch conversion at batch 1 in fp32, fp16 weights, or full-integer int8 (PT2E)."""
    example = example[:1].contiguous()
    if precision == "fp32":
        _litert_convert(module, example, path)
        return {}
    if precision == "fp16":
        with _quiet():
            from litert_torch.generative.quantize import quant_recipes

        _litert_convert(module, example, path, quant_recipes.full_fp16_recipe())
        return {}
    if precision != "int8":
        raise ValueError(f"TFLite precision {precision!r}")
    with _quiet():
        from litert_torch.quantize import pt2e_quantizer, quant_config
        from torchao.quantization.pt2e import move_exported_model_to_eval, quantize_pt2e

    rows = torch.from_numpy(_calibration_rows(calib_x))
    quantizer = pt2e_quantizer.PT2EQuantizer().set_global(
        pt2e_quantizer.get_symmetric_quantization_config(is_per_channel=True, is_dynamic=False))
    with _quiet():
        graph = torch.export.export(module.eval(), (example,)).module()
        graph = quantize_pt2e.prepare_pt2e(graph, quantizer)
        with torch.no_grad():
            for i in range(len(rows)):  # observers record activation ranges on the calibration inputs
                graph(rows[i: i + 1])
        graph = move_exported_model_to_eval(quantize_pt2e.convert_pt2e(graph, fold_quantize=False))
    _litert_convert(graph, example, path, quant_config.QuantConfig(pt2e_quantizer=quantizer))
    return {"calibration_rows": len(rows)}


def export_artifact(mc_model, fmt: str, path, example_x, calib_x=None, opset: int = 17, *, layout: str = "packed",
                    details: dict | None = None) -> Path:
    """Write the MC-averaged `mc_model` (an MCAverage) in format `fmt` to `path`; returns the path.

    example_x: a batch of inputs (shapes, and the packed-equals-unrolled check); calib_x: calibration inputs
    from the training split (int8 formats); layout: 'packed' or 'unrolled' (a network the packed layout
    refuses is exported unrolled, and `details` says so: "layout", "packed_refused"). Conversion facts
    (calibration rows, ops left in fp32) are added to `details` when given.
    """
    f = get_format(fmt)
    path = Path(path)
    example_x = torch.as_tensor(example_x)
    batch_statistics = [n.split(".", 2)[-1] for n, m in mc_model.named_modules()   # named in the user's network
                        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_mean is None]
    if batch_statistics:   # torch's exporters fail on them deep inside ("batch_size and channel_size must be non-None")
        raise ExportError(f"{fmt}: batch norm {batch_statistics[0]!r} keeps no running statistics "
                          f"(track_running_stats=False; {len(set(batch_statistics))} such): evaluated, it "
                          f"normalises by each batch, which an exported graph's BatchNormalization cannot; build "
                          f"the network's batch norms with track_running_stats=True")
    refused = []   # the packed layout refused this network: it is exported unrolled, and says why
    module = mc_graph(mc_model, layout, example_x[:16], fallback=refused.append,
                      fold_batch_norms=f.name != "onnx-codebook")   # codebook convs keep their K levels
    info = {"format": f.name, "precision": f.precision, "runtime": f.runtime,
            "layout": "unrolled" if refused else layout}
    if refused:
        info["packed_refused"] = f"{refused[0]} Exported unrolled instead: {UNROLLED_COST}"
    try:
        _convert(f, module, path, example_x, calib_x, opset, info)
    except _ConverterFailed as e:   # torch's converters fail deep inside, with their whole IR in the message
        if module is mc_model:   # unrolled already: nothing simpler to try
            raise ExportError(f"{fmt}: the converter failed on the network ({e})") from e.__cause__
        info.update(layout="unrolled", packed_refused=f"the converter failed on the packed graph ({e}). "
                                                      f"Exported unrolled instead: {UNROLLED_COST}")
        try:
            _convert(f, mc_model.eval(), path, example_x, calib_x, opset, info)
        except _ConverterFailed as e2:
            raise ExportError(f"{fmt}: the converter failed on the network, packed ({e}) and unrolled "
                              f"({e2})") from e2.__cause__
    if f.suffix == ".onnx" and "bytes_breakdown" not in info:
        info["bytes_breakdown"] = breakdown(path, path if f.precision == "fp32" else None)
    if details is not None:
        details.update(info)
    return path


class _ConverterFailed(Exception):
    """torch's ONNX or LiteRT converter failed (its exception is the cause); the message is its first line."""


def _converted(convert, *args):
    """convert(*args), a converter's failure raised as _ConverterFailed: 'Type: first line' of a message that
    may run to pages (the converter's IR dump). Our own refusals (ExportError) pass as they are."""
    try:
        return convert(*args)
    except (ExportError, ImportError):   # ours, or a converter not installed: not the network's fault
        raise
    except Exception as e:
        first = next((line for line in str(e).splitlines() if line.strip()), "")[:300]
        raise _ConverterFailed(f"{type(e).__name__}: {first}") from e


def _convert(f, module, path, example_x, calib_x, opset, info):
    """Write `module` (packed or unrolled) in format `f`; conversion facts into `info`."""
    with torch.no_grad():
        if f.suffix == ".onnx":
            if f.precision == "int8" or f.name in ("onnx-codebook", "onnx-fp16w"):
                with tempfile.TemporaryDirectory() as tmp:
                    fp32 = Path(tmp) / "fp32.onnx"
                    # onnx-codebook: batch norms left unfolded, else a conv's K levels become K x C_out values
                    _converted(export_onnx, module, example_x[:1], fp32, opset, f.name != "onnx-codebook")
                    if f.name == "onnx-codebook":
                        info.update(lowbit_onnx(fp32, path))
                    elif f.name == "onnx-fp16w":
                        # onnxruntime folds the Casts at load: its copy of the weights is the fp32 file's
                        info.update(weight_storage(fp32, path, "fp16"), runtime_weight_bytes=fp32.stat().st_size)
                    else:
                        info.update(quantize_onnx_int8(fp32, path, calib_x))
                    info["bytes_breakdown"] = breakdown(path, fp32)
            else:  # fp32 ONNX; for tensorrt-fp16 the engine is built from it in fp16 on the target
                _converted(export_onnx, module, example_x[:1], path, opset)
        else:
            info.update(_converted(export_tflite, module, example_x, path, f.precision, calib_x))


def artifact_predict(path, fmt: str, x: np.ndarray, threads: int = 0) -> np.ndarray:
    """Run an artifact over x with the device runner's own backend (the code the device runs)."""
    backend = make_backend(get_format(fmt).runtime, os.fspath(path), threads)
    want = backend.example_shape
    if want is not None and (len(want) != x.ndim - 1 or any(w not in (None, g) for w, g in zip(want, x.shape[1:]))):
        shown = ", ".join("?" if w is None else str(w) for w in want)
        raise ValueError(f"x: {Path(path).name} takes inputs of shape (N, {shown}), x has shape {tuple(x.shape)}")
    return predict_all(backend, np.ascontiguousarray(x, dtype=np.float32))


def fidelity(probs, reference_probs, y) -> dict:
    """An artifact's accuracy, NLL and ECE on the eval set beside the PyTorch MC average's, and the largest
    difference of any class probability (the same metric functions the device runner uses)."""
    probs = np.asarray(probs, dtype=np.float64)
    mine, ref = classification_metrics(probs, y), classification_metrics(reference_probs, y)
    return {**{k: mine[k] for k in ("accuracy", "nll", "ece", "brier")},
            "reference": {k: ref[k] for k in ("accuracy", "nll", "ece", "brier")},
            "max_abs_prob_diff": float(np.abs(probs - np.asarray(reference_probs, dtype=np.float64)).max()),
            "n": mine["n"]}


def check_fidelity(line: dict, precision: str, tolerance: float, max_accuracy_drop: float) -> dict:
    """The stated tolerance of an artifact: fp32 within `tolerance` of the PyTorch probabilities (or, where
    line["float64"] holds compressed.samples.fp32_agreement's facts, as close to float64 as PyTorch fp32 is,
    plus `tolerance`); fp16 and
    int8 (which legitimately move probabilities) at or above the accuracy floor. Returns the check, passed
    or not, for the manifest and the report."""
    if precision == "fp32":
        # fp32_agreement's facts, where the fp32 reference alone did not pass (an ill-conditioned network)
        exact = line.get("float64") or {}
        passed = line["max_abs_prob_diff"] <= tolerance or bool(exact.get("passed"))
        rule = f"max |p - p_torch| <= {tolerance:.0e}"
        if "torch_fp32_error" in exact:
            rule += (f", or from float64 {exact['max_abs_diff_float64']:.2e} <= {tolerance:.0e} + PyTorch fp32's "
                     f"own {exact['torch_fp32_error']:.2e} (an ill-conditioned network)")
    else:
        floor = line["reference"]["accuracy"] - max_accuracy_drop
        passed = line["accuracy"] >= floor
        rule = f"accuracy >= {floor:.4f} (PyTorch MC accuracy - {max_accuracy_drop})"
    return {"rule": rule, "passed": bool(passed)}


def operator_count(path):
    """Operators an inference with the exported file dispatches: the ONNX graph's nodes (Constant and
    Identity nodes hold no work), or the TFLite model's ops. A TensorRT format ships ONNX, counted as such."""
    path = Path(path)
    if path.suffix == ".onnx":
        import onnx

        return sum(n.op_type not in ("Constant", "Identity") for n in onnx.load(str(path)).graph.node)
    if path.suffix == ".tflite":
        from edgebayes.ondevice.backends import _tflite_interpreter

        interpreter_class, _, _ = _tflite_interpreter()
        named, content = native_model_source(path)
        return len(interpreter_class(model_path=named, model_content=content)._get_ops_details())
    raise ValueError(f"{path}: cannot count the operators of a {path.suffix or 'suffix-less'} file")


def formats_for(profile, family=None):
    """The export formats this device's runtime loads, at the precisions its profile lists; a format made
    for some model families only (onnx-codebook: SQS) when `family` is one of them."""
    fmts = [f for f in FORMATS.values()
            if f.runtime == profile.runtime.name and f.precision in profile.runtime.precision
            and (not f.families or family in f.families)]
    if not fmts:
        known = ", ".join(f"{f.name} ({f.runtime} {f.precision})" for f in FORMATS.values())
        raise StageError(f"device {profile.name}: no export format for runtime {profile.runtime.name} at "
                         f"precision {', '.join(profile.runtime.precision)} (formats here: {known})")
    return fmts
