"""SQS (paper 001): sparse + quantized Bayesian compression of a trained network with a spike-and-GMM family.

Starting point: a trained full-precision plain network (the pipeline's own `dnn` family, trained here in a
deterministic pretraining stage, or a user's state dict loaded with weights_only=True). Every nn.Linear /
nn.Conv2d weight theta_i gets the variational law of eq. 6

    q(theta~_i) = lambda~_i sum_k phi_k(theta_i) N(mu_k, sigma_k^2) + (1 - lambda~_i) delta_0

  - phi_k(theta_i) = softmax_k(varphi_k / tau),  varphi_k = softmax_k(pi_k N(theta_i | mu_k, sigma_k^2))
    (eq. 2, tau = 5e-4); theta_i stays a trainable full-precision latent weight;
  - lambda~_i = sigmoid(s_i / tau') (eq. 33), tau' = 0.0125, halved after half of the fine-tuning steps;
  - a K-component mixture (mu, sigma, pi) per layer and window, initialised by scikit-learn's KMeans on the
    window's weights with each cluster's empirical mean, spread (ddof 1) and share (appendix C);
  - windows (appendix C): "outlier" = [min, q1 - 5 IQR), the body split in two at its median,
    (q3 + 5 IQR, max]; "equal" = four equal-width windows over [min, max] (the paper's ablation);
    "single" = one mixture per layer (exactly K levels per layer: log2 K bits is then what is stored).

Objective (eq. 8) per mini-batch: mean NLL at the mean weight lambda~_i sum_k mu_k phi_k(theta_i), plus
train.kl_weight x regularizer / N_train, with the regularizer
    sum_i KL(Ber(lambda~_i) || Ber(lambda)) + sum_i lambda~_i KL(N(mu_k*, sigma_k*^2) || N(0, sigma0^2)),
k* = argmax_k phi_k. sqs.prior = gaussian is the ablation of appendix D.2: the spike is replaced by
N(0, sigma0^2) and the Bernoulli term goes (the mean weight is the same). AdamW with one learning rate for
the quantization parameters (theta, mu, sigma, pi and the biases) and one for the pruning parameters (s).

Inference (section 3.1): prune deterministically to a non-zero rate r, keeping the round(r T) weights of
largest keep score over the whole network (T = all wrapped weights; biases are never pruned); draw each
kept weight's level k with probability phi_k (eq. 9) and average M such networks (eq. 10, in export's
MCAverage); the greedy alternative (eq. 34) takes k* = argmax phi_k.

Where this deviates from or completes the paper, and why:
  - The pruning schedule is "polynomial" in the paper without a formula. Here it is Zhu & Gupta's (2017)
    gradual pruning: the non-zero rate of step t falls from sqs.keep_init to the target r along
    r_t = r + (keep_init - r)(1 - t / (f T))^3 for t < f T (f = sqs.schedule_fraction), then stays at r;
    the training forward pass prunes the mean weights to r_t with the inference rule (largest keep
    scores), and r_t is also the prior inclusion probability lambda of the Bernoulli KL. Without the
    mask the keep fraction that training settles at is set by the balance of NLL and regularizer, not by
    r, and the network deployed at r has weights switched on or off that training never saw that way
    (on digits training then settled far above the target rate and the net deployed at r was near chance).
  - The paper does not say how s is initialised: all s_i start at tau' logit(keep_init) plus a tie-break
    of 0.1 tau' |theta_i| / std_layer |theta| (0.1 in logit per standard deviation: lambda~ stays near
    keep_init), so the first steps of the schedule prune small weights, not the last ones by index; after
    a few steps (the pruning lr moves s by about tau' per step) the learned scores decide.
  - pi_k enters eq. 2 as written (a weight on the density, clamped at 0), not as a log-prior; sigma_k is
    stored as log sigma_k so it stays positive.
  - Windows with fewer weights than K fit as many components as they have weights; the others get pi = 0
    (they never win). A singleton cluster has no ddof-1 spread: it gets the smallest spread of the layer.
  - sqs.first_layer_scores = per-input (opt-in; the paper's per-weight scores are the default): the first
    layer's weights reading one input feature share one inclusion variable, as in the group spike-and-slab
    of paper 000 with the input feature as the group. The regularizer then counts KL(Ber(lambda~_g) ||
    Ber(lambda)) once per group and lambda~_g KL(slab) per weight, the global quantile ranks each weight by
    its group's score (one boundary group may be cut part-way, so the count stays exact), and whole inputs
    are pruned. Why: an unstructured 50% mask costs about as much on disk as the 2-bit indices of the kept
    weights (compressed/codebook.py; benchmarks/results/sqs_mnist_mlp100.md), and an MLP's first layer
    holds most of its weights; with whole inputs pruned there the first layer's mask costs one bit per input.
  - One K per training run: the pipeline's deploy-time knob is the non-zero rate alone (with M), so select
    sees rate x M; a different K is a different run (config), as the paper trains one model per K.
"""

