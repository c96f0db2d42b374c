"""Packed layout of the MC-averaged graph: the M posterior samples run as one network.

`MCAverage` (compress.py) is the *unrolled* layout: M copies of the network side by side, each layer
run M times. The M samples share one architecture (the kept widths of the knob value) and differ only in
their weights, so each layer can instead run all M samples in one operator call:

    Conv2d       one grouped convolution: the M weight tensors concatenated along the output channels,
                 groups = M x the original groups; the activations are [B, M*C, H, W], sample m's
                 channels at m*C .. (m+1)*C. The first convolution reads the shared input, so it needs
                 no grouping and no replicated input: one convolution with M*C outputs.
    BatchNorm    folded into the Conv2d / Linear before it (eval statistics) when that layer is called
                 once and feeds only the batch norm (`_fold_batch_norms`); any other batch norm (after a
                 concatenation, an addition, a layer with shared weights) stays one BatchNormalization
                 over the M*C channels and is listed in `PackedMC.unfolded_batch_norms` with the reason.
    Linear       features are laid out like channels, [B, M*F]: a Linear is a grouped 1x1 convolution
                 (groups = M) on [B, M*F, 1, 1]. Its output stays [B, M*out, 1, 1] (FEATURE_MAPS) through
                 activations into the next Linear, and a flatten, reshape or spatial mean feeding a Linear
                 goes straight to [B, M*F, 1, 1]: each reshape is one more operator call, the cost packing
                 exists to cut. The first Linear reads the shared input and is one matmul with M*out
                 outputs. (A batched matmul over [M, B, F] was 3x slower in onnxruntime 1.31, whose fused
                 batched MatMul has no fast path for it, and its int8 kernel refuses it.)
                 A Linear on tokens, [B, T, F] per sample (a transformer's MLP), is one batched matmul:
                 [B, M, T, F] @ [M, F, out] -> [B, M*T, out] (every sample's T rows are a real GEMM).
    activations, pooling, spatial reductions (mean/amax/amin/sum over dimensions >= 2)
                 unchanged: they act per element or per channel.
    add/sub/mul  elementwise; operands broadcasting over the channel dimension (an attention map
                 [B, 1, H, W] times [B, C, H, W]) are viewed as [B, M, C, ...] first. Squeeze-and-
                 excitation's [B, M*C, 1, 1] x [B, M*C, H, W] broadcasts as it is.
    reshapes     flatten(1), view/reshape keeping the batch dimension (x.view(x.size(0), -1),
                 x.reshape(x.shape[0], -1), x.view(-1, F)), squeeze/unsqueeze off the batch dimension: sample
                 m's values are contiguous in every layout, so any per-example reshape [B, C, ...] ->
                 [B, C', ...] is the reshape [B, M*C, ...] -> [B, M*C', ...]. x.size()/x.shape are accepted
                 only as the shape of such a reshape or of a new per-example tensor (x.shape[0] in
                 class_token.expand(x.shape[0], -1, -1)), never as a number in arithmetic.
    cat          channel concatenation per sample: [B, M, C1, ...] and [B, M, C2, ...] -> [B, M, C1+C2, ...].
    output       [B, M*K] -> [B, M, K]: the mean over M of the softmaxes, exactly as MCAverage.
    anything else that acts on each example alone (a LayerNorm, attention, a transpose, a class token
                 expanded to the batch size) and whose weights are the same in every sample (the
                 deterministic parts of a posterior sample): run as written on the samples folded into the
                 batch, [B*M, ...] (`_Packer.per_example`); a tensor attribute read directly (a class token,
                 a layer scale, a LayerNorm2d's weight) is then a constant of the graph.

The graph is built generically: torch.fx traces sample 0 (after batch-norm folding), shapes are
propagated on an example input, and each call is replaced by its packed version, the weights taken
from the same layer of every sample. Anything not in the table above is refused with a PackingError
naming the operation. `pack_samples` checks on the example input that the packed graph computes the
unrolled MC average.
"""

import builtins
import collections
import copy
import inspect
import math
import operator

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.nn.utils.fusion import fuse_conv_bn_eval, fuse_linear_bn_eval

from edgebayes.errors import StageError

LAYOUTS = ("packed", "unrolled")

# Where a value of the packed graph keeps its M samples.
SHARED = "shared"      # does not depend on the sample (the network input, and what only it feeds)
CHANNELS = "channels"  # [B, M*C, ...]: sample m's channels (or features) at m*C .. (m+1)*C
FEATURE_MAPS = "feature maps"  # per-sample [B, F] features held as [B, M*F, 1, 1], as a grouped 1x1 conv makes them
SIZE = "size"          # an x.size() / x.shape value: no node until an operation needs it (`size_of`)
BATCHED = "batched"    # [B*M, ...]: the samples folded into the batch, sample m of example b at row b*M + m
CONSTANT = "constant"  # a tensor attribute, the same in every sample: no batch dimension, used as it is

# Parameter-free modules and functions acting per element or per channel: they keep the layout.
ELEMENTWISE_MODULES = (nn.ReLU, nn.ReLU6, nn.SiLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU,
                       nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Softplus, nn.Mish, nn.Identity,
                       nn.Dropout)
CHANNELWISE_MODULES = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)
ELEMENTWISE_FUNCTIONS = {F.relu, torch.relu, F.relu6, torch.sigmoid, F.sigmoid, torch.tanh, F.tanh, F.silu,
                         F.gelu, F.leaky_relu, F.elu, F.hardswish, F.hardsigmoid, F.hardtanh, F.softplus, F.mish,
                         F.dropout}
