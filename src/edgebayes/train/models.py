"""The networks of the families built by the layer factory, with the interface later stages rely on.

`BayesianNet` (dnn, bnn and the spike-and-slab families of paper 000) and `NestedNet` (bn3, fn3 of
paper 002) wrap an architecture built by `LayerFactory` (train/layers.py) and answer the posterior-net
interface (train/families.py, PosteriorNet):
  - `kl()`: the KL term of the negative ELBO;
  - `knob` (inclusion threshold, width), `default_knob`, `operating_points(values)`;
  - `posterior_sample(knob_value, generator)`: one posterior sample as a *plain* module, the same
    architecture built by the dnn factory with the sampled weights copied in (rows of switched-off units
    exactly zero), plus the "dead units" description that surgery uses: {qualified name of each Linear /
    Conv2d in the plain module: boolean mask of its kept outputs}.
SQS (paper 001) wraps a trained plain network instead: train/sqs.py.
"""

import numpy as np
import torch
from torch import nn

from edgebayes.train.arch import as_builder, resolve_arch
from edgebayes.train.bayesianize import load_matching
from edgebayes.train.layers import ConvNorm, LayerFactory
from edgebayes.train.nested import NESTED_FAMILIES, NestedLayer, OrderingUnit, gumbel_uniforms, recollect_batch_norm
from edgebayes.train.spike_slab import (
    GlobalHorseshoeScale,
    GlobalScale,
    SpikeSlabLayer,
    prior_inclusion_probability,
)


NO_KNOB = "none"   # the knob of a family that has no deploy-time choice (summary.point_label)
UNPRUNED_FAMILIES = ("dnn", "bnn")   # no inclusion variables: nothing is switched off


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
        if family in UNPRUNED_FAMILIES:   # no inclusion variables: one network, whatever the threshold
            self.knob, self.default_operating_points = NO_KNOB, (self.default_knob,)
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
        """The inclusion thresholds to try; each must lie in (0, 1). A family without inclusion variables has
        the one network (select.knob_values, written for another family, changes nothing)."""
        if self.knob == NO_KNOB:
            return list(self.default_operating_points)
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
        # Deterministic parts (batch norms, plain layers) are copied by name.
        load_matching(plain, self.net.state_dict())
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


