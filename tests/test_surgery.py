"""Structural surgery (compressed/surgery.py), posterior samples (train/models.py) and compress (compressed/samples.py)."""

import pytest
import torch
from torch import nn

from edgebayes.config import ModelConfig, PriorConfig
from edgebayes.compressed.samples import MCAverage, compress, sample_generator
from edgebayes.compressed.surgery import SurgeryError, format_report, remove_dead_units
from edgebayes.compressed.structure import count_weights, paper_flops, structure_report
from edgebayes.train.layers import LayerFactory
from edgebayes.train.models import BayesianNet, build_model
from edgebayes.train.spike_slab import SpikeSlabLayer

from _nets import CatPoolFlatten, ConstantAfterNorm, Depthwise

IN, HIDDEN, CLASSES = 20, [16, 12], 5
INPUT_SHAPE = (4, 5)  # flattened to IN by the MLP's Flatten
BAYESIAN = ["ss-ig", "ss-gl", "ss-ghs"]


def _model(family, arch="mlp", input_shape=INPUT_SHAPE, seed=0, **prior):
    torch.manual_seed(seed)
    return build_model(ModelConfig(family=family, arch=arch, hidden=list(HIDDEN)), PriorConfig(**prior),
                       input_shape, CLASSES, n_train=1000)


def _prunable(model):
    return [layer for _, layer in model.bayesian_layers() if layer.prunable]


