"""The layer factory: the one switch (as in timm) that decides which layer type a whole architecture is built from.

  - dnn:    plain nn.Linear / nn.Conv2d (+ nn.BatchNorm2d), the deterministic baseline;
  - bnn:    dense mean-field Gaussian layers (the SS-IG layer that is never pruned), the dense BNN baseline;
  - ss-ig, ss-gl, ss-ghs: spike-and-slab layers over nodes and channels (paper 000, train/spike_slab.py);
  - bn3, fn3: nested layers with an ordering unit over groups of output channels (paper 002, train/nested.py).
Architectures (edgebayes.train.zoo, a user's builder, bayesianize) only call the factory; the networks
that wrap them (BayesianNet, NestedNet) are in train/models.py.
"""

from collections import OrderedDict

from torch import nn

from edgebayes.train.nested import NESTED_FAMILIES, NestedConv2d, NestedLinear
from edgebayes.train.spike_slab import PRIORS, SpikeSlabConv2d, SpikeSlabLinear

FAMILIES = ("dnn", "bnn") + PRIORS + NESTED_FAMILIES
ACTIVATIONS = {"silu": nn.SiLU, "relu": nn.ReLU, "tanh": nn.Tanh}


class ConvNorm(nn.Sequential):
    """A plain convolution followed by its batch norm: the plain twin of a spike-and-slab layer with `norm`."""

    def __init__(self, conv, norm):
        super().__init__(OrderedDict(conv=conv, norm=norm))


class Signal1d(nn.Module):
    """A Conv1d (and the BatchNorm1d that alone reads it) as the height-1 Conv2d (and BatchNorm2d) it equals, on
    (N, C, L) signals: (N, C, 1, L) through the (1, k) kernel, then back. The same outputs, the same FLOPs
    (structure.py's formula over one kernel row and one output row) and the same channels (dimension 1), so the
    families' 2-D layers, surgery and the packed export take it as any Conv2d; runtimes run the Unsqueeze /
    Squeeze around it as reshapes. `norm` is nn.Identity where no batch norm alone reads the convolution."""

    def __init__(self, conv, norm=None):
        super().__init__()
        self.conv, self.norm = conv, norm if norm is not None else nn.Identity()

    def forward(self, x):
        return self.norm(self.conv(x.unsqueeze(-2))).squeeze(-2)


class LayerFactory:
    """Builds the layers of one family. `linear_inclusion(fan_in, units)` gives lambda_l of FC layers.

    The contract every architecture (zoo, a user's builder, bayesianize) relies on, in one place:
      - `linear(in_features, out_features, prunable=True, bias=True)` and `conv(in_channels, out_channels, kernel_size,
        stride=1, padding=0, groups=1, bias=True, norm=False, prunable=True, dilation=1)` are the only layers with
        weights the families treat; `activation()` is the configured activation. Anything else
        (pooling, additions, concatenation, flatten, reshapes) is plain PyTorch in the builder's forward.
      - `prunable=False` marks a layer that is never pruned: no spike-and-slab selection, no nested
        dropout. The layers that produce the network's outputs must be built so (VGG's first and dense
        layers are too, by choice).
      - `norm=True` gives the convolution its batch norm, owned by the layer: the node indicator (or the
        nested mask) multiplies the batch norm's output, so a switched-off channel is exactly zero and
        surgery can cut it. Write a batch norm that follows a convolution this way, not as its own module.
      - `truncates` (nested families only) names the layer whose output channels a depthwise layer's mask
        also drops (MobileNetV2, see train/nested.py).
      - `conv1d(...)`, with conv's arguments in one dimension, is a 1-D convolution on (N, C, L) signals: the
        family's conv of height 1 in a Signal1d (bayesianize makes a user's nn.Conv1d the same).
    With family dnn the same calls give nn.Linear, nn.Conv2d and ConvNorm(conv, norm): the plain twin that
    posterior samples are copied into, so the names of both nets line up.
    """

    def __init__(self, family, prior_cfg=None, global_scale=None, linear_inclusion=None, activation="silu",
                 nested_cfg=None):
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
        self.family, self.prior_cfg, self.global_scale = family, prior_cfg, global_scale
        self.linear_inclusion = linear_inclusion
        self.activation_name = activation
        self.nested_cfg = nested_cfg
        self._made = 0   # layers built so far: the first gets its own log alpha init (paper 002)

    def activation(self):
        return ACTIVATIONS[self.activation_name]()

    def _bayesian(self, prunable, prior_inclusion):
        p = self.prior_cfg
        prior = "ss-ig" if self.family == "bnn" else self.family
        return dict(prior=prior, prunable=prunable and self.family != "bnn", prior_inclusion=prior_inclusion,
                    sigma0_sq=p.sigma0_sq, temperature=p.temperature, gamma_init=p.gamma_init,
                    global_scale=self.global_scale, c_reg=p.c_reg,
                    noncentered=p.parameterization == "non-centered")

    def _nested(self, prunable):
        c, first = self.nested_cfg, self._made == 0
        self._made += 1
        return dict(groups=c.groups, fixed_groups=c.fixed_groups, nested=prunable, bayesian=self.family == "bn3",
                    learned_order=self.family == "bn3", mubar_init=c.mubar_init, prior_keep_logit=c.prior_keep_logit,
                    log_alpha_init=c.log_alpha_init_first if first else c.log_alpha_init)

    def linear(self, in_features, out_features, prunable=True, bias=True):
        if self.family == "dnn":
            return nn.Linear(in_features, out_features, bias=bias)
        if self.family in NESTED_FAMILIES:
            return NestedLinear(in_features, out_features, bias=bias, **self._nested(prunable))
        lam = self.linear_inclusion(in_features, out_features) if prunable else 1.0
        return SpikeSlabLinear(in_features, out_features, bias=bias, **self._bayesian(prunable, lam))

    def conv(self, in_channels, out_channels, kernel_size, stride=1, padding=0, groups=1, bias=True, norm=False,
             prunable=True, truncates=None, dilation=1):
        if self.family == "dnn":
            conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias)
            return ConvNorm(conv, nn.BatchNorm2d(out_channels)) if norm else conv
        if self.family in NESTED_FAMILIES:
            return NestedConv2d(in_channels, out_channels, kernel_size, stride, padding, groups, dilation, bias=bias,
                                norm=nn.BatchNorm2d(out_channels) if norm else None, truncates=truncates,
                                **self._nested(prunable))
        return SpikeSlabConv2d(in_channels, out_channels, kernel_size, stride, padding, groups, dilation, bias=bias,
                               norm=nn.BatchNorm2d(out_channels) if norm else None,
                               **self._bayesian(prunable, self.prior_cfg.conv_inclusion))

    def conv1d(self, in_channels, out_channels, kernel_size, stride=1, padding=0, groups=1, bias=True, norm=False,
               prunable=True, truncates=None, dilation=1):
        return Signal1d(self.conv(in_channels, out_channels, (1, kernel_size), (1, stride), (0, padding), groups, bias,
                                  norm, prunable, truncates, (1, dilation)))
