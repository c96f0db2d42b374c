"""Validated configuration: `pipeline.yaml` (the run) and `devices/<name>.yaml` (a device profile).

Each file is parsed into pydantic models (strict: no string read as a number, no number as a boolean; unknown
keys refused), whose ranges are declared beside each field (`Check`) and end up in the JSON Schema
(`edgebayes config schema`). Checks across fields and sections follow the models (`_check_*`). Any problem (a
missing file, YAML that does not parse, an unknown key, a wrong type, a value out of range, an unknown device)
raises `ConfigError` with one message naming the file and the key (`_message` writes pydantic's first error
that way); the CLI prints it and exits with code 2 before any work is done.
"""

import hashlib
import json
import math
import os
import re
import reprlib
import sys
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Optional

import yaml
from annotated_types import MinLen
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import PydanticCustomError, core_schema

from edgebayes.errors import InputError
from edgebayes.ondevice.tables import FORMATS, PRECISIONS, PROTOCOL, RUNTIMES

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
    # a built-in set (BUILTIN_DATASETS), a format of your own data read from data.path (DATA_FORMATS), or
    # package.module:function, a loader of your own called with this DataConfig (data.py, _function)
    dataset: str = "digits"
    root: Optional[str] = None          # built-in sets: default $EDGEBAYES_DATA, else ./data
    download: bool = False              # only download when the user allows it
    path: Optional[str] = None          # npz, image-folder, csv: the file or folder (relative: working directory)
    image_size: Optional[Items[int]] = None   # image-folder: [H, W] to resize every image to; null: one size
    label_column: Optional[int | str] = None  # csv: a header name or 0-based index; null: label/target/class, else last
    val_fraction: Fraction = 0.2
    test_fraction: Fraction = 0.2       # sets without a test split (digits, your own single set)
    # train on the first N images of the training split (quick runs); null: all
    train_subset: Annotated[Optional[int], Range("expected a positive integer or null", gt=0)] = None
    # null | noise (uniform in the training inputs' range) | a built-in data set with the same input shape
    ood: Optional[Literal["noise", "digits", "mnist", "fashion-mnist", "cifar10"]] = None


class ModelConfig(Section):
    # dnn: deterministic; bnn: dense mean-field Gaussian; ss-*: spike-and-slab node/channel selection
    # sqs: sparse + quantized (paper 001), wrapping the dnn of the same architecture (section sqs)
    # bn3: Bayesian nested net (paper 002); fn3: its fixed nested-dropout baseline (section nested)
    family: Literal["dnn", "bnn", "ss-ig", "ss-gl", "ss-ghs", "sqs", "bn3", "fn3"] = "ss-gl"
    # a zoo name (mlp, lenet5-caffe, resnet20, resnet32, resnet56, vgg11, mobilenetv2), a name registered with
    # edgebayes.register_arch, or an import path package.module:builder (train/arch.py says what it may be)
    arch: str = "mlp"
    options: dict[str, Any] = {}        # keyword arguments of an import-path builder
    pretrained: Optional[str] = None    # a state dict (weights_only) of the plain network the posterior starts from
    hidden: Annotated[Items[int], Check(lambda v: all(h > 0 for h in v), "expected positive layer widths")] = [400, 400]
    activation: Literal["silu", "relu", "tanh"] = "silu"
    width_multiplier: Positive = 1.0    # vgg11, mobilenetv2: channels x this (paper 002 trains VGG11 x1.5)


class PriorConfig(Section):
    sigma0_sq: Positive = 1.0           # slab variance sigma0^2 (1 for MLP / LeNet in paper 000)
    inclusion_constant: Positive = 1e-9  # C_l of the layer-wise prior inclusion probability
    conv_inclusion: Fraction = 1e-4     # prior inclusion probability of convolution channels (paper 000, 5.3)
    a0: Positive = 4.0                  # SS-GL: varsigma^2 ~ Gamma(a0, b0)
    b0: Positive = 2.0
    c_reg: Positive = 1.0               # SS-GHS: regularization constant of the group horseshoe
    d0: Positive = 1.0                  # SS-GHS: global scale varsigma ~ C+(0, d0)
    # non-centered: w = tau* w0, w0 ~ N(0, sigma0^2) (the paper's choice for ResNets)
    parameterization: Literal["centered", "non-centered"] = "centered"
    temperature: Positive = 0.5         # relaxed Bernoulli temperature
    gamma_init: Fraction = 0.99         # initial inclusion probability ("close to 1", appendix A.2)


