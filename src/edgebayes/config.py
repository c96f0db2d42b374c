"""Validated configuration: `pipeline.yaml` (the run) and `devices/<name>.yaml` (a device profile).

Each file is parsed into pydantic models (strict: no string read as a number, no number as a boolean; unknown
keys refused), whose ranges are declared beside each field (`Check`) and end up in the JSON Schema
(`edgebayes config schema`). Checks across fields and sections follow the models (`_check_*`). Any problem (a
missing file, YAML that does not parse, an unknown key, a wrong type, a value out of range, an unknown device)
raises `ConfigError` with one message naming the file and the key (`_message` writes pydantic's first error
that way); the CLI prints it and exits with code 2 before any work is done.
"""

import glob
import hashlib
import json
import math
import os
import re
import reprlib
import shlex
import shutil
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Optional

import yaml
from annotated_types import MinLen
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError, core_schema

from edgebayes.errors import InputError, warn_once
from edgebayes.ondevice.tables import CHANNEL_MULTIPLE, FORMATS, PRECISIONS, PROTOCOL, RUNTIMES

ROOT = Path(__file__).resolve().parents[2]
# The shipped device profiles are package data (in a checkout, src/edgebayes/devices links to devices/), so
# an installed edgebayes finds them wherever it runs; a user's own profiles come first (devices_dirs).
DEVICES_DIR = Path(__file__).resolve().parent / "devices"
USER_DEVICES_DIR = None   # --devices-dir (cli.py)


class ConfigError(InputError):
    """A configuration problem; the message names the file and the key."""


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxdict = _REPR.maxtuple = 6
_REPR.maxlevel = 2


def _show(value) -> str:
    """A value for a message, shortened (reprlib): a huge string or list must not make a huge message."""
    return _REPR.repr(value)


class Check:
    """A field's condition beyond its type, with the message a user reads when it fails (a string, or a
    function of the value); `schema` are the JSON Schema keywords that say the same to an editor."""

    def __init__(self, ok: Callable[[Any], bool], message: str | Callable[[Any], str], **schema):
        self.ok, self.message, self.schema = ok, message, schema

    def __get_pydantic_core_schema__(self, source, handler):
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(self, schema, handler):
        return {**handler(schema), **self.schema}

    def _check(self, value):
        if value is not None and not self.ok(value):
            message = self.message(value) if callable(self.message) else self.message
            raise PydanticCustomError("check", "{message}", {"message": message})
        return value


def Range(message: str, gt=None, ge=None, lt=None, le=None) -> Check:
    """A Check of bounds (named like annotated_types' Gt / Interval markers, which would word the message)."""
    bounds = {"exclusiveMinimum": gt, "minimum": ge, "exclusiveMaximum": lt, "maximum": le}
    return Check(lambda v: ((gt is None or v > gt) and (ge is None or v >= ge) and (lt is None or v < lt)
                            and (le is None or v <= le)), message, **{k: b for k, b in bounds.items() if b is not None})


# Upper bounds where a value multiplies memory: M samples are M copies of the network; the device's batch
# is allocated by the runner (a batch of 1e9 asked for 238 GiB, after training and selection had run).
MAX_MC_SAMPLES = 1000
MAX_DEVICE_BATCH = 4096
# torch.onnx.export's TorchScript exporter (export/onnx_export.py) writes opsets 7 to 20.
OPSETS = (7, 20)

T = typing.TypeVar("T")
Items = Annotated[list[T], MinLen(1)]   # a list in a config is never empty
Positive = Annotated[float, Range("expected a positive number", gt=0)]
PositiveInt = Annotated[int, Range("expected a positive integer", gt=0)]
NonNegativeInt = Annotated[int, Range("expected a non-negative integer", ge=0)]
AtLeastZero = Annotated[float, Range("expected a number >= 0", ge=0)]
Fraction = Annotated[float, Range("expected a number in (0, 1)", gt=0, lt=1)]
Rate = Annotated[float, Range("expected a number in (0, 1]", gt=0, le=1)]
McSamples = Annotated[int, Range("expected a positive integer", gt=0),
                      Range(f"expected at most {MAX_MC_SAMPLES}", le=MAX_MC_SAMPLES)]
# Run and device names become folder names under --runs-dir (runs/<name>/<stage>/<device>): no separators,
# no leading '.' (no `..`, no hidden folders) or '-' (not an option), so a name cannot point elsewhere.
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
Name = Annotated[str, Check(lambda v: NAME.fullmatch(v) is not None, lambda v: "expected letters, digits, '-', '_' "
                            f"or '.' (not first: '.' or '-'; at most 128), got {_show(v)}", pattern=f"^{NAME.pattern}$")]


class Section(BaseModel):
    """A mapping of a config file: strict types, no unknown key; a section left empty (`train:`) is its
    defaults, as an absent one is."""
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data):
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or not _is_section(cls.model_fields.get(k))}


def _is_section(field) -> bool:
    return field is not None and isinstance(field.annotation, type) and issubclass(field.annotation, Section)


# ---------------------------------------------------------------------------------------------
# The run: pipeline.yaml
# ---------------------------------------------------------------------------------------------
BUILTIN_DATASETS = ("digits", "mnist", "fashion-mnist", "cifar10")
DATA_FORMATS = ("npz", "image-folder", "csv")   # your own data, read from data.path (data.py says how)


class DataConfig(Section):
    dataset: str = Field("digits", description=(
        "a built-in set (BUILTIN_DATASETS), a format of your own data read from data.path (DATA_FORMATS), or "
        "package.module:function, a loader of your own called with this DataConfig (data.py, _function)"))
    root: Optional[str] = Field(None, description="folder of the built-in sets; null: $EDGEBAYES_DATA, else ./data")
    download: bool = Field(False, description="let torchvision download a built-in set missing from data.root")
    path: Optional[str] = Field(None, description=(
        "npz, image-folder, csv: the file or folder (relative: working directory)"))
    image_size: Optional[Items[int]] = Field(None, description=(
        "image-folder: [H, W] to resize every image to; null: one size"))
    channels: Optional[Literal[1, 3]] = Field(None, description=(
        "image-folder: 3 reads grayscale images as RGB (torchvision's ImageFolder does), 1 reads every image as "
        "grayscale; null: 1 when every image is grayscale, else 3"))
    label_column: Optional[int | str] = Field(None, description=(
        "csv: a header name or 0-based index; null: label/target/class, else last"))
    val_fraction: Fraction = Field(0.2, description=(
        "share of the training set held out for validation (selection scores on it)"))
    test_fraction: Fraction = Field(0.2, description="sets without a test split (digits, your own single set)")
    train_subset: Annotated[Optional[int], Range("expected a positive integer or null", gt=0)] = Field(
        None, description="train on the first N images of the training split (quick runs); null: all")
    signals: bool = Field(False, description=(
        "npz / your loader: 3-D arrays are 1-D signals (N, channels, length) for a Conv1d network, 2-D ones "
        "(N, length); false: 3-D arrays are grayscale images (N, H, W), 2-D ones feature vectors"))
    ood: Optional[Literal["noise", "digits", "mnist", "fashion-mnist", "cifar10"]] = Field(None, description=(
        "null | noise (uniform in the training inputs' range) | a built-in data set with the same input shape"))


class ModelConfig(Section):
    family: Literal["dnn", "bnn", "ss-ig", "ss-gl", "ss-ghs", "sqs", "bn3", "fn3"] = Field("ss-gl", description=(
        "dnn: deterministic; bnn: dense mean-field Gaussian; ss-*: spike-and-slab node/channel selection; sqs: "
        "sparse + quantized (paper 001), wrapping the dnn of the same architecture (section sqs); bn3: Bayesian "
        "nested net (paper 002); fn3: its fixed nested-dropout baseline (section nested)"))
    arch: str = Field("mlp", description=(
        "a zoo name (mlp, lenet5-caffe, resnet20, resnet32, resnet56, vgg11, mobilenetv2), a name registered with; "
        "edgebayes.register_arch, or an import path package.module:builder (train/arch.py says what it may be)"))
    options: dict[str, Any] = Field({}, description="keyword arguments of an import-path builder")
    pretrained: Optional[str] = Field(None, description=(
        "a state dict (weights_only) of the plain network the posterior starts from"))
    hidden: Annotated[Items[int], Check(lambda v: all(h > 0 for h in v), "expected positive layer widths")] = Field(
        [400, 400], description="hidden layer widths of the zoo's mlp")
    activation: Literal["silu", "relu", "tanh"] = Field("silu", description="activation of the zoo's networks")
    width_multiplier: Positive = Field(1.0, description=(
        "vgg11, mobilenetv2: channels x this (paper 002 trains VGG11 x1.5)"))