import copy
import math
import warnings

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from edgebayes.compressed import codebook
from edgebayes.compressed.samples import sample_generator
from edgebayes.config import SQS_WINDOWS as WINDOWS, fingerprint
from edgebayes.data import inputs_fingerprint
from edgebayes.errors import InputError
from edgebayes.provenance import code_version, read_json, write_json
from edgebayes.train.accel import autocast, fused_optimizer, in_layout
from edgebayes.train.bayesianize import read_state_dict, state_as_built, without_wrapper_prefix
from edgebayes.train.flops_target import pruning_schedule
from edgebayes.train.kl import kl_bernoulli, kl_gaussian_gaussian
from edgebayes.train.models import build_model
from edgebayes.train.trainer import ELBO, evaluate, train

WRAPPED = (nn.Linear, nn.Conv2d)


# ---------------------------------------------------------------------------------------------
# Initialisation: windows and K-means
# ---------------------------------------------------------------------------------------------
def assign_windows(theta: np.ndarray, kind: str, iqr_factor: float = 5.0) -> np.ndarray:
    """Window index (0 .. W-1) of every weight of a layer, for the windowing `kind`."""
    theta = np.asarray(theta, dtype=np.float64).ravel()
    if kind == "single":
        return np.zeros(theta.size, dtype=np.int64)
    if kind == "equal":
        lo, hi = theta.min(), theta.max()
        edges = lo + (hi - lo) * np.arange(1, 4) / 4
        return np.searchsorted(edges, theta, side="right").astype(np.int64)
    if kind != "outlier":
        raise ValueError(f"unknown windowing {kind!r}; expected one of {sorted(WINDOWS)}")
    q1, q3 = np.quantile(theta, [0.25, 0.75])
    iqr = q3 - q1
    lower, upper = q1 - iqr_factor * iqr, q3 + iqr_factor * iqr
    body = theta[(theta >= lower) & (theta <= upper)]
    middle = np.median(body)
    window = np.where(theta < lower, 0, np.where(theta < middle, 1, np.where(theta <= upper, 2, 3)))
    return window.astype(np.int64)


def kmeans_gmm(values: np.ndarray, components: int, seed: int = 0):
    """K-means initialisation of one K-component mixture (appendix C).

    Returns (mu, sigma, pi, labels): per cluster G_k its mean, its spread sqrt(sum (x - mu)^2 / (|G_k| - 1))
    and its share |G_k| / n, components sorted by mean; labels give each value's cluster.
    """
    from sklearn.cluster import KMeans

    values = np.asarray(values, dtype=np.float64).ravel()
    mu, sigma, pi = np.zeros(components), np.ones(components), np.zeros(components)
    labels = np.zeros(values.size, dtype=np.int64)
    if values.size == 0:
        return mu, sigma, pi, labels
    k = min(components, np.unique(values).size)
    fit = KMeans(n_clusters=k, n_init=1, random_state=seed).fit(values[:, None])
    order = np.argsort(fit.cluster_centers_.ravel())
    rank = np.empty(k, dtype=np.int64)
    rank[order] = np.arange(k)
    labels = rank[fit.labels_]
    for c in range(k):
        group = values[labels == c]
        mu[c] = group.mean()
        sigma[c] = group.std(ddof=1) if group.size > 1 else np.nan
        pi[c] = group.size / values.size
    filled = sigma[:k]
    # A cluster of identical values (weights exactly at a few levels: an already-quantized checkpoint, a constant or
    # zero-initialised layer) has spread 0 (or float rounding, 1e-17), and log(0) = -inf made every step's loss
    # NaN: it gets the smallest real spread of the window, or, where none has one, 5% of the values' spread (a
    # weight that moves off its level must keep some density under a component).
    scale = np.abs(values).max()
    usable = np.isfinite(filled) & (filled > 1e-6 * scale)
    fallback = filled[usable].min() if usable.any() else max(0.05 * values.std(), 1e-3 * scale, 1e-8)
    sigma[:k] = np.where(usable, filled, fallback)
    mu[k:] = mu[0]  # unused components (pi = 0) sit on a real level, never selected
    return mu, sigma, pi, labels


def _first_argmax(t):
    """t.argmax(0) (the first of equal maxima) as a knockout between neighbouring planes, the left one winning
    ties, with the winners' indices in one byte: torch's CPU argmax over a leading dimension of size K is not
    vectorized (11 % of an SQS step on LeNet-5-Caffe, issue 20), and a running argmax in int64 over the K
    planes still took a fifth of the mixture's time; the knockout is about 3x faster."""
    small = torch.uint8 if len(t) <= 256 else torch.long
    values, indices = list(t.unbind(0)), list(range(len(t)))   # an int: the plane's own index, not yet a tensor
    while len(values) > 1:
        next_values, next_indices = [], []
        for j in range(0, len(values) - 1, 2):
            right = values[j + 1] > values[j]   # strict: of equal values the left one (lower index) wins
            if len(values) > 2:
                next_values.append(torch.maximum(values[j], values[j + 1]))
            if isinstance(indices[j], int):     # first round: the pair's own indices j, j + 1
                next_indices.append(right.to(small).add_(indices[j]))
            else:
                next_indices.append(torch.where(right, indices[j + 1], indices[j]))
        if len(values) % 2:                     # the odd one out goes through
            next_values.append(values[-1])
            last = indices[-1]
            next_indices.append(torch.full(t.shape[1:], last, dtype=small, device=t.device)
                                if isinstance(last, int) else last)
        values, indices = next_values, next_indices
    best = indices[0]
    return torch.full(t.shape[1:], best, dtype=torch.long, device=t.device) if isinstance(best, int) else best.long()


