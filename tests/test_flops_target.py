"""train.flops_target (train/flops_target.py): a trained network fine-tuned to a share of its dense FLOPs."""

import copy
import json
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import edgebayes as eb
from edgebayes.compressed.structure import paper_flops, structure_report
from edgebayes.compressed.surgery import coupled_channels
from edgebayes.config import ConfigError, TrainConfig
from edgebayes.train.flops_target import (DEFAULT_BATCH, REPAIR_STEPS, SMALLEST_BATCH, SURE, FlopsTargetSchedule,
                                          GroupFlops, _dense_sample, channel_families, fine_tuning_batch_size,
                                          masked_flops, plan, prunable_layers, steps_at_final_structure)

SHAPE = (3, 8, 8)


class Residual(nn.Module):
    """A residual stream written by the stem and by a block's second convolution, a block-internal
    convolution, and a Linear head: what a ResNet's coupling looks like, at 8x8."""

    def __init__(self, c=8, classes=4):
        super().__init__()
        self.stem, self.bn0 = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv1, self.bn1 = nn.Conv2d(c, 2 * c, 3, padding=1, bias=False), nn.BatchNorm2d(2 * c)
        self.conv2, self.bn2 = nn.Conv2d(2 * c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        h = F.relu(self.bn0(self.stem(x)))
        h = F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(h))))) + h)
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


def data(n=256, seed=0):
    """Four classes told apart by which quadrant of the image is bright."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(4, (n,), generator=g)
    x = torch.randn((n,) + SHAPE, generator=g) * 0.3
    for i, c in enumerate(y.tolist()):
        r, q = divmod(c, 2)
        x[i, :, 4 * r: 4 * r + 4, 4 * q: 4 * q + 4] += 1.0
    return x, y


def trained_net(seed=0):
    torch.manual_seed(seed)
    module = Residual()
    x, y = data()
    opt = torch.optim.Adam(module.parameters(), 1e-2)
    for _ in range(30):
        opt.zero_grad()
        F.cross_entropy(module(x), y).backward()
        opt.step()
    return module.eval()


def test_the_residual_stream_is_one_family_of_groups_across_its_writers():
    net = eb.bayesianize(trained_net(), "ss-gl", input_shape=SHAPE, n_train=256)
    plain, _ = net.posterior_sample(0.0)
    groups, blocked = coupled_channels(plain, ["stem.conv", "conv1.conv", "conv2.conv"], torch.zeros((1,) + SHAPE))
    stream = [g for g in groups if ("stem.conv", 0) in g][0]
    assert stream == {("stem.conv", 0), ("conv2.conv", 0)}   # channel 0 of the stream, in both writers
    assert {("conv1.conv", 3)} in groups                       # a block-internal channel goes alone
    assert not blocked
    families = channel_families(net, log=lambda *_: None)
    assert sorted(len(f) for f in families) == [8, 16]        # the stream's 8 channels, conv1's 16


def test_plan_keeps_the_most_important_groups_within_the_target():
    net = eb.bayesianize(trained_net(), "ss-gl", input_shape=SHAPE, n_train=256)
    layers = dict(prunable_layers(net))
    with torch.no_grad():   # conv1's channel importance: its batch norm's scale, made 1..16
        layers["conv1"].norm.weight.copy_(torch.arange(1, 17, dtype=torch.float32))
    families = channel_families(net, log=lambda *_: None)
    plain, _ = net.posterior_sample(0.0)
    dense = paper_flops(plain, SHAPE)
    keep, flops = plan(net, 0.5 * dense, families)
    assert flops <= 0.5 * dense
    kept = keep["conv1"].nonzero().flatten().tolist()
    assert kept and kept == list(range(16 - len(kept), 16))    # the largest scales stay
    assert keep["stem"].tolist() == keep["conv2"].tolist()     # the stream goes in both writers together


class Gated(nn.Module):
    """A residual stream; an expand -> depthwise -> squeeze-and-excitation gate -> project block; a
    concatenation read by the head: the ways a channel's liveness hangs on a group that GroupFlops reads."""

    def __init__(self, c=8, classes=4):
        super().__init__()
        self.stem, self.bn0 = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.expand, self.bn1 = nn.Conv2d(c, 2 * c, 1, bias=False), nn.BatchNorm2d(2 * c)
        self.dw, self.bn2 = nn.Conv2d(2 * c, 2 * c, 3, padding=1, groups=2 * c, bias=False), nn.BatchNorm2d(2 * c)
        self.squeeze, self.excite = nn.Conv2d(2 * c, 4, 1), nn.Conv2d(4, 2 * c, 1)
        self.project, self.bn3 = nn.Conv2d(2 * c, c, 1, bias=False), nn.BatchNorm2d(c)
        self.side, self.bn4 = nn.Conv2d(c, 4, 1, bias=False), nn.BatchNorm2d(4)
        self.fc = nn.Linear(c + 4, classes)

    def forward(self, x):
        h = F.relu(self.bn0(self.stem(x)))
        d = F.relu(self.bn2(self.dw(F.relu(self.bn1(self.expand(h))))))
        gate = torch.sigmoid(self.excite(F.relu(self.squeeze(F.adaptive_avg_pool2d(d, 1)))))
        h = h + self.bn3(self.project(d * gate))
        c = torch.cat([h, F.relu(self.bn4(self.side(h)))], 1)
        return self.fc(F.adaptive_avg_pool2d(c, 1).flatten(1))


@pytest.mark.parametrize("module", [Residual, Gated])
def test_group_flops_counts_what_the_probe_counts_and_plans_alike(module):
    torch.manual_seed(0)
    net = eb.bayesianize(module().eval(), "ss-gl", input_shape=SHAPE, n_train=256)
    families = channel_families(net, log=lambda *_: None)
    plain, plain_names = _dense_sample(net)
    counter = GroupFlops.build(net, families, plain, plain_names)
    assert counter is not None
    generator = torch.Generator().manual_seed(1)
    for share in (0.9, 0.5, 0.3, 0.0):   # 0: one group of each family, the least a plan keeps
        keep = GroupFlops._keep(net, [g for f in families for g in f], GroupFlops._draw(families, share, generator))
        assert counter.count(keep) == masked_flops(net, keep, plain_names, plain)
    dense = paper_flops(plain, SHAPE)
    for target in (0.6, 0.3):
        slow = plan(net, target * dense, families, plain, plain_names)
        fast = plan(net, target * dense, families, plain, plain_names, counter)
        assert fast[1] == slow[1] and all(torch.equal(fast[0][n], slow[0][n]) for n in slow[0])


