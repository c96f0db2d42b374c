"""The family registry: one place that says, for each family, how it is built, trained and summarized.

    family = FAMILIES[cfg.model.family]
    net, history = family.fit(cfg, splits, checkpoint_path, log)   # train stage
    net = family.build(cfg, splits)                                # untrained, to load a checkpoint into

Every trained net answers the same small interface (`PosteriorNet`), so the stages after training call
the net, never its family's name: select sweeps `net.operating_points()` of `net.knob`, export draws
`net.posterior_sample(knob_value)` through compress (edgebayes/compressed). What differs between families
is here: the builder, the training (the one loop of train/trainer.py with the family's objective; SQS
runs it twice: pretraining a dnn, then fine-tuning), the config section of the family's own settings,
the train stage's extra summary and the compressed file a family writes.

The config's checks of a family's settings (select.knob_values in the knob's range, the sqs / nested
sections) are still in config.py.
"""

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, get_args, runtime_checkable

import numpy as np
import torch
from torch import nn

from edgebayes.config import ModelConfig, NestedConfig, PriorConfig
from edgebayes.data import as_inputs, pixels_as_float
from edgebayes.errors import ArchError, warn_once
from edgebayes.train import sqs
from edgebayes.train.arch import resolve_arch
from edgebayes.train.bayesianize import module_builder, output_classes
from edgebayes.train.models import NO_KNOB, UNPRUNED_FAMILIES, BayesianNet, NestedNet
from edgebayes.train.trainer import ELBO, train


@runtime_checkable
class PosteriorNet(Protocol):
    """What every family's net offers the later stages (BayesianNet, NestedNet, SQSNet)."""

    knob: str               # the deploy-time knob select sweeps: inclusion_threshold, width, nonzero_rate
    default_knob: float     # the knob value the train stage reports at
    input_shape: tuple      # one example's shape (surgery probes with it)

    def kl(self) -> torch.Tensor:
        """The regularizer of the family's objective (the KL of the negative ELBO)."""

    def operating_points(self, values=None) -> list:
        """The knob values to try (the family's defaults when None); ValueError for values out of range."""

    def posterior_sample(self, knob_value, generator=None) -> tuple[nn.Module, dict]:
        """One posterior sample as a plain module with dense shapes, and {Linear/Conv2d name: kept outputs}."""


@dataclass(frozen=True)
class Family:
    name: str
    paper: str                     # where the method is defined
    knob: str                      # what select sweeps (the net's `knob`)
    build: Callable                # (cfg, splits) -> PosteriorNet of the configured architecture, untrained
    fit: Callable                  # (cfg, splits, checkpoint_path, log) -> (trained net, history)
    section: Optional[str] = None  # the config section of the family's own settings (PipelineConfig field)
    wrap: Optional[Callable] = None     # (build, input_shape, classes, n_train, prior, nested, activation,
    #                                     calibration_x) -> net around an architecture builder; None: pipeline only
    summary: Optional[Callable] = None  # (net, splits, train_dir, knob_value, test metrics, log) -> dict
    write_compressed: Optional[Callable] = None  # (net, folder, knob_value, m, seed) -> {"file": name, **rates}


def _wrap_bayesian(family):
    def wrap(build, input_shape, classes, n_train, prior, nested, activation, calibration_x):
        return BayesianNet(build, family, prior, input_shape, classes, n_train, activation)
    return wrap


def _wrap_nested(family):
    def wrap(build, input_shape, classes, n_train, prior, nested, activation, calibration_x):
        # The batch-norm statistics of every posterior sample (each epoch's validation, compress, select) come
        # from the first nested.bn_batches batches of the training inputs (appendix 9.2), however many are given:
        # handed all its 4,000 training images, the benchmark's resnet18 took 19.9 s (CPU) to validate each
        # epoch of about 90, 8.8 s with these 1,024
        rows = nested.bn_batches * nested.bn_batch_size
        return NestedNet(build, family, nested, input_shape, classes, activation=activation,
                         calibration_x=None if calibration_x is None else pixels_as_float(calibration_x[:rows]),
                         bn_batch_size=nested.bn_batch_size)
    return wrap