def _mixture(theta, mu, sigma, pi, tau):
    """(z, density, varphi, phi) of eq. 2 for every weight and component k, from theta (*shape) and the per-weight
    tables mu, sigma, pi+ (K, *shape) or (K, 1, ..., 1): z_k = (theta - mu_k) / sigma_k, density_k =
    N(theta | mu_k, sigma_k^2), varphi = softmax_k(pi_k density_k), phi = softmax_k(varphi / tau)."""
    z = (theta - mu) / sigma
    density = torch.exp(-0.5 * z * z) / (math.sqrt(2 * math.pi) * sigma)
    varphi = torch.softmax(pi * density, dim=0)
    return z, density, varphi, torch.softmax(varphi / tau, dim=0)


def _sum_to(grad, shape):
    """`grad` summed over the dimensions where `shape` has 1 (the backward of a broadcast)."""
    dims = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(dims, keepdim=True) if dims else grad


class _MixtureMean(torch.autograd.Function):
    """(sum_k phi_k(theta_i) mu_k, k*_i = argmax_k phi_k) of eq. 2 for every weight, with the backward written out.

    Inputs: theta (*shape) and the per-weight tables mu, sigma, pi+ (K, *shape), or (K, 1, ..., 1) for one
    window. With z_k = (theta - mu_k) / sigma_k, d_k = N(theta | mu_k, sigma_k^2), a_k = pi_k d_k,
    v = softmax(a), phi = softmax(v / tau) and m = sum_k phi_k mu_k, the chain rule gives
        dm/dv_k (times g)   u_k = g phi_k (mu_k - m) / tau
        d/da_k              e_k = v_k (u_k - sum_j v_j u_j)
        d/dtheta = -sum_k h_k z_k,  d/dmu_k = h_k z_k + g phi_k,  d/dsigma_k = h_k (z_k^2 - 1),  d/dpi_k = e_k d_k
    with h_k = e_k a_k / sigma_k. The same values and gradients as autograd through `SpikeGMMWeight.phi`
    (tests/test_sqs.py) in about 2/3 of the time: autograd's backward of the two softmaxes and of the density
    was most of an SQS step on a CPU (issue 20).
    """

    @staticmethod
    def forward(ctx, theta, mu, sigma, pi, tau):
        z, density, varphi, phi = _mixture(theta, mu, sigma, pi, tau)
        best = _first_argmax(phi)
        ctx.mark_non_differentiable(best)
        ctx.tau = tau
        m = (phi * mu).sum(0)
        ctx.save_for_backward(mu, sigma, pi, z, density, varphi, phi, m)
        return m, best

    @staticmethod
    def backward(ctx, g, _):
        mu, sigma, pi, z, density, varphi, phi, m = ctx.saved_tensors
        u = (mu - m).mul_(phi).mul_(g / ctx.tau)
        e = u.sub_((varphi * u).sum(0)).mul_(varphi)
        g_pi = e * density
        h = g_pi * pi / sigma
        hz = h * z
        g_theta = -hz.sum(0)
        g_mu = hz.add_(phi * g)
        g_sigma = h.mul_(z * z - 1)
        return g_theta, _sum_to(g_mu, mu.shape), _sum_to(g_sigma, sigma.shape), _sum_to(g_pi, pi.shape), None


