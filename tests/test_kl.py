"""Closed-form KL terms of paper 000 (train/kl.py, train/spike_slab.py) against Monte-Carlo estimates.

Every MC check draws N samples with a fixed seed, in float64, and accepts |closed - MC| <= Z * SE, where
SE = std(per-sample log-ratio) / sqrt(N) is the MC standard error of the estimate. Z = 5 makes a false
alarm a < 1e-6 event for a correct formula, while every check also asserts that SE is small next to the
value, so that a wrong constant, a missing factor or a swapped parameterization is far outside the band.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Bernoulli, Gamma, InverseGamma, LogNormal, Normal, kl_divergence

from edgebayes.train.kl import (
    kl_bernoulli,
    kl_gaussian_gaussian,
    kl_lognormal_gamma,
    relaxed_bernoulli_hard,
)
from edgebayes.train.models import build_model
from edgebayes.config import ModelConfig, PriorConfig
from edgebayes.train.spike_slab import (
    GlobalHorseshoeScale,
    GlobalScale,
    SpikeSlabLinear,
    prior_inclusion_probability,
)

Z = 5.0
DT = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _assert_mc(closed, per_sample, *, max_rel_se=0.02):
    """closed-form value vs the MC mean of per-sample log-ratios, within Z standard errors."""
    closed = float(closed)
    n = per_sample.numel()
    mean = float(per_sample.mean())
    se = float(per_sample.std()) / math.sqrt(n)
    # The test only has power when the MC error is small next to the value itself.
    assert se <= max_rel_se * max(abs(closed), 1e-3), (closed, mean, se)
    assert abs(closed - mean) <= Z * se, f"closed {closed:.6f} vs MC {mean:.6f} +- {se:.2e}"


def _lognormal(m, s, n, g):
    m, s = torch.as_tensor(m, dtype=DT), torch.as_tensor(s, dtype=DT)
    eps = torch.randn((n,) + tuple(m.shape), generator=g, dtype=DT)
    return torch.exp(m + s * eps)


# ---------------------------------------------------------------------------------------------
# Elementwise KLs
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m, s, a, b", [(0.3, 0.4, 2.5, 1.7), (-1.0, 1.1, 4.0, 2.0), (1.5, 0.2, 0.7, 0.3)])
def test_kl_lognormal_gamma_fixed_rate_matches_mc(m, s, a, b):
    """KL(LN(m, s^2) || Gamma(a, rate b)) equals E_LN[log q - log p] (1M samples)."""
    closed = kl_lognormal_gamma(torch.tensor(m, dtype=DT), torch.tensor(s, dtype=DT), a,
                                torch.tensor(math.log(b), dtype=DT), torch.tensor(b, dtype=DT))
    x = _lognormal(m, s, 1_000_000, _gen(0))
    log_ratio = LogNormal(torch.tensor(m, dtype=DT), torch.tensor(s, dtype=DT)).log_prob(x) \
        - Gamma(torch.tensor(a, dtype=DT), torch.tensor(b, dtype=DT)).log_prob(x)
    _assert_mc(closed, log_ratio)


def test_kl_lognormal_gamma_random_rate_matches_mc():
    """E_{q(varsigma^2)} KL(LN || Gamma(a, varsigma^2/2)) with GlobalScale.rate_moments() equals the MC
    average of log q(x) - log Gamma(x; a, varsigma^2/2) over independent x ~ LN and varsigma^2 ~ LN."""
    gs = GlobalScale(4.0, 2.0).double()
    with torch.no_grad():
        gs.mu.fill_(0.4)
        gs.rho.fill_(-0.3)  # s = softplus(-0.3) ~ 0.55: a genuinely random rate
    vs_m, vs_s = gs.mu.detach(), F.softplus(gs.rho.detach())
    m, s, a = torch.tensor(-0.2, dtype=DT), torch.tensor(0.6, dtype=DT), 3.5
    e_log_rate, e_rate = gs.rate_moments()
    closed = kl_lognormal_gamma(m, s, a, e_log_rate.detach(), e_rate.detach())

    g = _gen(1)
    n = 1_000_000
    x = _lognormal(m, s, n, g)
    rate = _lognormal(vs_m, vs_s, n, g) / 2
    log_ratio = LogNormal(m, s).log_prob(x) - Gamma(torch.tensor(a, dtype=DT), rate).log_prob(x)
    _assert_mc(closed, log_ratio)
    # The random rate matters: plugging in the rate at E[log b] alone gives a different (wrong) value.
    plug_in = kl_lognormal_gamma(m, s, a, e_log_rate.detach(), torch.exp(e_log_rate.detach()))
    assert abs(float(plug_in) - float(closed)) > 0.05


@pytest.mark.parametrize("mu, sigma, v", [(0.5, 0.3, 1.0), (-1.2, 0.05, 0.04), (0.0, 2.0, 0.7)])
def test_kl_gaussian_gaussian_fixed_variance_matches_torch(mu, sigma, v):
    """KL(N(mu, sigma^2) || N(0, v)) with fixed v equals torch.distributions.kl_divergence."""
    mu_t, sig_t = torch.tensor(mu, dtype=DT), torch.tensor(sigma, dtype=DT)
    closed = kl_gaussian_gaussian(mu_t, sig_t, torch.tensor(math.log(v), dtype=DT), torch.tensor(1 / v, dtype=DT))
    ref = kl_divergence(Normal(mu_t, sig_t), Normal(torch.tensor(0.0, dtype=DT), torch.tensor(math.sqrt(v), dtype=DT)))
    assert float(closed) == pytest.approx(float(ref), rel=1e-10, abs=1e-12)


def test_kl_gaussian_gaussian_random_variance_matches_mc():
    """With v = sigma0^2 tau^2, tau^2 ~ LN(m, s^2): the closed form with E[log v], E[1/v] equals the MC
    average of log N(w; mu, sigma^2) - log N(w; 0, v) over w ~ q and tau^2 ~ LN (1M samples)."""
    mu, sigma, sigma0_sq = torch.tensor(0.7, dtype=DT), torch.tensor(0.4, dtype=DT), 0.6
    m, s = torch.tensor(-0.3, dtype=DT), torch.tensor(0.5, dtype=DT)
    e_log_v = math.log(sigma0_sq) + m
    e_inv_v = torch.exp(-m + s**2 / 2) / sigma0_sq
    closed = kl_gaussian_gaussian(mu, sigma, e_log_v, e_inv_v)

    g = _gen(2)
    n = 1_000_000
    w = mu + sigma * torch.randn(n, generator=g, dtype=DT)
    v = sigma0_sq * _lognormal(m, s, n, g)
    log_ratio = Normal(mu, sigma).log_prob(w) - Normal(torch.zeros((), dtype=DT), v.sqrt()).log_prob(w)
    _assert_mc(closed, log_ratio)


def test_kl_bernoulli_matches_torch_and_is_finite_at_the_edges():
    """KL(Ber(g) || Ber(l)) equals torch's KL in the interior and stays finite (and correct to the
    clamp's precision) for g, l at or next to 0 and 1."""
    g = torch.tensor([0.1, 0.5, 0.9, 0.3, 0.999, 0.02], dtype=DT)
    lam = torch.tensor([0.5, 0.0025, 0.3, 0.3, 0.1, 0.9], dtype=DT)
    ref = kl_divergence(Bernoulli(probs=g), Bernoulli(probs=lam))
    torch.testing.assert_close(kl_bernoulli(g, lam), ref, rtol=1e-9, atol=1e-12)
    # a scalar prior probability broadcasts
    torch.testing.assert_close(kl_bernoulli(g, 0.0025), kl_divergence(Bernoulli(probs=g), Bernoulli(probs=torch.full_like(g, 0.0025))))

    edges = torch.tensor([0.0, 1e-12, 1.0 - 1e-12, 1.0], dtype=DT)
    out = kl_bernoulli(edges, 0.3)
    assert torch.isfinite(out).all()
    # limits: KL(Ber(0)||Ber(l)) = -log(1-l), KL(Ber(1)||Ber(l)) = -log(l)
    torch.testing.assert_close(out, torch.tensor([-math.log(0.7)] * 2 + [-math.log(0.3)] * 2, dtype=DT),
                               rtol=0, atol=1e-5)
    assert torch.isfinite(kl_bernoulli(torch.tensor([0.5, 0.0, 1.0], dtype=DT), 0.0)).all()
    assert torch.isfinite(kl_bernoulli(torch.tensor([0.5, 0.0, 1.0], dtype=DT), 1.0)).all()
    # gradients at the edges are finite too (training can push gamma there)
    x = torch.tensor([1e-12, 0.5, 1 - 1e-12], dtype=DT, requires_grad=True)
    kl_bernoulli(x, 0.01).sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("mu, rho", [(1.0, -6.0), (0.3, 0.2), (-0.5, -1.0)])