class PriorConfig(Section):
    sigma0_sq: Positive = Field(1.0, description="slab variance sigma0^2 (1 for MLP / LeNet in paper 000)")
    inclusion_constant: Positive = Field(1e-9, description="C_l of the layer-wise prior inclusion probability")
    conv_inclusion: Fraction = Field(1e-4, description=(
        "prior inclusion probability of convolution channels (paper 000, 5.3)"))
    a0: Positive = Field(4.0, description="SS-GL: varsigma^2 ~ Gamma(a0, b0)")
    b0: Positive = Field(2.0, description="SS-GL: rate of the Gamma prior on varsigma^2")
    c_reg: Positive = Field(1.0, description="SS-GHS: regularization constant of the group horseshoe")
    d0: Positive = Field(1.0, description="SS-GHS: global scale varsigma ~ C+(0, d0)")
    parameterization: Literal["centered", "non-centered"] = Field("centered", description=(
        "non-centered: w = tau* w0, w0 ~ N(0, sigma0^2) (the paper's choice for ResNets)"))
    temperature: Positive = Field(0.5, description="relaxed Bernoulli temperature")
    gamma_init: Fraction = Field(0.99, description="initial inclusion probability (\"close to 1\", appendix A.2)")


class TrainConfig(Section):
    epochs: PositiveInt = Field(100, description=(
        "training epochs (paper setups: 1200 for MLP / LeNet, 300 for ResNets)"))
    batch_size: Optional[PositiveInt] = Field(None, description=(
        "training batch size (split over train.processes); null: 1024, and with train.flops_target the largest "
        "power of two down to 16 that leaves the cut network 100 steps at its final structure "
        "(train/flops_target.py)"))
    lr: Positive = Field(1e-3, description="learning rate of every parameter without a learning rate of its own below")
    inclusion_lr: Optional[Positive] = Field(None, description=(
        "spike-and-slab inclusion logits' lr; null: lr (trainer.py)"))
    rho_lr: Optional[Positive] = Field(None, description=(
        "lr of the slab's rho (sigma = softplus(rho)), bnn / ss-*; null: lr"))
    scale_lr: Optional[Positive] = Field(None, description=(
        "lr of the slab-scale variables (tau, varsigma), ss-gl / ss-ghs; null: lr"))
    optimizer: Literal["adam", "sgd"] = Field("adam", description=(
        "paper 000: Adam for MLP / LeNet, SGD + momentum for ResNets"))
    momentum: Annotated[float, Range("expected a number in [0, 1)", ge=0, lt=1)] = Field(0.9, description=(
        "SGD momentum (optimizer sgd only)"))
    # A plain list, unlike the others: [] is the default (a constant rate) and a user may write it
    lr_milestones: list[int] = Field([], description="epochs where the lr is multiplied by lr_gamma ([]: none)")
    lr_gamma: Annotated[float, Range("expected a number in (0, 1] (the learning rate is multiplied by it at each "
                                     "milestone)", gt=0, le=1)] = Field(0.1, description=(
        "the learning rate is multiplied by this at each of lr_milestones"))
    kl_weight: Positive = Field(1.0, description="1 = the exact ELBO; < 1 tempers the KL (see trainer docstring)")
    mc_samples_eval: McSamples = Field(10, description=(
        "MC samples of the test evaluation after training (paper 000: 10)"))
    mc_samples_val: McSamples = Field(2, description="MC samples of the per-epoch validation (a cheap progress signal)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description=(
        "where training runs: auto picks CUDA when present"))
    # Speed (train/accel.py, train/distributed.py); none of these changes the objective.
    augment: bool = Field(False, description=(
        "random crop (zero padding augment_padding) + horizontal flip, on the device"))
    augment_padding: NonNegativeInt = Field(4, description="pixels of zero padding around each image before the crop")
    precision: Literal["fp32", "bf16"] = Field("fp32", description=(
        "bf16: autocast of the forward; KL terms and parameters stay fp32"))
    channels_last: bool = Field(False, description=(
        "NHWC memory format for the convolutions (faster tensor cores on GPUs)"))
    compile: bool = Field(False, description="torch.compile the forward and the KL; falls back to eager, logging why")
    processes: PositiveInt = Field(1, description="> 1: `edgebayes train` relaunches itself under torchrun (DDP)")
    threads: Annotated[int, Range("expected a non-negative integer (0: the free cores)", ge=0)] = Field(
        0, description="torch threads of train, select and export; 0: the cores no other process keeps busy "
                       "(train/accel.py)")
    kl_warmup_epochs: NonNegativeInt = Field(0, description=(
        "KL scaled by min(1, step / warm-up steps) over these epochs (trainer.py)"))
    kl_warmup_from: Annotated[float, Range("expected a number in [0, 1)", ge=0, lt=1)] = Field(0.0, description=(
        "> 0: the warm-up is geometric, from this factor up to 1 (equal steps per decade; trainer.py), else linear; "
        "with kl_warmup_ordered: the share of the KL's gradient on a unit's inclusion logit before its turn"))
    kl_warmup_ordered: bool = Field(False, description=(
        "spike-and-slab: the KL reaches the units' inclusion logits in turn (trainer.py)"))
    flops_target: Optional[Rate | Literal["device"]] = Field(None, description=(
        "spike-and-slab: the median model's FLOPs after surgery as a fraction of the dense network's, reached by "
        "switching the least important units off during the first flops_schedule_fraction of the steps "
        "(train/flops_target.py); bn3 / fn3: the narrowest width trained and served is the widest within it "
        "(train/nested.py); device: the largest fraction the device's model_mb and latency_ms budgets "
        "allow, found before the first epoch (deploy/budget_targets.py; the training is then the device's); null: none"))
    flops_channel_multiple: PositiveInt = Field(1, description=(
        "spike-and-slab with train.flops_target: the target's last cut is counted with each pruned convolution's "
        "width rounded up to a multiple of this, as surgery does for a runtime's channel block "
        "(runtime.channel_multiple); with flops_target device it is the device's block; 1: as the masks say"))
    flops_schedule_fraction: Rate = Field(0.1, description=(
        "the share of the training steps over which train.flops_target's schedule reaches its target (0.1: the "
        "rest of a few epochs' fine-tuning repairs the cut network; train/flops_target.py)"))
    max_accuracy_drop: Optional[Annotated[float, Range("expected a number in [0, 1)", ge=0, lt=1)]] = Field(
        None, description=(
            "with train.flops_target: the validation accuracy the fine-tuning may lose against the network it "
            "starts from (0.01: one point); a target that costs more is reported at the end of training with the "
            "closest point of the schedule that did not (train/flops_target.py); null: no floor"))


# codebooks per layer of each windowing of the SQS weights (train/sqs.py, appendix C): K levels each
SQS_WINDOWS = {"outlier": 4, "equal": 4, "single": 1}


class SQSConfig(Section):
    """Family sqs (paper 001, train/sqs.py): fine-tuning epochs, batch size and kl_weight come from `train`,
    sigma0^2 from `prior`."""
    components: Annotated[int, Check(lambda k: 2 <= k <= 256 and k & (k - 1) == 0,
                                     "expected a power of two in 2..256", enum=[2 ** b for b in range(1, 9)])] = Field(
        4, description="K per layer and window: 4 = 2 bits, 16 = 4 bits")
    windows: Literal[tuple(SQS_WINDOWS)] = Field("outlier", description=(
        "how each layer's weights are split into windows with their own codebook: outlier (the tails apart), equal, "
        "or single"))
    iqr_factor: Positive = Field(5.0, description="outlier windows: tails beyond q1 - 5 IQR and q3 + 5 IQR")
    prior: Literal["spike-slab", "gaussian"] = Field("spike-slab", description=(
        "prior of the quantized weights: spike-and-slab (paper 001) or a plain Gaussian mixture"))
    nonzero_rate: Rate = Field(0.5, description="target of the pruning schedule and the default knob value")
    operating_points: Annotated[Optional[Items[float]], Check(lambda v: all(0 < x <= 1 for x in v),
                                                             "expected non-zero rates in (0, 1]")] = Field(
        None, description="default non-zero rates to try; null: [nonzero_rate]")
    first_layer_scores: Literal["per-weight", "per-input"] = Field("per-weight", description=(
        "first layer's keep scores: one per weight (the paper), or one per input feature shared by the layer's "
        "output units, so that whole inputs (pixels) are pruned and the mask costs ~nothing there (train/sqs.py)"))
    keep_init: Rate = Field(0.99, description="initial keep probability lambda~ and prior inclusion lambda")
    schedule_fraction: Rate = Field(0.5, description=(
        "the polynomial schedule reaches the target after this share of steps"))
    tau: Positive = Field(5.0e-4, description="tau of paper 001's eq. 2")
    tau_prime: Positive = Field(0.0125, description="tau' of paper 001's eq. 33, halved after half of the steps")
    lr_quantization: Positive = Field(5.0e-5, description="AdamW learning rate of theta / mu / sigma / pi / biases")
    lr_pruning: Positive = Field(0.012, description="AdamW learning rate of the keep scores s")
    weight_decay: Annotated[float, Range("expected a non-negative number", ge=0)] = Field(0.0, description=(
        "AdamW weight decay"))
    pretrain_epochs: PositiveInt = Field(10, description="the deterministic stage (ignored with a checkpoint)")
    pretrain_lr: Positive = Field(1.0e-3, description="learning rate of the deterministic stage")
    checkpoint: Optional[str] = Field(None, description="a user's state dict of the dnn network (loaded weights_only)")