# ---------------------------------------------------------------------------------------------
# The variational family over one weight tensor
# ---------------------------------------------------------------------------------------------
class SpikeGMMWeight(nn.Module):
    """Spike-and-GMM posterior of one weight tensor: latent theta, keep scores s, a mixture per window."""

    def __init__(self, shape, components: int, windows: int, per_input: bool = False):
        super().__init__()
        self.components, self.windows = components, windows
        self.theta = nn.Parameter(torch.zeros(shape))
        # One keep score per weight (the paper), or one per input feature shared by all output units
        # (shape[1:]: it broadcasts against the weight), so that pruning removes whole inputs.
        self.score = nn.Parameter(torch.zeros(shape[1:] if per_input else shape))
        self.mu = nn.Parameter(torch.zeros(windows, components))
        self.log_sigma = nn.Parameter(torch.zeros(windows, components))
        self.pi = nn.Parameter(torch.zeros(windows, components))
        self.register_buffer("window", torch.zeros(shape, dtype=torch.long))

    @torch.no_grad()
    def initialise(self, weight, windowing, iqr_factor, keep_logit, tie_scale, seed):
        w = weight.detach().cpu().double().numpy()
        window = assign_windows(w, windowing, iqr_factor).reshape(w.shape)
        self.theta.copy_(weight)
        self.window.copy_(torch.from_numpy(window))
        for j in range(self.windows):
            mu, sigma, pi, _ = kmeans_gmm(w[window == j], self.components, seed)
            self.mu[j] = torch.from_numpy(mu)
            self.log_sigma[j] = torch.from_numpy(np.log(sigma))
            self.pi[j] = torch.from_numpy(pi)
        # Equal keep probabilities, with a tie-break (0.1 tau' per layer standard deviation of |theta|)
        # so that the first steps of the pruning schedule remove small weights, not the last ones by index.
        # A per-input score ranks its input by the mean |theta| of the weights reading it, on the same
        # scale (the layer's per-weight standard deviation) as per-weight scores.
        magnitude = weight.detach().abs()
        scale = magnitude.std().clamp(min=1e-12)
        if self.score.shape != magnitude.shape:
            magnitude = magnitude.mean(0)
        self.score.copy_(keep_logit + 0.1 * tie_scale * magnitude / scale)

    def _per_weight(self, table):
        """A (W, K) table as (K, *weight shape): each weight's window's row, components on dim 0, so that the
        softmaxes and sums over k run over contiguous planes (with k last they were reductions of stride K,
        most of an SQS step on a CPU: issue 20). (K, 1, ..., 1) for one window."""
        by_component = table.t()
        if self.windows == 1:
            return by_component.reshape((self.components,) + (1,) * self.theta.dim())
        return by_component.index_select(1, self.window.reshape(-1)).view((self.components,) + self.theta.shape)

    def phi(self, tau):
        """phi_k(theta_i) of eq. 2, shape (K, *weight shape)."""
        return _mixture(*self._mixture_inputs(), tau)[3]

    def _mixture_inputs(self):
        """(theta, mu, sigma, pi+) as _mixture takes them: theta in the tables' layout (a channels_last model
        makes conv weights NHWC), the tables per weight."""
        return (self.theta.contiguous(), self._per_weight(self.mu), self._per_weight(self.log_sigma.exp()),
                self._per_weight(self.pi.clamp(min=0)))

    def mixture_mean(self, tau):
        """(sum_k phi_k(theta_i) mu_k, k*_i = argmax_k phi_k) for every weight, from one evaluation of phi
        (_MixtureMean; under torch.compile the plain expression, which the compiler fuses itself)."""
        if torch.compiler.is_compiling():
            phi = self.phi(tau)
            return (phi * self._per_weight(self.mu)).sum(0), _first_argmax(phi)
        return _MixtureMean.apply(*self._mixture_inputs(), tau)

    def terms(self, tau, tau_prime, sigma0_sq, spike, mask=None):
        """(mean weight, regularizer) of eq. 8 for this tensor, from one evaluation of phi.

        `mask` (training only): the pruning schedule's current keep mask, applied to the mean weight.
        The slab term sum_i lambda~_i KL(N(mu_k*, sigma_k*^2) || N(0, sigma0^2)) is summed per level:
        sum over levels (window, k) of the level's KL times the summed lambda~ of the weights whose k* it is
        (counted in float64, so that no weight's share is lost in a sum of 10^5-10^6 terms). The same sum,
        with one pass over the weights instead of a gather of each weight's level and its KL.
        """
        keep = self.keep_probability(tau_prime)
        m, best = self.mixture_mean(tau)
        mean = keep * m
        if mask is not None:
            mean = mean * mask
        level = (best if self.windows == 1 else self.window * self.components + best).reshape(-1)
        keep_per_level = torch.zeros(self.mu.numel(), dtype=torch.float64, device=level.device).index_add_(
            0, level, keep.expand(best.shape).reshape(-1).double())
        kl_per_level = kl_gaussian_gaussian(self.mu.reshape(-1), self.log_sigma.exp().reshape(-1),
                                            math.log(sigma0_sq), 1 / sigma0_sq)
        reg = (kl_per_level.double() * keep_per_level).sum().to(kl_per_level.dtype)
        if spike is not None:
            reg = reg + kl_bernoulli(keep, spike).sum()
        return in_layout(mean, self.theta), reg

    def keep_probability(self, tau_prime):
        """lambda~ of eq. 33: per weight, or per input (broadcasts against the weight)."""
        return torch.sigmoid(self.score / tau_prime)

    def weight_scores(self):
        """Every weight's keep score (a per-input score repeated over the output units)."""
        return self.score.detach().expand(self.theta.shape)

    def levels(self):
        """The layer's codebook, window-major: level window * K + k is mu[window, k]."""
        return self.mu.detach().reshape(-1)


# ---------------------------------------------------------------------------------------------
# The network
# ---------------------------------------------------------------------------------------------
def _input_layer(base, wrapped):
    """The wrapped layer that reads the network's input (sqs.first_layer_scores: per-input): the first of them
    to run on an input of base.input_shape, which need not be the first registered (a head defined before the
    body). None, with a warning, where that layer has one input feature (a Conv2d of one channel and a 1x1
    kernel): one shared score would keep or cut the whole layer."""
    if getattr(base, "input_shape", None) is None:
        raise ValueError("sqs.first_layer_scores per-input: the network has no input_shape (one example's shape) "
                         "to find the layer that reads the input with; set it on the module")
    ran = []
    hooks = [base.get_submodule(name).register_forward_pre_hook(lambda m, a, name=name: ran.append(name))
             for name in wrapped]
    was_training = base.training
    try:
        with torch.no_grad():
            base.eval()(torch.zeros((1,) + tuple(base.input_shape)))
    finally:
        base.train(was_training)
        for hook in hooks:
            hook.remove()
    if not ran:
        return None
    first = base.get_submodule(ran[0])
    if first.weight[0].numel() < 2:
        warnings.warn(f"sqs.first_layer_scores per-input: {ran[0]} reads one input feature, so one shared score "
                      f"would keep or cut the whole layer; its weights keep the paper's per-weight scores")
        return None
    return ran[0]


