"""Node- and channel-wise spike-and-slab layers of paper 000 (SS-IG, SS-GL, SS-GHS).

A group is one output unit's incoming weights plus its bias: a row of a Linear weight, one output filter of
a Conv2d. Per group j of layer l:

    prior      z_j ~ Ber(lambda_l);   w_j | z_j = 1 ~ N(0, sigma0^2 tau*_j^2 I);   w_j | z_j = 0 = 0
    posterior  q(z_j) = Ber(gamma_j); q(w_j | z_j = 1) = N(mu_j, diag sigma_j^2), sigma = softplus(rho)

The slab scale tau*^2 is what tells the priors apart (`SCALES`):
  - SS-IG:  tau*^2 = 1 (plain Gaussian slab, the baseline);
  - SS-GL:  tau*^2 = tau_j^2 ~ Gamma(k_l/2 + 1, rate varsigma^2/2), varsigma^2 ~ Gamma(a0, b0) (eq. 9);
  - SS-GHS: tau*^2 = tau~_j^2 varsigma^2 = c^2 tau_j^2 varsigma^2 / (c^2 + tau_j^2 varsigma^2), the regularized
    group horseshoe (eq. 11), with the half-Cauchys written as products (eq. 12):
    tau_j^2 = beta_j alpha_j, beta ~ IG(1/2, 1), alpha ~ Gamma(1/2, 1); varsigma^2 = zeta_a zeta_b,
    zeta_b ~ IG(1/2, 1), zeta_a ~ Gamma(1/2, rate 1/d0^2) (the paper writes G(1/2, d0^2) with d0^2 as scale;
    the paper's d0^2 = 1 makes both readings equal).
Every scale variable has a LogNormal posterior (eq. 10, 13); varsigma^2 is one variable for the whole
network, owned by the network (`GlobalScale`, `GlobalHorseshoeScale`), which adds its KL once.

Negative ELBO term of a layer (appendix E.1, F.1):
    sum_j gamma_j E_q(scale)[KL(N(mu_j, sigma_j^2) || N(0, sigma0^2 tau*_j^2))] + KL(Ber(gamma_j) || Ber(lambda_l))
    + KL of the scale variables.
The expectation needs E[log tau*^2] and E[1/tau*^2]. Both are closed form for SS-GL. For SS-GHS,
E[1/tau*^2] = E[1/(beta alpha zeta_a zeta_b)] + 1/c^2 is closed form and E[log(c^2 + beta alpha varsigma^2)] is
not: it is estimated with reparameterized samples (one per step in training), unbiased and differentiable.

Non-centered parameterization (section 5.3, used for ResNets): w_j = z_j tau*_j w0_j with pi(w0_j) = N(0, sigma0^2 I)
and q(w0_j) = N(mu_j, diag sigma_j^2), neither conditioned on z_j; tau*_j is sampled (reparameterized) in the
forward pass. The exact KL of this family is KL(q(z)) + KL(q(w0)) + KL(q(scale)) with the KL of w0 NOT
weighted by gamma_j: w0 is a latent variable whether the unit is on or off, and pi(w0) and q(w0) do not depend
on z. (In the centered form q(w_j | z_j = 0) = pi(w_j | z_j = 0) = delta_0, hence the weight gamma_j there.)
A public implementation of the paper's non-centered layers computes it the same way. What this changes in
training (issue 20): in the centered form a unit's slab KL, about log(sigma0 / sigma) nats per weight (5.5 at
initialisation, times the fan-in), pushes its gamma down at every step; in the non-centered form switching a
unit off saves only its Bernoulli KL, so the inclusion probabilities are not driven below 0.5 together
(measured on LeNet-5-Caffe: none fell below 0.98 in 10 epochs, benchmarks/results/inclusion_collapse_*).
In a layer with a batch norm, tau*_j multiplies the batch-norm output, tau*_j BN(conv(x; w0)), not the
convolution output: batch norm in training mode divides by the batch's own scale of each channel, so
BN(tau* conv(x)) = BN(conv(x)) and tau* (hence the shrinkage prior) would get no likelihood gradient
(issue 20: 1e-4 against about 140 for the weights); SS-GL / SS-GHS would be SS-IG. After the batch norm the
scale acts on the channel as z does; without a batch norm both places are the same.

Training forward: z from the relaxed Bernoulli with a hard forward pass (temperature 0.5), weights through
local reparameterization. Evaluation forward: z = 1[gamma > inclusion threshold] (the median model at 0.5,
what export deploys) and one weight sample per call, so a call is one coherent posterior sample; with
`sample_inclusion` set (trainer.sampled_inclusion) z ~ Ber(gamma) is drawn per call instead, which is
the paper's posterior-mean estimator of accuracy. The output layer is never pruned (lambda = gamma = 1).

Deviation, for exact surgery: a layer may own a batch norm (`norm`), and then the node indicator
multiplies the batch-norm output, z * BN(conv(x)), not the convolution output. With z on the convolution
output, a switched-off channel would leave BN's constant shift behind (BN(0) = beta - gamma mu / sigma) and
could not be removed without changing the network; with z after BN it is exactly zero.

The dense mean-field Gaussian BNN (the paper's dense baseline) is the SS-IG layer with prunable=False.
"""

