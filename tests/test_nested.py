"""Bayesian nested nets (paper 002, train/nested.py): the ordering unit, the KL, truncation, the pipeline."""

import itertools
import json
import math

import pytest
import torch
import yaml
from scipy.stats import chisquare

from conftest import ROOT
from edgebayes.cli import main
from edgebayes.config import NestedConfig
from edgebayes.compressed.surgery import remove_dead_units
from edgebayes.train.models import NestedNet
from edgebayes.train.nested import (
    NestedLayer,
    NestedLinear,
    downhill_sample,
    keep_probabilities,
    ordered_mask_log_probs,
    phi1,
    phi2,
    recollect_batch_norm,
    weight_kl,
)


def _chain_probability(z, keep):
    """p(z) of the Bernoulli chain of eq. 1 by its definition, step by step (keep[i] = pi_{i+1}, pi_1 = 1)."""
    p, previous = 1.0, 1
    for zi, pi in zip(z, [1.0] + list(keep)):
        if previous == 0:
            p *= 1.0 if zi == 0 else 0.0
        else:
            p *= pi if zi == 1 else 1 - pi
        previous = zi
    return p


def _ordered_masks(k):
    return [tuple([1] * j + [0] * (k - j)) for j in range(1, k + 1)]


# ---------------------------------------------------------------------------------------------
# The ordering unit
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tau", [0.05, 0.5, 1.0, 5.0])
def test_downhill_samples_are_non_increasing_masks_in_the_unit_interval(tau):
    log_beta = ordered_mask_log_probs(torch.randn(7, generator=torch.Generator().manual_seed(0)))
    z = downhill_sample(log_beta, tau, (5000,), torch.Generator().manual_seed(1))
    assert z.shape == (5000, 8)
    assert torch.all((z >= 0) & (z <= 1))
    assert torch.all(z[:, 0] == 1)                        # z_1 = 1: the exclusive cumulative sum
    assert torch.all(z[:, 1:] <= z[:, :-1] + 1e-6)       # non-increasing
    assert z[:, -1].min() < 0.99                          # not trivially all ones


@pytest.mark.parametrize("hard", [False, True])
def test_downhill_at_vanishing_temperature_samples_ordered_masks_with_frequencies_beta(hard):
    """Property 2: as tau -> 0 the samples fall in the set V of ordered masks, v_j with probability beta_j."""
    k, n = 6, 20000
    mubar = torch.tensor([2.0, 0.5, -0.3, 1.0, -1.0], dtype=torch.float64)
    log_beta = ordered_mask_log_probs(mubar)
    z = downhill_sample(log_beta, 1e-5, (n,), torch.Generator().manual_seed(2), hard=hard)
    masks = torch.tensor(_ordered_masks(k), dtype=z.dtype)
    distance, index = (z[:, None, :] - masks[None]).abs().amax(-1).min(1)
    assert float((distance < 1e-3).float().mean()) > 0.999
    counts = torch.bincount(index, minlength=k).numpy()
    expected = log_beta.exp().numpy() * n
    assert chisquare(counts, expected * counts.sum() / expected.sum()).pvalue > 1e-3
    # And a wrong beta is rejected by the same test: it has power.
    wrong = torch.roll(log_beta, 1).exp().numpy() * n
    assert chisquare(counts, wrong * counts.sum() / wrong.sum()).pvalue < 1e-6


def test_ordered_mask_probabilities_are_the_chain_and_keep_probabilities_their_tails():
    k = 5
    mubar = torch.tensor([1.5, -0.4, 0.3, 2.2], dtype=torch.float64)
    log_beta = ordered_mask_log_probs(mubar)
    mu = torch.sigmoid(mubar).tolist()
    for j, v in enumerate(_ordered_masks(k)):
        assert math.exp(log_beta[j]) == pytest.approx(_chain_probability(v, mu), rel=1e-12)
    assert float(log_beta.exp().sum()) == pytest.approx(1.0, rel=1e-12)
    tails = torch.flip(torch.cumsum(torch.flip(log_beta.exp(), [0]), 0), [0])   # sum_{v >= j} beta_v
    torch.testing.assert_close(keep_probabilities(mubar), tails)