class NestedConfig(Section):
    """Families bn3 / fn3 (paper 002, train/nested.py): D groups of output channels per nested layer, the
    first fixed_groups always kept; the knob is the width (groups kept, 1..groups). kappa is train.kl_weight."""
    groups: PositiveInt = Field(32, description="D: 32 for VGG11 / ResNeXt, 16 for MobileNetV2")
    fixed_groups: int = Field(2, description="leading groups for base features (VGG11 on CIFAR-10: 2)")
    mubar_init: float | Literal["uniform"] = Field(3.0, description=(
        "conditional keep probabilities mu = sigmoid(mubar) at init: a number (paper: 3), or \"uniform\" to start "
        "from FN3's distribution, every width equally likely (train/nested.py OrderingUnit)"))
    prior_keep_logit: float | Literal["uniform"] = Field(3.0, description=(
        "the prior chain's pi = sigmoid(this), or FN3's uniform distribution (not given in the paper)"))
    target_width_probability: Fraction = Field(0.99, description=(
        "with train.flops_target: the prior's and q's initial probability of the narrowest width served, the widest "
        "within the target (the wider ones as mubar_init and prior_keep_logit); not in the paper (train/nested.py)"))
    shared_draw: bool = Field(True, description=(
        "one Downhill draw per training step shared by every nested layer, so that the layers' widths move "
        "together as the deployed widths do (each layer's distribution unchanged; false: an independent draw per "
        "layer, the paper's mean field; train/nested.py)"))
    log_alpha_init: float = Field(-1.0, description="initial log variance ratio of the multiplicative weight noise")
    log_alpha_init_first: float = Field(-8.0, description="log_alpha_init of the network's first layer")
    temperature: Positive = Field(0.3, description=(
        "Downhill temperature in the first epoch, annealed to temperature_min"))
    temperature_min: float = Field(0.03, description=(
        "the Downhill temperature in the last epoch, annealed exponentially (not in the paper)"))
    bn_batches: PositiveInt = Field(2, description="batch-norm statistics at a width: 2 batches of 512 (appendix 9.2)")
    bn_batch_size: PositiveInt = Field(512, description=(
        "examples per batch when batch-norm statistics are recollected at a width"))


def _each_once(message: Callable[[list], str]) -> Check:
    return Check(lambda v: len(set(v)) == len(v), message, uniqueItems=True)


class SelectConfig(Section):
    knob_values: Optional[Annotated[Items[float], _each_once(lambda v: f"expected each value once, got {v}")]] = Field(
        None, description=(
        "values of the family's deploy-time knob to try (inclusion threshold, width, non-zero rate); null: the "
        "model's own default operating points (a nested net fitted to train.flops_target: the width within it, the one "
        "its training made). Widths narrower than a nested net's training served "
        "(nested.fixed_groups or fewer groups, or under train.flops_target's width) are left out, and the log says "
        "so"))
    mc_samples: Annotated[Items[int], Check(lambda v: all(m > 0 for m in v), "expected positive integers"),
                          Check(lambda v: max(v) <= MAX_MC_SAMPLES, f"expected integers in 1..{MAX_MC_SAMPLES}"),
                          _each_once(lambda v: f"expected each M once, got {v}")] = Field([1, 2, 4, 8], description=(
        "numbers of posterior samples M to try (each is averaged in one exported graph)"))
    objective: Literal["accuracy", "nll", "ece-constrained-accuracy"] = Field("accuracy", description=(
        "accuracy: highest val accuracy; nll: lowest val NLL; ece-constrained-accuracy: highest val accuracy among "
        "the candidates whose val ECE is at most max_ece."))
    max_ece: Annotated[Optional[float], Range("expected a number in (0, 1] or null", gt=0, le=1)] = Field(
        None, description="ece-constrained-accuracy: the largest validation ECE a candidate may have")
    temperature_scaling: bool = Field(True, description=(
        "divide every posterior sample's logits by one temperature fitted on the validation split (the NLL of the "
        "MC average; compressed/samples.py fit_temperature) in every candidate and the exported model: a network "
        "fine-tuned for a few epochs after its cut is under-confident. false: the papers' MC average as it is. The "
        "validation metrics select reports are then of a temperature fitted on them; the test split's are not"))


# Target formats of the exported MC-averaged model (export/formats.py has what each one is).
ExportFormat = Literal[tuple(FORMATS)]


class ExportConfig(Section):
    opset: Annotated[int, Range(f"expected an ONNX opset in {OPSETS[0]}..{OPSETS[1]}", ge=OPSETS[0],
                                le=OPSETS[1])] = Field(17, description="ONNX opset of the exported graphs")
    fidelity_tolerance: Positive = Field(1e-4, description="fp32 artifacts: max |p_artifact - p_torch| on the eval set")
    formats: Annotated[Items[ExportFormat], _each_once(lambda v: f"expected each format once, got {v}")] = Field(
        ["onnx"], description="formats exported beside the one selection chose (which is always exported and is the "
                              "primary).")
    layout: Literal["packed", "unrolled"] = Field("packed", description=(
        "the M samples as one grouped network, or M branches"))
    calibration_size: PositiveInt = Field(256, description="training inputs that calibrate the int8 formats")
    max_accuracy_drop: Annotated[float, Range("expected a number in [0, 1)", ge=0, lt=1)] = Field(0.02, description=(
        "fp16/int8 artifacts: accuracy floor = PyTorch MC accuracy - this"))


class BenchmarkConfig(Section):
    warmup: NonNegativeInt = Field(PROTOCOL["warmup"], description=(
        "untimed runs before timing (the runner's defaults too, ondevice/tables.py)"))
    min_runs: PositiveInt = Field(PROTOCOL["min_runs"], description="the runner times at least this many runs")
    min_seconds: AtLeastZero = Field(PROTOCOL["min_seconds"], description="and for at least this many seconds")
    rounds: PositiveInt = Field(PROTOCOL["rounds"], description=(
        "timing rounds, interleaved with the other models'; percentiles over all rounds' samples (ondevice/timing.py)"))


class PipelineConfig(Section):
    name: Name = Field("run", description="the run's name: its folder under --runs-dir")
    seed: Annotated[int, Range("expected an integer in 0..2^32 - 1 (numpy's and torch's seeds)",
                               ge=0, le=2**32 - 1)] = Field(0, description=(
        "seed of the data split, the initialisation and the posterior samples"))
    data: DataConfig = Field(DataConfig(), description="the data set and its splits")
    model: ModelConfig = Field(ModelConfig(), description="the model family and architecture")
    prior: PriorConfig = Field(PriorConfig(), description="the spike-and-slab priors (paper 000)")
    train: TrainConfig = Field(TrainConfig(), description="the training loop")
    sqs: SQSConfig = Field(SQSConfig(), description="family sqs: sparse + quantized (paper 001)")
    nested: NestedConfig = Field(NestedConfig(), description="families bn3 / fn3: nested nets (paper 002)")
    select: SelectConfig = Field(SelectConfig(), description="the operating points tried and how one is chosen")
    export: ExportConfig = Field(ExportConfig(), description="the exported formats and their checks")
    benchmark: BenchmarkConfig = Field(BenchmarkConfig(), description="the timing protocol on the device")


# ---------------------------------------------------------------------------------------------
# A device: devices/<name>.yaml
# ---------------------------------------------------------------------------------------------
class RuntimeConfig(Section):
    name: Literal[RUNTIMES] = Field("onnxruntime", description="runtime on the device: onnxruntime, tflite or tensorrt")
    threads: Annotated[int, Range("expected an integer in 0..1024 (0: the runtime's default)", ge=0, le=1024)] = Field(
        0, description="intra-op threads of the runtime; 0: its default")
    precision: Annotated[Items[Literal[PRECISIONS]], _each_once("lists a precision twice")] = Field(
        ["fp32"], description="the precisions this runtime takes on the device; selection tries each one that has an "
                              "export format (onnxruntime: fp16 -> onnx-fp16w, int8 -> onnx-int8)")
    workspace_mb: PositiveInt = Field(1024, description=(
        "TensorRT builder workspace in MiB (engines are built on the device, cached by ONNX hash and options)"))
    channel_multiple: Optional[PositiveInt] = Field(None, description=(
        "surgery keeps a multiple of this many channels in every convolution it prunes (dead ones stay, zero), "
        "the block the runtime's fast kernels work in; null: the runtime's own (onnxruntime 4, tflite 1, tensorrt 8)"))

    @property
    def channel_block(self) -> int:
        """channel_multiple, or the runtime's default (ondevice/tables.py, CHANNEL_MULTIPLE)."""
        return self.channel_multiple or CHANNEL_MULTIPLE[self.name]