def test_a_plan_is_counted_by_the_probe_whatever_the_counter_says():
    class Wrong:
        def count(self, keep):
            return 0   # every mask within any target: the plan it gives keeps everything
    torch.manual_seed(0)
    net = eb.bayesianize(Gated().eval(), "ss-gl", input_shape=SHAPE, n_train=256)
    families = channel_families(net, log=lambda *_: None)
    plain, plain_names = _dense_sample(net)
    target = 0.4 * paper_flops(plain, SHAPE)
    keep, flops = plan(net, target, families, plain, plain_names, Wrong())
    slow, slow_flops = plan(net, target, families, plain, plain_names)
    assert flops == slow_flops <= target and all(torch.equal(keep[n], slow[n]) for n in slow)


def test_fine_tuning_reaches_the_target_in_the_network_that_is_shipped():
    x, y = data()
    net = eb.bayesianize(trained_net(), "ss-gl", input_shape=SHAPE, n_train=len(x))
    lines = []
    eb.fit(net, x, y, epochs=2, batch_size=32, lr=1e-3, flops_target=0.4, log=lines.append)
    c = eb.compress(net, m=2)
    s = structure_report(c.dense_sample, c.samples[0], c.kept, SHAPE)
    assert s["physical_flops_ratio"] <= 0.4 + 1e-9     # counted after surgery: what the device gets
    assert s["physical_flops_ratio"] == pytest.approx(s["flops_ratio"], abs=0.02)   # the stream really went
    assert any("flops target" in str(line) for line in lines)
    with torch.no_grad():
        out = c.samples[0](x[:16])
    assert out.shape == (16, 4)


class GroupedNet(nn.Module):
    """A 4-group convolution between two plain ones: surgery keeps its groups equal (each as large as the one
    with the most live channels), so a cut that is unbalanced across its groups removes less than the masks say."""

    def __init__(self, classes=4):
        super().__init__()
        self.a, self.bn = nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.g = nn.Conv2d(32, 32, 3, padding=1, groups=4)
        self.b = nn.Conv2d(32, 24, 1)
        self.fc = nn.Linear(24, classes)

    def forward(self, x):
        h = F.relu(self.g(F.relu(self.bn(self.a(x)))))
        return self.fc(F.adaptive_avg_pool2d(F.relu(self.b(h)), 1).flatten(1))


def test_a_grouped_convolution_reaches_the_target_after_surgery_not_only_on_the_masks():
    """Before the last cut was counted after surgery: 0.39 of the FLOPs on the masks, 0.71 in the network
    that was shipped (every input channel of the 4-group convolution kept)."""
    x, y = data()
    torch.manual_seed(0)
    net = eb.bayesianize(GroupedNet(), "ss-gl", input_shape=SHAPE, n_train=len(x))
    lines = []
    eb.fit(net, x, y, epochs=1, batch_size=32, flops_target=0.4, log=lines.append)
    c = eb.compress(net, m=1)
    physical = structure_report(c.dense_sample, c.samples[0], c.kept, SHAPE)["physical_flops_ratio"]
    assert physical <= 0.4 * 1.01
    reached = [line for line in lines if "of the dense FLOPs after" in str(line)]
    assert reached and f"{physical:.3f} of the dense FLOPs" in reached[-1]   # the log says what was shipped


class Transition(nn.Module):
    """DenseNet's transition layer: a batch norm that reads the block's input, then a convolution named `conv`
    beside it, so `conv` and `norm` are siblings with different channel counts (not a convolution and its own
    batch norm)."""

    def __init__(self, c_in, c_out):
        super().__init__()
        self.norm, self.conv = nn.BatchNorm2d(c_in), nn.Conv2d(c_in, c_out, 1, bias=False)

    def forward(self, x):
        return self.conv(F.relu(self.norm(x)))


class PreActivationNet(nn.Module):
    def __init__(self, classes=4):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.transition = Transition(16, 8)
        self.fc = nn.Linear(8, classes)

    def forward(self, x):
        h = self.transition(F.relu(self.stem(x)))   # the stem feeds a ReLU: the batch norm stays the transition's
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


def test_a_convolution_named_conv_beside_a_batch_norm_it_does_not_feed_fine_tunes_to_the_target():
    """torchvision's densenet121 with train.flops_target raised 'The size of tensor a (256) must match the size
    of tensor b (128)': switching a unit off took any module named `conv` for a convolution that owns the
    sibling `norm`."""
    x, y = data()
    torch.manual_seed(0)
    net = eb.bayesianize(PreActivationNet(), "ss-gl", input_shape=SHAPE, n_train=len(x))
    eb.fit(net, x, y, epochs=1, batch_size=32, flops_target=0.5, log=lambda *_: None)
    c = eb.compress(net, m=1)
    assert structure_report(c.dense_sample, c.samples[0], c.kept, SHAPE)["physical_flops_ratio"] <= 0.5 * 1.01
    norm = c.samples[0].transition.norm   # the pre-activation batch norm still reads every stem channel left
    assert isinstance(norm, nn.BatchNorm2d) and norm.num_features == c.samples[0].stem.out_channels


class Versioned(nn.Module):
    """Converts old states when it loads one, as torchvision's MNASNet does: refuses a state dict that does not
    say which version saved it (its `_metadata`)."""

    _version = 2

    def __init__(self):
        super().__init__()
        self.inner = Residual()

    def forward(self, x):
        return self.inner(x)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):
        if local_metadata.get("version") != self._version:
            raise ValueError(f"version should be {self._version} instead of {local_metadata.get('version')}")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


