"""Structural surgery: physically remove dead units from a plain module.

Input: a plain nn.Sequential (Flatten, Linear, elementwise activations) and a "dead units" description
{name of Linear in the Sequential: boolean mask of kept outputs}. Output: a smaller nn.Sequential with
the same outputs on the kept units: the rows of a Linear and the matching columns of the next Linear go.

Why outputs stay equal: a dead unit's incoming weights and bias are zero, so its pre-activation is 0 and,
for an activation with f(0) = 0 (SiLU, ReLU, tanh), its output is 0 and its outgoing column contributes
nothing. Activations with f(0) != 0 are refused rather than silently changing the network.

This covers chains of fully connected layers (issue 2). Convolutions, batch norm, residual additions and
concatenation need a dependency graph (issue 3).
"""

import copy

import torch
from torch import nn

from edgebayes.errors import StageError

PASS_THROUGH = (nn.Identity, nn.Dropout, nn.Flatten)


def _maps_zero_to_zero(layer) -> bool:
    """True for a parameter-free, shape-preserving module with f(0) = 0 (probed on a small zero input)."""
    try:
        out = layer(torch.zeros(2, 3))
    except Exception:
        return False
    return out.shape == (2, 3) and not bool(out.abs().sum())


class SurgeryError(StageError, ValueError):
    pass


@torch.no_grad()
def remove_dead_units(module: nn.Sequential, dead_units: dict) -> nn.Sequential:
    """Return a copy of `module` with the units whose mask is False physically removed."""
    if not isinstance(module, nn.Sequential):
        raise SurgeryError(f"surgery handles nn.Sequential chains, got {type(module).__name__}")
    names = [name for name, m in module.named_children() if isinstance(m, nn.Linear)]
    unknown = set(dead_units) - set(names)
    if unknown:
        raise SurgeryError(f"dead_units names {sorted(unknown)} are not Linear layers of the module")
    if names and not bool(dead_units.get(names[-1], torch.ones(1, dtype=torch.bool)).all()):
        raise SurgeryError("the last Linear layer produces the model's outputs and cannot lose units")

    pruned = copy.deepcopy(module)
    incoming_keep = None  # mask over the inputs of the next Linear
    for name, layer in pruned.named_children():
        if isinstance(layer, nn.Linear):
            keep = dead_units.get(name, torch.ones(layer.out_features, dtype=torch.bool)).to(torch.bool)
            keep = keep.to(layer.weight.device)
            weight = layer.weight[keep]
            if incoming_keep is not None:
                weight = weight[:, incoming_keep]
            new = nn.Linear(weight.shape[1], weight.shape[0], bias=layer.bias is not None)
            new.weight.copy_(weight)
            if layer.bias is not None:
                new.bias.copy_(layer.bias[keep])
            setattr(pruned, name, new)
            incoming_keep = keep
        elif isinstance(layer, PASS_THROUGH):
            continue
        elif next(layer.parameters(), None) is None and _maps_zero_to_zero(layer):
            continue  # an elementwise activation with f(0) = 0 (SiLU, ReLU, GELU, tanh, ...)
        elif next(layer.parameters(), None) is None:
            raise SurgeryError(f"layer {name!r} ({type(layer).__name__}) has f(0) != 0: "
                               "removing units would change the outputs")
        else:
            raise SurgeryError(
                f"layer {name!r} ({type(layer).__name__}) is not supported by Linear-chain surgery")
    return pruned.eval()