def test_global_scale_kl_matches_mc(mu, rho):
    """GlobalScale.kl() equals the MC estimate of KL(LN(m, s^2) || Gamma(a0, b0)) (1M samples)."""
    gs = GlobalScale(4.0, 2.0)
    with torch.no_grad():
        gs.mu.fill_(mu)
        gs.rho.fill_(rho)
    m, s = torch.tensor(mu, dtype=DT), F.softplus(torch.tensor(rho, dtype=DT))
    x = _lognormal(m, s, 1_000_000, _gen(3))
    log_ratio = LogNormal(m, s).log_prob(x) - Gamma(torch.tensor(4.0, dtype=DT), torch.tensor(2.0, dtype=DT)).log_prob(x)
    # at rho = -6 the law is nearly a point mass: the KL is large and the MC spread tiny
    _assert_mc(gs.kl().detach(), log_ratio)


# ---------------------------------------------------------------------------------------------
# The full layer KL
# ---------------------------------------------------------------------------------------------
C_REG = 1.5


def _random_layer(prior, prunable, seed=0, sigma0_sq=0.8, prior_inclusion=0.3, noncentered=False):
    torch.manual_seed(seed)
    gs = {"ss-gl": GlobalScale(4.0, 2.0), "ss-ghs": GlobalHorseshoeScale(d0=1.3)}.get(prior)
    layer = SpikeSlabLinear(3, 4, prior=prior, prior_inclusion=prior_inclusion, prunable=prunable,
                            sigma0_sq=sigma0_sq, temperature=0.5, gamma_init=0.9, global_scale=gs, c_reg=C_REG,
                            noncentered=noncentered)
    g = _gen(100 + seed)
    with torch.no_grad():
        layer.weight_mu.copy_(torch.randn(4, 3, generator=g))
        layer.bias_mu.copy_(torch.randn(4, generator=g))
        layer.weight_rho.copy_(torch.empty(4, 3).uniform_(-1.5, 0.0, generator=g))
        layer.bias_rho.copy_(torch.empty(4).uniform_(-1.5, 0.0, generator=g))
        if prunable:
            layer.gamma_logit.copy_(torch.tensor([-1.0, 0.3, 1.2, 2.5]))
        if prior == "ss-gl":
            layer.scale.mu.copy_(torch.tensor([-0.5, 0.1, 0.4, 0.9]))
            layer.scale.rho.copy_(torch.tensor([-1.5, -0.8, -1.0, -0.3]))
            gs.mu.fill_(0.6)
            gs.rho.fill_(-0.7)
        if prior == "ss-ghs":
            layer.scale.beta_mu.copy_(torch.tensor([-0.5, 0.1, 0.4, 0.9]))
            layer.scale.beta_rho.copy_(torch.tensor([-1.5, -0.8, -1.0, -0.3]))
            layer.scale.alpha_mu.copy_(torch.tensor([0.3, -0.2, 0.0, -0.6]))
            layer.scale.alpha_rho.copy_(torch.tensor([-0.9, -1.2, -0.4, -2.0]))
            gs.a_mu.fill_(0.4)
            gs.a_rho.fill_(-0.8)
            gs.b_mu.fill_(-0.3)
            gs.b_rho.fill_(-1.1)
    return layer, gs