OptionalPositive = Annotated[Optional[float], Range("expected a positive number or null", gt=0)]


class Budgets(Section):
    latency_ms: OptionalPositive = Field(None, description=(
        "latency budget (ms) at `percentile`, for `batch_size` inputs; null: none"))
    percentile: Literal[50, 90, 99] = Field(90, description=(
        "the latency percentile latency_ms is judged at, over every timed run"))
    batch_size: Annotated[int, Range(f"expected an integer in 1..{MAX_DEVICE_BATCH}", gt=0,
                                     le=MAX_DEVICE_BATCH)] = Field(1, description=(
        "inputs per inference, on the device and in the latency model"))
    memory_mb: OptionalPositive = Field(None, description=(
        "budget (MB) of the model's own memory: its peak RSS above the runtime loaded, estimated at selection, "
        "measured after deployment (README, Memory); null: none"))
    model_mb: OptionalPositive = Field(None, description=(
        "budget (MB, 10^6 bytes) of the shipped model file (onnx-codebook's low-bit file for SQS); null: none"))
    mc_samples: Annotated[Optional[Items[int]], Check(lambda v: all(0 < m <= MAX_MC_SAMPLES for m in v),
                                                      f"expected integers in 1..{MAX_MC_SAMPLES} or null")] = Field(
        None, description="the numbers of MC samples allowed; null: any")
    mc_samples_max: Annotated[Optional[int], Range("expected a positive integer or null", gt=0)] = Field(
        None, description="at most this many MC samples; null: any")

    def mc_samples_violations(self, m) -> list:
        """Why M = m posterior samples are not allowed here (empty: they are): select's verdict on a candidate,
        and the fewest samples the pre-flight sizes the model at."""
        out = []
        if self.mc_samples is not None and m not in self.mc_samples:
            out.append(f"M={m} not in budget mc_samples {self.mc_samples}")
        if self.mc_samples_max is not None and m > self.mc_samples_max:
            out.append(f"M={m} > budget mc_samples_max {self.mc_samples_max}")
        return out

    def allowed_mc_samples(self, grid) -> list:
        """The numbers of MC samples of `grid` (select.mc_samples) this device allows."""
        return [m for m in grid if not self.mc_samples_violations(m)]


# ssh argv safety: a value starting with '-' would be read as an option (`user: -oProxyCommand=...`).
SshArgument = Annotated[Optional[str], Check(lambda v: v.strip() and not v.startswith("-"),
                                             lambda v: f"must not be empty or start with '-', got {_show(v)}")]
# Host and user names as names: ssh puts them into %h / %r of the commands a config runs (Match exec,
# ProxyCommand) through a shell, so a `;` or `$(` there would be code (OpenSSH 9.6 refuses them too).
HOST = re.compile(r"(?=.{1,253}$)[A-Za-z0-9_][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*\.?")
USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@-]{0,63}\$?")
# ProxyJump: [user@]host[:port] hops, comma-separated (an IPv6 address in brackets)
JUMP_HOP = re.compile(rf"(?:(?P<user>[^@,]+)@)?(?:\[(?P<ip6>[0-9A-Fa-f:.%]+)\]|(?P<host>[^:,]+))(?::(?P<port>\d{{1,5}}))?")


def is_host(value: str) -> bool:
    """A host name (or a Host alias of the ssh config, which has the same shape) or an IP address."""
    import ipaddress

    try:
        return bool(ipaddress.ip_address(value))
    except ValueError:
        return HOST.fullmatch(value) is not None


def _is_jump(value: str) -> bool:
    hops = [JUMP_HOP.fullmatch(hop) for hop in value.split(",")]
    return all(m and (m["user"] is None or USER.fullmatch(m["user"])) and is_host(m["ip6"] or m["host"])
               and (m["port"] is None or 0 < int(m["port"]) < 65536) for m in hops)


HostName = Annotated[SshArgument, Check(is_host, lambda v: "expected a host name (letters, digits, '-', '_', "
                                        f"dots) or an IP address, got {_show(v)}")]
UserName = Annotated[SshArgument, Check(lambda v: USER.fullmatch(v) is not None, lambda v: "expected a user name "
                                        f"(letters, digits, '.', '_', '-', '@'), got {_show(v)}")]
JumpHosts = Annotated[SshArgument, Check(_is_jump, lambda v: "expected [user@]host[:port] hops separated by "
                                         f"commas, got {_show(v)}")]


class Connection(Section):
    kind: Literal["local", "ssh"] = Field("local", description=(
        "local: this machine; ssh: a device reached with the system ssh client"))
    local_sshd: bool = Field(False, description=(
        "ssh to this machine through a throwaway sshd (deploy/localsshd.py) in the folder of identity_file: started "
        "when a command needs it and stopped when that command ends, unless it was already running"))
    python: Optional[str] = Field(None, description=(
        "interpreter on the device; null: this one (local) or python3 (ssh)"))
    workdir: Optional[str] = Field(None, description=(
        "where bundles go; null: the run folder (local), edgebayes/<device> under the remote home (ssh)"))
    # ssh only; each may also come from ~/.ssh/config (host may be a Host alias there).
    host: HostName = Field(None, description=(
        "ssh: host name, address or a Host alias of ~/.ssh/config (required for ssh)"))
    user: UserName = Field(None, description="ssh: login; null: ssh's default or ~/.ssh/config")
    port: Annotated[Optional[int], Range("expected a port number in 1..65535", gt=0, lt=65536)] = Field(
        None, description="ssh: port; null: 22 or ~/.ssh/config")
    identity_file: Optional[str] = Field(None, description=(
        "ssh -i: the private key; null: ssh's default or ~/.ssh/config"))
    proxy_jump: JumpHosts = Field(None, description="ssh -J: [user@]jumphost[:port][,...]")
    ssh_config: Optional[str] = Field(None, description="ssh -F: a config file other than ~/.ssh/config")
    options: Annotated[Optional[Items[str]], Check(lambda v: all("=" in o for o in v),
                                                   "expected `Key=value` ssh options")] = Field(None, description=(
        "extra `ssh -o Key=value` options; those that make ssh run code on this machine or open it to the device "
        "only with trusted: true"))
    connect_timeout_s: PositiveInt = Field(10, description="ssh ConnectTimeout, seconds")
    min_free_mb: AtLeastZero = Field(50.0, description="a deploy needs this much free disk beyond the files it copies")
    trusted: bool = Field(False, description=(
        "true lets the profile make ssh run code on this machine or open it to the device; set it only in a profile "
        "you wrote or read. Without it the profile's settings are read as ssh reads them (ssh -G with its options "
        "and ssh_config file, and each jump host's) and refused where ssh would get ProxyCommand, LocalCommand / "
        "PermitLocalCommand, KnownHostsCommand, XAuthLocation, PKCS11Provider, SecurityKeyProvider, agent / X11 / "
        "port forwarding or Tunnel that ssh's defaults and your own ~/.ssh/config do not give that host, or a "
        "Match exec (found without running it)"))


class LatencyModel(Section):
    kind: Literal["measure", "table", "flops"] = Field("measure", description=(
        "measure: time each candidate on the device when it is reachable, else predict from the table; table: "
        "predict from the table `edgebayes devices profile` measured; flops: estimate from the spec sheet "
        "(flops_per_second, memory_bandwidth_gb_s, overhead_ms)"))
    table: Optional[str] = Field(None, description=(
        "a latency table file; null: runs/devices/<name>/latency_table.json, then devices/profiles/<name>.json"))
    flops_per_second: OptionalPositive = Field(None, description="declared throughput (paper FLOPs, multiplies only)")
    memory_bandwidth_gb_s: OptionalPositive = Field(None, description=(
        "published memory bandwidth (GB/s): the spec-sheet estimate's memory term, weight bytes / bandwidth"))
    overhead_ms: AtLeastZero = Field(0.0, description="fixed per-inference cost added to the spec-sheet estimate")
    estimate_band: Annotated[list[float], Check(lambda v: len(v) == 2 and 0 < v[0] <= 1 <= v[1],
                                                "expected [low, high] with 0 < low <= 1 <= high")] = Field(
        [0.5, 3.0], description="the spec-sheet estimate's band: [low, high] factors of the estimate (declared, "
                                "nothing was measured)")
    source: str = Field("", description="where flops_per_second, memory_bandwidth_gb_s and overhead_ms come from")