class TrainConfig(Section):
    epochs: PositiveInt = 100
    batch_size: PositiveInt = 1024
    lr: Positive = 1e-3
    inclusion_lr: Optional[Positive] = None   # spike-and-slab inclusion logits' lr; null: lr (trainer.py)
    rho_lr: Optional[Positive] = None   # lr of the slab's rho (sigma = softplus(rho)), bnn / ss-*; null: lr
    scale_lr: Optional[Positive] = None   # lr of the slab-scale variables (tau, varsigma), ss-gl / ss-ghs; null: lr
    optimizer: Literal["adam", "sgd"] = "adam"  # paper 000: Adam for MLP / LeNet, SGD + momentum for ResNets
    momentum: Annotated[float, Range("expected a number in [0, 1)", ge=0, lt=1)] = 0.9   # sgd only
    lr_milestones: Items[int] = []      # epochs where the lr is multiplied by lr_gamma
    lr_gamma: Annotated[float, Range("expected a number in (0, 1] (the learning rate is multiplied by it at each "
                                     "milestone)", gt=0, le=1)] = 0.1
    kl_weight: Positive = 1.0           # 1 = the exact ELBO; < 1 tempers the KL (see trainer docstring)
    mc_samples_eval: McSamples = 10     # paper 000 evaluates with 10 MC samples
    mc_samples_val: McSamples = 2       # per-epoch validation: a cheap progress signal
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Speed (train/accel.py, train/distributed.py); none of these changes the objective.
    augment: bool = False               # random crop (zero padding augment_padding) + horizontal flip, on the device
    augment_padding: NonNegativeInt = 4  # pixels of zero padding around each image before the crop
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16: autocast of the forward; KL terms and parameters stay fp32
    channels_last: bool = False         # NHWC memory format for the convolutions (faster tensor cores on GPUs)
    compile: bool = False               # torch.compile the forward and the KL; falls back to eager, logging why
    processes: PositiveInt = 1          # > 1: `edgebayes train` relaunches itself under torchrun (DDP)
    # torch threads of train, select and export; 0: the cores no other process keeps busy (train/accel.py)
    threads: Annotated[int, Range("expected a non-negative integer (0: the free cores)", ge=0)] = 0
    kl_warmup_epochs: NonNegativeInt = 0  # KL scaled by min(1, step / warm-up steps) over these epochs (trainer.py)
    # > 0: the warm-up is geometric, from this factor up to 1 (equal steps per decade; trainer.py), else linear;
    # with kl_warmup_ordered: the share of the KL's gradient on a unit's inclusion logit before its turn
    kl_warmup_from: Annotated[float, Range("expected a number in [0, 1)", ge=0, lt=1)] = 0.0
    kl_warmup_ordered: bool = False     # spike-and-slab: the KL reaches the units' inclusion logits in turn (trainer.py)