def test_a_module_that_checks_its_state_dicts_version_fine_tunes_to_a_target_and_loads_pretrained_weights(tmp_path):
    """torchvision's MNASNet with train.flops_target raised 'version should be set to 1 or 2 instead of None':
    the schedule's FLOPs count restored the network from a state dict without its versions; so did the loading
    of model.pretrained."""
    from edgebayes.train.bayesianize import apply_state_dict

    x, y = data()
    torch.manual_seed(0)
    net = eb.bayesianize(Versioned(), "ss-gl", input_shape=SHAPE, n_train=len(x))
    eb.fit(net, x, y, epochs=1, batch_size=64, flops_target=0.5, log=lambda *_: None)
    assert structure_report(*(lambda c: (c.dense_sample, c.samples[0], c.kept))(eb.compress(net)), SHAPE)[
        "physical_flops_ratio"] <= 0.5 * 1.01
    trained = Versioned()
    torch.save(trained.state_dict(), tmp_path / "w.pt")
    loaded = apply_state_dict(Versioned(), torch.load(tmp_path / "w.pt", weights_only=True), tmp_path / "w.pt")
    assert torch.equal(loaded.inner.stem.weight, trained.inner.stem.weight)


def test_kept_units_start_sure_and_switched_off_ones_stay_off_in_training():
    """Units flip in training with probability 1 - gamma per step: a fine-tuning target starts every unit at
    SURE and switches units off to 1 - SURE, not paper 000's 0.99 / 0.01 (train/flops_target.py)."""
    x, y = data()
    net = eb.bayesianize(trained_net(), "ss-ghs", input_shape=SHAPE, n_train=len(x))
    layers = dict(prunable_layers(net))
    assert all(float(layer.inclusion_probability().max()) < SURE for layer in layers.values())  # the config's 0.99
    eb.fit(net, x, y, epochs=1, batch_size=32, lr=1e-3, flops_target=0.4, log=lambda *_: None)
    gamma = torch.cat([layer.inclusion_probability().detach() for layer in layers.values()])
    assert bool((gamma < 0.5).any()) and bool((gamma > 0.5).any())
    # one epoch of Adam moves a logit by about lr per step: far from 0.99 / 0.01 either way
    assert float(gamma[gamma > 0.5].min()) > 0.9995 and float(gamma[gamma < 0.5].max()) < 5e-4


@pytest.mark.parametrize("target", [0.2, 0.3])
def test_after_every_cut_the_median_model_is_the_plan_counted(target):
    """The schedule's last rates are close, and a plan may keep a group an earlier cut switched off: it must come
    back on, or the network ends below the FLOPs the plan counted (a residual net at 0.2: 0.164 for 0.185)."""
    torch.manual_seed(0)
    net = eb.bayesianize(trained_net(), "ss-gl", input_shape=SHAPE, n_train=256)
    schedule = FlopsTargetSchedule(net, TrainConfig(flops_target=target), 400, log=lambda *_: None)
    for step in range(schedule.points[-1]):
        schedule.step(net, step)
        if step + 1 in schedule.points:
            median = {n: layer.inclusion_probability().detach() > 0.5 for n, layer in prunable_layers(net)}
            assert masked_flops(net, median) / schedule.dense_flops == pytest.approx(schedule.reached, abs=1e-9)
    assert schedule.reached <= target * 1.01


def test_a_target_without_prunable_layers_is_one_message_naming_the_key():
    x, y = data(64)
    net = eb.bayesianize(trained_net(), "bnn", input_shape=SHAPE, n_train=len(x))
    with pytest.raises(ConfigError, match=r"fit: flops_target: only a spike-and-slab family"):
        eb.fit(net, x, y, epochs=1, batch_size=32, flops_target=0.5, log=lambda *_: None)


def test_a_target_below_the_smallest_network_names_a_smallest_share_above_it():
    """The message's smallest share is shown to three significant digits, so a tiny target is never told that
    the smallest network is the target itself (a wide net's one-unit-per-family floor is under 1% of its FLOPs)."""
    import re

    x, y = data(64)
    net = eb.bayesianize(Residual(c=64), "ss-gl", input_shape=SHAPE, n_train=len(x))
    target = 1e-4
    with pytest.raises(ConfigError, match="cannot be reached") as e:
        FlopsTargetSchedule(net, eb.config.TrainConfig(flops_target=target), 10, log=lambda *_: None)
    shown = float(re.search(r"the smallest it allows is ([0-9.e-]+) ", str(e.value)).group(1))
    advice = float(re.search(r"set train.flops_target to ([0-9.e-]+) or more", str(e.value)).group(1))
    dense = paper_flops(net.posterior_sample(0.0)[0], SHAPE)
    smallest = plan(net, 0.0, channel_families(net, log=lambda *_: None))[1] / dense
    assert smallest < 0.01 and shown == pytest.approx(smallest, rel=0.01) and shown > target and advice >= shown


def test_config_refuses_a_target_for_a_family_that_does_not_switch_units_off(tmp_path):
    from edgebayes.config import load_pipeline_config

    path = tmp_path / "c.yaml"
    path.write_text("name: t\ndata: {dataset: digits}\nmodel: {family: dnn, arch: mlp, hidden: [8]}\n"
                    "train: {epochs: 1, flops_target: 0.5}\n")
    with pytest.raises(ConfigError, match="train.flops_target"):
        load_pipeline_config(path)
    path.write_text("name: t\ndata: {dataset: digits}\nmodel: {family: ss-gl, arch: mlp, hidden: [8]}\n"
                    "train: {epochs: 1, flops_target: 1.5}\n")
    with pytest.raises(ConfigError, match="flops_target"):
        load_pipeline_config(path)


def test_a_nested_net_starts_from_the_trained_channels_most_important_first():
    """bayesianize(..., "bn3") reorders a copy of the module's channels by importance (train/bayesianize.py,
    order_for_nesting), the residual stream in every writer alike, and the function stays the same."""
    from edgebayes.train.bayesianize import order_for_nesting
    import copy

    module = trained_net()
    with torch.no_grad():
        module.bn1.weight.copy_(torch.linspace(0.1, 1.6, 16))    # conv1's channels: weakest first
        module.bn0.weight.copy_(torch.linspace(0.1, 0.8, 8))     # the stream, as written by the stem ...
        module.bn2.weight.copy_(torch.linspace(0.1, 0.8, 8))     # ... and by the block
    x, _ = data(16)
    reordered = copy.deepcopy(module)
    names = order_for_nesting(reordered, SHAPE)
    assert set(names) == {"stem", "conv1", "conv2"}              # fc produces the outputs: never reordered
    assert torch.allclose(reordered(x), module(x), atol=1e-5)
    assert bool((reordered.bn1.weight.diff() < 0).all())          # strongest first
    assert bool((reordered.bn0.weight.diff() < 0).all()) and torch.equal(reordered.bn0.weight, reordered.bn2.weight)
    net = eb.bayesianize(module, "bn3", input_shape=SHAPE, n_train=256)
    assert torch.equal(module.bn1.weight, torch.linspace(0.1, 1.6, 16))   # the caller's module keeps its order
    assert torch.allclose(net.net.conv1.norm.weight, reordered.bn1.weight)


