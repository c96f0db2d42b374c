"""Metrics: predictive (from the device runner, so they are defined once) and structural (paper 000).

Predictive metrics (accuracy, NLL, ECE with 15 equal-width bins, Brier) live in the standalone device
runner, which must not import this package; everything here reuses them.

Structural metrics follow paper 000 exactly:
  - node sparsity (eq. 17) = O_pr / O, kept units over units, per layer;
  - compression ratio = non-zero weights of the compressed net / weights of the dense net (biases count);
  - FLOPs ratio with appendix A.1's formula, multiplies only:
      linear  (I_pr + 1) O_pr;     conv  (C_in,pr Kw Kh + 1) Ow Oh C_out,pr.
"""

import numpy as np
import torch
from sklearn.metrics import average_precision_score, roc_auc_score
from torch import nn

from edgebayes.deploy.runner import classification_metrics, reliability_bins  # noqa: F401


def paper_flops(module: nn.Module, input_shape) -> int:
    """FLOPs of a plain module for one example, by appendix A.1 (counted over Linear and Conv2d)."""
    total = 0

    def linear_hook(m, inputs, output):
        nonlocal total
        total += (m.in_features + 1) * m.out_features

    def conv_hook(m, inputs, output):
        nonlocal total
        oh, ow = output.shape[-2:]
        kh, kw = m.kernel_size
        total += ((m.in_channels // m.groups) * kw * kh + 1) * ow * oh * m.out_channels

    handles = []
    for m in module.modules():
        if isinstance(m, nn.Linear):
            handles.append(m.register_forward_hook(linear_hook))
        elif isinstance(m, nn.Conv2d):
            handles.append(m.register_forward_hook(conv_hook))
    try:
        with torch.no_grad():
            module(torch.zeros((1,) + tuple(input_shape)))
    finally:
        for h in handles:
            h.remove()
    return total


def count_weights(module: nn.Module, nonzero_only=False) -> int:
    """Weights and biases of the Linear / Conv2d layers of a plain module."""
    total = 0
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            for p in (m.weight, m.bias):
                if p is not None:
                    total += int((p != 0).sum()) if nonzero_only else p.numel()
    return total


def structure_report(dense: nn.Module, pruned: nn.Module, kept: dict, input_shape) -> dict:
    """Per-layer node sparsity, compression ratio and FLOPs ratio of a pruned sample against its dense net.

    `kept` maps each layer's name to the boolean mask of its kept output units (or channels).
    """
    layers = [{"name": n, "kept": int(m.sum()), "total": int(m.numel()),
               "node_sparsity": float(m.sum()) / m.numel()} for n, m in kept.items()]
    dense_flops, pruned_flops = paper_flops(dense, input_shape), paper_flops(pruned, input_shape)
    dense_w, kept_w = count_weights(dense), count_weights(pruned)
    return {
        "layers": layers,
        "dense_weights": dense_w, "kept_weights": kept_w, "compression_ratio": kept_w / dense_w,
        "dense_flops": dense_flops, "pruned_flops": pruned_flops, "flops_ratio": pruned_flops / dense_flops,
    }


def ood_scores(probs_in: np.ndarray, probs_out: np.ndarray) -> dict:
    """OOD detection with predictive entropy as the score, the OOD set as positives: AUROC and AUPR."""
    def entropy(p):
        return -(p * np.log(np.clip(p, 1e-12, 1))).sum(1)
    scores = np.concatenate([entropy(probs_in), entropy(probs_out)])
    labels = np.concatenate([np.zeros(len(probs_in)), np.ones(len(probs_out))])
    return {"auroc": float(roc_auc_score(labels, scores)), "aupr": float(average_precision_score(labels, scores))}
