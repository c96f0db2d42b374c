"""Structural surgery: physically remove dead units and channels from a plain module.

Input: a plain module (nn.Linear, nn.Conv2d, nn.BatchNorm2d, activations, pooling, flatten, residual
additions, concatenation, depthwise and grouped convolutions: whatever Torch-Pruning can trace), a "dead
units" description {qualified name of a Linear / Conv2d: boolean mask of its kept outputs} and an example
input. Output: a smaller module with the same outputs (to float rounding).

Structural knowledge lives in one place, Torch-Pruning's dependency graph: for the dead outputs of a layer
it gives the group of every coupled layer, the layers that write those channels (a residual stream has
one writer per block) and the layers that read them (across batch norm, additions, concatenation and the
flatten from a convolution to a linear layer, with the index mapping that each implies). A dead channel
is removed only when

  1. every Linear / Conv2d that writes it marks it dead (a residual stream: dead in every block), and
  2. it is exactly zero where every Linear / Conv2d reads it, checked on a probe batch. A dead unit behind
     an activation with f(0) != 0, or behind a batch norm with a shift, is not zero there, and stays.

Removing such a channel drops only zero contributions, so the outputs stay equal. A final check compares
the pruned module with the original on the probe batch and raises SurgeryError if they differ.
"""

import copy

import torch
import torch_pruning as tp
from torch import nn

from edgebayes.errors import StageError

AFFINE = (nn.Linear, nn.Conv2d)


class SurgeryError(StageError, ValueError):
    pass


def _is_depthwise(m):
    return isinstance(m, nn.Conv2d) and m.groups > 1 and m.groups == m.out_channels


def _zero_input_channels(module, probe):
    """{Linear/Conv2d: boolean mask of its input channels that are exactly zero on the probe batch}."""
    zero, hooks = {}, []

    def record(m, inputs, _):
        x = inputs[0].detach()
        channel_dim = 1 if isinstance(m, nn.Conv2d) else x.dim() - 1
        dims = [d for d in range(x.dim()) if d != channel_dim]
        zero[m] = x.abs().amax(dim=dims) == 0

    for m in module.modules():
        if isinstance(m, AFFINE):
            hooks.append(m.register_forward_hook(record))
    try:
        with torch.no_grad():
            module(probe)
    finally:
        for h in hooks:
            h.remove()
    return zero


@torch.no_grad()
def remove_dead_units(module: nn.Module, dead_units: dict, example_input: torch.Tensor, atol: float = 1e-5):
    """Return a copy of `module` with every removable dead unit / channel physically removed."""
    pruned = copy.deepcopy(module).cpu().eval()
    layers = dict(pruned.named_modules())
    for name, mask in dead_units.items():
        if name not in layers or not isinstance(layers[name], AFFINE):
            raise SurgeryError(f"dead_units names {name!r}, which is not a Linear or Conv2d layer of the module")
        if mask.numel() != layers[name].weight.shape[0]:
            raise SurgeryError(f"dead_units[{name!r}] has {mask.numel()} entries for {layers[name].weight.shape[0]} outputs")

    probe = torch.randn((4,) + tuple(example_input.shape[1:]), generator=torch.Generator().manual_seed(0))
    reference = pruned(probe)
    # Current masks, kept up to date as channels go (indices shift after every pruning step).
    keep = {m: torch.ones(m.weight.shape[0], dtype=torch.bool) for m in pruned.modules() if isinstance(m, AFFINE)}
    for name, mask in dead_units.items():
        keep[layers[name]] = mask.detach().cpu().to(torch.bool).clone()
    zero_in = _zero_input_channels(pruned, probe)

    with torch.enable_grad():  # Torch-Pruning traces the graph through autograd
        graph = tp.DependencyGraph().build_dependency(pruned, example_inputs=probe[:1], verbose=False)

    def out_fn(m):
        return tp.prune_linear_out_channels if isinstance(m, nn.Linear) else tp.prune_conv_out_channels

    for name in dead_units:
        root = layers[name]
        dead = (~keep[root]).nonzero().flatten().tolist()
        if not dead:
            continue
        blocked = set()
        for item in graph.get_pruning_group(root, out_fn(root), dead):
            m, handler = item.dep.target.module, item.dep.handler
            for i, r in zip(item.idxs, item.root_idxs):
                writer_alive = (graph.is_out_channel_pruning_fn(handler) and m in keep and not _is_depthwise(m)
                                and bool(keep[m][i]))
                read_nonzero = graph.is_in_channel_pruning_fn(handler) and m in zero_in and not bool(zero_in[m][i])
                if writer_alive or read_nonzero:
                    blocked.add(r)
        removable = [r for r in dead if r not in blocked]
        if not removable:
            continue
        group = graph.get_pruning_group(root, out_fn(root), removable)
        for item in group:
            m, handler = item.dep.target.module, item.dep.handler
            if graph.is_out_channel_pruning_fn(handler) and m in keep:
                keep[m] = _drop(keep[m], item.idxs)
            if graph.is_in_channel_pruning_fn(handler) and m in zero_in:
                zero_in[m] = _drop(zero_in[m], item.idxs)
        group.prune()

    out = pruned(probe)
    if out.shape != reference.shape:
        raise SurgeryError(f"surgery changed the output shape from {tuple(reference.shape)} to {tuple(out.shape)}: "
                           "the layer that produces the model's outputs cannot lose units")
    gap = float((out - reference).abs().max())
    if gap > atol * max(1.0, float(reference.abs().max())):
        raise SurgeryError(f"the pruned module's outputs differ from the original by {gap:.2e}")
    return pruned


def _drop(mask, idxs):
    gone = torch.zeros(mask.numel(), dtype=torch.bool)
    gone[list(idxs)] = True
    return mask[~gone]