class SQSConfig(Section):
    """Family sqs (paper 001, train/sqs.py): fine-tuning epochs, batch size and kl_weight come from `train`,
    sigma0^2 from `prior`."""
    # K per layer and window: 4 = 2 bits, 16 = 4 bits
    components: Annotated[int, Check(lambda k: 2 <= k <= 256 and k & (k - 1) == 0,
                                     "expected a power of two in 2..256", enum=[2 ** b for b in range(1, 9)])] = 4
    windows: Literal["outlier", "equal", "single"] = "outlier"
    iqr_factor: Positive = 5.0          # outlier windows: tails beyond q1 - 5 IQR and q3 + 5 IQR
    prior: Literal["spike-slab", "gaussian"] = "spike-slab"
    nonzero_rate: Rate = 0.5            # target of the pruning schedule and the default knob value
    # default non-zero rates to try; null: [nonzero_rate]
    operating_points: Annotated[Optional[Items[float]], Check(lambda v: all(0 < x <= 1 for x in v),
                                                             "expected non-zero rates in (0, 1]")] = None
    # first layer's keep scores: one per weight (the paper), or one per input feature shared by the layer's
    # output units, so that whole inputs (pixels) are pruned and the mask costs ~nothing there (train/sqs.py)
    first_layer_scores: Literal["per-weight", "per-input"] = "per-weight"
    keep_init: Rate = 0.99              # initial keep probability lambda~ and prior inclusion lambda
    schedule_fraction: Rate = 0.5       # the polynomial schedule reaches the target after this share of steps
    tau: Positive = 5.0e-4              # eq. 2
    tau_prime: Positive = 0.0125        # eq. 33, halved after half of the steps
    lr_quantization: Positive = 5.0e-5  # AdamW, theta / mu / sigma / pi / biases
    lr_pruning: Positive = 0.012        # AdamW, keep scores s
    weight_decay: Annotated[float, Range("expected a non-negative number", ge=0)] = 0.0
    pretrain_epochs: PositiveInt = 10   # the deterministic stage (ignored with a checkpoint)
    pretrain_lr: Positive = 1.0e-3
    checkpoint: Optional[str] = None    # a user's state dict of the dnn network (loaded weights_only)


class NestedConfig(Section):
    """Families bn3 / fn3 (paper 002, train/nested.py): D groups of output channels per nested layer, the
    first fixed_groups always kept; the knob is the width (groups kept, 1..groups). kappa is train.kl_weight."""
    groups: PositiveInt = 32            # D: 32 for VGG11 / ResNeXt, 16 for MobileNetV2
    fixed_groups: int = 2               # leading groups for base features (VGG11 on CIFAR-10: 2)
    # conditional keep probabilities mu = sigmoid(mubar) at init: a number (paper: 3), or "uniform" to
    # start from FN3's distribution, every width equally likely (train/nested.py OrderingUnit)
    mubar_init: float | Literal["uniform"] = 3.0
    prior_keep_logit: float | Literal["uniform"] = 3.0   # the prior chain's pi = sigmoid(this), or FN3's
                                                         # uniform distribution (not given in the paper)
    log_alpha_init: float = -1.0
    log_alpha_init_first: float = -8.0  # the network's first layer
    temperature: Positive = 0.3         # Downhill temperature in the first epoch ...
    temperature_min: float = 0.03       # ... annealed exponentially to this in the last (not in the paper)
    bn_batches: PositiveInt = 2         # batch-norm statistics at a width: 2 batches of 512 (appendix 9.2)
    bn_batch_size: PositiveInt = 512


class SelectConfig(Section):
    # Values of the family's deploy-time knob to try (inclusion threshold, width, non-zero rate);
    # null: the model's own default operating points.
    knob_values: Optional[Items[float]] = None
    mc_samples: Annotated[Items[int], Check(lambda v: all(m > 0 for m in v), "expected positive integers"),
                          Check(lambda v: max(v) <= MAX_MC_SAMPLES,
                                f"expected integers in 1..{MAX_MC_SAMPLES}")] = [1, 2, 4, 8]
    # accuracy: highest val accuracy; nll: lowest val NLL; ece-constrained-accuracy: highest val accuracy
    # among the candidates whose val ECE is at most max_ece.
    objective: Literal["accuracy", "nll", "ece-constrained-accuracy"] = "accuracy"
    max_ece: Annotated[Optional[float], Range("expected a number in (0, 1] or null", gt=0, le=1)] = None


# Target formats of the exported MC-averaged model (export/formats.py has what each one is).
ExportFormat = Literal[tuple(FORMATS)]


def _each_once(message: Callable[[list], str]) -> Check:
    return Check(lambda v: len(set(v)) == len(v), message, uniqueItems=True)


