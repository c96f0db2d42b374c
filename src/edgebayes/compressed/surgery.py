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
stay: the last input of a group of a grouped convolution that still has outputs there (grouped
convolutions lose channels group by group, sizes left unequal: compressed/grouped.py), normalized together
with other channels (GroupNorm / LayerNorm), a
residual stream channel that another block writes, a constant read by a padded convolution, the last
channel of a layer, a channel that goes through a split, slice, reshape or expand that changes the
channel dimension (torch.chunk, x[:, :k], a channel shuffle: the sizes after it are in the code).

Surgery degrades, it does not fail. `report`, when a dict is passed, receives per layer of `dead_units`
how many dead channels were removed and, for those that stay, why, naming the layer or operation that
kept them (`format_report` prints it). A final check compares the pruned module with the original on the
probe and on a fresh batch; when it finds a difference (or Torch-Pruning fails inside a group), the layer
whose group causes it is found by bisection and kept, and the rest is removed. A module Torch-Pruning
cannot trace is returned masked and unpruned, the reason in the report. What remains an error is a
SurgeryError naming the layer: dead_units that do not fit the module, a module that fails on the input.
"""

import copy
import threading
import traceback
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
import torch_pruning as tp
from torch import nn
from torch.overrides import TorchFunctionMode
from torch_pruning.dependency import index_mapping as tp_index_mapping
from torch_pruning.dependency.group import Group as TPGroup
from torch_pruning.dependency.index_mapping import _ConcatIndexMapping

from edgebayes.compressed.grouped import is_depthwise, is_grouped, last_inputs, regroup, ungroup
from edgebayes.errors import StageError

AFFINE = (nn.Linear, nn.Conv2d)
_CAT = (torch.cat, torch.concat, torch.concatenate)
_MIXING_NORMS = (nn.GroupNorm, nn.LayerNorm)  # statistics over several channels: a channel cannot go
_PER_CHANNEL = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm, nn.PReLU)
_CONSTANT_RTOL = 1e-5  # rounding of a constant through an average pool that divides different counts


class SurgeryError(StageError, ValueError):
    pass


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
    a Linear); input channel k is the constant value[k] where _constant_mask(lo, hi)[k].

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


def _exact(module, x):
    """module(x) on a float64 copy, or None where the module does not run in float64 (a float32 tensor made
    inside its forward). The checks that a removal or a reordering changed nothing compare in float64: cutting
    channels that carry zeros changes the order of a convolution's sums, and a deep network trained on narrow
    inputs amplifies fp32 rounding on a random probe (efficientnet_b0 fine-tuned on MNIST: outputs of 4,408
    moved by 1.2 in fp32 when a zero channel was cut, by 1.5e-9 in float64; a 1e-7 relative change of the
    input moved them by 4.6), which a float32 check takes for a change."""
    try:
        with torch.no_grad():
            return copy.deepcopy(module).double()(x.double())
    except Exception:
        return None


# --------------------------------------------------------------------------------------------------
# What Torch-Pruning traces, recorded beside it. Torch-Pruning (1.6) infers a concatenation's offsets
# from its inputs' channel counts and checks them against the channel count of the layer that reads it;
# when that count comes through a flatten into a Linear (cat -> pool -> flatten -> Linear) it is C * H * W,
# not C, the check fails, and it leaves the offsets unset: a channel of the second input is then mapped to
# the same index of the first input (an IndexError, or a wrong cut that the final check refuses). The
# concatenations are recorded while it traces, so their dimension and sizes are known, and their index
# mapping is set here from those sizes, kept current by Torch-Pruning's own bookkeeping of `concat_sizes`
# as channels go. The input and output shapes of every other operation are recorded too: a group of
# channels that passes through a split, slice, reshape or expand which changes the channel dimension
# (torch.chunk / split, x[:, :k], a channel shuffle's view, [B, 1, H, W].expand(...)) cannot lose channels,
# because the sizes on the other side are fixed in the network's code (`_channel_op_reason`).
class _Recorder(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.cats, self.shapes = {}, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
        if not outs or outs[0].grad_fn is None:
            return out
        if func in _CAT:
            tensors = args[0] if args else kwargs["tensors"]
            dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % out.dim()
            self.cats[out.grad_fn] = (dim, out.dim(), [t.shape[dim] for t in tensors])
        source = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if source is not None and outs[0].grad_fn not in self.shapes:
            self.shapes[outs[0].grad_fn] = (getattr(func, "__name__", str(func)), tuple(source.shape),
                                            [tuple(t.shape) for t in outs])
        return out


_SHAPE_OPS = ("SPLIT", "SLICE", "UNBIND", "RESHAPE", "EXPAND")


def _channel_op_reason(node, recorder):
    """Why channels cannot go through this Torch-Pruning node (a split, slice, reshape, expand), or None
    when it keeps the channel dimension (a spatial slice, [B, C, 1, 1] -> [B, C], an expand over space)
    or is the flatten [B, C, ...] -> [B, C * ...] whose index mapping Torch-Pruning keeps."""
    if node.type.name not in _SHAPE_OPS:
        return None
    recorded = recorder.shapes.get(node.grad_fn)
    if recorded is None:   # made inside an operator (F.linear's views): Torch-Pruning's mapping, and the check
        return None
    op, source, outs = recorded
    if len(source) >= 2 and all(len(o) >= 2 and o[0] == source[0] and o[1] == source[1] for o in outs):
        return None
    flat = 1
    for d in source[1:]:
        flat *= d
    if node.type.name == "RESHAPE" and len(outs) == 1 and outs[0] == (source[0], flat):
        return None
    return (f"{op} from {list(source)} to {', '.join(str(list(o)) for o in outs)}: the channel sizes after it are "
            f"fixed in the network's code")


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


_MAX_MAPPED = 1 << 21   # channel indices one index mapping may make (_patched_torch_pruning)
_TP_HAS_PRUNING_OP = TPGroup.has_pruning_op   # Torch-Pruning's own, which _covered_by_group asks first
# Held while Torch-Pruning is patched: a second thread's surgery would otherwise take the first one's patches
# for Torch-Pruning's originals and put them back for good when it ends (re-entrant, so that one thread may
# nest the patch).
_PATCH_LOCK = threading.RLock()
_MAPPING_UPDATES = ("update_concat_index_mapping", "update_split_index_mapping", "update_reshape_index_mapping",
                    "update_unbind_index_mapping", "update_expand_index_mapping", "update_slice_index_mapping")


@contextmanager
def _patched_torch_pruning(failed: dict):
    """Torch-Pruning as surgery runs it, patched for the duration of one surgery (the module-level functions
    and methods are what Torch-Pruning looks up). The patches are the process's: surgeries in threads of one
    process take turns (_PATCH_LOCK), and other Torch-Pruning work in another thread meanwhile sees them.
    Three changes:

    Tolerant: its index-mapping updates, each of which may raise on a shape it does not expect (a
    channel shuffle's view: ZeroDivisionError in update_reshape_index_mapping, which made torchvision's
    shufflenet untraceable), run per node: a node whose update fails is recorded in `failed` with the
    error, and every group through it keeps its channels.

    Bounded: a flatten's index mapping multiplies a channel's indices by the features per channel, and
    where reshapes chain (swin_t's windows: x32, x32, x32) the group search built 33 million indices and took
    24 GB before the machine killed it. A mapping that would make more than _MAX_MAPPED indices raises instead,
    so the group is not found and its channels stay, with the reason (_remove's "could not find the channels
    coupled to them"); a flatten of a whole feature map into a Linear stays far below it.

    Each coupling followed once: the group search (DependencyGraph.get_pruning_group) goes on from a
    dependency it reaches again unless it brings exactly the index list of an earlier visit
    (Group.has_pruning_op). Through channel shuffles (view, transpose, view) the same channels come back in
    ever new lists, and the search went round torchvision's shufflenet_v2_x0_5 for 53 s for one layer's
    group (one surgery 37 s at 32x32; a nested width search runs several). Here it stops where every
    (index, root index) pair it brings is already in the group for that dependency (_covered_by_group):
    the index mappings map each index on its own, so such a visit adds no pair to the group that the earlier
    visits do not. On torchvision's classifiers without shuffles the groups are the same, pair for pair
    and in order (tests/test_surgery.py); through shuffles they hold the same channels, but a channel that
    several root channels reach may name another of them as its root, the one that reached it first
    (shufflenet_v2_x0_5's surgery: 3 s, the same report)."""
    with _PATCH_LOCK:
        originals = {name: getattr(tp_index_mapping, name) for name in _MAPPING_UPDATES}
        flatten = tp_index_mapping._FlattenIndexMapping.__call__

        def bounded(mapping, idxs):
            if not mapping.reverse and len(idxs) * mapping._stride > _MAX_MAPPED:
                raise ValueError(f"a reshape maps {len(idxs)} channel indices to {len(idxs) * mapping._stride} "
                                 f"(more than {_MAX_MAPPED}: chained reshapes)")
            return flatten(mapping, idxs)

        def tolerant(name, update):
            def run(graph, node):
                try:
                    return update(graph, node)
                except Exception as e:
                    failed.setdefault(node, f"Torch-Pruning's {name} fails on {node.grad_fn.name()} "
                                            f"({type(e).__name__}: {e})")
            return run

        for name, update in originals.items():
            setattr(tp_index_mapping, name, tolerant(name, update))
        tp_index_mapping._FlattenIndexMapping.__call__ = bounded
        TPGroup.has_pruning_op = _covered_by_group
        try:
            yield
        finally:
            for name, update in originals.items():
                setattr(tp_index_mapping, name, update)
            tp_index_mapping._FlattenIndexMapping.__call__ = flatten
            TPGroup.has_pruning_op = _TP_HAS_PRUNING_OP


def _covered_by_group(group, dep, idxs):
    """Whether `group` (Torch-Pruning's Group while its search runs) already holds `dep` with every (index,
    root index) pair of `idxs` (_patched_torch_pruning). Torch-Pruning's own test first (an exact repeat:
    no hashing of long index lists, which swin_t's reshapes make); then the pairs of that dependency, kept
    on the group and brought up to date with the items added since it was last asked about."""
    if _TP_HAS_PRUNING_OP(group, dep, idxs):
        return True
    known = group.__dict__.setdefault("_pairs", {})   # (target, handler) -> (pairs, group items read)
    pairs, read = known.get((dep.target, dep.handler), (set(), 0))
    for item_dep, item_idxs in group._group[read:]:
        if item_dep.target == dep.target and item_dep.handler == dep.handler:
            pairs.update(item_idxs)
    known[(dep.target, dep.handler)] = (pairs, len(group._group))
    return pairs.issuperset(idxs)


# --------------------------------------------------------------------------------------------------
NOT_PRUNED = "not pruned: "   # the prefix of a reason that covers the whole module (nothing was removed)


class _Untraceable(Exception):
    pass


class _GroupFailed(Exception):
    """Removing one layer's group failed half-way: the attempt's copy is spoilt, the group must stay."""

    def __init__(self, layer, reason):
        super().__init__(reason)
        self.layer, self.reason = layer, reason


@torch.no_grad()
def remove_dead_units(module: nn.Module, dead_units: dict, example_input: torch.Tensor, atol: float = 1e-5,
                      report: dict = None, channel_multiple: int = 1):
    """Return a copy of `module` with every removable dead unit / channel physically removed.

    Surgery degrades, it does not fail: a dead channel that cannot be removed exactly stays (zero, or the
    constant the masked network has there) and the report says which operation kept it. Each layer's
    dead channels are removed as one group; when Torch-Pruning fails inside a group, or the final check
    finds the outputs changed, the layer whose group causes it is found (by bisection over the groups in
    the order they were removed) and kept, and surgery runs again without it. A module Torch-Pruning
    cannot trace at all is returned unpruned (the masked network), with the reason in every layer's row.
    The remaining errors are SurgeryErrors naming the layer: dead_units that do not fit the module, or
    mark the model's outputs dead, and a module that fails on the example input.

    report: a dict to fill with {layer name: {"dead": n, "removed": n, "kept": {reason: n}}} for each layer
    of `dead_units` (format_report prints it).
    channel_multiple: each convolution keeps a multiple of this many output channels where it loses any (dead
    ones stay, zero, to round its width up; `_round_width`): a runtime's fast kernels work on blocks of channels.
    """
    original = copy.deepcopy(module).cpu().eval()
    layers = dict(original.named_modules())
    names = {m: n for n, m in layers.items()}
    for name, mask in dead_units.items():
        if name not in layers or not isinstance(layers[name], AFFINE):
            raise SurgeryError(f"dead_units names {name!r}, which is not a Linear or Conv2d layer of the module")
        if mask.numel() != layers[name].weight.shape[0]:
            raise SurgeryError(f"dead_units[{name!r}] has {mask.numel()} entries for {layers[name].weight.shape[0]} outputs")

    shape = tuple(example_input.shape[1:])
    probe = torch.randn((4,) + shape, generator=torch.Generator().manual_seed(0))
    check = torch.cat([probe, torch.randn((4,) + shape, generator=torch.Generator().manual_seed(2))])
    reference = _run(original, check, names, "the original module")
    exact = _exact(original, check)   # float64, where the module runs in it (_exact says why)
    tolerance = atol * max(1.0, float((reference if exact is None else exact).abs().max()))
    dead_sets = {name: set((~mask.detach().cpu().to(torch.bool)).nonzero().flatten().tolist())
                 for name, mask in dead_units.items()}
    kept = {}   # layer name -> why all its dead channels stay (its group failed, or changed the outputs)

    def attempt(only=None):
        """(pruned, reasons, out_map, order, why its outputs are wrong or None), removing the groups of the
        layers in `only` (all when None) but those of `kept`."""
        pruned, reasons, out_map, order = _remove(original, dead_sets, probe, kept, only, channel_multiple)
        try:
            out = _run(pruned, check, {m: n for n, m in pruned.named_modules()}, "check of the pruned module")
        except SurgeryError as e:
            return pruned, reasons, out_map, order, str(e).replace("surgery (check of the pruned module): ", "")
        if out.shape != reference.shape:
            return pruned, reasons, out_map, order, (f"they are outputs of the model (the output shape changed "
                                                     f"from {tuple(reference.shape)} to {tuple(out.shape)})")
        out64 = None if exact is None else _exact(pruned, check)
        gap = float((out - reference).abs().max() if out64 is None else (out64 - exact).abs().max())
        return pruned, reasons, out_map, order, (None if gap <= tolerance else f"the outputs changed by {gap:.2e}")

    def fails(prefix):
        try:
            return attempt(set(prefix))[-1] is not None
        except _GroupFailed:
            return True

    while True:
        try:
            pruned, reasons, out_map, order, why = attempt()
        except _Untraceable as e:
            pruned, out_map = original, {m: torch.arange(m.weight.shape[0]) for m in original.modules()
                                         if isinstance(m, AFFINE)}
            reasons = {(name, o): NOT_PRUNED + str(e) for name, dead in dead_sets.items() for o in dead}
            break
        except _GroupFailed as e:
            kept[e.layer] = e.reason
            continue
        if why is None:
            break
        if not order:   # nothing was removed, and still the outputs differ: the module is not deterministic
            raise SurgeryError(f"surgery: the module gives other outputs on a copy of itself ({why})")
        kept[_first_failing(order, fails)] = f"removing them changed the pruned module: {why}"

    if report is not None:
        layers = dict(pruned.named_modules())
        for name, dead in dead_sets.items():
            left = set(out_map[layers[name]].tolist())
            count = Counter(reasons.get((name, o), "not examined") for o in dead if o in left)
            report[name] = {"dead": len(dead), "removed": len(dead) - sum(count.values()), "kept": dict(count)}
    return pruned


def _round_width(width, candidates, multiple):
    """{root index: why it stays} for the last dead candidates that keep a convolution's width at a multiple
    of `multiple` (rounded up, at most the width it has): runtimes run convolutions in blocks of channels, and a
    width off the block falls to slower kernels or pays a layout conversion per layer (onnxruntime on x86: six
    3x3 convolutions of 57-63 channels took 1.4-1.7x the time of 56, 60 or 64; benchmarks/results/
    channel_multiple.md). Linear layers are not rounded: their width made no difference beyond noise in
    onnxruntime or LiteRT there. A layer whose width is not a multiple to begin with keeps it rather than
    round past it."""
    left = width - len(candidates)
    keep = min(-(-left // multiple) * multiple, width) - left
    return {r: f"kept to round the layer's width up to a multiple of {multiple} channels (the runtime's channel "
               f"block: runtime.channel_multiple)" for r in candidates[len(candidates) - keep:]} if keep else {}


def _first_failing(order, fails):
    """The layer of `order` whose group makes the removal fail: the last of the shortest failing prefix
    (the empty prefix passes, the whole order fails); log2(len(order)) more attempts."""
    lo, hi = 0, len(order)   # prefix lo passes, prefix hi fails
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fails(order[:mid]):
            hi = mid
        else:
            lo = mid
    return order[hi - 1]


def _where(e):
    frame = traceback.extract_tb(e.__traceback__)[-1]
    return f"{type(e).__name__}: {e}, in {frame.name} of {Path(frame.filename).name}"


def _remove(original, dead_sets, probe, kept, only=None, channel_multiple=1):
    """One attempt on a fresh copy of `original`: (pruned, {(layer, channel): why it stays}, out_map,
    the layers whose groups were removed, in order)."""
    pruned = copy.deepcopy(original)
    grouped = ungroup(pruned)   # dense while Torch-Pruning cuts them; their groups come back at the end
    layers = dict(pruned.named_modules())
    names = {m: n for n, m in layers.items()}
    ranges = probe_inputs(pruned, probe, names)
    # Original index of every current output / input channel of each layer (indices shift as channels go).
    out_map = {m: torch.arange(m.weight.shape[0]) for m in pruned.modules() if isinstance(m, AFFINE)}
    in_map = {m: torch.arange(len(r[0])) for m, r in ranges.items()}
    reasons, order = {}, []   # (layer name, original channel) -> why that dead channel stays

    recorder, unmapped = _Recorder(), {}
    with _patched_torch_pruning(unmapped):
        try:
            with torch.enable_grad(), recorder:  # Torch-Pruning traces the graph through autograd
                graph = tp.DependencyGraph().build_dependency(pruned, example_inputs=probe[:1], verbose=False)
        except Exception as e:
            raise _Untraceable(f"Torch-Pruning cannot trace the module ({_where(e)}); the masked network is "
                               f"kept, its FLOPs and bytes are the dense ones") from None
        owned = _own_concats(graph, recorder.cats)

        # Grouped convolutions' own outputs first: a group left with no outputs then lets its inputs go too.
        for name, dead in sorted(dead_sets.items(), key=lambda item: layers[item[0]] not in grouped):
            root = layers[name]
            candidates = [i for i, o in enumerate(out_map[root].tolist()) if o in dead]
            if not candidates:
                continue
            if name in kept or (only is not None and name not in only):
                reasons.update({(name, o): kept.get(name, "not tried") for o in dead})
                continue
            if root not in graph.module2node:  # e.g. an auxiliary head that eval mode skips
                reasons.update({(name, o): "not reached by the forward pass" for o in dead})
                continue
            fn = graph.get_pruner_of_module(root).prune_out_channels
            try:
                while candidates:
                    _map_concats(owned)
                    group = graph.get_pruning_group(root, fn, candidates)
                    blocked, folds = _check_group(graph, group, names, in_map, out_map, ranges, root, recorder,
                                                  unmapped, grouped)
                    if not blocked and not graph.check_pruning_group(group):
                        blocked = {candidates[-1]: "the last channel: a layer cannot be left empty"}
                    if not blocked and isinstance(root, nn.Conv2d):
                        blocked = _round_width(root.weight.shape[0], candidates, channel_multiple)
                    if not blocked:
                        break
                    for r, why in blocked.items():
                        reasons[(name, int(out_map[root][r]))] = why
                    candidates = [r for r in candidates if r not in blocked]
            except SurgeryError:
                raise
            except Exception as e:   # nothing was changed yet: the group stays, the reason says why
                why = f"Torch-Pruning could not find the channels coupled to them ({_where(e)})"
                reasons.update({(name, int(out_map[root][r])): why for r in candidates})
                continue
            if not candidates:
                continue
            try:
                for m, k, c in folds:
                    _fold(m, k, c)
                group.prune()
            except Exception as e:
                raise _GroupFailed(name, f"Torch-Pruning failed removing them ({_where(e)})") from None
            order.append(name)
            for item in group:
                m, handler = item.dep.target.module, item.dep.handler
                if m in out_map and graph.is_out_channel_pruning_fn(handler):
                    out_map[m] = _drop(out_map[m], item.idxs)
                if m in in_map and graph.is_in_channel_pruning_fn(handler):
                    in_map[m] = _drop(in_map[m], item.idxs)
    for old, new in regroup(pruned, grouped, in_map, out_map).items():
        out_map[new] = out_map[old]
    return pruned, reasons, out_map, order


def _check_group(graph, group, names, in_map, out_map, ranges, root, recorder, unmapped, grouped):
    """({root index: why it must stay}, [(reader, input index, constant to fold)]) for one group."""
    live_writers = {}  # root index -> layers that write that channel with non-zero weights, depthwise first
    for item in group:
        m = item.dep.target.module
        if isinstance(m, AFFINE) and graph.is_out_channel_pruning_fn(item.dep.handler):
            rows = _live_rows(m).tolist()
            for i, r in zip(item.idxs, item.root_idxs):
                if rows[i]:
                    writers = live_writers.setdefault(r, [])
                    writers.insert(0, m) if is_depthwise(m) else writers.append(m)

    residual = any(isinstance(item.dep.target.module, tp.ops._ElementWiseOp)
                   and "add" in str(item.dep.target.module._grad_fn).lower() for item in group)

    def live_reason(r, reader):
        writers = live_writers.get(r, [])
        if root in writers:
            return "not dead: its weights are not zero"
        if not writers:
            return f"varies where {names[reader]} reads it"
        if is_depthwise(writers[0]):
            return f"coupled to a live depthwise channel of {names[writers[0]]}"
        if residual:
            return f"residual stream: also written by live {names[writers[0]]}"
        return f"coupled to live {names[writers[0]]}, read by {names[reader]}"

    blocked, folds = {}, []
    for item in group:
        m, handler = item.dep.target.module, item.dep.handler
        if isinstance(m, tp.ops._OutputOp):
            for r in item.root_idxs:
                blocked.setdefault(r, "they are outputs of the model")
            continue
        label = names.get(m) or type(m).__name__
        through = unmapped.get(item.dep.target) or _channel_op_reason(item.dep.target, recorder)
        if through is not None:
            for r in item.root_idxs:
                blocked.setdefault(r, f"passes through {through}")
            continue
        if isinstance(m, _MIXING_NORMS):
            for r in item.root_idxs:
                blocked.setdefault(r, f"normalized together with other channels by {label}")
            continue
        if not graph.is_in_channel_pruning_fn(handler) or is_depthwise(m):
            continue  # writers, batch norms, element-wise ops; a depthwise layer: its readers decide
        if not isinstance(m, AFFINE) or m not in ranges:
            for r in item.root_idxs if _mixes_channels(m) else ():
                blocked.setdefault(r, f"read by {type(m).__name__} {label}, which surgery has no rule for")
            continue
        # Per channel of the item, computed for all of them at once (a ConvNeXt's groups hold thousands)
        idxs = torch.as_tensor(item.idxs, dtype=torch.long)
        reads = _reads_inputs(m)[idxs].tolist()
        lo, hi, value = (t[in_map[m][idxs]] for t in ranges[m])
        is_constant, values = _constant_mask(lo, hi).tolist(), value.tolist()
        for j, (k, r) in enumerate(zip(item.idxs, item.root_idxs)):
            if not reads[j]:
                continue  # the reader multiplies it by zero
            if not is_constant[j]:
                blocked.setdefault(r, live_reason(r, m))
            elif _pads(m) and values[j] != 0:
                blocked.setdefault(r, f"a non-zero constant (batch-norm shift, f(0) != 0) read by padded "
                                      f"convolution {label}")
            elif values[j] != 0:
                folds.append((m, k, value[j]))
    if not blocked:   # a group of a grouped convolution keeps one input while it has outputs
        for item in group:
            m = item.dep.target.module
            if m in grouped and m in in_map and graph.is_in_channel_pruning_fn(item.dep.handler):
                root_of = dict(zip(item.idxs, item.root_idxs))
                for i, g in last_inputs(grouped[m], item.idxs, in_map[m], out_map[m]).items():
                    blocked.setdefault(root_of[i], f"the last input channel of group {g} of grouped convolution "
                                                   f"{names.get(m)}, which still has outputs there")
    return blocked, folds


def _reads_inputs(m):
    """[input channel]: whether m reads it with a non-zero weight (a grouped convolution's channel k: the
    outputs of its group, at its position there); _reading's weights, for every channel at once."""
    nonzero = m.weight.detach().flatten(2).ne(0).any(2) if isinstance(m, nn.Conv2d) else m.weight.detach().ne(0)
    if isinstance(m, nn.Conv2d) and m.groups > 1:   # [out, in / groups] -> [groups, in / groups] -> [in]
        return nonzero.view(m.groups, m.out_channels // m.groups, -1).any(1).flatten()
    return nonzero.any(0)


def _reading(m, k):
    """The weights with which m reads its input channel k, [outputs reading it, ...]: a grouped
    convolution's channel k is read by the outputs of its group only, with the weights of its position."""
    if not isinstance(m, nn.Conv2d) or m.groups == 1:
        return m.weight[:, k]
    rows, per = m.out_channels // m.groups, m.in_channels // m.groups
    return m.weight[k // per * rows: (k // per + 1) * rows, k % per]


def _fold(m, k, c):
    """Add the contribution of the constant input channel k (value c) to m's bias: exact without padding."""
    w = _reading(m, k).detach()
    contribution = w * c if isinstance(m, nn.Linear) else w.sum((1, 2)) * c
    if m.bias is None:
        m.bias = nn.Parameter(torch.zeros(m.weight.shape[0], dtype=w.dtype))
    if isinstance(m, nn.Conv2d) and m.groups > 1:
        rows, per = m.out_channels // m.groups, m.in_channels // m.groups
        m.bias.data[k // per * rows: (k // per + 1) * rows] += contribution
    else:
        m.bias.data += contribution


def _drop(index, idxs):
    gone = torch.zeros(index.numel(), dtype=torch.bool)
    gone[list(idxs)] = True
    return index[~gone]


def kept_summary(report: dict, limit: int = 3) -> str:
    """The layers of remove_dead_units' report that keep dead channels, most first, each with its main reason:
    what an error names when surgery cannot make a network as small as asked ("" when every dead channel went)."""
    rows = sorted(((sum(r["kept"].values()), name, r) for name, r in report.items() if r["kept"]),
                  key=lambda t: (-t[0], t[1]))
    parts = [f"{name} keeps {n} of its {r['dead']} switched-off channels ({max(r['kept'], key=r['kept'].get)})"
             for n, name, r in rows[:limit]]
    return "; ".join(parts) + (f"; {len(rows) - limit} more layer(s)" if len(rows) > limit else "")


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
    with _traced(module, example_input) as (graph, owned):
        return _coupled(graph, owned, layers, names, wanted, layer_names)


@contextmanager
def _traced(module, example_input):
    """(dependency graph, owned concatenations) of `module`, as remove_dead_units traces it; SurgeryError
    when Torch-Pruning cannot trace it. Within the block, Torch-Pruning is patched as surgery runs it
    (_patched_torch_pruning)."""
    recorder, unmapped = _Recorder(), {}
    with _patched_torch_pruning(unmapped):
        try:
            with torch.enable_grad(), recorder:
                graph = tp.DependencyGraph().build_dependency(module.eval(), example_inputs=example_input[:1],
                                                              verbose=False)
        except Exception as e:
            raise SurgeryError(f"Torch-Pruning cannot trace the module ({_where(e)})") from None
        yield graph, _own_concats(graph, recorder.cats)


def _coupled(graph, owned, layers, names, wanted, layer_names):
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
        _map_concats(owned)
        try:
            group = graph.get_pruning_group(root, graph.get_pruner_of_module(root).prune_out_channels,
                                            list(range(root.weight.shape[0])))
        except Exception:   # surgery will keep this layer's dead channels too, saying why
            blocked.add(name)
            continue
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
    moves as one, as Torch-Pruning's dependency graph maps them. `importance(writers)` takes the (name, layer)
    pairs that write one coupled group and gives each a score per output channel, or None for a writer that
    does not rank it; the group ranks by the sum of the scores, each over its layer's mean.

    Nested nets keep the first channels at narrow widths (train/nested.py), so a trained network reordered
    this way keeps its strongest channels there. Each group's move is checked on a probe and undone if the
    outputs change (the model's own outputs, a module this cannot permute); a group with a grouped
    convolution or a norm over several channels keeps its order. Returns the names of the layers reordered.
    """
    try:
        with _traced(module, example_input) as (graph, owned):
            return _order(module, importance, example_input, graph, owned)
    except SurgeryError:   # an untraceable network keeps its order (surgery says why when it runs)
        return []


def _order(module, importance, example_input, graph, owned):
    layers = dict(module.named_modules())
    names = {m: n for n, m in layers.items()}
    probe = torch.randn((4,) + tuple(example_input.shape[1:]), generator=torch.Generator().manual_seed(0))
    exact = _exact(module, probe)   # reorders are checked in float64 where the module runs in it
    reference = module(probe) if exact is None else exact
    tolerance = 1e-5 * max(1.0, float(reference.abs().max()))
    done, reordered = set(), []
    for name, root in layers.items():
        if not isinstance(root, AFFINE) or root in done or root not in graph.module2node:
            continue
        _map_concats(owned)
        try:
            group = graph.get_pruning_group(root, graph.get_pruner_of_module(root).prune_out_channels,
                                            list(range(root.weight.shape[0])))
        except Exception:
            continue
        items = [(it.dep.target.module, it.dep.handler, list(it.idxs), list(it.root_idxs)) for it in group]
        writers = [(m, idxs, roots) for m, h, idxs, roots in items
                   if isinstance(m, AFFINE) and graph.is_out_channel_pruning_fn(h)]
        done.update(m for m, _, _ in writers)
        if any(isinstance(m, (_MIXING_NORMS, tp.ops._OutputOp)) or is_grouped(m) for m, _, _, _ in items):
            continue
        scores = importance([(names[m], m) for m, _, _ in writers])
        if all(s is None for s in scores):   # no writer ranks it: it keeps its order
            continue
        score = torch.zeros(root.weight.shape[0])
        for (m, idxs, roots), s in zip(writers, scores):
            if s is not None:
                s = s.float()
                score.index_add_(0, torch.tensor(roots), (s / s.mean().clamp_min(1e-12))[idxs])
        perm = score.argsort(descending=True)   # new root position q holds old root channel perm[q]
        if bool((perm == torch.arange(len(perm))).all()):
            continue
        moved, seen = [], set()
        for m, handler, idxs, roots in items:
            if not isinstance(m, _REORDERED):
                continue
            dim = 1 if (graph.is_in_channel_pruning_fn(handler) and isinstance(m, AFFINE)
                        and not is_depthwise(m)) else 0
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
        after = module(probe) if exact is None else _exact(module, probe)
        if after is None or float((after - reference).abs().max()) > tolerance:
            for t, old in moved:   # the model's outputs, or something this cannot permute: undo
                t.data = old
        else:
            reordered += [names[m] for m, _, _ in writers]
    return reordered