# ---------------------------------------------------------------------------------------------
# The network
# ---------------------------------------------------------------------------------------------
class NestedNet(nn.Module):
    """A nested network (BN3 or FN3, train/nested.py) with the interface of the later stages (module docstring).

    knob = width, the number of groups kept in every nested layer (1..D); operating points are widths.
    `calibration_x` holds the training inputs whose batches recollect the batch-norm statistics of every
    posterior sample (not saved in checkpoints: the family registry's build takes them from the training split again).
    """

    knob = "width"

    def __init__(self, build, family, nested_cfg, input_shape, classes, activation="silu", calibration_x=None,
                 bn_batch_size=512, **zoo_kw):
        """`build(factory, input_shape, classes)` makes the architecture (train/arch.py resolve_arch); a zoo
        name with its keyword arguments (hidden=...) is accepted too."""
        super().__init__()
        build = as_builder(build, **zoo_kw)

        if family not in NESTED_FAMILIES:
            raise ValueError(f"unknown nested family {family!r}; expected one of {NESTED_FAMILIES}")
        self.family, self.input_shape, self.classes = family, tuple(input_shape), classes
        self.groups, self.fixed_groups = nested_cfg.groups, nested_cfg.fixed_groups
        self.temperature, self.temperature_min = nested_cfg.temperature, nested_cfg.temperature_min
        self.default_knob = self.groups
        self.bn_batch_size = bn_batch_size
        self._build_plain = lambda: build(LayerFactory("dnn", activation=activation), input_shape, classes)
        self.net = build(LayerFactory(family, nested_cfg=nested_cfg, activation=activation), input_shape, classes)
        self.register_buffer("calibration_x", calibration_x, persistent=False)
        self.set_temperature(self.temperature)
        # Batch norms in training mode see one sub-network per batch, not a mixture (train/nested.py).
        with_norms = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.net.modules())
        for _, layer in self.nested_layers():
            layer.mask_per_batch = with_norms
        # The running statistics of training are a blend over the sub-networks drawn: the per-epoch validation
        # recollects them at the width, as compress does (trainer.ELBO.validate).
        self.validate_compressed = with_norms and calibration_x is not None
        self.shared_draw = nested_cfg.shared_draw
        self._order_init = (nested_cfg.mubar_init, nested_cfg.prior_keep_logit,
                            nested_cfg.target_width_probability)
        self.configured_fixed_groups = nested_cfg.fixed_groups   # the narrowest any target may serve from: + 1
        # The narrowest width trained (serve_from), saved with the weights: a checkpoint's ordering units are
        # that long, so a net built from the config takes the saved width before loading them.
        self.register_buffer("narrowest_width", torch.tensor(self.fixed_groups + 1))
        self.register_load_state_dict_pre_hook(NestedNet._take_saved_width)

    def forward(self, x):
        ordered = [m for _, m in self.nested_layers() if m.nested] if self.training and self.shared_draw else []
        if ordered:   # one Gumbel draw for every layer in a training step (train/nested.py)
            draws = {}   # per number of ordered groups K (the same in every layer the factory builds)
            for layer in ordered:
                k = layer.ordering.k
                if k not in draws:
                    draws[k] = gumbel_uniforms((1 if layer.mask_per_batch else x.shape[0], k), layer.theta)
                layer.shared_uniforms = draws[k]
            try:
                return self.net(x)
            finally:   # not kept beyond the step: a deep copy or a later step never sees this one's draws
                for layer in ordered:
                    layer.shared_uniforms = None
        return self.net(x)

    def nested_layers(self):
        """(name, layer) of every variational / nested layer, in module order."""
        return [(n, m) for n, m in self.net.named_modules() if isinstance(m, NestedLayer)]

    bayesian_layers = nested_layers   # the name the trainer's per-epoch record reads

    def set_rescale(self, rescale):
        """Test-time rescaling of kept channels by P(z_j = 1) (appendix 8.2) on or off (train/nested.py)."""
        for _, layer in self.nested_layers():
            layer.rescale = bool(rescale)

    def kl(self):
        return sum((layer.kl() for _, layer in self.nested_layers()), torch.zeros((), device=self._device()))

    def _device(self):
        return next(self.parameters()).device

    # -- training schedule ----------------------------------------------------------------------
    def temperature_at(self, epoch, epochs):
        """Exponential annealing from nested.temperature (first epoch) to nested.temperature_min (last)."""
        progress = epoch / max(1, epochs - 1)
        return self.temperature * (self.temperature_min / self.temperature) ** progress

    def set_temperature(self, tau):
        for _, layer in self.nested_layers():
            layer.temperature = float(tau)

    def start_epoch(self, epoch, epochs):
        """Called by the trainer before each epoch (0-based): anneal the Downhill temperature."""
        self.set_temperature(self.temperature_at(epoch, epochs))

    def serve_from(self, width):
        """Train and serve widths `width`..D only: the first width - 1 groups of every nested layer become fixed
        groups (always kept) and each ordering unit orders the rest, restarted at its initial distribution, with
        nested.target_width_probability on this width in the prior and in q.

        What train.flops_target does for a nested family (train/nested.py): a trained network fine-tuned
        for a few epochs keeps a narrow width only if its steps train that width, and widths narrower than the
        user's target are never deployed. That width becomes the default knob too: it is the network the
        training made (the wider ones get 1 - target_width_probability of the steps), so the trainer validates
        it, the train stage reports it and eb.compress(net) ships it; before, they took the full width, whose
        FLOPs are the dense network's (a user's `compress(net)` after a fit to 0.3 shipped 1.0)."""
        width = int(width)
        if not 1 <= width <= self.groups - 1:
            raise ValueError(f"the narrowest width served must lie in 1..{self.groups - 1} (D - 1: one group "
                             f"ordered), got {width}")
        mubar_init, prior_keep_logit, target_width_probability = self._order_init
        for _, layer in self.nested_layers():
            if layer.nested:
                learned = layer.ordering.learned
                layer.fixed_groups = width - 1
                layer.ordering = OrderingUnit(self.groups - layer.fixed_groups, mubar_init, prior_keep_logit,
                                              learned, target_width_probability).to(layer.theta.device)
        self.fixed_groups = width - 1
        self.narrowest_width.fill_(width)
        self.default_knob = width
        return self

    def _take_saved_width(self, state, prefix, *args):   # load_state_dict's pre-hook: (module, state, prefix, ...)
        saved = state.get(prefix + "narrowest_width")
        if saved is None:   # saved before the narrowest width was kept: it served every width from F + 1
            state[prefix + "narrowest_width"] = self.narrowest_width.clone()
        elif int(saved) != int(self.narrowest_width):
            self.serve_from(int(saved))

    # -- the deploy interface ---------------------------------------------------------------------
    def set_width(self, width):
        for _, layer in self.nested_layers():
            layer.width = int(width)

    def untrained_widths(self, widths):
        """The widths of `widths` that no training step served: F or fewer groups, where F is nested.fixed_groups,
        or train.flops_target's width - 1 once serve_from raised it (select leaves them out and says so)."""
        return [w for w in widths if w <= self.fixed_groups]

    def operating_points(self, values=None):
        """The widths to try: integers in 1..D. Default: 8 widths spread over F+1..D (D included)."""
        if values is None:
            return sorted({int(round(v)) for v in np.linspace(self.fixed_groups + 1, self.groups, 8)})
        bad = [v for v in values if v != int(v) or not 1 <= v <= self.groups]
        if bad:
            raise ValueError(f"widths must be whole numbers of groups in 1..{self.groups}, got {bad}")
        return [int(v) for v in values]

    @staticmethod
    def _plain_name(name, layer):
        return f"{name}.conv" if layer.norm is not None else name

    def _truncated(self):
        """{plain name of a layer: the nested layer whose mask also drops its output channels}."""
        names = {id(m): n for n, m in self.nested_layers()}
        return {self._plain_name(names[id(layer.truncates)], layer.truncates): layer
                for _, layer in self.nested_layers() if layer.truncates is not None}

    def kept_units(self, width):
        """{plain Linear/Conv2d name: boolean mask of kept outputs} at this width, in module order."""
        own = {self._plain_name(n, m): m.kept_channels(width).cpu() for n, m in self.nested_layers()}
        own.update({name: layer.kept_channels(width).cpu() for name, layer in self._truncated().items()})
        return {name: own.get(name, torch.ones(m.weight.shape[0], dtype=torch.bool))
                for name, m in self._build_plain().named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}

    @torch.no_grad()
    def posterior_sample(self, width, generator=None):
        """One posterior sample at a width as a plain module with dense shapes, and its kept masks.

        Weights drawn once (eq. 17), channels beyond the width exactly zero (weights, bias and batch-norm
        scale and shift), kept channels scaled by P(z_j = 1), batch-norm statistics recollected.
        """
        width = self.operating_points([width])[0]
        plain = self._build_plain()
        load_matching(plain, self.net.state_dict())
        for name, layer in self.nested_layers():
            affine = plain.get_submodule(self._plain_name(name, layer))
            scale = layer.channel_scale(width)
            weight = layer.sample_weight(generator).to(affine.weight.device)
            if layer.norm is None:   # scale folded into the affine map
                affine.weight.copy_(weight * scale.view((-1,) + (1,) * (weight.dim() - 1)))
                if layer.bias is not None:
                    affine.bias.copy_(layer.bias * scale)
            else:                    # scale after the batch norm: folded into its affine parameters
                keep = layer.kept_channels(width).to(weight.dtype)
                affine.weight.copy_(weight * keep.view((-1,) + (1,) * (weight.dim() - 1)))
                if layer.bias is not None:
                    affine.bias.copy_(layer.bias * keep)
                norm = plain.get_submodule(f"{name}.norm")
                norm.weight.mul_(scale)
                norm.bias.mul_(scale)
        for name, layer in self._truncated().items():   # e.g. MobileNetV2's expand conv before a depthwise
            drop_outputs(plain, name, layer.kept_channels(width))
        if self.calibration_x is not None:
            recollect_batch_norm(plain, self.calibration_x.cpu(), self.bn_batch_size)
        return plain.cpu().eval(), self.kept_units(width)


