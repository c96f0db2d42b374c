"""Networks of every family from one architecture definition, and the interface later stages rely on.

`LayerFactory(family, ...)` is the one switch (as in timm) that decides which layer type a whole
architecture is built from:
  - dnn:    plain nn.Linear / nn.Conv2d (+ nn.BatchNorm2d), the deterministic baseline;
  - bnn:    dense mean-field Gaussian layers (the SS-IG layer that is never pruned), the dense BNN baseline;
  - ss-ig, ss-gl, ss-ghs: spike-and-slab layers over nodes and channels (paper 000);
  - bn3, fn3: nested layers with an ordering unit over groups of output channels (paper 002; the
    network, NestedNet, is in train/nested.py).
Architectures (edgebayes.train.zoo) only call the factory.

`BayesianNet` wraps a network and answers the interface of ../shared/DESIGN.md:
  - `kl()`: the KL term of the negative ELBO;
  - `knob` (here the inclusion threshold), `default_knob`, `operating_points(values)`;
  - `posterior_sample(knob_value, generator)`: one posterior sample as a *plain* module, the same
    architecture built by the dnn factory with the sampled weights copied in (rows of switched-off units
    exactly zero), plus the "dead units" description that surgery uses: {qualified name of each Linear /
    Conv2d in the plain module: boolean mask of its kept outputs}.
"""

from collections import OrderedDict

import torch
from torch import nn

from edgebayes.train.spike_slab import (
    PRIORS,
    GlobalHorseshoeScale,
    GlobalScale,
    SpikeSlabConv2d,
    SpikeSlabLayer,
    SpikeSlabLinear,
    prior_inclusion_probability,
)
from edgebayes.train.arch import as_builder, resolve_arch
from edgebayes.train.nested import NESTED_FAMILIES, NestedConv2d, NestedLinear

FAMILIES = ("dnn", "bnn") + PRIORS + NESTED_FAMILIES
ACTIVATIONS = {"silu": nn.SiLU, "relu": nn.ReLU, "tanh": nn.Tanh}


class ConvNorm(nn.Sequential):
    """A plain convolution followed by its batch norm: the plain twin of a spike-and-slab layer with `norm`."""

    def __init__(self, conv, norm):
        super().__init__(OrderedDict(conv=conv, norm=norm))