def test_a_gate_beside_batch_norms_does_not_rank_the_channels_it_gates():
    """The expand channels of a squeeze-and-excitation block are written by the expand and depthwise
    convolutions (each with a batch norm) and by the excitation layer (a gate, without one): they rank by the
    batch norms' scales alone (order_for_nesting), however large the gate's weights are."""
    from edgebayes.train.bayesianize import order_for_nesting
    import copy

    torch.manual_seed(0)
    module = Gated().eval()
    with torch.no_grad():
        module.bn1.weight.copy_(torch.linspace(0.1, 1.6, 16))                 # weakest first
        module.bn2.weight.fill_(1.0)
        module.excite.weight.mul_(2.0 ** torch.arange(16, 0, -1).view(-1, 1, 1, 1))   # gate rows: largest first
    x, _ = data(16)
    reordered = copy.deepcopy(module)
    assert "excite" in order_for_nesting(reordered, SHAPE)
    assert torch.allclose(reordered(x), module(x), atol=1e-4)
    assert bool((reordered.bn1.weight.diff() < 0).all())                   # by the batch norm, strongest first


def test_a_nested_net_with_batch_norms_and_no_calibration_inputs_is_warned_about():
    """Without calibration_x each posterior sample keeps the trained network's batch-norm statistics: about 2
    points lower on a digits CNN, and nothing said so (probe)."""
    from edgebayes.errors import _SAID

    net = trained_net()
    assert any(isinstance(m, nn.BatchNorm2d) for m in net.modules())
    _SAID.clear()
    with pytest.warns(UserWarning, match=r"has batch norms and no calibration_x.*pass calibration_x=x"):
        eb.bayesianize(net, "bn3", input_shape=SHAPE, n_train=10)


def test_a_flops_target_with_no_width_left_to_order_is_a_config_error():
    """nested.fixed_groups = groups - 1 leaves no width below the full one: train.flops_target 1.0 ended in a
    traceback from serve_from (probe)."""
    from edgebayes.config import NestedConfig
    from edgebayes.train.flops_target import nested_width_within
    from edgebayes.train.models import NestedNet

    net = NestedNet("mlp", "bn3", NestedConfig(groups=5, fixed_groups=4), (1, 4, 4), 3, hidden=[10, 10])
    with pytest.raises(ConfigError, match=r"nested\.fixed_groups 4 of 5 groups leaves no width narrower than the full "
                                          r"one.*nested\.fixed_groups 3 or less"):
        nested_width_within(net, 1.0)


def test_a_nested_net_with_a_flops_target_trains_and_serves_the_widths_within_it_and_loads_as_saved():
    """bn3 with flops_target (train/nested.py, nested_width_within): the widest width within the target becomes
    the narrowest one served, its ordering units order only the wider ones, and a net built from the config
    loads the checkpoint with those widths."""
    from edgebayes.train.flops_target import nested_width_within

    x, y = data(128)
    net = eb.bayesianize(trained_net(), "bn3", input_shape=SHAPE, n_train=len(x), calibration_x=x)
    lines = []
    history = eb.fit(net, x, y, epochs=1, batch_size=32, flops_target=0.3, log=lines.append)
    width = int(net.narrowest_width)
    assert net.fixed_groups == width - 1 and net.operating_points()[0] == width
    # the width the training made is the default: validated per epoch, and what compress ships unasked
    assert net.default_knob == width < net.groups
    assert history[-1]["kept_nodes"] == [int(k.sum()) for k in net.kept_units(width).values()][:-1]
    assert any(f"serves widths {width}..{net.groups}" in line for line in lines)
    assert all(m.ordering.mubar.numel() == net.groups - width for _, m in net.nested_layers() if m.nested)

    def shipped(w):   # the FLOPs ratio of the network compress and surgery make at width w
        c = eb.compress(net, knob=w, m=1, seed=0)
        return structure_report(c.dense_sample, c.samples[0], c.kept, SHAPE)["physical_flops_ratio"]

    assert shipped(width) <= 0.3 < shipped(width + 1)
    assert shipped(None) == shipped(width)
    assert nested_width_within(net, 0.3)[1] == pytest.approx(shipped(width), rel=1e-6)
    fresh = eb.bayesianize(trained_net(), "bn3", input_shape=SHAPE, n_train=len(x), calibration_x=x)
    assert fresh.operating_points()[0] == 3                       # nested.fixed_groups 2 + 1, before loading
    fresh.load_state_dict(net.state_dict())
    assert fresh.operating_points() == net.operating_points() and fresh.default_knob == width
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), net.state_dict().values()))
    with pytest.raises(ConfigError, match=r"train.flops_target: 0.0001 of the dense FLOPs cannot be reached by this "
                                          r"nested network: its narrowest width \(3 of 32 groups"):
        eb.fit(fresh, x, y, epochs=1, batch_size=32, flops_target=1e-4, log=lambda *_: None)


def test_bayesianize_keeps_the_configured_batch_norm_calibration_rows_of_the_inputs_given():
    """Every posterior sample recollects its batch-norm statistics on calibration_x: the first nested.bn_batches x
    nested.bn_batch_size rows of what the user gives, as the pipeline takes them, not the whole training set."""
    from edgebayes.config import NestedConfig

    x, _ = data(40)
    nested = NestedConfig(bn_batches=3, bn_batch_size=8)
    net = eb.bayesianize(trained_net(), "bn3", input_shape=SHAPE, n_train=len(x), calibration_x=x, nested=nested)
    assert torch.equal(net.calibration_x, x[:24])
    few = eb.bayesianize(trained_net(), "bn3", input_shape=SHAPE, n_train=len(x), calibration_x=x[:5], nested=nested)
    assert torch.equal(few.calibration_x, x[:5])