def _mc_layer_kl(layer, gs, n=400_000, seed=7):
    """Independent MC of E_q[log q - log p] over the layer's spike-and-slab joint (Bernoulli part exact).

    Per unit j: z_j ~ Ber(gamma_j); given z_j = 1 the group (row j of W and bias j) w_j ~ N(mu_j, sigma_j^2)
    against N(0, sigma0^2 tau_j^2); for SS-GL also tau_j^2 ~ LN(q) against Gamma(k/2 + 1, varsigma^2/2) with
    varsigma^2 ~ LN(q) shared by all units. Returns (exact Bernoulli sum, per-sample MC log-ratios).
    """
    g = _gen(seed)
    mu = torch.cat([layer.weight_mu, layer.bias_mu[:, None]], 1).detach().to(DT)            # (4, k+1)
    sig = F.softplus(torch.cat([layer.weight_rho, layer.bias_rho[:, None]], 1).detach().to(DT))
    units, size = mu.shape
    w = mu + sig * torch.randn((n, units, size), generator=g, dtype=DT)
    log_q_w = Normal(mu, sig).log_prob(w).sum(-1)                                           # (n, units)

    if layer.prunable:
        gamma = torch.sigmoid(layer.gamma_logit.detach().to(DT))
        lam = torch.tensor(layer.prior_inclusion, dtype=DT)
        bern = float((gamma * torch.log(gamma / lam) + (1 - gamma) * torch.log((1 - gamma) / (1 - lam))).sum())
    else:
        gamma, bern = torch.ones(units, dtype=DT), 0.0
    z = (torch.rand((n, units), generator=g, dtype=DT) < gamma).to(DT)

    if layer.prior == "ss-gl":
        t_m, t_s = layer.scale.mu.detach().to(DT), F.softplus(layer.scale.rho.detach().to(DT))
        v_m, v_s = gs.mu.detach().to(DT), F.softplus(gs.rho.detach().to(DT))
        tau2 = _lognormal(t_m, t_s, n, g)                                                   # (n, units)
        vs2 = _lognormal(v_m, v_s, n, g)[:, None]                                           # (n, 1)
        var = layer.sigma0_sq * tau2
        shape = torch.tensor(layer.fan_in / 2 + 1, dtype=DT)
        tau_term = (LogNormal(t_m, t_s).log_prob(tau2) - Gamma(shape, vs2 / 2).log_prob(tau2)).sum(-1)
    elif layer.prior == "ss-ghs":
        def law(mu, rho):
            return LogNormal(mu.detach().to(DT), F.softplus(rho.detach().to(DT)))
        q_beta, q_alpha = law(layer.scale.beta_mu, layer.scale.beta_rho), law(layer.scale.alpha_mu, layer.scale.alpha_rho)
        beta, alpha = q_beta.sample((n,)), q_alpha.sample((n,))                              # (n, units)
        zeta = law(gs.a_mu, gs.a_rho).sample((n, 1)) * law(gs.b_mu, gs.b_rho).sample((n, 1))
        product = beta * alpha * zeta
        var = layer.sigma0_sq * C_REG**2 * product / (C_REG**2 + product)                 # eq. 12
        half = torch.tensor(0.5, dtype=DT)
        tau_term = (q_beta.log_prob(beta) - InverseGamma(half, torch.tensor(1.0, dtype=DT)).log_prob(beta)
                    + q_alpha.log_prob(alpha) - Gamma(half, torch.tensor(1.0, dtype=DT)).log_prob(alpha)).sum(-1)
    else:
        var = torch.full((n, units), layer.sigma0_sq, dtype=DT)
        tau_term = torch.zeros(n, dtype=DT)
    if layer.noncentered:  # the KL is of w0 against the fixed N(0, sigma0^2); the scale enters the forward pass
        var = torch.full((n, units), layer.sigma0_sq, dtype=DT)
    log_p_w = Normal(torch.zeros((), dtype=DT), var.sqrt()[..., None]).log_prob(w).sum(-1)
    # centered: the slab counts where z = 1 (q = p = delta_0 otherwise); non-centered: w0 is a latent variable
    # whatever z, with q(w0) and pi(w0) free of z, so its log-ratio counts for every unit
    on = torch.ones_like(z) if layer.noncentered else z
    per_sample = (on * (log_q_w - log_p_w)).sum(-1) + tau_term
    return bern, per_sample


