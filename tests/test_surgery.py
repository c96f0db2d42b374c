"""Structural surgery (export/surgery.py), posterior samples (train/models.py) and compress (export/compress.py)."""

import pytest
import torch
from torch import nn

from edgebayes.config import ModelConfig, PriorConfig
from edgebayes.export.compress import MCAverage, compress, sample_generator
from edgebayes.export.surgery import SurgeryError, remove_dead_units
from edgebayes.train.metrics import count_weights, paper_flops
from edgebayes.train.models import build_model

IN, HIDDEN, CLASSES = 20, [16, 12], 5
INPUT_SHAPE = (4, 5)  # flattened to IN by the model's Flatten
FAMILIES = ["ss-ig", "ss-gl", "dnn"]


def _model(family, seed=0):
    torch.manual_seed(seed)
    return build_model(ModelConfig(family=family, hidden=list(HIDDEN)), PriorConfig(), IN, CLASSES, n_train=1000)


def _dead_sets(seed=1):
    """Half of each hidden layer's units, chosen at random (fixed seed)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randperm(h, generator=g)[: h // 2] for h in HIDDEN]


def _kill(model, dead_sets):
    with torch.no_grad():
        for layer, dead in zip(model.layers[:-1], dead_sets):
            layer.gamma_logit[dead] = -10.0


def _linears(module):
    return [m for m in module if isinstance(m, nn.Linear)]


def _inputs(n=64, seed=2):
    return torch.randn((n,) + INPUT_SHAPE, generator=torch.Generator().manual_seed(seed))


def _dense_sample_with_dead_units(family):
    """A dense posterior sample (dead rows zeroed) and its kept-unit masks, half of each hidden layer dead."""
    model, dead_sets = _model(family), _dead_sets()
    if family != "dnn":
        _kill(model, dead_sets)
        dense, keep = model.posterior_sample(0.5, torch.Generator().manual_seed(3))
        return dense, keep, dead_sets
    # The deterministic net has no inclusion probabilities: zero the rows by hand and describe them.
    dense, keep = model.posterior_sample(0.5, torch.Generator().manual_seed(3))
    names = [name for name, m in dense.named_children() if isinstance(m, nn.Linear)]
    with torch.no_grad():
        for name, dead in zip(names[:-1], dead_sets):
            lin = getattr(dense, name)
            lin.weight[dead] = 0
            lin.bias[dead] = 0
            keep[name] = keep[name].clone()
            keep[name][dead] = False
    return dense, keep, dead_sets


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_surgery_preserves_outputs_shapes_weights_and_flops(family):
    """Removing dead units: same outputs (1e-5), Linear shapes = kept counts, count_weights and
    paper_flops = sum over layers of (kept_in + 1) * kept_out (appendix A.1), input module untouched."""
    dense, keep, dead_sets = _dense_sample_with_dead_units(family)
    names = [name for name, m in dense.named_children() if isinstance(m, nn.Linear)]
    kept_counts = [int(keep[n].sum()) for n in names]
    assert kept_counts == [h - h // 2 for h in HIDDEN] + [CLASSES]
    # dead rows of the dense sample are exactly zero, kept ones are not
    for name, dead in zip(names[:-1], dead_sets):
        lin = getattr(dense, name)
        assert torch.all(lin.weight[dead] == 0) and torch.all(lin.bias[dead] == 0)
        assert torch.all(lin.weight[keep[name]].abs().sum(1) > 0)

    pruned = remove_dead_units(dense, keep)
    x = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(pruned(x), dense(x), rtol=0, atol=1e-5)

    shapes = [(m.in_features, m.out_features) for m in _linears(pruned)]
    expected_in = [IN] + kept_counts[:-1]
    assert shapes == list(zip(expected_in, kept_counts))
    by_hand = sum((i + 1) * o for i, o in zip(expected_in, kept_counts))
    assert count_weights(pruned) == by_hand
    assert paper_flops(pruned, INPUT_SHAPE) == by_hand
    dense_widths = [IN] + HIDDEN + [CLASSES]
    assert paper_flops(dense, INPUT_SHAPE) == sum((i + 1) * o for i, o in zip(dense_widths[:-1], dense_widths[1:]))
    # surgery works on a copy
    assert [(m.in_features, m.out_features) for m in _linears(dense)] == list(zip(dense_widths[:-1], dense_widths[1:]))
    assert not pruned.training


def test_surgery_is_a_noop_when_nothing_is_dead():
    """With every unit kept the pruned module has the dense shapes and the same parameters."""
    model = _model("ss-gl")
    dense, keep = model.posterior_sample(0.5, torch.Generator().manual_seed(0))
    assert all(bool(m.all()) for m in keep.values())  # gamma_init 0.99 keeps everything
    pruned = remove_dead_units(dense, keep)
    for a, b in zip(_linears(dense), _linears(pruned)):
        assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)


# ---------------------------------------------------------------------------------------------
def _spread_gammas(model):
    """Inclusion probabilities spread over (0, 1) so that thresholds 0.5 and 0.7 keep different units."""
    with torch.no_grad():
        for layer in model.layers[:-1]:
            n = layer.out_features
            layer.gamma_logit.copy_(torch.linspace(-3, 3, n)[torch.randperm(n, generator=torch.Generator().manual_seed(n))])


@pytest.mark.parametrize("family", ["ss-ig", "ss-gl"])
def test_eval_forward_is_the_materialized_posterior_sample(family):
    """Eval forward with set_inclusion_threshold(t) and torch.manual_seed(s) equals the dense sample
    posterior_sample(t, Generator(s)): same weights drawn in the same order, same kept units."""
    model = _model(family)
    _spread_gammas(model)
    x = _inputs()
    model.eval()
    model.set_inclusion_threshold(0.7)
    torch.manual_seed(123)
    with torch.no_grad():
        out = model(x)
    dense, keep = model.posterior_sample(0.7, torch.Generator().manual_seed(123))
    with torch.no_grad():
        torch.testing.assert_close(out, dense(x), rtol=1e-6, atol=1e-6)
    for mask, layer in zip(keep.values(), model.layers):
        assert torch.equal(mask, layer.kept_units(0.7))
    assert [int(m.sum()) for m in keep.values()][:2] != HIDDEN  # the threshold really drops units

    # the knob matters: at 0.5 more units are kept and the output changes
    model.set_inclusion_threshold(0.5)
    torch.manual_seed(123)
    with torch.no_grad():
        assert not torch.allclose(model(x), out, atol=1e-4)


@pytest.mark.parametrize("family", ["ss-ig", "ss-gl"])
def test_eval_forward_ignores_weights_of_units_below_threshold(family):
    """Units whose gamma is below the threshold contribute nothing in eval mode: perturbing their
    weights (means and scales) leaves the output unchanged; perturbing a kept unit changes it."""
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
    first = model.layers[0]
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
    """In train mode (relaxed Bernoulli, hard forward) units with gamma ~ 0 output exactly 0 and units
    with gamma ~ 1 do not."""
    model = _model("ss-gl")
    dead_sets = _dead_sets()
    _kill(model, dead_sets)
    with torch.no_grad():
        for layer, dead in zip(model.layers[:-1], dead_sets):
            alive = torch.ones(layer.out_features, dtype=torch.bool)
            alive[dead] = False
            layer.gamma_logit[alive] = 10.0
    model.train()
    outputs = []
    hooks = [layer.register_forward_hook(lambda m, i, o: outputs.append(o)) for layer in model.layers[:-1]]
    torch.manual_seed(0)
    model(_inputs())
    for h in hooks:
        h.remove()
    for out, dead in zip(outputs, dead_sets):
        alive = torch.ones(out.shape[1], dtype=torch.bool)
        alive[dead] = False
        assert torch.all(out[:, dead] == 0)
        assert torch.all(out[:, alive].abs().sum(0) > 0)


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["ss-gl", "dnn"])
def test_compress_samples_are_pruned_plain_modules_and_prefix_stable(family):
    """compress(): every sample is a pruned plain nn.Sequential (Flatten/Linear/activation only, kept
    widths); the M=3 samples are the first 3 of the M=5 ones for the same seed; MCAverage rows sum to 1
    and equal the mean of the samples' softmax outputs."""
    model = _model(family)
    if family != "dnn":
        _kill(model, _dead_sets())
    c3 = compress(model, 0.5, 3, seed=4)
    c5 = compress(model, 0.5, 5, seed=4)
    assert len(c3.samples) == 3 and len(c5.samples) == 5
    kept_counts = [int(m.sum()) for m in c5.kept.values()]
    expect = ([h - h // 2 for h in HIDDEN] if family != "dnn" else HIDDEN) + [CLASSES]
    assert kept_counts == expect
    for s in c5.samples:
        assert isinstance(s, nn.Sequential)
        assert all(type(m) in (nn.Flatten, nn.Linear, nn.SiLU) for m in s)
        assert [m.out_features for m in _linears(s)] == kept_counts
        assert sum(p.numel() for p in s.parameters()) == count_weights(s)  # no variational leftovers
    for a, b in zip(c3.samples, c5.samples[:3]):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)

    x = _inputs()
    with torch.no_grad():
        p = c5.mc_model()(x)
        assert p.shape == (len(x), CLASSES) and torch.all(p >= 0)
        torch.testing.assert_close(p.sum(-1), torch.ones(len(x)), rtol=0, atol=1e-6)
        manual = torch.stack([torch.softmax(s(x), -1) for s in c5.samples]).mean(0)
        torch.testing.assert_close(p, manual, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(c5.mc_model(3)(x), c3.mc_model()(x), rtol=0, atol=0)
        assert isinstance(c5.mc_model(2), MCAverage) and len(c5.mc_model(2).samples) == 2

    # the first dense sample is the first draw of the seeded generator
    dense0, _ = model.posterior_sample(0.5, sample_generator(4))
    for a, b in zip(_linears(dense0), _linears(c5.dense_sample)):
        assert torch.equal(a.weight, b.weight)
    if family != "dnn":
        # Bayesian samples differ from each other and across seeds
        w = [_linears(s)[0].weight for s in c5.samples]
        assert not torch.equal(w[0], w[1])
        assert not torch.equal(_linears(compress(model, 0.5, 1, seed=5).samples[0])[0].weight, w[0])


# ---------------------------------------------------------------------------------------------
def test_surgery_refuses_activation_with_nonzero_at_zero():
    """A Sigmoid (f(0) = 0.5) between two Linears is refused: removing a unit would change the outputs."""
    module = nn.Sequential(nn.Linear(4, 3), nn.Sigmoid(), nn.Linear(3, 2))
    with pytest.raises(SurgeryError, match="Sigmoid"):
        remove_dead_units(module, {"0": torch.tensor([True, False, True])})


def test_surgery_refuses_to_remove_output_units():
    """The last Linear produces the model's outputs: a mask with a False there raises; all-True is fine."""
    module = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    with pytest.raises(SurgeryError, match="last Linear"):
        remove_dead_units(module, {"2": torch.tensor([True, False])})
    pruned = remove_dead_units(module, {"2": torch.tensor([True, True]), "0": torch.tensor([True, False, True])})
    assert [(m.in_features, m.out_features) for m in _linears(pruned)] == [(4, 2), (2, 2)]


def test_surgery_refuses_unsupported_layer_and_names_it():
    """A Conv2d in the chain raises SurgeryError naming the layer (its index and type)."""
    module = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Conv2d(1, 1, 1), nn.Linear(4, 2))
    with pytest.raises(SurgeryError, match=r"'2'.*Conv2d"):
        remove_dead_units(module, {"0": torch.tensor([True, False, True, True])})


def test_surgery_refuses_bad_inputs():
    """Masks naming a non-Linear layer and non-Sequential modules are refused."""
    module = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    with pytest.raises(SurgeryError, match="not Linear"):
        remove_dead_units(module, {"1": torch.tensor([True, False, True])})
    with pytest.raises(SurgeryError, match="Sequential"):
        remove_dead_units(nn.Linear(3, 2), {})


def test_surgery_accepts_any_parameter_free_activation_with_zero_at_zero():
    """GELU (f(0) = 0) is not in a fixed list but is elementwise with f(0) = 0: units can go."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 3), nn.GELU(), nn.Linear(3, 2)).eval()
    with torch.no_grad():
        module[0].weight[1] = 0
        module[0].bias[1] = 0
    keep = {"0": torch.tensor([True, False, True])}
    pruned = remove_dead_units(module, keep)
    x = torch.randn(5, 4)
    assert pruned[0].out_features == 2
    assert torch.allclose(pruned(x), module(x), atol=1e-6)


def test_surgery_names_the_nonzero_activation():
    module = nn.Sequential(nn.Linear(4, 3), nn.Sigmoid(), nn.Linear(3, 2))
    with pytest.raises(SurgeryError, match="f\\(0\\) != 0"):
        remove_dead_units(module, {"0": torch.tensor([True, False, True])})