class SQSNet(nn.Module):
    """A plain network whose Linear / Conv2d weights carry the spike-and-GMM posterior (model interface)."""

    knob = "nonzero_rate"

    def __init__(self, base: nn.Module, *, components=4, windowing="outlier", iqr_factor=5.0, tau=5e-4,
                 tau_prime=0.0125, sigma0_sq=1.0, prior="spike-slab", nonzero_rate=0.5,
                 operating_points=None, first_layer_scores="per-weight"):
        super().__init__()
        if windowing not in WINDOWS:
            raise ValueError(f"unknown windowing {windowing!r}; expected one of {sorted(WINDOWS)}")
        self.base = base
        self.input_shape = getattr(base, "input_shape", None)  # surgery probes with it (compressed/surgery.py)
        self.components, self.windowing, self.iqr_factor = components, windowing, iqr_factor
        self.tau, self.sigma0_sq, self.prior = tau, sigma0_sq, prior
        self.default_knob = nonzero_rate
        self.default_operating_points = tuple(operating_points or (nonzero_rate,))
        self.wrapped = [name for name, m in base.named_modules() if isinstance(m, WRAPPED)]
        if first_layer_scores not in ("per-weight", "per-input"):
            raise ValueError(f"first_layer_scores must be 'per-weight' or 'per-input', got {first_layer_scores!r}")
        self.first_layer_scores = first_layer_scores
        grouped = _input_layer(base, self.wrapped) if first_layer_scores == "per-input" else None
        self.posteriors = nn.ModuleDict({
            self._key(name): SpikeGMMWeight(base.get_submodule(name).weight.shape, components, WINDOWS[windowing],
                                            per_input=name == grouped)
            for name in self.wrapped})
        for name in self.wrapped:  # the posterior replaces the weight; theta holds its trained value
            base.get_submodule(name).weight.requires_grad_(False)
        self.register_buffer("tau_prime", torch.tensor(float(tau_prime)))
        self.register_buffer("prior_inclusion", torch.tensor(float(nonzero_rate)))

    @staticmethod
    def _key(name):
        return name.replace(".", "/")

    def posterior(self, name) -> SpikeGMMWeight:
        return self.posteriors[self._key(name)]

    @torch.no_grad()
    def initialise(self, keep_init=0.99, seed=0):
        """K-means mixtures and keep scores from the base network's trained weights."""
        keep_logit = float(self.tau_prime) * math.log(keep_init / (1 - keep_init))
        for name in self.wrapped:
            self.posterior(name).initialise(self.base.get_submodule(name).weight, self.windowing,
                                            self.iqr_factor, keep_logit, float(self.tau_prime), seed)
        return self

    # -- training ---------------------------------------------------------------------------------
    def weights_and_regularizer(self, nonzero_rate=None):
        """({weight name: E_q[theta~_i] = lambda~_i sum_k mu_k phi_k(theta_i)}, eq. 8's regularizer).

        The mean weights enter eq. 8's likelihood term; the regularizer is
        sum_i KL(Ber(lambda~_i) || Ber(lambda)) + lambda~_i KL(N(mu_k*, sigma_k*^2) || N(0, sigma0^2)),
        without the Bernoulli term for the Gaussian-prior ablation. With `nonzero_rate` (the pruning
        schedule's rate during training) the mean weights are pruned by the inference rule (keep_masks).
        """
        spike = self.prior_inclusion if self.prior == "spike-slab" else None
        masks = self.keep_masks(nonzero_rate) if nonzero_rate is not None and nonzero_rate < 1 else {}
        weights, total = {}, torch.zeros((), device=self.tau_prime.device)
        for name in self.wrapped:
            mean, reg = self.posterior(name).terms(self.tau, self.tau_prime, self.sigma0_sq, spike, masks.get(name))
            weights[f"{name}.weight"] = mean
            total = total + reg
        return weights, total

    def forward(self, x):
        return functional_call(self.base, self.weights_and_regularizer()[0], (x,))

    def kl(self):
        """The regularizer of eq. 8 (or of the Gaussian-prior ablation), summed over all wrapped weights."""
        return self.weights_and_regularizer()[1]

    def parameter_groups(self):
        """(quantization parameters, pruning parameters) for AdamW's two learning rates."""
        pruning = [p.score for p in self.posteriors.values()]
        ids = {id(p) for p in pruning}
        quantization = [p for p in self.parameters() if p.requires_grad and id(p) not in ids]
        return quantization, pruning

    # -- inference --------------------------------------------------------------------------------
    def operating_points(self, values=None):
        """The non-zero rates to try; each must lie in (0, 1]."""
        values = list(self.default_operating_points if values is None else values)
        bad = [v for v in values if not 0 < v <= 1]
        if bad:
            raise ValueError(f"non-zero rates must lie in (0, 1], got {bad}")
        return values

    @torch.no_grad()
    def keep_masks(self, nonzero_rate):
        """{layer: bool mask}: the round(rate T) weights of largest keep score over the network are kept.

        Ties (equal scores) go to the weight that comes first, so the count is exact.
        """
        scores = torch.cat([self.posterior(n).weight_scores().reshape(-1) for n in self.wrapped])
        n_keep = int(round(float(nonzero_rate) * scores.numel()))
        if n_keep == 0:
            flat = torch.zeros(scores.numel(), dtype=torch.bool, device=scores.device)
        else:
            # The n_keep-th largest score by selection (linear time; this runs every training step, where a
            # full sort of a million scores cost more than the step's matmuls), then the weights above it
            # and, of those equal to it, the first ones: the same mask as a stable descending sort.
            threshold = torch.kthvalue(scores, scores.numel() - n_keep + 1).values
            flat = scores > threshold
            ties = (scores == threshold).nonzero().squeeze(1)
            flat[ties[: n_keep - int(flat.sum())]] = True
        masks, start = {}, 0
        for name in self.wrapped:
            shape = self.posterior(name).theta.shape
            masks[name] = flat[start: start + shape.numel()].reshape(shape)
            start += shape.numel()
        return masks

    @torch.no_grad()
    def sample_levels(self, generator=None, greedy=False):
        """{layer: codebook index of every weight}: drawn with probability phi_k (eq. 9) or argmax (eq. 34)."""
        out = {}
        for name in self.wrapped:
            p = self.posterior(name)
            phi = p.phi(self.tau).cpu()
            if greedy:
                k = _first_argmax(phi)
            else:
                u = torch.rand((1,) + phi.shape[1:], generator=generator, dtype=phi.dtype)
                k = (phi.cumsum(0) < u).sum(0).clamp(max=self.components - 1)
            out[name] = p.window.cpu() * self.components + k
        return out

    @torch.no_grad()
    def quantized_weights(self, nonzero_rate, generator=None, greedy=False):
        """{layer: dense weight} of one sample: codebook values at kept weights, exact zeros elsewhere."""
        masks, levels = self.keep_masks(nonzero_rate), self.sample_levels(generator, greedy)
        return {name: self.posterior(name).levels().cpu()[levels[name]] * masks[name].cpu() for name in self.wrapped}

    @torch.no_grad()
    def posterior_sample(self, nonzero_rate, generator=None, greedy=False):
        """One sampled sparse quantized network as a plain module, with {layer: all-True mask}.

        The pruning is unstructured, so no unit is removed: the masks keep every output unit.
        """
        plain = copy.deepcopy(self.base).cpu()
        for name, w in self.quantized_weights(nonzero_rate, generator, greedy).items():
            plain.get_submodule(name).weight.copy_(w)
        if hasattr(plain, "posterior_sample"):  # the pipeline's architectures give a named Sequential
            return plain.posterior_sample(None, None)
        return plain.eval(), {}

    # -- compressed form --------------------------------------------------------------------------
    @torch.no_grad()
    def layer_codes(self, nonzero_rate, m=1, seed=0, greedy=False):
        """The codebook form (compressed/codebook.py) of the m samples that compress() draws (compressed/samples.py)."""
        gen, masks = sample_generator(seed), self.keep_masks(nonzero_rate)
        draws = [self.sample_levels(gen, greedy) for _ in range(m)]
        codes = []
        for name in self.wrapped:
            mask = masks[name].cpu().numpy()
            kept = np.stack([d[name].numpy()[mask] for d in draws])
            used, indices = np.unique(kept, return_inverse=True)
            levels = self.posterior(name).levels().cpu().numpy()[used].astype(np.float32)
            bias = self.base.get_submodule(name).bias
            codes.append(codebook.LayerCode(name, levels, mask, indices.reshape(kept.shape),
                                            None if bias is None else bias.detach().cpu().numpy()))
        return codes

    def write_compressed(self, path, nonzero_rate, m=1, seed=0, greedy=False):
        """Write the compressed file; returns its rates (paper formula and bytes, compressed/codebook.py)."""
        codes = self.layer_codes(nonzero_rate, m, seed, greedy)
        meta = {"nonzero_rate": nonzero_rate, "components": self.components, "windowing": self.windowing,
                "samples": m, "greedy": greedy}
        info = codebook.write(path, codes, meta)
        return codebook.rates(codes, info["bytes"], math.log2(self.components))


