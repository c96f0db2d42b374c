"""Predictive metrics in plain numpy, shared by the device and the rest of edgebayes (defined once).

`probs` is [N, C] predictive probabilities (already MC-averaged), `y` is [N] integer labels. All sums are
done in float64 so that fp16/fp32 model outputs do not change the metric definitions.
"""

import numpy as np

NLL_CLIP = 1e-12      # log(0) would make one bad example dominate the mean
PROB_TOLERANCE = 1e-2  # how far a row of probabilities may stray from [0, 1] and from summing to 1
# Fractions of the evaluation set rejected (most uncertain first) for the accuracy-vs-rejection curve.
REJECTION_FRACTIONS = tuple(round(0.05 * i, 2) for i in range(19))   # 0 .. 0.9


def check_probabilities(probs):
    """Refuse what is not class probabilities: logits or scores give an NLL, ECE and Brier score that mean nothing,
    without a word. For arrays a user hands over (eb.metrics); the exported graphs end in a softmax average, and a
    quantized one may stray further than the tolerance, which admits an average of fp16 softmaxes (rows within
    about 1e-3 of 1)."""
    probs = np.asarray(probs, dtype=np.float64)
    if probs.ndim == 2 and probs.size and np.isfinite(probs).all() and (
            probs.min() < -PROB_TOLERANCE or probs.max() > 1 + PROB_TOLERANCE
            or np.abs(probs.sum(axis=1) - 1).max() > PROB_TOLERANCE):
        raise ValueError(f"probs must be class probabilities, each row in [0, 1] summing to 1 (got values in "
                         f"[{probs.min():.3g}, {probs.max():.3g}], row sums in [{probs.sum(1).min():.3g}, "
                         f"{probs.sum(1).max():.3g}]); pass softmax outputs, not logits")


def _check_probs_labels(probs, y):
    probs = np.asarray(probs, dtype=np.float64)
    y = np.asarray(y)
    if probs.ndim != 2:
        raise ValueError(f"probs must be 2-D [N, C], got shape {probs.shape}")
    if y.ndim != 1 or y.shape[0] != probs.shape[0]:
        raise ValueError(f"y must be 1-D with N={probs.shape[0]} entries, got shape {y.shape}")
    if probs.shape[0] == 0:
        raise ValueError("metrics of an empty set are undefined")
    if not np.isfinite(probs).all():
        raise ValueError(f"probs holds NaN or infinite values ({int((~np.isfinite(probs)).any(1).sum())} of "
                         f"{probs.shape[0]} rows)")
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"y must hold integer class labels, got dtype {y.dtype}")
    if y.min() < 0 or y.max() >= probs.shape[1]:
        raise ValueError(f"labels must lie in [0, {probs.shape[1]}), got [{y.min()}, {y.max()}]")
    return probs, y.astype(np.int64)


def accuracy(probs, y):
    """Fraction of examples whose argmax class equals the label: mean(argmax_c p = y)."""
    probs, y = _check_probs_labels(probs, y)
    return float(np.mean(probs.argmax(axis=1) == y))


def negative_log_likelihood(probs, y):
    """Mean negative log-likelihood: mean_i -log(max(p_i[y_i], 1e-12)), natural log."""
    probs, y = _check_probs_labels(probs, y)
    p_true = probs[np.arange(len(y)), y]
    return float(np.mean(-np.log(np.clip(p_true, NLL_CLIP, 1.0))))


def _confidence_bins(probs, y, n_bins):
    """Per-bin count, summed confidence and summed correctness over equal-width confidence bins.

    confidence_i = max_c p_i[c]; bins are (k/n, (k+1)/n] (the first also holds 0).
    """
    probs, y = _check_probs_labels(probs, y)
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    conf = probs.max(axis=1)
    correct = (probs.argmax(axis=1) == y).astype(np.float64)
    # searchsorted on the inner edges puts conf into (lo, hi] bins, exactly
    # like the usual `lo < conf <= hi` loop, but in one vectorised step.
    inner_edges = np.linspace(0.0, 1.0, n_bins + 1)[1:-1]
    bin_idx = np.searchsorted(inner_edges, conf, side="left")
    counts = np.bincount(bin_idx, minlength=n_bins)
    sum_conf = np.bincount(bin_idx, weights=conf, minlength=n_bins)
    sum_correct = np.bincount(bin_idx, weights=correct, minlength=n_bins)
    return counts, sum_conf, sum_correct


def per_example(probs, y, n_bins=15):
    """Each example's share of accuracy, NLL and ECE: (correct, nll, bin index, correct - confidence).

    accuracy and nll are the means of the first two, and ECE = sum_b |sum_{i in b} (correct_i - conf_i)| / N
    with the bins of `_confidence_bins`, so a paired bootstrap can re-weight the examples and recompute all
    three for several models at once (deploy/selection.py)."""
    probs, y = _check_probs_labels(probs, y)
    conf = probs.max(axis=1)
    correct = (probs.argmax(axis=1) == y).astype(np.float64)
    nll = -np.log(np.clip(probs[np.arange(len(y)), y], NLL_CLIP, 1.0))
    bin_idx = np.searchsorted(np.linspace(0.0, 1.0, n_bins + 1)[1:-1], conf, side="left")
    return correct, nll, bin_idx, correct - conf