def test_phi1_matches_brute_force_enumeration_over_all_masks():
    """Phi1 = E_q[log q(z) / p(z)] summed over all 2^K binary masks, q and p the two chains."""
    k = 6
    g = torch.Generator().manual_seed(3)
    mubar = torch.randn(k - 1, generator=g, dtype=torch.float64) * 2
    prior = torch.randn(k - 1, generator=g, dtype=torch.float64)
    mu, pi = torch.sigmoid(mubar).tolist(), torch.sigmoid(prior).tolist()
    brute, support = 0.0, []
    for z in itertools.product((0, 1), repeat=k):
        q = _chain_probability(z, mu)
        if q > 0:
            support.append(z)
            brute += q * math.log(q / _chain_probability(z, pi))
    assert sorted(support) == sorted(_ordered_masks(k))   # only the D ordered masks carry mass
    assert float(phi1(ordered_mask_log_probs(mubar), ordered_mask_log_probs(prior))) == pytest.approx(brute, rel=1e-10)


def test_phi2_matches_brute_force_enumeration_over_all_masks():
    """Phi2 = sum_z q(z) sum_j z_j sum_i K_ij (eq. 13-14 with the spike's K^0 = 0) against eq. 15."""
    k = 6
    g = torch.Generator().manual_seed(4)
    mubar = torch.randn(k - 1, generator=g, dtype=torch.float64)
    group_kl = torch.rand(k, generator=g, dtype=torch.float64) * 10
    mu = torch.sigmoid(mubar).tolist()
    brute = sum(_chain_probability(z, mu) * sum(zj * s for zj, s in zip(z, group_kl.tolist()))
                for z in itertools.product((0, 1), repeat=k))
    assert float(phi2(group_kl, ordered_mask_log_probs(mubar))) == pytest.approx(brute, rel=1e-10)


def test_layer_kl_is_phi1_plus_phi2_plus_the_fixed_groups_by_enumeration():
    torch.manual_seed(5)
    layer = NestedLinear(6, 12, groups=4, fixed_groups=1, nested=True, bayesian=True, learned_order=True,
                         log_alpha_init=-1.0, mubar_init=3.0, prior_keep_logit=1.0)
    with torch.no_grad():
        layer.log_alpha.uniform_(-4, 1)
        layer.ordering.mubar.copy_(torch.tensor([0.5, -1.0]))
    per_group = weight_kl(layer.log_alpha).detach().sum(1).view(4, 3).sum(1).double()   # 3 units per group
    mu = torch.sigmoid(layer.ordering.mubar.double()).tolist()
    pi = [torch.sigmoid(torch.tensor(1.0)).item()] * 2
    brute = float(per_group[0])
    for z in itertools.product((0, 1), repeat=3):
        q = _chain_probability(z, mu)
        if q > 0:
            brute += q * (sum(zj * float(s) for zj, s in zip(z, per_group[1:])) + math.log(q / _chain_probability(z, pi)))
    assert float(layer.kl().detach()) == pytest.approx(brute, rel=1e-5)


def test_weight_kl_is_positive_and_close_to_molchanov_on_the_fitted_range():
    """C = -a1 (module docstring): K^1 > 0 everywhere, within 0.1 nats of Molchanov et al. (2017) on [-5, 0.5]."""
    wide = torch.linspace(-20, 20, 2001)
    assert torch.all(weight_kl(wide) > 0)
    log_alpha = torch.linspace(-5, 0.5, 200)
    k1, k2, k3 = 0.63576, 1.87320, 1.48695
    molchanov = -(k1 * torch.sigmoid(k2 + k3 * log_alpha) - 0.5 * torch.log1p(torch.exp(-log_alpha)) - k1)
    assert float((weight_kl(log_alpha) - molchanov).abs().max()) < 0.1


