"""Make a user's plain network (a torchvision model, a home-made nn.Module) the net of any family.

    net = bayesianize(torchvision.models.resnet18(num_classes=10), "ss-gl", input_shape=(3, 32, 32),
                      n_train=50_000)

`bayesianize` itself is in the family registry (train/families.py), which wraps the converted module in
its family's net; this module converts. Every nn.Conv2d and nn.Linear is swapped for the layer the
family's `LayerFactory` builds (the same switch the zoo goes through, train/layers.py), in place, so the
user's own `forward` keeps running unchanged:

  - a convolution whose only consumer is a batch norm takes that batch norm with it (`norm`: the layer owns
    it, z multiplies its output, so a switched-off channel is exactly zero); the batch norm's old place
    becomes nn.Identity. Any other batch norm (densenet's pre-activation one) stays where it is.
  - the layers that produce the network's outputs (reached backwards from the output through
    parameter-free operations only) are built with prunable=False: the classifier is never pruned.
  - the new layer starts from the module's weights: the posterior means (weights, biases, batch-norm
    statistics) are the given weights, and the spike-and-slab posterior scales min(softplus(-6), 0.1 |w|)
    (`_relative_rho` says why this deviates from paper 000's -6), so a pretrained network starts where it
    was trained. Nested layers keep paper 002's log alpha initialisation.
  - a Conv1d (1-D signals: sensors, audio) is first rewritten as the height-1 Conv2d it equals, with the
    BatchNorm1d that alone reads it (`conv1d_as_conv2d`, `Signal1d`), and then becomes the family's layer as
    any Conv2d does: its channels carry uncertainty, are switched off and are cut out.
  - padding "valid" and "same" are taken as the numbers they mean (`_explicit_padding`); "same" with an even
    kernel (it pads unevenly), padding modes other than zeros, other convolutions (Conv3d, transposed) and
    nn.MultiheadAttention have no Bayesian twin here: they
    stay plain, deterministic and whole, listed in `net.plain_layers` and in one warning (FLOPs ratios count
    them: compressed/structure.py).

The structure is read with torch.fx (symbolic_trace), which every torchvision classifier supports; a
forward that fx cannot trace gets one ArchError saying so.
"""

import copy
from collections import OrderedDict
import math
import pickle
import re
import zipfile
from pathlib import Path

import torch
from torch import fx, nn

from edgebayes.compressed.surgery import order_channels
from edgebayes.errors import ArchError, InputError, warn_once
from edgebayes.train.layers import ConvNorm, LayerFactory, Signal1d
from edgebayes.train.nested import NESTED_FAMILIES

AFFINE = (nn.Conv2d, nn.Linear)
NORM_OF = {nn.Conv2d: nn.BatchNorm2d, nn.Conv1d: nn.BatchNorm1d}   # the batch norm a convolution takes with it
PLAIN_ONLY = (nn.modules.conv._ConvNd, nn.MultiheadAttention, nn.RNNBase)   # no Bayesian twin: stay plain