@pytest.mark.parametrize("family", ["bn3", "fn3"])
def test_the_width_a_target_ships_has_its_probability_in_the_prior_and_in_q(family):
    """serve_from puts nested.target_width_probability on the narrowest width served (train/nested.py): beta_1 of
    the prior and of q at init (FN3: of its fixed distribution), the wider widths in the chain's own proportions,
    so Phi1 = 0 at the start as without a target."""
    from edgebayes.config import NestedConfig
    from edgebayes.train.nested import ordered_mask_log_probs

    x, _ = data(16)
    net = eb.bayesianize(trained_net(), family, input_shape=SHAPE, n_train=64, calibration_x=x,
                         nested=NestedConfig(target_width_probability=0.6))
    before = [torch.exp(m.ordering.log_beta()) for _, m in net.nested_layers() if m.nested]
    net.serve_from(20)
    for (_, m), old in zip([lm for lm in net.nested_layers() if lm[1].nested], before):
        beta, prior = torch.exp(m.ordering.log_beta()), torch.exp(ordered_mask_log_probs(m.ordering.prior_logits))
        assert len(beta) == net.groups - 19 and beta.sum().item() == pytest.approx(1, abs=1e-5)
        assert beta[0].item() == pytest.approx(0.6, abs=1e-6) and prior[0].item() == pytest.approx(0.6, abs=1e-6)
        tail = old[-(len(beta) - 1):]   # the wider widths keep the chain's proportions
        assert torch.allclose(beta[1:] / beta[1:].sum(), tail / tail.sum(), atol=1e-5)
        if family == "bn3":   # FN3 has no KL
            assert abs(m.ordering.kl().item()) < 1e-5


def test_a_nested_checkpoint_whose_saved_width_is_out_of_range_is_refused_by_name(tmp_path):
    """A checkpoint's narrowest width comes from the file: out of 1..D-1 it stops the resume with the trainer's
    one message for a checkpoint of another network (it was serve_from's bare ValueError), naming the range."""
    x, y = data(64)
    ckpt = tmp_path / "fit.pt"
    settings = dict(epochs=2, batch_size=32, flops_target=0.3, checkpoint=ckpt, log=lambda *_: None)
    net = eb.bayesianize(trained_net(), "bn3", input_shape=SHAPE, n_train=len(x), calibration_x=x)
    eb.fit(net, x, y, until_epoch=1, **settings)
    state = torch.load(ckpt, weights_only=True)
    state["model"]["narrowest_width"] = torch.tensor(net.groups + 7)
    torch.save(state, ckpt)
    fresh = eb.bayesianize(trained_net(), "bn3", input_shape=SHAPE, n_train=len(x), calibration_x=x)
    with pytest.raises(ConfigError, match=r"fit\.pt is of another network: the narrowest width served must lie "
                                          r"in 1\.\.31 .*got 39"):
        eb.fit(fresh, x, y, until_epoch=2, **settings)


def test_the_accuracy_floor_is_refused_for_a_nested_family(tmp_path):
    from edgebayes.config import load_pipeline_config

    path = tmp_path / "c.yaml"
    path.write_text("name: t\ndata: {dataset: digits}\nmodel: {family: bn3, arch: mlp, hidden: [8]}\n"
                    "train: {epochs: 1, flops_target: 0.5}\n")
    assert load_pipeline_config(path).train.flops_target == 0.5
    path.write_text("name: t\ndata: {dataset: digits}\nmodel: {family: bn3, arch: mlp, hidden: [8]}\n"
                    "train: {epochs: 1, flops_target: 0.5, max_accuracy_drop: 0.01}\n")
    with pytest.raises(ConfigError, match="train.max_accuracy_drop: is the floor of the spike-and-slab"):
        load_pipeline_config(path)


