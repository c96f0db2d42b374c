"""The packed MC layout (export/packed.py): one graph running all M posterior samples per layer equals the
unrolled MC average, in PyTorch and through ONNX."""

import copy
import operator

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _nets import samples_and_inputs
from edgebayes.config import ModelConfig, PriorConfig
from edgebayes.export.compress import MCAverage, compress
from edgebayes.export.onnx_export import export_onnx, onnx_predict
from edgebayes.export.packed import PackingError, mc_graph, pack_samples
from edgebayes.train.models import build_model


@pytest.mark.parametrize("net", ["mlp", "lenet", "rescat"])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_packed_equals_unrolled(net, m):
    samples, x = samples_and_inputs(net, m)
    packed = pack_samples(samples, x[:4])
    with torch.no_grad():
        gap = (packed(x) - MCAverage(samples).eval()(x)).abs().max().item()
    assert gap <= 1e-5
    # One operator call per layer: as many convolutions and matmuls as one sample has Conv2d and Linear layers.
    layers = sum(isinstance(mod, (nn.Conv2d, nn.Linear)) for mod in samples[0].modules())
    calls = [n for n in packed.net.graph.nodes if n.op == "call_function" and n.target in (F.conv2d, F.linear)]
    assert len(calls) == layers


def test_batch_norm_is_folded_into_the_convolution():
    samples, x = samples_and_inputs("rescat", 2)
    packed = pack_samples(samples, x[:4])
    assert not any(isinstance(mod, nn.BatchNorm2d) for mod in packed.modules())
    assert not any(n.target is operator.mul for n in packed.net.graph.nodes)  # no leftover affine maps


@pytest.mark.parametrize("net", ["mlp", "lenet", "rescat"])
def test_packed_onnx_equals_unrolled(net, tmp_path):
    samples, x = samples_and_inputs(net, 4)
    path = tmp_path / "packed.onnx"
    export_onnx(pack_samples(samples, x[:4]), x[:1], path)
    with torch.no_grad():
        ref = MCAverage(samples).eval()(x).numpy()
    assert np.abs(onnx_predict(path, x.numpy()) - ref).max() <= 1e-5


@pytest.mark.parametrize("family", ["ss-ig", "ss-gl", "ss-ghs", "dnn"])
def test_packed_compressed_posterior_samples(family):
    torch.manual_seed(0)
    model = build_model(ModelConfig(family=family, hidden=[16, 12]), PriorConfig(), (20,), 5, n_train=100)
    mc = compress(model, 0.5, 4, seed=0).mc_model()
    x = torch.randn(16, 20)
    with torch.no_grad():
        assert (mc_graph(mc, "packed", x)(x) - mc(x)).abs().max() <= 1e-5
    assert mc_graph(mc, "unrolled", x) is mc


def test_packed_layout_of_one_sample_is_the_plain_graph():
    """With M = 1 there is nothing to pack: export gets the plain network, not the reshaping packed graph."""
    mc = MCAverage([nn.Sequential(nn.Linear(20, 8), nn.ReLU(), nn.Linear(8, 5)).eval()])
    assert mc_graph(mc, "packed", torch.randn(4, 20)) is mc


def test_packed_zoo_lenet5_caffe_from_compress():
    """LeNet-5-Caffe of the zoo, spike-and-slab channels, through compress() as the pipeline does it."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(family="ss-gl", arch="lenet5-caffe"), PriorConfig(), (1, 28, 28), 10, n_train=100)
    mc = compress(model, model.default_knob, 3, seed=0).mc_model()
    x = torch.randn(8, 1, 28, 28)
    with torch.no_grad():
        assert (mc_graph(mc, "packed", x)(x) - mc(x)).abs().max() <= 1e-5


def _perturbed(module, seed):
    """A copy of a plain module with other weights and batch-norm statistics: another 'posterior sample'."""
    g = torch.Generator().manual_seed(seed)
    module = copy.deepcopy(module)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        for mod in module.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.copy_(torch.randn(mod.running_mean.shape, generator=g) * 0.1)
                mod.running_var.copy_(torch.rand(mod.running_var.shape, generator=g) + 0.5)
    return module.eval()


def test_packed_zoo_resnet20():
    """ResNet-20 of the zoo (batch norm, projection shortcuts, residual adds, global pooling) as plain modules."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(family="dnn", arch="resnet20"), PriorConfig(), (3, 32, 32), 10, n_train=100)
    plain, _ = model.posterior_sample(model.default_knob, torch.Generator().manual_seed(0))
    mc = MCAverage([_perturbed(plain, s) for s in range(3)]).eval()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        ref = mc(x)
        logits = mc.samples[0](x)
        assert (logits[0] - logits[1]).abs().max() > 1e-3  # the output depends on the input
        assert (mc_graph(mc, "packed", x)(x) - ref).abs().max() <= 1e-5


