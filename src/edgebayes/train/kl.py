"""Closed-form KL divergences and expectations used by the Bayesian layers.

A LogNormal variational law LN(m, s^2) means x = exp(m + s*eps):
E[log x] = m, E[x] = exp(m + s^2/2), E[1/x] = exp(-m + s^2/2), entropy H = m + 1/2 + 1/2 log(2 pi s^2).
Every function works elementwise on tensors and returns the un-summed KL, so callers decide how to sum.
"""

import math

import torch

# Bernoulli probabilities are clamped away from 0 and 1 so log terms stay finite.
_PROB_EPS = 1e-7


def lognormal_entropy(m, s):
    """Entropy of LN(m, s^2)."""
    return m + 0.5 + 0.5 * torch.log(2 * math.pi * s**2)


def kl_lognormal_gamma(m, s, shape, log_rate_mean, rate_mean):
    """KL(LN(m, s^2) || Gamma(shape, rate b)), averaged over a random rate b.

    KL = -H - [a E log b - lgamma(a) + (a-1) m - E[b] exp(m + s^2/2)].
    For a fixed rate pass log_rate_mean = log b and rate_mean = b. The rate enters linearly in
    E[log b] and E[b], so the expectation over an independent q(b) stays in closed form.
    """
    shape = torch.as_tensor(shape, dtype=m.dtype, device=m.device)
    expected_log_density = (
        shape * log_rate_mean
        - torch.lgamma(shape)
        + (shape - 1) * m
        - rate_mean * torch.exp(m + 0.5 * s**2)
    )
    return -lognormal_entropy(m, s) - expected_log_density


def kl_lognormal_invgamma(m, s, shape, scale):
    """KL(LN(m, s^2) || InvGamma(shape a, scale b)) for fixed a, b.

    KL = -H - [a log b - lgamma(a) - (a+1) m - b exp(-m + s^2/2)].
    """
    shape = torch.as_tensor(shape, dtype=m.dtype, device=m.device)
    expected_log_density = (
        shape * math.log(scale)
        - torch.lgamma(shape)
        - (shape + 1) * m
        - scale * torch.exp(-m + 0.5 * s**2)
    )
    return -lognormal_entropy(m, s) - expected_log_density


def kl_gaussian_gaussian(mu, sigma, prior_log_var_mean, prior_inv_var_mean):
    """KL(N(mu, sigma^2) || N(0, v)) per coordinate, averaged over a random prior variance v.

    KL = 1/2 [E log v - log sigma^2 + (sigma^2 + mu^2) E[1/v] - 1]. For a fixed v pass log v and 1/v.
    """
    return 0.5 * (prior_log_var_mean - torch.log(sigma**2) + (sigma**2 + mu**2) * prior_inv_var_mean - 1)


class _GroupGaussianKL(torch.autograd.Function):
    """sum over each row of kl_gaussian_gaussian(mu, sigma, log_v, inv_v), with the prior moments per row:
    the value and gradients of that expression (tests/test_spike_slab.py) in about a third of its passes over
    the weights. Per row j of n_j coordinates,
        KL_j = 1/2 [n_j E log v_j - sum_i log sigma_i^2 + E[1/v_j] sum_i (sigma_i^2 + mu_i^2) - n_j],
    so only two sums touch the weights, and the backward is written out:
        d/d mu_i = g_j E[1/v_j] mu_i,  d/d sigma_i = g_j (E[1/v_j] sigma_i - 1/sigma_i).
    """

    @staticmethod
    def forward(ctx, mu, sigma, log_v, inv_v):
        n, within_row = mu[0].numel(), tuple(range(1, mu.dim()))   # summed in place: any memory format
        sum_log_var = 2 * torch.log(sigma).sum(within_row)
        sum_sq = torch.addcmul(sigma * sigma, mu, mu).sum(within_row)
        ctx.save_for_backward(mu, sigma, inv_v, sum_sq)
        ctx.n = n
        return 0.5 * (n * log_v - sum_log_var + inv_v * sum_sq - n)

    @staticmethod
    def backward(ctx, grad):
        mu, sigma, inv_v, sum_sq = ctx.saved_tensors
        view = (-1,) + (1,) * (mu.dim() - 1)
        g_inv = (grad * inv_v).view(view)
        grad_mu = g_inv * mu if ctx.needs_input_grad[0] else None
        grad_sigma = torch.addcmul(-grad.view(view) / sigma, g_inv, sigma) if ctx.needs_input_grad[1] else None
        grad_log_v = 0.5 * ctx.n * grad if ctx.needs_input_grad[2] else None
        grad_inv_v = 0.5 * grad * sum_sq if ctx.needs_input_grad[3] else None
        return grad_mu, grad_sigma, grad_log_v, grad_inv_v


def kl_gaussian_groups(mu, sigma, prior_log_var_mean, prior_inv_var_mean):
    """Per row (dim 0) of mu: the sum of KL(N(mu_i, sigma_i^2) || N(0, v_j)) over the row, with the row's
    prior moments E[log v_j], E[1/v_j] (vectors, or scalars for one prior); returns a vector."""
    rows = mu.shape[0]
    log_v = torch.as_tensor(prior_log_var_mean, dtype=mu.dtype, device=mu.device).expand(rows)
    inv_v = torch.as_tensor(prior_inv_var_mean, dtype=mu.dtype, device=mu.device).expand(rows)
    return _GroupGaussianKL.apply(mu, sigma, log_v, inv_v)


def kl_bernoulli(gamma, lam):
    """KL(Ber(gamma) || Ber(lam)), gamma and lam clamped away from 0 and 1."""
    gamma = gamma.clamp(_PROB_EPS, 1 - _PROB_EPS)
    lam = torch.as_tensor(lam, dtype=gamma.dtype, device=gamma.device).clamp(_PROB_EPS, 1 - _PROB_EPS)
    return gamma * torch.log(gamma / lam) + (1 - gamma) * torch.log((1 - gamma) / (1 - lam))


def relaxed_bernoulli_hard(gamma_logit, temperature, generator=None, shape=None):
    """Binary Concrete sample with a hard forward pass and a straight-through backward pass.

    z~ = sigmoid((logit gamma + logit u) / t), u ~ U(0, 1); forward returns 1[z~ > 0.5] (exact node
    sparsity), backward uses the gradient of z~ (paper 000, section 3.3; temperature 0.5 there).
    """
    shape = gamma_logit.shape if shape is None else shape
    u = torch.rand(shape, generator=generator, device=gamma_logit.device, dtype=gamma_logit.dtype)
    u = u.clamp(_PROB_EPS, 1 - _PROB_EPS)
    z_soft = torch.sigmoid((gamma_logit + torch.log(u) - torch.log1p(-u)) / temperature)
    z_hard = (z_soft > 0.5).to(z_soft.dtype)
    # (z_hard - z_soft) + z_soft is exactly 0 or 1 in floating point; z_hard + z_soft - z_soft is not.
    return (z_hard - z_soft.detach()) + z_soft