CHANNELWISE_FUNCTIONS = {F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d, F.adaptive_max_pool2d}
ELEMENTWISE_METHODS = {"relu", "sigmoid", "tanh"}
BINARY_FUNCTIONS = {operator.add, torch.add, operator.sub, torch.sub, operator.mul, torch.mul,
                    operator.iadd, operator.isub, operator.imul}
BINARY_METHODS = {"add", "sub", "mul"}
REDUCTIONS = {torch.mean: "mean", torch.amax: "amax", torch.amin: "amin", torch.sum: "sum"}
RESHAPE_METHODS = {"view", "reshape"}
# Operations that take sizes as the shape of a new per-example tensor (a class token expanded to the batch)
SHAPE_METHODS = {"expand", "repeat", "new_zeros", "new_ones", "new_empty", "new_full"}
SHAPE_FUNCTIONS = {torch.zeros, torch.ones, torch.empty, torch.full}
FOLDABLE = ((nn.Conv2d, nn.BatchNorm2d), (nn.Linear, nn.BatchNorm1d))  # (layer, batch norm that folds into it)


class PackingError(StageError, ValueError):
    pass


class _PerExample(PackingError):
    """An operation with no channel-layout rule that acts on each example alone: `_Packer.per_example`."""


class PackedMC(nn.Module):
    """The packed MC-averaged network: input [B, ...] -> mean over the M samples of their softmaxes.

    `folded_batch_norms` names the batch norms folded into the layer before them, `unfolded_batch_norms`
    the others as {"node", "reason"}: each is one more BatchNormalization per call in the exported graph.
    """

    def __init__(self, graph_module: fx.GraphModule, m: int, folded=(), unfolded=()):
        super().__init__()
        self.net = graph_module
        self.mc_samples = m
        self.folded_batch_norms = list(folded)
        self.unfolded_batch_norms = list(unfolded)

    def forward(self, x):
        return self.net(x)


def _trace(sample: nn.Module) -> fx.GraphModule:
    """The sample's forward as torch.fx traces it, called with its input alone: the forward's other parameters
    that have defaults (`forward(x, temperature=None)`) are traced at those defaults, as export calls it. Traced
    as proxies instead, `temperature is None` is False while tracing and the graph divides by None."""
    sample = copy.deepcopy(sample).eval()
    parameters = list(inspect.signature(sample.forward).parameters.values())[1:]
    defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty
                and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)}
    try:
        traced = fx.symbolic_trace(sample, concrete_args=defaults or None)
        if defaults:   # fx guards each default it specialised on (torch._assert nodes): the graph takes x alone
            guards = (torch._assert, fx._symbolic_trace._assert_is_none)
            for node in reversed(list(traced.graph.nodes)):
                if node.op == "call_function" and node.target in guards:
                    traced.graph.erase_node(node)
            traced.graph.eliminate_dead_code()
            for node in [n for n in traced.graph.nodes if n.op == "placeholder"][1:]:
                if not node.users:
                    traced.graph.erase_node(node)
            traced.recompile()
        return traced
    except Exception as e:  # fx tracing failed: data-dependent control flow and the like
        raise PackingError(f"cannot trace the posterior sample with torch.fx ({type(e).__name__}: {e}); "
                           f"export it with export.layout: unrolled") from None


def _describe(node) -> str:
    if node.op == "call_module":
        return f"{node.target} ({type(node.graph.owning_module.get_submodule(node.target)).__name__})"
    if node.op == "placeholder":
        return "the network input"
    return f"{node.name} ({getattr(node.target, '__name__', node.target)})"


def _why_not_foldable(node, modules, calls):
    """None when the batch norm called by `node` can be folded into the layer before it, else why not.

    Folding rewrites that layer's weights, which is exact only when the layer's output goes nowhere else
    and the layer runs nowhere else: a layer called twice (shared weights) would change at its other call
    too. A parameter-free module called twice (one self.relu used throughout) changes nothing and does not
    matter. The batch norm itself is left untouched, so it may be shared.
    """
    bn = modules[node.target]  # in eval mode: _trace traces an eval copy
    if bn.running_mean is None or bn.running_var is None:
        return "no running statistics (track_running_stats=False)"
    if len(node.args) != 1 or node.kwargs:
        return "called with more than its input"
    prev = node.args[0]
    if not isinstance(prev, fx.Node) or prev.op != "call_module" or \
            not any(isinstance(modules[prev.target], layer) and isinstance(bn, norm) for layer, norm in FOLDABLE):
        what = _describe(prev) if isinstance(prev, fx.Node) else repr(prev)
        return f"follows {what}, not a Conv2d (BatchNorm2d) or Linear (BatchNorm1d)"
    layer = modules[prev.target]
    if calls[prev.target] > 1:
        return f"{prev.target} is called {calls[prev.target]} times (shared weights)"
    if len(prev.users) > 1:
        others = ", ".join(u.name for u in prev.users if u is not node)
        return f"the output of {prev.target} also feeds {others}"
    width = layer.out_channels if isinstance(layer, nn.Conv2d) else layer.out_features
    if bn.num_features != width:
        return f"{bn.num_features} features after {prev.target}'s {width} outputs"
    return None