class FeatureHead(nn.Module):
    """Linears after a conv whose outputs meet a batch norm, a residual add, a concatenation and a flatten that
    also feeds a non-Linear: each place where the packed graph's [B, M*F, 1, 1] features must be handled."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc1, self.fc2, self.fc3 = nn.Linear(4 * 6 * 6, 12), nn.Linear(12, 12), nn.Linear(12, 5)
        self.norm = nn.BatchNorm1d(12)
        self.out = nn.Linear(5 + 144 + 12, 3)

    def forward(self, x):
        flat = torch.flatten(torch.relu(self.conv(x)), 1)
        h = torch.relu(self.fc1(flat))
        h = h + self.fc2(h) * 0.5          # residual between Linears, and a scalar operand
        n = self.norm(self.fc2(h))         # batch norm over features
        return self.out(torch.cat([self.fc3(h), flat.sigmoid(), n], 1))


def test_packed_linear_features_stay_feature_maps_and_convert_where_needed():
    samples = []
    for seed in range(3):
        torch.manual_seed(seed)
        net = FeatureHead()
        net.norm.running_mean.normal_()
        net.norm.running_var.uniform_(0.5, 1.5)
        samples.append(net.eval())
    mc, x = MCAverage(samples).eval(), torch.randn(6, 1, 8, 8)
    packed = mc_graph(mc, "packed", x)
    with torch.no_grad():
        assert (packed(x) - mc(x)).abs().max() <= 1e-5
    # Only the Linear of the first sample's chain after the flatten reads [B, M*F, 1, 1] without a reshape:
    # the flatten also feeds a sigmoid, so it stays a flatten.
    assert sum(n.target is torch.flatten for n in packed.net.graph.nodes) == 1


def test_packed_mlp_linears_run_as_grouped_convolutions_without_reshapes_between_them():
    samples, x = samples_and_inputs("mlp", 4)
    packed = mc_graph(MCAverage(samples).eval(), "packed", x)
    reshapes = [n for n in packed.net.graph.nodes if n.op == "call_method" and n.target == "reshape"]
    # one into the first grouped convolution, one to [B, M, classes] at the output
    assert len(reshapes) == 2


def test_unsupported_operation_is_refused_by_name():
    class Sorts(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 3)

        def forward(self, x):
            return self.fc(torch.sort(x, dim=1).values)

    with pytest.raises(PackingError, match="sort"):
        pack_samples([Sorts().eval(), Sorts().eval()], torch.randn(4, 8))

    rnn = nn.Sequential(nn.Linear(8, 8), nn.PReLU(), nn.Linear(8, 3)).eval()
    with pytest.raises(PackingError, match="PReLU"):
        pack_samples([rnn, rnn], torch.randn(4, 8))


def test_samples_of_different_widths_are_refused():
    a = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3)).eval()
    b = nn.Sequential(nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 3)).eval()
    with pytest.raises(PackingError, match="sample 1 has another architecture"):
        pack_samples([a, b], torch.randn(4, 8))


def test_unknown_layout_is_refused():
    samples, x = samples_and_inputs("mlp", 2)
    with pytest.raises(ValueError, match="layout"):
        mc_graph(MCAverage(samples), "diagonal", x)
