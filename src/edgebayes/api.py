"""The Python API: a user's network from training to a measured artifact, with the stages' own functions.

    import torchvision, edgebayes as eb
    net = eb.bayesianize(torchvision.models.resnet18(num_classes=10), "ss-gl", input_shape=(3, 32, 32),
                         n_train=len(x))
    eb.fit(net, x, y, epochs=5, batch_size=128)            # the ELBO trainer of the train stage
    c = eb.compress(net, knob=0.5, m=4)                     # 4 posterior samples, dead channels cut out
    eb.save(c, "model.onnx", example=x[:16])                # packed MC-averaged graph, fp32 ONNX
    probs = eb.run("model.onnx", x_test)                    # onnxruntime: MC-averaged class probabilities
    print(eb.metrics(probs, y_test))                        # accuracy, NLL, ECE, Brier

Nothing here has logic of its own: `bayesianize` is the family registry's (train/families.py), `fit` is
train/trainer.py's `train` under the ELBO with a config made from its arguments, `compress` is
compressed/samples.py's, `save` and `run` are export/formats.py's (`save`, not `export`: edgebayes.export
is the export package).
"""

import hashlib
import numbers
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from edgebayes.config import (MAX_MC_SAMPLES, OPSETS, ConfigError, ExportConfig, PipelineConfig, TrainConfig,
                              check_train, validate)
from edgebayes.compressed.samples import Compressed, EmptyLayerError, compress as _compress
from edgebayes.data import as_inputs, check_classes_seen, class_indices
from edgebayes.train.arch import register_arch  # noqa: F401  (re-exported)
from edgebayes.train.families import bayesianize  # noqa: F401  (re-exported)