class DeviceProfile(Section):
    name: Name = Field(description=(
        "the profile's name, the file's own (mybox.yaml: mybox): letters, digits, -, _, ., not first . or - (it "
        "names folders under --runs-dir)"))
    description: str = Field("", description="free text, shown by `edgebayes devices list`")
    runtime: RuntimeConfig = Field(RuntimeConfig(), description="the runtime on the device and the precisions it takes")
    budgets: Budgets = Field(Budgets(), description="the limits the chosen point must meet on the device")
    connection: Connection = Field(Connection(), description="how the device is reached")
    latency_model: LatencyModel = Field(LatencyModel(), description="where latency comes from when it is not measured")


# ---------------------------------------------------------------------------------------------
# Validation: pydantic's first error in today's words
# ---------------------------------------------------------------------------------------------
def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return _type_name(typing.get_args(tp)[0])
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false",
            dict: "a mapping of names to values"}.get(origin or tp, getattr(tp, "__name__", str(tp)))


def _locate(cls, data, loc):
    """Walk an error's location through the models and the data: (annotation, value, dotted key, the model
    holding the last key). It stops at a union, whose members pydantic adds to the location."""
    tp, value, key, model = cls, data, "", cls
    for part in loc:
        while typing.get_origin(tp) is Annotated:
            tp = typing.get_args(tp)[0]
        if isinstance(tp, type) and issubclass(tp, Section) and isinstance(part, str):
            model, key = tp, f"{key}.{part}" if key else part
            tp, value = (tp.model_fields[part].annotation if part in tp.model_fields else None,
                         value.get(part) if isinstance(value, dict) else None)
        elif typing.get_origin(tp) is list and isinstance(part, int) and isinstance(value, list):
            tp, value, key = typing.get_args(tp)[0], value[part], f"{key}[{part}]"
        else:
            break
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    return tp, value, key, model


def _message(cls, data, error: dict, path: str, set_keys=()) -> str:
    """pydantic's error in the words of a config: where, what was expected, and what the key is for (its
    Field description, the same text as the JSON Schema's)."""
    message = _problem(cls, data, error, path, set_keys)
    _, _, key, model = _locate(cls, data, error["loc"])
    field = model.model_fields.get(re.sub(r"\[\d+\]$", "", key.rsplit(".", 1)[-1])) if key else None
    if error["type"] in ("extra_forbidden", "missing") or field is None or not field.description:
        return message
    return f"{message}. {key.split('[')[0]}: {field.description}"


def _problem(cls, data, error: dict, path: str, set_keys=()) -> str:
    tp, value, key, model = _locate(cls, data, error["loc"])
    where = f"{path}: {key}" if key else path
    if key and any(key == k or key.startswith(f"{k}.") or key.startswith(f"{k}[") for k in set_keys):
        where = f"--set {key}"   # the command line's value, not the file's
    kind = error["type"]
    if kind == "check":
        return f"{where}: {error['ctx']['message']}"
    if kind == "extra_forbidden":
        return f"{where}: unknown key (allowed: {', '.join(model.model_fields)})"
    if kind == "missing":
        return f"{where}: required key is missing"
    if kind in ("model_type", "model_attributes_type"):
        return f"{where}: expected a mapping of keys, got {_show(value)}"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType, Literal):
        return f"{where}: expected {_type_name(tp)}, got {_show(value)}"
    if origin is list:
        return f"{where}: expected a non-empty list, got {_show(value)}"
    if kind == "finite_number" or (tp is float and isinstance(value, int) and not isinstance(value, bool)):
        # .inf / .nan, or an int too large for a float: they would pass every `> 0` check and break the run later
        return f"{where}: expected a finite number, got {value if isinstance(value, float) else math.inf}"
    hint = ("; YAML 1.2, as configs are read: write true or false" if tp is bool and isinstance(value, str)
            and value.lower() in YAML11_BOOLEANS else "")
    return f"{where}: expected {_type_name(tp)}, got {_show(value)} ({type(value).__name__}){hint}"


def validate(cls, data, path, set_keys=()):
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        # A number or a word (flops_target: 0.25 or device): for a number out of range, the range says more
        # than "expected a number or one of 'device'"
        ranged = {err["loc"][:-1] for err in errors if err["type"] == "check"}
        errors = [err for err in errors if not (str(err["loc"][-1]).startswith("literal[") and err["loc"][:-1] in ranged)]
        # types and keys first, then ranges: the order the file is read in, one message
        first = min(errors, key=lambda err: err["type"] == "check")
        if not first["loc"]:   # the whole value is wrong: not a mapping of keys at all
            raise ConfigError(f"{path}: expected a mapping of keys, got {_show(data)} ({type(data).__name__})") from None
        raise ConfigError(_message(cls, data, first, str(path), set_keys)) from None


MAX_YAML_DEPTH = 64
MAX_CONFIG_BYTES = 4 << 20


class _Refused(yaml.YAMLError):
    """YAML that parses but is refused: an alias or a key given twice (the message has the line)."""


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML follows YAML 1.1, where `1e-3` (no dot) is a string; read it as the number users mean.

    Two refusals on top of the safe loader. Aliases (`*name`): nine nested aliases of a nine-item list
    expand to 9^9 items (an "alias bomb": gigabytes and minutes before any key is checked), and no config
    needs one. Duplicate keys: the last one would win silently, so an edit above might not take effect.
    """

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _Refused(f"line {event.start_mark.line + 1}: alias *{event.anchor[:40]}: YAML aliases "
                           f"are not accepted in a config; write the value out")
        # Nesting is composed recursively: 100,000 levels were a RecursionError of 3,000 lines.
        self.depth = getattr(self, "depth", 0) + 1
        try:
            if self.depth > MAX_YAML_DEPTH:
                raise _Refused(f"line {self.peek_event().start_mark.line + 1}: nested more than {MAX_YAML_DEPTH} "
                               f"levels deep; no config needs that")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":   # `<<:` merges an alias's mapping: none to merge here
                raise _Refused(f"line {key_node.start_mark.line + 1}: YAML merge keys (<<) are not accepted in a "
                               f"config; write the keys out")
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the safe constructor refuses it itself
                continue
            if duplicate:
                raise _Refused(f"line {key_node.start_mark.line + 1}: key {_show(key)} appears twice in the same "
                               f"mapping (the last one would win silently); keep one")
        return super().construct_mapping(node, deep)


# Booleans as YAML 1.2 writes them (true / false): YAML 1.1's yes / no / on / off made `name: yes` a boolean,
# refused as "expected a string, got True" (probe). A key that takes a boolean refuses them, with that hint
YAML11_BOOLEANS = ("yes", "no", "on", "off", "y", "n")
_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


_KINDS = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "true or false"}


def _regular_file(path: Path, what=""):
    """A ConfigError naming `path` unless it is a regular file: missing, not regular (a folder, a FIFO), or a
    symlink loop / a link to nothing (which read as missing: stat's words say which). `what`: said after."""
    if path.is_file():
        return
    if path.is_symlink():
        try:
            path.stat()
        except OSError as e:
            raise ConfigError(f"{path}: cannot read it: {e.strerror or e}{what}") from None
    raise ConfigError(f"{path}: {'not a regular file' if path.exists() else 'file not found'}{what}")


def _load_yaml(path: Path):
    _regular_file(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:   # unreadable (permissions): bad input, named, like the others
        raise ConfigError(f"{path}: cannot read it: {e.strerror or e}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES >> 20} MB; not a config")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"{path}: line {line}: byte 0x{raw[e.start]:02x} is not UTF-8 text; save the file "
                          f"as UTF-8") from None
    try:
        data = yaml.load(text, Loader=_Yaml12Loader)
    except _Refused as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}".replace("\n", " ")) from None
    except ValueError as e:   # a value YAML reads but Python refuses: an integer of more than 4300 digits
        raise ConfigError(f"{path}: {e}") from None
    if data is None:  # an empty file would otherwise run every default without a word
        raise ConfigError(f"{path}: empty file (expected a mapping of keys, e.g. pipeline.yaml or devices/local.yaml)")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys (key: value lines, e.g. pipeline.yaml or "
                          f"devices/local.yaml), got {_KINDS.get(type(data), type(data).__name__)} {_show(data)}")
    odd = [k for k in data if not isinstance(k, str)]
    if odd:
        raise ConfigError(f"{path}: key {_show(odd[0])} is not a name; keys are words such as data, model, train")
    return data


def _check(condition, where, message):
    if not condition:
        raise ConfigError(f"{where}: {message}")


