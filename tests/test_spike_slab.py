"""Spike-and-slab layers (train/spike_slab.py): where the non-centered scale acts, and the fused training
computation against a straightforward reference."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edgebayes.train.kl import kl_bernoulli, kl_gaussian_gaussian, relaxed_bernoulli_hard
from edgebayes.train import spike_slab
from edgebayes.train.spike_slab import (GlobalHorseshoeScale, GlobalScale, SpikeSlabConv2d, SpikeSlabLinear,
                                        batch_blocks, standard_normal_like)


def _conv_bn(prior, seed=0):
    torch.manual_seed(seed)
    gs = GlobalScale(4.0, 2.0) if prior == "ss-gl" else GlobalHorseshoeScale(1.0)
    layer = SpikeSlabConv2d(3, 8, 3, padding=1, bias=False, prior=prior, prior_inclusion=1e-4, prunable=True,
                            sigma0_sq=0.04, temperature=0.5, gamma_init=0.99, global_scale=gs, c_reg=1.0,
                            noncentered=True, norm=nn.BatchNorm2d(8))
    return layer, gs


@pytest.mark.parametrize("prior", ["ss-gl", "ss-ghs"])
def test_noncentered_scale_after_batch_norm_gets_a_likelihood_gradient(prior):
    """Issue 20: with tau* on the convolution output, the batch norm (training mode) cancelled it and the
    likelihood gradient reaching tau and varsigma was ~1e-4 of the weights'. After the batch norm it is of
    the same order as the weights' (before the fix: 5e-4 and 7e-5 of them here; now 12 and 1.5 times)."""
    layer, gs = _conv_bn(prior)
    layer.train()
    x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    target = torch.randn(16, 8, 8, 8, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(3)
    loss = F.mse_loss(layer(x), target, reduction="sum")   # a likelihood term only, no KL
    loss.backward()
    weight_grad = layer.weight_mu.grad.abs().mean()
    # SS-GL's varsigma^2 enters through the KL of tau^2 only; SS-GHS's is a factor of tau*^2 itself.
    scale_mus = [layer.scale.mu] if prior == "ss-gl" else [layer.scale.beta_mu, layer.scale.alpha_mu,
                                                                  gs.a_mu, gs.b_mu]
    for p in scale_mus:
        assert p.grad.abs().mean() > 0.1 * weight_grad, (p.grad, weight_grad)


def test_noncentered_eval_forward_folds_the_scale_into_the_batch_norm():
    """The eval forward (tau* after the batch norm) is the plain conv + batch norm whose affine parameters
    carry tau*: what models.posterior_sample copies into the plain twin."""
    layer, _ = _conv_bn("ss-gl")
    with torch.no_grad():
        layer.scale.mu.copy_(torch.linspace(-1, 1, 8))
        layer.norm.running_mean.uniform_(-0.3, 0.3)
        layer.norm.bias.uniform_(-0.2, 0.2)
    layer.eval()
    x = torch.randn(4, 3, 8, 8)
    torch.manual_seed(5)
    with torch.no_grad():
        out = layer(x)
    weight, bias, tau = layer.sample_weights(torch.Generator().manual_seed(5))
    assert bias is None and tau is not None and not torch.allclose(tau, torch.ones(8), atol=0.1)
    norm = nn.BatchNorm2d(8).eval()
    norm.load_state_dict(layer.norm.state_dict())
    with torch.no_grad():
        norm.weight.mul_(tau)
        norm.bias.mul_(tau)
        torch.testing.assert_close(out, norm(F.conv2d(x, weight, None, 1, 1)), rtol=1e-5, atol=1e-6)


def _reference_loss(layer, x, weights):
    """The training forward and the layer KL written out plainly (no fused functions, no shared softplus, no
    blocks), with the layer's random draws in its order: tau*, z, then the noise of each block of the batch
    (batch_blocks), in memory order."""
    sp = F.softplus
    tau = z = torch.ones(layer.out_units)
    if layer.noncentered and layer.prior != "ss-ig":
        tau = torch.exp(0.5 * layer.scale.log_sample())
    if layer.prunable:
        z = relaxed_bernoulli_hard(layer.gamma_logit, layer.temperature)
    bias_var = None if layer.bias_rho is None else sp(layer.bias_rho) ** 2
    mean = layer._affine(x, layer.weight_mu, layer.bias_mu)
    var = layer._affine(x * x, sp(layer.weight_rho) ** 2, bias_var)
    eps = torch.cat([standard_normal_like(mean[a:b]) for a, b in batch_blocks(len(x), mean[0].numel(), x.device)])
    out = mean + torch.sqrt(var + 1e-16) * eps
    if layer.norm is not None:
        out = layer.norm(out)
    unit = [1] * out.dim()   # a Linear's units are its last dimension (tokens before it), a convolution's dim 1
    unit[-1 if isinstance(layer, SpikeSlabLinear) else 1] = -1
    out = out * tau.view(unit) * z.view(unit)
    if layer.noncentered:
        log_t, inv_t = torch.zeros(layer.out_units), torch.ones(layer.out_units)
    else:
        log_t, inv_t = layer.scale.moments()
    log_v, inv_v = math.log(layer.sigma0_sq) + log_t, inv_t / layer.sigma0_sq
    per_group = kl_gaussian_gaussian(layer.weight_mu, sp(layer.weight_rho), layer._per_group(log_v),
                                     layer._per_group(inv_v)).flatten(1).sum(1)
    if layer.bias_mu is not None:
        per_group = per_group + kl_gaussian_gaussian(layer.bias_mu, sp(layer.bias_rho), log_v, inv_v)
    on = 1.0 if layer.noncentered else layer.inclusion_probability()   # w0's KL whatever z (non-centered)
    kl = (on * per_group).sum() + layer.scale.kl()
    if layer.prunable:
        kl = kl + kl_bernoulli(layer.inclusion_probability(), layer.prior_inclusion).sum()
    return (out * weights).sum() + kl


def _layer(kind, prior, noncentered, seed=0):
    torch.manual_seed(seed)
    gs = {"ss-gl": GlobalScale(4.0, 2.0), "ss-ghs": GlobalHorseshoeScale(1.0)}.get(prior)
    kw = dict(prior=prior, prior_inclusion=0.3, prunable=True, sigma0_sq=0.5, temperature=0.5, gamma_init=0.7,
              global_scale=gs, c_reg=1.5, noncentered=noncentered)
    if kind.startswith("linear"):
        layer = SpikeSlabLinear(6, 5, **kw)
        x = torch.randn(5, 4, 6) if kind == "linear tokens" else torch.randn(5, 6)   # (B, T, F): a transformer's
    else:
        dilation = 2 if kind.endswith("dilated") else 1   # a temporal convolutional network's
        layer = SpikeSlabConv2d(3, 5, 3, padding=dilation, dilation=dilation, bias=kind == "conv", **kw,
                                norm=nn.BatchNorm2d(5) if kind.startswith("conv+bn") else None)
        x = torch.randn(5, 3, 5, 5)
        if kind.endswith("channels_last"):   # what train.channels_last does to the model and its inputs
            layer, x = layer.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    with torch.no_grad():   # spread posterior scales and inclusion so every term matters
        layer.weight_rho.uniform_(-3, 0)
        if layer.bias_rho is not None:
            layer.bias_rho.uniform_(-3, 0)
        layer.gamma_logit.uniform_(-1, 3)
    return layer, x


@pytest.mark.parametrize("blocks", ["one", "several"])
@pytest.mark.parametrize("kind", ["linear", "linear tokens", "conv", "conv+bn", "conv+bn channels_last",
                                  "conv channels_last", "conv+bn dilated"])
@pytest.mark.parametrize("prior,noncentered", [("ss-ig", False), ("ss-gl", False), ("ss-ghs", False),
                                               ("ss-ig", True), ("ss-gl", True), ("ss-ghs", True)])
def test_fused_training_step_equals_the_plain_computation(kind, prior, noncentered, blocks, monkeypatch):
    """Issue 20's speed work (local reparameterization in blocks of the batch with a written-out backward,
    the unit factor inside the blocks or folded into the batch norm, per-group KL with a written-out backward,
    one softplus per step) changes neither the loss, nor any gradient, nor the batch norm's running
    statistics beyond float error. "several": blocks of 2 samples of the batch of 5 (2, 2 and a remainder)."""
    layer, x = _layer(kind, prior, noncentered)
    if blocks == "several":
        monkeypatch.setattr(spike_slab, "BLOCK_ELEMENTS", 2 * layer._outputs_per_sample(x) + 1)
        assert len(batch_blocks(len(x), layer._outputs_per_sample(x), x.device)) == 3
    layer.train()
    x.requires_grad_(True)
    params = ([x] + list(layer.parameters())
              + list(getattr(layer.scale, "global_scale", nn.Module()).parameters()))
    initial_stats = {k: v.clone() for k, v in layer.state_dict().items() if "running" in k or "batches" in k}
    weights = None
    results, stats = [], []
    for compute in ("fused", "reference"):
        layer.load_state_dict(initial_stats, strict=False)
        torch.manual_seed(11)
        if compute == "fused":
            out = layer(x)
            weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
            loss = (out * weights).sum() + layer.kl()
        else:
            loss = _reference_loss(layer, x, weights)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        results.append((loss.detach(), grads))
        stats.append({k: v.clone() for k, v in layer.state_dict().items() if k in initial_stats})
    (loss, grads), (ref_loss, ref_grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for p, g, r in zip(params, grads, ref_grads):
        assert (g is None) == (r is None)
        if g is not None:
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    assert any(g is not None and g.abs().sum() > 0 for g in grads[1:3])
    for k in initial_stats:
        torch.testing.assert_close(stats[0][k], stats[1][k])


def test_standard_normal_like_keeps_the_layout_and_is_randn_like_for_contiguous_tensors():
    t = torch.empty(4, 3, 5, 5)
    torch.manual_seed(0)
    a = standard_normal_like(t)
    torch.manual_seed(0)
    assert torch.equal(a, torch.randn_like(t))
    cl = t.contiguous(memory_format=torch.channels_last)
    torch.manual_seed(0)
    b = standard_normal_like(cl)
    assert b.is_contiguous(memory_format=torch.channels_last) and b.shape == t.shape
    torch.manual_seed(0)
    assert torch.equal(b.permute(0, 2, 3, 1).reshape(-1), torch.randn(t.numel()))   # iid draws in memory order


@pytest.mark.parametrize("prior", ["ss-ig", "ss-gl"])
def test_slab_kl_pushes_inclusion_down_only_in_the_centered_family(prior):
    """Issue 20's collapse: in the centered family d KL / d logit gamma_j carries the unit's whole slab KL
    (switching the unit off removes its weights from the posterior); in the non-centered family w0 is a
    latent variable whether the unit is on or off, so only the Bernoulli term depends on gamma."""
    grads = {}
    for noncentered in (False, True):
        layer, _ = _layer("linear", prior, noncentered)
        (grad,) = torch.autograd.grad(layer.kl(), layer.gamma_logit)
        gamma = layer.inclusion_probability().detach()
        bernoulli = gamma * (1 - gamma) * (torch.logit(gamma) - math.log(0.3 / 0.7))   # d KL(Ber) / d logit
        grads[noncentered] = grad - bernoulli
    assert torch.allclose(grads[True], torch.zeros(5), atol=1e-6)
    assert (grads[False] > 1e-3).all()   # the slab KL is positive, so it always pulls gamma down