def load_compressed(path, base: nn.Module, sample=0) -> nn.Module:
    """A copy of `base` with the weights and biases of one sample of a compressed file."""
    codes, _ = codebook.read(path)
    plain = copy.deepcopy(base).cpu()
    with torch.no_grad():
        for code in codes:
            layer = plain.get_submodule(code.name)
            layer.weight.copy_(torch.from_numpy(code.weights(sample)))
            if code.bias is not None:
                layer.bias.copy_(torch.from_numpy(code.bias))
    return plain.eval()


# ---------------------------------------------------------------------------------------------
# Building, training
# ---------------------------------------------------------------------------------------------
def base_config(cfg):
    """The config of the deterministic network SQS wraps: the same architecture, family dnn."""
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"family": "dnn"})})


def build_base(cfg, splits):
    """The plain (dnn) network of the configured architecture that SQS wraps, untrained."""
    return build_model(base_config(cfg).model, cfg.prior, splits.input_shape, len(splits.classes),
                       len(splits.train_x))


def build_sqs(cfg, input_shape, classes, n_train):
    """An SQS network of the configured architecture (untrained; `initialise` or load a state dict)."""
    s = cfg.sqs
    base = build_model(base_config(cfg).model, cfg.prior, input_shape, classes, n_train)
    return SQSNet(base, components=s.components, windowing=s.windows, iqr_factor=s.iqr_factor, tau=s.tau,
                  tau_prime=s.tau_prime, sigma0_sq=cfg.prior.sigma0_sq, prior=s.prior,
                  nonzero_rate=s.nonzero_rate, operating_points=s.operating_points,
                  first_layer_scores=s.first_layer_scores)


