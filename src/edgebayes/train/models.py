"""Architectures, built from one layer factory so a single definition serves every family.

`layer_factory(family, ...)` is the one switch (as in timm) that decides which layer type a whole
architecture is built from: a plain `nn.Linear` for the deterministic net, a spike-and-slab layer for
SS-IG / SS-GL. The architectures below only call the factory.

Every Bayesian network answers the interface that the later stages rely on (../shared/DESIGN.md):
  - `kl()`: the KL term of the negative ELBO;
  - `knob`: the name of its deploy-time knob (here the inclusion threshold), `default_knob` and
    `operating_points(values)`: the knob values to try (checked), the model's defaults when values is None;
  - `posterior_sample(knob_value, generator)`: one posterior sample as a plain torch module
    (nn.Linear / activations) with dense shapes, plus the "dead units" description that surgery uses:
    {qualified name of a layer in the plain module: boolean mask of its kept output units}.
"""

from collections import OrderedDict
from functools import partial

import torch
from torch import nn

from edgebayes.train.spike_slab import (
    PRIORS,
    GlobalScale,
    SpikeSlabLayer,
    SpikeSlabLinear,
    prior_inclusion_probability,
)

FAMILIES = ("dnn",) + PRIORS
ACTIVATIONS = {"silu": nn.SiLU, "relu": nn.ReLU, "tanh": nn.Tanh}


def layer_factory(family, prior_cfg, global_scale=None):
    """Return `make_linear(in_features, out_features, prunable, prior_inclusion)` for a family."""
    if family == "dnn":
        return lambda i, o, prunable=False, prior_inclusion=1.0: nn.Linear(i, o)
    if family not in PRIORS:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    common = dict(prior=family, sigma0_sq=prior_cfg.sigma0_sq, temperature=prior_cfg.temperature,
                  gamma_init=prior_cfg.gamma_init, global_scale=global_scale)
    return lambda i, o, prunable, prior_inclusion: SpikeSlabLinear(
        i, o, prunable=prunable, prior_inclusion=prior_inclusion, **common)


class MLP(nn.Module):
    """Multilayer perceptron: Flatten -> [Linear -> activation] x hidden -> Linear (paper 000: 2x400, SiLU)."""

    knob = "inclusion_threshold"
    default_knob = 0.5
    default_operating_points = (0.5, 0.7, 0.9)

    def __init__(self, in_features, hidden, classes, *, family="ss-gl", prior_cfg=None, activation="silu",
                 n_train=60000):
        super().__init__()
        self.family, self.in_features, self.hidden, self.classes = family, in_features, list(hidden), classes
        self.activation_name = activation
        self.global_scale = GlobalScale(prior_cfg.a0, prior_cfg.b0) if family == "ss-gl" else None
        make_linear = layer_factory(family, prior_cfg, self.global_scale)
        widths = [in_features] + self.hidden + [classes]
        fan_ins = widths[:-1]
        inclusion = partial(prior_inclusion_probability, n=n_train, num_hidden=len(self.hidden),
                            fan_ins=fan_ins, prior=family,
                            constant=getattr(prior_cfg, "inclusion_constant", 1e-9))
        layers = []
        for i, (fan_in, units) in enumerate(zip(widths[:-1], widths[1:])):
            is_output = i == len(widths) - 2
            lam = 1.0 if (is_output or family == "dnn") else inclusion(fan_in, units)
            layers.append(make_linear(fan_in, units, prunable=not is_output, prior_inclusion=lam))
        self.layers = nn.ModuleList(layers)
        self.act = ACTIVATIONS[activation]()

    def forward(self, x):
        x = x.flatten(1)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = self.act(x)
        return x

    # -- the Bayesian interface -------------------------------------------------------------------
    def bayesian_layers(self):
        return [m for m in self.layers if isinstance(m, SpikeSlabLayer)]

    def kl(self):
        total = sum(layer.kl() for layer in self.bayesian_layers())
        if self.global_scale is not None:
            total = total + self.global_scale.kl()
        return torch.as_tensor(total)

    def operating_points(self, values=None):
        """The inclusion thresholds to try; each must lie in (0, 1)."""
        values = list(self.default_operating_points if values is None else values)
        bad = [v for v in values if not 0 < v < 1]
        if bad:
            raise ValueError(f"inclusion thresholds must lie in (0, 1), got {bad}")
        return values

    def layer_names(self):
        return [f"hidden{i + 1}" for i in range(len(self.hidden))] + ["output"]

    def set_inclusion_threshold(self, threshold):
        for layer in self.bayesian_layers():
            layer.inclusion_threshold = float(threshold)

    def kept_units(self, threshold):
        """{layer name: boolean mask of kept output units} at this threshold (the output layer keeps all)."""
        out = {}
        for name, layer in zip(self.layer_names(), self.layers):
            if isinstance(layer, SpikeSlabLayer):
                out[name] = layer.kept_units(threshold)
            else:
                out[name] = torch.ones(layer.out_features, dtype=torch.bool, device=layer.weight.device)
        return out

    @torch.no_grad()
    def posterior_sample(self, threshold, generator=None):
        """One posterior sample at an inclusion threshold as a plain nn.Sequential with dense shapes.

        Rows (and biases) of dropped units are exactly zero. Returns (module, dead_units) where
        dead_units maps the name of each Linear in the module (hidden1, ..., output) to the boolean mask
        of its kept outputs.
        """
        modules, keep = [("flatten", nn.Flatten())], {}
        for i, (name, layer) in enumerate(zip(self.layer_names(), self.layers)):
            linear = nn.Linear(layer.in_features, layer.out_features)
            if isinstance(layer, SpikeSlabLayer):
                weight, bias = layer.sample_weights(generator)
                mask = layer.kept_units(threshold)
            else:
                weight, bias = layer.weight, layer.bias
                mask = torch.ones(layer.out_features, dtype=torch.bool, device=weight.device)
            linear.weight.copy_(weight * mask[:, None])
            linear.bias.copy_(bias * mask)
            keep[name] = mask.cpu()
            modules.append((name, linear))
            if i < len(self.layers) - 1:
                modules.append((f"act{i + 1}", ACTIVATIONS[self.activation_name]()))
        return nn.Sequential(OrderedDict(modules)).cpu().eval(), keep


def build_model(model_cfg, prior_cfg, in_features, classes, n_train):
    """Builder function: config -> network (one architecture for now: the MLP)."""
    if model_cfg.arch != "mlp":
        raise ValueError(f"unknown architecture {model_cfg.arch!r}; available: mlp")
    return MLP(in_features, model_cfg.hidden, classes, family=model_cfg.family, prior_cfg=prior_cfg,
               activation=model_cfg.activation, n_train=n_train)