def _structure(module):
    """(conv name -> batch-norm name that only it feeds, output layer names, names of the Linear and convolution
    layers in call order, names of every module fx called: torch.nn's own, such as nn.TransformerEncoderLayer,
    are called whole, their layers inside; names of the modules whose parameters the forward reads itself,
    `fc.weight` in a tied decoder)."""
    try:
        graph = fx.symbolic_trace(module).graph
    except Exception as e:
        raise ArchError(f"bayesianize: cannot trace {type(module).__name__} with torch.fx ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); build it with the layer factory instead "
                        f"(train/arch.py)") from None
    mods = dict(module.named_modules())
    calls = [n for n in graph.nodes if n.op == "call_module"]
    count = {}
    for n in calls:
        count[n.target] = count.get(n.target, 0) + 1
    order, pairs = [], {}
    for n in calls:   # every affine map: those without a Bayesian twin (a Conv3d) are listed as staying plain
        if isinstance(mods[n.target], AFFINE + PLAIN_ONLY) and n.target not in order:
            order.append(n.target)
        norm = next((b for c, b in NORM_OF.items() if isinstance(mods[n.target], c)), None)
        if norm is not None and count[n.target] == 1 and len(n.users) == 1:
            (user,) = n.users
            if user.op == "call_module" and isinstance(mods[user.target], norm) and count[user.target] == 1:
                pairs[n.target] = user.target
    stack = [n for n in graph.nodes if n.op == "output"]
    if any(_is_softmax(arg, mods) for node in stack for arg in node.all_input_nodes):
        raise ArchError(f"bayesianize: {type(module).__name__} returns probabilities (its output is a softmax); "
                        f"the ELBO's likelihood and the MC average take class scores (logits), and a softmax of "
                        f"probabilities trains a flat network: return the scores (drop the final softmax) or "
                        f"log_softmax")
    # Output layers: walk back from the output through everything that is not a Linear / Conv2d.
    outputs, seen = set(), set()
    while stack:
        node = stack.pop()
        for arg in node.all_input_nodes:
            if arg in seen:
                continue
            seen.add(arg)
            if arg.op == "call_module" and isinstance(mods[arg.target], AFFINE):
                outputs.add(arg.target)
            else:
                stack.append(arg)
    read = {n.target.rpartition(".")[0] for n in graph.nodes if n.op == "get_attr"}
    return pairs, outputs, order, set(count), read


def _is_softmax(node, mods):
    return ((node.op == "call_module" and isinstance(mods[node.target], nn.Softmax))
            or (node.op == "call_function" and node.target in (torch.softmax, torch.nn.functional.softmax))
            or (node.op == "call_method" and node.target == "softmax"))


MOPED_DELTA = 0.1   # posterior scale at most this fraction of each given weight (Krishnan et al. 2020)
NESTED_NOISE_DELTA = 0.03   # the nested family's sqrt(alpha) at most this: log alpha <= -7.0 (_relative_rho)


@torch.no_grad()
def _start_from(layer, affine, norm):
    """Copy a plain layer's weights (and its batch norm's state) into a factory-built layer."""
    own_norm = getattr(layer, "norm", None)
    if hasattr(layer, "weight_mu"):      # spike-and-slab / dense BNN: posterior means and scales
        layer.weight_mu.copy_(affine.weight)
        layer.weight_rho.copy_(_relative_rho(affine.weight, layer.weight_rho))
        if layer.bias_mu is not None and affine.bias is not None:
            layer.bias_mu.copy_(affine.bias)
            layer.bias_rho.copy_(_relative_rho(affine.bias, layer.bias_rho))
    elif hasattr(layer, "theta"):        # nested layers: the weights the noise multiplies
        layer.theta.copy_(affine.weight)
        if getattr(layer, "log_alpha", None) is not None:   # BN3: w = theta (1 + sqrt(alpha) eps)
            layer.log_alpha.clamp_(max=2 * math.log(NESTED_NOISE_DELTA))
        if layer.bias is not None and affine.bias is not None:
            layer.bias.copy_(affine.bias)
    else:                                # dnn: nn.Linear / nn.Conv2d, or ConvNorm(conv, norm)
        target = layer.conv if hasattr(layer, "conv") else layer
        target.load_state_dict(affine.state_dict())
    if norm is not None and own_norm is not None:
        _copy_batch_norm(own_norm, norm)


def _copy_batch_norm(own, norm):
    """The user's batch norm, state and settings, in the layer's own nn.BatchNorm2d: eps and momentum
    (torchvision's efficientnet_v2 normalises with eps 1e-3, mnasnet averages with momentum 3e-4; the factory's
    defaults would change the function and its fine-tuning). Without affine parameters (affine=False) the own
    ones stay at 1 and 0, the same function, and become trainable: a switched-off channel is zeroed through
    them (models.drop_outputs). Without running statistics (track_running_stats=False) the own one normalises
    by each batch's too."""
    own.eps, own.momentum = norm.eps, norm.momentum
    if norm.affine:
        own.weight.copy_(norm.weight)
        own.bias.copy_(norm.bias)
    if norm.track_running_stats:
        own.running_mean.copy_(norm.running_mean)
        own.running_var.copy_(norm.running_var)
        own.num_batches_tracked.copy_(norm.num_batches_tracked)
    else:
        own.track_running_stats = False
        own.running_mean = own.running_var = own.num_batches_tracked = None