class ExportConfig(Section):
    opset: Annotated[int, Range(f"expected an ONNX opset in {OPSETS[0]}..{OPSETS[1]}", ge=OPSETS[0],
                                le=OPSETS[1])] = 17
    fidelity_tolerance: Positive = 1e-4  # fp32 artifacts: max |p_artifact - p_torch| on the eval set
    # Formats exported beside the one selection chose (which is always exported and is the primary).
    formats: Annotated[Items[ExportFormat], _each_once(lambda v: f"expected each format once, got {v}")] = ["onnx"]
    layout: Literal["packed", "unrolled"] = "packed"  # the M samples as one grouped network, or M branches
    calibration_size: PositiveInt = 256  # training inputs that calibrate the int8 formats
    # fp16/int8 artifacts: accuracy floor = PyTorch MC accuracy - this
    max_accuracy_drop: Annotated[float, Range("expected a number in [0, 1)", ge=0, lt=1)] = 0.02


class BenchmarkConfig(Section):
    warmup: NonNegativeInt = PROTOCOL["warmup"]   # the runner's defaults too (ondevice/tables.py)
    min_runs: PositiveInt = PROTOCOL["min_runs"]
    min_seconds: AtLeastZero = PROTOCOL["min_seconds"]
    rounds: PositiveInt = PROTOCOL["rounds"]  # percentiles over all rounds' samples (ondevice/timing.py)


class PipelineConfig(Section):
    name: Name = "run"
    seed: Annotated[int, Range("expected an integer in 0..2^32 - 1 (numpy's and torch's seeds)",
                               ge=0, le=2**32 - 1)] = 0
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    prior: PriorConfig = PriorConfig()
    train: TrainConfig = TrainConfig()
    sqs: SQSConfig = SQSConfig()
    nested: NestedConfig = NestedConfig()
    select: SelectConfig = SelectConfig()
    export: ExportConfig = ExportConfig()
    benchmark: BenchmarkConfig = BenchmarkConfig()


# ---------------------------------------------------------------------------------------------
# A device: devices/<name>.yaml
# ---------------------------------------------------------------------------------------------
class RuntimeConfig(Section):
    name: Literal[RUNTIMES] = "onnxruntime"
    threads: Annotated[int, Range("expected a non-negative integer (0: the runtime's default)", ge=0)] = 0
    # The precisions this runtime takes on the device; selection tries each one that has an export format.
    precision: Annotated[Items[Literal[PRECISIONS]], _each_once("lists a precision twice")] = ["fp32"]
    workspace_mb: PositiveInt = 1024    # TensorRT builder workspace (engines are built on the device)


OptionalPositive = Annotated[Optional[float], Range("expected a positive number or null", gt=0)]


class Budgets(Section):
    latency_ms: OptionalPositive = None  # at `percentile`, for `batch_size` inputs
    percentile: Literal[50, 90, 99] = 90
    batch_size: Annotated[int, Range(f"expected an integer in 1..{MAX_DEVICE_BATCH}", gt=0,
                                     le=MAX_DEVICE_BATCH)] = 1
    memory_mb: OptionalPositive = None  # the model's own memory on the device (deploy/memory.py)
    model_mb: OptionalPositive = None   # size of the model file
    # the numbers of MC samples allowed; null: any
    mc_samples: Annotated[Optional[Items[int]], Check(lambda v: all(0 < m <= MAX_MC_SAMPLES for m in v),
                                                      f"expected integers in 1..{MAX_MC_SAMPLES} or null")] = None
    # or a range: at most this many
    mc_samples_max: Annotated[Optional[int], Range("expected a positive integer or null", gt=0)] = None


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
    kind: Literal["local", "ssh"] = "local"
    # ssh to this machine through a throwaway sshd (deploy/localsshd.py) in the folder of identity_file:
    # started when a command needs it and stopped when that command ends, unless it was already running
    local_sshd: bool = False
    python: Optional[str] = None        # interpreter on the device; null: this one (local) or python3 (ssh)
    workdir: Optional[str] = None       # where the bundle is copied; null: run folder (local), ~/edgebayes (ssh)
    # ssh only; each may also come from ~/.ssh/config (host may be a Host alias there).
    host: HostName = None
    user: UserName = None
    port: Annotated[Optional[int], Range("expected a port number in 1..65535", gt=0, lt=65536)] = None
    identity_file: Optional[str] = None
    proxy_jump: JumpHosts = None        # ssh -J: [user@]jumphost[:port][,...]
    ssh_config: Optional[str] = None    # ssh -F: a config file other than ~/.ssh/config
    # extra `ssh -o` options, e.g. "UserKnownHostsFile=..."
    options: Annotated[Optional[Items[str]], Check(lambda v: all("=" in o for o in v),
                                                   "expected `Key=value` ssh options")] = None
    connect_timeout_s: PositiveInt = 10
    min_free_mb: AtLeastZero = 50.0     # a deploy needs this much free disk beyond the files it copies
    # options that make ssh run a local command (ProxyCommand, LocalCommand, ...) need this: a profile
    # is data, and using one must not run a command on this machine unless its author is trusted
    trusted: bool = False


