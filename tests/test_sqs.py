"""SQS (paper 001, issue 5): initialisation, inference rule, compressed form, and the pipeline on digits."""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
import yaml
from sklearn.cluster import KMeans

from conftest import write_profile
from edgebayes.cli import main
from edgebayes.config import ConfigError, PipelineConfig, SQSConfig, load_pipeline_config
from edgebayes.errors import InputError
from edgebayes.compressed import codebook
from edgebayes.compressed.samples import compress
from edgebayes.train.models import build_model
from edgebayes.train.sqs import (
    WINDOWS,
    SpikeGMMWeight,
    _first_argmax,
    SQSNet,
    assign_windows,
    kmeans_gmm,
    load_compressed,
    pretrained_base,
    pruning_schedule,
)
from edgebayes.train.kl import kl_bernoulli, kl_gaussian_gaussian

ROOT = Path(__file__).resolve().parents[1]


def dnn(input_shape, hidden, classes):
    cfg = PipelineConfig()
    cfg.model.family, cfg.model.hidden = "dnn", hidden
    return build_model(cfg.model, cfg.prior, input_shape, classes, n_train=100)


def small_net(components=4, windowing="outlier", seed=0, **kw):
    torch.manual_seed(seed)
    base = dnn((20,), [16, 12], 3)
    with torch.no_grad():  # a heavy-tailed layer so that the outlier windows are not empty
        base.net.hidden1.weight[0, :3] = torch.tensor([2.0, -3.0, 2.5])
    net = SQSNet(base, components=components, windowing=windowing, **kw).initialise(keep_init=0.9, seed=seed)
    with torch.no_grad():  # distinct keep scores, as after training
        for p in net.posteriors.values():
            p.score.copy_(torch.randn(p.score.shape))
    return net


def test_kmeans_init_gives_each_component_its_clusters_mean_spread_and_share():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.normal(-1, 0.1, 300), rng.normal(0, 0.2, 500), rng.normal(1.5, 0.05, 200)])
    mu, sigma, pi, labels = kmeans_gmm(values, 3, seed=0)
    # The clusters are scikit-learn's K-means clusters (labels up to a renaming).
    reference = KMeans(n_clusters=3, n_init=1, random_state=0).fit(values[:, None]).labels_
    assert {frozenset(np.flatnonzero(labels == k)) for k in range(3)} == \
           {frozenset(np.flatnonzero(reference == k)) for k in range(3)}
    for k in range(3):
        group = values[labels == k]
        assert mu[k] == pytest.approx(group.mean())
        assert sigma[k] == pytest.approx(group.std(ddof=1))
        assert pi[k] == pytest.approx(group.size / values.size)
    assert list(mu) == sorted(mu) and pi.sum() == pytest.approx(1)


@pytest.mark.parametrize("values", [np.repeat([-0.1, 0.0, 0.1], 50), np.full(40, 0.3), np.zeros(30)])
def test_kmeans_of_weights_exactly_at_a_few_values_gives_every_component_a_spread(values):
    """An already-quantized (ternary), constant or zero layer: a cluster of identical values has spread 0, and
    log(0) made the first step's loss NaN, blamed on the learning rate (probe)."""
    _, sigma, _, _ = kmeans_gmm(values, 4, seed=0)
    assert np.isfinite(np.log(sigma)).all() and (sigma > 0).all()