def pretrained_base(cfg, splits, train_dir, log=print):
    """The starting network: a user's state dict (sqs.checkpoint) or the pipeline's own dnn, trained here.

    The deterministic stage is the first call of the one training loop (train/trainer.py, the ELBO of a
    dnn: its KL is 0, so the plain NLL); it checkpoints to train_dir/pretrained.pt (resumable) and is
    reused while its config (seed, data, model, the pretraining settings) is unchanged; pretrained.json
    holds its metrics.
    """
    s, base_cfg = cfg.sqs, base_config(cfg)
    if s.checkpoint:
        base = load_checkpoint(build_base(cfg, splits), s.checkpoint, cfg.model.arch)
        source = {"source": "checkpoint", "path": str(s.checkpoint)}
    else:
        pre_cfg = base_cfg.model_copy(update={"train": cfg.train.model_copy(update=dict(
            epochs=s.pretrain_epochs, lr=s.pretrain_lr, kl_weight=1.0, mc_samples_eval=1, mc_samples_val=1))})
        path, marker = train_dir / "pretrained.pt", train_dir / "pretrained.json"
        # what the files hold counts too, as for the train stage: a replaced data file or model.pretrained, the
        # user's own network or loader edited
        weights = [("model.pretrained", cfg.model.pretrained)] if cfg.model.pretrained else []
        key = fingerprint("sqs-pretrain", code_version(), cfg.seed, cfg.data, base_cfg.model, pre_cfg.train,
                          *inputs_fingerprint(cfg, weights))
        if path.exists() and (not marker.is_file() or read_json(marker).get("fingerprint") != key):
            path.unlink()
        write_json(marker, {"fingerprint": key})
        log(f"sqs: pretraining the deterministic {cfg.model.arch} for {s.pretrain_epochs} epochs"
            + (f" from model.pretrained {cfg.model.pretrained} (sqs.checkpoint compresses a trained network's "
               f"weights as they are)" if cfg.model.pretrained else ""))
        base, _ = train(pre_cfg, splits, path, lambda: build_base(cfg, splits), ELBO(), log)
        source = {"source": "pretrained", "epochs": s.pretrain_epochs, "fingerprint": key,
                  "from": cfg.model.pretrained}
    base = base.cpu().eval()
    test, _, _ = evaluate(base, splits.test_x, splits.test_y, 1.0, 1, cfg.seed, allow_no_network=True)
    write_json(train_dir / "pretrained.json", {**source, "test": test})
    return base, test


def load_checkpoint(base, path, arch):
    """`base` (the plain network SQS wraps) with every tensor of the state dict at `path` (sqs.checkpoint): read as
    model.pretrained files are (a checkpoint's "model" / "state_dict" entry, a DataParallel or torch.compile
    prefix), but all of it: SQS compresses these weights as they are, so a tensor missing, extra or of another
    shape is an InputError naming the first few."""
    state = read_state_dict(path, key="sqs.checkpoint")
    # The plain architecture's own keys (hidden1.weight, ...) or the pipeline's (net.hidden1.weight)
    target = base.net if hasattr(base, "net") and not any(k.startswith("net.") for k in state) else base
    own = target.state_dict()
    state = state_as_built(without_wrapper_prefix(state, own), target)   # the file as the network's author saved it
    problems = []
    for what, keys in (("missing", [k for k in own if k not in state]),
                       ("not in the model", [k for k in state if k not in own]),
                       ("of another shape", [f"{k} {tuple(state[k].shape)} (the model's {tuple(own[k].shape)})"
                                             for k in own if k in state and state[k].shape != own[k].shape])):
        if keys:
            problems.append(f"{len(keys)} tensor(s) {what}: {', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}")
    if problems:
        raise InputError(f"sqs.checkpoint {path}: not a state dict of the configured {arch}: {'; '.join(problems)}")
    target.load_state_dict(state)
    return base


