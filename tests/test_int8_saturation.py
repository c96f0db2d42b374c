"""onnx-int8 of a network whose weights sit at the ends of their int8 range (an SQS codebook's few levels):
onnxruntime's fused Q/DQ kernels (u8 x s8, pairs summed in int16) must compute the function the Q/DQ graph
writes. On x86 without VNNI they saturated: the packed M = 4 SQS MLP on digits shipped at max |p - p_torch|
0.75 and 6.7 points *above* its PyTorch accuracy (export/formats.py _reduce_weight_range). On a CPU with VNNI
or on ARM both sessions agree either way; the test is of the kernels this machine runs."""
import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import numpy_helper
from torch import nn

from edgebayes.compressed.samples import MCAverage
from edgebayes.export.formats import export_artifact


def _run(path, x, level):
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    so.intra_op_num_threads = 1
    s = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return s.run(None, {s.get_inputs()[0].name: x})[0]


def _codebook_mlp(seed):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.SiLU(), nn.Linear(256, 256), nn.SiLU(), nn.Linear(256, 10))
    with torch.no_grad():
        for m in net:
            if isinstance(m, nn.Linear):   # three levels per layer, as SQS's 2-bit codebook with its zero
                m.weight.copy_(torch.randint(-1, 2, m.weight.shape).float() * 3 / m.weight.shape[1] ** 0.5)
    return net.eval()


def test_int8_onnx_runs_as_its_qdq_graph_says(tmp_path):
    # packed (M = 4 as one grouped conv per layer) with a fitted temperature, as select ships it: the Mul after the
    # output layer makes NNCF quantize its output, and onnxruntime fuses that layer into a QLinearConv
    mc = MCAverage([_codebook_mlp(s) for s in range(4)], temperature=0.8).eval()
    x = torch.rand(512, 1, 8, 8)
    path = export_artifact(mc, "onnx-int8", tmp_path / "q.onnx", x[:8], x[:256], layout="packed")
    fused = _run(path, x.numpy(), ort.GraphOptimizationLevel.ORT_ENABLE_ALL)   # what the runner runs
    written = _run(path, x.numpy(), ort.GraphOptimizationLevel.ORT_DISABLE_ALL)   # Q/DQ as the graph says
    assert (fused.argmax(1) == written.argmax(1)).mean() > 0.99   # before the fix: 0.08 on an AVX2 CPU
    assert np.abs(fused - written).max() < 0.02                    # before: 0.51


def test_int8_weights_are_seven_bit(tmp_path):
    mc = MCAverage([_codebook_mlp(0)]).eval()
    x = torch.rand(64, 1, 8, 8)
    path = export_artifact(mc, "onnx-int8", tmp_path / "q.onnx", x[:8], x, layout="packed")
    weights = [numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer
               if t.data_type == onnx.TensorProto.INT8 and len(t.dims) >= 2]
    assert weights and all(-64 <= w.min() and w.max() <= 63 for w in weights)