def test_a_fine_tuning_to_a_flops_target_interrupted_mid_schedule_resumes_to_the_uninterrupted_result(
        tmp_path, monkeypatch):
    """The schedule's state is the inclusion logits (in the checkpoint) and the step: a run killed after its
    first epoch's checkpoint, in the middle of the schedule, resumes without starting it again (no second
    'every unit sure' at step 0) and ends with the uninterrupted run's weights and inclusion probabilities."""
    import edgebayes.train.trainer as trainer

    x, y = data()
    settings = dict(epochs=3, batch_size=32, lr=1e-3, flops_target=0.4, flops_schedule_fraction=0.8,
                    log=lambda *_: None)
    full = eb.bayesianize(trained_net(), "ss-gl", input_shape=SHAPE, n_train=len(x))
    full_history = eb.fit(full, x, y, checkpoint=tmp_path / "full.pt", **settings)

    real_save = trainer.atomic_torch_save

    def save_then_die(obj, path):
        real_save(obj, path)
        if obj["epoch"] == 1:
            raise KeyboardInterrupt   # after the first of three epochs: the schedule runs to 80% of the steps

    monkeypatch.setattr(trainer, "atomic_torch_save", save_then_die)
    part = eb.bayesianize(trained_net(), "ss-gl", input_shape=SHAPE, n_train=len(x))
    with pytest.raises(KeyboardInterrupt):
        eb.fit(part, x, y, checkpoint=tmp_path / "part.pt", **settings)
    monkeypatch.setattr(trainer, "atomic_torch_save", real_save)
    gamma_at_checkpoint = {n: float(l.inclusion_probability().detach().min()) for n, l in prunable_layers(part)}
    assert min(gamma_at_checkpoint.values()) < 0.5   # units were switched off before the interruption

    resumed = eb.bayesianize(trained_net(), "ss-gl", input_shape=SHAPE, n_train=len(x))
    lines = []
    history = eb.fit(resumed, x, y, checkpoint=tmp_path / "part.pt", **{**settings, "log": lines.append})
    assert any("resuming" in str(line) for line in lines) and [h["epoch"] for h in history] == [1, 2, 3]
    for (name, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    points = history[-1]["flops_target_points"]   # every cut, validated, in both runs
    assert points == full_history[-1]["flops_target_points"] and points[0]["step"] == 0 and len(points) > 2
    c = eb.compress(resumed, m=2)
    assert structure_report(c.dense_sample, c.samples[0], c.kept, SHAPE)["physical_flops_ratio"] <= 0.4 + 1e-9


def test_a_run_in_slices_with_until_epoch_is_the_uninterrupted_run(tmp_path):
    """fit(until_epoch=k) stops after epoch k of the whole run (a benchmark interleaving methods epoch by epoch,
    a job on a preemptible machine); the schedules that depend on the run's length (KL warm-up over 2 of 3
    epochs, the FLOPs target's cuts) are the whole run's, so three slices end where one run does."""
    x, y = data()
    settings = dict(epochs=3, batch_size=32, lr=1e-3, flops_target=0.4, flops_schedule_fraction=0.8,
                    kl_warmup_epochs=2, log=lambda *_: None)
    full = eb.bayesianize(trained_net(), "ss-gl", input_shape=SHAPE, n_train=len(x))
    full_history = eb.fit(full, x, y, checkpoint=tmp_path / "full.pt", **settings)
    sliced = eb.bayesianize(trained_net(), "ss-gl", input_shape=SHAPE, n_train=len(x))
    for k in (1, 2, 3):
        history = eb.fit(sliced, x, y, checkpoint=tmp_path / "sliced.pt", until_epoch=k, **settings)
        assert [h["epoch"] for h in history] == list(range(1, k + 1))
        assert ("flops_target_verdict" in history[-1]) == ("flops_target_verdict" in full_history[k - 1])
    assert [h["kl_warmup"] for h in history] == [h["kl_warmup"] for h in full_history]
    assert history[-1]["flops_target_points"] == full_history[-1]["flops_target_points"]
    for (name, a), (_, b) in zip(full.state_dict().items(), sliced.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("until_epoch, checkpoint", [(0, True), (4, True), (1.5, True), (True, True), (2, False)])
def test_until_epoch_out_of_range_or_without_a_checkpoint_is_refused_before_training(tmp_path, until_epoch,
                                                                                       checkpoint):
    x, y = data()
    net = eb.bayesianize(trained_net(), "ss-gl", input_shape=SHAPE, n_train=len(x))
    before = copy.deepcopy(net.state_dict())
    path = tmp_path / "c.pt" if checkpoint else None
    with pytest.raises(ConfigError, match="fit: until_epoch"):
        eb.fit(net, x, y, epochs=3, checkpoint=path, until_epoch=until_epoch, log=lambda *_: None)
    assert all(torch.equal(a, before[k]) for k, a in net.state_dict().items()) and not (tmp_path / "c.pt").exists()


def test_a_target_that_costs_more_than_the_accuracy_floor_names_the_closest_point_within_it():
    """train.max_accuracy_drop: the network is validated before the first step and at every point of the
    schedule's cuts, each fine-tuned until the next; 10% of the FLOPs of this small net costs far more than the
    floor, and the message names the smallest cut at or above it (or says none was), as the target to set."""
    x, y = data()
    net = eb.bayesianize(trained_net(), "ss-gl", input_shape=SHAPE, n_train=len(x))
    lines = []
    drop = 0.1
    history = eb.fit(net, x, y, epochs=2, batch_size=32, lr=1e-3, flops_target=0.1, max_accuracy_drop=drop,
                     flops_schedule_fraction=0.5, log=lines.append)   # ten cuts over 8 steps
    points = history[-1]["flops_target_points"]
    assert points[0] == {"step": 0, "flops_ratio": 1.0, "val_accuracy": points[0]["val_accuracy"]}
    assert [p["step"] for p in points] == sorted(p["step"] for p in points) and points[-1]["flops_ratio"] <= 0.1
    assert [p["flops_ratio"] for p in points] == sorted((p["flops_ratio"] for p in points), reverse=True)
    assert points[-1]["val_accuracy"] == history[-1]["val_accuracy"]   # the last cut: after the last epoch
    floor = points[0]["val_accuracy"] - drop
    assert history[-1]["val_accuracy"] < floor     # the cost this test is about
    verdict = history[-1]["flops_target_verdict"]
    assert verdict in lines and f"train.max_accuracy_drop {drop:g}" in verdict
    within = [p for p in points[1:] if p["val_accuracy"] >= floor]
    assert within and f"the smallest cut within it: {min(p['flops_ratio'] for p in within):.3f} of the FLOPs" in verdict
    assert any(line.startswith("flops target: validation accuracy of each cut") for line in lines)
    # no cut within the floor: said so (the schedule's own trajectory, set here)
    schedule = FlopsTargetSchedule(net, eb.config.TrainConfig(flops_target=0.1, max_accuracy_drop=0.01), 10,
                                   evaluate=lambda m: 0.0, points=[{**points[0], "val_accuracy": 0.9},
                                                                   {**points[1], "val_accuracy": 0.5}])
    curve, verdict = schedule.finish(0.6)
    assert "no cut of the schedule stayed within it" in verdict and curve.endswith("(the first before fine-tuning, "
                                                                                   "the last after it)")
    # the report's summary carries it among the things not to miss
    from edgebayes.deploy.summary import summarize
    assert any("train.max_accuracy_drop" in w for w in summarize({"train": {"history": history}})["warnings"])


def test_a_target_within_the_accuracy_floor_says_nothing_and_the_floor_needs_a_target(tmp_path):
    from edgebayes.config import load_pipeline_config

    x, y = data()
    net = eb.bayesianize(trained_net(), "ss-gl", input_shape=SHAPE, n_train=len(x))
    history = eb.fit(net, x, y, epochs=2, batch_size=32, lr=1e-3, flops_target=0.9, max_accuracy_drop=0.5,
                     log=lambda *_: None)
    assert "flops_target_verdict" not in history[-1]
    path = tmp_path / "c.yaml"
    path.write_text("name: t\ndata: {dataset: digits}\nmodel: {family: ss-gl, arch: mlp, hidden: [8]}\n"
                    "train: {epochs: 1, max_accuracy_drop: 0.01}\n")
    with pytest.raises(ConfigError, match="train.max_accuracy_drop"):
        load_pipeline_config(path)


def test_validating_along_the_schedule_changes_no_training_noise(monkeypatch):
    """The cuts are validated mid-epoch; the fine-tuned network is the one a run that did not validate ends
    with (counting kept units builds a plain twin, whose initialisation would draw from the global generator)."""
    from edgebayes.train import flops_target

    x, y = data()
    runs = []
    for validate in (True, False):
        if not validate:
            monkeypatch.setattr(flops_target.FlopsTargetSchedule, "_validate", lambda self, model: 0.0)
        net = eb.bayesianize(trained_net(), "ss-gl", input_shape=SHAPE, n_train=len(x))
        eb.fit(net, x, y, epochs=2, batch_size=32, lr=1e-3, flops_target=0.3, log=lambda *_: None)
        runs.append(net.state_dict())
    for name in runs[0]:
        assert torch.equal(runs[0][name], runs[1][name]), name


class ReflectSignal(nn.Module):
    """A 1-D network (sensor or audio data) of reflection-padded Conv1d layers, which have no Bayesian twin, and a
    Linear head."""

    def __init__(self, classes=4):
        super().__init__()
        self.c1 = nn.Conv1d(2, 16, 5, padding=2, padding_mode="reflect")
        self.c2 = nn.Conv1d(16, 16, 5, padding=2, padding_mode="reflect")
        self.fc1, self.fc = nn.Linear(16, 32), nn.Linear(32, classes)

    def forward(self, x):
        h = F.relu(self.c2(F.relu(self.c1(x))))
        return self.fc(F.relu(self.fc1(h.mean(-1))))


def test_layers_without_a_bayesian_twin_are_told_counted_and_named_when_they_block_the_target():
    """A reflection-padded Conv1d stays plain: bayesianize says so in one warning, its FLOPs count (before, the
    ratio counted the Linear layers only: 0.38 'reached' with every convolution whole), and a target it blocks is
    refused before the first step, naming it and the smallest share within reach."""
    from edgebayes.compressed.structure import paper_flops

    tiny = nn.Sequential(nn.Conv1d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(32, 3))
    assert paper_flops(tiny, (2, 10)) == (2 * 4 * 3 + 4) * 8 + (32 * 3 + 3)   # appendix A.1's formula, in 1-D
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 2, 40, generator=g), torch.randint(4, (64,), generator=g)
    with pytest.warns(UserWarning, match=r"2 layer\(s\) of ReflectSignal have no Bayesian twin.*padding: c1\.conv, "
                                         r"c2\.conv"):
        net = eb.bayesianize(ReflectSignal(), "ss-gl", input_shape=(2, 40), n_train=len(x))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    # The convolutions are most of the FLOPs and stay whole: cutting the Linear layers to one unit each would
    # destroy the classifier and still miss the target, so the fine-tuning does not start
    with pytest.raises(ConfigError, match=r"train\.flops_target: 0\.4 of the dense FLOPs cannot be reached on this "
                                          r"network: the smallest it allows is 0\.9\d* .*without a Bayesian twin "
                                          r"stay whole: c1\.conv, c2\.conv\); set train\.flops_target to 0\.9\d or more"):
        eb.fit(net, x, y, epochs=1, batch_size=32, flops_target=0.4, log=lambda *_: None)
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())   # nothing trained
    lines = []
    eb.fit(net, x, y, epochs=1, batch_size=32, flops_target=0.995, log=lines.append)   # within reach: trains
    c = eb.compress(net)
    assert structure_report(c.dense_sample, c.samples[0], c.kept, (2, 40))["physical_flops_ratio"] <= 0.995 * 1.01