def test_fn3_has_a_fixed_uniform_order_deterministic_weights_and_no_kl():
    net = NestedNet("mlp", "fn3", NestedConfig(groups=5, fixed_groups=1), (1, 4, 4), 3, hidden=[10, 10])
    layer = [m for _, m in net.nested_layers() if m.nested][0]
    torch.testing.assert_close(layer.ordering.log_beta().exp(), torch.full((4,), 0.25))
    assert not any("mubar" in n or "log_alpha" in n for n, _ in net.named_parameters())
    assert float(net.kl()) == 0.0
    z = layer.ordering.sample(1000, temperature=1.0)   # hard nested dropout whatever the temperature
    assert set(z.unique().tolist()) <= {0.0, 1.0}


def test_bn3_can_start_from_fn3s_uniform_order_and_learn_it(tmp_path):
    net = NestedNet("mlp", "bn3", NestedConfig(groups=5, fixed_groups=1, mubar_init="uniform"), (1, 4, 4), 3,
                    hidden=[10, 10])
    layer = [m for _, m in net.nested_layers() if m.nested][0]
    torch.testing.assert_close(layer.ordering.log_beta().exp(), torch.full((4,), 0.25))
    assert layer.ordering.mubar.requires_grad
    default = NestedNet("mlp", "bn3", NestedConfig(groups=5, fixed_groups=1), (1, 4, 4), 3, hidden=[10, 10])
    assert torch.all([m for _, m in default.nested_layers() if m.nested][0].ordering.mubar == 3.0)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"name": "x", "model": {"family": "bn3"}, "nested": {"mubar_init": "flat"}}))
    assert main(["train", "--config", str(bad), "--runs-dir", str(tmp_path)]) == 2


def test_uniform_prior_is_fn3s_distribution_so_phi1_vanishes_at_the_uniform_start(tmp_path):
    def ordering(**kw):
        net = NestedNet("mlp", "bn3", NestedConfig(groups=5, fixed_groups=1, mubar_init="uniform", **kw), (1, 4, 4),
                        3, hidden=[10])
        return [m for _, m in net.nested_layers() if m.nested][0].ordering

    assert float(ordering(prior_keep_logit="uniform").kl().detach()) == pytest.approx(0.0, abs=1e-6)
    assert float(ordering(prior_keep_logit=3.0).kl().detach()) > 0.1   # the default prior favours the full width
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"name": "x", "model": {"family": "bn3"}, "nested": {"prior_keep_logit": "flat"}}))
    assert main(["train", "--config", str(bad), "--runs-dir", str(tmp_path)]) == 2


def test_temperature_is_annealed_per_epoch_from_start_to_min():
    net = NestedNet("mlp", "bn3", NestedConfig(groups=4, fixed_groups=0, temperature=2.0, temperature_min=0.2),
                    (1, 4, 4), 3, hidden=[8])
    taus = []
    for epoch in range(5):
        net.start_epoch(epoch, 5)
        layer_taus = {m.temperature for _, m in net.nested_layers()}
        assert len(layer_taus) == 1   # every layer at the same temperature
        taus.append(layer_taus.pop())
    assert taus[0] == 2.0 and taus[-1] == pytest.approx(0.2)
    assert all(a > b for a, b in zip(taus, taus[1:]))


def test_operating_points_are_whole_widths():
    net = NestedNet("mlp", "bn3", NestedConfig(groups=8, fixed_groups=2), (1, 4, 4), 3, hidden=[16])
    assert net.operating_points() == [3, 4, 5, 6, 7, 8]
    assert net.operating_points([2.0, 8]) == [2, 8]
    with pytest.raises(ValueError, match=r"widths must be whole numbers of groups in 1..8"):
        net.operating_points([0.5])
    with pytest.raises(ValueError, match=r"1..8"):
        net.operating_points([9])