@pytest.mark.parametrize("noncentered", [False, True], ids=["centered", "non-centered"])
@pytest.mark.parametrize("prior", ["ss-ig", "ss-gl", "ss-ghs"])
def test_layer_kl_matches_mc_of_spike_and_slab_joint(prior, noncentered):
    """SpikeSlabLinear.kl() (3 -> 4, prunable) equals an independent MC estimate of KL(q || p) of the
    layer's spike-and-slab joint: Bernoulli part exact, Gaussian slab and scale parts by 400k samples.
    (SS-GHS's E[log(c^2 + tau^2 varsigma^2)] is itself MC in the layer: 400k draws here.)"""
    layer, gs = _random_layer(prior, prunable=True, noncentered=noncentered)
    bern, per_sample = _mc_layer_kl(layer, gs)
    torch.manual_seed(1)
    _assert_mc(layer.kl(mc_samples=400_000).detach().to(DT) - bern, per_sample)
    # and the Bernoulli part really is in the layer KL (it is a sizeable share here)
    assert bern > 0.5


@pytest.mark.parametrize("prior", ["ss-ig", "ss-gl"])
def test_output_layer_kl_has_no_bernoulli_term(prior):
    """The output layer (prunable=False) has gamma = 1 and no Bernoulli KL: its KL is the sum of the
    slab terms only, even when a prior inclusion probability < 1 is passed in."""
    layer, gs = _random_layer(prior, prunable=False, prior_inclusion=0.01)
    assert not hasattr(layer, "gamma_logit")
    assert torch.equal(layer.inclusion_probability(), torch.ones(4))
    kl = layer.kl().detach().to(DT)
    bern, per_sample = _mc_layer_kl(layer, gs)
    assert bern == 0.0
    _assert_mc(kl, per_sample)
    if prior == "ss-ig":
        # fixed slab variance: the slab sum is exact through torch.distributions
        mu = torch.cat([layer.weight_mu, layer.bias_mu[:, None]], 1).detach().to(DT)
        sig = F.softplus(torch.cat([layer.weight_rho, layer.bias_rho[:, None]], 1).detach().to(DT))
        exact = kl_divergence(Normal(mu, sig), Normal(0.0, math.sqrt(layer.sigma0_sq))).sum()
        assert float(kl) == pytest.approx(float(exact), rel=1e-5)