def _check_data(d: DataConfig, p):
    """What the data keys say alone; the files themselves are read (and checked) when the data loads."""
    from edgebayes.data import DataError, resolve_loader
    from edgebayes.plugins import IMPORT_PATH

    own = d.dataset in DATA_FORMATS
    _check(d.dataset in BUILTIN_DATASETS or own or IMPORT_PATH.match(d.dataset), f"{p}: data.dataset",
           f"expected one of {', '.join(repr(n) for n in BUILTIN_DATASETS + DATA_FORMATS)}, or "
           f"package.module:function (a loader of your own), got {_show(d.dataset)}")
    if ":" in d.dataset:
        try:
            resolve_loader(d.dataset)
        except DataError as e:
            raise ConfigError(f"{p}: {e}") from None
    _check(not own or bool(d.path), f"{p}: data.path", f"required when data.dataset is {d.dataset}")
    _check(d.dataset not in BUILTIN_DATASETS or d.path is None, f"{p}: data.path",
           f"read for data.dataset {', '.join(DATA_FORMATS)} or a loader of your own; {d.dataset} does not use "
           f"it (its files come from data.root)")
    for key in ("image_size", "channels"):
        _check(getattr(d, key) is None or d.dataset == "image-folder", f"{p}: data.{key}",
               "only read for data.dataset image-folder")
    _check(d.image_size is None or (len(d.image_size) == 2 and min(d.image_size) > 0), f"{p}: data.image_size",
           f"expected [height, width], two positive integers, got {_show(d.image_size)}")
    _check(d.label_column is None or d.dataset == "csv", f"{p}: data.label_column", "only read for data.dataset csv")
    _check(not d.signals or d.dataset == "npz" or ":" in d.dataset, f"{p}: data.signals",
           "only read for data.dataset npz or a loader of your own (arrays whose layout it tells)")


SPIKE_SLAB_FAMILIES = ("ss-ig", "ss-gl", "ss-ghs")   # the families with prunable units (train/spike_slab.py PRIORS)


SETTING_EXAMPLE = "train.epochs=3"


def apply_settings(data, settings, path) -> dict:
    """`--set section.key=value` settings (command line) applied to a config file's mapping `data`; the value
    is read as YAML (1.2 numbers, as in the file: `train.lr=1e-3`, `select.mc_samples=[1,4]`, `null`). A
    malformed setting is one ConfigError naming it; its key and value are validated with the file's own."""
    data = dict(data) if isinstance(data, dict) else data
    top_level = [n for n, f in PipelineConfig.model_fields.items() if not _is_section(f)]   # seed, name
    for setting in settings:
        key, sep, value = setting.partition("=")
        setting = setting if len(setting) <= 120 else setting[:120] + "..."   # as said in messages: a line
        parts = key.strip().split(".")
        if not sep or not all(parts) or (len(parts) < 2 and parts[0] not in top_level):
            raise ConfigError(f"--set {setting}: expected section.key=value (or {' / '.join(top_level)}=value), "
                              f"e.g. --set {SETTING_EXAMPLE}")
        node = data
        for depth, section in enumerate(parts[:-1]):
            child = node.get(section) if isinstance(node, dict) else None
            if not isinstance(node, dict) or not isinstance(child, (dict, type(None))):
                held = f" (it holds {_show(child)})" if isinstance(node, dict) else ""
                raise ConfigError(f"--set {setting}: {'.'.join(parts[:depth + 1])} is not a section in {path}{held}")
            node[section] = node = dict(child or {})
        try:
            node[parts[-1]] = yaml.load(value, Loader=_Yaml12Loader) if value.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {setting}: the value is not valid YAML: {e}".replace("\n", " ")) from None
        except ValueError as e:   # an integer of more than 4300 digits
            raise ConfigError(f"--set {key}: {e}") from None
    return data


def load_pipeline_config(path, settings=()) -> PipelineConfig:
    """pipeline.yaml validated, with `settings` (`--set section.key=value`, cli.py) applied over it first:
    a setting is validated as the file is, and a message about its key names `--set KEY` instead of the file."""
    path = Path(path)
    settings = tuple(settings or ())
    data = _load_yaml(path)
    if settings:
        data = apply_settings(data, settings, path)
    cfg = validate(PipelineConfig, data, path, set_keys=[s.partition("=")[0].strip() for s in settings])
    shown = " ".join(settings)
    p = f"{path} with --set {shown if len(shown) <= 200 else shown[:200] + '...'}" if settings else str(path)
    _check_data(cfg.data, p)
    check_train(cfg.train, cfg.model.family, p, "train.")
    _check(cfg.select.objective != "ece-constrained-accuracy" or cfg.select.max_ece is not None,
           f"{p}: select.max_ece", "required when select.objective is ece-constrained-accuracy")
    _check_arch(cfg.model, p)
    _check_family(cfg, p)
    return cfg


def check_train(t: "TrainConfig", family: str, p: str, prefix: str = "train."):
    """The train section's checks that span keys or need the family (the pipeline's config and `eb.fit`'s
    keywords, named `prefix` + key: "train." in a file, "" for fit's arguments)."""
    from edgebayes.train.nested import NESTED_FAMILIES   # here: train/ imports this module
    _check(all(0 < e <= t.epochs for e in t.lr_milestones), f"{p}: {prefix}lr_milestones",
           f"expected epochs between 1 and {prefix}epochs")
    _check(t.kl_warmup_epochs <= t.epochs, f"{p}: {prefix}kl_warmup_epochs",
           f"expected an integer in 0..{prefix}epochs (the exact ELBO must be the objective at the end)")
    _check(t.inclusion_lr is None or family in SPIKE_SLAB_FAMILIES, f"{p}: {prefix}inclusion_lr",
           f"only a spike-and-slab family ({', '.join(SPIKE_SLAB_FAMILIES)}) has inclusion logits; leave it out (null)")
    _check(t.rho_lr is None or family in ("bnn",) + SPIKE_SLAB_FAMILIES, f"{p}: {prefix}rho_lr",
           f"only the Gaussian slab of bnn and {', '.join(SPIKE_SLAB_FAMILIES)} has a rho; leave it out (null)")
    _check(t.scale_lr is None or family in ("ss-gl", "ss-ghs"), f"{p}: {prefix}scale_lr",
           "only ss-gl and ss-ghs have slab-scale variables (tau, varsigma); leave it out (null)")
    _check(not t.kl_warmup_ordered or (t.kl_warmup_epochs > 0 and family in SPIKE_SLAB_FAMILIES),
           f"{p}: {prefix}kl_warmup_ordered", f"needs {prefix}kl_warmup_epochs > 0 and a spike-and-slab family "
           f"({', '.join(SPIKE_SLAB_FAMILIES)}): it orders the units of prunable layers")
    _check(t.flops_target is None or family in SPIKE_SLAB_FAMILIES + NESTED_FAMILIES,
           f"{p}: {prefix}flops_target",
           f"only a spike-and-slab family ({', '.join(SPIKE_SLAB_FAMILIES)}) switches units off, and a nested one "
           f"({', '.join(NESTED_FAMILIES)}) trains the widths within it; leave it out (null)")
    _check(t.flops_target != "device" or t.processes == 1, f"{p}: {prefix}flops_target",
           "device is found by one process before the first epoch; with train.processes > 1 give the share "
           "(`edgebayes train` with one process prints it first)")
    _check(t.flops_target is None or family not in SPIKE_SLAB_FAMILIES or t.flops_schedule_fraction < 1,
           f"{p}: {prefix}flops_schedule_fraction", "expected a share below 1 with a FLOPs target: at 1 the "
           "schedule's last cut is the last step, and no step trains the cut network")
    _check(t.max_accuracy_drop is None or t.flops_target is not None, f"{p}: {prefix}max_accuracy_drop",
           f"is the accuracy floor of a FLOPs target: set {prefix}flops_target too, or leave it out (null)")
    _check(t.max_accuracy_drop is None or family in SPIKE_SLAB_FAMILIES, f"{p}: {prefix}max_accuracy_drop",
           f"is the floor of the spike-and-slab families' cuts ({', '.join(SPIKE_SLAB_FAMILIES)}); a nested family "
           f"keeps every width it serves, and select picks among them: leave it out (null)")
    _check(t.batch_size is None or t.batch_size >= t.processes, f"{p}: {prefix}batch_size",
           f"expected at least {prefix}processes ({t.processes}): the batch is split over the processes")


def _check_arch(m: ModelConfig, p):
    """The architecture must resolve now (an import path is imported), not after the data has loaded."""
    from edgebayes.train.arch import ArchError, resolve_arch

    if m.pretrained is not None:
        _check(Path(m.pretrained).is_file(), f"{p}: model.pretrained", f"file not found: {m.pretrained}")
    try:
        resolve_arch(m)
    except ArchError as e:
        raise ConfigError(f"{p}: {e}") from None
    from edgebayes.train.zoo import ARCHITECTURES

    _check(not m.options or m.arch not in ARCHITECTURES, f"{p}: model.options",
           "only builders given by import path or register_arch take options; zoo nets use model.hidden / "
           "model.width_multiplier")


