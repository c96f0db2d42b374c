"""Grouped convolutions in surgery: dead channels go from each group on their own, sizes left unequal.

A grouped convolution (RegNet, ResNeXt: `groups` between 1 and the channel count) reads, for the outputs of
group g, only the input channels of group g. PyTorch's Conv2d gives every group the same size, so a
posterior that switches off 3 channels in one group and 1 in another left surgery two choices: remove as
many from every group as the emptiest allows (most dead channels stayed: 712 of RegNetX-400MF's 3,052
removable ones), or represent groups of different sizes. Surgery does the second, in two steps:

  ungroup  before Torch-Pruning traces the module, each grouped convolution becomes, in place, the dense
           convolution it equals: groups = 1, weights block-diagonal (zero between groups). Torch-Pruning
           then removes its input and output channels like any convolution's, and surgery's rules (a
           reader multiplying a channel by zero, a constant folded into a bias) read the zero blocks as
           they are. One rule is added (`last_inputs`): a group that still has outputs keeps one input,
           since a convolution cannot read no channel.
  regroup  after surgery, each one goes back to its groups: one Conv2d with `groups` when every group kept
           as many inputs and as many outputs as the others, else a `GroupedConv2d`: the input split by
           group, one Conv2d per group, the outputs concatenated. A group left with no outputs is dropped
           (its inputs are read by nothing).

Both steps are exact (the zero blocks add exact zeros); surgery's final check compares the result with the
original module. The dense form costs G times a grouped layer's weights and work while surgery runs
(ResNeXt-50's widest: 1024 x 1024 x 3 x 3 floats, 38 MB), not in the network it returns. Its FLOPs are
counted per group (the inner convolutions are plain Conv2d layers), as appendix A.1 counts a grouped one.
"""

import torch
from torch import nn


class GroupedConv2d(nn.Module):
    """A grouped convolution whose groups have different sizes: input channels split by `in_sizes` (one part
    per group that kept inputs), part `reads[i]` convolved by `convs[i]`, the outputs concatenated in group
    order. What surgery leaves of a
    grouped convolution whose groups lost different numbers of channels (compressed/grouped.py)."""

    def __init__(self, in_sizes, reads, convs):
        super().__init__()
        self.in_sizes, self.reads, self.convs = list(in_sizes), list(reads), nn.ModuleList(convs)

    def forward(self, x):
        parts = torch.split(x, self.in_sizes, dim=1)
        outs = [conv(parts[g]) for g, conv in zip(self.reads, self.convs)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def extra_repr(self):
        return f"in_sizes={self.in_sizes}, out_sizes={[c.out_channels for c in self.convs]}"


def is_grouped(m) -> bool:
    """A grouped convolution that is not depthwise (depthwise channels are single: surgery's own rule)."""
    return isinstance(m, nn.Conv2d) and 1 < m.groups and not m.groups == m.in_channels == m.out_channels


@torch.no_grad()
def ungroup(module: nn.Module) -> dict:
    """Make every grouped convolution of `module` the dense convolution it equals, in place (groups = 1,
    block-diagonal weights). Returns {conv: (groups, inputs per group, outputs per group)} for `regroup`."""
    grouped = {}
    for m in module.modules():
        if not is_grouped(m) or m.transposed:
            continue
        g, rows, cols = m.groups, m.out_channels // m.groups, m.in_channels // m.groups
        dense = m.weight.new_zeros((m.out_channels, m.in_channels) + tuple(m.weight.shape[2:]))
        for k in range(g):
            dense[k * rows: (k + 1) * rows, k * cols: (k + 1) * cols] = m.weight[k * rows: (k + 1) * rows]
        m.weight = nn.Parameter(dense, requires_grad=m.weight.requires_grad)
        m.groups = 1
        grouped[m] = (g, cols, rows)
    return grouped


def last_inputs(shape, removing, in_map, out_map) -> dict:
    """{index in `removing`: group} for the input channels of an ungrouped convolution that must stay: the
    last of a group that still has outputs (a convolution cannot read no channel). shape = (groups, inputs
    per group, outputs per group) of the original; in_map / out_map: the original index of each current
    input / output channel."""
    _, cols, rows = shape
    live_groups = set((out_map // rows).tolist())
    left = {}
    for i, original in enumerate(in_map.tolist()):
        left.setdefault(original // cols, set()).add(i)
    removing = set(removing)
    return {max(channels): group for group, channels in left.items()
            if group in live_groups and channels <= removing}


@torch.no_grad()
def regroup(module: nn.Module, grouped: dict, in_map: dict, out_map: dict) -> dict:
    """Give every convolution `ungroup` made dense its groups back (module docstring), in place. in_map /
    out_map: the original index of each remaining input / output channel. Returns {old conv: new module}
    for the convolutions replaced by a GroupedConv2d."""
    parents = {m: (parent, name) for parent in module.modules() for name, m in parent.named_children()}
    replaced = {}
    for m, (groups, cols, rows) in grouped.items():
        in_group = in_map[m] // cols if m in in_map else torch.arange(m.in_channels) // cols
        out_group = out_map[m] // rows
        blocks = [((out_group == g).nonzero().flatten(), (in_group == g).nonzero().flatten()) for g in range(groups)]
        sizes = {(len(r), len(c)) for r, c in blocks}
        if len(sizes) == 1 and 0 not in sizes.pop():   # equal groups: one grouped convolution
            m.weight = nn.Parameter(torch.cat([m.weight[r][:, c] for r, c in blocks]),
                                    requires_grad=m.weight.requires_grad)
            m.groups = groups
            continue
        present = [g for g, (_, c) in enumerate(blocks) if len(c)]   # groups that kept an input
        convs, reads = [], []
        for g, (r, c) in enumerate(blocks):
            if len(r) == 0:
                continue   # no outputs left: the group's inputs are read by nothing
            if len(c) == 0:
                raise ValueError(f"group {g} of a grouped convolution kept outputs but no input (last_inputs "
                                 f"keeps one)")
            conv = nn.Conv2d(len(c), len(r), m.kernel_size, m.stride, m.padding, m.dilation, 1, m.bias is not None,
                             m.padding_mode, device=m.weight.device, dtype=m.weight.dtype)
            conv.weight.copy_(m.weight[r][:, c])
            if m.bias is not None:
                conv.bias.copy_(m.bias[r])
            convs.append(conv.requires_grad_(m.weight.requires_grad))
            reads.append(present.index(g))
        new = GroupedConv2d([len(blocks[g][1]) for g in present], reads, convs).train(m.training)
        parent, name = parents[m]
        setattr(parent, name, new)
        replaced[m] = new
    return replaced
