"""Node-wise spike-and-slab layers of paper 000 (SS-IG, SS-GL): structurally sparse Bayesian nets.

A group is one output unit's incoming weights plus its bias (a row of a Linear weight). Per group j:

    prior      z_j ~ Ber(lambda_l);   w_j | z_j = 1 ~ N(0, sigma0^2 * scale_j^2 I);   w_j | z_j = 0 = 0
    posterior  q(z_j) = Ber(gamma_j); q(w_j | z_j = 1) = N(mu_j, diag sigma_j^2), sigma = softplus(rho)

SS-IG keeps scale_j = 1 (plain Gaussian slab, the baseline). SS-GL (eq. 9-10) puts
tau_j^2 | varsigma^2 ~ Gamma(k_l/2 + 1, rate varsigma^2/2) and varsigma^2 ~ Gamma(a0, b0) with LogNormal
posteriors; k_l is the layer's fan-in, so a group holds k_l + 1 weights. varsigma^2 is one variable for
the whole network, as in the paper: it lives in `GlobalScale`, shared by every layer, and the network adds
its KL once.

The negative ELBO term of each layer is appendix E.1's sum (centered parameterization):
    sum_j gamma_j E_q(scale)[KL(N(mu_j, sigma_j^2) || N(0, sigma0^2 scale_j^2))] + KL(Ber(gamma_j) || Ber(lambda_l))
    (+ SS-GL: E_q(varsigma^2)[KL(LN(tau_j) || Gamma(k_l/2 + 1, varsigma^2/2))])

Training forward pass: z from the relaxed Bernoulli with a hard forward pass (temperature 0.5), weights
through local reparameterization. Evaluation forward pass: z = 1[gamma > inclusion threshold] and one
weight sample per call, so a call is one coherent posterior sample of the network. The output layer is
never pruned (lambda_L = gamma_L = 1).

The layer is written against a generic "affine op" so that a Conv2d variant (issue 3) is a small subclass:
groups are always dimension 0 of the weight.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from edgebayes.train.kl import (
    kl_bernoulli,
    kl_gaussian_gaussian,
    kl_lognormal_gamma,
    relaxed_bernoulli_hard,
)

PRIORS = ("ss-ig", "ss-gl")

# sigma = softplus(rho) with rho = -6 at init keeps the initial weights at their Kaiming-uniform means
# (paper 000, appendix A.2).
RHO_INIT = -6.0


class GlobalScale(nn.Module):
    """The network-wide SS-GL scale varsigma^2: prior Gamma(a0, b0), posterior LN(m, s^2).

    Initialised as in appendix A.2: m = 1, s = softplus(-6).
    """

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


class SpikeSlabLayer(nn.Module):
    """Shared machinery of spike-and-slab layers; subclasses define the affine op and the shapes."""

    def __init__(self, weight_shape, fan_in, *, prior, prior_inclusion, prunable, sigma0_sq,
                 temperature, gamma_init, global_scale=None):
        super().__init__()
        if prior not in PRIORS:
            raise ValueError(f"unknown prior {prior!r}; expected one of {PRIORS}")
        if prior == "ss-gl" and global_scale is None:
            raise ValueError("an SS-GL layer needs the network's GlobalScale")
        out_units = weight_shape[0]
        self.prior, self.prunable, self.fan_in = prior, prunable, fan_in
        self.sigma0_sq, self.temperature = float(sigma0_sq), float(temperature)
        self.prior_inclusion = float(prior_inclusion) if prunable else 1.0
        self.inclusion_threshold = 0.5

        self.weight_mu = nn.Parameter(torch.empty(weight_shape))
        self.bias_mu = nn.Parameter(torch.empty(out_units))
        self.weight_rho = nn.Parameter(torch.full(weight_shape, RHO_INIT))
        self.bias_rho = nn.Parameter(torch.full((out_units,), RHO_INIT))
        # Kaiming uniform, as nn.Linear / nn.Conv2d initialise (appendix A.2).
        nn.init.kaiming_uniform_(self.weight_mu, a=math.sqrt(5))
        bound = 1 / math.sqrt(fan_in)
        nn.init.uniform_(self.bias_mu, -bound, bound)

        if prunable:
            logit = math.log(gamma_init / (1 - gamma_init))
            self.gamma_logit = nn.Parameter(torch.full((out_units,), logit))
        if prior == "ss-gl":
            self.tau_mu = nn.Parameter(torch.empty(out_units).uniform_(-0.6, 0.6))
            self.tau_rho = nn.Parameter(torch.full((out_units,), RHO_INIT))
        # A plain attribute, not a submodule: the network owns the GlobalScale and adds its KL once.
        self.__dict__["global_scale"] = global_scale

    # -- posterior quantities -------------------------------------------------------------------
    def inclusion_probability(self):
        """gamma_j = q(z_j = 1); exactly 1 for the output layer."""
        if not self.prunable:
            return torch.ones_like(self.bias_mu)
        return torch.sigmoid(self.gamma_logit)

    def kept_units(self, threshold=None):
        """Units whose inclusion probability exceeds the threshold (the median model at 0.5)."""
        threshold = self.inclusion_threshold if threshold is None else threshold
        if not self.prunable:
            return torch.ones_like(self.bias_mu, dtype=torch.bool)
        return self.inclusion_probability() > threshold

    def sample_weights(self, generator=None):
        """One draw of (weight, bias) from the slab; rows of dropped units are zeroed by the caller."""
        w_eps = torch.randn(self.weight_mu.shape, generator=generator, dtype=self.weight_mu.dtype,
                            device=self.weight_mu.device)
        b_eps = torch.randn(self.bias_mu.shape, generator=generator, dtype=self.bias_mu.dtype,
                            device=self.bias_mu.device)
        weight = self.weight_mu + F.softplus(self.weight_rho) * w_eps
        bias = self.bias_mu + F.softplus(self.bias_rho) * b_eps
        return weight, bias

    # -- KL ------------------------------------------------------------------------------------
    def _slab_prior_moments(self):
        """E[log v] and E[1/v] of the slab variance v = sigma0^2 * scale^2, one value per group."""
        log_s0 = math.log(self.sigma0_sq)
        if self.prior == "ss-ig":
            zeros = torch.zeros_like(self.bias_mu)
            return zeros + log_s0, zeros + 1 / self.sigma0_sq
        tau_s = F.softplus(self.tau_rho)
        return log_s0 + self.tau_mu, torch.exp(-self.tau_mu + 0.5 * tau_s**2) / self.sigma0_sq

    def kl(self):
        log_v, inv_v = self._slab_prior_moments()
        kl_w = kl_gaussian_gaussian(self.weight_mu, F.softplus(self.weight_rho), self._per_group(log_v),
                                    self._per_group(inv_v))
        kl_b = kl_gaussian_gaussian(self.bias_mu, F.softplus(self.bias_rho), log_v, inv_v)
        kl_group = kl_w.flatten(1).sum(1) + kl_b
        total = (self.inclusion_probability() * kl_group).sum()
        if self.prunable:
            total = total + kl_bernoulli(self.inclusion_probability(), self.prior_inclusion).sum()
        if self.prior == "ss-gl":
            e_log_rate, e_rate = self.global_scale.rate_moments()
            shape = self.fan_in / 2 + 1
            total = total + kl_lognormal_gamma(self.tau_mu, F.softplus(self.tau_rho), shape, e_log_rate, e_rate).sum()
        return total

    # -- forward -------------------------------------------------------------------------------
    def _affine(self, x, weight, bias):
        raise NotImplementedError

    def _per_group(self, v):
        """Broadcast a per-unit vector over the weight (groups on dim 0)."""
        return v.view((-1,) + (1,) * (self.weight_mu.dim() - 1))

    def _unit_view(self, z, ndim):
        """Broadcast a per-unit vector over an output of `ndim` dimensions (units on dim 1)."""
        return z.view((1, -1) + (1,) * (ndim - 2))

    def forward(self, x):
        if self.training:
            mean = self._affine(x, self.weight_mu, self.bias_mu)
            var = self._affine(x * x, F.softplus(self.weight_rho) ** 2, F.softplus(self.bias_rho) ** 2)
            out = mean + torch.sqrt(var + 1e-16) * torch.randn_like(mean)
            if self.prunable:
                z = relaxed_bernoulli_hard(self.gamma_logit, self.temperature)
                out = out * self._unit_view(z, out.dim())
            return out
        weight, bias = self.sample_weights()
        keep = self.kept_units().to(weight.dtype)
        return self._affine(x, weight * self._per_group(keep), bias * keep)


class SpikeSlabLinear(SpikeSlabLayer):
    """Spike-and-slab over the nodes of a fully connected layer (paper 000, section 3)."""

    def __init__(self, in_features, out_features, **kw):
        super().__init__((out_features, in_features), in_features, **kw)
        self.in_features, self.out_features = in_features, out_features

    def _affine(self, x, weight, bias):
        return F.linear(x, weight, bias)

    def extra_repr(self):
        return f"{self.in_features}, {self.out_features}, prior={self.prior}, prunable={self.prunable}"


def prior_inclusion_probability(fan_in, units, *, n, num_hidden, fan_ins, prior, constant=1e-9, t0=1.0):
    """Layer-wise prior inclusion probability of Corollaries 2 and 4 (appendix A.5).

    lambda_l = (1/k_{l+1}) exp(-C_l (k_l + 1) vartheta_l), with vartheta_l in the generic form of Remark 5,
    vartheta_l = 2 log n + 2L - log(p B_l^2/(k_l+1)) + p B_l^2/(k_l+1) + 2 sum_m log B_m, where B_l = k_l + 1
    (appendix A.5) and the penalty p is 1 for SS-IG and 1/(t0 (k_l + 1)) for SS-GL (Theorem 1 with the
    unknown tail constant t0'' set to `t0`). With C_l = 1e-9 the exponential is within 1e-3 (SS-IG) and
    1e-4 (SS-GL) of 1 for the paper's 784-400-400 MLP, so lambda_l is close to 1/k_{l+1}, as the paper intends.
    """
    b_l = fan_in + 1
    penalty = 1.0 if prior == "ss-ig" else 1.0 / (t0 * (fan_in + 1))
    strength = penalty * b_l**2 / (fan_in + 1)
    vartheta = (2 * math.log(n) + 2 * num_hidden - math.log(strength) + strength
                + 2 * sum(math.log(k + 1) for k in fan_ins))
    return math.exp(-constant * (fan_in + 1) * vartheta) / units
