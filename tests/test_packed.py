"""The packed MC layout (export/packed.py): one graph running all M posterior samples per layer equals the
unrolled MC average, in PyTorch and through ONNX."""

import collections
import copy
import operator

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _nets import IDIOMS, idiom_samples, samples_and_inputs, torchvision_samples, transformer_samples
from edgebayes.config import ModelConfig, PriorConfig
from edgebayes.compressed.samples import MCAverage, compress, fp32_agreement, predict_float64
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


def test_the_mc_average_of_one_sample_is_the_sample_and_a_softmax(tmp_path):
    """No division by 1: each operator is one more call per inference on the device (onnxruntime runs it)."""
    sample = nn.Sequential(nn.Linear(20, 8), nn.ReLU(), nn.Linear(8, 5)).eval()
    x = torch.randn(4, 20)
    export_onnx(MCAverage([sample]).eval(), x[:1], tmp_path / "m1.onnx")
    assert [n.op_type for n in onnx.load(str(tmp_path / "m1.onnx")).graph.node] == ["Gemm", "Relu", "Gemm", "Softmax"]
    two = MCAverage([sample, copy.deepcopy(sample)]).eval()
    with torch.no_grad():   # two equal samples average to one
        assert torch.allclose(two(x), torch.softmax(sample(x), -1)) and torch.allclose(MCAverage([sample])(x), two(x))


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


def _seeded_samples(make, count):
    """`count` fresh modules from `make`, seed 0, 1, ...: each with its own weights and batch-norm statistics
    (the "posterior samples" of a test)."""
    samples = []
    for seed in range(count):
        torch.manual_seed(seed)
        net = make()
        for norm in net.modules():
            if isinstance(norm, nn.modules.batchnorm._BatchNorm):
                norm.running_mean.normal_()
                norm.running_var.uniform_(0.5, 1.5)
        samples.append(net.eval())
    return samples


def test_packed_linear_features_stay_feature_maps_and_convert_where_needed():
    samples = _seeded_samples(FeatureHead, 3)
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
    """An operation with weights the packer has no rule for, or one mixing the examples of the batch, is
    refused by name. (torch.sort over the features, refused before, acts on each example alone: it runs
    on the samples folded into the batch, equal to the unrolled average.)"""
    class Sorts(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 3)

        def forward(self, x):
            return self.fc(torch.sort(x, dim=1).values)

    x = torch.randn(4, 8)
    assert pack_samples([Sorts().eval(), Sorts().eval()], x)(x).shape == (4, 3)   # equal to unrolled: checked

    class BatchMean(Sorts):
        def forward(self, x):
            return self.fc(x) - self.fc(x).mean(0)

    with pytest.raises(PackingError, match="mean over the batch"):
        pack_samples([BatchMean().eval(), BatchMean().eval()], x)

    # A module the packer has no rule for runs per example where its weights are the same in every sample (the
    # deterministic parts of a posterior sample); where they differ it is refused by name.
    same = [nn.Sequential(nn.Linear(8, 8), nn.PReLU(), nn.Linear(8, 3)).eval() for _ in range(2)]
    assert pack_samples(same, x)(x).shape == (4, 3)   # equal to unrolled: checked
    with pytest.raises(PackingError, match="module PReLU whose weights differ between the posterior samples"):
        pack_samples(_prelus_that_differ(), x)


def _prelus_that_differ():
    torch.manual_seed(0)
    samples = [nn.Sequential(nn.Linear(8, 8), nn.PReLU(), nn.Linear(8, 3)).eval() for _ in range(2)]
    with torch.no_grad():
        samples[1][1].weight.fill_(0.5)
    return samples


def test_samples_of_different_widths_are_refused():
    a = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3)).eval()
    b = nn.Sequential(nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 3)).eval()
    with pytest.raises(PackingError, match="sample 1 has another architecture"):
        pack_samples([a, b], torch.randn(4, 8))


def test_unknown_layout_is_refused():
    samples, x = samples_and_inputs("mlp", 2)
    with pytest.raises(ValueError, match="layout"):
        mc_graph(MCAverage(samples), "diagonal", x)


def _onnx_ops(path):
    return collections.Counter(node.op_type for node in onnx.load(str(path)).graph.node)


