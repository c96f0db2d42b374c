"""Metrics of training: predictive (from the on-device package, so they are defined once) and OOD detection.

Predictive metrics (accuracy, NLL, ECE with 15 equal-width bins, Brier) live in edgebayes.ondevice.metrics,
which the device runs and which imports nothing of edgebayes; everything here reuses them. Structural
metrics (node sparsity, compression and FLOPs ratios of paper 000) are in edgebayes/compressed/structure.py,
beside the samples they count.
"""

import numpy as np
from sklearn.metrics import average_precision_score, roc_auc_score

from edgebayes.ondevice.metrics import classification_metrics, reliability_bins  # noqa: F401


def ood_scores(probs_in: np.ndarray, probs_out: np.ndarray) -> dict:
    """OOD detection with predictive entropy as the score, the OOD set as positives: AUROC and AUPR."""
    def entropy(p):
        return -(p * np.log(np.clip(p, 1e-12, 1))).sum(1)
    scores = np.concatenate([entropy(probs_in), entropy(probs_out)])
    labels = np.concatenate([np.zeros(len(probs_in)), np.ones(len(probs_out))])
    return {"auroc": float(roc_auc_score(labels, scores)), "aupr": float(average_precision_score(labels, scores))}