def _kill_random_half(model, seed=1):
    """Switch off a random half of every prunable layer's units (fixed seed); returns the dead index sets."""
    g, dead_sets = torch.Generator().manual_seed(seed), []
    with torch.no_grad():
        for layer in _prunable(model):
            dead = torch.randperm(layer.out_units, generator=g)[: layer.out_units // 2]
            layer.gamma_logit[dead] = -10.0
            dead_sets.append(dead)
    return dead_sets


def _linears(module):
    return [m for m in module.modules() if isinstance(m, nn.Linear)]


def _inputs(shape=INPUT_SHAPE, n=16, seed=2):
    return torch.randn((n,) + tuple(shape), generator=torch.Generator().manual_seed(seed))


def _assert_same_outputs(pruned, dense, shape):
    x = _inputs(shape)
    with torch.no_grad():
        torch.testing.assert_close(pruned(x), dense(x), rtol=0, atol=1e-5)


def _prune(model, threshold=0.5, seed=3):
    dense, keep = model.posterior_sample(threshold, torch.Generator().manual_seed(seed))
    return dense, keep, remove_dead_units(dense, keep, torch.zeros((1,) + model.input_shape))


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", BAYESIAN)
def test_mlp_surgery_preserves_outputs_shapes_weights_and_flops(family):
    """MLP: same outputs (1e-5), Linear shapes = kept counts, count_weights and paper_flops = sum over layers
    of (kept_in + 1) * kept_out (appendix A.1); the input module is untouched."""
    model = _model(family)
    _kill_random_half(model)
    dense, keep, pruned = _prune(model)
    kept_counts = [int(m.sum()) for m in keep.values()]
    assert kept_counts == [h - h // 2 for h in HIDDEN] + [CLASSES]
    _assert_same_outputs(pruned, dense, INPUT_SHAPE)
    expected_in = [IN] + kept_counts[:-1]
    assert [(m.in_features, m.out_features) for m in _linears(pruned)] == list(zip(expected_in, kept_counts))
    by_hand = sum((i + 1) * o for i, o in zip(expected_in, kept_counts))
    assert count_weights(pruned) == by_hand
    assert paper_flops(pruned, INPUT_SHAPE) == by_hand
    dense_widths = [IN] + HIDDEN + [CLASSES]
    assert [m.out_features for m in _linears(dense)] == dense_widths[1:]  # surgery worked on a copy
    assert not pruned.training


def test_surgery_is_a_noop_when_nothing_is_dead():
    model = _model("ss-gl")
    dense, keep, pruned = _prune(model)
    assert all(bool(m.all()) for m in keep.values())  # gamma_init 0.99 keeps everything
    for a, b in zip(_linears(dense), _linears(pruned)):
        assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)


def test_lenet_surgery_cuts_channels_across_the_flatten_and_matches_a_hand_count():
    """LeNet-5-Caffe (paper 000: 800 flattened features -> 800 -> 500 -> 10): dead channels of conv1/conv2
    and units of fc1/fc2 go; fc1 loses the 16 inputs (4 x 4) of each dead conv2 channel; outputs equal;
    FLOPs by appendix A.1 equal a hand count."""
    model = _model("ss-ghs", arch="lenet5-caffe", input_shape=(1, 28, 28))
    _kill_random_half(model)
    dense, keep, pruned = _prune(model)
    c1, c2, f1, f2 = (int(keep[n].sum()) for n in ("conv1", "conv2", "fc1", "fc2"))
    assert (c1, c2, f1, f2) == (10, 25, 400, 250)
    assert (pruned.conv1.out_channels, pruned.conv2.in_channels, pruned.conv2.out_channels) == (c1, c1, c2)
    assert (pruned.fc1.in_features, pruned.fc1.out_features, pruned.fc2.in_features) == (16 * c2, f1, f1)
    assert (pruned.fc2.out_features, pruned.fc3.in_features) == (f2, f2)
    _assert_same_outputs(pruned, dense, (1, 28, 28))

    def flops(k1, k2, h1, h2):  # conv (C_in K K + 1) Ow Oh C_out + linear (I + 1) O
        return ((1 * 25 + 1) * 24 * 24 * k1 + (k1 * 25 + 1) * 8 * 8 * k2 + (16 * k2 + 1) * h1 + (h1 + 1) * h2
                + (h2 + 1) * CLASSES)
    # conv 299,520 + 1,603,200, fc 640,800 + 400,500, output 501 per class: counted by hand
    assert paper_flops(dense, (1, 28, 28)) == flops(20, 50, 800, 500) == 2_944_020 + 501 * CLASSES
    assert paper_flops(pruned, (1, 28, 28)) == flops(c1, c2, f1, f2)


def test_resnet_stream_channel_goes_only_when_dead_in_every_writer():
    """ResNet-20: a channel of stage 1's residual stream dead in the stem and every block's conv2 is
    removed everywhere; one dead in a single block's conv2 stays (zero rows, same width); channels internal
    to a block go; outputs equal with batch norm in eval mode."""
    model = _model("ss-gl", arch="resnet20", input_shape=(3, 16, 16), parameterization="non-centered")
    with torch.no_grad():
        for _, layer in model.bayesian_layers():  # batch norms with non-trivial statistics
            if layer.norm is not None:
                layer.norm.running_mean.uniform_(-0.5, 0.5)
                layer.norm.running_var.uniform_(0.5, 2.0)
                layer.norm.bias.uniform_(-0.3, 0.3)
        net = model.net
        net.stem.gamma_logit[0] = -10
        for block in net.layer1:
            block.conv2.gamma_logit[0] = -10
        net.layer1[1].conv2.gamma_logit[1] = -10  # channel 1 dead in one writer only
        net.layer1[0].conv1.gamma_logit[:5] = -10
        net.layer3[2].conv1.gamma_logit[3:9] = -10
    dense, keep, pruned = _prune(model)
    p = pruned
    assert p.stem.conv.out_channels == 15
    assert all(b.conv2.conv.out_channels == 15 and b.conv1.conv.in_channels == 15 for b in p.layer1)
    assert p.layer2[0].conv1.conv.in_channels == 15 and p.layer2[0].shortcut.conv.in_channels == 15
    assert p.layer1[0].conv1.conv.out_channels == 11 and p.layer3[2].conv1.conv.out_channels == 58
    assert p.layer3[2].conv2.conv.in_channels == 58
    _assert_same_outputs(pruned, dense, (3, 16, 16))
    assert paper_flops(pruned, (3, 16, 16)) < paper_flops(dense, (3, 16, 16))


class _UserNet(nn.Module):
    """Not in the zoo: a residual block and a channel concatenation, built from the same layer factory."""

    def __init__(self, make):
        super().__init__()
        self.a = make.conv(3, 8, 3, padding=1, norm=True)
        self.b = make.conv(8, 8, 3, padding=1, norm=True)       # residual: a + b(a)
        self.c = make.conv(8, 6, 1)                             # concatenated with a
        self.d = make.conv(14, 10, 3, stride=2, padding=1)
        self.head = make.linear(10, CLASSES, prunable=False)
        self.act = make.activation()

    def forward(self, x):
        a = self.act(self.a(x))
        r = self.act(a + self.b(a))
        cat = torch.cat([r, self.act(self.c(r))], dim=1)
        return self.head(self.act(self.d(cat)).mean((2, 3)))


def test_surgery_on_a_users_model_with_residual_and_concatenation():
    """A user's model built from the same layers goes through the same code: posterior sample via the
    plain twin, residual coupling and concatenation offsets from the dependency graph, outputs equal."""
    import edgebayes.train.zoo as zoo

    zoo.ARCHITECTURES["user-net"] = lambda make, input_shape, classes, **_: _UserNet(make)
    try:
        torch.manual_seed(0)
        model = BayesianNet("user-net", "ss-ig", PriorConfig(), (3, 8, 8), CLASSES, 1000)
        with torch.no_grad():
            model.net.a.gamma_logit[[1, 4]] = -10
            model.net.b.gamma_logit[[1, 4, 6]] = -10   # 1 and 4 dead in both writers of the stream; 6 only here
            model.net.c.gamma_logit[[0, 5]] = -10
            model.net.d.gamma_logit[[2]] = -10
        dense, keep, pruned = _prune(model)
    finally:
        del zoo.ARCHITECTURES["user-net"]
    assert (pruned.a.conv.out_channels, pruned.b.conv.out_channels, pruned.c.out_channels) == (6, 6, 4)
    assert pruned.d.in_channels == 10 and pruned.d.out_channels == 9 and pruned.head.in_features == 9
    _assert_same_outputs(pruned, dense, (3, 8, 8))


# ---------------------------------------------------------------------------------------------
def test_dead_unit_behind_an_activation_with_nonzero_at_zero_is_folded_into_the_next_linear():
    """Sigmoid(0) = 0.5: a dead unit's output is the constant 0.5 where the next Linear reads it, so it goes
    and W[:, unit] * 0.5 moves into that Linear's bias (outputs equal); a dead unit behind GELU (f(0) = 0)
    goes as it is. (A constant read by a padded convolution stays: test_constant_after_batch_norm_...)"""
    torch.manual_seed(0)
    for act, kept in ((nn.Sigmoid(), 2), (nn.GELU(), 2)):
        module = nn.Sequential(nn.Linear(4, 3), act, nn.Linear(3, 2)).eval()
        with torch.no_grad():
            module[0].weight[1] = 0
            module[0].bias[1] = 0
        pruned = remove_dead_units(module, {"0": torch.tensor([True, False, True])}, torch.zeros(1, 4))
        assert pruned[0].out_features == kept
        x = torch.randn(5, 4)
        torch.testing.assert_close(pruned(x), module(x), rtol=0, atol=1e-6)


def test_surgery_keeps_output_units_and_says_why():
    module = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    with torch.no_grad():
        module[2].weight[1] = 0
        module[2].bias[1] = 0
    report = {}
    pruned = remove_dead_units(module, {"2": torch.tensor([True, False])}, torch.zeros(1, 4), report=report)
    assert pruned[2].out_features == 2
    (why,) = report["2"]["kept"]
    assert "outputs of the model" in why


def test_surgery_refuses_bad_inputs():
    """Masks naming a missing or non-affine layer, or of the wrong size, are refused with the name."""
    module = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    with pytest.raises(SurgeryError, match="'1'.*not a Linear or Conv2d"):
        remove_dead_units(module, {"1": torch.tensor([True, False, True])}, torch.zeros(1, 4))
    with pytest.raises(SurgeryError, match="'nope'"):
        remove_dead_units(module, {"nope": torch.tensor([True])}, torch.zeros(1, 4))
    with pytest.raises(SurgeryError, match=r"dead_units\['0'\] has 2 entries for 3 outputs"):
        remove_dead_units(module, {"0": torch.tensor([True, False])}, torch.zeros(1, 4))


# ---------------------------------------------------------------------------------------------
def _spread_gammas(model):
    """Inclusion probabilities spread over (0, 1) so that thresholds 0.5 and 0.7 keep different units."""
    with torch.no_grad():
        for layer in _prunable(model):
            n = layer.out_units
            layer.gamma_logit.copy_(torch.linspace(-3, 3, n)[torch.randperm(n, generator=torch.Generator().manual_seed(n))])


@pytest.mark.parametrize("family,arch,shape", [("ss-ig", "mlp", INPUT_SHAPE), ("ss-gl", "mlp", INPUT_SHAPE),
                                               ("ss-ghs", "lenet5-caffe", (1, 28, 28))])
def test_eval_forward_is_the_materialized_posterior_sample(family, arch, shape):
    """Eval forward with set_inclusion_threshold(t) and torch.manual_seed(s) equals the dense sample
    posterior_sample(t, Generator(s)): same weights drawn in the same order, same kept units."""
    model = _model(family, arch=arch, input_shape=shape)
    _spread_gammas(model)
    x = _inputs(shape)
    model.eval()
    model.set_inclusion_threshold(0.7)
    torch.manual_seed(123)
    with torch.no_grad():
        out = model(x)
    dense, keep = model.posterior_sample(0.7, torch.Generator().manual_seed(123))
    with torch.no_grad():
        torch.testing.assert_close(out, dense(x), rtol=1e-5, atol=1e-5)
    expected = model.kept_units(0.7)
    assert keep.keys() == expected.keys() and all(torch.equal(keep[k], v) for k, v in expected.items())
    assert any(not bool(m.all()) for m in keep.values())  # the threshold really drops units
    model.set_inclusion_threshold(0.5)
    torch.manual_seed(123)
    with torch.no_grad():
        assert not torch.allclose(model(x), out, atol=1e-4)


def test_resnet_eval_forward_is_the_posterior_sample_with_batch_norm():
    """Non-centered ResNet-20 with batch norm: the eval forward equals the plain twin's forward."""
    model = _model("ss-ghs", arch="resnet20", input_shape=(3, 16, 16), parameterization="non-centered")
    _spread_gammas(model)
    model.eval()
    x = _inputs((3, 16, 16))
    torch.manual_seed(5)
    with torch.no_grad():
        out = model(x)
    dense, _ = model.posterior_sample(0.5, torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(out, dense(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", BAYESIAN)
def test_eval_forward_ignores_weights_of_units_below_threshold(family):
    """Units whose gamma is below the threshold contribute nothing in eval mode; a kept unit does."""
    model = _model(family)
    _spread_gammas(model)
    model.eval()
    model.set_inclusion_threshold(0.6)
    x = _inputs()

    def run():
        torch.manual_seed(7)
        with torch.no_grad():
            return model(x)

    ref = run()
    first = _prunable(model)[0]
    dropped, kept = ~first.kept_units(0.6), first.kept_units(0.6)
    assert dropped.any() and kept.any()
    with torch.no_grad():
        first.weight_mu[dropped] += 5.0
        first.bias_mu[dropped] -= 3.0
        first.weight_rho[dropped] = 1.0
    torch.testing.assert_close(run(), ref, rtol=0, atol=0)
    with torch.no_grad():
        first.weight_mu[kept] += 0.5
    assert not torch.allclose(run(), ref)


def test_train_forward_zeroes_units_with_vanishing_gamma():
    """In train mode (relaxed Bernoulli, hard forward) units with gamma ~ 0 output exactly 0, others not."""
    model = _model("ss-gl")
    dead_sets = _kill_random_half(model)
    layers = _prunable(model)
    with torch.no_grad():
        for layer, dead in zip(layers, dead_sets):
            alive = torch.ones(layer.out_units, dtype=torch.bool)
            alive[dead] = False
            layer.gamma_logit[alive] = 10.0
    model.train()
    outputs = []
    hooks = [layer.register_forward_hook(lambda m, i, o: outputs.append(o)) for layer in layers]
    torch.manual_seed(0)
    model(_inputs())
    for h in hooks:
        h.remove()
    for out, dead in zip(outputs, dead_sets):
        alive = torch.ones(out.shape[1], dtype=torch.bool)
        alive[dead] = False
        assert torch.all(out[:, dead] == 0)
        assert torch.all(out[:, alive].abs().sum(0) > 0)


def test_bnn_and_dnn_families_are_dense():
    """The dense BNN is mean-field Gaussian with nothing to prune; the DNN has no Bayesian layer at all."""
    bnn, dnn = _model("bnn"), _model("dnn")
    assert all(isinstance(m, SpikeSlabLayer) and not m.prunable for _, m in bnn.bayesian_layers())
    assert len(bnn.bayesian_layers()) == 3 and float(bnn.kl().detach()) > 0
    assert dnn.bayesian_layers() == [] and float(dnn.kl()) == 0
    assert all(bool(m.all()) for m in bnn.kept_units(0.9).values())


def test_layer_factory_decides_the_layer_type_of_the_whole_architecture():
    for family, kind in (("dnn", nn.Conv2d), ("ss-gl", SpikeSlabLayer)):
        net = _model(family, arch="lenet5-caffe", input_shape=(1, 28, 28)).net
        assert isinstance(net.conv1, kind) and isinstance(net.conv2, kind)
    with pytest.raises(ValueError, match="unknown family"):
        LayerFactory("ss-xx")


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["ss-gl", "dnn"])
def test_compress_samples_are_pruned_plain_modules_and_prefix_stable(family):
    """compress(): every sample is a pruned plain module (no variational leftovers, kept widths); the
    M=3 samples are the first 3 of the M=5 ones for the same seed; MCAverage = mean of softmaxes."""
    model = _model(family)
    if family != "dnn":
        _kill_random_half(model)
    c3 = compress(model, 0.5, 3, seed=4)
    c5 = compress(model, 0.5, 5, seed=4)
    assert len(c3.samples) == 3 and len(c5.samples) == 5
    assert c5.distinct_samples == (1 if family == "dnn" else 5)   # a plain net's M draws are one network
    kept_counts = [int(m.sum()) for m in c5.kept.values()]
    expect = ([h - h // 2 for h in HIDDEN] if family != "dnn" else HIDDEN) + [CLASSES]
    assert kept_counts == expect
    for s in c5.samples:
        assert all(type(m) in (nn.Flatten, nn.Linear, nn.SiLU) for m in s.children())
        assert [m.out_features for m in _linears(s)] == kept_counts
        assert sum(p.numel() for p in s.parameters()) == count_weights(s)
    for a, b in zip(c3.samples, c5.samples[:3]):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)

    x = _inputs()
    with torch.no_grad():
        p = c5.mc_model()(x)
        torch.testing.assert_close(p.sum(-1), torch.ones(len(x)), rtol=0, atol=1e-6)
        manual = torch.stack([torch.softmax(s(x), -1) for s in c5.samples]).mean(0)
        torch.testing.assert_close(p, manual, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(c5.mc_model(3)(x), c3.mc_model()(x), rtol=0, atol=0)
        assert isinstance(c5.mc_model(2), MCAverage) and len(c5.mc_model(2).samples) == 2

    dense0, _ = model.posterior_sample(0.5, sample_generator(4))
    for a, b in zip(_linears(dense0), _linears(c5.dense_sample)):
        assert torch.equal(a.weight, b.weight)
    if family != "dnn":
        w = [_linears(s)[0].weight for s in c5.samples]
        assert not torch.equal(w[0], w[1])
        assert not torch.equal(_linears(compress(model, 0.5, 1, seed=5).samples[0])[0].weight, w[0])


# ---------------------------------------------------------------------------------------------
# Surgery on networks outside the zoo (issue 18): concatenation into a flatten, depthwise groups,
# constants left behind by batch norm, Torch-Pruning's failures, torchvision classifiers.
def _zero_rows(layer, dead, norm=None):
    """What a spike-and-slab sample does to a dead unit: zero weight rows and bias; and, z multiplying after
    the batch norm, the batch norm's scale and shift too when `norm` is given."""
    with torch.no_grad():
        for p in (layer.weight, layer.bias) + ((norm.weight, norm.bias) if norm is not None else ()):
            if p is not None:
                p[dead] = 0


def _keep(n, dead):
    keep = torch.ones(n, dtype=torch.bool)
    keep[list(dead)] = False
    return keep


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("global_pool", [False, True])
def test_concat_then_pool_flatten_linear_loses_the_dead_channels_of_both_branches(seed, global_pool):
    """cat([a, b]) -> max-pool 2x2 -> flatten -> Linear: Torch-Pruning left the concatenation's offsets
    unset (an IndexError, or 'mat1 and mat2 shapes cannot be multiplied' at the check, before the fix);
    with a global average pool it worked and still does. Every dead channel goes: b's are zero; a's are
    the constant relu(BN shift) in each of their features, folded into fc's bias. A branch with no live
    channel keeps one (a layer cannot be empty)."""
    torch.manual_seed(seed)
    net = CatPoolFlatten(global_pool=global_pool).eval()
    g = torch.Generator().manual_seed(seed)
    keep_a, keep_b = torch.rand(4, generator=g) > 0.5, torch.rand(3, generator=g) > 0.5
    _zero_rows(net.a, ~keep_a)   # the batch norm stays live: a dead channel of a is a constant
    _zero_rows(net.b, ~keep_b)
    report = {}
    pruned = remove_dead_units(net, {"a": keep_a, "b": keep_b}, torch.zeros(1, 3, 8, 8), report=report)
    kept_a, kept_b = max(int(keep_a.sum()), 1), max(int(keep_b.sum()), 1)
    assert (pruned.a.out_channels, pruned.bn.num_features, pruned.b.out_channels) == (kept_a, kept_a, kept_b)
    assert pruned.fc.in_features == (1 if global_pool else 16) * (kept_a + kept_b)
    reasons = {why for row in report.values() for why in row["kept"]}
    assert reasons <= {"the last channel: a layer cannot be left empty"}
    _assert_same_outputs(pruned, net, (3, 8, 8))


def test_dead_depthwise_channel_takes_the_channel_feeding_it_unless_that_is_read_elsewhere():
    """A dead depthwise channel (zero filter, zero BN scale and shift) and the expand channel that feeds
    it are one group: the expand channel's work only meets the zero filter, so both go (expand, its batch
    norm, the depthwise layer and the projection's input lose channels 1 and 5). When a second layer also
    reads the expand channels, they are live where it reads them, and the pair stays, with the reason."""
    for side in (False, True):
        torch.manual_seed(0)
        net = Depthwise(side=side).eval()
        _zero_rows(net.depthwise, [1, 5], net.bn2)
        report = {}
        pruned = remove_dead_units(net, {"depthwise": _keep(8, [1, 5])}, torch.zeros(1, 3, 6, 6), report=report)
        width = 8 if side else 6
        assert (pruned.expand.out_channels, pruned.bn1.num_features, pruned.depthwise.out_channels,
                pruned.depthwise.groups, pruned.project.in_channels) == (width,) * 5
        assert report["depthwise"] == ({"dead": 2, "removed": 0, "kept": {"coupled to live expand, read by side": 2}}
                                       if side else {"dead": 2, "removed": 2, "kept": {}})
        _assert_same_outputs(pruned, net, (3, 6, 6))


@pytest.mark.parametrize("reader", ["conv1x1", "linear", "conv3x3"])
def test_constant_after_batch_norm_is_folded_where_exact_and_kept_behind_padding(reader):
    """A dead convolution channel with a live batch norm is the constant relu(beta - gamma mu / sigma) > 0.
    Read by a 1x1 convolution, or by a Linear after a flatten (each of its 36 features is that constant),
    W c moves into the reader's bias and the channel goes; read by a 3x3 convolution with padding 1 it
    stays (the border sees zeros, so no bias is the same), and the report says so."""
    torch.manual_seed(0)
    net = ConstantAfterNorm(reader).eval()
    _zero_rows(net.conv, [0, 3])
    report = {}
    pruned = remove_dead_units(net, {"conv": _keep(6, [0, 3])}, torch.zeros(1, 3, 6, 6), report=report)
    if reader == "conv3x3":
        assert pruned.conv.out_channels == 6 and torch.equal(pruned.read.bias, net.read.bias)
        (why,) = report["conv"]["kept"]
        assert report["conv"]["kept"][why] == 2 and "read by padded convolution read" in why
    else:
        assert pruned.conv.out_channels == 4 and pruned.bn.num_features == 4
        width = pruned.read.in_features if reader == "linear" else pruned.read.in_channels
        assert width == (4 * 36 if reader == "linear" else 4)
        assert not torch.allclose(pruned.read.bias, net.read.bias)  # the constants went into the bias
        assert report["conv"] == {"dead": 2, "removed": 2, "kept": {}}
    _assert_same_outputs(pruned, net, (3, 6, 6))


def test_failures_inside_surgery_keep_the_group_and_say_why(monkeypatch):
    """Torch-Pruning raising while it finds a group (here an IndexError like the concatenation bug's) keeps
    that layer's dead channels, the reason naming the error; raising half-way through removing one spoils
    the copy, so surgery runs again without that group. The module failing on the example input is a
    SurgeryError naming the layer. A layer the forward pass never reaches keeps its channels, with the reason."""
    import torch_pruning as tp

    module = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2)).eval()
    _zero_rows(module[0], [1])
    _zero_rows(module[2], [0])
    dead_units = {"0": _keep(3, [1]), "2": _keep(3, [0])}
    with pytest.raises(SurgeryError, match=r"'0' fails on an input of shape \(\d+, 5\): RuntimeError"):
        remove_dead_units(module, dead_units, torch.zeros(1, 5))

    find = tp.DependencyGraph.get_pruning_group

    def broken(graph, layer, *args, **kwargs):
        if layer is graph.model[0]:
            raise IndexError("index 60 is out of bounds for dimension 0 with size 56")
        return find(graph, layer, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(tp.DependencyGraph, "get_pruning_group", broken)
        report = {}
        pruned = remove_dead_units(module, dead_units, torch.zeros(1, 4), report=report)
    (why,) = report["0"]["kept"]
    assert "could not find the channels coupled" in why and "IndexError: index 60" in why
    assert report["2"] == {"dead": 1, "removed": 1, "kept": {}}
    assert (pruned[0].out_features, pruned[2].out_features) == (3, 2)
    _assert_same_outputs(pruned, module, (4,))

    from torch_pruning.dependency.group import Group

    prune = Group.prune

    def half_way(group, *args, **kwargs):
        if group[0].dep.target.module is group._DG.model[2]:
            group[0].dep.target.module.weight.data = group[0].dep.target.module.weight.data[:1]  # spoilt
            raise RuntimeError("half-way")
        return prune(group, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(Group, "prune", half_way)
        report = {}
        pruned = remove_dead_units(module, dead_units, torch.zeros(1, 4), report=report)
    assert report["0"] == {"dead": 1, "removed": 1, "kept": {}}
    (why,) = report["2"]["kept"]
    assert "failed removing them" in why and "RuntimeError: half-way" in why
    _assert_same_outputs(pruned, module, (4,))

    class Aux(nn.Module):  # an auxiliary head that the forward pass skips (torchvision googlenet's aux1)
        def __init__(self):
            super().__init__()
            self.body, self.aux = module, nn.Linear(3, 2)

        def forward(self, x):
            return self.body(x)

    net = Aux().eval()
    _zero_rows(net.aux, [0])
    report = {}
    remove_dead_units(net, {"aux": _keep(2, [0])}, torch.zeros(1, 4), report=report)
    assert report["aux"] == {"dead": 1, "removed": 0, "kept": {"not reached by the forward pass": 1}}


def _torchvision_with_dead_channels(name, fraction=0.25, seed=0):
    """torchvision.models.<name>(weights=None, num_classes=10) with batch-norm statistics from one batch
    (train mode) and random affine parameters, then a quarter of the output channels of every Conv2d dead
    as a spike-and-slab sample has them: zero weights and bias, and zero scale and shift of the batch norm
    that only this convolution feeds (z multiplies after it, train/bayesianize.py). The classifier (a
    Linear) is not pruned. Returns (net, dead_units)."""
    import torchvision
    from torch import fx

    torch.manual_seed(seed)
    net = getattr(torchvision.models, name)(weights=None, num_classes=10)
    for mod in net.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.momentum = None
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        net.train()(torch.randn((8, 3, 32, 32), generator=g))
        for mod in net.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.weight.copy_(0.5 + torch.rand(mod.num_features, generator=g))
                mod.bias.copy_(0.4 * torch.rand(mod.num_features, generator=g) - 0.2)
    net.eval()
    mods, follower = dict(net.named_modules()), {}
    for node in fx.symbolic_trace(net).graph.nodes:
        if node.op == "call_module" and isinstance(mods[node.target], nn.Conv2d) and len(node.users) == 1:
            (user,) = node.users
            if user.op == "call_module" and isinstance(mods[user.target], nn.BatchNorm2d):
                follower[node.target] = mods[user.target]
    dead_units = {}
    for layer_name, mod in mods.items():
        if isinstance(mod, nn.Conv2d):
            dead = torch.randperm(mod.out_channels, generator=g)[: round(fraction * mod.out_channels)]
            _zero_rows(mod, dead, follower.get(layer_name))
            dead_units[layer_name] = _keep(mod.out_channels, dead.tolist())
    return net, dead_units


# Physical / promised FLOPs (promise: the masks, metrics.structure_report's flops_ratio) at 25% dead:
#   resnet18 0.758 / 0.628: a residual-stream channel stays while any block writes it live;
#   mobilenet_v3_small 0.650 / 0.643, densenet121 0.571 / 0.610 (constants after the pre-activation
#   batch norms folded into the 1x1 convolutions and the classifier);
#   efficientnet_b0 0.653 / 0.606: a dead expand channel whose depthwise channel is live stays (that
#   channel is BN shift x SE scale, not zero), besides residual-stream channels.
TORCHVISION_EXPLAINED = ("residual stream: also written by live", "coupled to a live depthwise channel of",
                         "the last channel")


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small", "densenet121", "efficientnet_b0"])
def test_torchvision_classifiers_with_a_quarter_of_their_channels_dead(name):
    """Surgery on torchvision classifiers at 32x32 with 25% of every convolution's channels dead: outputs
    equal the masked network's (1e-5 relative to the logits' scale); physical FLOPs are within 2% of what
    the masks promise (or below it) where no channel is written by a live layer, and every dead channel
    that stays is explained by the report: a residual-stream channel another block writes, or an expand
    channel whose depthwise channel is live."""
    net, dead_units = _torchvision_with_dead_channels(name)
    report = {}
    pruned = remove_dead_units(net, dead_units, torch.zeros(1, 3, 32, 32), report=report)
    x = torch.randn((2, 3, 32, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        reference = net(x)
        torch.testing.assert_close(pruned(x), reference, rtol=0, atol=1e-5 * max(1.0, float(reference.abs().max())))
    s = structure_report(net, pruned, dead_units, (3, 32, 32))
    print(f"{name}: physical {s['physical_flops_ratio']:.3f} of dense FLOPs, the masks promise {s['flops_ratio']:.3f}")
    print(format_report({k: v for k, v in report.items() if v["kept"]}))
    unexplained = {k: v["kept"] for k, v in report.items()
                   if any(not why.startswith(TORCHVISION_EXPLAINED) for why in v["kept"])}
    assert not unexplained
    if name in ("mobilenet_v3_small", "densenet121"):
        assert s["physical_flops_ratio"] <= 1.02 * s["flops_ratio"]


def test_effective_flops_count_live_inputs_per_group_of_a_depthwise_convolution():
    """1x1 expand (1 -> 4) then 3x3 depthwise on 5x5: with expand channel 1 dead, each depthwise output reads
    its own channel, so C_in,pr is 1, 0, 1, 1 per output, not 3 // 4 = 0 for all (which counted 186 FLOPs
    and 10 weights). By hand, appendix A.1: expand (1 + 1) 25 x 3 = 150, depthwise (3 x 9 + 4) 9 = 279;
    weights 2 x 3 = 6 and 3 x 9 + 4 = 31."""
    from edgebayes.compressed.structure import _layer_costs

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 1), nn.ReLU(), nn.Conv2d(4, 4, 3, groups=4)).eval()
    assert _layer_costs(net, (1, 5, 5), effective=False) == ((1 + 1) * 25 * 4 + (9 + 1) * 9 * 4, 2 * 4 + 10 * 4)
    _zero_rows(net[0], [1])
    assert _layer_costs(net, (1, 5, 5), effective=True) == (150 + 279, 6 + 31)


def test_effective_flops_do_not_count_a_live_unit_that_is_off_on_the_probe_as_dead():
    """C_in,pr counts inputs that are identically zero: a live ReLU unit that is off on every probe example
    (bias -100) is still an input, a dead unit (zero weights and bias) is not."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).eval()
    with torch.no_grad():
        net[0].bias[0] = -100.0
    _zero_rows(net[0], [2])
    assert paper_flops(net, (4,), effective=True) == (4 + 1) * 2 + (2 + 1) * 2


class _Versioned(nn.Module):
    """A module that converts old states when it loads one, as torchvision's MNASNet does: it refuses a
    state dict that does not say which version saved it (its `_metadata`)."""

    _version = 3

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):
        if local_metadata.get("version") != self._version:
            raise ValueError(f"version should be {self._version} instead of {local_metadata.get('version')}")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


@pytest.mark.parametrize("make", [_Versioned, "mnasnet0_5"])
def test_posterior_samples_keep_the_modules_state_dict_metadata(make):
    """A posterior sample is loaded like the user's module loads its own state dict, versions included:
    before the fix the merged dict lost `_metadata` and MNASNet raised 'version should be set to 1 or 2
    instead of None' from train/models.py. The sample then compresses and matches its masked network."""
    from edgebayes.train.families import bayesianize

    torch.manual_seed(0)
    if isinstance(make, str):
        import torchvision

        module = getattr(torchvision.models, make)(weights=None, num_classes=10).eval()
    else:
        module = make().eval()
    net = bayesianize(module, "ss-gl", input_shape=(3, 16, 16), n_train=100).eval()
    sample, kept = net.posterior_sample(0.5, torch.Generator().manual_seed(0))
    assert type(sample) is type(module)
    compressed = compress(net, 0.5, 2, seed=0)
    _assert_same_outputs(compressed.samples[0], compressed.dense_sample, (3, 16, 16))


class _SplitShuffle(nn.Module):
    """Idioms whose channel sizes are fixed in the code: torch.chunk over channels then torch.cat (a raw
    IndexError from surgery before), a channel shuffle (view-transpose-view: Torch-Pruning's reshape mapping
    divided by zero, so torchvision's shufflenet could not be traced), a channel slice."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.c, self.d = nn.Conv2d(16, 16, 1), nn.Conv2d(16, 12, 1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        u, v = torch.chunk(torch.relu(self.a(x)), 2, dim=1)
        h = torch.relu(self.c(torch.cat([u, torch.relu(self.b(v))], 1)))
        n, c, height, width = h.size()
        h = h.view(n, 2, c // 2, height, width).transpose(1, 2).contiguous().view(n, c, height, width)
        h = torch.cat([h[:, :4], torch.relu(self.d(h))], 1)   # 4 + 12 channels
        return self.fc(h.mean((2, 3)))


def _split_shuffle(seed=0):
    torch.manual_seed(seed)
    net = _SplitShuffle().eval()
    g = torch.Generator().manual_seed(seed)
    dead_units = {}
    for name in ("a", "b", "c", "d"):
        layer = getattr(net, name)
        dead = torch.randperm(layer.out_channels, generator=g)[: layer.out_channels // 3].tolist()
        _zero_rows(layer, dead)
        dead_units[name] = _keep(layer.out_channels, dead)
    return net, dead_units


def test_channels_through_a_split_shuffle_or_slice_stay_and_the_others_go():
    """b's dead channels go (c reads them through the concatenation), and d's (through the concatenation
    into the mean and the classifier); a's pass through a chunk, c's through a channel shuffle's view and a
    channel slice, whose sizes the code fixes: they stay, the report naming that operation. The outputs are
    the masked network's."""
    net, dead_units = _split_shuffle()
    report = {}
    pruned = remove_dead_units(net, dead_units, torch.zeros(1, 3, 8, 8), report=report)
    _assert_same_outputs(pruned, net, (3, 8, 8))
    assert report["b"]["removed"] == report["b"]["dead"] == 2 and report["d"]["removed"] == report["d"]["dead"] == 4
    assert (pruned.b.out_channels, pruned.c.in_channels, pruned.c.out_channels, pruned.d.out_channels) == (6, 14, 16, 8)
    assert pruned.fc.in_features == 12
    for name in ("a", "c"):
        (why,) = report[name]["kept"]
        assert why.startswith("passes through ") and "fixed in the network's code" in why
    assert report["a"]["kept"] and next(iter(report["a"]["kept"])).startswith("passes through chunk")
    assert report["c"]["kept"] and next(iter(report["c"]["kept"])).startswith("passes through view")


def test_an_output_difference_is_narrowed_to_the_group_that_causes_it(monkeypatch):
    """With the rule for splits switched off, removing a's dead channels makes the chunk split the wrong
    channels and the check fails: surgery bisects over the groups it removed, keeps a's (the reason names
    the layer and the operation that failed), and removes the rest; before, one error failed everything."""
    import edgebayes.compressed.surgery as surgery

    net, dead_units = _split_shuffle()
    monkeypatch.setattr(surgery, "_channel_op_reason", lambda node, recorder: None)
    report = {}
    pruned = remove_dead_units(net, dead_units, torch.zeros(1, 3, 8, 8), report=report)
    _assert_same_outputs(pruned, net, (3, 8, 8))
    (why,) = report["a"]["kept"]
    assert why.startswith("removing them changed the pruned module") and "'b'" in why
    assert report["b"]["removed"] == report["b"]["dead"]


def test_a_module_torch_pruning_cannot_trace_is_returned_masked_with_the_reason(monkeypatch):
    import torch_pruning as tp

    net, dead_units = _split_shuffle()

    def untraceable(*args, **kwargs):
        raise ZeroDivisionError("integer division or modulo by zero")

    monkeypatch.setattr(tp.DependencyGraph, "build_dependency", untraceable)
    report = {}
    pruned = remove_dead_units(net, dead_units, torch.zeros(1, 3, 8, 8), report=report)
    assert [m.weight.shape for m in pruned.modules() if isinstance(m, nn.Conv2d)] == \
        [m.weight.shape for m in net.modules() if isinstance(m, nn.Conv2d)]
    _assert_same_outputs(pruned, net, (3, 8, 8))
    for row in report.values():
        assert row["removed"] == 0
        assert all(w.startswith("not pruned: Torch-Pruning cannot trace the module (ZeroDivisionError") for w in row["kept"])


class _Grouped(nn.Module):
    """1x1 conv -> BN -> ReLU -> 3x3 conv with 4 groups of 3 -> BN -> ReLU -> 1x1 conv: RegNet's and
    ResNeXt's block without the residual."""

    def __init__(self):
        super().__init__()
        self.a, self.bn_a = nn.Conv2d(3, 12, 1, bias=False), nn.BatchNorm2d(12)
        self.b, self.bn_b = nn.Conv2d(12, 8, 3, padding=1, groups=4, bias=False), nn.BatchNorm2d(8)
        self.c = nn.Conv2d(8, 5, 1)

    def forward(self, x):
        h = torch.relu(self.bn_a(self.a(x)))
        return self.c(torch.relu(self.bn_b(self.b(h)))).mean((2, 3))


@pytest.mark.parametrize("dead_a, dead_b, removed_a, in_sizes, out_sizes", [
    ([0, 4, 7, 9], [1, 2, 5, 7], 4, None, None),                     # one of each group: still one Conv2d
    ([0, 1, 4, 7, 10], [1, 2, 5, 7], 5, [1, 2, 2, 2], [1, 1, 1, 1]),  # unequal inputs
    ([0, 1, 2, 4], [1, 2, 5, 7], 3, [1, 2, 3, 3], [1, 1, 1, 1]),     # group 0 keeps its last input
    ([0, 1, 2, 4], [0, 1, 5, 7], 4, [2, 3, 3], [2, 1, 1]),           # group 0 has no output left: dropped
])
def test_grouped_convolution_loses_dead_channels_group_by_group(dead_a, dead_b, removed_a, in_sizes, out_sizes):
    """Dead inputs and outputs of a grouped convolution go from each group on its own (groups {0,1,2},
    {3,4,5}, ... of inputs, {0,1}, {2,3}, ... of outputs): when every group keeps as many, the result is one
    Conv2d with its groups; else a GroupedConv2d: one grouped convolution with every group padded to the
    widest (zero weights), its kept outputs gathered. A group that still has an output keeps one input, with
    the reason; a group without outputs goes, its inputs read by nothing. Outputs equal the original's, and
    the physical FLOPs count the padded convolution, zeros included."""
    from edgebayes.compressed.grouped import GroupedConv2d

    torch.manual_seed(0)
    net = _Grouped().eval()
    with torch.no_grad():
        for bn in (net.bn_a, net.bn_b):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 1.5)
    _zero_rows(net.a, dead_a, net.bn_a)
    _zero_rows(net.b, dead_b, net.bn_b)
    report = {}
    pruned = remove_dead_units(net, {"a": _keep(12, dead_a), "b": _keep(8, dead_b)}, torch.zeros(1, 3, 6, 6),
                               report=report)
    _assert_same_outputs(pruned, net, (3, 6, 6))
    assert report["a"]["removed"] == removed_a and report["b"] == {"dead": 4, "removed": 4, "kept": {}}
    assert pruned.a.out_channels == 12 - removed_a
    if in_sizes is None:
        assert isinstance(pruned.b, nn.Conv2d) and (pruned.b.in_channels, pruned.b.out_channels, pruned.b.groups) == (8, 4, 4)
        flops_b = 4 * (2 * 9 + 1) * 36
    else:   # one grouped convolution, every group padded to the widest; the kept outputs gathered
        assert isinstance(pruned.b, GroupedConv2d) and pruned.b.conv.groups == len(out_sizes)
        assert len(pruned.b.in_index) == len(out_sizes) * max(in_sizes)
        assert pruned.b.out_index is None or len(pruned.b.out_index) == sum(out_sizes)
        flops_b = len(out_sizes) * max(out_sizes) * (max(in_sizes) * 9 + 1) * 36
    for why in report["a"]["kept"]:
        assert why.startswith("the last input channel of group 0 of grouped convolution b")
    # appendix A.1 on the pruned network: a's, b's groups, c's FLOPs
    expected = (12 - removed_a) * (3 + 1) * 36 + flops_b + 5 * (4 + 1) * 36
    assert paper_flops(pruned, (3, 6, 6)) == expected


def test_unequal_groups_export_in_both_layouts():
    """A GroupedConv2d (pad, gathers, one grouped convolution) traces in the packed layout and converts: the M
    samples' ONNX (packed and unrolled) and TFLite outputs match the MC average in PyTorch."""
    pytest.importorskip("onnxruntime")
    import tempfile
    from pathlib import Path

    from edgebayes.compressed.grouped import GroupedConv2d
    from edgebayes.export.formats import artifact_predict, export_artifact

    samples = []
    for seed in range(2):
        torch.manual_seed(seed)
        net = _Grouped().eval()
        _zero_rows(net.a, [0, 1, 4, 7, 10], net.bn_a)
        _zero_rows(net.b, [0, 1, 5, 7], net.bn_b)
        samples.append(remove_dead_units(net, {"a": _keep(12, [0, 1, 4, 7, 10]), "b": _keep(8, [0, 1, 5, 7])},
                                         torch.zeros(1, 3, 6, 6)))
    assert isinstance(samples[0].b, GroupedConv2d)
    mc = MCAverage(samples).eval()
    x = torch.randn(5, 3, 6, 6)
    reference = mc(x).detach().numpy()
    cases = [("onnx", "packed"), ("onnx", "unrolled")]
    try:
        import ai_edge_litert  # noqa: F401  (the TFLite runtime; conversion needs litert-torch too)
        cases.append(("tflite-fp32", "packed"))
    except ImportError:
        pass
    with tempfile.TemporaryDirectory() as tmp:
        for fmt, layout in cases:
            details = {}
            path = export_artifact(mc, fmt, Path(tmp) / f"{layout}.{fmt}", x, opset=17, layout=layout, details=details)
            assert details["layout"] == layout
            assert abs(artifact_predict(path, fmt, x.numpy()) - reference).max() < 1e-5, (fmt, layout)


def test_compress_says_when_it_could_not_prune_the_network(monkeypatch):
    """compress keeps sample 0's surgery report; `not_pruned` carries the reason to select and export when
    Torch-Pruning cannot trace the network (the samples are then the masked networks, dense shapes)."""
    import torch_pruning as tp

    model = _model("ss-gl")
    _kill_random_half(model)
    assert compress(model, 0.5, 2, seed=0).not_pruned is None
    monkeypatch.setattr(tp.DependencyGraph, "build_dependency",
                        lambda *a, **k: (_ for _ in ()).throw(ZeroDivisionError("integer division or modulo by zero")))
    c = compress(model, 0.5, 2, seed=0)
    assert c.not_pruned.startswith("Torch-Pruning cannot trace the module (ZeroDivisionError")
    assert [layer.out_features for layer in _linears(c.samples[0])] == HIDDEN + [CLASSES]
    _assert_same_outputs(c.samples[0], c.dense_sample, INPUT_SHAPE)


@pytest.mark.parametrize("multiple, widths", [(1, (5, 2)), (4, (8, 4)), (8, (8, 8))])
def test_pruned_widths_round_up_to_the_runtime_channel_multiple(multiple, widths):
    """With channel_multiple q, a convolution that loses channels keeps a multiple of q (dead ones stay, zero,
    with the reason), never more than it had; a Linear is not rounded; outputs equal the original's."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 12, 3, padding=1), nn.ReLU(), nn.Conv2d(12, 10, 3, padding=1), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(10, 7), nn.ReLU(), nn.Linear(7, 3)).eval()
    dead = {"0": [0, 2, 3, 5, 7, 8, 10], "2": [1, 2, 3, 4, 6, 7, 8, 9], "6": [0, 1, 4]}   # 5/12, 2/10, 4/7 live
    for name, rows in dead.items():
        _zero_rows(net.get_submodule(name), rows)
    report = {}
    pruned = remove_dead_units(net, {n: _keep(net.get_submodule(n).weight.shape[0], d) for n, d in dead.items()},
                               torch.zeros(1, 3, 6, 6), report=report, channel_multiple=multiple)
    _assert_same_outputs(pruned, net, (3, 6, 6))
    assert (pruned[0].out_channels, pruned[2].out_channels, pruned[6].out_features) == widths + (4,)
    assert report["6"] == {"dead": 3, "removed": 3, "kept": {}}
    for name, width in zip(dead, widths):
        kept = report[name]["kept"]
        assert sum(kept.values()) == width - (12, 10)[list(dead).index(name)] + len(dead[name])
        assert all(why.startswith(f"kept to round the layer's width up to a multiple of {multiple}") for why in kept)


def test_an_index_mapping_that_explodes_keeps_the_group_instead_of_the_memory(monkeypatch):
    """Chained reshapes made Torch-Pruning's group search build 33 million indices for swin_t (24 GB, killed).
    A flatten's mapping beyond surgery's bound raises; the channels behind it stay with the reason and the
    rest is removed (here the bound is lowered so that a conv -> flatten -> Linear hits it)."""
    from edgebayes.compressed import surgery

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 16, 8), nn.ReLU(),
                        nn.Linear(8, 3)).eval()
    _zero_rows(net[0], [1, 4])
    _zero_rows(net[3], [2])
    dead = {"0": _keep(6, [1, 4]), "3": _keep(8, [2])}
    monkeypatch.setattr(surgery, "_MAX_MAPPED", 2 * 16 - 1)   # the two dead channels' 32 features
    report = {}
    pruned = remove_dead_units(net, dead, torch.zeros(1, 3, 6, 6), report=report)
    _assert_same_outputs(pruned, net, (3, 6, 6))
    assert report["0"]["removed"] == 0 and report["3"] == {"dead": 1, "removed": 1, "kept": {}}
    (why,) = report["0"]["kept"]
    assert "could not find the channels coupled to them" in why and "chained reshapes" in why
    monkeypatch.setattr(surgery, "_MAX_MAPPED", 2 * 16)
    assert remove_dead_units(net, dead, torch.zeros(1, 3, 6, 6))[0].out_channels == 4


class _ShuffleUnits(nn.Module):
    """Two of shufflenet v2's stride-1 units (half the channels through a 1x1 - depthwise 3x3 - 1x1 branch,
    concatenated with the other half, then a channel shuffle: view, transpose, view)."""

    def __init__(self, channels=16, units=2):
        super().__init__()
        half = channels // 2
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.branches = nn.ModuleList(nn.Sequential(
            nn.Conv2d(half, half, 1), nn.ReLU(), nn.Conv2d(half, half, 3, padding=1, groups=half),
            nn.Conv2d(half, half, 1), nn.ReLU()) for _ in range(units))
        self.fc = nn.Linear(channels, 4)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        for branch in self.branches:
            kept, through = x.chunk(2, dim=1)
            x = torch.cat([kept, branch(through)], 1)
            n, c, h, w = x.shape
            x = x.view(n, 2, c // 2, h, w).transpose(1, 2).contiguous().view(n, c, h, w)
        return self.fc(x.mean((2, 3)))


def _group_search(net, example, patched):
    """({root layer: [(dependency, idxs, root_idxs)]} of Torch-Pruning's group of every other output channel
    of each non-depthwise Conv2d, number of dependencies the searches added), with surgery's patches or not."""
    import torch_pruning as tp
    from torch_pruning.dependency.group import Group

    from edgebayes.compressed import surgery

    added, add_dep = [0], Group.add_dep

    def counting(group, dep, idxs):
        added[0] += 1
        return add_dep(group, dep, idxs)

    groups = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Group, "add_dep", counting)
        if not patched:   # Torch-Pruning's own search, the other two patches kept (shuffles need them)
            patch.setattr(surgery, "_covered_by_group", Group.has_pruning_op)
        with surgery._patched_torch_pruning({}), torch.enable_grad():
            graph = tp.DependencyGraph().build_dependency(net, example_inputs=example)
            for name, m in net.named_modules():
                if isinstance(m, nn.Conv2d) and m.groups == 1:
                    group = graph.get_pruning_group(m, graph.get_pruner_of_module(m).prune_out_channels,
                                                    list(range(0, m.out_channels, 2)))
                    groups[name] = [(str(item.dep), list(item.idxs), list(item.root_idxs)) for item in group]
    return groups, added[0]


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small", "efficientnet_b0"])
def test_the_group_search_follows_each_coupling_once_and_finds_torch_pruning_s_groups(name):
    """Surgery's group search (_patched_torch_pruning) stops where a visit brings no (index, root) pair the
    group does not hold. On torchvision classifiers (residual streams, squeeze-and-excitation, depthwise
    convolutions) every group is Torch-Pruning's own, pair for pair and in order."""
    import torchvision

    torch.manual_seed(0)
    net = getattr(torchvision.models, name)(weights=None, num_classes=10).eval()
    example = torch.zeros(1, 3, 32, 32)
    ours, _ = _group_search(net, example, patched=True)
    theirs, _ = _group_search(net, example, patched=False)
    assert ours == theirs and len(ours) > 10


def test_the_group_search_through_channel_shuffles_is_short_and_surgery_the_same():
    """Through channel shuffles Torch-Pruning's search reached the same dependencies again and again with new
    index lists (torchvision's shufflenet_v2_x0_5: 53 s for one group). Here every group holds the same
    channels of the same dependencies as Torch-Pruning's, the searches add a fraction of the dependencies,
    and surgery removes and keeps the same channels with the same reasons."""
    torch.manual_seed(0)
    net = _ShuffleUnits().eval()
    example = torch.zeros(1, 3, 8, 8)
    ours, ours_added = _group_search(net, example, patched=True)
    theirs, theirs_added = _group_search(net, example, patched=False)
    assert ours.keys() == theirs.keys()
    for layer in ours:
        assert {dep: set(idxs) for dep, idxs, _ in ours[layer]} == {dep: set(idxs) for dep, idxs, _ in theirs[layer]}
    print(f"dependencies added: {ours_added} against Torch-Pruning's {theirs_added}")
    assert ours_added * 4 < theirs_added

    from edgebayes.compressed import surgery
    from torch_pruning.dependency.group import Group

    dead = {}
    for name in ("stem", "branches.0.0", "branches.0.3", "branches.1.0", "branches.1.3"):
        layer = dict(net.named_modules())[name]
        _zero_rows(layer, [1, 2, 5])
        dead[name] = _keep(layer.out_channels, [1, 2, 5])
    reports = [{}, {}]
    ours = remove_dead_units(net, dead, example, report=reports[0])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(surgery, "_covered_by_group", Group.has_pruning_op)
        theirs = remove_dead_units(net, dead, example, report=reports[1])
    _assert_same_outputs(ours, net, (3, 8, 8))
    assert reports[0] == reports[1] and any(row["removed"] for row in reports[0].values())
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}


def test_surgeries_in_two_threads_take_turns_and_leave_torch_pruning_as_it_was():
    """The patches are the process's (_patched_torch_pruning): a second thread's surgery that entered while the
    first held them would take the first's patches for Torch-Pruning's originals and put them back for good.
    The second waits until the first is done, and afterwards Torch-Pruning is its own again."""
    import threading

    from torch_pruning.dependency import index_mapping
    from torch_pruning.dependency.group import Group

    from edgebayes.compressed import surgery

    own = (Group.has_pruning_op, index_mapping.update_reshape_index_mapping,
           index_mapping._FlattenIndexMapping.__call__)
    first_in, first_may_leave, order = threading.Event(), threading.Event(), []

    def first():
        with surgery._patched_torch_pruning({}):
            order.append("first in")
            first_in.set()
            first_may_leave.wait(10)
            order.append("first out")

    def second():
        with surgery._patched_torch_pruning({}):
            order.append("second in")

    one = threading.Thread(target=first)
    one.start()
    assert first_in.wait(10)
    two = threading.Thread(target=second)
    two.start()
    two.join(0.5)
    assert two.is_alive() and order == ["first in"]   # waiting, not inside the patch with the first
    first_may_leave.set()
    one.join(10)
    two.join(10)
    assert order == ["first in", "first out", "second in"]
    assert (Group.has_pruning_op, index_mapping.update_reshape_index_mapping,
            index_mapping._FlattenIndexMapping.__call__) == own

