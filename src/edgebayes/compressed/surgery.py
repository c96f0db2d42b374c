"""Structural surgery: physically remove dead units and channels from a plain module.

Input: a plain module (nn.Linear, nn.Conv2d, nn.BatchNorm2d, activations, pooling, flatten, residual
additions, concatenation, depthwise convolutions, squeeze-and-excitation products: whatever Torch-Pruning
can trace; the zoo, a user's network, torchvision classifiers), a "dead units" description {qualified name
of a Linear / Conv2d: boolean mask of its kept outputs} and an example input. Output: a smaller module
with the same outputs (to float rounding).

Structural knowledge lives in Torch-Pruning's dependency graph: for the dead outputs of a layer it gives
the group of coupled channels, the layers that write them (a residual stream has one writer per block; a
depthwise channel and the channel that feeds it are one group; a squeeze-and-excitation scale is
multiplied in) and the layers that read them (across batch norm, additions, concatenation and the flatten
from a convolution to a linear layer, with the index mapping each implies). Removing a group changes
nothing exactly when every Linear / Conv2d that reads one of its channels gets nothing from it:

  1. the reader's weights on that channel are zero (a dead depthwise channel: the producer channel that
     feeds only it goes with it), or
  2. the channel is zero where it is read, or
  3. the channel is one constant c where it is read and the reader takes W c into its bias: a Linear
     (after a flatten, each of the channel's features is such a constant), or a Conv2d without padding
     (a padded convolution sees zeros at the border, so its output is not W c + b there). That is a dead
     convolution behind a batch norm with a shift (beta - gamma mu / sigma) or behind an activation with
     f(0) != 0.

Writers need no condition of their own: a live writer's channel that nothing reads with a non-zero weight
does no work that survives. "Constant where read" is measured, not assumed (`probe_inputs`): a channel is
constant only if it takes one value over the batch and every position of a random probe and of a second
batch in which everything that depends on the input is driven to large values of both signs, so a live
unit that happens to be inactive on the probe cannot pass for a constant. Channels the rules do not cover
stay: read by a grouped convolution, normalized together with other channels (GroupNorm / LayerNorm), a
residual stream channel that another block writes, a constant read by a padded convolution, the last
channel of a layer.

`report`, when a dict is passed, receives per layer of `dead_units` how many dead channels were removed
and, for those that stay, why (`format_report` prints it). A final check compares the pruned module with
the original on the probe and on a fresh batch; every failure (Torch-Pruning's included) is a
SurgeryError that names the layer.
"""

import copy
from collections import Counter

import torch
import torch_pruning as tp
from torch import nn
from torch.overrides import TorchFunctionMode
from torch_pruning.dependency.index_mapping import _ConcatIndexMapping

from edgebayes.errors import StageError

AFFINE = (nn.Linear, nn.Conv2d)
_CAT = (torch.cat, torch.concat, torch.concatenate)
_MIXING_NORMS = (nn.GroupNorm, nn.LayerNorm)  # statistics over several channels: a channel cannot go
_PER_CHANNEL = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm, nn.PReLU)
_CONSTANT_RTOL = 1e-5  # rounding of a constant through an average pool that divides different counts


class SurgeryError(StageError, ValueError):
    pass


def _is_depthwise(m):
    return isinstance(m, nn.Conv2d) and m.groups > 1 and m.groups == m.out_channels == m.in_channels


def _channel_dim(m, rank):
    return 1 if isinstance(m, nn.Conv2d) else rank - 1


def _live_rows(m):
    return m.weight.detach().flatten(1).abs().sum(1) > 0


def _pads(m):
    """Whether a layer reads zeros beyond the border (then a constant input is not a bias)."""
    if isinstance(m, nn.Linear):
        return False
    if isinstance(m.padding, str):
        return m.padding == "same" and any(d * (k - 1) for d, k in zip(m.dilation, m.kernel_size))
    return any(m.padding)