def fit(net, x, y, *, val=None, epochs=10, seed=0, checkpoint=None, until_epoch=None, log=print, **train):
    """Train `net` in place with the ELBO trainer; returns the per-epoch history.

    `x`, `y`: training inputs and integer labels (tensors or arrays); `val` = (x_val, y_val), default: 10%
    of the training data, carved out with the seed. `train` takes the keys of the config's train section
    (batch_size, lr, optimizer, kl_weight, device, ...). `checkpoint` (a path) makes the run resumable.
    Another process fitting into the same checkpoint is refused at once (a StageError naming its pid).
    `until_epoch` (with `checkpoint`) stops after that epoch of the `epochs`-epoch run; a later call with the same
    arguments and a later until_epoch goes on, the same run as an uninterrupted one (trainer.train).
    Raises trainer.TrainingDiverged when an epoch's loss is not finite (the learning rate or the KL's weight is
    too large for the data): `net` is then back at its weights before that epoch, the checkpoint's (if any).
    With `flops_target`, a spike-and-slab net's schedule starts from every unit at each call: a second fit of a
    net fitted to a target switches its removed units back on (at their weights before the first) and cuts again,
    and train.max_accuracy_drop's floor is that network's. A missed floor does not raise: the last epoch's
    "flops_target_verdict" says what the target cost.
    """
    from edgebayes.data import DataError, Splits, checked_sets, pixels_as_float
    from edgebayes.train.trainer import ELBO, train as run_train

    _check_made_by_bayesianize(net, "fit", ("classes", "input_shape", "default_knob"))
    if val is not None and (isinstance(val, (str, bytes)) or not hasattr(val, "__len__") or len(val) != 2):
        raise ConfigError(f"fit: val: expected a pair (x_val, y_val), got {type(val).__name__}"
                          f"{f' of {len(val)}' if hasattr(val, '__len__') else ''}")
    if train.get("flops_target") == "device":
        raise ConfigError("flops_target: device needs a device profile, which fit does not take: run `edgebayes "
                          "train --device NAME` (its pre-flight finds the share), or give the share (0 < f <= 1)")
    # The keywords as the config's train section validates them: a misspelt one (learning_rate) or a value out
    # of range is refused by name, not ignored
    t = validate(TrainConfig, {"epochs": epochs, **train}, "fit")
    if t.processes > 1:   # taken, then trained in one process without a word (probe)
        raise ConfigError(f"fit: processes: fit trains in this process; for {t.processes} processes run `edgebayes "
                          f"train` with train.processes: {t.processes} in the config")
    check_train(t, getattr(net, "family", None), "fit", prefix="")
    from edgebayes.train.trainer import resolve_device

    resolve_device(t.device, key="fit: device")   # before the data's checks and the trainer, named as fit's
    if until_epoch is not None and (checkpoint is None or isinstance(until_epoch, bool)
                                    or not isinstance(until_epoch, int) or not 1 <= until_epoch <= t.epochs):
        raise ConfigError(f"fit: until_epoch: expected an integer in 1..epochs ({t.epochs}) and a checkpoint to go on "
                          f"from, got until_epoch={until_epoch!r}, checkpoint={checkpoint!r}")
    # The data as every source is checked (one label per input, finite inputs, labels that are classes of the
    # net; its messages call them x_train, y_train, x_val, y_val)
    classes = [str(c) for c in range(net.classes)]   # (the trainer moves the data to its device itself)
    given = {"train": (as_inputs(x, keep_pixels=True), y)}   # uint8 pixels: a quarter of float32's memory
    if val is not None:
        given["val"] = (as_inputs(val[0]), val[1])
    sets, classes = checked_sets(given, classes, "fit")
    shape = tuple(sets["train"][0].shape[1:])
    if shape != tuple(net.input_shape):
        raise DataError(f"fit: x has inputs of shape {shape}, the network was made for input_shape "
                        f"{tuple(net.input_shape)} (bayesianize's)")
    x, y = sets["train"]
    if unseen := sorted(set(range(net.classes)) - set(y.unique().tolist())):   # the pipeline's data names its classes
        warnings.warn(f"fit: the network has {net.classes} outputs and y uses {net.classes - len(unseen)} of them: "
                      f"class(es) {unseen[:10]}{' ...' if len(unseen) > 10 else ''} never appear, so their outputs "
                      f"are trained only to stay low", stacklevel=2)
    if val is None:   # 10% of the training data, carved out with the seed
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
        k = max(1, len(x) // 10)
        (vx, vy), x, y = (pixels_as_float(x[perm[:k]]), y[perm[:k]]), x[perm[k:]], y[perm[k:]]
    else:
        vx, vy = sets["val"]
    if val is None:
        check_classes_seen(y, {"validation": vy}, classes, "fit",
                           carved=f"10% of x carved out for validation with seed {seed}")
    splits = Splits(x, y, vx, vy, vx, vy, classes)
    cfg = PipelineConfig(seed=seed, train=t)
    path = Path(checkpoint) if checkpoint else None
    if path is not None and path.is_dir():
        raise ConfigError(f"fit: checkpoint: {path} is a folder; give a file path, e.g. {path / 'checkpoint.pt'}")
    # What this run is: a checkpoint of another (a new lr, other data, another network) is refused, not resumed.
    # Where and how fast it runs is not what it is: a run goes on from its checkpoint on another device
    identity = None if path is None else {
        "family": getattr(net, "family", None), "seed": seed,
        "train": t.model_dump(mode="json", exclude={"device", "threads", "compile", "channels_last", "processes"}),
        "network": _digest(repr([(k, tuple(v.shape)) for k, v in net.state_dict().items()]).encode()),
        # the values the network is trained on: uint8 pixels as their floats, a block at a time, so that the
        # same data as uint8 or as float32 / 255 is one run (and a checkpoint written before uint8 resumes)
        "data": _digest(*(pixels_as_float(a[i:i + 4096]).numpy().tobytes() for a in (x, y, vx, vy)
                          for i in range(0, len(a), 4096)))}
    if path is None:
        with tempfile.TemporaryDirectory() as tmp:
            _, history = run_train(cfg, splits, Path(tmp) / "checkpoint.pt", lambda: net, ELBO(), log)
    else:   # two fits resuming from one checkpoint would interleave their epochs
        from edgebayes.provenance import exclusive

        with exclusive(path.with_name(path.name + ".lock"), f"checkpoint {path}"):
            _, history = run_train(cfg, splits, path, lambda: net, ELBO(), log, until_epoch, identity)
    return history


def _digest(*chunks):
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()[:16]


def compress(net, knob=None, m=1, seed=0, channel_multiple=1) -> Compressed:
    """m posterior samples at a knob value (the family's default when None: for a nested net fit to a FLOPs
    target, the width within it, NestedNet.serve_from), dead units physically removed;
    each pruned convolution keeps a multiple of `channel_multiple` channels (the runtime's channel block: 4 for
    onnxruntime, 8 for TensorRT; ondevice/tables.py CHANNEL_MULTIPLE). `.calibrate(x_val, y_val)` on the result
    fits the MC average's temperature on validation data, as the pipeline's select does (compressed/samples.py)."""
    _check_made_by_bayesianize(net, "compress", ("default_knob", "operating_points", "posterior_sample"))
    if knob is not None and (isinstance(knob, bool) or not isinstance(knob, numbers.Real)):   # numpy's too
        raise ValueError(f"compress: knob: expected a number (an inclusion threshold, a width, a non-zero rate), "
                         f"got {knob!r} ({type(knob).__name__})")
    for name, value, most in (("m", m, MAX_MC_SAMPLES), ("channel_multiple", channel_multiple, None)):
        if (isinstance(value, bool) or not isinstance(value, numbers.Real) or int(value) != value or value < 1
                or (most is not None and value > most)):
            allowed = f"in 1..{most}" if most else "of 1 or more"
            raise ValueError(f"compress: {name}: expected a whole number {allowed}, got {value!r} "
                             f"({type(value).__name__})")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):   # numpy's integers too
        raise ValueError(f"compress: seed: expected a whole number, got {seed!r} ({type(seed).__name__})")
    knob = net.default_knob if knob is None else knob
    try:
        net.operating_points([knob])   # the family's range: an inclusion threshold in (0, 1), a width in 1..D
    except ValueError as e:
        raise ValueError(f"compress: knob: {e}") from None
    if getattr(net, "untrained_widths", lambda _: [])([knob]):   # as select leaves them out (a nested net)
        raise ValueError(f"compress: knob: width {knob:g} was never trained (the narrowest width the training served "
                         f"is {net.fixed_groups + 1} of {net.groups} groups: train.flops_target's, or "
                         f"nested.fixed_groups + 1); give a width in {net.fixed_groups + 1}..{net.groups}")
    try:
        return _compress(net.cpu().eval(), knob, int(m), int(seed), int(channel_multiple))
    except EmptyLayerError as e:   # the knob leaves no network: the argument's message
        raise EmptyLayerError(f"compress: knob: {e}") from None