class LatencyModel(Section):
    # measure: time each candidate on the device when it is reachable, else predict from the table;
    # table: predict from the table `edgebayes devices profile` measured; flops: FLOPs / declared throughput.
    kind: Literal["measure", "table", "flops"] = "measure"
    table: Optional[str] = None         # null: runs/devices/<name>/latency_table.json, then devices/profiles/<name>.json
    flops_per_second: OptionalPositive = None   # declared throughput (paper FLOPs, multiplies only)
    overhead_ms: AtLeastZero = 0.0      # fixed per-inference cost added to the FLOPs prediction
    source: str = ""                    # where flops_per_second and overhead_ms come from


class DeviceProfile(Section):
    name: Name
    description: str = ""
    runtime: RuntimeConfig = RuntimeConfig()
    budgets: Budgets = Budgets()
    connection: Connection = Connection()
    latency_model: LatencyModel = LatencyModel()


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


def _message(cls, data, error: dict, path: str) -> str:
    tp, value, key, model = _locate(cls, data, error["loc"])
    where = f"{path}: {key}" if key else path
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
    return f"{where}: expected {_type_name(tp)}, got {_show(value)} ({type(value).__name__})"


def _validate(cls, data, path):
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        # types and keys first, then ranges: the order the file is read in, one message
        first = min(e.errors(), key=lambda err: err["type"] == "check")
        raise ConfigError(_message(cls, data, first, str(path))) from None


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


_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _load_yaml(path: Path):
    if not path.is_file():
        raise ConfigError(f"{path}: {'not a regular file' if path.exists() else 'file not found'}")
    with open(path, "rb") as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
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
    if data is None:  # an empty file would otherwise run every default without a word
        raise ConfigError(f"{path}: empty file (expected a mapping of keys, e.g. pipeline.yaml or devices/local.yaml)")
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
    _check(d.image_size is None or d.dataset == "image-folder", f"{p}: data.image_size",
           "only read for data.dataset image-folder")
    _check(d.image_size is None or (len(d.image_size) == 2 and min(d.image_size) > 0), f"{p}: data.image_size",
           f"expected [height, width], two positive integers, got {_show(d.image_size)}")
    _check(d.label_column is None or d.dataset == "csv", f"{p}: data.label_column", "only read for data.dataset csv")


_SPIKE_SLAB = ("ss-ig", "ss-gl", "ss-ghs")   # the families with prunable units (train/spike_slab.py PRIORS)