def test_network_kl_adds_global_scale_once():
    """BayesianNet.kl() = sum of layer KLs + the global scale's KL exactly once (SS-GL, SS-GHS), no global
    term for SS-IG."""
    for family in ("ss-gl", "ss-ig", "ss-ghs"):
        torch.manual_seed(0)
        model = build_model(ModelConfig(family=family, hidden=[6, 5]), PriorConfig(c_reg=1e6), (4,), 3, 1000)
        layers = sum(layer.kl() for _, layer in model.bayesian_layers())
        extra = model.global_scale.kl() if family != "ss-ig" else 0.0
        # c_reg = 1e6 makes SS-GHS's one-sample MC term deterministic to float precision
        assert model.kl().item() == pytest.approx(float((layers + extra).detach()), rel=1e-5)
        assert len(model.bayesian_layers()) == 3


# ---------------------------------------------------------------------------------------------
# Relaxed Bernoulli
# ---------------------------------------------------------------------------------------------
LOGITS = [-2.0, -0.5, 0.0, 1.0, 3.0]


def test_relaxed_bernoulli_forward_is_binary_with_exact_zeros():
    """Forward values are 0 or 1: dropped units are exactly 0 (exact sparsity), kept ones 1 up to an ulp."""
    logit = torch.tensor(LOGITS, requires_grad=True)
    z = relaxed_bernoulli_hard(logit, 0.5, _gen(5), (10_000, len(LOGITS)))
    is_zero = z == 0
    near_one = (z - 1).abs() <= 2 * torch.finfo(z.dtype).eps
    assert (is_zero | near_one).all()
    assert is_zero.any() and near_one.any()


