"""The device's budgets as a share of the network, before training (issue 33 item 2).

From what the pre-flight's exports tell of the untrained network (export/preflight.py: file sizes, operator
counts, one sample's FLOPs and weights), for each budget the network exceeds at the fewest MC samples select
may choose: the share of its weights that fits budgets.model_mb, and the share of its FLOPs that fits
budgets.latency_ms by the device's latency model (deploy/latency_model.py, what select predicts with).
`train` says them as advice (`target_advice`), or takes the smallest as its target when train.flops_target
is `device` (`device_flops_target`). Said, not enforced: select decides after training.
"""

import math
from pathlib import Path

from edgebayes.config import SPIKE_SLAB_FAMILIES, ConfigError
from edgebayes.errors import StageError


def budget_shares(cfg, profile, facts, runs_dir=None):
    """{"model_mb" / "latency_ms": (share, where)} for each device budget the untrained network exceeds at the
    fewest MC samples select may choose: the share of its weights (model_mb) or FLOPs (latency_ms) that fits,
    0 where none does, and a line saying what was measured against what. facts: the pre-flight's."""
    shares = {}
    for name, found in (("model_mb", model_budget_share(cfg, profile, facts["sizes"], facts["m"],
                                                        facts.get("sizes_one"))),
                        ("latency_ms", latency_budget_share(cfg, profile, facts["operators"], facts["per_sample"],
                                                            runs_dir))):
        if found is not None:
            shares[name] = found
    return shares


def device_flops_target(shares, profile):
    """train.flops_target `device`: the smallest share `budget_shares` found, rounded down to two decimals,
    or None when the dense network fits every budget (nothing to remove). A budget no share fits (the fixed
    per-operator latency) or one that leaves under 1% of the network is a ConfigError naming it (exit 2)."""
    if shares is None:   # the pre-flight was skipped
        raise StageError("train.flops_target device: the untrained network could not be compressed to measure it "
                         "against the device's budgets (the pre-flight's line above); give the share instead")
    if not shares:
        return None
    name, (share, where) = min(shares.items(), key=lambda item: item[1][0])
    if share < 0.01:   # bad input like an unreachable numeric target (exit 2), not a stage that failed (exit 1)
        raise ConfigError(f"train.flops_target device: {where}" + (
            "" if share > 0 else "; fewer layers, fewer MC samples or another runtime can fit it, a FLOPs target "
                                 "cannot") + f"; raise budgets.{name} of {profile.name} or use a smaller network")
    return math.floor(share * 100) / 100


def _fewest_mc_samples(cfg, profile):
    """The fewest MC samples select may choose on this device."""
    return min(profile.budgets.allowed_mc_samples(cfg.select.mc_samples) or cfg.select.mc_samples)


def target_advice(cfg, where, share):
    """The line for a network that fits a budget with `share` of its dense size (weights or FLOPs), or None
    when train.flops_target already asks for that much (or the family is one select shrinks by itself)."""
    family, target = cfg.model.family, cfg.train.flops_target
    if share >= (target or 1.0) or family not in SPIKE_SLAB_FAMILIES + ("dnn", "bnn"):
        return None
    if share <= 0:
        return where
    if family not in SPIKE_SLAB_FAMILIES:
        return f"{where}, and model.family {family} removes none; use ss-gl or ss-ghs with train.flops_target"
    # rounded down, to two decimals (one significant digit below 0.01): "or less" must hold for the shown value
    digits = 2 if share >= 0.01 else 1 - math.floor(math.log10(share))
    shown = f"{math.floor(share * 10 ** digits) / 10 ** digits:.{digits}f}"
    if target is None:
        return (f"{where}; set train.flops_target to {shown} or less (a share of the dense FLOPs), or to device "
                f"(the largest share every budget of the device allows)")
    return f"{where}; train.flops_target {target:g} is too large: set it to {shown} or less, or to device"


def model_budget_share(cfg, profile, sizes, m, sizes_one=None):
    """(share, where) when the untrained network's file is larger than the device's model_mb budget, else None.

    `sizes`: {format select scores: bytes of its file holding m samples}; `sizes_one`: the same files at M = 1,
    where the pre-flight made them. The smallest file, scaled to the fewest MC samples select may choose, against
    the budget: the share of the weights that fits. A FLOPs
    target removes weights about as much as FLOPs (benchmarks/results/finetune_compress.md: a params ratio of
    0.48 at 0.5 of the FLOPs, 0.23 at 0.25, on four networks), so that share is what to give as
    train.flops_target. Nested (width) and SQS nets are made small by select's own knob."""
    budget = profile.budgets.model_mb
    if budget is None or not sizes:
        return None
    fewest = _fewest_mc_samples(cfg, profile)

    def parts(fmt):
        """(fixed bytes, bytes per sample) of a format's file. A file is fixed bytes (graph, names, quantization
        scales) + M x one sample's; with the same file at M = 1 (`sizes_one`) both are known: a small network's
        fixed bytes are a third of its int8 file (digits MLP: 5.7 of 16 kB), which pricing the whole file as
        weights missed (0.61 told, the int8 file at 0.61 was 12 kB against an 8 kB budget). Without it, all of
        the file is weights (the packed or unrolled file holds m samples')."""
        one = (sizes_one or {}).get(fmt)
        if one is None or m < 2:
            return 0.0, sizes[fmt] / m
        per_sample = max((sizes[fmt] - one) / (m - 1), 1.0)
        return max(one - per_sample, 0.0), per_sample

    # the format in which the largest share fits (without fixed bytes: the smallest file), among those whose
    # fixed bytes are known where any are (one priced as all weights would look roomier than it is)
    known = [f for f in sizes if f in (sizes_one or {})] if m > 1 else []
    options = []
    for name in known or sizes:
        fixed, per_sample = parts(name)
        options.append(((budget * 1e6 - fixed) / (fewest * per_sample), name, fixed, per_sample))
    share, fmt, fixed, per_sample = max(options, key=lambda o: o[0])
    if share >= 1:
        return None
    mb = (fixed + fewest * per_sample) / 1e6
    where = (f"at M={fewest} the network exports to about {mb:.3g} MB ({fmt}"
             + (f", {fixed / 1e6:.3g} MB of it fixed: graph, names, scales" if fixed else "")
             + f") against {profile.name}'s model_mb budget of {budget:g} MB")
    if share <= 0:
        return 0.0, f"{where}: the fixed bytes alone exceed it, no share of the weights fits"
    return share, f"{where}: it fits with about {share:.0%} of its weights"