def load_pipeline_config(path) -> PipelineConfig:
    path = Path(path)
    cfg = _validate(PipelineConfig, _load_yaml(path), path)
    p = str(path)
    _check_data(cfg.data, p)
    _check(all(0 < e <= cfg.train.epochs for e in cfg.train.lr_milestones), f"{p}: train.lr_milestones",
           "expected epochs between 1 and train.epochs")
    _check(cfg.train.kl_warmup_epochs <= cfg.train.epochs, f"{p}: train.kl_warmup_epochs",
           "expected an integer in 0..train.epochs (the exact ELBO must be the objective at the end)")
    _check(cfg.train.inclusion_lr is None or cfg.model.family in _SPIKE_SLAB, f"{p}: train.inclusion_lr",
           f"only a spike-and-slab family ({', '.join(_SPIKE_SLAB)}) has inclusion logits; leave it out (null)")
    _check(cfg.train.rho_lr is None or cfg.model.family in ("bnn",) + _SPIKE_SLAB, f"{p}: train.rho_lr",
           f"only the Gaussian slab of bnn and {', '.join(_SPIKE_SLAB)} has a rho; leave it out (null)")
    _check(cfg.train.scale_lr is None or cfg.model.family in ("ss-gl", "ss-ghs"), f"{p}: train.scale_lr",
           "only ss-gl and ss-ghs have slab-scale variables (tau, varsigma); leave it out (null)")
    _check(not cfg.train.kl_warmup_ordered or (cfg.train.kl_warmup_epochs > 0 and cfg.model.family in _SPIKE_SLAB),
           f"{p}: train.kl_warmup_ordered", "needs train.kl_warmup_epochs > 0 and a spike-and-slab family "
           f"({', '.join(_SPIKE_SLAB)}): it orders the units of prunable layers")
    _check(cfg.train.batch_size >= cfg.train.processes, f"{p}: train.batch_size",
           f"expected at least train.processes ({cfg.train.processes}): the batch is split over the processes")
    _check(cfg.select.objective != "ece-constrained-accuracy" or cfg.select.max_ece is not None,
           f"{p}: select.max_ece", "required when select.objective is ece-constrained-accuracy")
    _check_arch(cfg.model, p)
    _check_family(cfg, p)
    return cfg


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
    if family in ("bn3", "fn3"):
        _check(all(v == int(v) and 1 <= v <= n.groups for v in values), where,
               f"expected widths (whole numbers of groups) in 1..nested.groups = {n.groups}, got {_show(values)}")
    elif family == "sqs":
        _check(all(0 < v <= 1 for v in values), where, f"expected non-zero rates in (0, 1], got {_show(values)}")
    else:
        _check(all(0 < v < 1 for v in values), where, f"expected inclusion thresholds in (0, 1), got {_show(values)}")


def devices_dirs() -> list[Path]:
    """Where device profiles are looked up, the first folder holding NAME.yaml winning: --devices-dir,
    then $EDGEBAYES_DEVICES, then the profiles shipped in the package."""
    user = [Path(d).expanduser() for d in (USER_DEVICES_DIR, os.environ.get("EDGEBAYES_DEVICES")) if d]
    return [*user, DEVICES_DIR]


def known_devices() -> list[str]:
    return sorted({p.stem for d in devices_dirs() for p in d.glob("*.yaml")})


def _profile_path(name: str) -> Path:
    if name.endswith((".yaml", ".yml")):
        path = Path(name)
    else:
        path = next((d / f"{name}.yaml" for d in devices_dirs() if (d / f"{name}.yaml").is_file()),
                    devices_dirs()[0] / f"{name}.yaml")
    if not path.is_file():
        where = ", ".join(str(d) for d in devices_dirs())
        raise ConfigError(f"unknown device {name!r}: no {name}.yaml in {where} "
                          f"(known devices: {', '.join(known_devices()) or 'none'})")
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
        _check(data["alias"] != path.stem, f"{path}: alias", "a profile cannot be an alias of itself")
        target = _profile_path(data["alias"])
        _check(not (isinstance(_load_yaml(target), dict) and "alias" in _load_yaml(target)), f"{path}: alias",
               f"{data['alias']!r} is itself an alias; point at the profile")
        return load_device_profile(data["alias"])
    profile = _validate(DeviceProfile, data, path)
    p, c, lm = str(path), profile.connection, profile.latency_model
    _check(c.kind != "ssh" or bool(c.host), f"{p}: connection.host", "required when connection.kind is ssh")
    if c.kind == "ssh":   # what ssh would do with these options, as ssh itself reads them
        from edgebayes.deploy.transport import judge_ssh_config

        judge_ssh_config(c, p)
    _check(lm.kind != "flops" or (lm.flops_per_second or 0) > 0, f"{p}: latency_model.flops_per_second",
           "a positive number is required when latency_model.kind is flops")
    return profile


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