def _relative_rho(weight, rho, delta=MOPED_DELTA):
    """rho with softplus(rho) = min(softplus(rho_init), delta |w|): a posterior scale no larger than 10% of each
    given weight (as MOPED, Krishnan et al. 2020, starts from a trained net). Paper 000's initial
    softplus(-6) = 0.0025 is an absolute scale meant for training from scratch; on a deep pretrained net it is
    10-20% of a typical weight of the later layers and changes the network's function before any training.
    The nested family's multiplicative noise gets a bound of its own in _start_from, sqrt(alpha) <= 0.03
    (NESTED_NOISE_DELTA, log alpha <= -7.0): paper 002's initial log alpha of -1 (std 61% of every weight) took a
    trained net at full width from 96% to 38% accuracy before its first step (measured on
    benchmarks/own_models.py's Custom). Why smaller than delta: that noise is a fixed fraction of every weight,
    not min(an absolute scale, delta |w|), and a fine-tuning budget does not move it (Adam moves log alpha by
    about lr per step: 0.16 in benchmarks/finetune_compress.py's 160 steps), so the initial noise is the noise
    the narrow width trains under. Validation accuracy at the width shipped toward a quarter of the FLOPs
    (benchmarks/finetune_compress.py, seed 0): efficientnet_b0 0.675 at delta 0.1 (log alpha -4.6), 0.851 at 0.03
    (fine-tuning seed 1: 0.669 and 0.770); mobilenet_v2 0.786 and 0.815 (seed 1: 0.776 and 0.750, test accuracy
    82.65 and 82.62 averaged over both seeds: even there, widely spread). Right after bayesianize, at full width, one
    posterior sample at 0.1 is 2-3 points below the trained net on both, at 0.03 within 0.6 (M = 4 averages
    recover both), so the noise a trained net takes at once is not what a narrow width can train under."""
    sigma = torch.minimum(torch.nn.functional.softplus(rho), delta * weight.abs()).clamp_min(1e-6)
    return sigma + torch.log(-torch.expm1(-sigma))   # softplus^-1(sigma) = log(exp(sigma) - 1), stably