class LayerFactory:
    """Builds the layers of one family. `linear_inclusion(fan_in, units)` gives lambda_l of FC layers.

    The contract every architecture (zoo, a user's builder, bayesianize) relies on, in one place:
      - `linear(in_features, out_features, prunable=True)` and `conv(in_channels, out_channels, kernel_size,
        stride=1, padding=0, groups=1, bias=True, norm=False, prunable=True)` are the only layers with
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

    def linear(self, in_features, out_features, prunable=True):
        if self.family == "dnn":
            return nn.Linear(in_features, out_features)
        if self.family in NESTED_FAMILIES:
            return NestedLinear(in_features, out_features, **self._nested(prunable))
        lam = self.linear_inclusion(in_features, out_features) if prunable else 1.0
        return SpikeSlabLinear(in_features, out_features, **self._bayesian(prunable, lam))

    def conv(self, in_channels, out_channels, kernel_size, stride=1, padding=0, groups=1, bias=True, norm=False,
             prunable=True, truncates=None):
        if self.family == "dnn":
            conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, groups=groups, bias=bias)
            return ConvNorm(conv, nn.BatchNorm2d(out_channels)) if norm else conv
        if self.family in NESTED_FAMILIES:
            return NestedConv2d(in_channels, out_channels, kernel_size, stride, padding, groups, bias=bias,
                                norm=nn.BatchNorm2d(out_channels) if norm else None, truncates=truncates,
                                **self._nested(prunable))
        return SpikeSlabConv2d(in_channels, out_channels, kernel_size, stride, padding, groups, bias=bias,
                               norm=nn.BatchNorm2d(out_channels) if norm else None,
                               **self._bayesian(prunable, self.prior_cfg.conv_inclusion))


class BayesianNet(nn.Module):
    """A network of any family with the interface of the later stages (see the module docstring)."""

    knob = "inclusion_threshold"
    default_knob = 0.5
    default_operating_points = (0.5, 0.7, 0.9)

    def __init__(self, build, family, prior_cfg, input_shape, classes, n_train, activation="silu", **zoo_kw):
        """`build(factory, input_shape, classes)` makes the architecture (train/arch.py resolve_arch); a zoo
        name with its keyword arguments (hidden=...) is accepted too."""
        super().__init__()
        build = as_builder(build, **zoo_kw)
        self.family, self.input_shape, self.classes = family, tuple(input_shape), classes
        self._build_plain = lambda: build(LayerFactory("dnn", activation=activation), input_shape, classes)
        if family == "ss-gl":
            self.global_scale = GlobalScale(prior_cfg.a0, prior_cfg.b0)
        elif family == "ss-ghs":
            self.global_scale = GlobalHorseshoeScale(prior_cfg.d0)
        else:
            self.global_scale = None
        # Corollaries 2/4 need every layer's fan-in: read them off the plain twin.
        fan_ins = [m.weight[0].numel() for m in self._build_plain().modules() if isinstance(m, (nn.Linear, nn.Conv2d))]

        def linear_inclusion(fan_in, units):
            return prior_inclusion_probability(fan_in, units, n=n_train, num_hidden=len(fan_ins) - 1,
                                               fan_ins=fan_ins, prior="ss-ig" if family == "bnn" else family,
                                               constant=prior_cfg.inclusion_constant)

        factory = LayerFactory(family, prior_cfg, self.global_scale, linear_inclusion, activation)
        self.net = build(factory, input_shape, classes)

    def forward(self, x):
        return self.net(x)

    # -- the Bayesian interface -------------------------------------------------------------------
    def bayesian_layers(self):
        """(name, layer) of every spike-and-slab layer, in module order."""
        return [(n, m) for n, m in self.net.named_modules() if isinstance(m, SpikeSlabLayer)]

    def kl(self):
        total = sum((layer.kl() for _, layer in self.bayesian_layers()), torch.zeros(()))
        if self.global_scale is not None:
            total = total + self.global_scale.kl()
        return total

    def operating_points(self, values=None):
        """The inclusion thresholds to try; each must lie in (0, 1)."""
        values = list(self.default_operating_points if values is None else values)
        bad = [v for v in values if not 0 < v < 1]
        if bad:
            raise ValueError(f"inclusion thresholds must lie in (0, 1), got {bad}")
        return values

    def set_inclusion_threshold(self, threshold):
        for _, layer in self.bayesian_layers():
            layer.inclusion_threshold = float(threshold)

    @staticmethod
    def _plain_name(name, layer):
        return f"{name}.conv" if layer.norm is not None else name

    def kept_units(self, threshold):
        """{plain Linear/Conv2d name: boolean mask of kept outputs} at this threshold, in module order."""
        bayesian = {self._plain_name(n, m): m.kept_units(threshold) for n, m in self.bayesian_layers()}
        return {name: bayesian.get(name, torch.ones(m.weight.shape[0], dtype=torch.bool))
                for name, m in self._build_plain().named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}

    @torch.no_grad()
    def posterior_sample(self, threshold, generator=None):
        """One posterior sample at an inclusion threshold as a plain module with dense shapes.

        Returns (module, dead_units): rows (and biases) of switched-off units are exactly zero, and so are
        the batch-norm scale and shift of a switched-off channel, so its output is exactly zero.
        """
        plain = self._build_plain()
        own, target = self.net.state_dict(), plain.state_dict()
        # Deterministic parts (batch norms, plain layers) are copied by name.
        plain.load_state_dict({k: (own[k] if k in own and own[k].shape == v.shape else v) for k, v in target.items()})
        kept = {n: torch.ones(m.weight.shape[0], dtype=torch.bool)
                for n, m in plain.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}
        for name, layer in self.bayesian_layers():
            weight, bias, out_scale = layer.sample_weights(generator)
            keep = layer.kept_units(threshold)
            affine = plain.get_submodule(self._plain_name(name, layer))
            affine.weight.copy_(weight * layer._per_group(keep.to(weight.dtype)))
            if bias is not None:
                affine.bias.copy_(bias * keep)
            if layer.norm is not None:
                norm = plain.get_submodule(f"{name}.norm")
                scale = keep if out_scale is None else keep * out_scale   # tau* after the batch norm
                norm.weight.mul_(scale)
                norm.bias.mul_(scale)
            kept[self._plain_name(name, layer)] = keep.cpu()
        return plain.cpu().eval(), kept


def build_model(model_cfg, prior_cfg, input_shape, classes, n_train):
    """Builder function: config -> network of the configured family and architecture.

    The nested families need their own config section and training batches: train/nested.py build_nested."""
    return BayesianNet(resolve_arch(model_cfg), model_cfg.family, prior_cfg, input_shape, classes, n_train,
                       activation=model_cfg.activation)