import math
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.nn.modules.utils import _pair

from edgebayes.train.accel import in_layout, memory_format_of

from edgebayes.train.kl import (
    kl_bernoulli,
    kl_gaussian_groups,
    kl_lognormal_gamma,
    kl_lognormal_invgamma,
    relaxed_bernoulli_hard,
)

PRIORS = ("ss-ig", "ss-gl", "ss-ghs")

# layer -> (weight_rho's version, softplus(weight_rho)) of its last training forward: SpikeSlabLayer._weight_sigma
_SIGMA = weakref.WeakKeyDictionary()

# sigma = softplus(rho) with rho = -6 at init keeps the initial weights at their Kaiming-uniform means
# (paper 000, appendix A.2).
RHO_INIT = -6.0


def _lognormal_sample(mu, rho, generator=None, n=None):
    """A reparameterized sample of log x for x ~ LN(mu, softplus(rho)^2); n draws stacked on dim 0 if given."""
    shape = mu.shape if n is None else (n,) + tuple(mu.shape)
    eps = torch.randn(shape, generator=generator, dtype=mu.dtype, device=mu.device)
    return mu + F.softplus(rho) * eps


def _inverse_mean(mu, rho):
    """E[1/x] for x ~ LN(mu, softplus(rho)^2)."""
    return torch.exp(-mu + 0.5 * F.softplus(rho) ** 2)


def standard_normal_like(t):
    """torch.randn_like(t), but a channels_last t gets its draws in memory order: torch's CPU normal_ is
    vectorized only for contiguous tensors, and on a channels_last convolution output it was 5-8x slower (most
    of a ResNet-20 step, issue 20). The same law: every element an independent N(0, 1) draw."""
    return normal_in_memory_order_(torch.empty_like(t))


def normal_in_memory_order_(t):
    """Fill a dense tensor (contiguous or channels_last) with N(0, 1) draws in memory order, in place."""
    (t.permute(0, 2, 3, 1) if memory_format_of(t) is torch.channels_last else t).normal_()
    return t


# The CPU training forward works on blocks of the batch of about this many output elements: a block's mean,
# variance, noise and output (2 MiB each in fp32) stay in cache (L2 / L3) from the affine op that writes them to
# the last elementwise step that reads them (_LocalReparameterization). Measured on LeNet-5-Caffe at batch
# 1024 (one thread, issue 20): 2^15 made the step slower than no blocks (each block's convolution has a fixed
# cost), 2^17 was 7 % faster than no blocks, 2^19 and 2^21 about 12 %. On a GPU the batch is one block.
BLOCK_ELEMENTS = 2**19