def _onnx_gap(packed, x, path):
    """Largest |p_onnx - p_torch| of the packed graph exported to `path`."""
    export_onnx(packed, x[:1], path)
    with torch.no_grad():
        ref = packed(x).numpy()
    return float(np.abs(onnx_predict(path, x.numpy()) - ref).max())


def test_batch_norm_is_folded_despite_a_shared_parameter_free_module(tmp_path):
    """The zoo's ResNet-20 calls one self.act everywhere: that module has nothing to fold into, so all 21 batch
    norms still fold into their convolutions, and the ONNX graph has no Mul/Add pair left for them."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(family="dnn", arch="resnet20"), PriorConfig(), (3, 32, 32), 10, n_train=100)
    plain, _ = model.posterior_sample(model.default_knob, torch.Generator().manual_seed(0))
    calls = collections.Counter(n.target for n in torch.fx.symbolic_trace(plain).graph.nodes if n.op == "call_module")
    assert max(calls.values()) > 1  # the shared activation this test is about
    samples = [_perturbed(plain, s) for s in range(4)]
    x = torch.randn(4, 3, 32, 32)
    packed = pack_samples(samples, x)
    assert len(packed.folded_batch_norms) == 21 and packed.unfolded_batch_norms == []
    assert not any(n.target is F.batch_norm or n.target is operator.mul for n in packed.net.graph.nodes)
    assert _onnx_gap(packed, x, tmp_path / "packed.onnx") <= 1e-4
    # one plain sample exported by torch.onnx (which folds eval batch norms itself) has as many Mul and Add
    # (its SiLUs and residual additions) as the packed graph of four
    export_onnx(plain.eval(), x[:1], tmp_path / "plain.onnx")
    packed_ops, plain_ops = _onnx_ops(tmp_path / "packed.onnx"), _onnx_ops(tmp_path / "plain.onnx")
    assert packed_ops["BatchNormalization"] == 0
    assert (packed_ops["Mul"], packed_ops["Add"]) == (plain_ops["Mul"], plain_ops["Add"])


def test_batch_norm_after_a_layer_called_twice_stays_and_says_why():
    """A Conv2d called twice (shared weights) cannot take the batch norm of one call: it stays, as one
    batch-norm call (BatchNormalization in ONNX) over the M*C channels, listed with the reason."""
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.fc = nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3), nn.Linear(3, 4)

        def forward(self, x):
            return self.fc(self.conv(self.bn(self.conv(x))).mean((2, 3)))

    packed = pack_samples(_seeded_samples(Shared, 2), torch.randn(4, 3, 6, 6))
    assert packed.folded_batch_norms == []
    assert packed.unfolded_batch_norms == [{"node": "bn", "reason": "conv is called 2 times (shared weights)"}]
    assert sum(n.target is F.batch_norm for n in packed.net.graph.nodes) == 1


@pytest.mark.parametrize("idiom", sorted(IDIOMS) + ["attention"])
def test_packed_accepts_the_idioms_users_write(idiom, tmp_path):
    """x.view(x.size(0), -1), x.mean((2, 3)), torch.amax, squeeze-and-excitation, ...: packed, equal to the
    unrolled average (pack_samples checks it) and through ONNX; every batch norm after a layer is folded."""
    samples, x = idiom_samples(idiom, 3)
    packed = pack_samples(samples, x)
    assert packed.unfolded_batch_norms == []
    with torch.no_grad():
        assert (packed(x) - MCAverage(samples).eval()(x)).abs().max() <= 1e-5
    assert _onnx_gap(packed, x, tmp_path / "packed.onnx") <= 1e-5
    assert _onnx_ops(tmp_path / "packed.onnx")["BatchNormalization"] == 0


@pytest.mark.parametrize("idiom", ["view-size", "mean", "adaptive-pool-1", "squeeze"])
def test_idioms_feeding_a_linear_need_no_reshape_before_it(idiom):
    """Pooled or flattened features reach the Linear's grouped convolution as [B, M*F, 1, 1] directly: only the
    flatten of a feature map reshapes, and only the output's [B, M, classes] after it."""
    samples, x = idiom_samples(idiom, 2)
    packed = pack_samples(samples, x)
    reshapes = [n for n in packed.net.graph.nodes if n.op == "call_method" and n.target == "reshape"]
    assert len(reshapes) == (2 if idiom == "view-size" else 1)