def _mixes_channels(m):
    """A traced node with weights that surgery has no rule for (Conv1d, Embedding, attention, a bare
    parameter). Batch norm, instance norm and PReLU act per channel; Torch-Pruning's own nodes (additions,
    products, concatenation, reshapes, activations) move channels without mixing them."""
    if isinstance(m, nn.Parameter):
        return True
    return (isinstance(m, nn.Module) and any(True for _ in m.parameters(recurse=False))
            and not isinstance(m, _PER_CHANNEL))


# --------------------------------------------------------------------------------------------------
# Probing: which input channels of each Linear / Conv2d are one constant whatever the input, and which.
@torch.no_grad()
def probe_inputs(module: nn.Module, probe: torch.Tensor, names: dict = None) -> dict:
    """{Linear/Conv2d: (lo, hi, value)}, each a tensor over the layer's input channels (input features of
    a Linear); `constant(ranges, k)` reads it.

    Run A is the probe batch. Run B is a second batch in which every output channel of every Linear /
    Conv2d with a non-zero weight on an input channel found varying so far (the network input varies) is
    replaced by random values of magnitude 1 to 2 times (1 + the layer's largest output in run A),
    positive on even and negative on odd examples. Whatever depends on the input then moves, even where a
    unit was inactive on the whole probe (a ReLU unit off for every probe example is on for half of run
    B), while what only constants feed (dead units' biases, batch-norm shifts, zeros, f(0)) is computed as
    in run A. Replacing rather than adding keeps magnitudes at run A's scale through deep networks, so
    nothing overflows (an inf times a zero weight would be NaN, not the zero it is). lo / hi cover both
    runs, over the batch and every position; value is run A's.
    """
    names = names if names is not None else {m: n for n, m in module.named_modules()}
    lo, hi, value, scale = {}, {}, {}, {}
    gen = torch.Generator().manual_seed(1)

    def extremes(m, x):
        dims = [d for d in range(x.dim()) if d != _channel_dim(m, x.dim())]
        return x.amin(dim=dims), x.amax(dim=dims)

    def hook_a(m, inputs, out):
        a, b = extremes(m, inputs[0])
        lo[m] = a if m not in lo else torch.minimum(lo[m], a)
        hi[m] = b if m not in hi else torch.maximum(hi[m], b)
        value[m] = b
        scale[m] = max(scale.get(m, 0.0), float(out.abs().max()))

    def hook_b(m, inputs, out):
        a, b = extremes(m, inputs[0])
        lo[m], hi[m] = torch.minimum(lo[m], a), torch.maximum(hi[m], b)
        rows = _rows_reading(m, ~_constant_mask(lo[m], hi[m]))
        shape = [1] * out.dim()
        shape[_channel_dim(m, out.dim())] = -1
        sign = torch.ones(out.shape[0], dtype=out.dtype)
        sign[1::2] = -1
        sign = sign.view([-1] + [1] * (out.dim() - 1))
        jitter = 1 + torch.rand(out.shape, generator=gen, dtype=out.dtype)
        return torch.where(rows.view(shape), (1 + scale.get(m, 0.0)) * sign * jitter, out)

    shaken = 3 * torch.randn(probe.shape, generator=gen)
    for hook, x in ((hook_a, probe), (hook_b, shaken)):
        handles = [m.register_forward_hook(hook) for m in module.modules() if isinstance(m, AFFINE)]
        try:
            _run(module, x, names, "probing")
        finally:
            for h in handles:
                h.remove()
    return {m: (lo[m], hi[m], value[m]) for m in lo}


def _constant_mask(lo, hi):
    return torch.isfinite(lo) & torch.isfinite(hi) & (hi - lo <= _CONSTANT_RTOL * torch.maximum(lo.abs(), hi.abs()))