def test_export_says_when_the_runtimes_channel_block_puts_the_shipped_network_above_the_target(tmp_path):
    """One training serves every device, so the target is counted without the runtime's channel block, and
    surgery then rounds each pruned width up to a multiple of it: mobilenet_v2 fine-tuned to 0.25 shipped at
    0.2975 of its FLOPs for a block of 8, and nothing said so."""
    from types import SimpleNamespace

    from edgebayes.config import DeviceProfile, PipelineConfig
    from edgebayes.stages import _above_flops_target

    def ctx(target, block):
        cfg = PipelineConfig(train={"flops_target": target})
        profile = DeviceProfile(name="orin", runtime={"name": "tensorrt", "channel_multiple": block})
        return SimpleNamespace(cfg=cfg, profile=profile, stage_dir=lambda stage: tmp_path)

    message = _above_flops_target(ctx(0.25, 8), 0.2975, 0.2480)
    assert message.startswith("the shipped network has 0.297 of the dense FLOPs, above train.flops_target 0.25")
    assert "blocks of 8 channels" in message and "runtime.channel_multiple: 1" in message
    assert _above_flops_target(ctx(0.25, 8), 0.2520, 0.2480) is None   # within 1%
    assert _above_flops_target(ctx(None, 8), 0.9, 0.9) is None
    # a bn3 width select chose above the target (tied on accuracy, faster measured): the block was blamed (probe)
    (tmp_path / "choice.json").write_text(json.dumps({"knob": "width", "knob_value": 4}))
    message = _above_flops_target(ctx(0.25, 4), 0.2573, 0.2573)
    assert "select chose width 4, which keeps 0.257 by its masks" in message and "blocks of" not in message
    # ... and one within the target by its masks, above it in the device's blocks, with the target counted in
    # them: the block branch said no cut reached the target, where the training's width did (probe)
    (tmp_path / "choice.json").write_text(json.dumps({"knob": "width", "knob_value": 5}))
    (tmp_path / "metrics.json").write_text(json.dumps({"test": {"knob": "width", "knob_value": 4}}))
    blocked = ctx(0.45, 8)
    blocked.cfg.train.flops_channel_multiple = 8
    message = _above_flops_target(blocked, 0.551, 0.402)
    assert "select chose width 5" in message and "the training's point within the target is width 4" in message
    assert "no cut of the schedule reached it" not in message


class GroupNormed(nn.Module):
    """Convolutions followed by GroupNorms: a channel's statistics are shared with its group's other channels, so
    surgery cannot remove a switched-off channel exactly (compressed/surgery.py) and keeps every one."""

    def __init__(self, classes=4):
        super().__init__()
        self.c1, self.n1 = nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8)
        self.c2, self.n2 = nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(2, 8)
        self.fc = nn.Linear(8, classes)

    def forward(self, x):
        h = F.relu(self.n2(self.c2(F.relu(self.n1(self.c1(x))))))
        return self.fc(h.mean((2, 3)))


@pytest.mark.parametrize("family", ["bn3", "ss-gl"])
def test_a_target_that_surgery_cannot_reach_names_the_layers_it_keeps_and_why(family):
    """A network whose channels surgery keeps (here: each normalized with others by a GroupNorm) is refused
    before the first step, and the message names the layers and surgery's own reason, not only a ratio."""
    x, y = data(32)
    net = eb.bayesianize(GroupNormed(), family, input_shape=SHAPE, n_train=len(x),
                         calibration_x=x if family == "bn3" else None)
    with pytest.raises(ConfigError, match=r"cannot be reached") as e:
        eb.fit(net, x, y, epochs=1, batch_size=16, flops_target=0.5, log=lambda *_: None)
    message = str(e.value)
    assert "c1 keeps" in message and "normalized together with other channels by n1" in message, message