def test_layer_mixtures_are_initialised_per_window():
    net = small_net(windowing="outlier")
    p = net.posterior("net.hidden1")
    theta = net.base.net.hidden1.weight.detach().double().numpy()
    for j in range(4):
        values = theta[p.window.numpy() == j]
        mu, sigma, pi, _ = kmeans_gmm(values, 4, seed=0)
        np.testing.assert_allclose(p.mu[j].detach().numpy(), mu, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(p.log_sigma[j].exp().detach().numpy(), sigma, rtol=1e-4)
        np.testing.assert_allclose(p.pi[j].detach().numpy(), pi, rtol=1e-5)
    assert torch.equal(p.theta.detach(), net.base.net.hidden1.weight)


def test_outlier_windows_use_five_iqr_tails_and_split_the_body_at_its_median():
    rng = np.random.default_rng(1)
    body = rng.normal(0, 1, 1000)
    theta = np.concatenate([body, [-30.0, -25.0, 40.0]])
    q1, q3 = np.quantile(theta, [0.25, 0.75])
    lower, upper = q1 - 5 * (q3 - q1), q3 + 5 * (q3 - q1)
    window = assign_windows(theta, "outlier", 5.0)
    assert set(theta[window == 0]) == {-30.0, -25.0} and set(theta[window == 3]) == {40.0}
    inside = theta[(theta >= lower) & (theta <= upper)]
    assert np.all(theta[window == 1] < np.median(inside)) and np.all(theta[window == 2] >= np.median(inside))
    equal = assign_windows(theta, "equal")
    edges = theta.min() + (theta.max() - theta.min()) * np.arange(1, 4) / 4
    assert np.array_equal(equal, np.searchsorted(edges, theta, side="right"))
    assert set(assign_windows(theta, "single")) == {0}


@pytest.mark.parametrize("rate", [0.07, 0.37, 0.5, 1.0])
def test_nonzero_rate_is_met_exactly_and_sampled_weights_take_codebook_values(rate):
    net = small_net()
    total = sum(net.posterior(n).theta.numel() for n in net.wrapped)
    gen = torch.Generator().manual_seed(0)
    for greedy in (False, True):
        module, kept = net.posterior_sample(rate, gen, greedy=greedy)
        assert all(bool(m.all()) for m in kept.values())  # unstructured: no unit removed
        linears = [m for m in module if isinstance(m, torch.nn.Linear)]
        nonzero = sum(int((m.weight != 0).sum()) for m in linears)
        assert nonzero == round(rate * total)
        for name, linear in zip(net.wrapped, linears):
            levels = net.posterior(name).levels()
            w = linear.weight[linear.weight != 0]
            assert bool(torch.isin(w, levels).all())


def test_pruning_keeps_the_largest_keep_scores():
    net = small_net()
    masks = net.keep_masks(0.3)
    scores = torch.cat([net.posterior(n).score.detach().reshape(-1) for n in net.wrapped])
    kept = torch.cat([masks[n].reshape(-1) for n in net.wrapped])
    assert scores[kept].min() >= scores[~kept].max()


def test_a_rate_that_cuts_a_whole_layer_leaves_no_network_to_ship():
    """The rate ranks weights over the whole network (paper 001): a small first layer can lose every weight, and
    the samples then gave one constant prediction for every input, which select ranked and shipped with exit 0
    (probe). compress names the layer; a training's validation still scores it (allow_no_network)."""
    from edgebayes.compressed.samples import EmptyLayerError, output_ignores_input

    net = small_net()
    assert not output_ignores_input(compress(net, 0.5, 1, 0).samples[0], net.input_shape)
    with torch.no_grad():   # the first layer's weights rank last
        net.posterior("net.hidden1").score.fill_(-100.0)
    with pytest.raises(EmptyLayerError, match=r"same for every input: layer\(s\) \['hidden1'\] keep no weight"):
        compress(net, 0.3, 2, 0)   # 164 of 548 weights kept; the first layer has 320
    kept = compress(net, 0.3, 1, 0, allow_no_network=True)
    x = torch.randn(6, 20)
    probs = kept.mc_model()(x)
    assert torch.equal(probs, probs[:1].expand_as(probs))
    # a residual path around an emptied layer still reads the input: not refused
    assert compress(net, 0.99, 1, 0).samples   # above the other layers' share: every layer keeps weights

    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.branch, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            return self.head(x + self.branch(x))

    res = Residual()
    with torch.no_grad():
        res.branch.weight.zero_()
    assert not output_ignores_input(res, (4,))


@pytest.mark.parametrize("rate", [0.5, 0.37])
def test_per_input_scores_prune_whole_inputs_of_the_first_layer_at_the_exact_rate(rate):
    net = small_net(first_layer_scores="per-input")
    first, rest = net.posterior("net.hidden1"), [net.posterior(n) for n in net.wrapped[1:]]
    assert first.score.shape == (20,) and all(p.score.shape == p.theta.shape for p in rest)
    masks = net.keep_masks(rate)
    total = sum(m.numel() for m in masks.values())
    assert sum(int(m.sum()) for m in masks.values()) == round(rate * total)
    kept_per_input = masks["net.hidden1"].sum(0)
    partial = ((kept_per_input > 0) & (kept_per_input < 16)).sum()
    assert partial <= 1  # whole inputs, but for the one group the exact count may cut part-way
    # The ranking is by the group's score: every kept weight's score is >= every pruned weight's.
    scores = torch.cat([net.posterior(n).weight_scores().reshape(-1) for n in net.wrapped])
    kept = torch.cat([masks[n].reshape(-1) for n in net.wrapped])
    assert scores[kept].min() >= scores[~kept].max()


def test_per_input_scores_count_the_bernoulli_kl_once_per_input():
    spike = small_net(first_layer_scores="per-input", prior="spike-slab")
    gauss = small_net(first_layer_scores="per-input", prior="gaussian")
    gauss.load_state_dict(spike.state_dict())
    p = spike.posterior("net.hidden1")
    keep = p.keep_probability(spike.tau_prime)
    first = kl_bernoulli(keep, spike.prior_inclusion).sum()  # 20 terms, not 16 x 20
    others = sum(kl_bernoulli(spike.posterior(n).keep_probability(spike.tau_prime), spike.prior_inclusion).sum()
                 for n in spike.wrapped[1:])
    weights, reg = spike.weights_and_regularizer()
    assert float((reg - gauss.kl()).detach()) == pytest.approx(float((first + others).detach()), rel=1e-4)
    expected = keep * (p.phi(spike.tau) * p.mu[p.window].movedim(-1, 0)).sum(0)  # lambda~ of the input, per weight
    assert torch.allclose(weights["net.hidden1.weight"], expected)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 8, 9, 300])