def _from_arch(wrap):
    """build(cfg, splits) of a family that wraps the configured architecture; nested nets recollect their
    batch-norm statistics on the training split's first rows."""
    def build(cfg, splits):
        return wrap(resolve_arch(cfg.model), splits.input_shape, len(splits.classes), len(splits.train_x),
                    cfg.prior, cfg.nested, cfg.model.activation, splits.train_x)
    return build


def _fit_elbo(build):
    def fit(cfg, splits, checkpoint_path, log=print):
        return train(cfg, splits, checkpoint_path, lambda: build(cfg, splits), ELBO(), log)
    return fit


def _sqs_build(cfg, splits):
    return sqs.build_sqs(cfg, splits.input_shape, len(splits.classes), len(splits.train_x))


def _sqs_summary(net, splits, train_dir, knob_value, test, log):
    """Accuracy against the full-precision start, compression by formula and by the bytes of model.sqs."""
    summary = sqs.stage_summary(net, splits, train_dir, knob_value, test)
    others = summary["unquantized_params"]
    log(f"train: SQS drop {summary['accuracy_drop']:+.4f} against full precision; compression "
        f"{summary['rate_formula']:.1f}x by formula, {summary['rate_bytes']:.1f}x by file bytes"
        + (f" of the layers it quantizes; {others} parameters outside them stay fp32 (not in model.sqs): "
           f"{summary['rate_bytes_network']:.1f}x for the whole network" if others else ""))
    return summary


def _sqs_write_compressed(net, folder, knob_value, m, seed):
    """The real compressed form (compressed/codebook.py) of the m samples export draws, as model.sqs."""
    return {"file": "model.sqs", **net.write_compressed(folder / "model.sqs", knob_value, m, seed)}


def _registry():
    families = []
    for name, paper in (("dnn", "deterministic baseline"), ("bnn", "dense BNN baseline: paper 000's SS-IG, unpruned"),
                        ("ss-ig", "paper 000"), ("ss-gl", "paper 000"), ("ss-ghs", "paper 000")):
        wrap = _wrap_bayesian(name)
        build = _from_arch(wrap)
        knob = NO_KNOB if name in UNPRUNED_FAMILIES else BayesianNet.knob
        families.append(Family(name, paper, knob, build, _fit_elbo(build), wrap=wrap))
    for name, paper in (("bn3", "paper 002"), ("fn3", "paper 002's baseline (Cui et al. 2020)")):
        wrap = _wrap_nested(name)
        build = _from_arch(wrap)
        families.append(Family(name, paper, NestedNet.knob, build, _fit_elbo(build), section="nested", wrap=wrap))
    families.append(Family("sqs", "paper 001", sqs.SQSNet.knob, _sqs_build, sqs.train_sqs, section="sqs",
                           summary=_sqs_summary,
                           write_compressed=_sqs_write_compressed))
    return {f.name: f for f in families}


FAMILIES = _registry()


def family_of(cfg) -> Family:
    return FAMILIES[cfg.model.family]