def test_relaxed_bernoulli_forward_exactly_binary():
    """Forward values are exactly 0 or 1 (the straight-through sum must not perturb the hard sample)."""
    logit = torch.tensor(LOGITS, requires_grad=True)
    z = relaxed_bernoulli_hard(logit, 0.5, _gen(5), (10_000, len(LOGITS)))
    assert ((z == 0) | (z == 1)).all()


def test_relaxed_bernoulli_hard_sample_is_bernoulli_gamma():
    """The hard Concrete sample at threshold 0.5 is exactly Bernoulli(sigmoid(logit)): empirical means of
    200k samples within 5 binomial standard errors, at two temperatures (the law does not depend on t)."""
    logit = torch.tensor(LOGITS, dtype=DT)
    p = torch.sigmoid(logit)
    n = 200_000
    se = torch.sqrt(p * (1 - p) / n)
    for t in (0.5, 2.0):
        z = relaxed_bernoulli_hard(logit, t, _gen(6), (n, len(LOGITS)))
        assert ((z.mean(0) - p).abs() <= Z * se).all(), (z.mean(0), p)


def test_relaxed_bernoulli_straight_through_gradient():
    """The backward pass is the gradient of the soft sample z~: non-zero, positive w.r.t. the logit."""
    logit = torch.tensor(LOGITS, dtype=DT, requires_grad=True)
    z = relaxed_bernoulli_hard(logit, 0.5, _gen(8), (64, len(LOGITS)))
    z.sum().backward()
    assert (logit.grad > 0).all()

    # Same uniforms, soft sample by hand: identical gradient.
    logit2 = logit.detach().clone().requires_grad_(True)
    u = torch.rand((64, len(LOGITS)), generator=_gen(8), dtype=DT).clamp(1e-7, 1 - 1e-7)
    soft = torch.sigmoid((logit2 + torch.log(u) - torch.log1p(-u)) / 0.5)
    soft.sum().backward()
    torch.testing.assert_close(logit.grad, logit2.grad)


