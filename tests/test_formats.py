"""Every export format round-trips with its fidelity within the stated tolerances (export/formats.py).

Labels are the PyTorch MC average's own predictions on inputs where it is confident, so its accuracy is
1 and the accuracy floor of the fp16/int8 artifacts is a real bar (reference accuracy - max drop).
"""

import typing

import numpy as np
import pytest
import torch

from _nets import samples_and_inputs, transformer_samples
from edgebayes.config import ExportFormat
from edgebayes.compressed.samples import MCAverage
from edgebayes.export.formats import FORMATS, artifact_predict, check_fidelity, export_artifact, fidelity

TOLERANCE, MAX_DROP = 1e-4, 0.05


def _case(net, m=3, n=96):
    samples, x = samples_and_inputs(net, m, n=4 * n)
    mc = MCAverage(samples).eval()
    with torch.no_grad():
        ref = mc(x).numpy()
    confident = np.argsort(-ref.max(axis=1))[:n]  # keep inputs far from a decision boundary
    x, ref = x[confident], ref[confident]
    return mc, x, ref, ref.argmax(axis=1)


def test_format_table_matches_the_config_schema():
    assert set(FORMATS) == set(typing.get_args(ExportFormat))
    for f in FORMATS.values():
        assert f.runtime in ("onnxruntime", "tflite", "tensorrt") and f.precision in ("fp32", "fp16", "int8")


ALL = ["onnx", "onnx-fp16w", "onnx-int8", "tflite-fp32", "tflite-fp16", "tflite-int8"]
CASES = ([("mlp", "packed", f) for f in ALL] + [("lenet", "packed", f) for f in ALL]
         + [("mlp", "unrolled", f) for f in ("onnx", "onnx-int8", "tflite-int8")])


@pytest.mark.parametrize("net, layout, fmt", CASES)
def test_every_format_round_trips_within_tolerance(net, layout, fmt, tmp_path):
    mc, x, ref, y = _case(net)
    calib = samples_and_inputs(net, 1, n=64, seed=7)[1]  # calibration inputs: not the eval inputs
    facts = {}
    path = export_artifact(mc, fmt, tmp_path / f"model{FORMATS[fmt].suffix}", x[:8], calib, layout=layout,
                           details=facts)
    assert path.is_file() and facts["layout"] == layout and facts["precision"] == FORMATS[fmt].precision
    line = fidelity(artifact_predict(path, fmt, x.numpy()), ref, y)
    check = check_fidelity(line, FORMATS[fmt].precision, TOLERANCE, MAX_DROP)
    assert check["passed"], (fmt, line)
    if FORMATS[fmt].precision == "fp32":
        assert line["max_abs_prob_diff"] <= TOLERANCE
    else:
        assert line["accuracy"] >= 1 - MAX_DROP
        assert line["max_abs_prob_diff"] > 0  # it really is a different (quantized) model


def test_int8_onnx_keeps_probabilities_in_float(tmp_path):
    import onnx

    mc, x, ref, y = _case("mlp")
    facts = {}
    path = export_artifact(mc, "onnx-int8", tmp_path / "q.onnx", x[:8], x[:32], details=facts)
    graph = onnx.load(str(path)).graph
    ops = [n.op_type for n in graph.node]
    assert "QuantizeLinear" in ops and "DequantizeLinear" in ops  # it is quantized
    softmax = next(n for n in graph.node if n.op_type == "Softmax")
    assert not any(n.op_type == "QuantizeLinear" and softmax.output[0] in n.input for n in graph.node)
    assert facts["calibration_rows"] == 32