def bayesianize(module: nn.Module, family: str, *, input_shape, n_train, prior=None, nested=None,
                activation="silu", calibration_x=None):
    """The family's network around a plain `module`, with the interface of the later stages.

    Every Conv2d / Linear is swapped for the family's layer (train/bayesianize.py says how). `prior`
    (PriorConfig) and `nested` (NestedConfig) default to the config defaults; `n_train` enters the prior
    inclusion probabilities of paper 000; `calibration_x` (training inputs, of which the first
    nested.bn_batches x nested.bn_batch_size rows are kept: 2 x 512 by default) recollects batch-norm statistics
    of nested-net samples.
    """
    if family not in FAMILIES:
        raise ArchError(f"bayesianize: unknown family {family!r}; expected one of {tuple(FAMILIES)}")
    if FAMILIES[family].wrap is None:  # SQS fine-tunes a trained dnn in two calls of the loop (train/sqs.py)
        raise ArchError(f"bayesianize: family {family} runs through the pipeline: model.family: {family} with "
                        f"model.arch: <import path of the module's constructor> and {FAMILIES[family].section}."
                        f"checkpoint: <your trained network's state dict> (compressed from those weights as they "
                        f"are; model.pretrained would train them again for {FAMILIES[family].section}."
                        f"pretrain_epochs first)")
    if isinstance(n_train, bool) or not isinstance(n_train, (int, np.integer)) or n_train < 1:
        raise ArchError(f"bayesianize: n_train: expected the number of training examples (a positive integer: "
                        f"the ELBO's KL is per example), got {n_train!r}")
    shape = tuple(input_shape) if isinstance(input_shape, (tuple, list, torch.Size)) else ()
    if not shape or not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d > 0 for d in shape):
        raise ArchError(f"bayesianize: input_shape: expected the shape of one example, without the batch "
                        f"(e.g. (3, 32, 32)), got {input_shape!r}")
    activations = get_args(ModelConfig.model_fields["activation"].annotation)
    if activation not in activations:   # a bogus one was taken silently
        raise ArchError(f"bayesianize: activation: expected one of {activations} (of the zoo's networks; a module "
                        f"of yours keeps its own), got {activation!r}")
    prior = _section("prior", prior, PriorConfig)
    nested = _section("nested", nested, NestedConfig)
    if calibration_x is not None:   # arrays too, as eb.fit takes its inputs
        try:
            calibration_x = as_inputs(calibration_x)
        except (TypeError, ValueError) as e:
            raise ArchError(f"bayesianize: calibration_x: expected training inputs (an array or a tensor), got "
                            f"{type(calibration_x).__name__} ({e})") from None
        if calibration_x.dim() < 2 or tuple(calibration_x.shape[1:]) != shape or len(calibration_x) == 0:
            raise ArchError(f"bayesianize: calibration_x: expected a batch of inputs of shape (N, "
                            f"{', '.join(map(str, shape))}), got {tuple(calibration_x.shape)}")
    if FAMILIES[family].section == "nested" and calibration_x is None and any(
            isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules()):
        # each posterior sample's statistics then stay the trained network's: about 2 points lower (probe)
        warn_once(f"bayesianize: {type(module).__name__} has batch norms and no calibration_x: each width's "
                  f"posterior samples keep the trained network's batch-norm statistics; pass calibration_x=x "
                  f"(training inputs) to recollect them per sample, as the pipeline does")
    classes = output_classes(module, input_shape)
    return FAMILIES[family].wrap(module_builder(lambda _: module), input_shape, classes, n_train,
                                 prior, nested, activation, calibration_x)


def _section(name, value, cls):
    """bayesianize's `prior` / `nested`: None (the defaults), the config section, or a mapping of its keys
    (validated as the config file's section is, the key named on error)."""
    from edgebayes.config import validate

    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        return validate(cls, value, f"bayesianize: {name}")
    raise ArchError(f"bayesianize: {name}: expected a {cls.__name__} or a dict of its keys, got "
                    f"{type(value).__name__}")


def build(cfg, splits) -> PosteriorNet:
    """The configured family's net of the configured architecture, untrained (to load a checkpoint into)."""
    try:
        return family_of(cfg).build(cfg, splits)
    except RuntimeError as e:   # torch's allocator: a traceback about bytes, where the config's sizes are the cause
        if "allocate" not in str(e) and "out of memory" not in str(e).lower():
            raise
        raise ArchError(f"model: the {cfg.model.family} network of model.arch {cfg.model.arch!r} does not fit in "
                        f"this machine's memory ({str(e).strip().splitlines()[0][:200]}); make it smaller "
                        f"(model.hidden, the architecture's widths)") from None


def fit(cfg, splits, checkpoint_path, log=print):
    """Train (or resume) the configured family's net; returns (net, history)."""
    return family_of(cfg).fit(cfg, splits, checkpoint_path, log)