# ---------------------------------------------------------------------------------------------
# Prior inclusion probability
# ---------------------------------------------------------------------------------------------
def test_prior_inclusion_probability_paper_mlp():
    """Paper MLP 784-400-400-10, n = 60000, C = 1e-9: lambda_l ~= 1/k_{l+1} (SS-GL within 1e-4 relative;
    SS-IG, whose penalty is k_l+1 times larger, within 1e-3 and equal to the formula worked by hand);
    the output layer has lambda = 1; lambda decreases as C grows."""
    n, fan_ins = 60000, [784, 400, 400]
    for prior in ("ss-gl", "ss-ig", "ss-ghs"):
        model = build_model(ModelConfig(family=prior, hidden=[400, 400]), PriorConfig(), (784,), 10, n)
        hidden, out = [model.net.hidden1, model.net.hidden2], model.net.output
        assert out.prior_inclusion == 1.0 and not out.prunable
        for layer, fan_in in zip(hidden, fan_ins):
            lam = layer.prior_inclusion
            rel = abs(lam * 400 - 1)
            assert rel < (1e-3 if prior == "ss-ig" else 1e-4), (prior, fan_in, rel)
            # by hand: B_l = k_l + 1; strength = p B_l^2 / (k_l + 1) with p = 1 (IG) or 1/(k_l + 1) (GL)
            strength = (fan_in + 1) if prior == "ss-ig" else 1.0
            theta = (2 * math.log(n) + 2 * 2 - math.log(strength) + strength
                     + 2 * sum(math.log(k + 1) for k in fan_ins))
            assert lam == pytest.approx(math.exp(-1e-9 * (fan_in + 1) * theta) / 400, rel=1e-12)
            assert lam < 1 / 400

    kw = dict(n=n, num_hidden=2, fan_ins=fan_ins, prior="ss-gl")
    lams = [prior_inclusion_probability(784, 400, constant=c, **kw) for c in (1e-9, 1e-7, 1e-5, 1e-3)]
    assert all(a > b for a, b in zip(lams, lams[1:]))
    assert lams[-1] < 0.5 / 400  # C = 1e-3 really bites


# ---------------------------------------------------------------------------------------------
# SS-GHS: the half-Cauchy as a product of Gamma and inverse-Gamma variables (eq. 12)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_ghs_product_reproduces_half_cauchy_quantiles(scale):
    """tau^2 = beta alpha with beta ~ IG(1/2, 1), alpha ~ Gamma(1/2, rate 1/k^2) gives tau ~ C+(0, k):
    empirical quantiles of 400k draws match k tan(pi q / 2) (the half-Cauchy quantile function)."""
    torch.manual_seed(0)
    n = 400_000
    beta = InverseGamma(torch.tensor(0.5, dtype=DT), torch.tensor(1.0, dtype=DT)).sample((n,))
    alpha = Gamma(torch.tensor(0.5, dtype=DT), torch.tensor(1 / scale**2, dtype=DT)).sample((n,))
    tau = torch.sqrt(beta * alpha)
    qs = torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9, 0.95], dtype=DT)
    empirical = torch.quantile(tau[:200_000], qs)  # torch.quantile caps the input size
    expected = scale * torch.tan(math.pi * qs / 2)
    torch.testing.assert_close(empirical, expected, rtol=0.03, atol=0)


def test_ghs_global_scale_kl_matches_mc():
    """GlobalHorseshoeScale.kl() = KL(LN || Gamma(1/2, rate 1/d0^2)) + KL(LN || IG(1/2, 1)) by MC."""
    gs = GlobalHorseshoeScale(d0=1.7)
    with torch.no_grad():
        gs.a_mu.fill_(0.4)
        gs.a_rho.fill_(-0.5)
        gs.b_mu.fill_(-0.2)
        gs.b_rho.fill_(0.1)
    g = _gen(3)
    n = 1_000_000
    qa = LogNormal(gs.a_mu.detach().to(DT), F.softplus(gs.a_rho.detach().to(DT)))
    qb = LogNormal(gs.b_mu.detach().to(DT), F.softplus(gs.b_rho.detach().to(DT)))
    a = _lognormal(qa.loc, qa.scale, n, g)
    b = _lognormal(qb.loc, qb.scale, n, g)
    half = torch.tensor(0.5, dtype=DT)
    per_sample = (qa.log_prob(a) - Gamma(half, torch.tensor(1 / 1.7**2, dtype=DT)).log_prob(a)
                  + qb.log_prob(b) - InverseGamma(half, torch.tensor(1.0, dtype=DT)).log_prob(b))
    _assert_mc(gs.kl().detach().to(DT), per_sample)
