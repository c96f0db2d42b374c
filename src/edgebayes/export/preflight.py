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

The exported files also tell, before any training, whether the network can fit the device's model_mb budget:
when the untrained network, at the fewest MC samples select may choose, is larger than the budget, and
train.flops_target does not ask for that much less, one line says the share of its weights that would fit
(`model_budget_advice`). Said, not enforced: select decides after training.
"""

import tempfile
from pathlib import Path

from edgebayes.config import SPIKE_SLAB_FAMILIES
from edgebayes.errors import StageError


def requested_formats(cfg, profile):
    """The formats select scores on this device, then export.formats beyond them, without repeats."""
    from edgebayes.export.formats import formats_for

    names = [f.name for f in formats_for(profile, cfg.model.family)]
    return names + [f for f in cfg.export.formats if f not in names]


def preflight(cfg, profile, splits, log=print):
    """Compress and export the untrained net in every requested format; a StageError saying which and why
    if one fails. Returns the formats checked."""
    from edgebayes.compressed.samples import EmptyLayerError, compress
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
        return []
    except StageError as e:
        raise StageError(f"{what}: {e}") from None
    mc_model = compressed.mc_model()
    scored = {f.name for f in formats_for(profile, cfg.model.family)}   # what select may ship
    sizes = {}
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
    log(f"train: pre-flight: the untrained network compresses and exports to {', '.join(formats)} "
        f"({cfg.export.layout}, M={m})")
    advice = model_budget_advice(cfg, profile, sizes, m)
    if advice:
        log(f"train: pre-flight: {advice}")
    return formats


def model_budget_advice(cfg, profile, sizes, m):
    """What to change when the untrained network cannot fit the device's model_mb budget, or None.

    `sizes`: {format select scores: bytes of its file holding m samples}. The smallest file, scaled to the
    fewest MC samples select may choose, against the budget: the share of the weights that fits. A FLOPs
    target removes weights about as much as FLOPs (benchmarks/results/finetune_compress.md: a params ratio of
    0.48 at 0.5 of the FLOPs, 0.23 at 0.25, on four networks), so that share is what to give as
    train.flops_target. Nested (width) and SQS nets are made small by select's own knob: no advice."""
    budget = profile.budgets.model_mb
    if budget is None or not sizes:
        return None
    allowed = [k for k in cfg.select.mc_samples if not profile.budgets.mc_samples_violations(k)]
    fewest = min(allowed or cfg.select.mc_samples)
    fmt, size = min(sizes.items(), key=lambda item: item[1])
    mb = size / m * fewest / 1e6   # the packed or unrolled file holds m samples' weights
    share = budget / mb
    family, target = cfg.model.family, cfg.train.flops_target
    if share >= (target or 1.0) or family not in SPIKE_SLAB_FAMILIES + ("dnn", "bnn"):
        return None
    where = (f"at M={fewest} the network exports to about {mb:.3g} MB ({fmt}) against {profile.name}'s model_mb "
             f"budget of {budget:g} MB: it fits with about {share:.0%} of its weights")
    if family not in SPIKE_SLAB_FAMILIES:
        return f"{where}, and model.family {family} removes none; use ss-gl or ss-ghs with train.flops_target"
    if target is None:
        return f"{where}; set train.flops_target to {share:.2f} or less (a share of the dense FLOPs)"
    return f"{where}; train.flops_target {target:g} keeps about {target * mb:.3g} MB: set it to {share:.2f} or less"