class SQSObjective:
    """Eq. 8 for the one training loop (train/trainer.py ELBO says what an objective answers).

    AdamW with one learning rate for the quantization parameters and one for the keep scores; each step
    sets the pruning schedule's rate (the prior inclusion lambda and the training mask) and halves tau'
    after half of the steps; the mean weights and the regularizer come from one evaluation of phi.
    Validation is the deployed form: compress at the default non-zero rate (trainer.evaluate).
    `masked=False` is the ablation of the module docstring's hard top-r_t mask (benchmarks/sqs_ablations.py):
    eq. 8 as written, the mean weights unpruned in the likelihood term, lambda = r_t still in the
    regularizer; pruning to r happens at inference only.
    """

    name = "sqs"
    shown = ("train_keep_fraction",)
    # what the loop validates before the first step, and the advice when the fine-tuning ends below it
    # (trainer.lost_accuracy): the given network already quantized and pruned, not the network as given
    start = ("the network SQS starts from, quantized (k-means levels) and pruned to the non-zero rate",
             "SQS's fine-tuning ended below its own start. A lower sqs.lr_quantization or sqs.lr_pruning, or more "
             "train.epochs, keeps more of it (train/sqs.py)")

    def __init__(self, s, masked=True):
        self.s, self.masked = s, masked

    def optimizer(self, model, t):
        quantization, pruning = model.parameter_groups()
        groups = [{"params": quantization, "lr": self.s.lr_quantization}, {"params": pruning, "lr": self.s.lr_pruning}]
        return torch.optim.AdamW(groups, weight_decay=self.s.weight_decay, **fused_optimizer(groups)), None

    def prepare(self, model, forward, example, t, log):
        if t.compile:
            log("train.compile: not applied to SQS fine-tuning (its forward is a functional_call with new "
                "weights every step); the pretraining stage compiles")
        return forward, model.kl

    def schedule_steps(self, total_steps):
        """The pruning schedule's span: the keep rate reaches sqs.nonzero_rate after it (`terms`)."""
        return math.ceil(self.s.schedule_fraction * total_steps)

    def start_epoch(self, model, epoch, epochs):
        pass

    def terms(self, model, forward, kl_term, x, step, total_steps, device, precision):
        s = self.s
        rate = pruning_schedule(step, total_steps, s.keep_init, s.nonzero_rate, s.schedule_fraction)
        model.prior_inclusion.fill_(rate)
        model.tau_prime.fill_(s.tau_prime / 2 if step >= total_steps / 2 else s.tau_prime)
        weights, kl = model.weights_and_regularizer(rate if self.masked else None)  # phi once per step; fp32
        with autocast(device, precision):  # bf16 matmuls / convolutions only (train/accel.py)
            logits = functional_call(model.base, weights, (x,))
        return logits, kl

    def validate(self, model, splits, cfg, device):
        # a schedule's early scores may cut a whole small layer: scored as it is (the floor of a constant net)
        val, _, _ = evaluate(model, splits.val_x, splits.val_y, model.default_knob, cfg.train.mc_samples_val,
                             cfg.seed, allow_no_network=True)
        with torch.no_grad():
            keep = torch.cat([model.posterior(nm).keep_probability(model.tau_prime).expand(
                model.posterior(nm).theta.shape).reshape(-1) for nm in model.wrapped])
        return {"val_accuracy": val["accuracy"], "val_nll": val["nll"],
                "train_keep_fraction": float((keep > 0.5).float().mean()),
                "prior_inclusion": float(model.prior_inclusion), "tau_prime": float(model.tau_prime)}


def train_sqs(cfg, splits, checkpoint_path, log=print, masked=True):
    """Pretrain (or load) the full-precision network, then SQS fine-tuning; returns (model, history).

    Two calls of the one training loop (train/trainer.py): the dnn under the ELBO (pretrained_base), then
    the SQS net under eq. 8 (`masked`: SQSObjective). Both are resumable: a checkpoint after every epoch
    with the optimizer and RNG states.
    """
    s = cfg.sqs
    base, base_test = pretrained_base(cfg, splits, checkpoint_path.parent, log)
    log(f"sqs: K={s.components}, windows={s.windows}, prior={s.prior}, target non-zero {s.nonzero_rate}; "
        f"full-precision test accuracy {base_test['accuracy']:.4f}")

    def build():
        model = build_sqs(cfg, splits.input_shape, len(splits.classes), len(splits.train_x))
        model.base.load_state_dict(base.state_dict())
        return model.initialise(s.keep_init, cfg.seed)

    return train(cfg, splits, checkpoint_path, build, SQSObjective(s, masked), log)


def stage_summary(model, splits, train_dir, knob_value, test_metrics):
    """Train-stage figures of an SQS run: accuracy against the full-precision start and compression.

    The compressed file of one posterior sample (eq. 9) at the default non-zero rate is written to
    train_dir/model.sqs, so its bytes are measured, not estimated.
    """
    start = read_json(train_dir / "pretrained.json")
    rates = model.write_compressed(train_dir / "model.sqs", knob_value, m=1)
    # What SQS does not quantize (a Conv3d, norms) ships as fp32 beside the file: the network's rate counts it
    # (the file's rates were read as the network's: 16x by bytes where the network with a plain Conv1d was 7x).
    # Parameters only: a norm's running statistics are left out, and a norm that export folds into its
    # convolution is counted though it ships inside it: near, not exact, for nets with norms
    others = sum(p.numel() for name, p in model.base.named_parameters()
                 if name.rpartition(".")[0] not in model.wrapped)
    return {"unquantized_params": others,
            "rate_bytes_network": (rates["fp32_bytes"] + 4 * others) / (rates["file_bytes"] + 4 * others),
            "components": model.components, "windows": model.windowing, "prior": model.prior,
            "first_layer_scores": model.first_layer_scores,
            "full_precision_test": start["test"], "start": {k: v for k, v in start.items() if k != "test"},
            "accuracy_drop": start["test"]["accuracy"] - test_metrics["accuracy"],
            "compressed_file": "model.sqs", **rates}