def _check_family(cfg: PipelineConfig, p):
    """What depends on model.family or reads its own section (sqs, nested): the knob's range, SQS in one
    process, the sections' checks across keys. (A family registry would own these.)"""
    family, values, s, n = cfg.model.family, cfg.select.knob_values, cfg.sqs, cfg.nested
    _check(cfg.train.processes == 1 or family != "sqs", f"{p}: train.processes",
           "SQS fine-tuning runs in one process (the distributed trainer serves the ELBO families); set 1")
    if s.checkpoint is not None:
        _check(Path(s.checkpoint).is_file(), f"{p}: sqs.checkpoint", f"file not found: {s.checkpoint}")
    if family == "sqs":   # 8-bit indices: model.sqs holds 256 levels per layer, onnx-codebook 255 and the zero
        windows = SQS_WINDOWS[s.windows]
        codebook = "onnx-codebook" in cfg.export.formats
        most = 255 if codebook else 256
        fits = 1 << ((most // windows).bit_length() - 1)   # components are a power of two
        ways = [f"sqs.components: {fits}"] + (["sqs.windows: single"] if windows > 1 else []) \
            + (["onnx-codebook out of export.formats"] if codebook else [])
        _check(s.components * windows <= most, f"{p}: sqs.components",
               f"{s.components} levels x {windows} windows ({s.windows}) can give {s.components * windows} levels per "
               f"layer, more than the {most} (8-bit indices) a compressed layer holds"
               f"{' in onnx-codebook (export.formats)' if codebook else ''}; set {' or '.join(ways)}")
    _check(0 <= n.fixed_groups < n.groups, f"{p}: nested.fixed_groups",
           f"expected an integer in 0..groups - 1 = {n.groups - 1}, got {n.fixed_groups}")
    _check(0 < n.temperature_min <= n.temperature, f"{p}: nested.temperature_min",
           "expected a positive number no larger than nested.temperature")
    only = [f for f in cfg.export.formats if FORMATS[f].families and family not in FORMATS[f].families]
    _check(not only, f"{p}: export.formats",
           ", ".join(f"{f} is made for model.family {' / '.join(FORMATS[f].families)} only" for f in only)
           + f", not {family}")
    # select.knob_values in the family's range, as the model's operating_points checks them after training
    where = f"{p}: select.knob_values"
    if values is None:
        return
    from edgebayes.train.nested import NESTED_FAMILIES   # here: train/ imports this module (check_train)

    if family in NESTED_FAMILIES:
        widths = [int(v) if v == int(v) else v for v in values]   # YAML's 2 is read as 2.0 (knob values are numbers)
        _check(all(v == int(v) and 1 <= v <= n.groups for v in values), where,
               f"expected widths (whole numbers of groups) in 1..nested.groups = {n.groups}, got {_show(widths)}")
        _check(any(v > n.fixed_groups for v in values), where,
               f"every width ({_show(widths)}) is at or below nested.fixed_groups = {n.fixed_groups}, which no training "
               f"step serves; give widths in {n.fixed_groups + 1}..{n.groups}")
    elif family == "sqs":
        _check(all(0 < v <= 1 for v in values), where, f"expected non-zero rates in (0, 1], got {_show(values)}")
    else:
        _check(all(0 < v < 1 for v in values), where, f"expected inclusion thresholds in (0, 1), got {_show(values)}")


def devices_dirs() -> list[Path]:
    """Where device profiles are looked up, the first folder holding NAME.yaml winning: --devices-dir,
    then $EDGEBAYES_DEVICES, then the profiles shipped in the package."""
    user = [Path(d).expanduser() for d in (USER_DEVICES_DIR, os.environ.get("EDGEBAYES_DEVICES")) if d]
    # A mistyped folder was passed over without a word, the shipped profiles answering: --devices-dir, given for
    # this command, is refused; the environment's, set once for every command, is warned about and skipped
    if USER_DEVICES_DIR:
        _check(user[0].is_dir(), f"--devices-dir {user[0]}", "not a folder of device profiles")
    if os.environ.get("EDGEBAYES_DEVICES") and not user[-1].is_dir():
        warn_once(f"$EDGEBAYES_DEVICES {user[-1]}: not a folder of device profiles; skipped")
        user.pop()
    return [*user, DEVICES_DIR]


def known_devices() -> list[str]:
    return sorted({p.stem for d in devices_dirs() for p in d.glob("*.yaml") if p.is_file()})


def _profile_path(name: str) -> Path:
    if name.endswith((".yaml", ".yml")):
        path = Path(name)   # a path, not a name: not looked for among the profiles as <name>.yaml.yaml
        _regular_file(path, " (a device profile given by its path)")
    else:
        path = next((d / f"{name}.yaml" for d in devices_dirs() if (d / f"{name}.yaml").is_file()),
                    devices_dirs()[0] / f"{name}.yaml")
    if not path.is_file():
        where = ", ".join(str(d) for d in devices_dirs())
        several = "," in name and all(part.strip() for part in name.split(","))   # --devices a,b (probe)
        raise ConfigError(f"unknown device {name!r}: no {name}.yaml in {where} "
                          f"(known devices: {', '.join(known_devices()) or 'none'})"
                          + (f"; several devices are given apart: {' '.join(p.strip() for p in name.split(','))}"
                             if several else ""))
    return path


def load_device_profile(name: str) -> DeviceProfile:
    """Load devices/<name>.yaml; `name` may also be a path to a YAML file.

    A file holding only `alias: <other>` names another profile (devices/jetson.yaml -> jetson-orin-nano),
    so the names users type work without a second copy of the profile.
    """
    path = _profile_path(name)
    data = _load_yaml(path)
    if isinstance(data, dict) and "alias" in data:
        _check(set(data) == {"alias"} and isinstance(data["alias"], str), f"{path}: alias",
               "an alias file holds only `alias: <profile name>`")
        _check(NAME.fullmatch(data["alias"]) is not None, f"{path}: alias",   # a name, looked up as --device is
               f"expected a profile's name (letters, digits, -, _, .), got {data['alias']!r}")
        _check(data["alias"] != path.stem, f"{path}: alias", "a profile cannot be an alias of itself")
        try:
            target = _profile_path(data["alias"])
        except ConfigError as e:   # say which file points there
            raise ConfigError(f"{path}: alias: {e}") from None
        _check(not (isinstance(_load_yaml(target), dict) and "alias" in _load_yaml(target)), f"{path}: alias",
               f"{data['alias']!r} is itself an alias; point at the profile")
        return load_device_profile(data["alias"])
    profile = validate(DeviceProfile, data, path)
    p, c, lm = str(path), profile.connection, profile.latency_model
    _check(c.kind != "ssh" or bool(c.host), f"{p}: connection.host", "required when connection.kind is ssh")
    if c.kind == "ssh":   # what ssh would do with these options, as ssh itself reads them
        judge_ssh_config(c, p)
    _check(lm.kind != "flops" or (lm.flops_per_second or 0) > 0, f"{p}: latency_model.flops_per_second",
           "a positive number is required when latency_model.kind is flops")
    # The runs' folders of a device are named by `name`: a copy of local.yaml saved as mybox.yaml that kept
    # `name: local` wrote over local's measured results (probe)
    _check(profile.name == path.stem, f"{p}: name",
           f"{profile.name!r} is not the file's name {path.stem!r}; the device's folders under --runs-dir are named "
           f"by it, so this profile would write over device {profile.name}'s results: set `name: {path.stem}` (or "
           f"name the file {profile.name}.yaml)")
    return profile


def keys_table(kind: str = "pipeline") -> str:
    """The Markdown table of every key (dotted name, meaning, default) from the same Field descriptions as the
    JSON Schema: `edgebayes config schema --markdown`, and the tables of devices/README.md and configs/README.md."""
    def rows(model, prefix=""):
        for name, f in model.model_fields.items():
            if isinstance(f.annotation, type) and issubclass(f.annotation, Section):
                yield from rows(f.annotation, f"{prefix}{name}.")
            else:
                default = "(required)" if f.is_required() else json.dumps(f.default)
                yield f"| `{prefix}{name}` | {f.description.replace('|', '/')} | {default} |"
    model = {"pipeline": PipelineConfig, "device": DeviceProfile}[kind]
    return "\n".join(["| key | meaning | default |", "|---|---|---|", *rows(model)]) + "\n"


def json_schema(kind: str = "pipeline") -> dict:
    """The JSON Schema of pipeline.yaml (kind "pipeline") or of a device profile ("device"), for editors."""
    model = {"pipeline": PipelineConfig, "device": DeviceProfile}[kind]
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **model.model_json_schema()}


def expand_repo(value):
    """Placeholders of connection fields (the ssh-localhost profile): `{repo}` is the working directory,
    whose runs/ holds the throwaway sshd's keys and the device folder (not the install location: two
    checkouts, or an installed edgebayes, must not share one runs/); `{python}` is this interpreter."""
    if not isinstance(value, str):
        return value
    return value.replace("{repo}", str(Path.cwd())).replace("{python}", sys.executable)


def as_dict(obj) -> dict:
    return obj.model_dump()


def fingerprint(*parts) -> str:
    """A stable hash of JSON-able parts (config sections, upstream fingerprints)."""
    blob = json.dumps([as_dict(p) if isinstance(p, BaseModel) else p for p in parts], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ssh settings as ssh reads them (a profile is data: judged before any ssh runs; deploy/transport.py runs ssh)
def ssh_destination(c) -> str:
    return f"{c.user}@{c.host}" if c.user else c.host


def ssh_options(c, config_file=True, by_hand=False, port_flag="-p") -> list:
    """The ssh options of a profile's connection, as SSHTransport runs ssh and `judge_ssh_config` reads them;
    `by_hand`: without the batch-mode and keep-alive ones, for commands a person types (the finishing steps of
    a report of predictions); `port_flag` "-P" for scp."""
    opts = [] if by_hand else ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={c.connect_timeout_s}",
                               "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4"]
    if c.ssh_config and config_file:
        opts += ["-F", expand_repo(c.ssh_config)]
    if c.port:
        opts += [port_flag, str(c.port)]
    if c.identity_file:
        opts += ["-i", os.path.expanduser(expand_repo(c.identity_file))]
    if c.proxy_jump:
        opts += ["-J", c.proxy_jump]
    for option in c.options or []:
        opts += ["-o", expand_repo(option)]
    return opts


# What ssh may do on this machine beyond connecting, by the keyword `ssh -G` prints (ssh_config(5)): run a
# command (ProxyCommand; LocalCommand, which PermitLocalCommand enables; KnownHostsCommand; the xauth program
# of XAuthLocation), load a library into ssh (PKCS11Provider, SecurityKeyProvider), or open this machine to
# the device (the agent's keys, the X display, forwarded ports, a tunnel device).
LOCAL_EFFECTS = {"proxycommand": "ProxyCommand", "localcommand": "LocalCommand",
                 "permitlocalcommand": "PermitLocalCommand", "knownhostscommand": "KnownHostsCommand",
                 "xauthlocation": "XAuthLocation", "pkcs11provider": "PKCS11Provider",
                 "securitykeyprovider": "SecurityKeyProvider", "forwardagent": "ForwardAgent",
                 "forwardx11": "ForwardX11", "localforward": "LocalForward", "remoteforward": "RemoteForward",
                 "dynamicforward": "DynamicForward", "tunnel": "Tunnel"}
_RUNS = {"proxycommand", "localcommand", "permitlocalcommand", "knownhostscommand", "xauthlocation",
         "pkcs11provider", "securitykeyprovider"}
# ssh runs `Match exec` commands with $SHELL while it reads its configuration, `ssh -G` included; with a
# shell that does not exist it stops there instead, saying so: how we see a Match exec without running it.
_NO_SHELL = "/nonexistent/edgebayes-refuses-match-exec"
MAX_SSH_CONFIG_BYTES = 1 << 20


class _MatchExec(Exception):
    pass


def _effective_ssh_config(opts, destination) -> dict:
    """`ssh -G`: the configuration ssh would use for this destination (keyword -> its values), with every
    Match block evaluated as ssh evaluates it. Raises _MatchExec where one runs a command, InputError with
    ssh's own message where ssh refuses the options."""
    try:
        proc = subprocess.run(["ssh", "-G", *opts, "--", destination], capture_output=True, timeout=30,
                              stdin=subprocess.DEVNULL, env={**os.environ, "SHELL": _NO_SHELL})
    except subprocess.TimeoutExpired:
        raise InputError("`ssh -G` did not answer in 30 s") from None
    err = [ln.strip() for ln in proc.stderr.decode(errors="replace").replace("\r", "\n").splitlines() if ln.strip()]
    if proc.returncode != 0:
        if any(_NO_SHELL in ln for ln in err):
            raise _MatchExec()
        raise InputError(next((ln for ln in err if "terminal" not in ln), f"exit code {proc.returncode}"))
    config = {}
    for line in proc.stdout.decode(errors="replace").splitlines():
        key, _, value = line.partition(" ")
        config.setdefault(key.lower(), []).append(value)
    return config


def _match_exec_in(path, depth=0):
    """The file (this ssh config file or one it Includes) holding a `Match ... exec` line, read as ssh
    tokenizes it (quotes, `=`, any case, `!exec`), whether or not the Match applies: a profile's own config
    file may hide one behind a condition that is false today. None if there is none."""
    try:
        text = Path(path).read_text(errors="replace") if depth < 16 and Path(path).is_file() else ""
    except OSError:
        return None
    for line in text.splitlines():
        try:
            words = shlex.split(line.replace("=", " ", 1), comments=True)
        except ValueError:
            words = line.replace("=", " ").replace('"', " ").split()
        key = words[0].lower() if words else ""
        if key == "match" and any(w.lower().lstrip("!").startswith("exec") for w in words[1:]):
            return Path(path)
        if key == "include":   # relative to ~/.ssh, as ssh resolves a user config's Include
            home = Path("~/.ssh").expanduser()
            for f in (f for w in words[1:] for f in sorted(glob.glob(str(home / os.path.expanduser(w))))):
                if (found := _match_exec_in(f, depth + 1)) is not None:
                    return found
    return None


def judge_ssh_config(c, where):
    """Refuse a profile (ConfigError naming `where` and the field) whose ssh configuration, read by ssh
    itself (`ssh -G` with its options and config file, so no quoting, case or `=` hides a keyword), makes
    ssh run a command or open this machine (LOCAL_EFFECTS, `Match exec`), for the host or any jump host,
    unless `connection.trusted`. A profile is data users share; what the user's own ~/.ssh/config already
    does for a host is theirs, and allowed. No ssh installed: nothing can run, nothing to judge (the
    transport says ssh is missing)."""

    path = None
    if c.ssh_config:
        path = Path(os.path.expanduser(expand_repo(c.ssh_config)))
        if not path.is_file() or path.stat().st_size > MAX_SSH_CONFIG_BYTES:
            raise ConfigError(f"{where}: connection.ssh_config: {path} is not a readable file "
                              f"{'of at most 1 MB' if path.is_file() else '(missing, or not a regular file)'}")
    if c.trusted or shutil.which("ssh") is None:
        return
    allowed = "allowed only with `connection.trusted: true` in a profile you wrote or checked"
    if path and (found := _match_exec_in(path)) is not None:
        raise ConfigError(f"{where}: connection.ssh_config: {found} has a `Match exec`"
                          f"{'' if found == path else f' (included by {path})'}, which makes ssh run a command "
                          f"on this machine; {allowed}")

    def effective(opts, dest):
        try:
            return _effective_ssh_config(opts, dest)
        except _MatchExec:
            raise ConfigError(f"{where}: connection: ssh's configuration for {dest} evaluates a `Match exec`, "
                              f"which makes ssh run a command on this machine; {allowed}") from None
        except InputError as e:
            raise ConfigError(f"{where}: connection: ssh refuses these settings ({e})") from None

    def offending(config, dest):
        """The first LOCAL_EFFECTS keyword set otherwise than by ssh's defaults or the user's own config."""
        defaults = [effective(["-F", os.devnull], dest)]
        try:
            defaults.append(_effective_ssh_config([], dest))
        except (_MatchExec, InputError):
            pass
        return next((k for k in LOCAL_EFFECTS if all(config.get(k, []) != d.get(k, []) for d in defaults)), None)

    # A jump host is reached by an ssh of its own, which reads the config file (not the -o options).
    hop_opts = ["-F", str(path)] if path else []
    todo, seen = [(ssh_options(c), ssh_destination(c), None)], set()
    while todo:
        opts, dest, hop = todo.pop()
        config = effective(opts, dest)
        key = offending(config, dest)
        if key is not None:
            field = "connection.options"
            if hop is not None:
                field = f"connection.ssh_config ({path}) for jump host {hop}" if path else "connection.proxy_jump"
            elif path and offending(effective(ssh_options(c, config_file=False), dest), dest) is None:
                field = f"connection.ssh_config ({path})"
            effect = "makes ssh run code on this machine" if key in _RUNS else "opens this machine to the device"
            raise ConfigError(f"{where}: {field}: ssh reads {LOCAL_EFFECTS[key]} {_show(' '.join(config[key]))} "
                              f"from them, which {effect}; {allowed}")
        for jump in (config.get("proxyjump") or ["none"])[0].split(","):
            m = JUMP_HOP.fullmatch(jump)
            if jump != "none" and m and jump not in seen and len(seen) < 16:
                seen.add(jump)
                host = m["ip6"] or m["host"]
                todo.append(([*hop_opts, *(["-p", m["port"]] if m["port"] else [])],
                             f"{m['user']}@{host}" if m["user"] else host, jump))
