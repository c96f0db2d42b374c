"""Bayesian nested neural networks, BN3 (paper 002), and the fixed nested-dropout baseline FN3.

The output channels (units) of a layer are split into D groups: channel c of C belongs to group
floor(c D / C) (contiguous groups of C/D channels; a layer with C < D leaves some groups empty). The first
F groups are fixed (always kept, "base features"); the other K = D - F are ordered by a variational
ordering unit:

  - posterior: conditional keep probabilities mu_j = sigmoid(mubar_j) (appendix 8.2 and footnote 3), mu_1 = 1,
    mu_{K+1} = 0, mubar initialised at 3; beta_j = (1 - mu_{j+1}) prod_{k<=j} mu_k is the probability that
    exactly the first j groups are kept (q(v_j), eq. 12), and P(z_j = 1) = prod_{k<=j} mu_k = sum_{v>=j} beta_v;
  - Downhill sample (Property 1): g ~ Gumbel(0, 1), c = softmax((log beta + g) / tau), z_i = 1 - sum_{j<i} c_j
    (the exclusive cumulative sum: z_1 = 1, z non-increasing in [0, 1]); tau is annealed during training;
  - prior: the Bernoulli chain of eq. 1 with pi_1 = 1 and pi_j = sigmoid(prior_keep_logit) for j >= 2, so
    p(v_j) = (1 - pi_{j+1}) prod_{k<=j} pi_k (eq. 12, 33), pi_{K+1} = 0.

Weights carry multiplicative Gaussian noise w = theta (1 + sqrt(alpha) eps) (eq. 17) with the local
reparameterization of eq. 21-22 (mean x theta, variance x^2 alpha theta^2), computed as the spike-and-slab
layers compute theirs (spike_slab.local_reparameterization: blocks of the batch, a written-out backward; the same
values and gradients as the plain expression, tests/test_nested.py); log alpha starts at -1, at -8 in the
network's first layer (appendix 9.1). The sampled mask multiplies the layer's output channels (eq. 21,
38), group-wise, one mask per example, multiplied in the same blocks where no batch norm comes between (a pass
over the output fewer forward and two backward: LeNet-5-Caffe's first convolution at batch 1024, forward and
backward, 626 against 659 ms, this CPU under load); in a network with batch norms one mask per batch (deviation
below), folded into the batch norm's affine map (spike_slab.scaled_batch_norm, exact). With both, a training step of
benchmarks/finetune_compress.py's efficientnet_b0 (batch 128, CPU) holds 566 MiB of activations instead of 902
with the plain expressions, in 3% less time.

KL of a nested layer (eq. 11) = Phi1 + Phi2, scaled by kappa (train.kl_weight) in the trainer:
  - Phi1 = sum_j beta_j log(beta_j / p(v_j)) over the K ordered masks (eq. 12, 31);
  - Phi2 = e^T K^1 J_L^T beta (eq. 15 with the zero component dropped: q(w | z = 0) is the prior's spike,
    section 3.4), K^1_ij the KL of weight i of group j, from eq. 20:
        -K^1_ij = a1 exp(-exp(a4) (a2 + a3 log alpha_ij)^2) - 0.5 log(1 + 1/alpha_ij) + C.
    The fixed groups are kept with probability 1, so their weights count in full; a layer without nested
    dropout (the output layer, VGG's first layer and dense layers) is a plain variational layer, KL sum_ij K^1_ij.

Where this completes or deviates from the paper, and why:
  - C of eq. 20 is not given. Here C = -a1, so K^1 = a1 - f(log alpha) > 0 for every alpha (the fitted curve
    peaks below a1), as a KL must be: Phi2 then penalizes larger sub-networks, which is the ordered-l0
    reading of appendix 7.3. Over the fitted range log alpha in [-5, 0.5] this K^1 lies within 0.1 nats of
    Molchanov et al.'s approximation of the same eq. 19 (tests/test_nested.py checks it).
  - The prior's pi is not given. Default: pi = sigmoid(3), the posterior's initial mu, so Phi1 = 0 at init; or
    "uniform" (FN3's distribution), with mubar_init "uniform" likewise Phi1 = 0 at init.
  - nested.mubar_init: "uniform" starts BN3 from FN3's distribution (every width equally likely) instead of
    mubar = 3; our MNIST LeNet-5-Caffe config uses it (the paper has no LeNet setup). Why: with D = 10
    groups, mubar = 3 puts 68 % of the mass on the full width and 4.7 % on widths <= 2, and mubar moves at
    most about lr per Adam step, so in a CPU-length run the narrow sub-networks are rarely trained
    (benchmarks/results/nested_width_sweep_mnist_lenet5.md). nested.prior_keep_logit: "uniform" makes
    FN3's distribution the prior as well, since the sigmoid(3) chain pulls q towards the full width.
    The LeNet-5-Caffe config's uniform prior, log alpha init -4 and kappa 1e-2 are the setting in which
    BN3 matches FN3 at the narrow widths (the data term moves q's mass towards wider sub-networks, and the
    narrow network carries noise sized for all widths): 3 seeds in
    benchmarks/results/nested_width_seeds_mnist_lenet5_full15ep.md; the settings that trail FN3 in
    nested_width_sweep_mnist_lenet5_full15ep*.md.
  - Biases are deterministic (the paper omits them, section 3.2) and carry no KL.
  - In a network with batch norms every layer draws one mask per batch, not one per example
    (NestedNet sets `mask_per_batch`). The ELBO is the same (each example's expected log-likelihood over z;
    one draw shared by the batch is still an unbiased estimate of it, with more variance); what changes is
    what a training-mode batch norm sees: per-example masks mix the activations of up to K sub-networks in
    one batch's statistics, normalising every example, the full-width ones too, with statistics of none of
    them (the reason slimmable networks keep one batch norm per width). From scratch the network learns
    around it; from trained weights it wrecks them: a torchvision MobileNetV2 trained on MNIST (88% test
    accuracy) fell to chance within 16 steps and ended its 3-epoch fine-tuning at 12% at every width
    (benchmarks/results/finetune_compress.md, before this change). The evaluation-time statistics are
    recollected per width anyway (appendix 9.2). One mask per batch is not enough for that MobileNetV2 either:
    bayesianized, it is at 90.5% at full width before the first step (test-time rescaling off; 64.7% with it)
    and at 27.6% after the 3 epochs, 28.8% with the KL off (kl_weight 1e-9), 50% with the temperature at
    0.03 from the first step, and 92% when the same 3 epochs draw no masks: a fine-tuning budget does not
    re-train a deep batch-norm network for every width (slimmable networks keep one batch norm per width
    and train many epochs), and the spike-and-slab families' FLOPs target is the recipe for trained
    networks (train/flops_target.py). Most of that loss was the independence of the layers' draws (next).
  - One Downhill draw per training step shared by every nested layer (nested.shared_draw, on by default; the
    paper's configs set false). The paper's posterior is a mean field: each layer's ordering unit draws on its
    own. Here the layers share the uniforms behind the Gumbel noise, so each layer's mask keeps its law,
    Downhill(beta_l, tau), and layers whose orderings agree are cut at the same width, which is what test time
    deploys (every layer at width k, appendix 8.2) and what slimmable networks train. Independent draws train
    networks that are never deployed: MobileNetV2 has 52 nested layers, each at full width with probability
    0.24 at D = 32 and mubar = 3 (keeping 54% of its ordered groups on average), so every step cut every
    layer at its own random width, and from trained weights that wrecked the network at every width:
    benchmarks/finetune_compress.py's MobileNetV2 (seed 0, 5 epochs) ended at 0.504 validation accuracy at full
    width with independent draws and at 0.831 with one shared draw (0.705 after the first epoch); at 0.42 of its
    FLOPs 42.15% test accuracy against 73.75%. The figures of every benchmark net are in
    benchmarks/results/finetune_compress.md. What is not the paper's: the expected log-likelihood is taken under
    this coupled q, and the KL is still the sum of the layers' own: the coupled q's KL to the prior is larger by
    the coupling's total correlation, which the objective here leaves out.
  - With train.flops_target (a fine-tuning with a budget) the widest width within the target becomes the narrowest
    one trained and served (NestedNet.serve_from, flops_target.nested_width_within): its first width - 1 groups
    are fixed groups and every ordering unit orders the wider ones, restarted at mubar_init. The paper trains every
    width from F + 1; a user who says how small never deploys a narrower one, and a few epochs do not train every
    width of a trained deep batch-norm network: the steps at widths under the target pull the shared weights away
    from the widths that ship. benchmarks/finetune_compress.py's MobileNetV2 (seed 0, 5 epochs), validation
    accuracy at width 20 of 32 (0.42 of the FLOPs) / at the widest width within 0.25 of them:
      every width from 3 (the paper)                         0.717 / 0.401 (width 11, 0.149: select's eight points)
      the same, weight noise at log alpha -7.8, not -4.6     0.707 / 0.425
      the same, mubar and the prior's logit at 2 (narrower)  0.310 / 0.259
      widths 11..32 only (fixed groups 10)                   0.819 / 0.664 (width 14, 0.23)
      every step at width 11 alone                           -     / 0.846 (width 11)
    so the noise is not the cause, more steps at narrow widths do not help, and a narrow width trains as a pruned
    network does only where nothing narrower shares its steps. The cost: no width under the target is served.
  - With train.flops_target the narrowest width served (the one the target ships) has probability
    nested.target_width_probability, 0.99 by default, in the prior and in q at init (OrderingUnit's beta_1; the
    wider widths keep mubar_init's and prior_keep_logit's chain, so Phi1 = 0 at the start). The paper's mubar = 3
    gives it 1 - sigmoid(3) = 0.047 of the steps, and the data term moves q towards wider widths. The same
    MobileNetV2 trained toward 0.25 (widths 14..32), validation accuracy at width 14 (0.22 of the FLOPs) / at
    width 21 (0.46), test-time rescaling on:
      probability 0.047 (mubar 3)   0.623 / 0.869      0.5    0.801 / 0.792
      0.25                          0.738 / 0.820      0.75   0.854 / 0.848      0.9   0.859 / 0.858
    and the home-made CNN of the benchmark (seed 0, widths 14..32): 0.922 -> 0.950 at width 14, 0.965 -> 0.949
    at width 22. Where the user's target lies is where the steps go; the wider widths, still served, lose some.
    0.75 was chosen on those two nets first; efficientnet_b0 then showed what the 25% of steps at wider widths
    cost a cut network still being repaired. Validation accuracy of fit's last epoch, fine-tuned toward 0.25
    (benchmark seeds, 5 epochs; 0.75: the rows of 9f9c77b, whose training code e707a36 kept, and
    efficientnet_b0's at e707a36; 0.9 and 0.99 at e707a36), at 0.75 / 0.9 / 0.99, and the test accuracy of the
    width within 0.25 that ships (benchmarks/results/finetune_compress_bn3_target.md and the rows it replaced):
      efficientnet_b0 seed 2        0.544 / 0.666 / 0.726   test 65.15 (0.75, at 87a5ce4) / 69.80 / 74.25
      mobilenet_v2 seeds 0, 1, 2    0.796, 0.750, 0.771 at 0.75; 0.884, 0.846, 0.831 at 0.99
                                    test 85.60, 81.90, 82.35 at 0.75; 88.80, 86.40, 85.00 at 0.99
      home-made CNN seeds 0, 1, 2   0.954, 0.942, 0.951 at 0.75; 0.949, 0.944, 0.946 at 0.99 (0.949, 0.941, 0.944 at 0.9)
                                    test 95.85, 95.10, 95.40 at 0.75; 95.95, 95.30, 95.55 at 0.99
    Those validation figures are not of that width: fit validated the default knob, which was the full width
    until a0d860a (NestedNet.serve_from), with test-time rescaling, so the wider channels counted at their
    inclusion probabilities (about 0.01 each at 0.99, up to 0.25 at 0.75). The shipped width's test accuracy
    is higher at 0.99 than at 0.75 on every seed of the three nets (+0.10 to +9.10 points).
    So 0.99, the same for every net: the width the user's target ships takes nearly every step, as a pruned
    network's fine-tuning does, and the wider widths are served from what those steps leave them. Weight noise
    ten times smaller (sqrt(alpha) 0.003) at 0.99 gave efficientnet_b0 0.686, within the run-to-run spread, so
    the noise is not what is left of its gap to Torch-Pruning. The prior states what the user asked for, so the
    ELBO is the paper's with this prior.
  - A layer that owns a batch norm masks after it: z * BN(conv(x)), as the spike-and-slab layers do
    (train/spike_slab.py), so a dropped channel is exactly zero and physically removable.
  - The temperature schedule is not given: exponential per epoch from nested.temperature to
    nested.temperature_min (NestedNet.start_epoch), 0.3 -> 0.03 by default, not from 1: the soft "slope"
    masks of a high temperature rarely truncate, so the narrowest widths train less and lose accuracy.
  - In MobileNetV2 the ordering unit sits on the depthwise convolution of each inverted residual block
    (appendix 9.1); since a depthwise channel reads exactly one expand channel, dropping it drops that
    filter of the expand convolution too (`truncates`), which the paper states and surgery needs.

FN3 (Cui et al. 2020, the paper's baseline) is the same network with a fixed nested-dropout distribution
and deterministic weights: beta is uniform over the K tail indices (mubar_j = log(K - j + 1), not trained),
masks are hard samples (the tau -> 0 limit, Property 2: z = v_b, b ~ Categorical(beta)), and there is no KL.
FN3 is rescaled at test time like BN3 by default: paper 002 (section 5, "we generate fixed width masks for
BN3 and FN3 as in [6] ... We re-scale the node output by the probability that a node is kept") states the
rescaling in the paragraph that treats both, and does not exempt FN3, though its appendix 8.2 motivates it by
the variational nested dropout. Setting a layer's `rescale` to False (NestedNet.set_rescale) evaluates
without it; benchmarks/nested_width_sweep.py reports FN3 both ways.

Test time at width k (appendix 8.2, 9.2): keep the first k groups, scale group j's output by its keep
probability P(z_j = 1) (1 for the fixed groups), draw the weights (one draw per posterior sample), and
recollect the batch-norm statistics of that plain network on a few training batches (2 x 512 by default).
`NestedNet.posterior_sample` (train/models.py) returns that network with dense shapes and the masks of the
kept channels; compress and surgery (edgebayes/compressed) then remove the other channels physically.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from edgebayes.train.accel import in_layout
from edgebayes.train.spike_slab import (
    conv2d_backward,
    conv2d_outputs_per_sample,
    linear_backward,
    linear_outputs_per_sample,
    local_reparameterization,
    scaled_batch_norm,
)

NESTED_FAMILIES = ("bn3", "fn3")

# Eq. 20: the paper's fit of -KL(q(w | theta, alpha) || log-uniform) for multiplicative Gaussian noise.
A1, A2, A3, A4 = 0.7294, -0.2041, 0.3492, 0.5387


# ---------------------------------------------------------------------------------------------
# The variational ordering unit
# ---------------------------------------------------------------------------------------------
def ordered_mask_log_probs(logits):
    """log P(z = v_j), j = 1..K, of a Bernoulli chain whose conditional keep probabilities are
    sigmoid(logits) for j = 2..K (K - 1 logits); mu_1 = 1 and mu_{K+1} = 0 (eq. 12, 33)."""
    zero = logits.new_zeros(1)
    log_keep = torch.cat([zero, F.logsigmoid(logits)])         # log mu_1 .. log mu_K
    log_stop = torch.cat([F.logsigmoid(-logits), zero])        # log (1 - mu_2) .. log (1 - mu_{K+1})
    return torch.cumsum(log_keep, 0) + log_stop


def keep_probabilities(logits):
    """P(z_j = 1) = prod_{k<=j} mu_k, j = 1..K (appendix 8.2's scaling factor)."""
    return torch.exp(torch.cumsum(torch.cat([logits.new_zeros(1), F.logsigmoid(logits)]), 0))


def gumbel_uniforms(shape, like, generator=None):
    """The U(0, 1) draws a Downhill sample turns into Gumbel noise, g = -log(-log u), kept off 0 and 1."""
    return torch.rand(shape, generator=generator, dtype=like.dtype, device=like.device).clamp(1e-10, 1 - 1e-7)


def downhill_sample(log_beta, temperature, shape=(), generator=None, hard=False, uniforms=None):
    """Samples of Downhill(beta, tau) (Property 1), shape (*shape, K): non-increasing, in [0, 1], z_1 = 1.

    hard=True is the tau -> 0 limit (Property 2): c is one-hot at argmax(log beta + g), z an ordered mask.
    `uniforms` (shape (*shape, K)): the draws behind g, given where several layers share them (nested.shared_draw).
    """
    u = gumbel_uniforms(tuple(shape) + tuple(log_beta.shape), log_beta, generator) if uniforms is None else uniforms
    scores = log_beta - torch.log(-torch.log(u))
    if hard:
        c = F.one_hot(scores.argmax(-1), log_beta.numel()).to(log_beta.dtype)
    else:
        c = torch.softmax(scores / temperature, -1)
    return (1 - (torch.cumsum(c, -1) - c)).clamp(0, 1)


def phi1(log_beta, log_prior):
    """Phi1 = sum_j beta_j log(beta_j / p(v_j)) (eq. 12, 31)."""
    return (log_beta.exp() * (log_beta - log_prior)).sum()


def phi2(group_kl, log_beta):
    """Phi2 = e^T K^1 J_L^T beta (eq. 15, zero component dropped); group_kl = e^T K^1, one entry per group."""
    k = log_beta.numel()
    lower = torch.tril(torch.ones(k, k, dtype=log_beta.dtype, device=log_beta.device))   # J_L
    return group_kl @ (lower.T @ log_beta.exp())


def weight_kl(log_alpha):
    """K^1 of every weight: -(eq. 20) with C = -a1 (module docstring), positive for every alpha."""
    bump = A1 * torch.exp(-math.exp(A4) * (A2 + A3 * log_alpha) ** 2)
    return A1 - bump + 0.5 * F.softplus(-log_alpha)   # 0.5 log(1 + 1/alpha) = 0.5 softplus(-log alpha)


def uniform_logits(k):
    """Conditional keep logits of the uniform beta_j = 1/K: mu_j = (K - j + 1) / (K - j + 2), so
    mubar_j = log(K - j + 1), j = 2..K."""
    return torch.log(torch.arange(k - 1, 0, -1, dtype=torch.float32))


def chain_logits(k, value):
    """The K - 1 conditional keep logits of a Bernoulli chain given as a config value: a number (every
    logit), or "uniform" (uniform_logits)."""
    return uniform_logits(k) if value == "uniform" else torch.full((k - 1,), float(value))


class OrderingUnit(nn.Module):
    """q(z | beta) over K ordered groups (learned, BN3) or a fixed nested-dropout distribution (FN3).

    mubar_init: a number (every mubar_j; the paper's 3), or "uniform": BN3 starts from FN3's distribution.
    prior_keep_logit: the prior chain's conditional keep logit (a number), or "uniform": FN3's distribution.
    first_width_probability: None, or beta_1 of the prior and of q at init (FN3: of its fixed distribution), the
    probability that exactly the first ordered group is kept; the chain past it is as above (NestedNet.serve_from).
    """

    def __init__(self, k, mubar_init=3.0, prior_keep_logit=3.0, learned=True, first_width_probability=None):
        super().__init__()
        self.k, self.learned = k, learned
        mubar = chain_logits(k, mubar_init) if learned else uniform_logits(k)
        prior_logits = chain_logits(k, prior_keep_logit)
        if first_width_probability is not None:   # beta_1 = 1 - mu_2 = sigmoid(-mubar_2)
            stop = math.log(first_width_probability / (1 - first_width_probability))
            mubar[0] = prior_logits[0] = -stop
        if learned:
            self.mubar = nn.Parameter(mubar)
        else:
            self.register_buffer("mubar", mubar)
        self.register_buffer("prior_logits", prior_logits, persistent=False)

    def log_beta(self):
        return ordered_mask_log_probs(self.mubar)

    def keep_probability(self):
        return keep_probabilities(self.mubar)

    def sample(self, batch, temperature, generator=None, uniforms=None):
        return downhill_sample(self.log_beta(), temperature, (batch,), generator, hard=not self.learned,
                               uniforms=uniforms)

    def kl(self):
        return phi1(self.log_beta(), ordered_mask_log_probs(self.prior_logits))


# ---------------------------------------------------------------------------------------------
# Nested layers
# ---------------------------------------------------------------------------------------------
class NestedLayer(nn.Module):
    """Shared machinery; subclasses give the affine op and the weight shape (output channels on dim 0).

    nested=False: a variational layer without ordering unit (all channels always kept).
    bayesian=False (FN3): deterministic weights, no KL.
    """

    def __init__(self, weight_shape, fan_in, *, groups, fixed_groups, nested, bayesian, learned_order,
                 log_alpha_init, mubar_init, prior_keep_logit, bias=True, norm=None, truncates=None):
        super().__init__()
        channels = weight_shape[0]
        if nested and not 0 <= fixed_groups < groups:
            raise ValueError(f"fixed groups must lie in [0, groups), got {fixed_groups} of {groups}")
        self.nested, self.bayesian = nested, bayesian
        self.prunable = nested  # read by the trainer's mean_inclusion record
        self.groups, self.fixed_groups = groups, fixed_groups
        self.theta = nn.Parameter(torch.empty(weight_shape))
        nn.init.kaiming_uniform_(self.theta, a=math.sqrt(5))   # as nn.Linear / nn.Conv2d
        if bayesian:
            self.log_alpha = nn.Parameter(torch.full(weight_shape, float(log_alpha_init)))
        if bias:
            bound = 1 / math.sqrt(fan_in)
            self.bias = nn.Parameter(torch.empty(channels).uniform_(-bound, bound))
        else:
            self.register_parameter("bias", None)
        self.norm = norm
        self.register_buffer("group", torch.arange(channels) * groups // channels, persistent=False)
        if nested:
            self.ordering = OrderingUnit(groups - fixed_groups, mubar_init, prior_keep_logit, learned_order)
        self.temperature = 1.0
        self.mask_per_batch = False             # one mask shared by the batch (module docstring)
        self.shared_uniforms = None             # the step's draws behind every layer's mask (nested.shared_draw)
        self.width = groups                     # evaluation width (groups kept)
        self.rescale = True                     # test time: kept channels scaled by P(z_j = 1) (appendix 8.2)
        self.__dict__["truncates"] = truncates  # a layer whose output channels this one's mask also drops

    # -- posterior quantities ---------------------------------------------------------------------
    def group_keep_probability(self):
        """P(z_j = 1) per group: 1 for the fixed groups (and every group of a layer without nested dropout)."""
        ones = self.theta.new_ones(self.fixed_groups if self.nested else self.groups)
        return torch.cat([ones, self.ordering.keep_probability()]) if self.nested else ones

    def inclusion_probability(self):
        """P(z = 1) per channel."""
        return self.group_keep_probability()[self.group]

    def kept_channels(self, width):
        """Channels of the first `width` groups (all of them in a layer without nested dropout)."""
        if not self.nested:
            return torch.ones(self.group.numel(), dtype=torch.bool, device=self.group.device)
        return self.group < width

    def channel_scale(self, width):
        """Appendix 8.2: P(z_j = 1) on the kept channels, exactly 0 on the others (1 on the kept channels
        with `rescale` off: benchmarks/nested_width_sweep.py reports FN3 both ways)."""
        kept = self.kept_channels(width)
        return self.inclusion_probability() * kept if self.rescale else kept.to(self.theta.dtype)

    def sample_weight(self, generator=None):
        """One draw w = theta (1 + sqrt(alpha) eps) (eq. 17); theta itself for deterministic weights."""
        if not self.bayesian:
            return self.theta
        eps = torch.randn(self.theta.shape, generator=generator, dtype=self.theta.dtype, device=self.theta.device)
        return self.theta * (1 + torch.exp(0.5 * self.log_alpha) * eps)

    # -- KL -----------------------------------------------------------------------------------
    def kl(self):
        if not self.bayesian:
            return self.theta.new_zeros(())
        per_channel = weight_kl(self.log_alpha).flatten(1).sum(1)
        if not self.nested:
            return per_channel.sum()
        per_group = per_channel.new_zeros(self.groups).index_add(0, self.group, per_channel)
        f = self.fixed_groups
        return per_group[:f].sum() + phi2(per_group[f:], self.ordering.log_beta()) + self.ordering.kl()

    # -- forward -------------------------------------------------------------------------------
    def _affine(self, x, weight, bias):
        raise NotImplementedError

    def _channel_view(self, v, ndim):
        """(batch, C) or (C,) -> broadcastable over an output of `ndim` dimensions (channels on dim 1)."""
        return v.view(tuple(v.shape) + (1,) * (ndim - 2)) if v.dim() == 2 else v.view((1, -1) + (1,) * (ndim - 2))

    def forward(self, x):
        if self.training:
            mask = None
            if self.nested:   # (draws, C): one row per example, or one for the batch (mask_per_batch)
                draws = 1 if self.mask_per_batch else x.shape[0]
                z = self.ordering.sample(draws, self.temperature, uniforms=self.shared_uniforms)
                mask = torch.cat([z.new_ones(draws, self.fixed_groups), z], 1)[:, self.group]
            if self.bayesian:  # local reparameterization, eq. 21-22, fused in blocks of the batch (spike_slab)
                weight_var = in_layout(torch.exp(self.log_alpha) * self.theta ** 2, self.theta)
                if self.norm is None and mask is not None:   # the mask too, block by block
                    per_example = self._channel_view(mask, x.dim()).expand((len(x),) + (-1,) * (x.dim() - 1))
                    return local_reparameterization(self, x, self.theta, self.bias, weight_var, None, None,
                                                    per_example)
                out = local_reparameterization(self, x, self.theta, self.bias, weight_var, None)
            else:
                out = self._affine(x, self.theta, self.bias)
            if self.norm is not None and mask is not None and len(mask) == 1:   # the batch's one mask: folded
                return scaled_batch_norm(self.norm, out, mask[0])                # into the norm's affine map
            if self.norm is not None:
                out = self.norm(out)
            return out if mask is None else out * self._channel_view(mask, out.dim())
        # Evaluation: one weight draw per call at the set width, rescaled (appendix 8.2).
        scale = self.channel_scale(self.width)
        if self.norm is None:
            w = self.sample_weight() * scale.view((-1,) + (1,) * (self.theta.dim() - 1))
            return self._affine(x, w, None if self.bias is None else self.bias * scale)
        out = self.norm(self._affine(x, self.sample_weight(), self.bias))
        return out * self._channel_view(scale, out.dim())


class NestedLinear(NestedLayer):
    def __init__(self, in_features, out_features, **kw):
        super().__init__((out_features, in_features), in_features, **kw)
        self.in_features, self.out_features = in_features, out_features

    def _affine(self, x, weight, bias):
        return F.linear(x, weight, bias)

    def _outputs_per_sample(self, x):
        return linear_outputs_per_sample(x, self.in_features, self.out_features)

    def _affine_backward(self, x, weight, grad, needs):
        return linear_backward(x, weight, grad, needs)

    def _channel_view(self, v, ndim):
        """(batch, C) or (C,) -> broadcastable over an output whose last dimension holds the channels: (B, F),
        or (B, T, F) in a transformer."""
        if v.dim() == 2:
            return v.view((v.shape[0],) + (1,) * (ndim - 2) + (v.shape[1],))
        return v.view((1,) * (ndim - 1) + (-1,))

    def extra_repr(self):
        return f"{self.in_features}, {self.out_features}, nested={self.nested}, bayesian={self.bayesian}"


class NestedConv2d(NestedLayer):
    """`conv_groups` is the convolution's own groups argument (depthwise: = channels); `groups` is D."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, conv_groups=1, dilation=1, **kw):
        k = (kernel_size, kernel_size) if isinstance(kernel_size, int) else tuple(kernel_size)
        super().__init__((out_channels, in_channels // conv_groups) + k, in_channels // conv_groups * k[0] * k[1],
                         **kw)
        self.in_channels, self.out_channels, self.kernel_size = in_channels, out_channels, k
        self.stride, self.padding, self.conv_groups, self.dilation = stride, padding, conv_groups, dilation

    def _affine(self, x, weight, bias):
        return F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, self.conv_groups)

    def _outputs_per_sample(self, x):
        return conv2d_outputs_per_sample(x, self.out_channels, self.kernel_size, self.stride, self.padding,
                                         self.dilation)

    def _affine_backward(self, x, weight, grad, needs):
        return conv2d_backward(x, weight, grad, needs, self.stride, self.padding, self.conv_groups, self.dilation)

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"dilation={self.dilation}, groups={self.conv_groups}, nested={self.nested}, bayesian={self.bayesian}")


# ---------------------------------------------------------------------------------------------
# Batch-norm statistics at a width (appendix 9.2)
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def recollect_batch_norm(module, x, batch_size=512):
    """Re-estimate every batch norm's running mean and variance of `module` on the inputs x.

    Cumulative averages (momentum None) over the batches, each batch norm in training mode and the rest
    in evaluation mode; the module is left in evaluation mode. A no-op without batch norms.
    """
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return module.eval()
    module.eval()
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
        m.train()
    for i in range(0, len(x), batch_size):
        module(x[i: i + batch_size])
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum
    return module.eval()