def model_budget_advice(cfg, profile, sizes, m):
    """What to change when the untrained network cannot fit the device's model_mb budget, or None."""
    found = model_budget_share(cfg, profile, sizes, m)
    return None if found is None else target_advice(cfg, found[1], found[0])


def latency_budget_share(cfg, profile, operators, per_sample, runs_dir=None):
    """(share, where) when the untrained network is predicted slower than the device's latency budget, else None.

    `operators`: {format select scores: operators in its file}; `per_sample`: {"flops", "weights"} of one
    posterior sample and the input's "in_features". The device's latency model (deploy/latency_model.py, what
    select predicts with) at the fewest MC samples select may choose, in the fastest of those formats, with
    FLOPs and weights scaled by a share s and the operators kept (pruning removes channels, not operators):
    the largest s within the budget, by bisection (every latency model here grows with FLOPs and weights); 0
    when the fixed per-operator overhead alone exceeds it. None where the device has no latency model that
    covers the network (a `measure` device without a table: select measures it after training)."""
    found = _latency_judgement(cfg, profile, operators, per_sample, runs_dir)
    return None if found is None or found[0] is None else found


def latency_unjudged(cfg, profile, facts, runs_dir=None):
    """Why the device's latency budget cannot be judged before training (no latency model that covers the
    network), or None: the `device` target then comes from the other budgets, and saying 'the dense network
    fits them' of a latency budget never judged was false (probe)."""
    found = _latency_judgement(cfg, profile, facts["operators"], facts["per_sample"], runs_dir)
    return found[1] if found is not None and found[0] is None else None


def _latency_judgement(cfg, profile, operators, per_sample, runs_dir):
    """latency_budget_share's (share, where) or None, or (None, why) where no latency model judges it."""
    from edgebayes.deploy.latency_model import LatencyModelError, predictor_for
    from edgebayes.export.formats import FORMATS

    b = profile.budgets
    if b.latency_ms is None or not operators:
        return None
    unjudged = (None, f"its latency budget ({b.latency_ms:g} ms) is not judged before training: no latency table "
                      f"of {profile.name} covers this network"
                      + (f" (`edgebayes devices profile {profile.name}` makes one)" if cfg.model.arch == "mlp" else
                         " (the latency table's sweep is of MLPs)")
                      + "; select measures the trained network against it")
    try:
        predictor = predictor_for(profile, Path(runs_dir or "runs"))
    except LatencyModelError:
        return unjudged
    if predictor is None:
        return unjudged
    fewest = _fewest_mc_samples(cfg, profile)
    # the formats whose dense network the latency model covers (a table: its architecture and input size)
    operators = {fmt: ops for fmt, ops in operators.items()
                 if not predictor.covers(ops, fewest * per_sample["flops"], fewest * per_sample["weights"],
                                         FORMATS[fmt].precision, b.percentile, per_sample["in_features"],
                                         cfg.model.arch)}

    def latency(share):
        flops, weights = fewest * per_sample["flops"] * share, fewest * per_sample["weights"] * share
        best = None
        for fmt, ops in operators.items():
            try:
                ms = predictor.predict(ops, flops, weights, FORMATS[fmt].precision, b.percentile, b.batch_size)
            except LatencyModelError:
                continue
            best = ms if best is None else min(best, ms)
        return best

    dense = latency(1.0)
    if dense is None:
        return unjudged
    if dense <= b.latency_ms:
        return None
    where = (f"at M={fewest} the network is predicted at {dense:.3g} ms (p{b.percentile:g}, {predictor.describe()}) "
             f"against {profile.name}'s latency budget of {b.latency_ms:g} ms")
    floor = latency(1e-9)
    if floor > b.latency_ms:
        return 0.0, (f"{where}, and {floor:.3g} ms with almost nothing left: the per-operator overhead alone "
                     f"exceeds it, no share of the FLOPs fits")
    low, high = 0.0, 1.0   # latency(low) fits, latency(high) does not
    for _ in range(30):
        mid = (low + high) / 2
        low, high = (mid, high) if latency(mid) <= b.latency_ms else (low, mid)
    return low, f"{where}: it fits with about {low:.0%} of its FLOPs"


def latency_budget_advice(cfg, profile, operators, per_sample, runs_dir=None):
    """What to change when the untrained network is predicted slower than the device's latency budget, or None."""
    found = latency_budget_share(cfg, profile, operators, per_sample, runs_dir)
    return None if found is None else target_advice(cfg, found[1], found[0])