def test_first_argmax_is_torch_argmax_with_ties_to_the_first(k):
    """The knockout argmax over dim 0 gives torch.argmax's index (the first of equal maxima), odd K and
    more components than one byte counts included."""
    generator = torch.Generator().manual_seed(k)
    t = torch.randint(0, 3, (k, 7, 50), generator=generator).float()   # many exact ties
    best = _first_argmax(t)
    assert best.dtype == torch.long and torch.equal(best, t.argmax(0))


def _reference_terms(p, tau, tau_prime, sigma0_sq, spike, mask):
    """SpikeGMMWeight.terms as the plain autograd expression of eq. 8: each weight's k*, its level's KL."""
    phi, keep = p.phi(tau), p.keep_probability(tau_prime)
    mean = keep * (phi * p.mu[p.window].movedim(-1, 0)).sum(0) * mask
    level = (p.window * p.components + phi.argmax(0)).reshape(-1)
    mu_best, sigma_best = p.mu.reshape(-1)[level], p.log_sigma.exp().reshape(-1)[level]
    kl = kl_gaussian_gaussian(mu_best, sigma_best, math.log(sigma0_sq), 1 / sigma0_sq).view(phi.shape[1:])
    return mean, (keep * kl).sum() + kl_bernoulli(keep, spike).sum()


@pytest.mark.parametrize("windowing,scores", [("outlier", "per-weight"), ("single", "per-weight"),
                                              ("outlier", "per-input")])
def test_written_out_backward_of_the_mean_weight_and_regularizer_matches_autograd(windowing, scores):
    """_MixtureMean's backward and the regularizer summed per level: the values and gradients of the plain
    expression, in float64, at a temperature where both softmaxes of phi carry gradient."""
    net = small_net(windowing=windowing, first_layer_scores=scores).double()
    with torch.no_grad():   # distinct, spread mixtures so that every component and window is reached
        for p in net.posteriors.values():
            p.pi.copy_(torch.rand(p.pi.shape, dtype=torch.float64) + 0.1)
            p.log_sigma.add_(torch.randn(p.log_sigma.shape, dtype=torch.float64) * 0.3)
    tau, tau_prime, spike = 0.3, 0.5, torch.tensor(0.4, dtype=torch.float64)
    for name in net.wrapped:
        p = net.posterior(name)
        mask = (torch.rand(p.theta.shape) < 0.8).double()
        upstream = torch.randn(p.theta.shape, dtype=torch.float64)
        results = []
        for terms in (p.terms, lambda *a: _reference_terms(p, *a)):
            p.zero_grad()
            mean, reg = terms(tau, tau_prime, 1.0, spike, mask)
            ((mean * upstream).sum() + reg).backward()
            results.append((mean.detach(), reg.detach(), [q.grad.clone() for q in p.parameters()]))
        (mean, reg, grads), (ref_mean, ref_reg, ref_grads) = results
        assert torch.allclose(mean, ref_mean, rtol=1e-10, atol=1e-12)
        assert float(reg) == pytest.approx(float(ref_reg), rel=1e-10)
        for (q, _), g, ref in zip(p.named_parameters(), grads, ref_grads):
            assert torch.allclose(g, ref, rtol=1e-8, atol=1e-10), q
        assert any(float(g.abs().max()) > 1e-3 for g in grads[:1])   # theta's gradient is not trivially 0


def test_operating_points_are_checked():
    net = small_net(operating_points=(0.3, 0.5))
    assert net.operating_points(None) == [0.3, 0.5] and net.operating_points([1.0]) == [1.0]
    for bad in ([0.0], [1.2], [-0.1]):
        with pytest.raises(ValueError, match="non-zero rates"):
            net.operating_points(bad)


def test_objective_terms_of_eq8_and_the_gaussian_prior_ablation():
    spike, gauss = small_net(prior="spike-slab"), small_net(prior="gaussian")
    gauss.load_state_dict(spike.state_dict())
    weights, reg = spike.weights_and_regularizer()
    reg = reg.detach()
    bernoulli = sum(kl_bernoulli(spike.posterior(n).keep_probability(spike.tau_prime), spike.prior_inclusion).sum().detach()
                    for n in spike.wrapped)
    assert float(reg - gauss.kl().detach()) == pytest.approx(float(bernoulli), rel=1e-4)
    p = spike.posterior("net.hidden2")  # the mean weight is lambda~ sum_k mu_k phi_k, the same for both priors
    expected = p.keep_probability(spike.tau_prime) * (p.phi(spike.tau) * p.mu[p.window].movedim(-1, 0)).sum(0)
    assert torch.allclose(weights["net.hidden2.weight"], expected)
    assert torch.allclose(gauss.weights_and_regularizer()[0]["net.hidden2.weight"], expected)


def test_polynomial_pruning_schedule():
    values = [pruning_schedule(t, 100, 0.99, 0.5, 0.5) for t in range(101)]
    assert values[0] == pytest.approx(0.99) and values[50] == pytest.approx(0.5) and values[100] == 0.5
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert values[25] == pytest.approx(0.5 + 0.49 * 0.5**3)