def _explicit_padding(conv):
    """A Conv2d's padding as the numbers the layers take: "valid" is 0, "same" (stride 1) is d (k - 1) / 2 on each
    side where every d (k - 1) is even; None where it has no such form (an even kernel pads unevenly)."""
    if not isinstance(conv.padding, str):
        return conv.padding
    if conv.padding == "valid":
        return (0, 0)
    if all(d * (k - 1) % 2 == 0 for d, k in zip(conv.dilation, conv.kernel_size)):
        return tuple(d * (k - 1) // 2 for d, k in zip(conv.dilation, conv.kernel_size))
    return None


def _replace(module, name, new):
    parent, _, attr = name.rpartition(".")
    setattr(module.get_submodule(parent) if parent else module, attr, new)


@torch.no_grad()
def conv1d_as_conv2d(module: nn.Module) -> nn.Module:
    """A copy of `module` whose Conv1d layers are Signal1d's height-1 Conv2d (same weights, padding, stride,
    dilation, groups and padding mode), each with the BatchNorm1d that alone reads it (its place becomes
    nn.Identity); `module` itself where it has none. Why: the families' layers, the probes and the rules of
    surgery are written once, for Conv2d, and a 1-D convolution is exactly a 2-D one over a single row; kept as
    a Conv1d, a sensor or audio network kept its convolutions plain and whole (most of its FLOPs). A Conv1d whose
    weights the forward also reads itself stays (tied weights). `original_keys` of the copy maps its new state-dict
    keys to the module's (`state_as_built` reads a state dict of the module as written)."""
    pairs, _, order, _, read = _structure(module)
    names = [n for n in order if type(module.get_submodule(n)) is nn.Conv1d and n not in read]
    if not names:
        return module
    net, renamed = copy.deepcopy(module), {}
    for name in names:
        c = net.get_submodule(name)
        padding = c.padding if isinstance(c.padding, str) else (0,) + tuple(c.padding)
        conv = nn.Conv2d(c.in_channels, c.out_channels, (1,) + c.kernel_size, (1,) + c.stride, padding,
                         (1,) + c.dilation, c.groups, c.bias is not None, c.padding_mode)
        conv.weight.copy_(c.weight.unsqueeze(-2))
        renamed[f"{name}.conv.weight"] = f"{name}.weight"
        if c.bias is not None:
            conv.bias.copy_(c.bias)
            renamed[f"{name}.conv.bias"] = f"{name}.bias"
        norm = None
        if name in pairs:
            b = net.get_submodule(pairs[name])
            norm = nn.BatchNorm2d(b.num_features, b.eps, b.momentum, b.affine, b.track_running_stats)
            norm.load_state_dict(b.state_dict())
            renamed.update({f"{name}.norm.{k}": f"{pairs[name]}.{k}" for k in b.state_dict()})
            norm.train(b.training)
            _replace(net, pairs[name], nn.Identity())
        _replace(net, name, Signal1d(conv.train(c.training), norm))
    net.original_keys = renamed
    return net


def state_as_built(state, module):
    """`state`, a state dict of a network as its author wrote it, in the names and shapes of `module`, that network
    as built here (`original_keys`, new key -> the author's: conv1d_as_conv2d's Conv1d / BatchNorm1d moves, c1.weight
    of shape (out, in, k) as c1.conv.weight of shape (out, in, 1, k); the dnn twin's ConvNorm, conv1.weight and
    bn1.weight as conv1.conv.weight and conv1.norm.weight). Keys already in the built form pass unchanged."""
    renamed = getattr(module, "original_keys", None)
    if not renamed:
        return state
    own, state = module.state_dict(), dict(state)
    for new, old in renamed.items():
        if new not in state and old in state:
            value = state.pop(old)
            same_size = new in own and value.shape != own[new].shape and value.numel() == own[new].numel()
            state[new] = value.reshape(own[new].shape) if same_size else value
    return state


def convert(module: nn.Module, factory) -> nn.Module:
    """A copy of `module` with every Conv2d / Linear (+ its batch norm) built by `factory` (module docstring)."""
    pairs, outputs, order, called, read = _structure(module)
    net = copy.deepcopy(module)
    plain_layers = {}   # name -> why it has no Bayesian twin
    renamed = {}        # new state-dict key -> the module's (state_as_built)
    for name in order:
        affine = net.get_submodule(name)
        if type(affine) not in AFFINE:   # a Conv3d, a subclass (a quantization stub, a custom conv); a Conv1d
            # of a module module_builder made is a Conv2d by now (conv1d_as_conv2d)
            plain_layers[name] = type(affine).__name__
            continue
        if name in read:   # the forward also reads layer.weight itself, which the family's layer does not have
            plain_layers[name] = "called as a module and its weights also read directly (tied weights)"
            continue
        norm = net.get_submodule(pairs[name]) if name in pairs else None
        prunable = name not in outputs
        bias = affine.bias is not None
        if isinstance(affine, nn.Linear):
            layer = factory.linear(affine.in_features, affine.out_features, prunable=prunable, bias=bias)
        else:
            padding = _explicit_padding(affine)
            if affine.padding_mode != "zeros" or padding is None:
                plain_layers[name] = "padding"
                continue
            layer = factory.conv(affine.in_channels, affine.out_channels, affine.kernel_size, stride=affine.stride,
                                 padding=padding, groups=affine.groups, bias=bias, norm=norm is not None,
                                 prunable=prunable, dilation=affine.dilation)
        _start_from(layer, affine, norm)
        _replace(net, name, layer)
        if norm is not None:
            _replace(net, pairs[name], nn.Identity())
            if isinstance(layer, ConvNorm):   # the dnn twin: the pair's tensors under the layer's name
                renamed.update({f"{name}.conv.{k}": f"{name}.{k}" for k in affine.state_dict()})
                renamed.update({f"{name}.norm.{k}": f"{pairs[name]}.{k}" for k in norm.state_dict()})
    for name, m in module.named_modules():   # e.g. torchvision's swin_t: attention reads qkv.weight itself
        if not isinstance(m, AFFINE + PLAIN_ONLY) or name in order:
            continue
        whole = next((c for c in called if name.startswith(c + ".")), None)   # fx calls torch.nn's modules whole
        if whole is None:
            plain_layers[name] = "never called as a module (its weights read directly, or unused): FLOPs not counted"
        elif whole not in order:   # e.g. nn.TransformerEncoderLayer: its Linear layers run inside it
            plain_layers[name] = f"inside a {type(module.get_submodule(whole)).__name__} called whole"
    net.plain_layers = list(plain_layers)
    before = getattr(module, "original_keys", {})   # conv1d_as_conv2d's, less what this conversion moved again
    net.original_keys = {**{k: v for k, v in before.items() if k not in set(renamed.values())},
                         **{new: before.get(old, old) for new, old in renamed.items()}}
    if not set(order) - set(plain_layers):   # no layer became the family's
        found = f" (only {', '.join(sorted(set(plain_layers.values())))})" if plain_layers else ""
        raise ArchError(f"bayesianize: {type(module).__name__} has no nn.Linear or nn.Conv2d layer called in its "
                        f"forward{found}: nothing to make Bayesian, and no unit to switch off")
    if plain_layers:   # said once per process (warn_once)
        by_reason = {}
        for name, why in plain_layers.items():
            by_reason.setdefault(why, []).append(name)
        listed = "; ".join(f"{why}: {', '.join(names[:4])}{f' and {len(names) - 4} more' if len(names) > 4 else ''}"
                           for why, names in by_reason.items())
        message = (f"bayesianize: {len(plain_layers)} layer(s) of {type(module).__name__} have no Bayesian twin "
                   f"here and stay plain, deterministic and whole ({listed}); their FLOPs count in every ratio "
                   f"where they are called, and nothing switches their units off")
        warn_once(message)
    return net


def module_builder(make_module, pretrained=None):
    """build(factory, input_shape, classes) for train/arch.py from `make_module(classes) -> nn.Module`.

    The module is made (and `pretrained` loaded into it) once per process and converted for each factory,
    so the plain twin and the trained net have the same structure and names. For a nested family a copy
    of it is first reordered, most important channels first (`order_for_nesting`), before any conversion.
    """
    made = {}

    def build(factory, input_shape, classes):
        if classes not in made:
            module = make_module(classes)
            if pretrained:
                apply_state_dict(module, read_state_dict(pretrained), pretrained)
                _warn_skipped(module, pretrained)
            if (predicted := output_classes(module, input_shape, "model.arch")) != classes:
                raise ArchError(f"model.arch: {type(module).__name__} predicts {predicted} classes and the data has "
                                f"{classes}; make it take num_classes, or size its last layer to {classes}")
            made[classes] = conv1d_as_conv2d(module.eval())   # a copy where it has a Conv1d
            if factory.family in NESTED_FAMILIES:   # a copy: the caller's module keeps its order
                made[classes] = copy.deepcopy(made[classes])
                order_for_nesting(made[classes], input_shape)
        return convert(made[classes], factory)

    return build


def order_for_nesting(module, input_shape):
    """Reorder a plain module's channels, most important first, keeping its function (compressed/surgery.py,
    order_channels): a nested net keeps the first groups of every layer at narrow widths (paper 002), and
    a trained network's channels come in no order, so without this a narrow width of a fine-tuned network
    drops strong channels as often as weak ones. Returns the names of the layers reordered (the output
    layers never are).

    Importance of a group of coupled channels: the |scale| of the batch norms its convolutions feed (each
    channel's output scale, as network slimming ranks channels), from the writers that own one; the L2 norm
    of the writers' weights only where none does. A writer without a batch norm beside ones with it is left
    out: in EfficientNet the squeeze-and-excitation's excitation layer writes the same channels as the expand
    and depthwise convolutions, and its weights size a gate, not the channel. Counting it, as every writer was
    counted before, cost the narrow widths: efficientnet_b0 of benchmarks/finetune_compress.py (seed 0), the
    nested cut at width 14 (0.22 of the FLOPs) taken as a plain network and fine-tuned 5 epochs, validation
    accuracy over two fine-tuning seeds 0.713 / 0.798 counting it, 0.850 / 0.869 without it (Torch-Pruning's
    group L2 norm over every weight of the group, readers' too: 0.858 / 0.832; on mobilenet_v2 that norm gave
    0.801 / 0.793 where the batch norms give 0.875 / 0.846). Networks whose groups have no such mixed
    writers (mobilenet_v2, resnet18) are ordered as before."""
    pairs, *_ = _structure(module)

    def norm_of(name):
        norm = module.get_submodule(pairs[name]) if name in pairs else None
        return norm if norm is not None and getattr(norm, "weight", None) is not None else None

    def importance(writers):
        norms = [norm_of(name) for name, _ in writers]
        if any(n is not None for n in norms):
            return [None if n is None else n.weight.detach().abs() for n in norms]
        return [layer.weight.detach().flatten(1).norm(dim=1) for _, layer in writers]

    return order_channels(module, importance, torch.zeros((1,) + tuple(input_shape)))


def with_pretrained(build, path):
    """A build callable whose nets start from `path`, a state dict of the plain (dnn) net `build` makes.
    The file is read once: the plain twin is built again for every posterior sample and kept-units count."""
    state = {}

    def build_from(factory, input_shape, classes):
        first = not state
        if first:
            state.update(read_state_dict(path))
        net = build(factory, input_shape, classes)
        plain = apply_state_dict(build(LayerFactory("dnn"), input_shape, classes), state, path)
        if first:
            _warn_skipped(plain, path)
        start_from_plain(net, plain)
        return net
    return build_from


def load_matching(module, state):
    """Load into `module` the entries of `state` whose name and shape match its own; the others keep the
    module's values. The state dict handed over keeps the module's own `_metadata` (the version each
    submodule saved its state under): a module that converts old states in `_load_from_state_dict`
    (torchvision's MNASNet, batch norm) reads it, and MNASNet refuses a state dict without it."""
    target = module.state_dict()
    merged = OrderedDict((k, state[k] if k in state and state[k].shape == v.shape else v) for k, v in target.items())
    merged._metadata = getattr(target, "_metadata", OrderedDict())
    module.load_state_dict(merged)
    return module


@torch.no_grad()
def start_from_plain(net, plain):
    """Copy a plain twin's weights into the factory-built `net` of the same builder (names line up)."""
    load_matching(net, plain.state_dict())
    inside = {f"{n}.conv" for n, m in plain.named_modules() if isinstance(m, ConvNorm)}
    for name, mod in plain.named_modules():
        if isinstance(mod, ConvNorm):
            _start_from(net.get_submodule(name), mod.conv, mod.norm)
        elif isinstance(mod, AFFINE) and name not in inside:
            _start_from(net.get_submodule(name), mod, None)


def read_state_dict(path, key="model.pretrained"):
    """A state dict of tensors from `path` (weights_only; a pipeline checkpoint's "model" entry too); the errors name
    the config `key` that gave the path."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:   # torch's own text advises weights_only=False: never for a user's file
        raise InputError(f"{key} {path}: not a file of tensors that torch.load(weights_only=True) "
                         f"accepts (save one with torch.save(model.state_dict(), path))") from None
    except Exception as e:
        if Path(path).is_file() and not zipfile.is_zipfile(path):   # a text or other file: torch says `KeyError: 105`
            raise InputError(f"{key} {path}: not a file torch.save wrote (save one with "
                             f"torch.save(model.state_dict(), path))") from None
        raise InputError(f"{key} {path}: cannot load a state dict ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if isinstance(state, dict):   # a checkpoint that holds the state dict beside other entries (the pipeline's
        # "model", Lightning's "state_dict", a hand-written "model_state_dict")
        state = next((state[k] for k in STATE_DICT_KEYS if isinstance(state.get(k), dict)), state)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        held = f" (it holds {', '.join(map(repr, list(state)[:8]))})" if isinstance(state, dict) else ""
        raise InputError(f"{key} {path}: expected a state dict of tensors{held}; save one with "
                         f"torch.save(model.state_dict(), path)")
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:   # a diverged training's weights: every output NaN, which surgery's output check reports as a change
        raise InputError(f"{key} {path}: {len(bad)} tensor(s) hold NaN or infinite values "
                         f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})")
    return state


def apply_state_dict(module, state, path):
    """Load `state` into a plain module; tensors whose shapes differ (a classifier trained for another number
    of classes) keep their fresh initialisation, and `module.skipped_pretrained` names them."""
    own = module.state_dict()
    state = state_as_built(without_wrapper_prefix(state, own), module)
    fits = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    if not fits:
        raise InputError(f"model.pretrained {path}: none of its {len(state)} tensors matches the model "
                         f"(first keys: {list(state)[:3]}, model's: {list(own)[:3]})")
    if not any(v.dim() >= 2 for v in fits.values()):   # biases or norm scales matched by name: another net's file
        raise InputError(f"model.pretrained {path}: no weight matrix or kernel of the model is in it (only "
                         f"{', '.join(sorted(fits)[:3])}{', ...' if len(fits) > 3 else ''} match by name and shape): "
                         f"a checkpoint of another network; to start from part of a file on purpose, load it in "
                         f"your builder")
    load_matching(module, fits)   # with the module's state-dict versions (MNASNet refuses a state without them)
    module.skipped_pretrained = sorted(k for k in own if k not in fits)
    module.unused_pretrained = sorted(k for k in state if k not in own)
    return module


def _warn_skipped(module, path):
    """One warning naming the module's parameters that `path` left at their fresh initialisation: expected for
    a classifier trained on another number of classes, a sign of the wrong file when it is more."""
    params = {n for n, _ in module.named_parameters()}
    skipped = [k for k in module.skipped_pretrained if k in params]
    messages = []
    if skipped:
        messages.append(f"model.pretrained {path}: {len(skipped)} of {len(params)} parameters keep their fresh "
                        f"initialisation (no tensor of that name and shape there): {', '.join(skipped[:4])}"
                        f"{', ...' if len(skipped) > 4 else ''}")
    stats = {n for n, _ in module.named_buffers() if n.rpartition(".")[2] in ("running_mean", "running_var")}
    missing = [k for k in module.skipped_pretrained if k in stats]
    if missing:
        messages.append(f"model.pretrained {path}: {len(missing)} of {len(stats)} running statistics keep their "
                        f"fresh values (mean 0, variance 1): {', '.join(missing[:4])}"
                        f"{', ...' if len(missing) > 4 else ''}; save the whole torch.save(model.state_dict(), path), "
                        f"buffers included")
    unused = getattr(module, "unused_pretrained", [])
    if unused:
        messages.append(f"model.pretrained {path}: {len(unused)} of its tensors have no place in the model (no such "
                        f"name there): {', '.join(unused[:4])}{', ...' if len(unused) > 4 else ''}")
    for message in messages:   # the module is built again by later steps (the pre-flight)
        warn_once(message)


STATE_DICT_KEYS = ("model", "state_dict", "model_state_dict")   # where checkpoints keep the state dict
WRAPPER_PREFIXES = ("module.", "_orig_mod.")   # nn.DataParallel / DistributedDataParallel, torch.compile


def without_wrapper_prefix(state, own):
    """`state` without the prefix a training wrapper put on every key (a state dict saved from
    DistributedDataParallel(model) or torch.compile(model) names model's tensors module.* / _orig_mod.*; a
    Lightning module's, model.* after its attribute), where the module's own keys do not carry it."""
    while state and not any(k in own for k in state):
        first = {k.split(".", 1)[0] + "." for k in state}
        prefix = first.pop() if len(first) == 1 and all("." in k for k in state) else None
        if prefix is None:
            break
        stripped = {k[len(prefix):]: v for k, v in state.items()}
        if prefix not in WRAPPER_PREFIXES and not any(k in own for k in stripped):
            break   # an attribute's name only where that makes the keys the module's
        state = stripped
    return state


def check_runs(module, input_shape, name=None, where="model.arch"):
    """That `module` runs on a batch of two inputs of `input_shape` (zeros) in evaluation and in training mode
    and returns a tensor: else one ArchError naming it (`name`, or its class) and the shape. The module's mode
    and torch's seeded stream are left as they were (dropout, and a Bayesian net's noise in both modes)."""
    name, was_training = name or type(module).__name__, module.training
    inner = ("module" if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)) else
             "_orig_mod" if isinstance(getattr(module, "_orig_mod", None), nn.Module) else None)
    if inner:   # fx traces neither a multi-GPU wrapper nor torch.compile's: their message said nothing of this
        raise ArchError(f"{where}: {name} wraps the network (multi-GPU training or torch.compile); pass the network "
                        f"inside it (its .{inner})")
    dtypes = sorted({str(p.dtype) for p in module.parameters() if p.is_floating_point() and p.dtype != torch.float32})
    if dtypes:   # it failed on float32 inputs as "does not run on inputs of the data's shape"
        raise ArchError(f"{where}: {name} holds {', '.join(dtypes)} parameters; edgebayes trains and exports float32 "
                        f"networks: convert it with .float() first")
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            module.eval()(torch.zeros((2,) + tuple(input_shape)))
            training = copy.deepcopy(module).train()(torch.zeros((2,) + tuple(input_shape)))
    except Exception as e:
        raise ArchError(f"{where}: {name} does not run on inputs of the data's shape "
                        f"{tuple(input_shape)} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                        f"{_input_hint(str(e), input_shape)}") from None
    if not isinstance(training, torch.Tensor):   # torchvision's googlenet / inception_v3 with auxiliary heads
        raise ArchError(f"{where}: {name} returns {type(training).__name__} in training mode, "
                        f"not a tensor of class scores; build it without auxiliary outputs (torchvision: "
                        f"aux_logits=False)")
    module.train(was_training)


def _input_hint(error, input_shape):
    """What to change when the first layer and the data disagree on channels or dimensions (torch's message
    says what the layer expected, not which setting gives it)."""
    wanted = re.search(r"expected input\[.*?\] to have (\d+) channels", error)
    if wanted and len(input_shape) == 3 and int(wanted.group(1)) in (1, 3) and input_shape[0] in (1, 3):
        return (f"; the network takes {wanted.group(1)} channels and the data has {input_shape[0]}: set "
                f"data.channels: {wanted.group(1)} to convert the images (in Python, convert the inputs)")
    if re.search(r"input to conv1d|conv1d, but got input of size", error) and len(input_shape) != 2:
        return ("; a Conv1d network takes (channels, length) signals: set data.signals: true to read 3-D arrays "
                "as signals")
    return ""


def output_classes(module, input_shape, where="bayesianize"):
    """The number of classes `module` predicts (its output's second dimension), checking that it runs."""
    check_runs(module, input_shape, where=where)
    with torch.no_grad():
        out = module.eval()(torch.zeros((1,) + tuple(input_shape)))
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ArchError(f"{where}: {type(module).__name__} must return [batch, classes] logits, got {shape} "
                        f"for a batch of one")
    if not out.is_floating_point():   # class indices (argmax) or rounded scores: no softmax, no gradient
        raise ArchError(f"{where}: {type(module).__name__} returns {out.dtype} values; it must return "
                        f"[batch, classes] logits as floating-point numbers (leave out any argmax or rounding)")
    if out.shape[1] < 2:   # a one-logit binary classifier (BCE) was taken as a net of one class
        raise ArchError(f"{where}: {type(module).__name__} returns {out.shape[1]} score per input; a classifier here "
                        f"returns a score (logit) per class, at least 2: for a binary task, size its last layer to 2 "
                        f"(cross-entropy over two logits in place of BCE over one)")
    return out.shape[1]