# ---------------------------------------------------------------------------------------------
# Truncation: the physically smaller network is the masked one
# ---------------------------------------------------------------------------------------------
ARCHS = {
    "mlp": ((1, 8, 8), dict(groups=8, fixed_groups=1), dict(hidden=[32, 24])),
    "lenet5-caffe": ((1, 28, 28), dict(groups=10, fixed_groups=1), {}),
    "resnet20": ((3, 16, 16), dict(groups=8, fixed_groups=1), {}),
    "vgg11": ((3, 32, 32), dict(groups=32, fixed_groups=2), dict(width_multiplier=0.25)),
    "mobilenetv2": ((3, 32, 32), dict(groups=16, fixed_groups=1), dict(width_multiplier=0.25)),
}


def _trained_looking(arch, family="bn3", calibration=True):
    """A nested net with a non-trivial learned order and batch-norm statistics (no training needed)."""
    shape, nested, kw = ARCHS[arch]
    torch.manual_seed(6)
    x = torch.rand((96,) + shape)
    net = NestedNet(arch, family, NestedConfig(**nested), shape, 10, calibration_x=x if calibration else None,
                    bn_batch_size=48, **kw)
    with torch.no_grad():
        for _, layer in net.nested_layers():
            if layer.nested and layer.ordering.learned:
                layer.ordering.mubar.uniform_(-1, 3)
            if layer.norm is not None:
                layer.norm.running_mean.uniform_(-0.3, 0.3)
                layer.norm.running_var.uniform_(0.5, 2.0)
                layer.norm.weight.uniform_(0.5, 1.5)
                layer.norm.bias.uniform_(-0.2, 0.2)
    return net.eval(), shape