def test_channel_broadcasts_view_the_samples_apart():
    """[B, C, 1, 1] * [B, C, H, W] broadcasts as it is in the packed layout; [B, 1, H, W] with [B, C, H, W]
    would pair the M attention maps with the M*C channels, so it runs on [B, M, C, H, W] views."""
    samples, x = idiom_samples("attention", 2)
    graph = pack_samples(samples, x).net.graph
    five_d = {n for n in graph.nodes if n.op == "call_method" and n.target == "reshape" and len(n.args) == 6}
    binary_on_views = [n for n in graph.nodes if n.target in (operator.mul, operator.add)
                       and any(a in five_d for a in n.args)]
    assert len(binary_on_views) == 2  # h * a and (h * a) + a
    assert sum(n.target is operator.mul for n in graph.nodes) == 3  # the two excitations and h * a


SIZES = [lambda self, x: self.fc(x.view(x.size(0), x.size(1) * 16)),
         lambda self, x: self.fc(x.reshape(x.shape[0], -1)) * x.shape[1],
         lambda self, x: self.fc(x.mean(1).flatten(1).repeat(1, 2))]


class _Sizes(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2 * 16, 3)


@pytest.mark.parametrize("forward", SIZES)
def test_sizes_and_reductions_of_one_example_are_packed(forward):
    """A size other than the batch's used in arithmetic, a mean over the channels: per example, so they run
    on the samples folded into the batch (pack_samples checks the result against the unrolled average)."""
    _Sizes.forward = forward
    x = torch.randn(4, 2, 4, 4)
    torch.manual_seed(0)
    samples = [_Sizes().eval(), _Sizes().eval()]
    assert pack_samples(samples, x)(x).shape == (4, 3)


def test_the_batch_size_used_outside_a_reshape_is_refused_by_name():
    _Sizes.forward = lambda self, x: self.fc(torch.flatten(x, 1)) / x.size(0)
    with pytest.raises(PackingError, match=r"size = x\.size\(0\)"):
        pack_samples([_Sizes().eval(), _Sizes().eval()], torch.randn(4, 2, 4, 4))


@pytest.mark.parametrize("forward, features, what", [
    (lambda self, x: self.fc(x.view(1, -1)), 32, "first dimension is not the batch size"),
    (lambda self, x: self.fc(x.view(-1, 16)), 16, "does not keep the batch dimension"),
    (lambda self, x: self.fc(x.mean(0).flatten().expand(x.size(0), -1)), 32, "mean over the batch"),
])
def test_reshapes_and_reductions_across_samples_are_refused(forward, features, what):
    """Reshapes that fold the batch into the features and reductions over the batch mix the examples."""
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(features, 3)

    Bad.forward = forward
    with pytest.raises(PackingError, match=what):
        pack_samples([Bad().eval(), Bad().eval()], torch.randn(4, 2, 4, 4))


# Batch norms of each torchvision model at 32x32 that cannot be folded (densenet's pre-activation batch norms
# after a concatenation), and its Mul / Add nodes (squeeze-and-excitation, SiLU, residual additions).
TORCHVISION = ["resnet18", "mobilenet_v3_small", "densenet121", "efficientnet_b0"]


@pytest.mark.parametrize("name", TORCHVISION)
def test_packed_torchvision_models_in_onnx(name, tmp_path):
    """Real models at M = 2: packed equals unrolled (pack_samples checks 1e-5) and ONNX equals PyTorch
    within 1e-4; every batch norm after a convolution is folded, so the packed graph has exactly the
    BatchNormalization, Mul and Add nodes that one plain sample has in torch.onnx's export (which folds
    eval batch norms after convolutions itself)."""
    pytest.importorskip("torchvision")
    samples, x = torchvision_samples(name, 2)
    packed = pack_samples(samples, x)
    with torch.no_grad():
        probs = packed(x)
    assert float(probs.max()) > 0.3  # not a flat softmax
    assert _onnx_gap(packed, x, tmp_path / "packed.onnx") <= 1e-4
    export_onnx(samples[0], x[:1], tmp_path / "plain.onnx")
    packed_ops, plain_ops = _onnx_ops(tmp_path / "packed.onnx"), _onnx_ops(tmp_path / "plain.onnx")
    for op in ("BatchNormalization", "Mul", "Add"):
        assert packed_ops[op] == plain_ops[op], op
    assert packed_ops["BatchNormalization"] == len(packed.unfolded_batch_norms)
    if name == "densenet121":  # the 58 + 3 + 1 batch norms after a concatenation or pooling
        assert len(packed.unfolded_batch_norms) == 62 and len(packed.folded_batch_norms) == 59
        assert all(entry["reason"].startswith("follows ") for entry in packed.unfolded_batch_norms)
    else:
        assert packed.unfolded_batch_norms == []