@torch.no_grad()
def drop_outputs(plain, name, keep):
    """Zero, in place, the outputs of Linear / Conv2d `name` of a plain twin that the boolean mask `keep`
    leaves out: their weights' rows and biases, and the scale and shift of the batch norm of a ConvNorm, so
    that they are exactly zero and surgery can cut them."""
    affine = plain.get_submodule(name)
    keep = keep.to(affine.weight.dtype)
    affine.weight.mul_(keep.view((-1,) + (1,) * (affine.weight.dim() - 1)))
    if affine.bias is not None:
        affine.bias.mul_(keep)
    parent, _, child = name.rpartition(".")
    owner = plain.get_submodule(parent) if parent else plain
    if isinstance(owner, ConvNorm) and child == "conv":   # not any module named conv: densenet's transition
        owner.norm.weight.mul_(keep)                      # conv has a sibling `norm` that reads its input
        owner.norm.bias.mul_(keep)


def build_model(model_cfg, prior_cfg, input_shape, classes, n_train):
    """config sections -> BayesianNet of the configured family (dnn, bnn, ss-*) and architecture, untrained.

    The registry (train/families.py) builds every family; this is its BayesianNet case, also used for the
    plain dnn that SQS starts from."""
    return BayesianNet(resolve_arch(model_cfg), model_cfg.family, prior_cfg, input_shape, classes, n_train,
                       activation=model_cfg.activation)
