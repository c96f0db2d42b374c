"""Spike-and-slab layers (train/spike_slab.py): where the non-centered scale acts, and the fused training
computation against a straightforward reference."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edgebayes.train.spike_slab import GlobalHorseshoeScale, GlobalScale, SpikeSlabConv2d


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