def expected_calibration_error(probs, y, n_bins=15):
    """Expected calibration error with `n_bins` equal-width confidence bins.

    ECE = sum_b |b|/N * |accuracy(b) - mean confidence(b)|, empty bins
    contribute 0 (Guo et al., 2017); bins as in `_confidence_bins`.
    """
    counts, sum_conf, sum_correct = _confidence_bins(probs, y, n_bins)
    # |bin|/N * |acc - conf| == |sum_correct - sum_conf| / N per bin.
    return float(np.sum(np.abs(sum_correct - sum_conf)) / counts.sum())


def reliability_bins(probs, y, n_bins=15):
    """The reliability diagram behind the ECE: per bin, mean confidence,
    accuracy (None for an empty bin) and count."""
    counts, sum_conf, sum_correct = _confidence_bins(probs, y, n_bins)
    safe = np.maximum(counts, 1)
    return {
        "bin_confidence": [float(c) if n else None for c, n in zip(sum_conf / safe, counts)],
        "bin_accuracy": [float(a) if n else None for a, n in zip(sum_correct / safe, counts)],
        "bin_count": [int(n) for n in counts],
    }


def brier_score(probs, y):
    """Multi-class Brier score: mean_i sum_c (p_i[c] - onehot(y_i)[c])^2 (range 0..2)."""
    probs, y = _check_probs_labels(probs, y)
    onehot = np.zeros_like(probs)
    onehot[np.arange(len(y)), y] = 1.0
    return float(np.mean(np.sum((probs - onehot) ** 2, axis=1)))


def classification_metrics(probs, y):
    """All metrics above as a dict: accuracy, nll, ece (15 bins), brier, n."""
    return {
        "accuracy": accuracy(probs, y),
        "nll": negative_log_likelihood(probs, y),
        "ece": expected_calibration_error(probs, y, n_bins=15),
        "brier": brier_score(probs, y),
        "n": int(len(y)),
    }


def predictive_entropy(probs):
    """Entropy of the MC-averaged predictive distribution, -sum_c p[c] log p[c] (nats): the uncertainty
    score for OOD detection and selective prediction (train/metrics.ood_scores uses the same)."""
    probs = np.asarray(probs, dtype=np.float64)
    return -(probs * np.log(np.clip(probs, NLL_CLIP, 1.0))).sum(axis=1)


def auroc(scores, labels):
    """Area under the ROC curve of `scores` for binary `labels` (1 = positive): the Mann-Whitney statistic
    with tied scores given their average rank, so it equals scikit-learn's roc_auc_score."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels).astype(bool)
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUROC needs positives and negatives")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    counts = np.diff(np.r_[starts, len(scores)])
    ranks = np.empty(len(scores))
    ranks[order] = np.repeat(starts + (counts + 1) / 2.0, counts)   # 1-based average rank of each tie group
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def average_precision(scores, labels):
    """Area under the precision-recall curve as scikit-learn's average_precision_score computes it:
    sum over distinct thresholds of (recall step) x precision, positives = label 1."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels).astype(np.float64)
    if labels.sum() == 0:
        raise ValueError("average precision needs positives")
    order = np.argsort(-scores, kind="mergesort")
    sorted_scores, sorted_labels = scores[order], labels[order]
    last = np.r_[np.flatnonzero(sorted_scores[1:] != sorted_scores[:-1]), len(scores) - 1]  # end of each tie group
    tps = np.cumsum(sorted_labels)[last]
    precision, recall = tps / (last + 1), tps / tps[-1]
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def ood_detection(probs_in, probs_out):
    """OOD detection by predictive entropy, the OOD inputs as positives: AUROC and AUPR (as in training's
    metrics.json, here on the device's own outputs)."""
    for name, p in (("probs_in", probs_in), ("probs_out", probs_out)):
        if not np.isfinite(np.asarray(p, dtype=np.float64)).all():
            raise ValueError(f"ood_detection: {name} holds NaN or infinite values (a NaN entropy would rank as "
                             f"the most uncertain and inflate the AUROC)")
    scores = np.concatenate([predictive_entropy(probs_in), predictive_entropy(probs_out)])
    labels = np.concatenate([np.zeros(len(probs_in)), np.ones(len(probs_out))])
    return {"auroc": auroc(scores, labels), "aupr": average_precision(scores, labels), "score": "predictive entropy",
            "n_in": int(len(probs_in)), "n_out": int(len(probs_out))}


def selective_prediction(probs, y, fractions=REJECTION_FRACTIONS):
    """Accuracy against the fraction rejected: the examples with the highest predictive entropy are
    refused first (a Bayesian net's point: it can say "not sure"). Per fraction r, the accuracy on the
    ceil((1 - r) N) most certain examples and the entropy threshold that keeps them."""
    probs, y = _check_probs_labels(probs, y)
    entropy = predictive_entropy(probs)
    order = np.argsort(entropy, kind="mergesort")            # most certain first
    correct = (probs.argmax(axis=1) == y)[order]
    rows = {"rejected": [], "kept": [], "accuracy": [], "max_entropy": []}
    for r in fractions:
        kept = max(1, int(np.ceil((1.0 - r) * len(y))))
        rows["rejected"].append(float(r))
        rows["kept"].append(kept)
        rows["accuracy"].append(float(correct[:kept].mean()))
        rows["max_entropy"].append(float(entropy[order[kept - 1]]))
    return {**rows, "score": "predictive entropy", "n": int(len(y))}

