"""Fail in seconds, not after training: compress and export the untrained network first.

`train` (and `pipeline`, which starts with it) builds the configured family's network, freshly
initialised, compresses it at the family's default knob with M = 2 samples (1 where select.mc_samples
asks for no more; the packed layout is built alike for every M >= 2), and
exports it in every format it will be asked for (the device's formats that select scores, and
export.formats) in export.layout, before the first epoch. A network that one of them cannot handle (an
operation ONNX or TFLite has no conversion for, a layout it cannot take) is refused there, with the
message select or export would have given after the training had been paid for. Nothing is written: the
artifacts go to a temporary folder. An untrained spike-and-slab net has every unit's inclusion at its
prior, so surgery sees the network's real structure (what is dead changes with training, the operations
do not).

The exported files also tell, before any training, whether the network can fit the device's model_mb and
latency budgets: when the untrained network, at the fewest MC samples select may choose, is larger or slower
than the budget, and train.flops_target does not ask for that much less, one line per budget says the share
of its weights (`model_budget_advice`) or of its FLOPs (`latency_budget_advice`) that would fit. Latency is
the device's latency model's prediction (its spec sheet, or its latency table where the table covers the
network), the one select uses where it does not measure; a `measure` device without a table gets no latency
line. Said, not enforced: select decides after training.
"""

import math
import tempfile
from pathlib import Path

from edgebayes.config import SPIKE_SLAB_FAMILIES
from edgebayes.errors import StageError


def requested_formats(cfg, profile):
    """The formats select scores on this device, then export.formats beyond them, without repeats."""
    from edgebayes.export.formats import formats_for

    names = [f.name for f in formats_for(profile, cfg.model.family)]
    return names + [f for f in cfg.export.formats if f not in names]


def preflight(cfg, profile, splits, log=print, runs_dir=None):
    """Compress and export the untrained net in every requested format; a StageError saying which and why
    if one fails. Returns {budget name: (share of the dense network that fits it, what was measured)} for the
    device budgets the untrained network exceeds (`budget_shares`), None where the pre-flight was skipped. runs_dir: where the device's latency
    table is looked for."""
    from edgebayes.compressed.samples import EmptyLayerError, compress
    from edgebayes.compressed.structure import count_weights, paper_flops
    from edgebayes.deploy.latency_model import operator_count
    from edgebayes.export.formats import FORMATS, export_artifact, formats_for
    from edgebayes.train.families import build

    formats = requested_formats(cfg, profile)
    model = build(cfg, splits).cpu().eval()
    m = min(2, max(cfg.select.mc_samples))   # the packed graph is rewritten alike for every M >= 2
    x = splits.train_x[:2]
    what = "train: refused before the first epoch (compress and export of the untrained network)"
    try:
        compressed = compress(model, model.default_knob, m, cfg.seed, profile.runtime.channel_block)
    except EmptyLayerError as e:   # the untrained knob empties a layer: nothing to export, training decides
        log(f"train: pre-flight skipped: {e}")
        return None
    except StageError as e:
        raise StageError(f"{what}: {e}") from None
    mc_model = compressed.mc_model()
    scored = {f.name for f in formats_for(profile, cfg.model.family)}   # what select may ship
    sizes, operators = {}, {}
    with tempfile.TemporaryDirectory(prefix="edgebayes-preflight-") as tmp:
        for fmt in formats:
            path = Path(tmp) / f"{fmt}{FORMATS[fmt].suffix}"
            try:
                export_artifact(mc_model, fmt, path, x, x, cfg.export.opset, layout=cfg.export.layout)
            except Exception as e:
                raise StageError(f"{what}: device {profile.name}: cannot export format {fmt} "
                                 f"(export.layout {cfg.export.layout}): {type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''}") from None
            if fmt in scored and path.is_file():
                sizes[fmt] = path.stat().st_size
                operators[fmt] = operator_count(path)
    log(f"train: pre-flight: the untrained network compresses and exports to {', '.join(formats)} "
        f"({cfg.export.layout}, M={m})")
    sample = compressed.samples[0]
    per_sample = {"flops": paper_flops(sample, tuple(x.shape[1:])),
                  "weights": count_weights(sample, fold_batch_norm=True), "in_features": int(x[0].numel())}
    shares = budget_shares(cfg, profile, sizes, m, operators, per_sample, runs_dir)
    if cfg.train.flops_target != "device":   # said; with "device", run_train takes them as the target
        for share, where in shares.values():
            advice = _target_advice(cfg, where, share)
            if advice:
                log(f"train: pre-flight: {advice}")
    return shares


