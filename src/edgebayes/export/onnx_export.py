"""ONNX export of the MC-averaged graph, and the check that it computes what PyTorch computes.

The TorchScript-based exporter (`dynamo=False`) is used: it works on the torch versions we support
(2.11 on the lent GPUs, 2.14 here) and emits plain Gemm / Sigmoid / Softmax nodes for these graphs. No
graph simplifier runs afterwards (a simplifier would freeze random ops; ours has none, but the rule holds
for every Bayesian graph).
"""

import copy
import warnings

import numpy as np
import onnx
import torch

from edgebayes.ondevice.backends import native_model_source


def _averaging(out, size):
    """[out, size]: row i averages inputs floor(i size / out) .. ceil((i + 1) size / out) - 1, as
    adaptive_avg_pool2d does along one dimension."""
    a = torch.zeros(out, size)
    for i in range(out):
        start, end = (i * size) // out, -((-(i + 1) * size) // out)
        a[i, start:end] = 1.0 / (end - start)
    return a


AVERAGING_CONSTANTS = ("averaging_rows", "averaging_cols")   # AdaptiveAvgPoolAsMatmul's matrices: no weights


class AdaptiveAvgPoolAsMatmul(torch.nn.Module):
    """nn.AdaptiveAvgPool2d at a fixed input size as two matrix products: the same averages. torch.onnx
    exports an adaptive pool only when the output size divides the input size; alexnet's and vgg's 7x7 pool
    after a 1x1 map (32 px inputs) does not."""

    def __init__(self, in_hw, out_hw):
        super().__init__()
        # named AVERAGING_CONSTANTS: the file's initializers keep the names, and onnx_parameter_count skips them
        self.register_buffer("averaging_rows", _averaging(out_hw[0], in_hw[0]))
        self.register_buffer("averaging_cols", _averaging(out_hw[1], in_hw[1]).T.contiguous())

    def forward(self, x):
        return torch.matmul(torch.matmul(self.averaging_rows, x), self.averaging_cols)


def exportable(module: torch.nn.Module, example: torch.Tensor) -> torch.nn.Module:
    """`module`, or a copy with each adaptive average pool that ONNX cannot export as such (its output size
    does not divide its input size at the example's size) replaced by AdaptiveAvgPoolAsMatmul."""
    sizes = {}

    def record(m, inputs, out):
        sizes[m] = (tuple(inputs[0].shape[-2:]), tuple(out.shape[-2:]))

    handles = [m.register_forward_hook(record) for m in module.modules() if isinstance(m, torch.nn.AdaptiveAvgPool2d)]
    try:
        with torch.no_grad():
            module.eval()(example)
    finally:
        for h in handles:
            h.remove()
    bad = {m for m, (i, o) in sizes.items() if any(a % b for a, b in zip(i, o))}
    if not bad:
        return module
    names = {m: n for n, m in module.named_modules() if m in bad}
    module = copy.deepcopy(module)
    for m, name in names.items():
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, child, AdaptiveAvgPoolAsMatmul(*sizes[m]))
    return module


def export_onnx(module: torch.nn.Module, example: torch.Tensor, path, opset: int = 17, fold_batch_norm: bool = True):
    """Write `module` to `path` with input 'input', output 'probs' and a dynamic batch dimension.

    fold_batch_norm=False keeps each batch norm as a BatchNormalization node instead of folding it into the
    convolution before it (torch's eval-mode peephole): a codebook-quantized convolution keeps its K levels
    (onnx-codebook), and onnxruntime folds the pair itself when it loads the file."""
    module = exportable(module.eval(), example)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    # nn.MultiheadAttention's eval fast path is one fused operator ONNX has no conversion for (vit_b_16):
    # off, it runs as the matrix products and softmax it computes, which export.
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            # PRESERVE on a module in eval mode exports eval-mode batch norms; constant folding is safe then
            warnings.filterwarnings("ignore", message="It is recommended that constant folding be turned off")
            torch.onnx.export(module.eval(), (example,), str(path), input_names=["input"], output_names=["probs"],
                              dynamic_axes={"input": {0: "batch"}, "probs": {0: "batch"}},
                              opset_version=opset, dynamo=False,
                              training=torch.onnx.TrainingMode.EVAL if fold_batch_norm
                              else torch.onnx.TrainingMode.PRESERVE)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    onnx.checker.check_model(str(path))


AFFINE_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")


def onnx_parameter_count(path) -> int:
    """Number of weights and biases of the graph's affine maps (Conv, ConvTranspose, Gemm, MatMul): the
    initializers they read, counted once per use. What compressed/structure.count_weights counts on the PyTorch
    side, so the two can be compared: a batch norm the exporter leaves unfolded (a BatchNorm1d after a Linear
    at M = 1) and other constants are not weights of an affine map, and counting them said "the exported graph
    does not match the pruned model" of a correct file.

    The exporter stores equal constants once and hands them to several layers through Identity nodes
    (e.g. the folded batch-norm biases of freshly initialised layers); each use is a parameter of the net. The
    averaging matrices of an adaptive pool exported as products (AdaptiveAvgPoolAsMatmul) are not.
    """
    graph = onnx.load(str(path)).graph
    sizes = {t.name: int(np.prod(t.dims)) for t in graph.initializer
             if t.name.rpartition(".")[2] not in AVERAGING_CONSTANTS}
    source = {n.output[0]: n.input[0] for n in graph.node if n.op_type == "Identity" and n.input[0] in sizes}
    used = [name for n in graph.node if n.op_type in AFFINE_OPS for name in n.input[1:]]
    # A Linear on (B, T, F) exports as MatMul + Add: its bias is what the Add adds to the MatMul's output, one
    # vector of the output width per weight matrix ([N], or [M, 1, N] for M packed samples' [M, K, N]), not
    # another constant added there (a positional embedding)
    dims = {t.name: tuple(t.dims) for t in graph.initializer if t.name in sizes}
    weight = {n.output[0]: dims[source.get(n.input[1], n.input[1])] for n in graph.node
              if n.op_type == "MatMul" and source.get(n.input[1], n.input[1]) in dims}

    def is_bias(shape, w):
        return bool(shape) and shape[-1] == w[-1] and int(np.prod(shape)) == int(np.prod(w[:-2])) * w[-1]

    used += [name for n in graph.node if n.op_type == "Add" for product in n.input if product in weight
             for name in n.input if is_bias(dims.get(source.get(name, name)), weight[product])]
    return int(sum(sizes.get(source.get(name, name), 0) for name in used))


def onnx_session(path, threads: int = 0):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    named, content = native_model_source(path)
    return ort.InferenceSession(named or content, opts, providers=["CPUExecutionProvider"])


def onnx_predict(path, x: np.ndarray, batch_size: int = 2048) -> np.ndarray:
    session = onnx_session(path)
    return np.concatenate([session.run(["probs"], {"input": x[i: i + batch_size]})[0]
                           for i in range(0, len(x), batch_size)])