def _check_made_by_bayesianize(net, where, needed):
    """fit and compress take the networks bayesianize (or the family registry) makes, which have the `needed`
    attributes: a plain nn.Module was an AttributeError about `classes` or `default_knob`."""
    if not all(hasattr(net, a) for a in needed):
        raise ConfigError(f"{where}: net: expected a network made by eb.bayesianize(model, family, ...), got "
                          f"{type(net).__name__}")


def save(compressed: Compressed, path, *, example, fmt="onnx", layout="packed", calib_x=None, opset=17):
    """Write the MC-averaged graph of the compressed samples in `fmt` (export/formats.py); returns the path.
    `example`: a batch of inputs of the network's shape (its shapes are the graph's); `calib_x` (int8 formats):
    training inputs of that shape, a few hundred rows."""
    from edgebayes.export.formats import export_artifact, get_format

    f = get_format(fmt)
    path = Path(path).expanduser()
    if path.suffix != f.suffix:   # run() and the device runner tell the runtime by the file's suffix
        raise ValueError(f"save: path: {fmt} is written as a {f.suffix} file, got {path.name!r}")
    if f.precision == "int8" and calib_x is None:
        raise ValueError(f"save: calib_x: {fmt} needs calibration inputs (a few hundred rows of the training data)")
    if isinstance(opset, bool) or not isinstance(opset, numbers.Integral) or not OPSETS[0] <= opset <= OPSETS[1]:
        raise ValueError(f"save: opset: expected an ONNX opset in {OPSETS[0]}..{OPSETS[1]}, got {opset!r}")
    example = _network_inputs(example, compressed.input_shape, "save: example")
    if f.precision == "int8":   # else the quantizer's own errors, or the converter's blamed on the network (probe)
        calib_x = _network_inputs(calib_x, compressed.input_shape, "save: calib_x")
    if not path.parent.is_dir():   # the staging folder goes beside it: a missing folder named a temporary file
        raise ValueError(f"save: path: the folder {path.parent} does not exist (create it first)")
    if path.is_dir():   # os.replace failed only after the export, naming the staged file
        raise ValueError(f"save: path: {path} is a folder; give a file name ending in {f.suffix}")
    if path.exists() and not path.stat().st_mode & 0o222:   # the rename would pass over the file's own mode
        raise ValueError(f"save: path: {path} is read-only; make it writable or give another name")
    # Written beside the destination and renamed onto it: a failed export leaves no half-written file and
    # keeps the artifact that was there (the export stage does the same with its folder)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as tmp:
        staged = Path(tmp) / path.name
        mc_model = compressed.mc_model()
        facts = {}
        export_artifact(mc_model, fmt, staged, example, calib_x, opset, layout=layout, details=facts)
        if "packed_refused" in facts:   # the file is right, but M times the operators of one sample
            warnings.warn(f"save: {path.name}: {facts['packed_refused']}", stacklevel=2)
        if f.precision == "fp32" and f.runtime in ("onnxruntime", "tflite"):   # what the runtime runs here
            _check_fp32_artifact(mc_model, staged, fmt, example)
        elif f.runtime in ("onnxruntime", "tflite"):
            _warn_if_not_smaller(compressed, mc_model, staged, f, example, opset, layout)
        os.replace(staged, path)
    return path