def _repair_steps(n, batch, epochs, fraction=0.1):
    return steps_at_final_structure(epochs * -(-n // batch), fraction)


@pytest.mark.parametrize("n, epochs", [(1150, 3), (4000, 5), (300, 2)])
def test_a_batch_size_left_out_is_the_largest_that_leaves_the_cut_network_steps_to_recover(n, epochs):
    t = TrainConfig(epochs=epochs, flops_target=0.5)
    batch, warning = fine_tuning_batch_size(t, n)
    if _repair_steps(n, SMALLEST_BATCH, epochs) >= REPAIR_STEPS:
        assert warning is None and _repair_steps(n, batch, epochs) >= REPAIR_STEPS
        assert batch == DEFAULT_BATCH or _repair_steps(n, 2 * batch, epochs) < REPAIR_STEPS
    else:   # too few examples even at the smallest batch: the epochs that would do, checked
        assert batch == SMALLEST_BATCH
        more = int(re.search(r"set train\.epochs to (\d+)", warning).group(1))
        assert _repair_steps(n, batch, more) >= REPAIR_STEPS > _repair_steps(n, batch, more - 1)


def test_a_large_training_set_or_no_target_keeps_the_default_batch_and_a_users_batch_is_kept_with_a_warning():
    assert fine_tuning_batch_size(TrainConfig(epochs=5, flops_target=0.5), 60000) == (DEFAULT_BATCH, None)
    assert fine_tuning_batch_size(TrainConfig(epochs=1), 100) == (DEFAULT_BATCH, None)   # from scratch: not ours
    assert fine_tuning_batch_size(TrainConfig(epochs=1, batch_size=8), 100) == (8, None)
    batch, warning = fine_tuning_batch_size(TrainConfig(epochs=3, batch_size=1024, flops_target=0.5), 1150)
    assert batch == 1024 and "1,150 training examples at batch size 1024 are 2 step(s) an epoch" in warning
    smaller, more = map(int, re.search(r"train\.batch_size to (\d+) or train\.epochs to (\d+)", warning).groups())
    assert _repair_steps(1150, smaller, 3) >= REPAIR_STEPS and _repair_steps(1150, 1024, more) >= REPAIR_STEPS


def test_fit_without_a_batch_size_picks_it_for_the_target_and_says_so_when_the_data_is_too_small():
    x, y = data(n=128)
    net = eb.bayesianize(trained_net(), "ss-gl", input_shape=SHAPE, n_train=len(x))
    lines = []
    history = eb.fit(net, x, y, epochs=1, lr=1e-3, flops_target=0.5, log=lines.append)
    assert history[0]["batch_size"] == SMALLEST_BATCH   # 128 examples: 8 steps at 16, fewer than needed
    said = [str(line) for line in lines if "WARNING train.flops_target" in str(line)]
    assert len(said) == 1 and "set train.epochs to" in said[0]
    assert not any("leave the cut network at least" in str(line) for line in lines)   # not claimed when untrue


def test_a_schedule_that_leaves_no_step_after_its_last_cut_is_refused():
    """flops_schedule_fraction 1 put the last cut on the last step: the search for the epochs that leave the cut
    network steps to recover never ended (the run hung before its first line)."""
    from edgebayes.config import TrainConfig, check_train
    from edgebayes.train.flops_target import fine_tuning_batch_size

    with pytest.raises(ConfigError, match=r"flops_schedule_fraction: expected a share below 1 with a FLOPs target"):
        check_train(TrainConfig(flops_target=0.3, flops_schedule_fraction=1.0), "ss-gl", "fit", prefix="")
    check_train(TrainConfig(flops_target=0.3, flops_schedule_fraction=1.0), "bn3", "fit", prefix="")   # served whole
    batch, warning = fine_tuning_batch_size(TrainConfig(flops_target=0.3, flops_schedule_fraction=1 - 1e-9,
                                                        batch_size=64, epochs=1), 200)
    assert batch == 64 and "set train.flops_schedule_fraction well below" in warning


def test_a_resumed_schedule_in_a_process_that_does_not_validate_goes_on():
    """A DDP run resumed with a cut pending validation (the history's last point without accuracy) failed on
    every resume: process 1, which does not validate, called its evaluate of None (probe)."""
    torch.manual_seed(0)
    net = eb.bayesianize(trained_net(), "ss-gl", input_shape=SHAPE, n_train=256)
    pending = [{"step": 0, "flops_ratio": 1.0, "val_accuracy": 0.9}, {"step": 5, "flops_ratio": 0.7, "val_accuracy": None}]
    other_process = FlopsTargetSchedule(net, TrainConfig(flops_target=0.3), 400, log=lambda *_: None, points=pending)
    for step in range(other_process.points[1]):   # past the next cut, where process 0 validates the pending one
        other_process.step(net, step)
    assert other_process.trajectory == [] and other_process.reached < 1
    validating = FlopsTargetSchedule(net, TrainConfig(flops_target=0.3), 400, log=lambda *_: None,
                                     evaluate=lambda m: 0.8, points=pending)
    validating.step(net, validating.points[1] - 1)
    assert validating.trajectory[1]["val_accuracy"] == 0.8


def test_a_target_counted_with_the_runtimes_channel_block_ships_within_it_there():
    """flops_target device took the device's budgets but counted the cut without its runtime's channel block:
    surgery then rounded each pruned width up and the shipped network (0.235 for 0.18) failed the budget the
    target came from (probe). With train.flops_channel_multiple the last cut is counted as surgery ships it."""
    from edgebayes.compressed.samples import compress

    results = {}
    for block in (1, 4):
        torch.manual_seed(0)
        net = eb.bayesianize(trained_net(), "ss-gl", input_shape=SHAPE, n_train=256)
        schedule = FlopsTargetSchedule(net, TrainConfig(flops_target=0.25, flops_channel_multiple=block), 400,
                                       log=lambda *_: None)
        for step in range(schedule.points[-1]):
            schedule.step(net, step)
        shipped = compress(net, 0.5, 1, 0, channel_multiple=4)
        results[block] = structure_report(shipped.dense_sample, shipped.samples[0], shipped.kept,
                                          SHAPE)["physical_flops_ratio"]
    assert results[4] <= 0.25 * 1.01 < results[1]   # the masks' count alone ships above it in blocks of 4