def _fold_batch_norms(traced: fx.GraphModule, enabled: bool = True):
    """Folds each batch norm into the Conv2d / Linear before it where that is exact (`_why_not_foldable`).
    enabled=False folds none (onnx-codebook: a folded convolution's K levels become K x C_out values).

    torch.fx's `fuse` folds all or, with any module called twice, wrongly; this decides per batch norm.
    Returns (traced, names of the folded batch-norm nodes, [{"node", "reason"}] of the others).
    """
    modules = dict(traced.named_modules())
    calls = collections.Counter(n.target for n in traced.graph.nodes if n.op == "call_module")
    folded, unfolded = [], []
    for node in list(traced.graph.nodes):
        if node.op != "call_module" or not isinstance(modules[node.target], nn.modules.batchnorm._BatchNorm):
            continue
        reason = _why_not_foldable(node, modules, calls) if enabled else "kept apart: codebook weights"
        if reason is not None:
            unfolded.append({"node": node.name, "reason": reason})
            continue
        prev = node.args[0]
        layer, bn = modules[prev.target], modules[node.target]
        fused = fuse_conv_bn_eval(layer, bn) if isinstance(layer, nn.Conv2d) else fuse_linear_bn_eval(layer, bn)
        parent, _, name = prev.target.rpartition(".")
        setattr(traced.get_submodule(parent) if parent else traced, name, fused)
        modules[prev.target] = fused
        node.replace_all_uses_with(prev)
        traced.graph.erase_node(node)
        folded.append(node.name)
    traced.graph.lint()
    traced.delete_all_unused_submodules()
    traced.recompile()
    return traced, folded, unfolded


def _eval_identities():
    """Functions that are the identity in eval mode, called with training=False (4th argument)."""
    try:
        from torchvision.ops import stochastic_depth  # optional dependency (the `vision` extra)
    except ImportError:
        return set()
    return {stochastic_depth}