def _rows_reading(m, varying):
    """Output channels of m with a non-zero weight on a varying input channel (of their group)."""
    if isinstance(m, nn.Linear):
        return ((m.weight != 0) & varying[None, :]).any(1)
    nonzero = m.weight.flatten(2).abs().sum(2) > 0  # [out, in / groups]
    per_output = varying.view(m.groups, -1).repeat_interleave(m.out_channels // m.groups, dim=0)
    return (nonzero & per_output).any(1)


def constant(ranges, k):
    """(True, c) when input channel k took the single value c in both probe runs, else (False, None)."""
    lo, hi, value = (t[k: k + 1] for t in ranges)
    return (True, value[0]) if bool(_constant_mask(lo, hi)) else (False, None)


def _run(module, x, names, what):
    """module(x); an exception becomes a SurgeryError naming the submodule that was running."""
    entered = []
    handles = [m.register_forward_pre_hook(lambda m, _: entered.append(m)) for m in module.modules()]
    try:
        return module(x)
    except Exception as e:
        where = next((names[m] for m in reversed(entered) if names.get(m)), "the module")
        raise SurgeryError(f"surgery ({what}): {where!r} fails on an input of shape {tuple(x.shape)}: "
                           f"{type(e).__name__}: {e}") from e
    finally:
        for h in handles:
            h.remove()


# --------------------------------------------------------------------------------------------------
# Concatenation. Torch-Pruning (1.6) infers a concatenation's offsets from its inputs' channel counts and
# checks them against the channel count of the layer that reads it; when that count comes through a
# flatten into a Linear (cat -> pool -> flatten -> Linear) it is C * H * W, not C, the check fails, and it
# leaves the offsets unset: a channel of the second input is then mapped to the same index of the first
# input (an IndexError, or a wrong cut that the final check refuses). The concatenations are recorded
# while it traces, so their dimension and sizes are known, and their index mapping is set here from those
# sizes, kept current by Torch-Pruning's own bookkeeping of `concat_sizes` as channels go.
class _CatRecorder(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.cats = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _CAT and isinstance(out, torch.Tensor) and out.grad_fn is not None:
            tensors = args[0] if args else kwargs["tensors"]
            dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % out.dim()
            self.cats[out.grad_fn] = (dim, out.dim(), [t.shape[dim] for t in tensors])
        return out


def _own_concats(graph, cats):
    """Take over the index mapping of every concatenation along the channel dimension."""
    owned = []
    for node in graph.module2node.values():
        if node.type != tp.ops.OPTYPE.CONCAT or node.grad_fn not in cats:
            continue
        dim, rank, sizes = cats[node.grad_fn]
        fns = [f for f, _ in node.grad_fn.next_functions]
        if dim != (1 if rank in (2, 4) else rank - 1) or len(fns) != len(sizes):
            continue  # along batch or space: a channel index is the same in every input
        segment = {}
        for k, f in enumerate(fns):
            matches = {n for n in node.inputs if f is not None and n.grad_fn is f}
            if len(matches) > 1 or matches & segment.keys():
                segment = None  # the same tensor twice: one channel in two places, no mapping says so
                break
            segment.update({n: k for n in matches})
        if segment is not None:
            node.enable_index_mapping = False  # Torch-Pruning's own update then leaves the mappings alone
            node.module.concat_sizes = list(sizes)
            owned.append((node, segment))
    return owned


def _map_concats(owned):
    for node, segment in owned:
        offsets = [0]
        for size in node.module.concat_sizes:
            offsets.append(offsets[-1] + size)
        for in_node, k in segment.items():
            for dep in node.dependencies:
                if dep.target is in_node:
                    dep.index_mapping[1] = _ConcatIndexMapping(offset=offsets[k: k + 2], reverse=True)
            for dep in in_node.dependencies:
                if dep.target is node:
                    dep.index_mapping[1] = _ConcatIndexMapping(offset=offsets[k: k + 2], reverse=False)


# --------------------------------------------------------------------------------------------------
@torch.no_grad()
def remove_dead_units(module: nn.Module, dead_units: dict, example_input: torch.Tensor, atol: float = 1e-5,
                      report: dict = None):
    """Return a copy of `module` with every removable dead unit / channel physically removed.

    report: a dict to fill with {layer name: {"dead": n, "removed": n, "kept": {reason: n}}} for each layer
    of `dead_units` (format_report prints it).
    """
    pruned = copy.deepcopy(module).cpu().eval()
    layers = dict(pruned.named_modules())
    names = {m: n for n, m in layers.items()}
    for name, mask in dead_units.items():
        if name not in layers or not isinstance(layers[name], AFFINE):
            raise SurgeryError(f"dead_units names {name!r}, which is not a Linear or Conv2d layer of the module")
        if mask.numel() != layers[name].weight.shape[0]:
            raise SurgeryError(f"dead_units[{name!r}] has {mask.numel()} entries for {layers[name].weight.shape[0]} outputs")

    shape = tuple(example_input.shape[1:])
    probe = torch.randn((4,) + shape, generator=torch.Generator().manual_seed(0))
    check = torch.cat([probe, torch.randn((4,) + shape, generator=torch.Generator().manual_seed(2))])
    reference = _run(pruned, check, names, "the original module")
    ranges = probe_inputs(pruned, probe, names)
    # Original index of every current output / input channel of each layer (indices shift as channels go).
    out_map = {m: torch.arange(m.weight.shape[0]) for m in pruned.modules() if isinstance(m, AFFINE)}
    in_map = {m: torch.arange(len(r[0])) for m, r in ranges.items()}

    recorder = _CatRecorder()
    try:
        with torch.enable_grad(), recorder:  # Torch-Pruning traces the graph through autograd
            graph = tp.DependencyGraph().build_dependency(pruned, example_inputs=probe[:1], verbose=False)
    except Exception as e:
        raise SurgeryError(f"Torch-Pruning cannot trace the module: {type(e).__name__}: {e}") from e
    owned = _own_concats(graph, recorder.cats)
    reasons = {}  # (layer name, original channel) -> why that dead channel stays

    dead_sets = {name: set((~mask.detach().cpu().to(torch.bool)).nonzero().flatten().tolist())
                 for name, mask in dead_units.items()}

    for name, dead in dead_sets.items():
        root = layers[name]
        candidates = [i for i, o in enumerate(out_map[root].tolist()) if o in dead]
        if candidates and root not in graph.module2node:  # e.g. an auxiliary head that eval mode skips
            reasons.update({(name, o): "not reached by the forward pass" for o in dead})
            continue
        fn = tp.prune_linear_out_channels if isinstance(root, nn.Linear) else tp.prune_conv_out_channels

        def coupled():
            _map_concats(owned)
            return graph.get_pruning_group(root, fn, candidates)

        while candidates:
            group = _tp_call(name, "find the channels coupled to", coupled)
            blocked, folds = _check_group(graph, group, names, in_map, ranges, root)
            if not blocked and not graph.check_pruning_group(group):
                blocked = {candidates[-1]: "the last channel: a layer cannot be left empty"}
            if not blocked:
                break
            for r, why in blocked.items():
                reasons[(name, int(out_map[root][r]))] = why
            candidates = [r for r in candidates if r not in blocked]
        if not candidates:
            continue
        for m, k, c in folds:
            _fold(m, k, c)
        _tp_call(name, "remove", group.prune)
        for item in group:
            m, handler = item.dep.target.module, item.dep.handler
            if m in out_map and graph.is_out_channel_pruning_fn(handler):
                out_map[m] = _drop(out_map[m], item.idxs)
            if m in in_map and graph.is_in_channel_pruning_fn(handler):
                in_map[m] = _drop(in_map[m], item.idxs)

    out = _run(pruned, check, names, "check of the pruned module")
    if out.shape != reference.shape:
        raise SurgeryError(f"surgery changed the output shape from {tuple(reference.shape)} to {tuple(out.shape)}: "
                           "the layer that produces the model's outputs cannot lose units")
    gap = float((out - reference).abs().max())
    if gap > atol * max(1.0, float(reference.abs().max())):
        raise SurgeryError(f"the pruned module's outputs differ from the original by {gap:.2e}")
    if report is not None:
        for name, dead in dead_sets.items():
            left = set(out_map[layers[name]].tolist())
            kept = Counter(reasons.get((name, o), "not examined") for o in dead if o in left)
            report[name] = {"dead": len(dead), "removed": len(dead) - sum(kept.values()), "kept": dict(kept)}
    return pruned


def _tp_call(name, what, call):
    try:
        return call()
    except SurgeryError:
        raise
    except Exception as e:
        raise SurgeryError(f"Torch-Pruning could not {what} the dead channels of {name!r}: "
                           f"{type(e).__name__}: {e}") from e


def _check_group(graph, group, names, in_map, ranges, root):
    """({root index: why it must stay}, [(reader, input index, constant to fold)]) for one group."""
    live_writers = {}  # root index -> layers that write that channel with non-zero weights, depthwise first
    for item in group:
        m = item.dep.target.module
        if isinstance(m, AFFINE) and graph.is_out_channel_pruning_fn(item.dep.handler):
            rows = _live_rows(m)
            for i, r in zip(item.idxs, item.root_idxs):
                if rows[i]:
                    writers = live_writers.setdefault(r, [])
                    writers.insert(0, m) if _is_depthwise(m) else writers.append(m)

    residual = any(isinstance(item.dep.target.module, tp.ops._ElementWiseOp)
                   and "add" in str(item.dep.target.module._grad_fn).lower() for item in group)

    def live_reason(r, reader):
        writers = live_writers.get(r, [])
        if root in writers:
            return "not dead: its weights are not zero"
        if not writers:
            return f"varies where {names[reader]} reads it"
        if _is_depthwise(writers[0]):
            return f"coupled to a live depthwise channel of {names[writers[0]]}"
        if residual:
            return f"residual stream: also written by live {names[writers[0]]}"
        return f"coupled to live {names[writers[0]]}, read by {names[reader]}"

    blocked, folds = {}, []
    for item in group:
        m, handler = item.dep.target.module, item.dep.handler
        if isinstance(m, tp.ops._OutputOp):
            raise SurgeryError(f"dead_units marks units of {names[root]!r} dead that are outputs of the model: "
                               "the layer that produces the model's outputs cannot lose units")
        label = names.get(m) or type(m).__name__
        if isinstance(m, _MIXING_NORMS):
            for r in item.root_idxs:
                blocked.setdefault(r, f"normalized together with other channels by {label}")
            continue
        if isinstance(m, nn.Conv2d) and m.groups > 1 and not _is_depthwise(m):
            for r in item.root_idxs:  # Torch-Pruning cuts a grouped convolution's weights, not its groups
                blocked.setdefault(r, f"coupled to grouped convolution {label}")
            continue
        if not graph.is_in_channel_pruning_fn(handler) or _is_depthwise(m):
            continue  # writers, batch norms, element-wise ops; a depthwise layer: its readers decide
        if not isinstance(m, AFFINE) or m not in ranges:
            for r in item.root_idxs if _mixes_channels(m) else ():
                blocked.setdefault(r, f"read by {type(m).__name__} {label}, which surgery has no rule for")
            continue
        for k, r in zip(item.idxs, item.root_idxs):
            if bool((m.weight[:, k] == 0).all()):
                continue  # the reader multiplies it by zero
            is_constant, c = constant(ranges[m], int(in_map[m][k]))
            if not is_constant:
                blocked.setdefault(r, live_reason(r, m))
            elif _pads(m) and float(c) != 0:
                blocked.setdefault(r, f"a non-zero constant (batch-norm shift, f(0) != 0) read by padded "
                                      f"convolution {label}")
            elif float(c) != 0:
                folds.append((m, k, c))
    return blocked, folds


def _fold(m, k, c):
    """Add the contribution of the constant input channel k (value c) to m's bias: exact without padding."""
    w = m.weight.detach()
    contribution = w[:, k] * c if isinstance(m, nn.Linear) else w[:, k].sum((1, 2)) * c
    if m.bias is None:
        m.bias = nn.Parameter(torch.zeros(w.shape[0], dtype=w.dtype))
    m.bias.data += contribution


def _drop(index, idxs):
    gone = torch.zeros(index.numel(), dtype=torch.bool)
    gone[list(idxs)] = True
    return index[~gone]


def format_report(report: dict) -> str:
    """remove_dead_units' report as a table: layer, dead channels, removed, and why the others stay."""
    lines = [f"{'layer':40s} {'dead':>5s} {'removed':>7s}  kept: why"]
    for name, row in report.items():
        why = "; ".join(f"{n} {reason}" for reason, n in sorted(row["kept"].items(), key=lambda kv: -kv[1]))
        lines.append(f"{name:40s} {row['dead']:5d} {row['removed']:7d}  {why}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
@torch.no_grad()
def coupled_channels(module: nn.Module, layer_names: list, example_input: torch.Tensor):
    """The output channels of `layer_names` (Linear / Conv2d names of `module`) that can only go together.

    Returns (groups, blocked): groups is a list of sets of (layer name, channel), each a group of channels
    that Torch-Pruning's dependency graph couples (the channel of a residual stream in every block that
    writes it, an expand channel and the depthwise channel it feeds) and that surgery removes only when all
    of them are dead; blocked names the layers coupled to something outside `layer_names` (a layer that is
    not listed, the model's output), whose channels cannot all go. A flops target (train/flops_target.py)
    switches such groups off whole.
    """
    layers = dict(module.named_modules())
    names = {m: n for n, m in layers.items()}
    wanted = set(layer_names)
    recorder = _CatRecorder()
    try:
        with torch.enable_grad(), recorder:
            graph = tp.DependencyGraph().build_dependency(module.eval(), example_inputs=example_input[:1],
                                                          verbose=False)
    except Exception as e:
        raise SurgeryError(f"Torch-Pruning cannot trace the module: {type(e).__name__}: {e}") from e
    owned = _own_concats(graph, recorder.cats)
    parent = {}

    def find(a):
        parent.setdefault(a, a)
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    blocked = set()
    for name in layer_names:
        root = layers[name]
        if root not in graph.module2node:
            blocked.add(name)
            continue
        fn = tp.prune_linear_out_channels if isinstance(root, nn.Linear) else tp.prune_conv_out_channels
        _map_concats(owned)
        group = _tp_call(name, "find the channels coupled to", lambda: graph.get_pruning_group(
            root, fn, list(range(root.weight.shape[0]))))
        for item in group:
            m, handler = item.dep.target.module, item.dep.handler
            if isinstance(m, tp.ops._OutputOp):
                blocked.add(name)
            elif isinstance(m, AFFINE) and graph.is_out_channel_pruning_fn(handler):
                if names.get(m) not in wanted:
                    blocked.add(name)
                    continue
                for i, r in zip(item.idxs, item.root_idxs):
                    parent[find((names[m], int(i)))] = find((name, int(r)))
            elif isinstance(m, nn.Conv2d) and m.groups > 1 and not _is_depthwise(m):
                blocked.add(name)   # surgery keeps channels a grouped convolution reads (_check_group)
    for name in layer_names:
        for c in range(layers[name].weight.shape[0]):
            find((name, c))
    groups = {}
    for unit in parent:
        groups.setdefault(find(unit), set()).add(unit)
    # a group touching a blocked layer is blocked whole
    blocked |= {n for g in groups.values() if any(n in blocked for n, _ in g) for n, _ in g}
    return list(groups.values()), blocked


_REORDERED = (nn.Linear, nn.Conv2d, nn.modules.batchnorm._BatchNorm)


@torch.no_grad()
def order_channels(module: nn.Module, importance, example_input: torch.Tensor):
    """Reorder the output channels of the Linear / Conv2d layers of `module`, in place, most important first,
    without changing its function: each group of coupled channels (a residual stream in every block that
    writes it, the readers' input channels, batch norms, a flatten's features, a concatenation's offsets)
    moves as one, as Torch-Pruning's dependency graph maps them. `importance(name, layer)` gives a score per
    output channel; a coupled group ranks by the sum of its writers' scores, each over its layer's mean.

    Nested nets keep the first channels at narrow widths (train/nested.py), so a trained network reordered
    this way keeps its strongest channels there. Each group's move is checked on a probe and undone if the
    outputs change (the model's own outputs, a module this cannot permute); a group with a grouped
    convolution or a norm over several channels keeps its order. Returns the names of the layers reordered.
    """
    layers = dict(module.named_modules())
    names = {m: n for n, m in layers.items()}
    recorder = _CatRecorder()
    try:
        with torch.enable_grad(), recorder:
            graph = tp.DependencyGraph().build_dependency(module.eval(), example_inputs=example_input[:1],
                                                          verbose=False)
    except Exception:   # an untraceable network keeps its order (surgery says why when it runs)
        return []
    owned = _own_concats(graph, recorder.cats)
    probe = torch.randn((4,) + tuple(example_input.shape[1:]), generator=torch.Generator().manual_seed(0))
    reference = module(probe)
    tolerance = 1e-5 * max(1.0, float(reference.abs().max()))
    done, reordered = set(), []
    for name, root in layers.items():
        if not isinstance(root, AFFINE) or root in done or root not in graph.module2node:
            continue
        fn = tp.prune_linear_out_channels if isinstance(root, nn.Linear) else tp.prune_conv_out_channels
        _map_concats(owned)
        try:
            group = graph.get_pruning_group(root, fn, list(range(root.weight.shape[0])))
        except Exception:
            continue
        items = [(it.dep.target.module, it.dep.handler, list(it.idxs), list(it.root_idxs)) for it in group]
        writers = [(m, idxs, roots) for m, h, idxs, roots in items
                   if isinstance(m, AFFINE) and graph.is_out_channel_pruning_fn(h)]
        done.update(m for m, _, _ in writers)
        if any(isinstance(m, (_MIXING_NORMS, tp.ops._OutputOp)) or (isinstance(m, nn.Conv2d) and m.groups > 1
               and not _is_depthwise(m)) for m, _, _, _ in items):
            continue
        score = torch.zeros(root.weight.shape[0])
        for m, idxs, roots in writers:
            s = importance(names[m], m).float()
            score.index_add_(0, torch.tensor(roots), (s / s.mean().clamp_min(1e-12))[idxs])
        perm = score.argsort(descending=True)   # new root position q holds old root channel perm[q]
        if bool((perm == torch.arange(len(perm))).all()):
            continue
        moved, seen = [], set()
        for m, handler, idxs, roots in items:
            if not isinstance(m, _REORDERED):
                continue
            dim = 1 if (graph.is_in_channel_pruning_fn(handler) and isinstance(m, AFFINE)
                        and not _is_depthwise(m)) else 0
            if (m, dim) in seen:
                continue
            seen.add((m, dim))
            at = {}   # root channel -> its positions along this module's dim, in order
            for i, r in zip(idxs, roots):
                at.setdefault(int(r), []).append(int(i))
            tensors = [t for t in (m.weight, getattr(m, "bias", None), getattr(m, "running_mean", None),
                                   getattr(m, "running_var", None)) if t is not None and t.dim() > dim]
            src = torch.arange(tensors[0].shape[dim])
            for q, old in enumerate(perm.tolist()):
                for a, b in zip(at.get(q, []), at.get(old, [])):
                    src[a] = b
            for t in tensors:
                moved.append((t, t.data))
                t.data = t.data.index_select(dim, src)
        if float((module(probe) - reference).abs().max()) > tolerance:
            for t, old in moved:   # the model's outputs, or something this cannot permute: undo
                t.data = old
        else:
            reordered += [names[m] for m, _, _ in writers]
    return reordered