@pytest.mark.parametrize("k", [2, 4, 16])
def test_pack_and_unpack_of_level_indices_is_lossless(k):
    rng = np.random.default_rng(k)
    bits = codebook.index_bits(k)
    assert bits == int(math.log2(k))
    for count in (0, 1, 7, 8, 1001):
        indices = rng.integers(0, k, count)
        indices[:2] = [0, k - 1][: count]
        data = codebook.pack_indices(indices, bits)
        assert len(data) == math.ceil(count * bits / 8)
        assert np.array_equal(codebook.unpack_indices(data, bits, count), indices)
    with pytest.raises(ValueError):
        codebook.pack_indices(np.array([k]), bits)


def test_compressed_file_reloads_to_the_same_weights(tmp_path):
    net = small_net(components=4)
    m, seed = 3, 5
    rates = net.write_compressed(tmp_path / "model.sqs", 0.4, m=m, seed=seed)
    codes, meta = codebook.read(tmp_path / "model.sqs")
    samples = compress(net, 0.4, m, seed).samples  # what export puts into the ONNX graph
    linears = [[l for l in s if isinstance(l, torch.nn.Linear)] for s in samples]
    for j, code in enumerate(codes):
        for s in range(m):
            assert np.array_equal(code.weights(s), linears[s][j].weight.detach().numpy())
        assert np.array_equal(code.bias, linears[0][j].bias.detach().numpy())
    reloaded = load_compressed(tmp_path / "model.sqs", net.base, sample=1)
    x = torch.randn(5, 20)
    assert torch.equal(reloaded(x), samples[1](x))
    assert meta["samples"] == m and rates["file_bytes"] == (tmp_path / "model.sqs").stat().st_size
    assert rates["rate_formula"] == pytest.approx(32 / 2 / rates["nonzero_rate"])
    assert rates["rate_bytes"] == pytest.approx(rates["fp32_bytes"] / rates["file_bytes"])


def test_input_major_masks_round_trip_and_dead_columns_cost_little(tmp_path):
    rng = np.random.default_rng(0)
    mask = rng.random((64, 200)) < 0.5
    mask[:, rng.random(200) < 0.5] = False  # dead inputs: whole columns pruned
    layer = codebook.LayerCode("w", np.array([-1, -0.5, 0.5, 1], np.float32), mask,
                               rng.integers(0, 4, (2, int(mask.sum()))), np.zeros(64, np.float32))
    info = codebook.write(tmp_path / "c.sqs", [layer])
    assert info["header"]["layers"][0]["mask_order"] == "input-major"
    (back,), _ = codebook.read(tmp_path / "c.sqs")
    assert np.array_equal(back.mask, mask) and np.array_equal(back.indices, layer.indices)
    packed = codebook.rates([layer], info["bytes"], 2)["packed_bytes"]
    assert info["bytes"] < packed  # the entropy coder exploits the structure


def test_section_bytes_show_that_whole_pruned_inputs_make_the_mask_cheap():
    rng = np.random.default_rng(0)
    unstructured = rng.random((64, 200)) < 0.5
    whole_inputs = np.repeat(rng.random((1, 200)) < 0.5, 64, axis=0)  # the same density, by columns
    parts = {}
    for name, mask in (("unstructured", unstructured), ("whole_inputs", whole_inputs)):
        layer = codebook.LayerCode("w", np.array([-1, -0.5, 0.5, 1], np.float32), mask,
                                   rng.integers(0, 4, (1, int(mask.sum()))), np.zeros(64, np.float32))
        parts[name] = codebook.section_bytes([layer])
    assert parts["unstructured"]["mask"] > 0.8 * 64 * 200 / 8  # ~1 bit per weight: no structure to use
    assert parts["whole_inputs"]["mask"] < 0.2 * parts["unstructured"]["mask"]
    for name in parts:  # the indices: ~2 bits per kept weight either way
        assert parts[name]["indices"] > 0.9 * 2 * 0.5 * 64 * 200 / 8


def test_a_corrupt_compressed_file_is_refused_with_its_name(tmp_path):
    bad = tmp_path / "bad.sqs"
    bad.write_bytes(b"not a codebook")
    with pytest.raises(codebook.CodebookError, match="bad.sqs"):
        codebook.read(bad)


def test_sqs_config_is_validated(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"family": "sqs"}, "sqs": {"components": 3}}))
    with pytest.raises(ConfigError, match="sqs.components"):
        load_pipeline_config(path)
    path.write_text(yaml.safe_dump({"model": {"family": "sqs"}, "sqs": {"first_layer_scores": "columns"}}))
    with pytest.raises(ConfigError, match="sqs.first_layer_scores"):
        load_pipeline_config(path)
    path.write_text(yaml.safe_dump({"model": {"family": "sqs"}, "sqs": {"checkpoint": "missing.pt"}}))
    with pytest.raises(ConfigError, match="sqs.checkpoint"):
        load_pipeline_config(path)


