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
  regroup  after surgery, each one goes back to its groups (`_equal_groups`): one Conv2d with `groups` when
           every group kept as many inputs and outputs as the others, else a `GroupedConv2d`: the input
           gathered into groups of the widest group's size (a zero channel fills the others), one grouped
           convolution, the kept outputs gathered. A group left with no outputs is dropped (its inputs are
           read by nothing).

Both steps are exact (the zero blocks add exact zeros); surgery's final check compares the result with the
original module. The dense form costs G times a grouped layer's weights and work while surgery runs
(ResNeXt-50's widest: 1024 x 1024 x 3 x 3 floats, 38 MB), not in the network it returns.

Why one padded convolution, not one convolution per group: RegNetX-400MF at 32x32 with a quarter of its units
dead ran in 1.81 ms (onnxruntime) / 1.15 ms (LiteRT) with a convolution per group (split, convolutions,
concat) and 1.24 / 0.96 ms padded (one thread, this 2-core x86, measured once while choosing); per-operator
cost dominates these small convolutions, and a GPU pays a kernel launch per operator. The padding's zero
weights are computed, so they count in the physical FLOPs (0.768 of the dense against 0.706 per group).
Neither beats the masked network there, whose groups keep the widths the runtimes' kernels are tuned for:
benchmarks/results/channel_multiple.md (2 threads) has padded 1.59x the masked latency in onnxruntime, 1.15x
in LiteRT.
"""

import torch
from torch import nn


class GroupedConv2d(nn.Module):
    """A grouped convolution whose groups kept different numbers of channels, run as one grouped convolution
    of equal groups: the input gathered into groups of the widest group's size (a zero channel, appended to
    it, fills a group's missing inputs), the convolution (zero weights on the padding), then the kept outputs
    gathered. One convolution and three cheap operators, not one convolution per group (module docstring)."""

    def __init__(self, conv, in_index=None, out_index=None):
        super().__init__()
        self.conv = conv
        # Lists, not buffers: traced as constants (the packed MC layout takes no tensor attributes), and
        # exported as one Gather each. None: the input is in equal groups already / every output is kept.
        self.in_index, self.out_index = in_index, out_index

    def forward(self, x):
        if self.in_index is not None:
            # The zero channel by concatenation: F.pad on the channel dimension exports as eight operators that
            # compute its pads at run time (and a constant-folding warning each); this exports as four.
            x = torch.cat([x, torch.zeros_like(x[:, :1])], dim=1)[:, self.in_index]
        y = self.conv(x)
        return y if self.out_index is None else y[:, self.out_index]

    def extra_repr(self):
        return f"gathers: input {self.in_index is not None}, output {self.out_index is not None}"


def _equal_groups(m, blocks):
    """The GroupedConv2d (or, where nothing needs gathering, the Conv2d) that computes ungrouped convolution m
    with groups `blocks` [(its output rows, its input columns) per group]; groups without outputs go."""
    kept = [(r, c) for r, c in blocks if len(r)]
    width_in, width_out = max(len(c) for _, c in kept), max(len(r) for r, _ in kept)
    conv = nn.Conv2d(len(kept) * width_in, len(kept) * width_out, m.kernel_size, m.stride, m.padding, m.dilation,
                     len(kept), m.bias is not None, m.padding_mode, device=m.weight.device, dtype=m.weight.dtype)
    zero = m.in_channels   # the zero channel GroupedConv2d appends
    in_index, out_index = [], []
    with torch.no_grad():
        conv.weight.zero_()
        if m.bias is not None:
            conv.bias.zero_()
        for p, (r, c) in enumerate(kept):
            in_index += c.tolist() + [zero] * (width_in - len(c))
            out_index += list(range(p * width_out, p * width_out + len(r)))
            conv.weight[p * width_out: p * width_out + len(r), :len(c)] = m.weight[r][:, c]
            if m.bias is not None:
                conv.bias[p * width_out: p * width_out + len(r)] = m.bias[r]
    conv.requires_grad_(m.weight.requires_grad)
    gather_in = in_index != list(range(m.in_channels))
    gather_out = out_index != list(range(conv.out_channels))
    if not gather_in and not gather_out:
        return conv
    return GroupedConv2d(conv, in_index if gather_in else None, out_index if gather_out else None)


def is_depthwise(m) -> bool:
    """A convolution whose every channel is a group of its own (surgery removes its channels with their producer)."""
    return isinstance(m, nn.Conv2d) and m.groups > 1 and m.groups == m.out_channels == m.in_channels


def is_grouped(m) -> bool:
    """A grouped convolution that is not depthwise (depthwise channels are single: surgery's own rule)."""
    return isinstance(m, nn.Conv2d) and m.groups > 1 and not is_depthwise(m)


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
    out_map: the original index of each remaining input / output channel. Returns {old conv: new module}."""
    parents = {m: (parent, name) for parent in module.modules() for name, m in parent.named_children()}
    replaced = {}
    for m, (groups, cols, rows) in grouped.items():
        in_group = in_map[m] // cols if m in in_map else torch.arange(m.in_channels) // cols
        out_group = out_map[m] // rows
        blocks = [((out_group == g).nonzero().flatten(), (in_group == g).nonzero().flatten()) for g in range(groups)]
        if any(len(r) and not len(c) for r, c in blocks):
            raise ValueError("a group of a grouped convolution kept outputs but no input (last_inputs keeps one)")
        new = _equal_groups(m, blocks).train(m.training)
        parent, name = parents[m]
        setattr(parent, name, new)
        replaced[m] = new
    return replaced
