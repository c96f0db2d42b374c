"""Packed layout of the MC-averaged graph: the M posterior samples run as one network.

`MCAverage` (compress.py) is the *unrolled* layout: M copies of the network side by side, each layer
run M times. The M samples share one architecture (the kept widths of the knob value) and differ only in
their weights, so each layer can instead run all M samples in one operator call:

    Conv2d       one grouped convolution: the M weight tensors concatenated along the output channels,
                 groups = M x the original groups; the activations are [B, M*C, H, W], sample m's
                 channels at m*C .. (m+1)*C. The first convolution reads the shared input, so it needs
                 no grouping and no replicated input: one convolution with M*C outputs.
    BatchNorm    folded into the preceding convolution first (torch.fx fuse, eval statistics); one that
                 cannot be folded becomes a per-channel affine map over the M*C channels.
    Linear       features are laid out like channels, [B, M*F]: a Linear is a grouped 1x1 convolution
                 (groups = M) on [B, M*F, 1, 1]. Its output stays [B, M*out, 1, 1] (FEATURE_MAPS) through
                 activations into the next Linear, and a flatten feeding a Linear reshapes straight to
                 [B, M*F, 1, 1]: each reshape is one more operator call, the cost packing exists to cut.
                 The first Linear reads the shared input and is one matmul with M*out outputs. (A batched matmul over [M, B, F] was 3x slower in onnxruntime
                 1.31, whose fused batched MatMul has no fast path for it, and its int8 kernel refuses it.)
    activations, residual additions, pooling
                 unchanged: they act per element or per channel.
    flatten      conv -> linear per sample: [B, M*C, H, W] -> [B, M*C*H*W] is already sample-major.
    cat          channel concatenation per sample: [B, M, C1, ...] and [B, M, C2, ...] -> [B, M, C1+C2, ...].
    output       [B, M*K] -> [B, M, K]: the mean over M of the softmaxes, exactly as MCAverage.

The graph is built generically: torch.fx traces sample 0 (after batch-norm folding), shapes are
propagated on an example input, and each call is replaced by its packed version, the weights taken
from the same layer of every sample. Anything not in the table above is refused with a PackingError
naming the operation. `pack_samples` checks on the example input that the packed graph computes the
unrolled MC average.
"""

import copy
import math
import operator

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.experimental.optimization import fuse
from torch.fx.passes.shape_prop import ShapeProp

from edgebayes.errors import StageError

LAYOUTS = ("packed", "unrolled")

# Where a value of the packed graph keeps its M samples.
SHARED = "shared"      # does not depend on the sample (the network input, and what only it feeds)
CHANNELS = "channels"  # [B, M*C, ...]: sample m's channels (or features) at m*C .. (m+1)*C
FEATURE_MAPS = "feature maps"  # per-sample [B, F] features held as [B, M*F, 1, 1], as a grouped 1x1 conv makes them

# Parameter-free modules and functions acting per element or per channel: they keep the layout.
ELEMENTWISE_MODULES = (nn.ReLU, nn.ReLU6, nn.SiLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU,
                       nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Softplus, nn.Mish, nn.Identity,
                       nn.Dropout)
CHANNELWISE_MODULES = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)
ELEMENTWISE_FUNCTIONS = {F.relu, torch.relu, F.relu6, torch.sigmoid, F.sigmoid, torch.tanh, F.tanh, F.silu,
                         F.gelu, F.leaky_relu, F.elu, F.hardswish, F.hardtanh, F.softplus, F.dropout}
CHANNELWISE_FUNCTIONS = {F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d, F.adaptive_max_pool2d}
ELEMENTWISE_METHODS = {"relu", "sigmoid", "tanh"}
BINARY_FUNCTIONS = {operator.add, torch.add, operator.sub, torch.sub, operator.mul, torch.mul}
BINARY_METHODS = {"add", "sub", "mul"}


class PackingError(StageError, ValueError):
    pass


class PackedMC(nn.Module):
    """The packed MC-averaged network: input [B, ...] -> mean over the M samples of their softmaxes."""

    def __init__(self, graph_module: fx.GraphModule, m: int):
        super().__init__()
        self.net = graph_module
        self.mc_samples = m

    def forward(self, x):
        return self.net(x)


def _fold_batch_norm(sample: nn.Module) -> fx.GraphModule:
    try:
        traced = fx.symbolic_trace(copy.deepcopy(sample).eval())
    except Exception as e:  # fx tracing failed: data-dependent control flow and the like
        raise PackingError(f"cannot trace the posterior sample with torch.fx ({type(e).__name__}: {e}); "
                           f"export it with export.layout: unrolled") from None
    calls = [n.target for n in traced.graph.nodes if n.op == "call_module"]
    if len(calls) != len(set(calls)):
        # A layer called twice (shared weights): fx's fuse would fold a batch norm that follows one call into
        # the layer itself, changing the other call too. Keep batch norms as per-channel affine maps instead.
        return traced
    return fuse(traced)


