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

The exported files also tell, before any training, how the network stands against the device's model_mb
and latency budgets: preflight returns their sizes and operator counts, and deploy/budget_targets.py turns
them into the share of the network that fits (advice, or the target of train.flops_target device).
"""

import tempfile
from pathlib import Path

from edgebayes.data import pixels_as_float
from edgebayes.errors import StageError


def requested_formats(cfg, profile):
    """The formats select scores on this device, then export.formats beyond them, without repeats."""
    from edgebayes.export.formats import formats_for

    names = [f.name for f in formats_for(profile, cfg.model.family)]
    return names + [f for f in cfg.export.formats if f not in names]


def preflight(cfg, profile, splits, model, log=print):
    """Compress and export the untrained net `model` (families.build's: the caller checks more of it, the FLOPs
    target's reach) in every requested format; a StageError saying which and why
    if one fails. Returns what the exported files tell of the network at M = m samples, for the device's
    budgets (deploy/budget_targets.py): {"sizes": {format select scores: bytes}, "operators": {format:
    operators in its file}, "per_sample": {"flops", "weights" of one sample, "in_features"}, "m"}; None where
    the pre-flight was skipped."""
    from edgebayes.compressed.samples import EmptyLayerError, compress
    from edgebayes.compressed.structure import count_weights, paper_flops
    from edgebayes.export.formats import FORMATS, export_artifact, formats_for, operator_count

    formats = requested_formats(cfg, profile)
    model = model.cpu().eval()
    m = min(2, max(cfg.select.mc_samples))   # the packed graph is rewritten alike for every M >= 2
    x = pixels_as_float(splits.train_x[:2])
    what = "train: refused before the first epoch (compress and export of the untrained network)"
    try:
        # its weights are untrained, its structure is what is checked: an SQS net's equal keep scores may
        # leave a layer no weight before training ranks them (allow_no_network)
        compressed = compress(model, model.default_knob, m, cfg.seed, profile.runtime.channel_block,
                              allow_no_network=True)
    except EmptyLayerError as e:   # the untrained knob empties a layer: nothing to export, training decides
        log(f"train: pre-flight skipped: {e}")
        return None
    except StageError as e:
        raise StageError(f"{what}: {e}") from None
    mc_model = compressed.mc_model()
    scored = {f.name for f in formats_for(profile, cfg.model.family)}   # what select may ship
    sizes, operators, sizes_one = {}, {}, {}
    # the files at M = 1 too where the device's model_mb budget sets the FLOPs target (budget_targets.py): a file's
    # bytes are fixed ones (graph, names, scales) + M x a sample's; not exported otherwise (it costs a conversion)
    size_one = m > 1 and cfg.train.flops_target == "device" and profile.budgets.model_mb is not None
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
                if size_one:
                    one = Path(tmp) / f"{fmt}-m1{FORMATS[fmt].suffix}"
                    try:
                        export_artifact(compressed.mc_model(1), fmt, one, x, x, cfg.export.opset,
                                        layout=cfg.export.layout)
                        sizes_one[fmt] = one.stat().st_size
                    except Exception:   # the M = m export above is the pre-flight's check; this one only sizes
                        pass
    log(f"train: pre-flight: the untrained network compresses and exports to {', '.join(formats)} "
        f"({cfg.export.layout}, M={m})")
    sample = compressed.samples[0]
    per_sample = {"flops": paper_flops(sample, tuple(x.shape[1:])),
                  "weights": count_weights(sample, fold_batch_norm=True), "in_features": int(x[0].numel())}
    return {"sizes": sizes, "operators": operators, "per_sample": per_sample, "m": m,
            "sizes_one": sizes_one or None}


