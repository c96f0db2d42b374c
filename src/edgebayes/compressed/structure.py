"""Structural metrics of a plain module (paper 000): what a compressed sample costs.

Follow paper 000 exactly:
  - node sparsity (eq. 17) = O_pr / O, kept units over units, per layer;
  - compression ratio = non-zero weights of the compressed net / weights of the dense net (biases count);
  - FLOPs ratio with appendix A.1's formula, multiplies only:
      linear  (I_pr + 1) O_pr;     conv  (C_in,pr Kw Kh + 1) Ow Oh C_out,pr,
    over every Linear and Conv2d (for ResNets: the convolutions and the last linear layer, as the paper).
    Where this extends the paper: a Linear on (B, T, F) counts once per position t, a Conv1d or Conv3d by the
    same formula over its one or three kernel and output dimensions, an nn.MultiheadAttention its four
    projections as Linear maps per token (not the attention's products of activations, as the formula counts
    affine maps only), a transposed convolution by the formula over its input positions (each multiplies the
    kernel once), an nn.LSTM / GRU / RNN its input and hidden maps as Linear maps per time step. Those stay plain
    layers (train/bayesianize.py has no Bayesian twin for them) and nothing switches them off, but they cost what they cost: a 1-D network's ratio without them counted only its
    Linear layers.
"""

import math

import torch
from torch import nn

from edgebayes.compressed.surgery import probe_inputs
from edgebayes.errors import ArchError

# the layers FLOPs and weights are counted over: every convolution, transposed ones too (a ConvTranspose2d is no
# Conv2d subclass); recurrent layers (nn.LSTM, nn.GRU, nn.RNN) are counted apart (_recurrent_costs)
COSTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.modules.conv._ConvTransposeNd)
RECURRENT = (nn.RNNBase,)


def _recurrent_costs(m, x):
    """(FLOPs, weights) of a recurrent layer for one example: every time step multiplies its input and its hidden
    state by each layer's (and direction's) input and hidden weights, by the formula's (I + 1) O per map."""
    if isinstance(x, nn.utils.rnn.PackedSequence):
        steps = int(x.batch_sizes.numel())
    else:
        steps = x.shape[1] if (x.dim() == 3 and m.batch_first) else x.shape[0]
    maps = [p for n, p in m.named_parameters(recurse=False) if n.startswith(("weight_ih", "weight_hh", "weight_hr"))]
    flops = steps * sum(w.numel() + w.shape[0] for w in maps)
    return flops, sum(p.numel() for p in m.parameters(recurse=False))


def _on_probe(run, module, probe):
    """run(), which calls `module` on the random-normal `probe`; a network that cannot take such an input is
    refused by name (an nn.Embedding's token ids: a bare IndexError from deep in the FLOPs count)."""
    try:
        return run()
    except (IndexError, RuntimeError) as e:
        # only a net that takes ids is refused here: any other failure (a bug of the net's or of the FLOPs
        # count's own hooks) keeps its own error and traceback, not a message blaming the probe
        if not any(isinstance(m, nn.Embedding) for m in module.modules()):
            raise
        raise ArchError(f"{type(module).__name__} fails on a random-normal float input of shape "
                        f"{tuple(probe.shape[1:])} ({type(e).__name__}: {e}): edgebayes counts FLOPs and checks "
                        f"surgery on such probes, so a network whose inputs must be integer ids (nn.Embedding) or "
                        f"lie in a fixed range is not supported") from e