class _Packer:
    """Rewrites the traced graph of sample 0 into the packed graph over all M samples."""

    def __init__(self, traced: list, example: torch.Tensor):
        self.traced, self.m = traced, len(traced)
        self.modules = [dict(t.named_modules()) for t in traced]
        ShapeProp(traced[0]).propagate(example[:1].clone())
        self.root = nn.Module()
        self.graph = fx.Graph()
        self.env = {}  # node of sample 0's graph -> (node of the packed graph, layout)
        self.n_constants = 0

    # -- helpers -------------------------------------------------------------------------------
    def shape(self, node):
        """Per-sample shape of a node's value at batch 1 (from shape propagation)."""
        meta = node.meta.get("tensor_meta")
        if meta is None or not hasattr(meta, "shape"):
            raise PackingError(f"operation {node.format_node()} does not produce one tensor")
        return tuple(meta.shape)

    def constant(self, tensor, hint):
        name = f"{hint.replace('.', '_')}_{self.n_constants}"
        self.n_constants += 1
        self.root.register_buffer(name, tensor.detach().clone().contiguous())
        return self.graph.get_attr(name)

    def call(self, fn, *args):
        return self.graph.call_function(fn, tuple(args))

    def method(self, name, *args):
        return self.graph.call_method(name, tuple(args))

    def per_sample(self, node, attr):
        """The tensor `attr` of the module called by `node`, in each of the M samples."""
        mods = [mods[node.target] for mods in self.modules]
        return [getattr(mod, attr) for mod in mods]

    def as_features(self, value, shape):
        """A FEATURE_MAPS value as [B, M*F] (CHANNELS); any other value unchanged."""
        node, have = value
        if have != FEATURE_MAPS:
            return value
        return self.method("reshape", node, -1, self.m * shape[1]), CHANNELS

    def lift(self, value, shape):
        """The value in the CHANNELS layout: a shared value is replicated per sample (rarely needed)."""
        node, have = self.as_features(value, shape)
        if have == CHANNELS:
            return node
        return self.method("repeat", node, 1, self.m, *([1] * (len(shape) - 2)))

    # -- per operation ---------------------------------------------------------------------------
    def conv2d(self, node, x):
        mod = self.modules[0][node.target]
        if mod.padding_mode != "zeros":
            raise PackingError(f"{node.target}: Conv2d padding_mode {mod.padding_mode!r} is not supported")
        weight = self.constant(torch.cat(self.per_sample(node, "weight")), node.target + ".weight")
        bias = None
        if mod.bias is not None:
            bias = self.constant(torch.cat(self.per_sample(node, "bias")), node.target + ".bias")
        # The shared input feeds all M samples: one convolution with M times the outputs, original groups.
        groups = mod.groups if x[1] == SHARED else self.m * mod.groups
        return self.call(F.conv2d, x[0], weight, bias, mod.stride, mod.padding, mod.dilation, groups), CHANNELS

    def linear(self, node, x):
        in_shape = self.shape(node.args[0])
        if len(in_shape) != 2:
            raise PackingError(f"{node.target}: Linear on a {len(in_shape)}-D input is not supported "
                               f"(flatten to [batch, features] first)")
        weights, biases = self.per_sample(node, "weight"), self.per_sample(node, "bias")
        bias = None if biases[0] is None else self.constant(torch.cat(biases), node.target + ".bias")
        if x[1] == SHARED:  # one matmul with M*out outputs: [B, M*out], sample-major
            return self.call(F.linear, x[0], self.constant(torch.cat(weights), node.target + ".weight"), bias), CHANNELS
        # [B, M*in, 1, 1] -> grouped 1x1 convolution -> [B, M*out, 1, 1]
        weight = self.constant(torch.cat(weights)[:, :, None, None], node.target + ".weight")
        h = x[0] if x[1] == FEATURE_MAPS else self.method("reshape", x[0], -1, self.m * in_shape[1], 1, 1)
        return self.call(F.conv2d, h, weight, bias, 1, 0, 1, self.m), FEATURE_MAPS

    def batch_norm(self, node, x):
        """A batch norm that could not be folded: y = x * scale + shift per channel (eval statistics)."""
        shape = self.shape(node.args[0])
        mods = [mods[node.target] for mods in self.modules]
        if any(mod.training or mod.running_mean is None for mod in mods):
            raise PackingError(f"{node.target}: batch norm needs running statistics (eval mode)")
        scales, shifts = [], []
        for mod in mods:
            scale = torch.rsqrt(mod.running_var + mod.eps)
            if mod.weight is not None:
                scale = scale * mod.weight
            shift = -mod.running_mean * scale + (mod.bias if mod.bias is not None else 0)
            scales.append(scale)
            shifts.append(shift)
        h = self.lift(x, shape)
        view = (1, -1, *([1] * (len(shape) - 2)))
        scale, shift = torch.cat(scales).view(view), torch.cat(shifts).view(view)
        y = self.call(operator.mul, h, self.constant(scale, node.target + ".scale"))
        return self.call(operator.add, y, self.constant(shift, node.target + ".shift")), CHANNELS

    def flatten(self, node, x, start_dim):
        shape = self.shape(node.args[0])
        if start_dim % len(shape) != 1:
            raise PackingError(f"{node.format_node()}: only flatten from dimension 1 (per example) is supported")
        # Sample m's channels are contiguous, so its C*H*W features are too: a plain flatten, or when a
        # Linear reads it, one reshape straight to the [B, M*F, 1, 1] that the Linear's convolution takes.
        if x[1] == CHANNELS and len(shape) > 2 and all(self._feeds_linear(user) for user in node.users):
            features = self.m * math.prod(shape[1:])
            return self.method("reshape", x[0], -1, features, 1, 1), FEATURE_MAPS
        return self.call(torch.flatten, x[0], 1), x[1]

    def _feeds_linear(self, node):
        return node.op == "call_module" and isinstance(self.modules[0][node.target], nn.Linear)

    def cat(self, node, tensors, dim):
        shapes = [self.shape(t) for t in tensors]
        dim = dim % len(shapes[0])
        values = [self.env[t] for t in tensors]
        if dim == 0:
            raise PackingError(f"{node.format_node()}: concatenation along the batch dimension is not supported")
        if all(layout == SHARED for _, layout in values):
            return self.call(torch.cat, [n for n, _ in values], dim), SHARED
        # [B, M*C, ...]: view each as [B, M, C, ...], concatenate per sample, view back.
        parts = [self.method("reshape", self.lift(v, s), -1, self.m, *s[1:])
                 for v, s in zip(values, shapes)]
        out_shape = self.shape(node)
        joined = self.call(torch.cat, parts, dim + 1)
        return self.method("reshape", joined, -1, self.m * out_shape[1], *out_shape[2:]), CHANNELS

    def binary(self, node, a, b):
        """x + y, x - y, x * y: elementwise, so only the two layouts must agree."""
        operands = [(self.env[v], self.shape(v)) if isinstance(v, fx.Node) else (None, v) for v in (a, b)]
        layouts = {value[1] for value, _ in operands if value is not None}
        if layouts == {FEATURE_MAPS}:  # e.g. a residual connection between Linears: both are [B, M*F, 1, 1]
            return self.call(self._binary_function(node), *[v if value is None else value[0]
                                                            for value, v in operands]), FEATURE_MAPS
        target = SHARED if layouts == {SHARED} else CHANNELS
        args = [s if value is None else value[0] if target == SHARED else self.lift(value, s) for value, s in operands]
        return self.call(self._binary_function(node), *args), target

    @staticmethod
    def _binary_function(node):
        return (operator.add if node.target in (operator.add, torch.add, "add") else
                operator.sub if node.target in (operator.sub, torch.sub, "sub") else operator.mul)

    def unsupported(self, node, what):
        raise PackingError(f"the packed MC layout does not support {what} ({node.format_node()}); supported: "
                           f"Conv2d, Linear, BatchNorm, elementwise activations, pooling, flatten, add/sub/mul, "
                           f"cat. Use export.layout: unrolled for this network")

    # -- the rewrite -----------------------------------------------------------------------------
    def rewrite(self, node):
        arg = node.args[0] if node.args else None
        x = self.env.get(arg) if isinstance(arg, fx.Node) else None
        if node.op == "call_module":
            mod = self.modules[0][node.target]
            if isinstance(mod, nn.Conv2d):
                return self.conv2d(node, x)
            if isinstance(mod, nn.Linear):
                return self.linear(node, x)
            if isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d)):
                return self.batch_norm(node, x)
            if isinstance(mod, nn.Flatten):
                if mod.end_dim not in (-1, len(self.shape(arg)) - 1):
                    self.unsupported(node, "Flatten with an end_dim")
                return self.flatten(node, x, mod.start_dim)
            if isinstance(mod, ELEMENTWISE_MODULES + CHANNELWISE_MODULES):
                if isinstance(mod, CHANNELWISE_MODULES) and len(self.shape(arg)) != 4:
                    self.unsupported(node, "pooling over features")
                name = f"{node.target.replace('.', '_')}_{self.n_constants}"
                self.n_constants += 1
                self.root.add_module(name, copy.deepcopy(mod))
                return self.graph.call_module(name, (x[0],)), x[1]
            self.unsupported(node, f"module {type(mod).__name__}")
        if node.op == "call_function":
            if node.target in ELEMENTWISE_FUNCTIONS or (node.target in CHANNELWISE_FUNCTIONS and len(self.shape(arg)) == 4):
                return self.graph.call_function(node.target, (x[0], *node.args[1:]), dict(node.kwargs)), x[1]
            if node.target is torch.flatten:
                if node.kwargs.get("end_dim", node.args[2] if len(node.args) > 2 else -1) not in (-1,):
                    self.unsupported(node, "flatten with an end_dim")
                return self.flatten(node, x, node.kwargs.get("start_dim", node.args[1] if len(node.args) > 1 else 0))
            if node.target in BINARY_FUNCTIONS and not node.kwargs:
                return self.binary(node, *node.args)
            if node.target is torch.cat:
                dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
                return self.cat(node, list(arg), dim)
            self.unsupported(node, f"function {getattr(node.target, '__name__', node.target)}")
        if node.op == "call_method":
            if node.target in ELEMENTWISE_METHODS and len(node.args) == 1:
                return self.method(node.target, x[0]), x[1]
            if node.target in BINARY_METHODS and len(node.args) == 2 and not node.kwargs:
                return self.binary(node, *node.args)
            if node.target == "flatten":
                return self.flatten(node, x, node.kwargs.get("start_dim", node.args[1] if len(node.args) > 1 else 0))
            self.unsupported(node, f"method .{node.target}()")
        self.unsupported(node, f"a {node.op} node")

    def build(self) -> PackedMC:
        graph0 = self.traced[0].graph
        for node in graph0.nodes:
            if node.op == "placeholder":
                if self.env:
                    raise PackingError("the posterior sample must take exactly one input")
                self.env[node] = (self.graph.placeholder("input"), SHARED)
            elif node.op == "output":
                out = node.args[0]
                if not isinstance(out, fx.Node) or len(self.shape(out)) != 2:
                    raise PackingError("the posterior sample must return one [batch, classes] tensor of logits")
                if self.env[out][1] == SHARED:
                    raise PackingError("the network output does not depend on the posterior sample")
                classes = self.shape(out)[1]
                logits = self.method("reshape", self.env[out][0], -1, self.m, classes)  # [B, M, classes]
                probs = self.call(torch.softmax, logits, -1)
                self.graph.output(self.method("mean", probs, 1))
            elif node.op == "get_attr":
                self.unsupported(node, "a tensor attribute used directly")
            else:
                self.env[node] = self.rewrite(node)
        self.graph.lint()
        return PackedMC(fx.GraphModule(self.root, self.graph), self.m).eval()