def batch_blocks(samples, outputs_per_sample, device):
    """[(start, stop)] of the blocks of a batch: whole samples, about BLOCK_ELEMENTS outputs each (at least one
    sample), the last block the remainder."""
    if device.type != "cpu":
        return [(0, samples)]
    size = max(1, BLOCK_ELEMENTS // max(1, outputs_per_sample))
    return [(i, min(i + size, samples)) for i in range(0, samples, size)]


# The affine ops' geometry, which _LocalReparameterization asks its layer for (`_outputs_per_sample`,
# `_affine_backward`): shared by the spike-and-slab layers and the nested ones (train/nested.py).
def linear_outputs_per_sample(x, in_features, out_features):
    return x[0].numel() // in_features * out_features


def linear_backward(x, weight, grad, needs):
    """(d/dx, d/dweight, d/dbias) of F.linear(x, weight, bias) for the output gradient `grad` (any leading
    dimensions); None where `needs` says not needed."""
    out_features, in_features = weight.shape
    g2, x2 = grad.reshape(-1, out_features), x.reshape(-1, in_features)
    return ((grad @ weight) if needs[0] else None, (g2.t() @ x2) if needs[1] else None,
            g2.sum(0) if needs[2] else None)


def conv2d_outputs_per_sample(x, out_channels, kernel_size, stride, padding, dilation=1):
    (sh, sw), (ph, pw), (kh, kw), (dh, dw) = _pair(stride), _pair(padding), _pair(kernel_size), _pair(dilation)
    return (out_channels * ((x.shape[-2] + 2 * ph - dh * (kh - 1) - 1) // sh + 1)
            * ((x.shape[-1] + 2 * pw - dw * (kw - 1) - 1) // sw + 1))


def conv2d_backward(x, weight, grad, needs, stride, padding, groups, dilation=1):
    """(d/dx, d/dweight, d/dbias) of F.conv2d(x, weight, bias, stride, padding, dilation, groups) for the output
    gradient `grad`; None where `needs` says not needed."""
    return torch.ops.aten.convolution_backward(
        grad, x, weight, [weight.shape[0]], list(_pair(stride)), list(_pair(padding)), list(_pair(dilation)),
        False, [0, 0], groups, list(needs))


class _LocalReparameterization(torch.autograd.Function):
    """unit * (mean + sqrt(var + 1e-16) eps), eps ~ N(0, 1): local reparameterization, with
    mean = affine(x; weight_mu, bias_mu), var = affine(x^2; weight_var, bias_var) and a per-unit factor `unit`
    (z tau*, or None), computed one block of the batch at a time (batch_blocks).

    Why blocks: as separate autograd ops every step (the two affine outputs, the noise, the square root, the
    sum, the unit factor; as many again backward) is a pass over the layer's whole output, which on a CPU
    comes from memory each time (47 MB for LeNet-5-Caffe's first convolution at batch 1024). Per block
    everything after the affine ops stays in cache, and the backward runs the same way: the block's
    gradients of mean and var, then each affine op's backward (`_affine_backward`). x^2 is not kept: it is
    recomputed per block, and its gradient 2 x g joins x's in the same pass.

    Why the unit factor goes into the weights: unit * mean is the affine map of the scaled weights
    (unit_j w_j, unit_j b_j), so the forward only scales std by the unit (in cache, in the block), and the
    backward needs no product g * unit (the weights' gradients are unit_j times the unscaled ones: weight-sized work). The
    unit factor's own gradient, sum g * (mean + std eps) over the unit's outputs, then comes from the weights'
    gradients as well, by linearity of the affine maps: sum g mean_j = <dL/dw'_j, w_j> + dL/db'_j b_j, and
    sum g std_j eps_j = sum (g eps / std) var_j = <G_j, w_var_j> + G_b_j (b_var_j + 1e-16), with G the gradients
    of the var map for the output gradient g eps / std. So no output before the unit factor is kept
    (LeNet-5-Caffe's first convolution: 47 MB written and read back per step).

    Two passes fewer per block: the 1e-16 under the root is the var map's bias (b_var + 1e-16, or 1e-16 where the
    layer has none), added by the affine op itself; and the backward's eps / (2 std) is kept as eps / std, the
    1/2 applied to the var map's weight-sized gradients (and x's gradient through x^2, 2 x g_sq, taken as x g_sq).

    A per-example factor `example_unit` (BN3's nested mask, one per example: train/nested.py; or None),
    broadcastable to the output with the batch on dim 0, multiplies each block in cache as well: as an autograd
    op after this one it was one more pass over the whole output forward and two backward (the product, and
    the factor's gradient sum g * pre over each example's outputs). It cannot go into the weights, so the
    output before it (pre) is kept for its gradient, as autograd's product kept it.

    The same value and gradients as the autograd graph of the plain expression with the same noise
    (tests/test_spike_slab.py, tests/test_nested.py); the noise is drawn block after block, each in memory
    order. Kept for the backward: eps / sqrt(var + 1e-16), and pre where there is a per-example factor.
    """

    @staticmethod
    def forward(ctx, layer, x, weight_mu, bias_mu, weight_var, bias_var, unit, example_unit):
        n = x.shape[0]
        blocks = batch_blocks(n, layer._outputs_per_sample(x), x.device)
        unit_view = None if unit is None else layer._unit_view(unit, x.dim())
        mean_w, mean_b = _scaled_by_unit(layer, weight_mu, bias_mu, unit)
        var_b = (torch.full((weight_var.shape[0],), 1e-16, dtype=weight_var.dtype, device=weight_var.device)
                 if bias_var is None else bias_var + 1e-16)   # var + 1e-16 by the affine op (class docstring)
        out = eps_over_std = pre = None
        for start, stop in blocks:
            xb = x[start:stop]
            mean = layer._affine(xb, mean_w, mean_b)
            std = layer._affine(xb * xb, weight_var, var_b).sqrt_()
            if out is None:   # the whole output's buffers, in the layout and dtype of the affine op's output
                like = dict(dtype=mean.dtype, device=mean.device, memory_format=memory_format_of(mean))
                full = (n,) + mean.shape[1:]
                eps_over_std = torch.empty(full, **like)
                dtype = mean.dtype if unit is None else torch.promote_types(mean.dtype, unit.dtype)
                out = torch.empty(full, **{**like, "dtype": dtype})
                if example_unit is not None:
                    pre = out
                    out = torch.empty(full, **{**like, "dtype": torch.promote_types(dtype, example_unit.dtype)})
            eps = normal_in_memory_order_(eps_over_std[start:stop])
            written = (out if pre is None else pre)[start:stop]
            torch.addcmul(mean, std if unit is None else std * unit_view, eps, out=written)
            if pre is not None:
                torch.mul(written, example_unit[start:stop], out=out[start:stop])
            eps.div_(std)   # in place: eps is not needed any more
        ctx.layer, ctx.blocks = layer, blocks
        ctx.save_for_backward(x, weight_mu, bias_mu, weight_var, var_b, unit, eps_over_std, example_unit, pre)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight_mu, bias_mu, weight_var, var_b, unit, eps_over_std, example_unit, pre = ctx.saved_tensors
        _, need_x, need_mu, need_bias_mu, need_var, need_bias_var, need_unit, need_example = ctx.needs_input_grad
        layer, dtype = ctx.layer, eps_over_std.dtype   # dtype: the affine ops' (bf16 under autocast)
        # The gradients of the unscaled weights' maps (class docstring); the unit factor's needs them all
        need_mu, need_var = need_mu or need_unit, need_var or need_unit
        need_bias_mu = bias_mu is not None and (need_bias_mu or need_unit)
        need_bias_var = need_bias_var or need_unit   # var_b: b_var + 1e-16, or 1e-16
        mean_w, _ = _scaled_by_unit(layer, weight_mu, None, unit)
        var_w, _ = _scaled_by_unit(layer, weight_var, None, unit)   # x's gradient through var sees unit too
        grad_x = torch.empty_like(x) if need_x else None
        g_example = torch.empty_like(example_unit) if need_example else None
        sums = [None] * 4   # gradients of the maps' weight_mu, bias_mu; weight_var, var_b for g eps / std: per block
        with torch.autocast(grad.device.type, enabled=False):
            for start, stop in ctx.blocks:
                g = grad[start:stop]
                if example_unit is not None:   # the per-example factor's gradient, then g through it (in cache)
                    if need_example:
                        g_example[start:stop] = (g * pre[start:stop]).sum_to_size(g_example[start:stop].shape)
                    g = g * example_unit[start:stop]
                g = g.to(dtype)
                xb = x[start:stop]
                g_var = g * eps_over_std[start:stop]   # twice var's gradient (class docstring)
                gx_mean, g_mu, g_bias_mu = layer._affine_backward(
                    xb.to(dtype), mean_w.to(dtype), g, (need_x, need_mu, need_bias_mu))
                gx_sq, g_var_w, g_bias_var = layer._affine_backward(
                    (xb * xb).to(dtype), var_w.to(dtype), g_var, (need_x, need_var, need_bias_var))
                if need_x:   # d/dx of mean and of var (through x^2: 2 x times half of gx_sq) in one pass
                    torch.addcmul(gx_mean.to(x.dtype), xb, gx_sq.to(x.dtype), out=grad_x[start:stop])
                for i, part in enumerate((g_mu, g_bias_mu, g_var_w, g_bias_var)):
                    if part is not None:
                        sums[i] = part if sums[i] is None else sums[i].add_(part)
        g_mu, g_bias_mu, g_var_w, g_bias_var = (
            None if s is None else s.to(p.dtype) for s, p in zip(sums, (weight_mu, bias_mu, weight_var, var_b)))
        g_unit = None
        if need_unit:   # sum g (mean + std eps) per unit, from the maps' gradients (class docstring)
            within = tuple(range(1, weight_mu.dim()))
            g_unit = (g_mu * weight_mu).sum(within) + (g_var_w * weight_var).sum(within) + g_bias_var * var_b
            if g_bias_mu is not None:
                g_unit = g_unit + g_bias_mu * bias_mu
            g_unit = g_unit.to(unit.dtype)
        # Each parameter's gradient: unit times the map's, and half of it for the var map's (None where not asked)
        want = ctx.needs_input_grad
        g_mu = _scaled_by_unit(layer, g_mu, None, unit)[0] if want[2] else None
        g_var_w = _scaled_by_unit(layer, g_var_w, None, unit)[0].mul_(0.5) if want[4] else None
        g_bias_mu = (g_bias_mu if unit is None else g_bias_mu * unit) if want[3] else None
        g_bias_var = (g_bias_var if unit is None else g_bias_var * unit).mul(0.5) if want[5] else None
        if g_mu is not None:
            g_mu = in_layout(g_mu, weight_mu)
        if g_var_w is not None:
            g_var_w = in_layout(g_var_w, weight_var)
        return None, grad_x, g_mu, g_bias_mu, g_var_w, g_bias_var, g_unit, g_example


def _scaled_by_unit(layer, weight, bias, unit):
    """(unit_j w_j, unit_j b_j): an affine map's weight and bias (or a weight's gradient) scaled per unit."""
    if unit is None or weight is None:
        return weight, bias
    return weight * layer._per_group(unit.to(weight.dtype)), None if bias is None else bias * unit


def local_reparameterization(layer, x, weight_mu, bias_mu, weight_var, bias_var, unit=None, example_unit=None):
    """example_unit * unit * (mean + sqrt(var + 1e-16) eps) of _LocalReparameterization; under torch.compile
    the plain expression, which the compiler fuses itself."""
    if not torch.compiler.is_compiling():
        return _LocalReparameterization.apply(layer, x, weight_mu, bias_mu, weight_var, bias_var, unit,
                                              example_unit)
    mean = layer._affine(x, weight_mu, bias_mu)
    out = mean + torch.sqrt(layer._affine(x * x, weight_var, bias_var) + 1e-16) * standard_normal_like(mean)
    out = out if unit is None else out * layer._unit_view(unit, out.dim())
    return out if example_unit is None else out * example_unit


def scaled_batch_norm(norm, x, unit):
    """unit * norm(x), with a per-channel factor `unit` (or None), in one pass where that is exact.

    A batch norm's training output is gamma x^ + beta with x^ normalised by the batch's own statistics, which
    the factor does not change: so unit * BN(x) = (unit gamma) x^ + unit beta, the factor folded into the
    affine parameters (the module's own forward, which also updates its running statistics, with those
    parameters). Without an affine map, or another kind of norm, the product is taken after it.
    """
    if unit is None:
        return norm(x)
    if (isinstance(norm, (nn.BatchNorm1d, nn.BatchNorm2d)) and norm.affine
            and not torch.compiler.is_compiling()):
        return functional_call(norm, {"weight": norm.weight * unit, "bias": norm.bias * unit}, (x,))
    out = norm(x)
    return out * unit.view((1, -1) + (1,) * (out.dim() - 2))


# ---------------------------------------------------------------------------------------------
# Network-wide scales: one variable shared by every layer
# ---------------------------------------------------------------------------------------------
class GlobalScale(nn.Module):
    """The SS-GL scale varsigma^2: prior Gamma(a0, b0), posterior LN(m, s^2); init m = 1, s = softplus(-6)."""

    def __init__(self, a0: float = 4.0, b0: float = 2.0):
        super().__init__()
        self.a0, self.b0 = float(a0), float(b0)
        self.mu = nn.Parameter(torch.tensor(1.0))
        self.rho = nn.Parameter(torch.tensor(RHO_INIT))

    def rate_moments(self):
        """E[log b] and E[b] for the Gamma rate b = varsigma^2 / 2 under q(varsigma^2)."""
        s = F.softplus(self.rho)
        return self.mu - math.log(2.0), torch.exp(self.mu + 0.5 * s**2) / 2

    def kl(self):
        s = F.softplus(self.rho)
        return kl_lognormal_gamma(self.mu, s, self.a0, math.log(self.b0), self.b0)


class GlobalHorseshoeScale(nn.Module):
    """The SS-GHS scale varsigma^2 = zeta_a zeta_b ~ (C+(0, d0))^2; LN posteriors initialised at m = 1, rho = -6."""

    def __init__(self, d0: float = 1.0):
        super().__init__()
        self.d0 = float(d0)
        self.a_mu = nn.Parameter(torch.tensor(1.0))
        self.a_rho = nn.Parameter(torch.tensor(RHO_INIT))
        self.b_mu = nn.Parameter(torch.tensor(1.0))
        self.b_rho = nn.Parameter(torch.tensor(RHO_INIT))

    def log_mean(self):
        return self.a_mu + self.b_mu

    def inverse_mean(self):
        return _inverse_mean(self.a_mu, self.a_rho) * _inverse_mean(self.b_mu, self.b_rho)

    def log_sample(self, generator=None, n=None):
        return (_lognormal_sample(self.a_mu, self.a_rho, generator, n)
                + _lognormal_sample(self.b_mu, self.b_rho, generator, n))

    def kl(self):
        rate = 1.0 / self.d0**2
        return (kl_lognormal_gamma(self.a_mu, F.softplus(self.a_rho), 0.5, math.log(rate), rate)
                + kl_lognormal_invgamma(self.b_mu, F.softplus(self.b_rho), 0.5, 1.0))


# ---------------------------------------------------------------------------------------------
# Per-group slab scales tau*^2. Each answers: moments() -> (E[log tau*^2], E[1/tau*^2]) per group,
# log_sample() -> a reparameterized sample of log tau*^2 per group, kl() -> KL of its variables.
# ---------------------------------------------------------------------------------------------
class FixedScale(nn.Module):
    """SS-IG (and the dense BNN): tau*^2 = 1."""

    def __init__(self, units, fan_in, global_scale=None, c_reg=1.0):
        super().__init__()
        self.units = units

    def moments(self, mc_samples=1, generator=None):
        zeros = torch.zeros(self.units)
        return zeros, zeros + 1

    def log_sample(self, generator=None):
        return torch.zeros(self.units)

    def kl(self):
        return torch.zeros(())


class GroupLassoScale(nn.Module):
    """SS-GL: tau_j^2 | varsigma^2 ~ Gamma(k_l/2 + 1, rate varsigma^2/2), q(tau_j^2) = LN; mu ~ U(-0.6, 0.6)."""

    def __init__(self, units, fan_in, global_scale=None, c_reg=1.0):
        super().__init__()
        if not isinstance(global_scale, GlobalScale):
            raise ValueError("an SS-GL layer needs the network's GlobalScale")
        self.shape = fan_in / 2 + 1
        self.mu = nn.Parameter(torch.empty(units).uniform_(-0.6, 0.6))
        self.rho = nn.Parameter(torch.full((units,), RHO_INIT))
        self.__dict__["global_scale"] = global_scale  # shared, not a submodule: its KL is added once

    def moments(self, mc_samples=1, generator=None):
        return self.mu, _inverse_mean(self.mu, self.rho)

    def log_sample(self, generator=None):
        return _lognormal_sample(self.mu, self.rho, generator)

    def kl(self):
        e_log_rate, e_rate = self.global_scale.rate_moments()
        return kl_lognormal_gamma(self.mu, F.softplus(self.rho), self.shape, e_log_rate, e_rate).sum()


class GroupHorseshoeScale(nn.Module):
    """SS-GHS: tau*^2 = c^2 beta alpha varsigma^2 / (c^2 + beta alpha varsigma^2); q(beta), q(alpha) = LN."""

    def __init__(self, units, fan_in, global_scale=None, c_reg=1.0):
        super().__init__()
        if not isinstance(global_scale, GlobalHorseshoeScale):
            raise ValueError("an SS-GHS layer needs the network's GlobalHorseshoeScale")
        self.log_c_sq = 2 * math.log(c_reg)
        self.beta_mu = nn.Parameter(torch.empty(units).uniform_(-0.6, 0.6))
        self.beta_rho = nn.Parameter(torch.full((units,), RHO_INIT))
        self.alpha_mu = nn.Parameter(torch.empty(units).uniform_(-0.6, 0.6))
        self.alpha_rho = nn.Parameter(torch.full((units,), RHO_INIT))
        self.__dict__["global_scale"] = global_scale

    def _log_product_sample(self, generator=None, n=None):
        """log(beta alpha varsigma^2): one reparameterized sample per group, or n of them on dim 0."""
        log_global = self.global_scale.log_sample(generator, n)
        return (_lognormal_sample(self.beta_mu, self.beta_rho, generator, n)
                + _lognormal_sample(self.alpha_mu, self.alpha_rho, generator, n)
                + (log_global if n is None else log_global[:, None]))

    def moments(self, mc_samples=1, generator=None):
        e_log_product = self.beta_mu + self.alpha_mu + self.global_scale.log_mean()
        # E[log(c^2 + beta alpha varsigma^2)] has no closed form: Monte Carlo, reparameterized.
        log_products = self._log_product_sample(generator, mc_samples)
        e_log_sum = torch.logaddexp(torch.full_like(log_products, self.log_c_sq), log_products).mean(0)
        e_inv = (_inverse_mean(self.beta_mu, self.beta_rho) * _inverse_mean(self.alpha_mu, self.alpha_rho)
                 * self.global_scale.inverse_mean() + math.exp(-self.log_c_sq))
        return self.log_c_sq + e_log_product - e_log_sum, e_inv

    def log_sample(self, generator=None):
        log_product = self._log_product_sample(generator)
        return self.log_c_sq + log_product - torch.logaddexp(torch.full_like(log_product, self.log_c_sq), log_product)

    def kl(self):
        return (kl_lognormal_invgamma(self.beta_mu, F.softplus(self.beta_rho), 0.5, 1.0)
                + kl_lognormal_gamma(self.alpha_mu, F.softplus(self.alpha_rho), 0.5, 0.0, 1.0)).sum()


SCALES = {"ss-ig": FixedScale, "ss-gl": GroupLassoScale, "ss-ghs": GroupHorseshoeScale}
# the modules whose parameters are the LogNormal posteriors of scale variables (trainer: train.scale_lr)
SCALE_VARIABLES = (GlobalScale, GlobalHorseshoeScale, GroupLassoScale, GroupHorseshoeScale)


# ---------------------------------------------------------------------------------------------
# The layers
# ---------------------------------------------------------------------------------------------
class SpikeSlabLayer(nn.Module):
    """Shared machinery; subclasses define the affine op (`_affine`, its backward `_affine_backward`, its
    `_outputs_per_sample`) and the weight shape (groups on dim 0)."""

    def __init__(self, weight_shape, fan_in, *, prior, prior_inclusion, prunable, sigma0_sq,
                 temperature, gamma_init, global_scale=None, c_reg=1.0, noncentered=False, bias=True,
                 norm=None):
        super().__init__()
        if prior not in PRIORS:
            raise ValueError(f"unknown prior {prior!r}; expected one of {PRIORS}")
        out_units = weight_shape[0]
        self.prior, self.prunable, self.fan_in = prior, prunable, fan_in
        self.sigma0_sq, self.temperature = float(sigma0_sq), float(temperature)
        self.noncentered = bool(noncentered)   # the variational family (module docstring), SS-IG included
        self.prior_inclusion = float(prior_inclusion) if prunable else 1.0
        self.inclusion_threshold = 0.5
        self.sample_inclusion = False  # eval forward: z ~ Ber(gamma) instead of the threshold
        self.unit_kl_factor = None     # per-unit factors of the units' KL during an ordered KL warm-up (trainer)

        self.weight_mu = nn.Parameter(torch.empty(weight_shape))
        self.weight_rho = nn.Parameter(torch.full(weight_shape, RHO_INIT))
        # Kaiming uniform, as nn.Linear / nn.Conv2d initialise (appendix A.2).
        nn.init.kaiming_uniform_(self.weight_mu, a=math.sqrt(5))
        if bias:
            bound = 1 / math.sqrt(fan_in)
            self.bias_mu = nn.Parameter(torch.empty(out_units).uniform_(-bound, bound))
            self.bias_rho = nn.Parameter(torch.full((out_units,), RHO_INIT))
        else:
            self.register_parameter("bias_mu", None)
            self.register_parameter("bias_rho", None)
        if prunable:
            logit = math.log(gamma_init / (1 - gamma_init))
            self.gamma_logit = nn.Parameter(torch.full((out_units,), logit))
        self.scale = SCALES[prior](out_units, fan_in, global_scale, c_reg)
        self.norm = norm  # optional batch norm between the affine op and the node indicator

    @property
    def out_units(self):
        return self.weight_mu.shape[0]

    # -- posterior quantities -------------------------------------------------------------------
    def inclusion_probability(self):
        """gamma_j = q(z_j = 1); exactly 1 for a layer that is never pruned."""
        if not self.prunable:
            return torch.ones(self.out_units, device=self.weight_mu.device)
        return torch.sigmoid(self.gamma_logit)

    def kept_units(self, threshold=None):
        """Units whose inclusion probability exceeds the threshold (the median model at 0.5)."""
        threshold = self.inclusion_threshold if threshold is None else threshold
        return self.inclusion_probability() > threshold

    def _scale_sample(self, generator=None):
        """tau*_j, one reparameterized draw per group (non-centered form), else None."""
        if not self.noncentered or self.prior == "ss-ig":   # SS-IG: tau* = 1
            return None
        return torch.exp(0.5 * self.scale.log_sample(generator)).to(self.weight_mu.device)

    def sample_weights(self, generator=None):
        """One draw (weight, bias, out_scale) from the slab; the caller applies z.

        bias is None without one. out_scale is tau*_j of a non-centered layer with a batch norm: it multiplies
        the batch-norm output (the caller folds it into the norm's weight and bias), see `forward`. Without
        a batch norm tau* is folded into weight and bias here and out_scale is None.
        """
        def draw(mu, rho):
            eps = torch.randn(mu.shape, generator=generator, dtype=mu.dtype, device=mu.device)
            return mu + F.softplus(rho) * eps
        weight = draw(self.weight_mu, self.weight_rho)
        bias = None if self.bias_mu is None else draw(self.bias_mu, self.bias_rho)
        tau = self._scale_sample(generator)
        if tau is not None and self.norm is None:
            weight = weight * self._per_group(tau)
            bias = None if bias is None else bias * tau
            tau = None
        return weight, bias, tau

    def _weight_sigma(self, reuse=False):
        """sigma = softplus(weight_rho), computed once per optimisation step: the training forward keeps it
        (in `_SIGMA`, outside the module, so deepcopy and state dicts never see it) and the KL after it takes
        it back (`reuse`), while weight_rho has not changed in place since (its version) and grad mode is the
        same. softplus is a pass over every weight and on the CPU here about 20x slower than exp (log1p is
        not vectorized), so computing it twice per step cost as much as a deterministic step of LeNet-5-Caffe
        at batch 32. The graph is the same as with two softplus calls; only the work is shared."""
        rho = self.weight_rho
        if torch.compiler.is_compiling():   # the compiler fuses the two calls itself
            return F.softplus(rho)
        if reuse:
            cached = _SIGMA.pop(self, None)
            if (cached is not None and cached[0] == rho._version
                    and cached[1].requires_grad == (torch.is_grad_enabled() and rho.requires_grad)):
                return cached[1]
            return F.softplus(rho)
        sigma = F.softplus(rho)
        _SIGMA[self] = (rho._version, sigma)
        return sigma

    # -- KL ------------------------------------------------------------------------------------
    def weight_kl_per_group(self, mc_samples=1, generator=None):
        """E_q(scale) KL(q(w_j | z_j = 1) || p(w_j | z_j = 1)) per group (of w0 in the non-centered form)."""
        if self.noncentered:
            log_t, inv_t = torch.zeros(self.out_units), torch.ones(self.out_units)
        else:
            log_t, inv_t = self.scale.moments(mc_samples, generator)
        device = self.weight_mu.device
        log_v = (math.log(self.sigma0_sq) + log_t).to(device)
        inv_v = (inv_t / self.sigma0_sq).to(device)
        kl = kl_gaussian_groups(self.weight_mu, self._weight_sigma(reuse=True), log_v, inv_v)
        if self.bias_mu is not None:
            kl = kl + kl_gaussian_groups(self.bias_mu[:, None], F.softplus(self.bias_rho)[:, None], log_v, inv_v)
        return kl

    def kl(self, mc_samples=1):
        """This layer's KL terms; `mc_samples` draws estimate SS-GHS's E[log(c^2 + tau^2 varsigma^2)]."""
        weight_kl = self.weight_kl_per_group(mc_samples)
        gamma = self.inclusion_probability()
        if self.unit_kl_factor is not None:   # ordered KL warm-up (trainer.ordered_kl_warmup): the same value,
            f = self.unit_kl_factor.to(gamma.device)   # only f of the KL's gradient reaches each inclusion logit
            gamma = f * gamma + (1 - f) * gamma.detach()
        if not self.noncentered:   # centered: the slab's KL counts only when the unit is on (module docstring)
            weight_kl = gamma * weight_kl
        total = weight_kl.sum() + self.scale.kl()
        if self.prunable:
            total = total + kl_bernoulli(gamma, self.prior_inclusion).sum()
        return total

    # -- forward -------------------------------------------------------------------------------
    def _affine(self, x, weight, bias):
        raise NotImplementedError

    def _per_group(self, v):
        """Broadcast a per-unit vector over the weight (groups on dim 0)."""
        return v.view((-1,) + (1,) * (self.weight_mu.dim() - 1))

    def _unit_dim(self, ndim):
        """The dimension of an output of `ndim` dimensions that holds the units: a convolution's channels."""
        return 1

    def _unit_view(self, z, ndim):
        """Broadcast a per-unit vector over an output of `ndim` dimensions (units on `_unit_dim`)."""
        shape = [1] * ndim
        shape[self._unit_dim(ndim)] = -1
        return z.view(shape)

    def forward(self, x):
        if self.training:
            # tau* and z are per-unit factors, multiplied together first and drawn before the weights' noise:
            # without a batch norm they scale each block of the output as it is made (_LocalReparameterization);
            # with one they act after it (module docstring), folded into its affine map.
            tau = self._scale_sample()
            z = relaxed_bernoulli_hard(self.gamma_logit, self.temperature) if self.prunable else None
            unit = tau if z is None else (z if tau is None else z * tau)
            sigma = self._weight_sigma()
            weight_var = in_layout(sigma * sigma, self.weight_mu)   # mkldnn reorders a weight in another layout
            bias_var = None if self.bias_rho is None else F.softplus(self.bias_rho) ** 2
            out = local_reparameterization(self, x, self.weight_mu, self.bias_mu, weight_var, bias_var,
                                           unit if self.norm is None else None)
            return out if self.norm is None else scaled_batch_norm(self.norm, out, unit)
        weight, bias, tau = self.sample_weights()
        keep = (torch.bernoulli(self.inclusion_probability()) if self.sample_inclusion
                else self.kept_units()).to(weight.dtype)
        out = self._affine(x, weight * self._per_group(keep), None if bias is None else bias * keep)
        if self.norm is not None:
            out = self.norm(out) * self._unit_view(keep if tau is None else keep * tau, out.dim())
        return out


class SpikeSlabLinear(SpikeSlabLayer):
    """Spike-and-slab over the nodes of a fully connected layer (paper 000, section 3)."""

    def __init__(self, in_features, out_features, **kw):
        super().__init__((out_features, in_features), in_features, **kw)
        self.in_features, self.out_features = in_features, out_features

    def _affine(self, x, weight, bias):
        return F.linear(x, weight, bias)

    def _unit_dim(self, ndim):
        """A Linear's units are its output features, the last dimension: (B, F), or (B, T, F) in a transformer."""
        return ndim - 1

    def _outputs_per_sample(self, x):
        return linear_outputs_per_sample(x, self.in_features, self.out_features)

    def _affine_backward(self, x, weight, grad, needs):
        return linear_backward(x, weight, grad, needs)

    def extra_repr(self):
        return f"{self.in_features}, {self.out_features}, prior={self.prior}, prunable={self.prunable}"


class SpikeSlabConv2d(SpikeSlabLayer):
    """Spike-and-slab over the output channels of a convolution (paper 000, section 5.2-5.3)."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, groups=1, dilation=1, **kw):
        k = (kernel_size, kernel_size) if isinstance(kernel_size, int) else tuple(kernel_size)
        super().__init__((out_channels, in_channels // groups) + k, in_channels // groups * k[0] * k[1], **kw)
        self.in_channels, self.out_channels, self.kernel_size = in_channels, out_channels, k
        self.stride, self.padding, self.groups, self.dilation = stride, padding, groups, dilation

    def _affine(self, x, weight, bias):
        return F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)

    def _outputs_per_sample(self, x):
        return conv2d_outputs_per_sample(x, self.out_channels, self.kernel_size, self.stride, self.padding,
                                         self.dilation)

    def _affine_backward(self, x, weight, grad, needs):
        return conv2d_backward(x, weight, grad, needs, self.stride, self.padding, self.groups, self.dilation)

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, prior={self.prior}, prunable={self.prunable}")


def prior_inclusion_probability(fan_in, units, *, n, num_hidden, fan_ins, prior, constant=1e-9, t0=1.0):
    """Layer-wise prior inclusion probability of Corollaries 2 and 4 (appendix A.5), fully connected layers.

    lambda_l = (1/k_{l+1}) exp(-C_l (k_l + 1) vartheta_l), with vartheta_l in the generic form of Remark 5,
    vartheta_l = 2 log n + 2L - log(p B_l^2/(k_l+1)) + p B_l^2/(k_l+1) + 2 sum_m log B_m, where B_l = k_l + 1
    (appendix A.5) and the penalty p is 1 for SS-IG and 1/(t0 (k_l + 1)) for SS-GL and SS-GHS (Theorems 1
    and 3 with the unknown tail constants set to `t0`; SS-GHS's extra 1/c_reg^2 term is of the same order and
    left out). With C_l = 1e-9 the exponential is within 1e-3 of 1 for the paper's 784-400-400 MLP, so
    lambda_l is close to 1/k_{l+1}, as the paper intends.
    """
    b_l = fan_in + 1
    penalty = 1.0 if prior == "ss-ig" else 1.0 / (t0 * (fan_in + 1))
    strength = penalty * b_l**2 / (fan_in + 1)
    vartheta = (2 * math.log(n) + 2 * num_hidden - math.log(strength) + strength
                + 2 * sum(math.log(k + 1) for k in fan_ins))
    return math.exp(-constant * (fan_in + 1) * vartheta) / units