@pytest.mark.parametrize("name", ["vit", "swin", "convnext"])
def test_packed_transformers_in_onnx(name, tmp_path):
    """Posterior samples of bayesianized transformers pack (they were exported unrolled): their deterministic
    parts (LayerNorm, attention, class token, layer scale, read as modules or tensor attributes) run on the
    samples folded into the batch, each Bayesian Linear on tokens is one batched matmul over the M samples'
    weights, not M calls. Packed equals unrolled (pack_samples checks 1e-5) and ONNX equals PyTorch."""
    pytest.importorskip("torchvision")
    samples, x = transformer_samples(name, 3)
    packed = pack_samples(samples, x)
    traced = torch.fx.symbolic_trace(samples[0])   # the layers called as modules (attention's read their weights)
    layers = [n for n in traced.graph.nodes
              if n.op == "call_module" and isinstance(traced.get_submodule(n.target), (nn.Linear, nn.Conv2d))]
    nodes = list(packed.net.graph.nodes)
    assert not any(n.op == "call_module" and isinstance(packed.net.get_submodule(n.target), nn.Linear) for n in nodes)
    weighted = [n for n in nodes if n.op == "call_function" and n.target in (torch.matmul, F.linear, F.conv2d)]
    assert len(weighted) == len(layers)   # one call per layer for all M samples
    assert _onnx_gap(packed, x, tmp_path / "packed.onnx") <= 1e-4


