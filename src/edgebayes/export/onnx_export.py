"""ONNX export of the MC-averaged graph, and the check that it computes what PyTorch computes.

The TorchScript-based exporter (`dynamo=False`) is used: it works on the torch versions we support
(2.11 on the lent GPUs, 2.14 here) and emits plain Gemm / Sigmoid / Softmax nodes for these graphs. No
graph simplifier runs afterwards (a simplifier would freeze random ops; ours has none, but the rule holds
for every Bayesian graph).
"""

import warnings

import numpy as np
import onnx
import torch


def export_onnx(module: torch.nn.Module, example: torch.Tensor, path, opset: int = 17):
    """Write `module` to `path` with input 'input', output 'probs' and a dynamic batch dimension."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(module.eval(), (example,), str(path), input_names=["input"], output_names=["probs"],
                          dynamic_axes={"input": {0: "batch"}, "probs": {0: "batch"}},
                          opset_version=opset, dynamo=False)
    onnx.checker.check_model(str(path))


def onnx_parameter_count(path) -> int:
    """Number of weight values the graph uses: its initializers, counted once per Identity that re-uses one.

    The exporter stores equal constants once and hands them to several layers through Identity nodes
    (e.g. the folded batch-norm biases of freshly initialised layers); each use is a parameter of the net.
    """
    graph = onnx.load(str(path)).graph
    sizes = {t.name: int(np.prod(t.dims)) for t in graph.initializer}
    reused = sum(sizes.get(n.input[0], 0) for n in graph.node if n.op_type == "Identity")
    return int(sum(sizes.values()) + reused)


def onnx_session(path, threads: int = 0):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def onnx_predict(path, x: np.ndarray, batch_size: int = 2048) -> np.ndarray:
    session = onnx_session(path)
    return np.concatenate([session.run(["probs"], {"input": x[i: i + batch_size]})[0]
                           for i in range(0, len(x), batch_size)])