def _warn_if_not_smaller(compressed, mc_model, staged, f, example, opset, layout):
    """A warning where a lower-precision file is no smaller than the same graph in fp32: on a tiny network the
    scales, zero points and (de)quantization operators outweigh what 1- or 2-byte weights save (the pipeline's
    report shows every format's bytes; `save` writes one, so it says so itself). The fp32 graph is written to
    compare only where the file is at least 4 bytes per weight it holds, which a network of any size is not."""
    from edgebayes.compressed.structure import count_weights
    from edgebayes.export.formats import export_artifact

    weights = sum(count_weights(sample, fold_batch_norm=True) for sample in compressed.samples)
    size = staged.stat().st_size
    if size < 4 * weights:
        return
    fp32 = "onnx" if f.runtime == "onnxruntime" else "tflite-fp32"
    twin = staged.with_name("fp32" + staged.suffix)
    export_artifact(mc_model, fp32, twin, example, None, opset, layout=layout, details={})
    if size >= twin.stat().st_size:
        warnings.warn(f"save: {staged.name}: {f.name} is {size:,} bytes, no smaller than the same graph in fp32 "
                      f"({twin.stat().st_size:,} bytes, fmt={fp32!r}): this network's {weights:,} weights are too few "
                      f"for lower precision to save space", stacklevel=3)
    twin.unlink()


def _network_inputs(x, shape, where):
    """x as a float batch of the network's input shape (tensor or array; uint8 scaled as fit takes it), finite,
    or a ValueError naming `where`."""
    try:
        x = as_inputs(x)   # one that requires grad, or on a GPU, as eb.fit takes them
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: expected a batch of inputs (a tensor or an array), got {type(x).__name__} "
                         f"({e})") from None
    if x.dim() == 0 or len(x) == 0:
        raise ValueError(f"{where}: expected a batch of at least one input, got shape {tuple(x.shape)}")
    _refuse_non_finite(x, where)   # else blamed on the converter by the fidelity check
    if shape is not None and (x.dim() != len(shape) + 1 or tuple(x.shape[1:]) != tuple(shape)):
        raise ValueError(f"{where}: expected a batch of inputs of shape (N, {', '.join(map(str, shape))}), "
                         f"got {tuple(x.shape)}")
    return x


FIDELITY_TOLERANCE = ExportConfig.model_fields["fidelity_tolerance"].default   # the export stage's default


def _check_fp32_artifact(mc_model, path, fmt, example):
    """An fp32 artifact computes the PyTorch MC average on `example` within FIDELITY_TOLERANCE (as the export stage
    checks it on the eval set; fp32_agreement's float64 rule for ill-conditioned nets), or an ExportError: a
    converter that lowers an operation to another function (litert-torch's nearest-neighbour downsampling)
    is not written."""
    from edgebayes.compressed.samples import fp32_agreement
    from edgebayes.export.formats import ExportError, artifact_predict

    with torch.no_grad():
        reference = mc_model(example)
    agreement = fp32_agreement(artifact_predict(path, fmt, example.numpy()), reference, mc_model, example,
                               FIDELITY_TOLERANCE)
    if not agreement["passed"]:
        raise ExportError(f"save: {fmt}: the exported graph's probabilities differ from PyTorch's on the example by "
                          f"{agreement['max_abs_diff']:.2e} > {FIDELITY_TOLERANCE:.0e} (the converter computes "
                          f"another function for some operation); not written: try fmt='onnx' or layout='unrolled'")


def run(path, x, fmt=None):
    """Class probabilities of an exported artifact on inputs x, with its runtime (onnxruntime, LiteRT)."""
    from edgebayes.export.formats import artifact_predict

    fmt = fmt or ("tflite-fp32" if str(path).endswith(".tflite") else "onnx")
    x = as_inputs(x).numpy()   # uint8 scaled as fit took it; a tensor that requires grad too
    if x.ndim == 0 or len(x) == 0:
        raise ValueError(f"run: x: expected a batch of at least one input, got shape {x.shape}")
    _refuse_non_finite(x, "run: x")   # the graph would return NaN probabilities, silently
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"run: path: no such file {path}")
    try:
        return artifact_predict(path, fmt, x)
    except ValueError as e:   # x's shape against the artifact's input (the runtime's own message named neither)
        raise ValueError(f"run: {e}") from None


def _refuse_non_finite(x, where):
    bad = np.flatnonzero(~np.isfinite(np.asarray(x).reshape(len(x), -1)).all(1))
    if len(bad):
        raise ValueError(f"{where}: {len(bad)} input(s) hold NaN or infinite values (rows {bad[:5].tolist()}"
                         f"{', ...' if len(bad) > 5 else ''})")


def metrics(probs, y) -> dict:
    """Accuracy, NLL, ECE (15 bins) and Brier score of MC-averaged probabilities."""
    from edgebayes.ondevice.metrics import check_probabilities
    from edgebayes.train.metrics import classification_metrics

    try:
        check_probabilities(probs)
        return classification_metrics(np.asarray(probs), class_indices(y, "y", "metrics").numpy())
    except ValueError as e:   # the runner's checks (ondevice/metrics.py) name no caller
        raise ValueError(e if str(e).startswith("metrics:") else f"metrics: {e}") from None