@pytest.mark.parametrize("arch", list(ARCHS))
def test_truncated_network_equals_the_masked_network(arch):
    net, shape = _trained_looking(arch)
    width = net.operating_points()[1]
    dense, kept = net.posterior_sample(width, torch.Generator().manual_seed(7))
    pruned = remove_dead_units(dense, kept, torch.zeros((1,) + shape))
    x = torch.randn((16,) + shape, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        torch.testing.assert_close(pruned(x), dense(x), rtol=0, atol=1e-5)
    # Physical: every nested layer's plain twin keeps exactly the channels of the first `width` groups.
    plain = dict(pruned.named_modules())
    for name, layer in net.nested_layers():
        if layer.nested:
            expected = int((layer.group < width).sum())
            assert expected < layer.group.numel()
            assert plain[net._plain_name(name, layer)].weight.shape[0] == expected, name
    assert sum(p.numel() for p in pruned.parameters()) < sum(p.numel() for p in dense.parameters())


@pytest.mark.parametrize("arch", ["mlp", "lenet5-caffe", "resnet20"])
def test_plain_sample_is_the_models_own_masked_and_rescaled_network(arch):
    """FN3 (deterministic weights), no recollection: the plain sample computes the model's eval forward."""
    net, shape = _trained_looking(arch, family="fn3", calibration=False)
    width = net.operating_points()[2]
    net.set_width(width)
    dense, _ = net.posterior_sample(width)
    x = torch.randn((8,) + shape, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(dense(x), net(x), rtol=0, atol=1e-5)
        net.set_width(net.groups)
        assert (dense(x) - net(x)).abs().max() > 1e-3   # the width matters


def test_fn3_without_rescaling_keeps_channels_unscaled_in_the_eval_forward_and_the_plain_sample():
    """Issue 20: FN3 trains with hard masks; NestedNet.set_rescale(False) evaluates it without appendix 8.2's
    scaling by P(z_j = 1) (the width sweep's "FN3 unscaled"): kept channels scale 1, dropped ones 0, and the
    plain sample is still the model's own eval forward."""
    net, shape = _trained_looking("mlp", family="fn3", calibration=False)
    width = net.operating_points()[2]
    layer = next(m for _, m in net.nested_layers() if m.nested)
    scaled = layer.channel_scale(width)
    assert scaled[layer.kept_channels(width)].min() < 1          # rescaled by default (the paper's reading)
    net.set_rescale(False)
    assert torch.equal(layer.channel_scale(width), layer.kept_channels(width).float())
    net.set_width(width)
    dense, _ = net.posterior_sample(width)
    x = torch.randn((8,) + shape, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(dense(x), net(x), rtol=0, atol=1e-5)
        unscaled = net(x)
        net.set_rescale(True)
        assert (net(x) - unscaled).abs().max() > 1e-3


def test_batch_norm_statistics_are_recollected_at_the_width():
    net, shape = _trained_looking("resnet20")
    dense, _ = net.posterior_sample(3, torch.Generator().manual_seed(10))
    stem = dense.stem
    with torch.no_grad():
        out = stem.conv(net.calibration_x)
    kept = (net.net.stem.group < 3)
    torch.testing.assert_close(stem.norm.running_mean[kept], out.mean((0, 2, 3))[kept], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stem.norm.running_var[kept], out.var((0, 2, 3))[kept], rtol=1e-3, atol=1e-5)
    assert torch.all(stem.norm.weight[~kept] == 0) and torch.all(stem.norm.bias[~kept] == 0)


def test_recollect_batch_norm_leaves_momentum_and_eval_mode():
    module = torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.BatchNorm2d(3, momentum=0.3))
    recollect_batch_norm(module, torch.rand(10, 1, 6, 6), batch_size=4)
    assert not module.training and module[1].momentum == 0.3
    assert int(module[1].num_batches_tracked) == 3


def test_train_forward_masks_whole_groups_with_ordered_masks():
    torch.manual_seed(11)
    layer = NestedLinear(5, 12, groups=4, fixed_groups=1, nested=True, bayesian=False, learned_order=False,
                         log_alpha_init=-1.0, mubar_init=3.0, prior_keep_logit=3.0, bias=False)
    with torch.no_grad():
        layer.theta.fill_(1.0)
    out = layer.train()(torch.ones(500, 5))
    groups = (out / 5).view(500, 4, 3)
    assert torch.all(groups == groups[:, :, :1])           # one mask value per group
    mask = groups[:, :, 0]
    assert torch.all(mask[:, 0] == 1)                       # the fixed group is always kept
    assert torch.all(mask[:, 1:] <= mask[:, :-1])           # ordered
    assert set(mask.sum(1).tolist()) == {2.0, 3.0, 4.0}     # every width 2..4 is trained


@pytest.mark.parametrize("blocks", ["one", "several"])
@pytest.mark.parametrize("kind", ["linear", "linear tokens", "conv", "depthwise+bn", "conv+bn channels_last",
                                  "conv+bn one mask per batch", "depthwise+bn one mask per batch",
                                  "conv one mask per batch", "conv channels_last"])
def test_bayesian_training_forward_equals_the_plain_local_reparameterization(kind, blocks, monkeypatch):
    """BN3's weight noise goes through spike_slab's fused local reparameterization (blocks of the batch, a
    written-out backward), a per-example mask without a batch norm goes into the same blocks, and a batch's one
    mask is folded into its batch norm's affine map: the output, every gradient (theta, log alpha, the ordering
    unit's mubar, the bias, the norm's, x) and the batch norm's running statistics are those of
    eq. 21-22 and the mask written plainly, with the same noise."""
    from torch import nn
    from edgebayes.train import spike_slab
    from edgebayes.train.nested import NestedConv2d
    from edgebayes.train.spike_slab import batch_blocks, standard_normal_like

    torch.manual_seed(0)
    kw = dict(groups=4, fixed_groups=1, nested=True, bayesian=True, learned_order=True, log_alpha_init=-1.0,
              mubar_init=3.0, prior_keep_logit=3.0)
    if kind.startswith("linear"):
        layer = NestedLinear(6, 8, **kw)
        x = torch.randn(5, 4, 6) if kind == "linear tokens" else torch.randn(5, 6)
    else:
        channels, conv_groups = (8, 8) if kind.startswith("depthwise") else (3, 1)
        layer = NestedConv2d(channels, 8, 3, stride=2 if conv_groups > 1 else 1, padding=1, conv_groups=conv_groups,
                             bias=kind == "conv", norm=nn.BatchNorm2d(8) if "+bn" in kind else None, **kw)
        x = torch.randn(5, channels, 7, 7)
        if kind.endswith("channels_last"):
            layer, x = layer.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    layer.mask_per_batch = kind.endswith("one mask per batch")
    draws = 1 if layer.mask_per_batch else len(x)
    with torch.no_grad():
        layer.log_alpha.uniform_(-4, 0)
        if layer.norm is not None:
            layer.norm.weight.uniform_(0.5, 1.5)
            layer.norm.bias.uniform_(-0.5, 0.5)
    per_sample = layer._affine(x[:1], layer.theta, None)[0].numel()
    if blocks == "several":
        monkeypatch.setattr(spike_slab, "BLOCK_ELEMENTS", 2 * per_sample + 1)
        assert len(batch_blocks(len(x), per_sample, x.device)) == 3
    layer.train()
    x.requires_grad_(True)
    params = ([x, layer.theta, layer.log_alpha, layer.ordering.mubar]
              + ([layer.bias] if layer.bias is not None else []) + (list(layer.norm.parameters()) if layer.norm is not None else []))
    initial = {k: v.clone() for k, v in layer.state_dict().items() if "running" in k or "batches" in k}
    results, stats = [], []
    for compute in ("fused", "plain"):
        layer.load_state_dict(initial, strict=False)
        torch.manual_seed(11)
        uniforms = torch.rand(draws, 3)   # the ordering unit's draws, shared by both computations
        layer.shared_uniforms = uniforms
        if compute == "fused":
            out = layer(x)
        else:
            mean = layer._affine(x, layer.theta, layer.bias)
            var = layer._affine(x * x, torch.exp(layer.log_alpha) * layer.theta ** 2, None)
            eps = torch.cat([standard_normal_like(mean[a:b]) for a, b in batch_blocks(len(x), per_sample, x.device)])
            out = mean + torch.sqrt(var + 1e-16) * eps
            out = out if layer.norm is None else layer.norm(out)
            z = layer.ordering.sample(draws, layer.temperature, uniforms=uniforms).expand(len(x), -1)
            z = torch.cat([z.new_ones(len(x), layer.fixed_groups), z], 1)
            out = out * layer._channel_view(z[:, layer.group], out.dim())
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
        results.append((out.detach(), torch.autograd.grad((out * weights).sum(), params)))
        stats.append({k: v.clone() for k, v in layer.state_dict().items() if k in initial})
    (out, grads), (ref_out, ref_grads) = results
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    assert all(g.abs().sum() > 0 for g in grads)
    for k in initial:
        torch.testing.assert_close(stats[0][k], stats[1][k])


@pytest.mark.parametrize("arch", ["mlp", "resnet20"])
def test_a_network_with_batch_norms_draws_one_mask_per_batch_one_without_them_one_per_example(arch):
    """Per-example masks would mix sub-networks in a training batch norm's statistics (train/nested.py)."""
    shape, nested, kw = ARCHS[arch]
    net = NestedNet(arch, "fn3", NestedConfig(**nested), shape, 10, **kw).train()
    first = net.nested_layers()[0][1]
    seen = []
    first.register_forward_hook(lambda module, inputs, out: seen.append(out.detach()))
    torch.manual_seed(3)
    net(torch.rand((64,) + shape))
    zeroed = (seen[0].flatten(2).abs().sum(2) if seen[0].dim() > 2 else seen[0].abs()) == 0   # (batch, C)
    has_norms = arch == "resnet20"
    assert first.mask_per_batch == has_norms
    assert torch.all(zeroed == zeroed[:1]) == has_norms     # the same channels dropped in every example


def test_validation_of_a_nested_net_with_batch_norms_is_the_compressed_networks():
    """Training's running statistics blend the sub-networks drawn: the epoch's validation figure is the one
    compress gives at the default width (statistics recollected), not the training forward's."""
    import edgebayes as eb
    from edgebayes.train.trainer import evaluate

    shape, nested, kw = ARCHS["resnet20"]
    torch.manual_seed(0)
    x, y = torch.rand((64,) + shape), torch.randint(0, 3, (64,))
    net = NestedNet("resnet20", "bn3", NestedConfig(**nested), shape, 3, calibration_x=x, bn_batch_size=32, **kw)
    assert net.validate_compressed
    history = eb.fit(net, x, y, val=(x[:32], y[:32]), epochs=1, seed=4, batch_size=32, log=lambda *a: None)
    val, _, _ = evaluate(net, x[:32], y[:32], net.default_knob, 2, 4)
    assert history[-1]["val_nll"] == pytest.approx(val["nll"], rel=1e-6)
    assert not NestedNet("mlp", "bn3", NestedConfig(groups=4, fixed_groups=1), (1, 4, 4), 3, hidden=[8],
                         calibration_x=x[:, :1, :4, :4]).validate_compressed   # no batch norm: nothing to blend


def test_layer_factory_builds_nested_layers_for_every_architecture():
    for arch, (shape, nested, kw) in ARCHS.items():
        net = NestedNet(arch, "bn3", NestedConfig(**nested), shape, 10, **kw)
        layers = [m for m in net.modules() if isinstance(m, NestedLayer)]
        plain = [m for m in net.net.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
        assert layers and not plain, arch          # one switch: no plain affine layer is left
        assert float(layers[0].log_alpha.detach().mean()) == -8.0 and float(layers[1].log_alpha.detach().mean()) == -1.0
        assert not layers[-1].nested               # the output layer is never nested


# ---------------------------------------------------------------------------------------------
# The pipeline
# ---------------------------------------------------------------------------------------------
def _flops_device(path, latency_ms):
    """A local device whose latency is predicted from FLOPs (deterministic, so the test does not time)."""
    profile = yaml.safe_load((ROOT / "devices/local.yaml").read_text())
    profile.update(name=path.stem, description=f"test device, {latency_ms} ms budget")
    profile["budgets"].update(latency_ms=latency_ms, model_mb=None)
    profile["latency_model"] = {"kind": "flops", "flops_per_second": 1.0e7, "overhead_ms": 0.0,
                                "source": "declared, not measured: a test device"}
    path.write_text(yaml.safe_dump(profile))
    return path


@pytest.fixture(scope="module")
def nested_run(tmp_path_factory):
    """The nested digits config (fewer epochs), the whole pipeline on a roomy FLOPs-model device."""
    tmp = tmp_path_factory.mktemp("nested")
    cfg = yaml.safe_load((ROOT / "configs/digits-mlp-bn3.yaml").read_text())
    cfg["train"]["epochs"] = 40
    config = tmp / "digits-mlp-bn3.yaml"
    config.write_text(yaml.safe_dump(cfg))
    roomy = _flops_device(tmp / "roomy.yaml", 100.0)
    assert main(["pipeline", "--config", str(config), "--device", str(roomy), "--runs-dir", str(tmp / "runs")]) == 0
    return tmp, config


def test_nested_pipeline_end_to_end(nested_run):
    tmp, _ = nested_run
    run = tmp / "runs/digits-mlp-bn3"
    metrics = json.loads((run / "train/metrics.json").read_text())
    assert metrics["family"] == "bn3" and metrics["test"]["knob"] == "width" and metrics["test"]["knob_value"] == 8
    assert metrics["test"]["mc_samples"] == 6 and metrics["test"]["accuracy"] > 0.9
    export = json.loads((run / "export/roomy/export.json").read_text())
    report = json.loads((run / "report/roomy/report.json").read_text())
    assert export["knob"] == "width" and report["summary"]["knob"] == "width"
    width = export["knob_value"]
    # Truncation is physical: the exported hidden layers have width x 8 units, the output layer all 10.
    assert list(export["kept_units"].values()) == [8 * width, 8 * width, 10]
    assert export["params_match"] and report["results"]["max_abs_prob_diff"] < 1e-4
    assert "width" in (run / "report/roomy/report.html").read_text()


def test_two_devices_with_different_latency_budgets_pick_different_widths(nested_run, capsys):
    tmp, config = nested_run
    tight = _flops_device(tmp / "tight.yaml", 0.2)
    capsys.readouterr()
    assert main(["select", "--config", str(config), "--device", str(tight), "--runs-dir", str(tmp / "runs")]) == 0
    out = capsys.readouterr().out
    chosen = {d: json.loads((tmp / f"runs/digits-mlp-bn3/select/{d}/choice.json").read_text())
              for d in ("roomy", "tight")}
    assert "select: width" in out
    assert chosen["tight"]["knob"] == "width" and chosen["tight"]["candidate"]["fits"]
    assert chosen["tight"]["knob_value"] < chosen["roomy"]["knob_value"]
    assert chosen["tight"]["candidate"]["cost"]["latency_ms"] <= 0.2
    # The roomy device's choice would break the tight budget: the budget is why the widths differ.
    roomy_id = chosen["roomy"]["candidate"]["id"]
    candidates = json.loads((tmp / "runs/digits-mlp-bn3/select/tight/candidates.json").read_text())["candidates"]
    assert any("latency" in v for c in candidates if c["id"] == roomy_id for v in c["violations"])


def test_a_shared_draw_cuts_every_layer_at_one_width_and_keeps_each_layers_law():
    """nested.shared_draw (train/nested.py): in one training step every nested layer's mask comes from the same
    uniforms, so layers with the same ordering keep the same width (the deployed sub-networks); each layer's
    own masks are still Downhill(beta, tau) draws, checked against its probabilities P(z_j = 1). With
    shared_draw false the layers draw apart, as the paper's mean field does."""
    def widths(shared, steps=400):
        torch.manual_seed(0)
        net = NestedNet("mlp", "fn3", NestedConfig(groups=5, fixed_groups=1, shared_draw=shared), (1, 4, 4), 3,
                        hidden=[10, 10, 10]).train()
        layers = [layer for _, layer in net.nested_layers() if layer.nested]
        seen = []
        for layer in layers:   # the mask each layer multiplies its output by, per example
            layer.register_forward_hook(lambda mod, inp, out, seen=seen: seen.append((out != 0).sum(1)))
        rows = []
        for _ in range(steps):
            seen.clear()
            net(torch.rand(8, 1, 4, 4) + 1)   # positive inputs: a kept unit's output is never exactly 0 here
            rows.append(torch.stack(seen[:len(layers)], 1))
        assert all(layer.shared_uniforms is None for layer in layers)   # not kept beyond the step
        return torch.cat(rows), layers

    kept, layers = widths(True)
    assert (kept == kept[:, :1]).all()   # fn3's equal orderings: one width per example in every layer
    expected = layers[0].inclusion_probability().detach()   # P(unit kept) under Downhill(beta)
    share = torch.stack([(kept[:, 0] > j).float().mean() for j in range(10)])
    assert torch.allclose(share, expected, atol=0.04), (share, expected)
    apart, _ = widths(False)
    assert (apart != apart[:, :1]).any(1).float().mean() > 0.5


def test_compress_refuses_a_width_the_training_never_served():
    """Fit to a FLOPs target, a nested net trains from the target's width up; eb.compress(net, knob=8) shipped a
    narrower width without a word (accuracy 0.64 against 0.99 in the probe; knob=1.0, read as 'full', was width 1)."""
    import edgebayes as eb
    from torch import nn

    net = eb.bayesianize(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3)), "bn3", input_shape=(8,),
                         n_train=50)
    net.serve_from(net.groups // 2)
    with pytest.raises(ValueError, match=rf"compress: knob: width 1 was never trained .* give a width in "
                                         rf"{net.groups // 2}\.\.{net.groups}"):
        eb.compress(net, knob=1.0)
    assert len(eb.compress(net, knob=net.groups // 2).samples) == 1