def test_a_tensor_attribute_that_differs_between_samples_is_refused_by_name():
    class Scaled(nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.fc, self.scale = nn.Linear(8, 3), nn.Parameter(torch.full((3,), scale))

        def forward(self, x):
            return self.fc(x) * self.scale

    x = torch.randn(4, 8)
    same = [Scaled(2.0).eval(), Scaled(2.0).eval()]
    with torch.no_grad():
        assert (pack_samples(same, x)(x) - MCAverage(same).eval()(x)).abs().max() <= 1e-6
    with pytest.raises(PackingError, match="tensor attribute scale read directly, which differs between"):
        pack_samples([Scaled(2.0).eval(), Scaled(3.0).eval()], x)


def test_linear_on_the_shared_sequence_input_is_one_batched_matmul(tmp_path):
    """A network whose input is a sequence [B, T, F] (a user's sensor windows): the first Linear reads the shared
    input once for all M samples; later ones read each sample's own rows."""
    class Sequence(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.norm, self.mix, self.head = nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x):
            h = self.mix(torch.relu(self.norm(self.embed(x))))
            return self.head(h.mean(1))

    torch.manual_seed(0)
    base = Sequence()
    samples = []
    for i in range(3):
        sample = copy.deepcopy(base)
        with torch.no_grad():
            for layer in (sample.embed, sample.mix, sample.head):
                layer.weight.add_(torch.randn(layer.weight.shape) * 0.3)
        samples.append(sample.eval())
    x = torch.randn(5, 7, 6)
    packed = pack_samples(samples, x)
    assert sum(n.target is torch.matmul for n in packed.net.graph.nodes) == 2
    assert _onnx_gap(packed, x, tmp_path / "packed.onnx") <= 1e-4


def test_a_network_the_packed_layout_refuses_is_exported_unrolled_and_says_why(tmp_path):
    """export_artifact in the packed layout (the default) on a network the packer refuses (a PReLU: a
    module with weights it has no rule for, different in each sample) writes the unrolled graph instead of failing, and its details
    say why and what the unrolled layout costs; the artifact computes the MC average."""
    from edgebayes.export.formats import artifact_predict, export_artifact

    mc, x = MCAverage(_prelus_that_differ()).eval(), torch.randn(16, 8)
    details = {}
    path = export_artifact(mc, "onnx", tmp_path / "m.onnx", x, layout="packed", details=details)
    assert details["layout"] == "unrolled"
    assert "PReLU" in details["packed_refused"] and "runs each layer M times" in details["packed_refused"]
    with torch.no_grad():
        assert np.abs(artifact_predict(path, "onnx", x.numpy()) - mc(x).numpy()).max() <= 1e-5
    with pytest.raises(PackingError, match="PReLU"):
        mc_graph(mc, "packed", x)   # without a fallback the refusal stands
    # eb.save says so too (it wrote the unrolled file without a word, probe)
    import edgebayes as eb
    from edgebayes.compressed.samples import Compressed

    samples = list(mc.samples)
    compressed = Compressed(knob=0.5, samples=samples, dense_sample=samples[0], kept={})
    with pytest.warns(UserWarning, match=r"save: m2.onnx: .*PReLU.*Exported unrolled instead"):
        eb.save(compressed, tmp_path / "m2.onnx", example=x)


class _RealCode(nn.Module):
    """The idioms the packed layout refused (PackingError at select, after training): squeeze-and-excitation
    by x[:, :, None, None], expand_as, torch.max / torch.min with dim (CBAM's channel pooling), chunk and
    split over channels, a channel slice, a channel shuffle (view-transpose-view), and a Linear fed by
    torch.max's values."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.se1, self.se2 = nn.Linear(8, 4), nn.Linear(4, 8)
        self.spatial = nn.Conv2d(2, 1, 3, padding=1)
        self.left, self.right = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.fc = nn.Linear(8 + 3, 5)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        s = torch.sigmoid(self.se2(torch.relu(self.se1(h.mean((2, 3))))))
        h = h * s[:, :, None, None].expand_as(h)
        pooled = torch.cat([torch.max(h, dim=1, keepdim=True)[0], torch.min(h, 1, keepdim=True).values], 1)
        h = h * torch.sigmoid(self.spatial(pooled))
        a, b = h.chunk(2, dim=1)
        h = torch.cat([self.left(a), self.right(torch.split(h, [4, 4], dim=1)[1] + b)], 1)
        n, c, height, width = h.size()
        h = h.view(n, 2, c // 2, height, width).transpose(1, 2).contiguous().view(n, c, height, width)
        top = torch.max(h[:, :3], dim=1).values.amax((1, 2))[:, None].expand(-1, 3)
        return self.fc(torch.cat([h.mean((2, 3)), top * h[:, 5:].mean((1, 2, 3))[:, None]], 1))


def test_the_packed_layout_takes_real_code_idioms(tmp_path):
    """Every idiom of _RealCode packs (no fallback to unrolled), equal to the unrolled average (pack_samples
    checks 1e-5), and through ONNX; operations with no rule of their own run with the samples folded into
    the batch."""
    samples = [_random_batch_norms_seeded(_RealCode, i) for i in range(3)]
    x = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    packed = pack_samples(samples, x)
    with torch.no_grad():
        assert (packed(x) - MCAverage(samples).eval()(x)).abs().max() <= 1e-5
    assert _onnx_gap(packed, x, tmp_path / "packed.onnx") <= 1e-5
    from edgebayes.export.formats import export_artifact

    details = {}
    export_artifact(MCAverage(samples).eval(), "onnx", tmp_path / "m.onnx", x, layout="packed", details=details)
    assert details["layout"] == "packed" and "packed_refused" not in details


def _random_batch_norms_seeded(cls, i):
    torch.manual_seed(i)
    net = cls().eval()
    with torch.no_grad():
        for mod in net.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.uniform_(-0.3, 0.3)
                mod.running_var.uniform_(0.5, 1.5)
    return net


@pytest.mark.parametrize("size, out", [(1, 7), (5, 3), (3, (2, None))])
def test_an_adaptive_pool_onnx_cannot_take_is_exported_as_its_averages(size, out, tmp_path):
    """alexnet's and vgg's 7x7 adaptive pool after a 1x1 map (32 px inputs) made torch.onnx fail ('output
    size that are not factor of input size'); the pool is exported as the same averages (two matrix
    products), equal to PyTorch, in both layouts."""
    from edgebayes.export.formats import artifact_predict, export_artifact

    class Pooled(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.pool = nn.Conv2d(3, 4, 1), nn.AdaptiveAvgPool2d(out)
            self.fc = nn.LazyLinear(5)

        def forward(self, x):
            return self.fc(torch.flatten(self.pool(torch.relu(self.conv(x))), 1))

    x = torch.randn(8, 3, size, size, generator=torch.Generator().manual_seed(0))
    samples = []
    for i in range(2):
        torch.manual_seed(i)
        net = Pooled()
        net(x)   # materialise the lazy Linear
        samples.append(net.eval())
    mc = MCAverage(samples).eval()
    for layout in ("packed", "unrolled"):
        path = export_artifact(mc, "onnx", tmp_path / f"{layout}.onnx", x, layout=layout)
        with torch.no_grad():
            assert np.abs(artifact_predict(path, "onnx", x.numpy()) - mc(x).numpy()).max() <= 1e-5


def test_multihead_attention_exports_to_onnx(tmp_path):
    """nn.MultiheadAttention in eval runs a fused fast-path operator that torch.onnx cannot convert
    (vit_b_16 failed so); export turns the fast path off, and the packed layout, which has no rule for the
    attention's weights, falls back to unrolled."""
    from edgebayes.export.formats import artifact_predict, export_artifact

    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.patch = nn.Conv2d(3, 8, 2, stride=2)
            self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            t = self.patch(x).flatten(2).transpose(1, 2)
            return self.fc(self.attention(t, t, t, need_weights=False)[0].mean(1))

    samples = []
    for i in range(2):
        torch.manual_seed(i)
        samples.append(Tokens().eval())
    mc, x = MCAverage(samples).eval(), torch.randn(8, 3, 4, 4)
    details = {}
    path = export_artifact(mc, "onnx", tmp_path / "m.onnx", x, layout="packed", details=details)
    assert details["layout"] == "unrolled"
    with torch.no_grad():
        assert np.abs(artifact_predict(path, "onnx", x.numpy()) - mc(x).numpy()).max() <= 1e-5


def test_numbers_computed_from_the_input_size_are_packed():
    """vit_b_16's patch count, h // p * (w // p) from the input's shape, used in a reshape of a convolution's
    output: the packed layout refused it ('does not produce one tensor') and fell back to unrolled."""
    class Patches(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.fc = nn.Conv2d(3, 6, 2, stride=2), nn.Linear(6, 4)

        def forward(self, x):
            n, _, h, w = x.shape
            t = self.proj(x).reshape(n, 6, (h // 2) * (w // 2)).permute(0, 2, 1)
            return self.fc(t.mean(1))

    samples = []
    for i in range(2):
        torch.manual_seed(i)
        samples.append(Patches().eval())
    x = torch.randn(8, 3, 4, 6)
    assert pack_samples(samples, x)(x).shape == (8, 4)   # equal to the unrolled average: checked


def _ill_conditioned_net(seed):
    """A conv whose second channel is its bias (100) plus a tiny signal, then a batch norm that saw that channel
    as constant (running mean 100, variance 0, as a unit that never moved on the calibration data): the
    subtraction cancels and 1/sqrt(eps) ~ 316 amplifies every rounding of the conv."""
    g = torch.Generator().manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(4, 3))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        net[0].weight[1].mul_(1e-4)
        net[0].bias[1], net[1].weight[1] = 100.0, 1.0
        net[1].running_mean.zero_()
        net[1].running_var.fill_(1.0)
        net[1].running_mean[1], net[1].running_var[1] = 100.0, 0.0
    return net.eval()


def test_an_ill_conditioned_network_packs_when_it_is_as_close_to_float64_as_the_unrolled_fp32_is():
    """Two correct fp32 computations of an ill-conditioned net differ by more than the packing check's 1e-5:
    the check then measures both from float64 (fp32_agreement) and a packed graph no farther from it than the
    unrolled one is (plus 1e-5) is kept; a wrong graph stays refused."""
    samples = [_ill_conditioned_net(s) for s in range(4)]
    x = torch.randn(64, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    unrolled = MCAverage(samples).eval()
    packed = pack_samples(samples, x)      # refused before: "differs from the unrolled MC average by 6e-05"
    with torch.no_grad():
        out, ref32 = packed(x), unrolled(x)
    exact = predict_float64(unrolled, x)
    assert (out - ref32).abs().max() > 1e-5                       # the fp32 rule alone would refuse it
    own_error = float((ref32.double() - exact).abs().max())
    assert float((out.double() - exact).abs().max()) <= 1e-5 + own_error
    facts = fp32_agreement(out, ref32, unrolled, x, 1e-5)
    assert facts["passed"] and facts["torch_fp32_error"] == pytest.approx(own_error)
    wrong = fp32_agreement(out + 1e-3, ref32, unrolled, x, 1e-5)
    assert not wrong["passed"] and wrong["max_abs_diff_float64"] > 1e-4


def test_fp32_agreement_without_float64_keeps_the_fp32_rule():
    """A module that cannot run in float64 is judged by the fp32 reference alone."""
    class Fp32Only(nn.Module):
        def forward(self, x):
            if x.dtype != torch.float32:
                raise RuntimeError("expected scalar type Float")
            return x.softmax(-1)

    x = torch.randn(8, 3)
    ref = Fp32Only()(x)
    assert predict_float64(Fp32Only(), x) is None
    assert fp32_agreement(ref + 5e-6, ref, Fp32Only(), x, 1e-5)["passed"]
    facts = fp32_agreement(ref + 5e-5, ref, Fp32Only(), x, 1e-5)
    assert not facts["passed"] and "max_abs_diff_float64" not in facts


class _DenseCatPool(nn.Module):
    """A DenseNet-like block: a concatenation, then an adaptive pool to 2x2 (the exporter lost the packed
    value's height and width behind the concatenation's reshape: 'input size not accessible')."""

    def __init__(self, functional):
        super().__init__()
        self.functional = functional
        self.a, self.b = nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.pool, self.fc = nn.AdaptiveAvgPool2d(2), nn.Linear(8 * 4, 3)

    def forward(self, x):
        a = F.relu(self.a(x))
        x = torch.cat([a, F.relu(self.b(a))], 1)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 2) if self.functional else self.pool(x), 1))


@pytest.mark.parametrize("functional", [False, True], ids=["module", "functional"])
def test_an_adaptive_pool_after_a_concatenation_exports_packed(functional, tmp_path):
    from edgebayes.export.formats import export_artifact

    torch.manual_seed(0)
    samples, x = [_DenseCatPool(functional).eval() for _ in range(3)], torch.rand(5, 1, 8, 8)
    details = {}
    export_artifact(MCAverage(samples).eval(), "onnx", tmp_path / "m.onnx", x, details=details)
    assert details["layout"] == "packed" and "packed_refused" not in details
    with torch.no_grad():
        assert np.abs(onnx_predict(tmp_path / "m.onnx", x.numpy()) - MCAverage(samples).eval()(x).numpy()).max() < 1e-5


def test_a_converter_failure_on_the_packed_graph_exports_unrolled_and_says_why(tmp_path, monkeypatch):
    """Whatever torch's converter cannot take in the packed graph, the unrolled one is tried (as for the packed
    layout's own refusals); a network neither converts is one ExportError of a few lines, not the IR dump."""
    import edgebayes.export.formats as formats

    samples, x = samples_and_inputs("mlp", 2)
    real = formats.export_onnx

    def fails_on_packed(module, *args, **kwargs):
        if not isinstance(module, MCAverage):
            raise RuntimeError("a converter's failure\n" + "graph(%x : Float(...)) dump\n" * 500)
        return real(module, *args, **kwargs)

    monkeypatch.setattr(formats, "export_onnx", fails_on_packed)
    details = {}
    formats.export_artifact(MCAverage(samples).eval(), "onnx", tmp_path / "m.onnx", x, details=details)
    assert details["layout"] == "unrolled"
    assert details["packed_refused"].startswith("the converter failed on the packed graph (RuntimeError: a converter's "
                                                "failure). Exported unrolled instead")
    monkeypatch.setattr(formats, "export_onnx", lambda *a, **k: fails_on_packed(None))
    with pytest.raises(formats.ExportError) as error:
        formats.export_artifact(MCAverage(samples).eval(), "onnx", tmp_path / "n.onnx", x)
    assert str(error.value).count("\n") == 0 and len(str(error.value)) < 400
    assert not (tmp_path / "n.onnx").exists()
    # a converter that is not installed is not the network's failure: select says 'cannot export here' on it

    def not_installed(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'litert_torch'")

    monkeypatch.setattr(formats, "export_onnx", not_installed)
    with pytest.raises(ModuleNotFoundError):
        formats.export_artifact(MCAverage(samples).eval(), "onnx", tmp_path / "n.onnx", x)