def _arg(node, index, name, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


class _Packer:
    """Rewrites the traced graph of sample 0 into the packed graph over all M samples."""

    def __init__(self, traced: list, example: torch.Tensor):
        self.traced, self.m = traced, len(traced)
        self.modules = [dict(t.named_modules()) for t in traced]
        try:
            ShapeProp(traced[0]).propagate(example[:1].clone())
        except Exception as e:   # the traced graph does not run on the example: refused, exported unrolled
            raise PackingError(f"the posterior sample's torch.fx graph does not run on the example "
                               f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        self.root = nn.Module()
        self.graph = fx.Graph()
        self.env = {}  # node of sample 0's graph -> (node of the packed graph, layout)
        self.sizes = {}  # size/shape node of sample 0's graph -> (tensor node, dimension or tuple of dimensions)
        self.sample_major = {}  # node of sample 0's graph -> its packed value viewed as [B, M, C, ...] (for cat)
        self.reshaped_from = {}  # per-example reshape node of sample 0's graph -> the node it reshapes (no reshape)
        self.eval_identities = _eval_identities()
        self.n_constants = 0
        self.batched_views = {}  # node of sample 0's graph -> its packed value as [B*M, ...] (per_example)

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

    def adaptive_avg_pool(self, arg, x, output_size):
        """adaptive_avg_pool2d at the graph's static size as the avg_pool2d it is where the output size divides the
        input size, else None. The TorchScript ONNX exporter loses H and W of a packed value behind a
        reshape(-1, ...) under the dynamic batch (a per-sample concatenation's), and its adaptive_avg_pool2d to more
        than 1x1 needs them: 'input size not accessible'."""
        h, w = self.shape(arg)[-2:]
        oh, ow = (output_size, output_size) if isinstance(output_size, int) else tuple(output_size)
        oh, ow = oh or h, ow or w
        if h % oh or w % ow:
            return None
        return self.call(F.avg_pool2d, x[0], (h // oh, w // ow)), x[1]

    def call(self, fn, *args, **kwargs):
        return self.graph.call_function(fn, tuple(args), kwargs)

    def method(self, name, *args, **kwargs):
        return self.graph.call_method(name, tuple(args), kwargs)

    def per_sample(self, node, attr):
        """The tensor `attr` of the module called by `node`, in each of the M samples."""
        mods = [mods[node.target] for mods in self.modules]
        return [getattr(mod, attr) for mod in mods]

    def same_in_every_sample(self, node):
        """Whether the module called by `node` has the same parameters and buffers in all M samples (none, or
        the deterministic layers of a posterior sample: a LayerNorm, an attention block)."""
        states = [mods[node.target].state_dict() for mods in self.modules]
        return all(torch.equal(t, other[name]) for other in states[1:] for name, t in states[0].items())

    def attribute(self, node):
        """A tensor attribute read directly (get_attr): a constant of the packed graph where it is the same in
        every sample, else refused (its per-sample layout would need a rule of its own)."""
        values = [operator.attrgetter(node.target)(t) for t in self.traced]
        if not isinstance(values[0], torch.Tensor):
            self.unsupported(node, f"the attribute {node.target} of type {type(values[0]).__name__}")
        if any(not torch.equal(values[0], v) for v in values[1:]):
            self.unsupported(node, f"the tensor attribute {node.target} read directly, which differs between the "
                                   f"posterior samples")
        return self.constant(values[0], node.target), CONSTANT

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

    def packed_shape(self, value, shape):
        """Shape after the batch dimension that a value of per-sample `shape` has in the packed graph."""
        if value[1] == SHARED:
            return tuple(shape[1:])
        if value[1] == FEATURE_MAPS:
            return (self.m * shape[1], 1, 1)
        return (self.m * shape[1], *shape[2:])

    def by_sample(self, node):
        """The packed value of `node` viewed as [B, M, C, ...] (sample m at [:, m]); one view per node."""
        if node not in self.sample_major:
            shape = self.shape(node)
            value = self.env[node]
            h = value[0] if value[1] == FEATURE_MAPS else self.lift(value, shape)  # FEATURE_MAPS: same memory order
            self.sample_major[node] = self.method("reshape", h, -1, self.m, *shape[1:])
        return self.sample_major[node]

    def batched(self, node):
        """The packed value of `node` with the samples folded into the batch: [B*M, ...] (BATCHED). Sample m's
        values are contiguous in every layout, so it is one reshape; a shared value is repeated per sample."""
        value, layout = self.env[node]
        if layout in (BATCHED, CONSTANT):
            return value
        if layout == SIZE:
            return self.size_of(node)
        if not hasattr(node.meta.get("tensor_meta"), "shape"):
            return value   # a number computed from sizes (vit's h // patch): the same for every sample
        if node not in self.batched_views:
            shape = self.shape(node)
            if layout == SHARED:
                value = self.method("expand", self.method("unsqueeze", value, 1), -1, self.m, *shape[1:])
            self.batched_views[node] = self.method("reshape", value, -1, *shape[1:])
        return self.batched_views[node]

    def size_of(self, node, folded=True):
        """A SIZE value as a node: the sizes of its tensor with the samples folded into the batch, or of the
        shared tensor as it is (folded=False)."""
        tensor, dims = self.sizes[node]
        value, layout = self.env[tensor]
        if folded and layout == SHARED:   # B*M rows of the shared shape, without materialising them (`batched`)
            def size(d):
                return self.call(operator.mul, self.method("size", value, 0), self.m) if d == 0 else \
                    self.method("size", value, d)
        else:
            h = self.batched(tensor) if folded else value
            def size(d):
                return self.method("size", h, d)
        return size(dims) if isinstance(dims, int) else tuple(size(d) for d in dims)

    def per_example(self, node):
        """Any operation that acts on each example alone, without weights or with the same weights in every
        sample (a transpose, a channel slice, chunk, x[:, :, None, None], expand, a reduction over channels, a
        channel shuffle's views, a LayerNorm, attention, a class token, a layer scale): run as written on
        the samples folded into the batch, [B*M, ...], which is each sample's own computation. Whether it
        really is per example is checked by pack_samples (packed against unrolled, on the example batch)."""
        values = [self.env[a][1] for a in node.all_input_nodes]
        if all(layout in (SHARED, SIZE, CONSTANT) for layout in values) and \
                all(self.env[self.sizes[a][0]][1] == SHARED for a in node.all_input_nodes if a in self.sizes):
            convert, layout = (lambda a: self.size_of(a, folded=False) if a in self.sizes else self.env[a][0]), SHARED
        else:
            convert, layout = self.batched, BATCHED
        args, kwargs = fx.node.map_arg(node.args, convert), fx.node.map_arg(node.kwargs, convert)
        if node.op == "call_module":
            name = f"{node.target.replace('.', '_')}_{self.n_constants}"
            self.n_constants += 1
            self.root.add_module(name, copy.deepcopy(self.modules[0][node.target]))
            return self.graph.call_module(name, args, kwargs), layout
        return self.graph.create_node(node.op, node.target, args, kwargs), layout

    def rewrite_any(self, node):
        """The packed value of `node`: by the rule for its operation (`rewrite`), or per example."""
        inputs = node.all_input_nodes
        if inputs and all(self.env[a][1] == CONSTANT for a in inputs):   # arithmetic on constants
            return self.graph.node_copy(node, lambda a: self.env[a][0]), CONSTANT
        if any(self.env[a][1] == CONSTANT for a in inputs):   # no rule reads a constant operand
            return self.per_example(node)
        size_ops = self._is_view(node) or (node.op == "call_function" and node.target is operator.getitem
                                           and inputs and inputs[0] in self.sizes)
        if not size_ops and any(not hasattr(a.meta.get("tensor_meta"), "shape") for a in inputs):
            return self.per_example(node)   # arithmetic on sizes, a number or tuple passed to an operation
        for a in inputs:
            if self.env[a][1] == BATCHED:
                meta = a.meta.get("tensor_meta")
                if not hasattr(meta, "shape") or len(meta.shape) < 2 or \
                        (node.op == "call_function" and node.target is operator.getitem):
                    return self.per_example(node)
                # back to [B, M*C, ...]: the operation has a rule of its own
                self.env[a] = self.method("reshape", self.env[a][0], -1, self.m * meta.shape[1], *meta.shape[2:]), CHANNELS
        try:
            return self.rewrite(node)
        except _PerExample:
            return self.per_example(node)

    def only_feeds_linears(self, node):
        """Whether every use of `node` reaches a Linear through elementwise operations only."""
        def elementwise(user):
            if user.args[:1] != (node,):
                return False
            if user.op == "call_module":
                return isinstance(self.modules[0][user.target], ELEMENTWISE_MODULES)
            if user.op == "call_function":
                return user.target in ELEMENTWISE_FUNCTIONS or user.target in self.eval_identities
            return user.op == "call_method" and user.target in ELEMENTWISE_METHODS

        return bool(node.users) and all(
            (user.op == "call_module" and isinstance(self.modules[0][user.target], nn.Linear))
            or (elementwise(user) and self.only_feeds_linears(user)) for user in node.users)

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
        if len(in_shape) < 2:
            raise PackingError(f"{node.target}: Linear on a 1-D input (no batch dimension) is not supported")
        weights, biases = self.per_sample(node, "weight"), self.per_sample(node, "bias")
        if len(in_shape) > 2:
            return self.linear_on_rows(node, x, in_shape, weights, biases)
        bias = None if biases[0] is None else self.constant(torch.cat(biases), node.target + ".bias")
        if x[1] == SHARED:  # one matmul with M*out outputs: [B, M*out], sample-major
            return self.call(F.linear, x[0], self.constant(torch.cat(weights), node.target + ".weight"), bias), CHANNELS
        # [B, M*in, 1, 1] -> grouped 1x1 convolution -> [B, M*out, 1, 1]
        weight = self.constant(torch.cat(weights)[:, :, None, None], node.target + ".weight")
        h = x[0] if x[1] == FEATURE_MAPS else self.method("reshape", x[0], -1, self.m * in_shape[1], 1, 1)
        return self.call(F.conv2d, h, weight, bias, 1, 0, 1, self.m), FEATURE_MAPS

    def linear_on_rows(self, node, x, in_shape, weights, biases):
        """A Linear on [B, T, ..., F] per sample (a transformer's tokens): one batched matmul,
        [B, M, T*..., F] @ [M, F, out] (+ bias [M, 1, out]) -> [B, M*T, ..., out] (CHANNELS): each sample's rows
        are one GEMM with its own weights. A shared input is viewed as [B, 1, T*..., F] and broadcast."""
        rows, features = math.prod(in_shape[1:-1]), in_shape[-1]
        if x[1] == SHARED:
            h = self.method("reshape", x[0], -1, 1, rows, features)
        else:
            h = self.method("reshape", self.lift(x, in_shape), -1, self.m, rows, features)
        weight = self.constant(torch.stack([w.t() for w in weights]), node.target + ".weight")   # [M, F, out]
        out = self.call(torch.matmul, h, weight)
        if biases[0] is not None:
            out = self.call(operator.add, out, self.constant(torch.stack(biases)[:, None, :], node.target + ".bias"))
        out_shape = self.shape(node)
        return self.method("reshape", out, -1, self.m * out_shape[1], *out_shape[2:]), CHANNELS

    def batch_norm(self, node, x):
        """A batch norm that could not be folded: one batch norm over the M*C channels (eval statistics).

        One BatchNormalization node in ONNX, where the equivalent x * scale + shift is two (Mul, Add), each
        a pass over the tensor: ten BatchNormalization+Relu on [32, 512, 8, 8] took 1.8 ms against 4.5 ms as
        Mul+Add+Relu (onnxruntime 1.31, one thread). A FEATURE_MAPS value [B, M*F, 1, 1] is normalised as it
        is (channel dimension 1).
        """
        shape = self.shape(node.args[0])
        mods = [mods[node.target] for mods in self.modules]
        if any(mod.training or mod.running_mean is None for mod in mods):
            raise PackingError(f"{node.target}: batch norm needs running statistics (eval mode)")
        eps = mods[0].eps
        mean = torch.cat([mod.running_mean for mod in mods])
        var = torch.cat([mod.running_var + (mod.eps - eps) for mod in mods])  # one eps for all M samples
        weight = torch.cat([mod.weight if mod.weight is not None else torch.ones_like(mod.running_mean)
                            for mod in mods])
        bias = torch.cat([mod.bias if mod.bias is not None else torch.zeros_like(mod.running_mean) for mod in mods])
        h, layout = (x[0], x[1]) if x[1] in (CHANNELS, FEATURE_MAPS) else (self.lift(x, shape), CHANNELS)
        hint = node.target
        return self.call(F.batch_norm, h, self.constant(mean, hint + ".mean"), self.constant(var, hint + ".var"),
                         self.constant(weight, hint + ".weight"), self.constant(bias, hint + ".bias"),
                         False, 0.0, eps), layout

    def reshape(self, node, x):
        """A per-example reshape: [B, C, ...] -> [B, C', ...] per sample is [B, M*C, ...] -> [B, M*C', ...].

        The output's shape comes from shape propagation; only whether dimension 0 stays the batch is read off
        the arguments: it must be the batch size (x.size(0), x.shape[0]) or -1 with the other sizes fixed.
        Reading into a Linear, the result is laid out as the [B, M*F, 1, 1] the Linear's convolution takes.
        A reshape of a reshape (x.squeeze(-1).squeeze(-1)) reshapes the first one's input once; the first
        one, if nothing else reads it, is dropped with the dead code.
        """
        out = self.shape(node)
        if len(out) < 2 or out[0] != 1:
            self.unsupported(node, "a reshape that does not keep the batch dimension")
        if x[1] == SHARED:
            return self.method("reshape", x[0], -1, *out[1:]), SHARED
        source = self.reshaped_from.get(node.args[0], node.args[0])
        self.reshaped_from[node] = source
        x = self.env[source]
        current = self.packed_shape(x, self.shape(source))
        if len(out) == 2 and self.only_feeds_linears(node):
            target, layout = (self.m * out[1], 1, 1), FEATURE_MAPS
        else:
            target, layout = (self.m * out[1], *out[2:]), CHANNELS
        if current == target:  # e.g. pooled [B, M*C, 1, 1] flattened for a Linear: nothing to do
            return x[0], layout
        return self.method("reshape", x[0], -1, *target), layout

    def view(self, node, x, sizes):
        """x.view(...) / x.reshape(...) / torch.reshape(x, ...) with `sizes` the shape arguments."""
        if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, fx.Node)):
            sizes = sizes[0]
        if isinstance(sizes, fx.Node):  # x.view(y.size())
            sizes = (sizes,)
        dims = []  # ("size", d): dimension d of some value (d == 0: the batch size), ("fixed", n): a literal
        for s in sizes:
            if isinstance(s, int):
                dims.append(("fixed", s))
            elif isinstance(s, fx.Node) and s in self.sizes:
                d = self.sizes[s][1]
                dims.extend(("size", i) for i in (d if isinstance(d, tuple) else (d,)))
            else:
                self.unsupported(node, f"a reshape to a computed size {s}", per_example=True)
        if dims[0] != ("size", 0) and dims[0] != ("fixed", -1):
            self.unsupported(node, "a reshape whose first dimension is not the batch size (x.size(0) or -1)")
        if ("size", 0) in dims[1:]:
            self.unsupported(node, "a reshape that moves the batch dimension")
        return self.reshape(node, x)

    def size_value(self, node, tensor, dims):
        """x.size(), x.size(d), x.shape, x.shape[d]: kept aside (no node) for the reshape that reads it.

        The batch size is the one size that differs between the example and the deployed graph (and B*M
        where the samples are folded into the batch): a size that includes it is accepted only as the shape
        of a reshape (which reads it as the batch: `view`) or of a new tensor per example (a class token
        expanded to x.shape[0], run per example on the folded sizes, B*M: `size_of`), never as a number in
        arithmetic. Other sizes are per example: an operation that needs one reads it off the value.
        """
        has_batch = 0 in (dims if isinstance(dims, tuple) else (dims,))
        for user in node.users if has_batch else ():
            ok = (user.op == "call_function" and user.target is operator.getitem and user.args[0] is node) or \
                 (self._is_view(user) and user.args[0] is not node) or \
                 (user.op == "call_method" and user.target in SHAPE_METHODS and user.args[0] is not node) or \
                 (user.op == "call_function" and user.target in SHAPE_FUNCTIONS)
            if not ok:
                raise PackingError(f"the packed MC layout takes {node.name} = {_describe_size(node)} only as the shape "
                                   f"of a view/reshape or of a new tensor, not in {user.format_node()}. Use "
                                   f"export.layout: unrolled for this network")
        self.sizes[node] = (tensor, dims)
        return None, SIZE

    @staticmethod
    def _is_view(node):
        return (node.op == "call_method" and node.target in RESHAPE_METHODS) or \
               (node.op == "call_function" and node.target is torch.reshape)

    def flatten(self, node, x, start_dim, end_dim=-1):
        shape = self.shape(node.args[0])
        if start_dim % len(shape) == 0:
            self.unsupported(node, "a flatten of the batch dimension")
        if start_dim % len(shape) != 1 or end_dim % len(shape) != len(shape) - 1:
            self.unsupported(node, "a flatten of some dimensions", per_example=True)
        # Sample m's channels are contiguous, so its C*H*W features are too: a plain flatten, or when a
        # Linear reads it, one reshape straight to the [B, M*F, 1, 1] that the Linear's convolution takes.
        if len(shape) == 2:  # already [B, F]
            return x
        if x[1] == SHARED:
            return self.call(torch.flatten, x[0], 1), SHARED
        if self.only_feeds_linears(node) or node.args[0] in self.reshaped_from:
            return self.reshape(node, x)
        return self.call(torch.flatten, x[0], 1), CHANNELS  # CHANNELS: FEATURE_MAPS are 2-D per sample

    def squeeze(self, node, x, dim, unsqueeze):
        rank = len(self.shape(node)) if unsqueeze else len(self.shape(node.args[0]))
        dims = dim if isinstance(dim, (tuple, list)) else (dim,)
        if dim is None or any(not isinstance(d, int) or d % rank == 0 for d in dims):
            self.unsupported(node, "a squeeze/unsqueeze that may touch the batch dimension")
        return self.reshape(node, x)

    def reduce(self, node, x, op, dim, keepdim):
        """mean/amax/amin/sum over dimensions >= 2 (spatial): per channel, so the layout is unchanged.

        [B, M*C, H, W] -> [B, M*C] (CHANNELS), or [B, M*C, 1, 1] with keepdim. A mean over (2, 3) that only
        feeds Linears keeps its dims: [B, M*C, 1, 1] is what the Linear's grouped convolution reads.
        """
        shape = self.shape(node.args[0])
        dims = dim if isinstance(dim, (tuple, list)) else (dim,)
        if dim is None or not all(isinstance(d, int) for d in dims):
            self.unsupported(node, f"{op} without explicit dimensions")
        dims = tuple(sorted(d % len(shape) for d in dims))
        if dims[0] < 2:
            self.unsupported(node, f"{op} over the batch or channel/feature dimension", per_example=dims[0] == 1)
        if x[1] == SHARED:
            return self.method(op, x[0], dims, keepdim=keepdim), SHARED
        h = self.lift(x, shape)
        if not keepdim and len(shape) == 4 and dims == (2, 3) and self.only_feeds_linears(node):
            return self.method(op, h, dims, keepdim=True), FEATURE_MAPS
        return self.method(op, h, dims, keepdim=keepdim), CHANNELS

    def cat(self, node, tensors, dim):
        shapes = [self.shape(t) for t in tensors]
        dim = dim % len(shapes[0])
        values = [self.env[t] for t in tensors]
        if dim == 0:
            raise PackingError(f"{node.format_node()}: concatenation along the batch dimension is not supported")
        if all(layout == SHARED for _, layout in values):
            return self.call(torch.cat, [n for n, _ in values], dim), SHARED
        # [B, M*C, ...]: view each as [B, M, C, ...], concatenate per sample, view back. A densely connected
        # block concatenates each output many times: its [B, M, C, ...] view is made once (by_sample).
        out_shape = self.shape(node)
        joined = self.call(torch.cat, [self.by_sample(t) for t in tensors], dim + 1)
        return self.method("reshape", joined, -1, self.m * out_shape[1], *out_shape[2:]), CHANNELS

    def binary(self, node, a, b):
        """x + y, x - y, x * y: elementwise, so the two layouts must agree.

        Operands of one per-sample shape, or broadcasting only over dimensions >= 2 (squeeze-and-excitation:
        [B, C, 1, 1] * [B, C, H, W]), combine as they are: the packed channel dimension is M*C on both sides.
        One broadcasting over the channel dimension ([B, 1, H, W] * [B, C, H, W]) would pair M with M*C, so
        both sides are viewed as [B, M, C, ...] for the operation.
        """
        fn = self._binary_function(node)
        operands = [(self.env[v], self.shape(v)) if isinstance(v, fx.Node) else (None, v) for v in (a, b)]
        tensors = [(value, s) for value, s in operands if value is not None]
        layouts = {value[1] for value, _ in tensors}
        if layouts == {SHARED}:
            return self.call(fn, *[s if value is None else value[0] for value, s in operands]), SHARED
        if len(tensors) == 2:
            (_, sa), (_, sb) = tensors
            if len(sa) != len(sb):
                self.unsupported(node, f"broadcasting between a {len(sa)}-D and a {len(sb)}-D value", per_example=True)
            if sa[1] != sb[1]:
                out = self.shape(node)
                joined = self.call(fn, self.by_sample(a), self.by_sample(b))
                return self.method("reshape", joined, -1, self.m * out[1], *out[2:]), CHANNELS
        if layouts == {FEATURE_MAPS}:  # e.g. a residual connection between Linears: both are [B, M*F, 1, 1]
            return self.call(fn, *[s if value is None else value[0] for value, s in operands]), FEATURE_MAPS
        return self.call(fn, *[s if value is None else self.lift(value, s) for value, s in operands]), CHANNELS

    @staticmethod
    def _binary_function(node):
        return (operator.add if node.target in (operator.add, operator.iadd, torch.add, "add") else
                operator.sub if node.target in (operator.sub, operator.isub, torch.sub, "sub") else operator.mul)

    def unsupported(self, node, what, per_example=False):
        """Refuse `node`; per_example=True when the operation acts on each example alone, so that it can run
        on the samples folded into the batch instead (`per_example`)."""
        raise (_PerExample if per_example else PackingError)(
            f"the packed MC layout does not support {what} ({node.format_node()}); supported: "
                           f"Conv2d, Linear, BatchNorm, elementwise activations, pooling, spatial mean/amax, "
                           f"per-example flatten/view/reshape, add/sub/mul, cat, and what acts on each example "
                           f"alone with the same weights in every sample. Use export.layout: unrolled for this "
                           f"network")

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
                return self.flatten(node, x, mod.start_dim, mod.end_dim)
            if isinstance(mod, nn.AdaptiveAvgPool2d) and len(self.shape(arg)) == 4:
                lowered = self.adaptive_avg_pool(arg, x, mod.output_size)
                if lowered is not None:
                    return lowered
            if isinstance(mod, ELEMENTWISE_MODULES + CHANNELWISE_MODULES):
                if isinstance(mod, CHANNELWISE_MODULES) and len(self.shape(arg)) != 4:
                    self.unsupported(node, "pooling over features", per_example=True)
                name = f"{node.target.replace('.', '_')}_{self.n_constants}"
                self.n_constants += 1
                mod = copy.deepcopy(mod)
                if getattr(mod, "inplace", False):
                    mod.inplace = False  # the packed graph's reshapes may alias or copy where the sample's did not
                self.root.add_module(name, mod)
                return self.graph.call_module(name, (x[0],)), x[1]
            same = self.same_in_every_sample(node)
            self.unsupported(node, f"module {type(mod).__name__}" + ("" if same else " whose weights differ between "
                             "the posterior samples"), per_example=same)
        if node.op == "call_function":
            if node.target is F.adaptive_avg_pool2d and len(self.shape(arg)) == 4:
                lowered = self.adaptive_avg_pool(arg, x, _arg(node, 1, "output_size"))
                if lowered is not None:
                    return lowered
            if node.target in ELEMENTWISE_FUNCTIONS or \
                    (node.target in CHANNELWISE_FUNCTIONS and len(self.shape(arg)) == 4):
                kwargs = {k: v for k, v in node.kwargs.items() if k != "inplace"}
                return self.graph.call_function(node.target, (x[0], *node.args[1:]), kwargs), x[1]
            if node.target in self.eval_identities:
                if _arg(node, 3, "training", True) is not False:
                    self.unsupported(node, "a random operation in training mode")
                return x
            if node.target is torch.flatten:
                return self.flatten(node, x, _arg(node, 1, "start_dim", 0), _arg(node, 2, "end_dim", -1))
            if node.target is torch.reshape:
                return self.view(node, x, (_arg(node, 1, "shape"),))
            if node.target in (torch.squeeze, torch.unsqueeze):
                return self.squeeze(node, x, _arg(node, 1, "dim"), node.target is torch.unsqueeze)
            if node.target in REDUCTIONS and set(node.kwargs) <= {"dim", "keepdim"} and len(node.args) <= 3:
                return self.reduce(node, x, REDUCTIONS[node.target], _arg(node, 1, "dim"),
                                   _arg(node, 2, "keepdim", False))
            if node.target is builtins.getattr and node.args[1] == "shape":
                return self.size_value(node, arg, tuple(range(len(self.shape(arg)))))
            if node.target is operator.getitem and arg in self.sizes:
                tensor, dims = self.sizes[arg]
                return self.size_value(node, tensor, dims[node.args[1]])
            if node.target in BINARY_FUNCTIONS and not node.kwargs:
                return self.binary(node, *node.args)
            if node.target is torch.cat:
                return self.cat(node, list(arg), _arg(node, 1, "dim", 0))
            self.unsupported(node, f"function {getattr(node.target, '__name__', node.target)}", per_example=True)
        if node.op == "call_method":
            if node.target in ELEMENTWISE_METHODS and len(node.args) == 1:
                return self.method(node.target, x[0]), x[1]
            if node.target in BINARY_METHODS and len(node.args) == 2 and not node.kwargs:
                return self.binary(node, *node.args)
            if node.target == "flatten":
                return self.flatten(node, x, _arg(node, 1, "start_dim", 0), _arg(node, 2, "end_dim", -1))
            if node.target in RESHAPE_METHODS:
                return self.view(node, x, node.args[1:] or (node.kwargs.get("shape"),))
            if node.target in ("squeeze", "unsqueeze"):
                return self.squeeze(node, x, _arg(node, 1, "dim"), node.target == "unsqueeze")
            if node.target in REDUCTIONS.values() and set(node.kwargs) <= {"dim", "keepdim"} and len(node.args) <= 3:
                return self.reduce(node, x, node.target, _arg(node, 1, "dim"), _arg(node, 2, "keepdim", False))
            if node.target == "size":
                dim = _arg(node, 1, "dim")
                rank = len(self.shape(arg))
                return self.size_value(node, arg, tuple(range(rank)) if dim is None else dim % rank)
            self.unsupported(node, f"method .{node.target}()", per_example=True)
        self.unsupported(node, f"a {node.op} node")

    def build(self, folded=(), unfolded=(), temperature=1.0) -> PackedMC:
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
                if self.env[out][1] in (SHARED, CONSTANT):
                    raise PackingError("the network output does not depend on the posterior sample")
                classes = self.shape(out)[1]
                logits = self.method("reshape", self.env[out][0], -1, self.m, classes)  # [B, M, classes]
                if temperature != 1.0:   # as MCAverage: every sample's logits times 1 / T
                    logits = self.call(operator.mul, logits, 1.0 / temperature)
                probs = self.call(torch.softmax, logits, -1)
                self.graph.output(self.method("mean", probs, 1))
            elif node.op == "get_attr":
                self.env[node] = self.attribute(node)
            else:
                self.env[node] = self.rewrite_any(node)
        module = fx.GraphModule(self.root, self.graph)
        module.graph.eliminate_dead_code()  # reshapes that a later reshape replaced
        module.graph.lint()
        module.recompile()
        return PackedMC(module, self.m, folded, unfolded).eval()


def _describe_size(node) -> str:
    if node.op == "call_method":
        return f"{node.args[0]}.size({', '.join(map(str, node.args[1:]))})"
    if node.target is builtins.getattr:
        return f"{node.args[0]}.shape"
    return f"{_describe_size(node.args[0])}[{node.args[1]}]"


def _check_same_architecture(traced):
    shapes0 = [(name, tuple(p.shape)) for name, p in traced[0].state_dict().items()]
    ops0 = [(n.op, str(n.target)) for n in traced[0].graph.nodes]
    for i, t in enumerate(traced[1:], start=1):
        if [(n.op, str(n.target)) for n in t.graph.nodes] != ops0 or \
                [(name, tuple(p.shape)) for name, p in t.state_dict().items()] != shapes0:
            raise PackingError(f"posterior sample {i} has another architecture than sample 0: "
                               f"the packed layout needs the same kept widths in every sample")


@torch.no_grad()
def pack_samples(samples, example: torch.Tensor, atol: float = 1e-5, temperature: float = 1.0,
                 fold_batch_norms: bool = True) -> PackedMC:
    """The packed MC-averaged network of `samples` (plain modules of one architecture, logits out), each
    sample's logits divided by `temperature` before its softmax (MCAverage).

    `example` (a batch of inputs, [B, ...]) drives shape propagation and the equality check against the
    unrolled MC average; a packed graph that differs by more than `atol` is refused (on an ill-conditioned
    network: by more than atol plus the unrolled fp32's own error, both measured from float64; fp32_agreement).
    """
    from edgebayes.compressed.samples import MCAverage, fp32_agreement

    samples = list(samples)
    if not samples:
        raise PackingError("no posterior samples to pack")
    folds = [_fold_batch_norms(_trace(s), fold_batch_norms) for s in samples]
    traced = [t for t, _, _ in folds]
    _check_same_architecture(traced)
    packed = _Packer(traced, example).build(folds[0][1], folds[0][2], temperature)
    unrolled = MCAverage(samples, temperature).eval()
    with torch.no_grad():
        agreement = fp32_agreement(packed(example), unrolled(example), unrolled, example, atol)
    if not agreement["passed"]:
        gap, exact = agreement["max_abs_diff"], agreement.get("max_abs_diff_float64")
        raise PackingError(f"the packed graph differs from the unrolled MC average by {gap:.2e} > {atol:.0e}"
                           + ("" if exact is None else f" (from float64: {exact:.2e}, the unrolled fp32's own "
                                                       f"{agreement['torch_fp32_error']:.2e})"))
    return packed


# What the unrolled layout costs where packing was refused (benchmarks/results/export_packed_latency.md,
# onnxruntime, batch 1, 1 and 2 threads): at M = 8 the packed graph took 0.27x-0.89x of the unrolled one's time.
UNROLLED_COST = ("the unrolled layout runs each layer M times: at M = 8 the packed layout took 0.27-0.89x its "
                 "latency in onnxruntime on the nets measured (benchmarks/results/export_packed_latency.md)")


def mc_graph(mc_model, layout: str, example: torch.Tensor, fallback=None, fold_batch_norms: bool = True) -> nn.Module:
    """The MC-averaged module to export in `layout` ('packed' or 'unrolled') from an MCAverage.

    fallback: called with the reason when the packed layout refuses the network (a PackingError), which is
    then exported unrolled; without it the PackingError propagates."""
    if layout == "unrolled":
        return mc_model.eval()
    if layout == "packed":
        if len(mc_model.samples) == 1:
            # One sample: nothing to pack. The plain graph runs Gemms where the packed one runs 1x1
            # convolutions and reshapes, slower in onnxruntime (benchmarks/results/export_packed_latency.md, M = 1).
            return mc_model.eval()
        try:
            return pack_samples(mc_model.samples, example, temperature=mc_model.temperature,
                                fold_batch_norms=fold_batch_norms)
        except PackingError as e:
            if fallback is None:
                raise
            fallback(str(e))
            return mc_model.eval()
    raise ValueError(f"unknown MC layout {layout!r}; expected one of {LAYOUTS}")