def test_a_users_checkpoint_is_the_starting_point(tmp_path):
    from edgebayes.data import load_data

    cfg = PipelineConfig(model=PipelineConfig().model.__class__(family="sqs", hidden=[8]))
    splits = load_data(cfg.data, cfg.seed)
    user = dnn(splits.input_shape, [8], 10)
    torch.save(user.net.state_dict(), tmp_path / "user.pt")  # the plain network's own keys
    cfg.sqs = SQSConfig(checkpoint=str(tmp_path / "user.pt"))
    base, _ = pretrained_base(cfg, splits, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(base.state_dict().values(), user.state_dict().values()))
    torch.save({"something": torch.zeros(3)}, tmp_path / "other.pt")
    cfg.sqs = SQSConfig(checkpoint=str(tmp_path / "other.pt"))
    with pytest.raises(InputError, match=r"sqs.checkpoint .*other.pt: .*missing: hidden1.weight.*not in the model: "
                                         r"something"):
        pretrained_base(cfg, splits, tmp_path)
    # the layouts model.pretrained reads: a checkpoint's "state_dict" entry, a DataParallel / torch.compile prefix
    for name, state in (("wrapped.pt", {"state_dict": user.net.state_dict(), "epoch": 3}),
                        ("compiled.pt", {f"_orig_mod.{k}": v for k, v in user.net.state_dict().items()})):
        torch.save(state, tmp_path / name)
        cfg.sqs = SQSConfig(checkpoint=str(tmp_path / name))
        base, _ = pretrained_base(cfg, splits, tmp_path)
        assert all(torch.equal(a, b) for a, b in zip(base.state_dict().values(), user.state_dict().values()))


@pytest.mark.parametrize("dims", [1, 2])
def test_a_conv_bn_networks_own_checkpoint_loads_and_its_convolutions_are_quantized(dims, tmp_path):
    """SQS wraps the network as the pipeline builds it: a convolution and the batch norm that alone reads it are
    one ConvNorm (conv1.conv, conv1.norm), and a Conv1d is a height-1 Conv2d (train/bayesianize.py). A user's
    checkpoint, saved from the network as written (conv1.weight, bn1.weight), was refused as 'not a state dict of
    the configured' network for every Conv + BatchNorm network (torchvision's resnet18); it now loads, moved to
    the built names and shapes, and the convolution is quantized, not left fp32."""
    from edgebayes.config import PriorConfig
    from edgebayes.train.bayesianize import module_builder
    from edgebayes.train.models import BayesianNet
    from edgebayes.train.sqs import load_checkpoint

    conv, norm = (nn.Conv1d, nn.BatchNorm1d) if dims == 1 else (nn.Conv2d, nn.BatchNorm2d)
    shape = (2, 16) if dims == 1 else (2, 4, 4)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.b1, self.fc = conv(2, 6, 3, padding=1), norm(6), nn.Linear(6 * 16, 3)

        def forward(self, x):
            return self.fc(torch.relu(self.b1(self.c1(x))).flatten(1))

    torch.manual_seed(0)
    user = Net().eval()
    with torch.no_grad():
        user.b1.running_mean.uniform_(-1, 1)
    torch.save(user.state_dict(), tmp_path / "user.pt")
    base = BayesianNet(module_builder(lambda _: Net()), "dnn", PriorConfig(), shape, 3, 100)
    load_checkpoint(base, tmp_path / "user.pt", "net")
    x = torch.randn((8,) + shape)
    torch.testing.assert_close(base.net.eval()(x), user(x), rtol=1e-5, atol=1e-6)
    assert SQSNet(base.net, windowing="single").wrapped == ["c1.conv.conv" if dims == 1 else "c1.conv", "fc"]


def test_a_replaced_sqs_checkpoint_trains_again(tmp_path):
    """The train stage's fingerprint follows what sqs.checkpoint holds, as it does model.pretrained's: a file
    replaced under the same name shipped the network compressed from the old one (probe)."""
    import os

    from edgebayes.config import load_device_profile
    from edgebayes.stages import Context

    weights = tmp_path / "user.pt"
    torch.save({}, weights)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"family": "sqs"}, "sqs": {"checkpoint": str(weights)}}))
    ctx = Context(load_pipeline_config(path), load_device_profile("local"))
    before = ctx.fingerprint("train")
    torch.save({"x": torch.zeros(3)}, weights)
    os.utime(weights, ns=(1, 10**18))
    assert Context(ctx.cfg, ctx.profile).fingerprint("train") != before   # the next command's


class HeadFirst(nn.Module):
    """An MLP whose output layer is defined before the layer that reads the input."""

    def __init__(self, inputs=20):
        super().__init__()
        self.out = nn.Linear(12, 3)
        self.body = nn.Linear(inputs, 12)
        self.input_shape = (inputs,)

    def forward(self, x):
        return self.out(torch.relu(self.body(x)))