def _check_same_architecture(traced):
    shapes0 = [(name, tuple(p.shape)) for name, p in traced[0].state_dict().items()]
    ops0 = [(n.op, str(n.target)) for n in traced[0].graph.nodes]
    for i, t in enumerate(traced[1:], start=1):
        if [(n.op, str(n.target)) for n in t.graph.nodes] != ops0 or \
                [(name, tuple(p.shape)) for name, p in t.state_dict().items()] != shapes0:
            raise PackingError(f"posterior sample {i} has another architecture than sample 0: "
                               f"the packed layout needs the same kept widths in every sample")


@torch.no_grad()
def pack_samples(samples, example: torch.Tensor, atol: float = 1e-5) -> PackedMC:
    """The packed MC-averaged network of `samples` (plain modules of one architecture, logits out).

    `example` (a batch of inputs, [B, ...]) drives shape propagation and the equality check against the
    unrolled MC average; a packed graph that differs by more than `atol` is refused.
    """
    from edgebayes.export.compress import MCAverage

    samples = list(samples)
    if not samples:
        raise PackingError("no posterior samples to pack")
    traced = [_fold_batch_norm(s) for s in samples]
    _check_same_architecture(traced)
    packed = _Packer(traced, example).build()
    gap = float((packed(example) - MCAverage(samples).eval()(example)).abs().max())
    if not gap <= atol:
        raise PackingError(f"the packed graph differs from the unrolled MC average by {gap:.2e} > {atol:.0e}")
    return packed


def mc_graph(mc_model, layout: str, example: torch.Tensor) -> nn.Module:
    """The MC-averaged module to export in `layout` ('packed' or 'unrolled') from an MCAverage."""
    if layout == "unrolled":
        return mc_model.eval()
    if layout == "packed":
        if len(mc_model.samples) == 1:
            # One sample: nothing to pack. The plain graph runs Gemms where the packed one runs 1x1
            # convolutions and reshapes, 1.1-1.6x slower in onnxruntime (export_packed_latency.md, M = 1).
            return mc_model.eval()
        return pack_samples(mc_model.samples, example)
    raise ValueError(f"unknown MC layout {layout!r}; expected one of {LAYOUTS}")