def _quantized_ops(path):
    """(weighted ops reading a dequantized input, all weighted ops) of an ONNX graph, by type."""
    import collections

    import onnx

    graph = onnx.load(str(path)).graph
    dequantized = {o for n in graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    weighted = [n for n in graph.node if n.op_type in ("Conv", "Gemm", "MatMul")]
    return (collections.Counter(n.op_type for n in weighted if dequantized.intersection(n.input)),
            collections.Counter(n.op_type for n in weighted))


@pytest.mark.parametrize("layout", ["unrolled", "packed"])
def test_int8_onnx_of_a_transformer_quantizes_past_its_attention_and_runs(layout, tmp_path):
    """A softmax inside the network (attention) is not an output probability: the layers after it are int8 too
    (before, everything after a transformer's first attention stayed float). The packed layout's Linears on
    tokens (a MatMul over the M samples' stacked weights, which onnxruntime's int8 kernels refuse at run time)
    stay float and are named in float_ops; every other layer is int8, and the artifact runs."""
    import onnx

    pytest.importorskip("torchvision")
    samples, x = transformer_samples("vit", 2)
    mc, x = MCAverage(samples).eval(), torch.cat([x, -x, 2 * x, x.flip(0)])   # 32 calibration inputs
    facts = {}
    path = export_artifact(mc, "onnx-int8", tmp_path / "q.onnx", x[:8], x, layout=layout, details=facts)
    assert facts["layout"] == layout
    quantized, weighted = _quantized_ops(path)
    graph = onnx.load(str(path)).graph
    stacked = [n.name for n in graph.node if n.op_type == "MatMul" and n.name in facts["float_ops"]]
    if layout == "unrolled":
        assert quantized == weighted and not stacked and facts["float_layers"] == []   # every Conv, Gemm and MatMul, after the attention too
    else:
        assert len(stacked) == 4 and sorted(facts["float_layers"]) == sorted(stacked)   # 2 MLP Linears x 2 blocks
        assert quantized["MatMul"] == weighted["MatMul"] - 4 and quantized["Conv"] == weighted["Conv"]
    with torch.no_grad():
        ref = mc(x).numpy()
    assert np.abs(artifact_predict(path, "onnx-int8", x.numpy()) - ref).max() < 0.05


@pytest.mark.parametrize("name", ["vit", "swin", "convnext"])
def test_packed_transformers_round_trip_through_tflite(name, tmp_path):
    """litert-torch converts the packed graph of a transformer (the M samples folded into the batch around
    LayerNorm and attention, batched matmuls on tokens) and LiteRT computes the MC average."""
    pytest.importorskip("torchvision")
    samples, x = transformer_samples(name, 2)
    mc = MCAverage(samples).eval()
    facts = {}
    path = export_artifact(mc, "tflite-fp32", tmp_path / "m.tflite", x, layout="packed", details=facts)
    assert facts["layout"] == "packed"
    with torch.no_grad():
        ref = mc(x).numpy()
    assert ref.max() - ref.min() > 0.02   # probabilities that compare something
    assert np.abs(artifact_predict(path, "tflite-fp32", x.numpy()) - ref).max() <= TOLERANCE


def test_fp16_weight_onnx_halves_the_file_keeps_fp32_compute_and_is_offered_where_fp16_is(tmp_path):
    import onnx
    from onnx import numpy_helper

    from edgebayes.config import DeviceProfile
    from edgebayes.export.formats import formats_for

    mc, x, _, _ = _case("mlp")
    fp32 = export_artifact(mc, "onnx", tmp_path / "fp32.onnx", x[:8])
    facts = {}
    path = export_artifact(mc, "onnx-fp16w", tmp_path / "fp16w.onnx", x[:8], details=facts)
    model = onnx.load(str(path))
    weights = [numpy_helper.to_array(t) for t in model.graph.initializer if len(t.dims) >= 2]
    assert weights and all(w.dtype == np.float16 for w in weights)  # stored fp16, no fp32 weight left
    for v in (*model.graph.input, *model.graph.output):  # fp32 in and out: the runner feeds it as any onnx
        assert v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    ratio = facts["bytes_breakdown"]["compression_ratio"]
    assert facts["bytes_breakdown"]["fp32_bytes"] == fp32.stat().st_size and 1.8 <= ratio < 2
    assert facts["runtime_weight_bytes"] == fp32.stat().st_size  # onnxruntime's copy: the Casts folded to fp32
    diff = np.abs(artifact_predict(path, "onnx-fp16w", x.numpy()) - artifact_predict(fp32, "onnx", x.numpy())).max()
    assert 0 < diff <= 1e-3  # rounded weights, same function (3e-6 measured on this net)

    def offered(precision):
        profile = DeviceProfile.model_validate({"name": "edge", "runtime": {"precision": precision}})
        return [f.name for f in formats_for(profile)]

    assert "onnx-fp16w" in offered(["fp32", "fp16"]) and "onnx-fp16w" not in offered(["fp32"])


def test_export_is_deterministic(tmp_path):
    mc, x, _, _ = _case("mlp")
    a = export_artifact(mc, "onnx", tmp_path / "a.onnx", x[:8])
    b = export_artifact(mc, "onnx", tmp_path / "b.onnx", x[:8])
    assert a.read_bytes() == b.read_bytes()


def test_int8_without_calibration_data_is_refused(tmp_path):
    from edgebayes.export.formats import ExportError

    mc, x, _, _ = _case("mlp")
    with pytest.raises(ExportError, match="calibration"):
        export_artifact(mc, "tflite-int8", tmp_path / "q.tflite", x[:8], None)


def test_fidelity_check_rules():
    y = np.array([0, 1])
    ref = np.array([[0.9, 0.1], [0.2, 0.8]])
    line = fidelity(ref + [[-0.05, 0.05], [0, 0]], ref, y)
    assert line["max_abs_prob_diff"] == pytest.approx(0.05) and line["accuracy"] == 1.0
    assert not check_fidelity(line, "fp32", 1e-4, 0.01)["passed"]
    assert check_fidelity(line, "int8", 1e-4, 0.01)["passed"]
    flipped = fidelity(ref[:, ::-1], ref, y)
    assert flipped["accuracy"] == 0.0 and not check_fidelity(flipped, "fp16", 1e-4, 0.5)["passed"]


def test_an_fp32_artifact_as_close_to_float64_as_pytorch_fp32_passes_and_the_rule_says_so():
    """export's fp32 check on an ill-conditioned network (compressed.samples.fp32_agreement's facts in
    line["float64"]): 1.2e-4 from PyTorch fp32 passes when it is 7e-5 from float64 and PyTorch fp32 itself is 5e-5
    from it; not when float64 says the artifact is wrong."""
    y = np.array([0, 1])
    ref = np.array([[0.9, 0.1], [0.2, 0.8]])
    line = fidelity(ref + [[1.2e-4, -1.2e-4], [0, 0]], ref, y)
    assert not check_fidelity(line, "fp32", 1e-4, 0.01)["passed"]
    line["float64"] = {"passed": True, "max_abs_diff": 1.2e-4, "max_abs_diff_float64": 7e-5, "torch_fp32_error": 5e-5}
    check = check_fidelity(line, "fp32", 1e-4, 0.01)
    assert check["passed"] and "float64 7.00e-05" in check["rule"] and "5.00e-05" in check["rule"]
    line["float64"] = {"passed": False, "max_abs_diff": 1.2e-4, "max_abs_diff_float64": 1.2e-4, "torch_fp32_error": 1e-7}
    assert not check_fidelity(line, "fp32", 1e-4, 0.01)["passed"]


def test_the_litert_conversion_keeps_its_progress_bars_off_the_log(tmp_path, monkeypatch, capfd):
    """ai-edge-quantizer drew tqdm bars on stderr for a network of 100 operations or more (tflite-fp16 of a
    mobilenet), in the pipeline's log and under eb.save (probe)."""
    import sys

    import litert_torch

    from edgebayes.export import formats

    class Edge:
        def model_content(self):
            return b""

    def convert(*args, **kwargs):
        print("Generating Quantization Parameters:: 100%", file=sys.stderr)
        return Edge()

    monkeypatch.setattr(litert_torch, "convert", convert)
    formats._litert_convert(torch.nn.Identity(), torch.zeros(1, 2), tmp_path / "m.tflite")
    assert "Generating" not in capfd.readouterr().err


def test_save_says_when_a_lower_precision_file_is_no_smaller_than_fp32(tmp_path):
    """On a tiny network the int8 graph's scales, zero points and (de)quantization operators outweigh the bytes
    its weights save, and eb.save wrote the larger file in silence (the pipeline's report shows every format's
    bytes; save writes one). A network with enough weights gets no warning: its int8 file is smaller."""
    import warnings

    import edgebayes as eb
    from torch import nn

    torch.manual_seed(0)
    for hidden, expect in ((2, True), (256, False)):
        module = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 3))
        c = eb.compress(eb.bayesianize(module, "ss-gl", input_shape=(1, 8, 8), n_train=100), m=1)
        x = torch.rand(32, 1, 8, 8)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            path = eb.save(c, tmp_path / f"h{hidden}.onnx", example=x[:4], fmt="onnx-int8", calib_x=x)
        fp32 = eb.save(c, tmp_path / f"h{hidden}-fp32.onnx", example=x[:4])
        told = [str(w.message) for w in said if "no smaller than the same graph in fp32" in str(w.message)]
        assert (path.stat().st_size >= fp32.stat().st_size) == expect   # the case is what it is meant to be
        assert bool(told) == expect, told
        if expect:
            assert f"{path.stat().st_size:,} bytes" in told[0] and f"({fp32.stat().st_size:,} bytes" in told[0]
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(f"h{hidden}")) == \
            sorted([f"h{hidden}.onnx", f"h{hidden}-fp32.onnx"])   # the comparison's file is not left behind