def _layer_costs(module: nn.Module, input_shape, effective: bool, terms=None):
    """(FLOPs, weights) of the Linear / Conv2d layers of a plain module, for one example, by appendix A.1.
    A list `terms` receives each layer's (layer, live output rows, live input channels, kernel size, positions),
    the parts its FLOPs are made of (train/flops_target.py's GroupFlops counts masks from them; paper_flops passes it on).

    effective=False counts the module's shapes. effective=True counts a masked module as the paper does:
    C_out,pr = outputs whose weight row or bias is non-zero, C_in,pr = input channels that are not
    identically zero, so dead units count as pruned before any surgery. "Identically zero" is measured by
    surgery's probe (compressed/surgery.py, probe_inputs: one definition of "dead"): zero on a random batch and on a batch where
    everything that depends on the input is driven to both signs. Zero on a random batch alone would also
    count a live ReLU unit that is off for the few probe examples (common where maps are 1x1 or 2x2).

    A grouped convolution's output reads only the input channels of its group, so C_in,pr is counted per
    group: a depthwise output reads one channel, 1 if it is live, 0 if not (C_in,pr // groups, the live
    inputs of the whole layer divided by the groups, is 0 as soon as one input channel is dead).
    """
    flops = weights = 0
    probe = torch.randn((4,) + tuple(input_shape), generator=torch.Generator().manual_seed(0))
    if effective:
        ranges = _on_probe(lambda: probe_inputs(module.eval(), probe), module, probe)

    def hook(m, inputs, output):
        nonlocal flops, weights
        w = m.weight
        conv = not isinstance(m, nn.Linear)
        groups = m.groups if conv else 1
        transposed = isinstance(m, nn.modules.conv._ConvTransposeNd)
        if transposed:   # [in, out / groups, *k] -> a convolution's [out, in / groups, *k], group by group
            w = w.reshape(groups, w.shape[0] // groups, *w.shape[1:]).transpose(1, 2).reshape(
                w.shape[1] * groups, w.shape[0] // groups, *w.shape[2:])
        if effective:
            rows = w.flatten(1).abs().sum(1) > 0
            if m.bias is not None:
                rows |= m.bias != 0
        else:
            rows = torch.ones(w.shape[0], dtype=torch.bool)
        if effective and m in ranges:   # the probe covers the Linear / Conv2d layers surgery acts on
            lo, hi, _ = ranges[m]
            live_in = (lo != 0) | (hi != 0)
        else:
            live_in = torch.ones(m.in_channels if conv else m.in_features, dtype=torch.bool)
        # C_in,pr of each live output: the live inputs of its group; summed over the live outputs
        c_in = int(live_in.view(groups, -1).sum(1).repeat_interleave(w.shape[0] // groups)[rows].sum())
        c_out = int(rows.sum())
        bias = 1 if m.bias is not None else 0
        # per position: a Linear on (B, T, F) (a transformer's tokens) maps every one of the T
        kernel = math.prod(m.kernel_size) if conv else 1
        # a transposed convolution multiplies every input position by its kernel once
        positions = (math.prod(inputs[0].shape[2:]) if transposed else math.prod(output.shape[2:])) if conv \
            else math.prod(output.shape[1:-1])
        flops += (c_in * kernel + c_out) * positions   # the formula's +1 is there with or without a bias
        weights += c_in * kernel + bias * c_out
        if terms is not None:
            terms.append((m, rows, live_in, kernel, positions))

    def attention_hook(m, args, kwargs, output):
        """nn.MultiheadAttention: its four projections, Linear maps by the same formula, per token (the
        attention's own products, of activations with activations, are not affine maps and not counted)."""
        nonlocal flops, weights
        query = args[0] if len(args) > 0 else kwargs["query"]
        key = args[1] if len(args) > 1 else kwargs["key"]

        def tokens(t):   # (L, E) unbatched, (L, N, E), or (N, L, E) with batch_first
            return t.shape[1] if t.dim() == 3 and m.batch_first else t.shape[0]

        e, bias = m.embed_dim, int(m.in_proj_bias is not None)
        per_query, per_key = (e + 1) * e * 2, (m.kdim + 1) * e + (m.vdim + 1) * e   # q and out; k and v
        flops += per_query * tokens(query) + per_key * tokens(key)
        weights += e * e * 2 + m.kdim * e + m.vdim * e + bias * 3 * e + int(m.out_proj.bias is not None) * e

    def recurrent_hook(m, inputs, output):
        """nn.LSTM / GRU / RNN: plain and whole (no Bayesian twin), what it costs counts like attention's."""
        nonlocal flops, weights
        f, w = _recurrent_costs(m, inputs[0])
        flops += f
        weights += w

    handles = [m.register_forward_hook(hook) for m in module.modules() if isinstance(m, COSTED)]
    handles += [m.register_forward_hook(attention_hook, with_kwargs=True) for m in module.modules()
                if isinstance(m, nn.MultiheadAttention)]
    handles += [m.register_forward_hook(recurrent_hook) for m in module.modules() if isinstance(m, RECURRENT)]
    try:
        with torch.no_grad():
            _on_probe(lambda: module.eval()(probe[:1]), module, probe)
    finally:
        for h in handles:
            h.remove()
    return flops, weights


def paper_flops(module: nn.Module, input_shape, effective=False, terms=None) -> int:
    """FLOPs of a plain module for one example by appendix A.1 (COSTED layers; see _layer_costs, also for
    `terms`)."""
    return _layer_costs(module, input_shape, effective, terms)[0]


def _folded_batch_norms(module: nn.Module):
    """The BatchNorm2d modules that directly follow a bias-free Conv2d, its only reader: the exporter folds each
    into the convolution as a bias. Read from the torch.fx graph (a forward that calls them one after the other,
    not only an nn.Sequential's neighbours); where fx cannot trace the module, from nn.Sequential neighbours.
    Traced only where those neighbours leave a batch norm out (select counts every sample of every candidate:
    tracing a mobilenet_v2 costs tens of milliseconds)."""
    neighbours = [b for seq in module.modules() if isinstance(seq, nn.Sequential)
                  for a, b in zip(list(seq.children()), list(seq.children())[1:])
                  if isinstance(a, nn.Conv2d) and a.bias is None and isinstance(b, nn.BatchNorm2d)]
    norms = [m for m in module.modules() if isinstance(m, nn.BatchNorm2d)]
    bias_free = any(isinstance(m, nn.Conv2d) and m.bias is None for m in module.modules())
    if len(neighbours) == len(norms) or not bias_free:
        yield from neighbours
        return
    try:
        graph = torch.fx.symbolic_trace(module).graph
    except Exception:
        yield from neighbours
        return
    mods = dict(module.named_modules())
    for n in graph.nodes:
        src = n.args[0] if n.op == "call_module" and n.args else None
        if (isinstance(mods.get(n.target), nn.BatchNorm2d) and isinstance(src, torch.fx.Node)
                and src.op == "call_module" and isinstance(mods[src.target], nn.Conv2d)
                and mods[src.target].bias is None and len(src.users) == 1):
            yield mods[n.target]


def count_weights(module: nn.Module, nonzero_only=False, fold_batch_norm=False) -> int:
    """Weights and biases of the Linear and convolution layers of a plain module (COSTED).

    fold_batch_norm=True counts the network as exported: a batch norm right after a bias-free convolution
    (in an nn.Sequential) folds into it and gives it one bias per channel.
    """
    total = 0
    if fold_batch_norm:
        total += sum(bn.num_features for bn in _folded_batch_norms(module))
    for m in module.modules():
        if isinstance(m, COSTED):
            own = (m.weight, m.bias)
        elif isinstance(m, (nn.MultiheadAttention,) + RECURRENT):
            # attention's input projections (its out_proj is a Linear); a recurrent layer's every weight
            own = tuple(m.parameters(recurse=False))
        else:
            continue
        for p in own:
            if p is not None:
                total += int((p != 0).sum()) if nonzero_only else p.numel()
    return total


def structure_report(dense: nn.Module, pruned: nn.Module, kept: dict, input_shape) -> dict:
    """Per-layer node sparsity, compression and FLOPs ratio of a posterior sample (paper 000, section 5).

    `dense` is the sample with dead units zeroed, `pruned` the same after surgery, `kept` maps each
    layer's name to the boolean mask of its kept output units (or channels). compression_ratio and
    flops_ratio count as the paper does, by the masks (`_layer_costs(effective=True)`); the physical_*
    ratios count the network after surgery. Physical is higher where surgery cannot remove a dead channel
    exactly (a residual-stream channel live in another block, a constant read by a padded convolution, an
    expand channel whose depthwise channel is live: surgery's report says which and why); it can be lower,
    since surgery also removes what the masks count as live: a producer channel that only a dead depthwise
    channel reads, a channel that is a constant folded into the next layer's bias.
    """
    layers = [{"name": n, "kept": int(m.sum()), "total": int(m.numel()),
               "node_sparsity": float(m.sum()) / m.numel()} for n, m in kept.items()]
    dense_flops, dense_w = _layer_costs(dense, input_shape, effective=False)
    masked_flops, masked_w = _layer_costs(dense, input_shape, effective=True)
    pruned_flops, kept_w = _layer_costs(pruned, input_shape, effective=False)
    return {
        "layers": layers,
        "dense_weights": dense_w, "kept_weights": kept_w, "compression_ratio": masked_w / dense_w,
        "physical_compression_ratio": kept_w / dense_w,
        "dense_flops": dense_flops, "pruned_flops": pruned_flops, "flops_ratio": masked_flops / dense_flops,
        "physical_flops_ratio": pruned_flops / dense_flops,
    }