def budget_shares(cfg, profile, sizes, m, operators, per_sample, runs_dir=None):
    """{"model_mb" / "latency_ms": (share, where)} for each device budget the untrained network exceeds at the
    fewest MC samples select may choose: the share of its weights (model_mb) or FLOPs (latency_ms) that fits,
    0 where none does, and a line saying what was measured against what."""
    shares = {}
    for name, found in (("model_mb", model_budget_share(cfg, profile, sizes, m)),
                        ("latency_ms", latency_budget_share(cfg, profile, operators, per_sample, runs_dir))):
        if found is not None:
            shares[name] = found
    return shares


def device_flops_target(shares, profile):
    """train.flops_target `device`: the smallest share `budget_shares` found, rounded down to two decimals,
    or None when the dense network fits every budget (nothing to remove). A budget no share fits (the fixed
    per-operator latency) or one that leaves under 1% of the network is a StageError naming it."""
    if shares is None:
        raise StageError("train.flops_target device: the untrained network could not be compressed to measure it "
                         "against the device's budgets (the pre-flight's line above); give the share instead")
    if not shares:
        return None
    name, (share, where) = min(shares.items(), key=lambda item: item[1][0])
    if share < 0.01:
        raise StageError(f"train.flops_target device: {where}" + (
            "" if share > 0 else "; fewer layers, fewer MC samples or another runtime can fit it, a FLOPs target "
                                 "cannot") + f"; raise budgets.{name} of {profile.name} or use a smaller network")
    return math.floor(share * 100) / 100


def _fewest_mc_samples(cfg, profile):
    """The fewest MC samples select may choose on this device."""
    allowed = [k for k in cfg.select.mc_samples if not profile.budgets.mc_samples_violations(k)]
    return min(allowed or cfg.select.mc_samples)


def _target_advice(cfg, where, share):
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


def model_budget_share(cfg, profile, sizes, m):
    """(share, where) when the untrained network's file is larger than the device's model_mb budget, else None.

    `sizes`: {format select scores: bytes of its file holding m samples}. The smallest file, scaled to the
    fewest MC samples select may choose, against the budget: the share of the weights that fits. A FLOPs
    target removes weights about as much as FLOPs (benchmarks/results/finetune_compress.md: a params ratio of
    0.48 at 0.5 of the FLOPs, 0.23 at 0.25, on four networks), so that share is what to give as
    train.flops_target. Nested (width) and SQS nets are made small by select's own knob."""
    budget = profile.budgets.model_mb
    if budget is None or not sizes:
        return None
    fewest = _fewest_mc_samples(cfg, profile)
    fmt, size = min(sizes.items(), key=lambda item: item[1])
    mb = size / m * fewest / 1e6   # the packed or unrolled file holds m samples' weights
    share = budget / mb
    if share >= 1:
        return None
    return share, (f"at M={fewest} the network exports to about {mb:.3g} MB ({fmt}) against {profile.name}'s "
                   f"model_mb budget of {budget:g} MB: it fits with about {share:.0%} of its weights")


def model_budget_advice(cfg, profile, sizes, m):
    """What to change when the untrained network cannot fit the device's model_mb budget, or None."""
    found = model_budget_share(cfg, profile, sizes, m)
    return None if found is None else _target_advice(cfg, found[1], found[0])


def latency_budget_share(cfg, profile, operators, per_sample, runs_dir=None):
    """(share, where) when the untrained network is predicted slower than the device's latency budget, else None.

    `operators`: {format select scores: operators in its file}; `per_sample`: {"flops", "weights"} of one
    posterior sample and the input's "in_features". The device's latency model (deploy/latency_model.py, what
    select predicts with) at the fewest MC samples select may choose, in the fastest of those formats, with
    FLOPs and weights scaled by a share s and the operators kept (pruning removes channels, not operators):
    the largest s within the budget, by bisection (every latency model here grows with FLOPs and weights); 0
    when the fixed per-operator overhead alone exceeds it. None where the device has no latency model that
    covers the network (a `measure` device without a table: select measures it after training)."""
    from edgebayes.deploy.latency_model import LatencyModelError, predictor_for
    from edgebayes.export.formats import FORMATS

    b = profile.budgets
    if b.latency_ms is None or not operators:
        return None
    try:
        predictor = predictor_for(profile, Path(runs_dir or "runs"))
    except LatencyModelError:
        return None
    if predictor is None:
        return None
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
    if dense is None or dense <= b.latency_ms:
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
    return None if found is None else _target_advice(cfg, found[1], found[0])