def test_sqs_rates_count_the_layers_it_leaves_fp32(tmp_path):
    """A layer SQS does not wrap ships as fp32 beside model.sqs (here a Conv1d given to SQSNet as written; the
    pipeline's networks have theirs as Conv2d): the file's rates were read as the network's (probe)."""
    from edgebayes.provenance import write_json
    from edgebayes.train.sqs import stage_summary

    class Signal(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(1, 4, 3)
            self.head = nn.Linear(248, 64)   # inputs of 64 samples

        def forward(self, x):
            return self.head(torch.relu(self.conv(x)).flatten(1))

    torch.manual_seed(0)
    net = SQSNet(Signal(), windowing="single").initialise(keep_init=0.9, seed=0)
    write_json(tmp_path / "pretrained.json", {"source": "checkpoint", "test": {"accuracy": 0.9}})
    s = stage_summary(net, None, tmp_path, 0.5, {"accuracy": 0.8})
    assert s["unquantized_params"] == 4 * 3 + 4   # the Conv1d's weight and bias
    assert s["rate_bytes_network"] == pytest.approx((s["fp32_bytes"] + 64) / (s["file_bytes"] + 64))
    assert 1 < s["rate_bytes_network"] < s["rate_bytes"]   # (a file of a few weights is larger than fp32)


def test_per_input_scores_go_to_the_layer_that_reads_the_input():
    """sqs.first_layer_scores per-input: the layer that runs first on the input, not the first registered."""
    net = SQSNet(HeadFirst(), first_layer_scores="per-input")
    assert net.posteriors["body"].score.shape == (20,)
    assert net.posteriors["out"].score.shape == (3, 12)
    with pytest.warns(UserWarning, match="body reads one input feature"):
        net = SQSNet(HeadFirst(inputs=1), first_layer_scores="per-input")
    assert net.posteriors["body"].score.shape == (12, 1)


def test_pipeline_with_family_sqs_on_digits(tmp_path):
    cfg = yaml.safe_load((ROOT / "pipeline.yaml").read_text())
    cfg["name"] = "digits-sqs"
    cfg["model"]["family"] = "sqs"
    cfg["train"].update(epochs=4, kl_weight=0.01, mc_samples_eval=2)
    cfg["train"].pop("flops_target")   # SQS has its own target (sqs.nonzero_rate)
    cfg["sqs"] = {"components": 4, "windows": "single", "nonzero_rate": 0.5, "operating_points": [0.5, 1.0],
                  "pretrain_epochs": 30, "pretrain_lr": 3.0e-3}
    cfg["select"] = {"mc_samples": [1, 2], "objective": "accuracy"}
    cfg["benchmark"] = {"warmup": 5, "min_runs": 20, "min_seconds": 0.1}
    config = tmp_path / "sqs.yaml"
    config.write_text(yaml.safe_dump(cfg))
    runs = tmp_path / "runs"
    # model_mb between the low-bit and the fp32 ONNX (issue 21): judged on the shipped file, so the
    # onnx-codebook artifact is chosen; the fp32 one is exported beside it and would not fit.
    device = write_profile(tmp_path / "small-flash.yaml", base="local", budgets={"model_mb": 0.02})
    assert main(["pipeline", "--config", str(config), "--device", str(device), "--runs-dir", str(runs)]) == 0
    run = runs / "digits-sqs"
    choice = json.loads((run / "select/small-flash/choice.json").read_text())
    assert choice["format"] == "onnx-codebook"
    fp32_mb = [c["cost"]["model_mb"] for c in json.loads((run / "select/small-flash/candidates.json").read_text())[
        "candidates"] if c["format"] == "onnx"]
    assert min(fp32_mb) > 0.02 >= choice["candidate"]["cost"]["model_mb"]
    metrics = json.loads((run / "train/metrics.json").read_text())
    s = metrics["sqs"]
    assert metrics["family"] == "sqs" and metrics["test"]["knob"] == "nonzero_rate"
    assert s["nonzero_rate"] == pytest.approx(0.5, abs=1e-3) and s["rate_formula"] == pytest.approx(32, rel=1e-2)
    assert s["file_bytes"] == (run / "train/model.sqs").stat().st_size
    assert s["accuracy_drop"] == pytest.approx(s["full_precision_test"]["accuracy"] - metrics["test"]["accuracy"])
    export = json.loads((run / "export/small-flash/export.json").read_text())
    assert export["format"] == "onnx-codebook" and export["model_bytes"] <= 0.02e6
    assert export["artifacts"]["onnx-codebook"]["bytes_breakdown"]["compression_ratio"] > 4
    form = export["compressed_form"]
    assert form["samples"] == export["mc_samples"] and form["file_bytes"] == (run / "export/small-flash/model.sqs").stat().st_size
    # The exporter stores identical initializers once (the biases, and a weight tensor that two samples
    # share when phi is one-hot), so the graph holds at most M x the weights of one sample.
    assert 0 < export["onnx_params"] <= export["kept_weights_total"]
    results = json.loads((run / "deploy/small-flash/results.json").read_text())
    assert results["bundle"]["artifact"] == "onnx-codebook"
    assert results["metrics"]["accuracy"] >= 0.85 and results["max_abs_prob_diff"] < 1e-4
    report = json.loads((run / "report/small-flash/report.json").read_text())
    assert report["summary"]["budgets"]["model_mb"]["verdict"] == "pass"
    html_text = (run / "report/small-flash/report.html").read_text()
    ratio = export["artifacts"]["onnx-codebook"]["bytes_breakdown"]["compression_ratio"]
    assert "Where the shipped bytes go" in html_text and f"{ratio:.1f}x" in html_text
    # the page shows SQS's own figures (it showed node counts only: probe); the zoo MLP leaves nothing fp32
    assert f"<td>non-zero weights / all (the shipped samples)</td><td>{form['nonzero_rate']:.4g}" in html_text
    assert "levels per layer" in html_text and "test accuracy: full precision (the start) / after SQS" in html_text
    assert s["unquantized_params"] == 0 and s["rate_bytes_network"] == pytest.approx(s["rate_bytes"])


def test_sqs_wraps_the_convolutions_of_lenet5_caffe(tmp_path):
    cfg = PipelineConfig()
    cfg.model.family, cfg.model.arch = "dnn", "lenet5-caffe"
    torch.manual_seed(0)
    base = build_model(cfg.model, cfg.prior, (1, 28, 28), 10, n_train=100)
    net = SQSNet(base, components=4, windowing="outlier").initialise(seed=0)
    assert [n for n in net.wrapped] == ["net.conv1", "net.conv2", "net.fc1", "net.fc2", "net.fc3"]
    with torch.no_grad():
        for p in net.posteriors.values():
            p.score.copy_(torch.randn(p.score.shape))
    compressed = compress(net, 0.25, 2, seed=0)
    sample = compressed.samples[0]
    total = sum(net.posterior(n).theta.numel() for n in net.wrapped)
    weights = [m.weight for m in sample.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    assert sum(int((w != 0).sum()) for w in weights) == round(0.25 * total)
    rates = net.write_compressed(tmp_path / "lenet.sqs", 0.25, m=2, seed=0)
    reloaded = load_compressed(tmp_path / "lenet.sqs", net.base, sample=0)
    x = torch.rand(3, 1, 28, 28)
    assert torch.allclose(torch.softmax(reloaded(x), -1), compressed.mc_model(1)(x), atol=1e-6)
    assert rates["rate_formula"] == pytest.approx(64)


def test_sqs_fine_tuning_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch):
    """Both stages run in the one training loop (train/trainer.py): fine-tuning interrupted after an epoch's
    checkpoint resumes from it (the pretrained dnn is reused) and ends with the uninterrupted model."""
    import edgebayes.train.trainer as trainer
    from edgebayes.data import load_data
    from edgebayes.train.families import fit

    cfg = PipelineConfig(model=PipelineConfig().model.__class__(family="sqs", hidden=[16]))
    cfg.train.epochs, cfg.train.batch_size, cfg.train.mc_samples_val, cfg.train.device = 3, 64, 1, "cpu"
    cfg.train.kl_weight = 0.01
    cfg.sqs = SQSConfig(windows="single", pretrain_epochs=2, pretrain_lr=3.0e-3)
    splits = load_data(cfg.data, cfg.seed)
    quiet = dict(log=lambda *_: None)
    (tmp_path / "full").mkdir()
    full, full_history = fit(cfg, splits, tmp_path / "full" / "checkpoint.pt", **quiet)

    real_save = trainer.atomic_torch_save

    def save_then_die(obj, path):
        real_save(obj, path)
        if path.name == "checkpoint.pt" and obj["epoch"] == 2:
            raise KeyboardInterrupt  # after the second fine-tuning epoch was checkpointed

    (tmp_path / "part").mkdir()
    monkeypatch.setattr(trainer, "atomic_torch_save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        fit(cfg, splits, tmp_path / "part" / "checkpoint.pt", **quiet)
    monkeypatch.setattr(trainer, "atomic_torch_save", real_save)
    messages = []
    resumed, history = fit(cfg, splits, tmp_path / "part" / "checkpoint.pt", log=messages.append)

    assert any("checkpoint.pt after epoch 2" in m for m in messages)
    assert any("pretrained.pt after epoch 2" in m for m in messages)  # the finished pretraining is reused
    assert [h["epoch"] for h in history] == [1, 2, 3] and "train_keep_fraction" in history[-1]
    assert history[-1]["val_accuracy"] == full_history[-1]["val_accuracy"] > 0.5  # trained, not at chance
    for (name, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("rate", [0.0, 0.3, 0.37, 0.5, 1.0])
def test_keep_masks_by_selection_equal_the_stable_sort_with_ties(rate):
    """keep_masks finds the threshold by selection (issue 20: a full sort every step was slow); the mask is
    the one a stable descending sort gives, ties included (the first of equal scores win)."""
    net = small_net()
    with torch.no_grad():   # many ties: scores on a coarse grid
        for p in net.posteriors.values():
            p.score.copy_(torch.randint(0, 4, p.score.shape).float())
    masks = net.keep_masks(rate)
    scores = torch.cat([net.posterior(n).weight_scores().reshape(-1) for n in net.wrapped])
    expected = torch.zeros(scores.numel(), dtype=torch.bool)
    expected[torch.sort(scores, descending=True, stable=True).indices[: round(rate * scores.numel())]] = True
    assert torch.equal(torch.cat([masks[n].reshape(-1) for n in net.wrapped]), expected)


def test_unmasked_objective_gives_pruned_weights_a_likelihood_gradient():
    """The ablation of the hard top-r_t mask: with it, weights outside the mask get no likelihood gradient
    (their theta gradient is zero); without it (eq. 8 as written) they do."""
    net = small_net()
    x, y = torch.randn(8, 20), torch.randint(0, 3, (8,))
    grads = {}
    for masked in (True, False):
        net.zero_grad(set_to_none=True)
        weights, _ = net.weights_and_regularizer(0.3 if masked else None)
        nll = torch.nn.functional.cross_entropy(torch.func.functional_call(net.base, weights, (x,)), y)
        nll.backward()
        grads[masked] = net.posterior("net.hidden1").theta.grad.clone()
    pruned = ~net.keep_masks(0.3)["net.hidden1"]
    assert pruned.any()
    assert torch.all(grads[True][pruned] == 0)
    assert grads[False][pruned].abs().sum() > 0


def _reference_terms(p, tau, tau_prime, sigma0_sq, spike, mask):
    """Eq. 8's terms of one tensor written plainly, components on the last dim and the (W, K) tables indexed by
    window (the computation before issue 20's layout change)."""
    table = (lambda t: t[0]) if p.windows == 1 else (lambda t: t[p.window])
    mu, sigma = table(p.mu), table(p.log_sigma.exp())
    density = torch.exp(-0.5 * ((p.theta.unsqueeze(-1) - mu) / sigma) ** 2) / (math.sqrt(2 * math.pi) * sigma)
    phi = torch.softmax(torch.softmax(table(p.pi.clamp(min=0)) * density, dim=-1) / tau, dim=-1)
    keep = p.keep_probability(tau_prime)
    mean = keep * (phi * mu).sum(-1) * mask
    best = phi.argmax(-1, keepdim=True)
    mu_best = mu.expand(phi.shape).gather(-1, best).squeeze(-1)
    sigma_best = sigma.expand(phi.shape).gather(-1, best).squeeze(-1)
    reg = (keep * kl_gaussian_gaussian(mu_best, sigma_best, math.log(sigma0_sq), 1 / sigma0_sq)).sum()
    return mean, reg + kl_bernoulli(keep, spike).sum()


@pytest.mark.parametrize("shape,channels_last", [((12, 20), False), ((6, 3, 3, 3), False), ((6, 3, 3, 3), True)])
@pytest.mark.parametrize("windowing", ["outlier", "single"])
def test_spike_gmm_terms_with_components_first_equal_the_plain_computation(shape, channels_last, windowing):
    """Issue 20's layout of phi (components on dim 0, tables by index_select) changes neither the mean weight,
    nor the regularizer, nor a gradient beyond float error, nor the mean weight's memory layout."""
    torch.manual_seed(0)
    weight = torch.randn(shape)
    weight.view(-1)[:3] = torch.tensor([2.0, -3.0, 2.5])   # outliers, so that the outer windows are used
    p = SpikeGMMWeight(shape, 4, WINDOWS[windowing]).double()
    p.initialise(weight.double(), windowing, 5.0, 0.0, 0.0125, 0)
    with torch.no_grad():
        p.score.copy_(0.0125 * torch.randn(shape, dtype=torch.float64))
    if channels_last:
        p = p.to(memory_format=torch.channels_last)
    mask = torch.rand(shape) < 0.7
    out = torch.randn(shape, dtype=torch.float64)
    results = []
    for terms in (p.terms, lambda *a: _reference_terms(p, *a)):
        mean, reg = terms(5e-2, 0.0125, 1.0, 0.3, mask)
        results.append((mean, reg, torch.autograd.grad((mean * out).sum() + reg, list(p.parameters()))))
    (mean, reg, grads), (ref_mean, ref_reg, ref_grads) = results
    torch.testing.assert_close(mean, ref_mean)
    torch.testing.assert_close(reg, ref_reg)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)
    assert mean.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


TINY_CONV = """
from torch import nn
def build(num_classes=10):
    return nn.Sequential(nn.Conv2d(1, 1, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, num_classes))
"""


def test_a_rate_that_takes_a_whole_layer_fails_train_by_name_after_a_full_preflight(tmp_path, monkeypatch, capsys):
    """A 1-channel first convolution (9 weights) ranked with 4,800 others at a rate of 0.3%: every sample's output
    was one constant, shipped with exit 0 (probe). The pre-flight still exports the untrained net (its equal keep
    scores may leave a layer empty before training ranks them), and train ends with the layer and the rate named."""
    (tmp_path / "tinyconv.py").write_text(TINY_CONV)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = yaml.safe_load((ROOT / "pipeline.yaml").read_text())
    cfg["name"] = "sqs-collapse"
    cfg["model"].update(family="sqs", arch="tinyconv:build")
    cfg["train"].update(epochs=1, mc_samples_eval=1)
    cfg["train"].pop("flops_target")
    cfg["sqs"] = {"components": 4, "windows": "single", "nonzero_rate": 0.003, "pretrain_epochs": 1}
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config", str(config), "--runs-dir", str(tmp_path / "runs")]) == 1
    out, err = capsys.readouterr()
    assert "train: pre-flight: the untrained network compresses and exports" in out
    assert re.search(r"train: nonzero_rate 0.003 leaves the network's output the same for every input: layer\(s\) "
                     r"\['\d'(, '\d')*\] keep no weight; a larger nonzero_rate keeps them \(sqs\.nonzero_rate, the rate "
                     r"this training pruned to", err), err
    assert (tmp_path / "runs/sqs-collapse/train/checkpoint.pt").is_file()
