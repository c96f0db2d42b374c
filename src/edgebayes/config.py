"""Validated configuration: `pipeline.yaml` (the run) and `devices/<name>.yaml` (a device profile).

Each file is parsed into dataclasses. Any problem (a missing file, YAML that does not parse, an unknown
key, a wrong type, a value out of range, an unknown device) raises `ConfigError` with one message naming
the file and the key; the CLI prints it and exits with code 2 before any work is done.
"""

import dataclasses
import hashlib
import json
import math
import os
import re
import reprlib
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import yaml

ROOT = Path(__file__).resolve().parents[2]
# The shipped device profiles are package data (in a checkout, src/edgebayes/devices links to devices/), so
# an installed edgebayes finds them wherever it runs; a user's own profiles come first (devices_dirs).
DEVICES_DIR = Path(__file__).resolve().parent / "devices"
USER_DEVICES_DIR = None   # --devices-dir (cli.py)


from edgebayes.errors import InputError


class ConfigError(InputError):
    """A configuration problem; the message names the file and the key."""


# ---------------------------------------------------------------------------------------------
# The run: pipeline.yaml
# ---------------------------------------------------------------------------------------------
BUILTIN_DATASETS = ("digits", "mnist", "fashion-mnist", "cifar10")
DATA_FORMATS = ("npz", "image-folder", "csv")   # your own data, read from data.path (data.py says how)


@dataclass
class DataConfig:
    # a built-in set (BUILTIN_DATASETS), a format of your own data read from data.path (DATA_FORMATS), or
    # package.module:function, a loader of your own called with this DataConfig (data.py, _function)
    dataset: str = "digits"
    root: Optional[str] = None          # built-in sets: default $EDGEBAYES_DATA, else ./data
    download: bool = False              # only download when the user allows it
    path: Optional[str] = None          # npz, image-folder, csv: the file or folder (relative: working directory)
    image_size: Optional[list[int]] = None   # image-folder: [H, W] to resize every image to; null: one size
    label_column: Optional[int | str] = None  # csv: a header name or 0-based index; null: label/target/class, else last
    val_fraction: float = 0.2
    test_fraction: float = 0.2          # sets without a test split (digits, your own single set)
    train_subset: Optional[int] = None  # train on the first N images of the training split (quick runs); null: all
    # null | noise (uniform in the training inputs' range) | a built-in data set with the same input shape
    ood: Optional[Literal["noise", "digits", "mnist", "fashion-mnist", "cifar10"]] = None


@dataclass
class ModelConfig:
    # dnn: deterministic; bnn: dense mean-field Gaussian; ss-*: spike-and-slab node/channel selection
    # sqs: sparse + quantized (paper 001), wrapping the dnn of the same architecture (section sqs)
    # bn3: Bayesian nested net (paper 002); fn3: its fixed nested-dropout baseline (section nested)
    family: Literal["dnn", "bnn", "ss-ig", "ss-gl", "ss-ghs", "sqs", "bn3", "fn3"] = "ss-gl"
    # a zoo name (mlp, lenet5-caffe, resnet20, resnet32, resnet56, vgg11, mobilenetv2), a name registered with
    # edgebayes.register_arch, or an import path package.module:builder (train/arch.py says what it may be)
    arch: str = "mlp"
    options: dict = field(default_factory=dict)   # keyword arguments of an import-path builder
    pretrained: Optional[str] = None    # a state dict (weights_only) of the plain network the posterior starts from
    hidden: list[int] = field(default_factory=lambda: [400, 400])   # mlp only
    activation: Literal["silu", "relu", "tanh"] = "silu"
    width_multiplier: float = 1.0       # vgg11, mobilenetv2: channels x this (paper 002 trains VGG11 x1.5)


@dataclass
class PriorConfig:
    sigma0_sq: float = 1.0              # slab variance sigma0^2 (1 for MLP / LeNet in paper 000)
    inclusion_constant: float = 1e-9    # C_l of the layer-wise prior inclusion probability
    conv_inclusion: float = 1e-4        # prior inclusion probability of convolution channels (paper 000, 5.3)
    a0: float = 4.0                     # SS-GL: varsigma^2 ~ Gamma(a0, b0)
    b0: float = 2.0
    c_reg: float = 1.0                  # SS-GHS: regularization constant of the group horseshoe
    d0: float = 1.0                     # SS-GHS: global scale varsigma ~ C+(0, d0)
    # non-centered: w = tau* w0, w0 ~ N(0, sigma0^2) (the paper's choice for ResNets)
    parameterization: Literal["centered", "non-centered"] = "centered"
    temperature: float = 0.5            # relaxed Bernoulli temperature
    gamma_init: float = 0.99            # initial inclusion probability ("close to 1", appendix A.2)


@dataclass
class TrainConfig:
    epochs: int = 100
    batch_size: int = 1024
    lr: float = 1e-3
    optimizer: Literal["adam", "sgd"] = "adam"  # paper 000: Adam for MLP / LeNet, SGD + momentum for ResNets
    momentum: float = 0.9               # sgd only
    lr_milestones: list[int] = field(default_factory=list)  # epochs where the lr is multiplied by lr_gamma
    lr_gamma: float = 0.1
    kl_weight: float = 1.0              # 1 = the exact ELBO; < 1 tempers the KL (see trainer docstring)
    mc_samples_eval: int = 10           # paper 000 evaluates with 10 MC samples
    mc_samples_val: int = 2             # per-epoch validation: a cheap progress signal
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Speed (train/accel.py, train/distributed.py); none of these changes the objective.
    augment: bool = False               # random crop (zero padding augment_padding) + horizontal flip, on the device
    augment_padding: int = 4            # pixels of zero padding around each image before the crop
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16: autocast of the forward; KL terms and parameters stay fp32
    channels_last: bool = False         # NHWC memory format for the convolutions (faster tensor cores on GPUs)
    compile: bool = False               # torch.compile the forward and the KL; falls back to eager, logging why
    processes: int = 1                  # > 1: `edgebayes train` relaunches itself under torchrun (DDP)
    threads: int = 0                    # torch threads of train, select, export; 0: the free cores (train/accel.py)
    kl_warmup_epochs: int = 0           # KL scaled by min(1, step / warm-up steps) over these epochs (trainer.py)


@dataclass
class SQSConfig:
    """Family sqs (paper 001, train/sqs.py): fine-tuning epochs, batch size and kl_weight come from `train`,
    sigma0^2 from `prior`."""
    components: int = 4                 # K per layer and window: 4 = 2 bits, 16 = 4 bits
    windows: Literal["outlier", "equal", "single"] = "outlier"
    iqr_factor: float = 5.0             # outlier windows: tails beyond q1 - 5 IQR and q3 + 5 IQR
    prior: Literal["spike-slab", "gaussian"] = "spike-slab"
    nonzero_rate: float = 0.5           # target of the pruning schedule and the default knob value
    operating_points: Optional[list[float]] = None   # default non-zero rates to try; null: [nonzero_rate]
    # first layer's keep scores: one per weight (the paper), or one per input feature shared by the layer's
    # output units, so that whole inputs (pixels) are pruned and the mask costs ~nothing there (train/sqs.py)
    first_layer_scores: Literal["per-weight", "per-input"] = "per-weight"
    keep_init: float = 0.99             # initial keep probability lambda~ and prior inclusion lambda
    schedule_fraction: float = 0.5      # the polynomial schedule reaches the target after this share of steps
    tau: float = 5.0e-4                 # eq. 2
    tau_prime: float = 0.0125           # eq. 33, halved after half of the steps
    lr_quantization: float = 5.0e-5     # AdamW, theta / mu / sigma / pi / biases
    lr_pruning: float = 0.012           # AdamW, keep scores s
    weight_decay: float = 0.0
    pretrain_epochs: int = 10           # the deterministic stage (ignored with a checkpoint)
    pretrain_lr: float = 1.0e-3
    checkpoint: Optional[str] = None    # a user's state dict of the dnn network (loaded weights_only)


@dataclass
class NestedConfig:
    """Families bn3 / fn3 (paper 002, train/nested.py): D groups of output channels per nested layer, the
    first fixed_groups always kept; the knob is the width (groups kept, 1..groups). kappa is train.kl_weight."""
    groups: int = 32                    # D: 32 for VGG11 / ResNeXt, 16 for MobileNetV2
    fixed_groups: int = 2               # leading groups for base features (VGG11 on CIFAR-10: 2)
    # conditional keep probabilities mu = sigmoid(mubar) at init: a number (paper: 3), or "uniform" to
    # start from FN3's distribution, every width equally likely (train/nested.py OrderingUnit)
    mubar_init: float | Literal["uniform"] = 3.0
    prior_keep_logit: float | Literal["uniform"] = 3.0   # the prior chain's pi = sigmoid(this), or FN3's
                                                         # uniform distribution (not given in the paper)
    log_alpha_init: float = -1.0
    log_alpha_init_first: float = -8.0  # the network's first layer
    temperature: float = 0.3            # Downhill temperature in the first epoch ...
    temperature_min: float = 0.03       # ... annealed exponentially to this in the last (not in the paper)
    bn_batches: int = 2                 # batch-norm statistics at a width: 2 batches of 512 (appendix 9.2)
    bn_batch_size: int = 512


@dataclass
class SelectConfig:
    # Values of the family's deploy-time knob to try (inclusion threshold, width, non-zero rate);
    # null: the model's own default operating points.
    knob_values: Optional[list[float]] = None
    mc_samples: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    # accuracy: highest val accuracy; nll: lowest val NLL; ece-constrained-accuracy: highest val accuracy
    # among the candidates whose val ECE is at most max_ece.
    objective: Literal["accuracy", "nll", "ece-constrained-accuracy"] = "accuracy"
    max_ece: Optional[float] = None


# Target formats of the exported MC-averaged model (export/formats.py has what each one is).
ExportFormat = Literal["onnx", "onnx-int8", "tflite-fp32", "tflite-fp16", "tflite-int8", "tensorrt-fp16",
                       "tensorrt-int8"]


@dataclass
class ExportConfig:
    opset: int = 17
    fidelity_tolerance: float = 1e-4     # fp32 artifacts: max |p_artifact - p_torch| on the eval set
    # Formats exported beside the one selection chose (which is always exported and is the primary).
    formats: list[ExportFormat] = field(default_factory=lambda: ["onnx"])
    layout: Literal["packed", "unrolled"] = "packed"  # the M samples as one grouped network, or M branches
    calibration_size: int = 256          # training inputs that calibrate the int8 formats
    max_accuracy_drop: float = 0.02      # fp16/int8 artifacts: accuracy floor = PyTorch MC accuracy - this


@dataclass
class BenchmarkConfig:
    warmup: int = 20
    min_runs: int = 200
    min_seconds: float = 1.0
    rounds: int = 10         # the runner reports each percentile as its best round's (runner.latency_summary)


@dataclass
class PipelineConfig:
    name: str = "run"
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    prior: PriorConfig = field(default_factory=PriorConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sqs: SQSConfig = field(default_factory=SQSConfig)
    nested: NestedConfig = field(default_factory=NestedConfig)
    select: SelectConfig = field(default_factory=SelectConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)


# ---------------------------------------------------------------------------------------------
# A device: devices/<name>.yaml
# ---------------------------------------------------------------------------------------------
PRECISIONS = ("fp32", "fp16", "int8")


@dataclass
class RuntimeConfig:
    name: Literal["onnxruntime", "tflite", "tensorrt"] = "onnxruntime"
    threads: int = 0                    # 0: the runtime's default
    # The precisions this runtime takes on the device; selection tries each one that has an export format.
    precision: list[Literal["fp32", "fp16", "int8"]] = field(default_factory=lambda: ["fp32"])
    workspace_mb: int = 1024            # TensorRT builder workspace (engines are built on the device)


@dataclass
class Budgets:
    latency_ms: Optional[float] = None  # at `percentile`, for `batch_size` inputs
    percentile: Literal[50, 90, 99] = 90
    batch_size: int = 1
    memory_mb: Optional[float] = None   # peak RSS of the runner on the device
    model_mb: Optional[float] = None    # size of the model file
    mc_samples: Optional[list[int]] = None  # the numbers of MC samples allowed; null: any
    mc_samples_max: Optional[int] = None    # or a range: at most this many


@dataclass
class Connection:
    kind: Literal["local", "ssh"] = "local"
    # ssh to this machine through a throwaway sshd (deploy/localsshd.py) in the folder of identity_file:
    # started when a command needs it and stopped when that command ends, unless it was already running
    local_sshd: bool = False
    python: Optional[str] = None        # interpreter on the device; null: this one (local) or python3 (ssh)
    workdir: Optional[str] = None       # where the bundle is copied; null: run folder (local), ~/edgebayes (ssh)
    # ssh only; each may also come from ~/.ssh/config (host may be a Host alias there).
    host: Optional[str] = None
    user: Optional[str] = None
    port: Optional[int] = None
    identity_file: Optional[str] = None
    proxy_jump: Optional[str] = None    # ssh -J: [user@]jumphost[:port][,...]
    ssh_config: Optional[str] = None    # ssh -F: a config file other than ~/.ssh/config
    options: Optional[list[str]] = None  # extra `ssh -o` options, e.g. "UserKnownHostsFile=..."
    connect_timeout_s: int = 10
    min_free_mb: float = 50.0           # a deploy needs this much free disk beyond the files it copies
    # options that make ssh run a local command (ProxyCommand, LocalCommand, ...) need this: a profile
    # is data, and using one must not run a command on this machine unless its author is trusted
    trusted: bool = False


@dataclass
class LatencyModel:
    # measure: time each candidate on the device when it is reachable, else predict from the table;
    # table: predict from the table `edgebayes devices profile` measured; flops: FLOPs / declared throughput.
    kind: Literal["measure", "table", "flops"] = "measure"
    table: Optional[str] = None         # null: runs/devices/<name>/latency_table.json, then devices/profiles/<name>.json
    flops_per_second: Optional[float] = None   # declared throughput (paper FLOPs, multiplies only)
    overhead_ms: float = 0.0            # fixed per-inference cost added to the FLOPs prediction
    source: str = ""                    # where flops_per_second and overhead_ms come from


@dataclass
class DeviceProfile:
    name: str
    description: str = ""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    budgets: Budgets = field(default_factory=Budgets)
    connection: Connection = field(default_factory=Connection)
    latency_model: LatencyModel = field(default_factory=LatencyModel)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------
def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false",
            dict: "a mapping of names to values"}.get(
        tp, getattr(tp, "__name__", str(tp)))


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxdict = _REPR.maxtuple = 6
_REPR.maxlevel = 2


def _show(value) -> str:
    """A value for a message, shortened (reprlib): a huge string or list must not make a huge message."""
    return _REPR.repr(value)


def _convert(tp, value, where):
    """Check `value` against the annotation `tp`; return the converted value or raise ConfigError."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, where)
            except ConfigError:
                pass
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {_show(value)}")
    if origin is Literal:
        if value in typing.get_args(tp) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {_show(value)}")
    if origin is list:
        if not isinstance(value, list) or not value:
            raise ConfigError(f"{where}: expected a non-empty list, got {_show(value)}")
        (item,) = typing.get_args(tp)
        return [_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # .inf / .nan (and ints too large for a float) pass every `> 0` check and break the run later
            try:
                value = float(value)
            except OverflowError:
                value = math.inf
            if not math.isfinite(value):
                raise ConfigError(f"{where}: expected a finite number, got {value}")
            return value
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is dict:
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return value
    raise ConfigError(f"{where}: expected {_type_name(tp)}, got {_show(value)} ({type(value).__name__})")


def _join(where, key):
    """'file.yaml' + 'train' -> 'file.yaml: train'; 'file.yaml: train' + 'epochs' -> 'file.yaml: train.epochs'."""
    return f"{where}.{key}" if ": " in where else f"{where}: {key}"


def _build(cls, data, where):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of keys, got {_show(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            raise ConfigError(f"{_join(where, key)}: unknown key (allowed: {', '.join(fields)})")
    kwargs = {}
    for name, f in fields.items():
        key_where = _join(where, name)
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], key_where)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{key_where}: required key is missing")
    return cls(**kwargs)


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
        return super().compose_node(parent, index)

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
        raise ConfigError(f"{path}: file not found")
    try:
        data = yaml.load(path.read_text(), Loader=_Yaml12Loader)
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
    _check(0 < d.val_fraction < 1, f"{p}: data.val_fraction", "expected a number in (0, 1)")
    _check(0 < d.test_fraction < 1, f"{p}: data.test_fraction", "expected a number in (0, 1)")
    _check(d.train_subset is None or d.train_subset > 0, f"{p}: data.train_subset",
           "expected a positive integer or null")


# Run and device names become folder names under --runs-dir (runs/<name>/<stage>/<device>): no separators,
# no leading '.' (no `..`, no hidden folders) or '-' (not an option), so a name cannot point elsewhere.
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


def _check_name(name, where):
    _check(NAME.fullmatch(name) is not None, where, "expected letters, digits, '-', '_' or '.' (not first: "
           f"'.' or '-'; at most 128), got {_show(name)}")


# Upper bounds where a value multiplies memory: M samples are M copies of the network; the device's batch
# is allocated by the runner (a batch of 1e9 asked for 238 GiB, after training and selection had run).
MAX_MC_SAMPLES = 1000
MAX_DEVICE_BATCH = 4096
# torch.onnx.export's TorchScript exporter (export/onnx_export.py) writes opsets 7 to 20.
OPSETS = (7, 20)


def load_pipeline_config(path) -> PipelineConfig:
    path = Path(path)
    cfg = _build(PipelineConfig, _load_yaml(path), str(path))
    p = str(path)
    _check_name(cfg.name, f"{p}: name")
    _check(0 <= cfg.seed < 2**32, f"{p}: seed", "expected an integer in 0..2^32 - 1 (numpy's and torch's seeds)")
    _check_data(cfg.data, p)
    _check(all(h > 0 for h in cfg.model.hidden), f"{p}: model.hidden", "expected positive layer widths")
    _check(cfg.prior.sigma0_sq > 0, f"{p}: prior.sigma0_sq", "expected a positive number")
    _check(0 < cfg.prior.gamma_init < 1, f"{p}: prior.gamma_init", "expected a number in (0, 1)")
    _check(cfg.prior.temperature > 0, f"{p}: prior.temperature", "expected a positive number")
    _check(0 < cfg.prior.conv_inclusion < 1, f"{p}: prior.conv_inclusion", "expected a number in (0, 1)")
    _check(cfg.prior.c_reg > 0, f"{p}: prior.c_reg", "expected a positive number")
    _check(cfg.prior.d0 > 0, f"{p}: prior.d0", "expected a positive number")
    _check(cfg.train.epochs > 0, f"{p}: train.epochs", "expected a positive integer")
    _check(cfg.train.batch_size > 0, f"{p}: train.batch_size", "expected a positive integer")
    _check(cfg.train.kl_weight > 0, f"{p}: train.kl_weight", "expected a positive number")
    _check(cfg.train.lr > 0, f"{p}: train.lr", "expected a positive number")
    _check(0 <= cfg.train.momentum < 1, f"{p}: train.momentum", "expected a number in [0, 1)")
    _check(all(0 < e <= cfg.train.epochs for e in cfg.train.lr_milestones), f"{p}: train.lr_milestones",
           "expected epochs between 1 and train.epochs")
    _check(cfg.train.mc_samples_eval > 0, f"{p}: train.mc_samples_eval", "expected a positive integer")
    _check(cfg.train.mc_samples_val > 0, f"{p}: train.mc_samples_val", "expected a positive integer")
    _check(cfg.train.augment_padding >= 0, f"{p}: train.augment_padding", "expected a non-negative integer")
    _check(cfg.train.processes > 0, f"{p}: train.processes", "expected a positive integer")
    _check(cfg.train.batch_size >= cfg.train.processes, f"{p}: train.batch_size",
           f"expected at least train.processes ({cfg.train.processes}): the batch is split over the processes")
    _check(cfg.train.processes == 1 or cfg.model.family != "sqs", f"{p}: train.processes",
           "SQS fine-tuning runs in one process (the distributed trainer serves the ELBO families); set 1")
    _check(cfg.select.knob_values is None or len(cfg.select.knob_values) > 0, f"{p}: select.knob_values",
           "expected a non-empty list (or null for the model's default operating points)")
    _check(all(m > 0 for m in cfg.select.mc_samples), f"{p}: select.mc_samples", "expected positive integers")
    _check(cfg.select.max_ece is None or 0 < cfg.select.max_ece <= 1, f"{p}: select.max_ece",
           "expected a number in (0, 1] or null")
    _check(cfg.select.objective != "ece-constrained-accuracy" or cfg.select.max_ece is not None,
           f"{p}: select.max_ece", "required when select.objective is ece-constrained-accuracy")
    _check(cfg.export.fidelity_tolerance > 0, f"{p}: export.fidelity_tolerance", "expected a positive number")
    _check(len(set(cfg.export.formats)) == len(cfg.export.formats), f"{p}: export.formats",
           f"expected each format once, got {cfg.export.formats}")
    _check(cfg.export.calibration_size > 0, f"{p}: export.calibration_size", "expected a positive integer")
    _check(0 <= cfg.export.max_accuracy_drop < 1, f"{p}: export.max_accuracy_drop", "expected a number in [0, 1)")
    _check(cfg.model.width_multiplier > 0, f"{p}: model.width_multiplier", "expected a positive number")
    _check_arch(cfg.model, p)
    _check_sqs(cfg.sqs, p)
    _check_nested(cfg.nested, p)
    _check(cfg.benchmark.min_runs > 0, f"{p}: benchmark.min_runs", "expected a positive integer")
    _check(cfg.benchmark.rounds > 0, f"{p}: benchmark.rounds", "expected a positive integer")
    _check(cfg.benchmark.min_seconds >= 0, f"{p}: benchmark.min_seconds", "expected a number >= 0")
    _check_ranges(cfg, p)
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


def _check_ranges(cfg, p):
    """The ranges issue 19 found unchecked (each failed late: after training, in the runner, or never)."""
    for key in ("inclusion_constant", "a0", "b0"):
        _check(getattr(cfg.prior, key) > 0, f"{p}: prior.{key}", "expected a positive number")
    _check(0 < cfg.train.lr_gamma <= 1, f"{p}: train.lr_gamma",
           "expected a number in (0, 1] (the learning rate is multiplied by it at each milestone)")
    for key in ("mc_samples_eval", "mc_samples_val"):
        _check(getattr(cfg.train, key) <= MAX_MC_SAMPLES, f"{p}: train.{key}", f"expected at most {MAX_MC_SAMPLES}")
    _check(max(cfg.select.mc_samples) <= MAX_MC_SAMPLES, f"{p}: select.mc_samples",
           f"expected integers in 1..{MAX_MC_SAMPLES}")
    _check_knob_values(cfg, p)
    lo, hi = OPSETS
    _check(lo <= cfg.export.opset <= hi, f"{p}: export.opset", f"expected an ONNX opset in {lo}..{hi}")
    _check(cfg.benchmark.warmup >= 0, f"{p}: benchmark.warmup", "expected a non-negative integer")
    _check(cfg.train.threads >= 0, f"{p}: train.threads", "expected a non-negative integer (0: the free cores)")
    _check(0 <= cfg.train.kl_warmup_epochs <= cfg.train.epochs, f"{p}: train.kl_warmup_epochs",
           "expected an integer in 0..train.epochs (the exact ELBO must be the objective at the end)")


def _check_knob_values(cfg, p):
    """select.knob_values in the family's range, as the model's operating_points checks them after training."""
    values, family = cfg.select.knob_values, cfg.model.family
    if values is None:
        return
    where = f"{p}: select.knob_values"
    if family in ("bn3", "fn3"):
        groups = cfg.nested.groups
        _check(all(v == int(v) and 1 <= v <= groups for v in values), where,
               f"expected widths (whole numbers of groups) in 1..nested.groups = {groups}, got {_show(values)}")
    elif family == "sqs":
        _check(all(0 < v <= 1 for v in values), where, f"expected non-zero rates in (0, 1], got {_show(values)}")
    else:
        _check(all(0 < v < 1 for v in values), where, f"expected inclusion thresholds in (0, 1), got {_show(values)}")


def _check_sqs(s: SQSConfig, p):
    k = s.components
    _check(2 <= k <= 256 and k & (k - 1) == 0, f"{p}: sqs.components", "expected a power of two in 2..256")
    for key in ("nonzero_rate", "keep_init", "schedule_fraction"):
        _check(0 < getattr(s, key) <= 1, f"{p}: sqs.{key}", "expected a number in (0, 1]")
    _check(s.operating_points is None or all(0 < v <= 1 for v in s.operating_points), f"{p}: sqs.operating_points",
           "expected non-zero rates in (0, 1]")
    for key in ("iqr_factor", "tau", "tau_prime", "lr_quantization", "lr_pruning", "pretrain_lr"):
        _check(getattr(s, key) > 0, f"{p}: sqs.{key}", "expected a positive number")
    _check(s.weight_decay >= 0, f"{p}: sqs.weight_decay", "expected a non-negative number")
    _check(s.pretrain_epochs > 0, f"{p}: sqs.pretrain_epochs", "expected a positive integer")
    if s.checkpoint is not None:
        _check(Path(s.checkpoint).is_file(), f"{p}: sqs.checkpoint", f"file not found: {s.checkpoint}")


def _check_nested(n: NestedConfig, p):
    _check(n.groups >= 1, f"{p}: nested.groups", "expected a positive integer")
    _check(0 <= n.fixed_groups < n.groups, f"{p}: nested.fixed_groups",
           f"expected an integer in 0..groups - 1 = {n.groups - 1}, got {n.fixed_groups}")
    _check(n.temperature > 0, f"{p}: nested.temperature", "expected a positive number")
    _check(0 < n.temperature_min <= n.temperature, f"{p}: nested.temperature_min",
           "expected a positive number no larger than nested.temperature")
    _check(n.bn_batches > 0, f"{p}: nested.bn_batches", "expected a positive integer")
    _check(n.bn_batch_size > 0, f"{p}: nested.bn_batch_size", "expected a positive integer")


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
    profile = _build(DeviceProfile, data, str(path))
    p = str(path)
    _check_name(profile.name, f"{p}: name")
    b = profile.budgets
    _check(0 < b.batch_size <= MAX_DEVICE_BATCH, f"{p}: budgets.batch_size",
           f"expected an integer in 1..{MAX_DEVICE_BATCH}")
    _check(profile.runtime.threads >= 0, f"{p}: runtime.threads", "expected a non-negative integer (0: the runtime's default)")
    _check(profile.runtime.workspace_mb > 0, f"{p}: runtime.workspace_mb", "expected a positive integer")
    for key in ("latency_ms", "memory_mb", "model_mb"):
        value = getattr(b, key)
        _check(value is None or value > 0, f"{p}: budgets.{key}", "expected a positive number or null")
    _check(b.mc_samples is None or all(0 < m <= MAX_MC_SAMPLES for m in b.mc_samples), f"{p}: budgets.mc_samples",
           f"expected integers in 1..{MAX_MC_SAMPLES} or null")
    _check(b.mc_samples_max is None or b.mc_samples_max > 0, f"{p}: budgets.mc_samples_max",
           "expected a positive integer or null")
    _check(len(set(profile.runtime.precision)) == len(profile.runtime.precision), f"{p}: runtime.precision",
           "lists a precision twice")
    c = profile.connection
    _check(c.kind != "ssh" or bool(c.host), f"{p}: connection.host", "required when connection.kind is ssh")
    _check(c.port is None or 0 < c.port < 65536, f"{p}: connection.port", "expected a port number in 1..65535")
    _check(c.connect_timeout_s > 0, f"{p}: connection.connect_timeout_s", "expected a positive integer")
    _check(all("=" in o for o in c.options or []), f"{p}: connection.options", "expected `Key=value` ssh options")
    _check_ssh(c, p)
    _check(c.min_free_mb >= 0, f"{p}: connection.min_free_mb", "expected a number >= 0")
    lm = profile.latency_model
    _check(lm.kind != "flops" or (lm.flops_per_second or 0) > 0, f"{p}: latency_model.flops_per_second",
           "a positive number is required when latency_model.kind is flops")
    _check(lm.flops_per_second is None or lm.flops_per_second > 0, f"{p}: latency_model.flops_per_second",
           "expected a positive number or null")
    _check(lm.overhead_ms >= 0, f"{p}: latency_model.overhead_ms", "expected a number >= 0")
    return profile


# ssh options that make ssh run a command on this machine (ssh_config(5)); PermitLocalCommand enables
# LocalCommand. Allowed only in a profile marked `connection.trusted: true`.
LOCAL_COMMAND_OPTIONS = ("proxycommand", "localcommand", "permitlocalcommand", "knownhostscommand")


def _check_ssh(c, p):
    """ssh argv safety: a value starting with '-' would be read as an option (`user: -oProxyCommand=...`)."""
    for key in ("host", "user", "proxy_jump"):
        value = getattr(c, key)
        _check(value is None or (value.strip() and not value.startswith("-")), f"{p}: connection.{key}",
               f"must not be empty or start with '-', got {_show(value)}")
    for option in c.options or []:
        key = re.split(r"[\s=]", option.strip(), maxsplit=1)[0].lower()
        _check(c.trusted or key not in LOCAL_COMMAND_OPTIONS, f"{p}: connection.options",
               f"{_show(option)} makes ssh run a command on this machine; allowed only with "
               f"`connection.trusted: true` in a profile you wrote or checked")


def expand_repo(value):
    """Placeholders of connection fields (the ssh-localhost profile): `{repo}` is the working directory,
    whose runs/ holds the throwaway sshd's keys and the device folder (not the install location: two
    checkouts, or an installed edgebayes, must not share one runs/); `{python}` is this interpreter."""
    if not isinstance(value, str):
        return value
    return value.replace("{repo}", str(Path.cwd())).replace("{python}", sys.executable)


def as_dict(obj) -> dict:
    return dataclasses.asdict(obj)


def fingerprint(*parts) -> str:
    """A stable hash of JSON-able parts (config sections, upstream fingerprints)."""
    blob = json.dumps([as_dict(p) if dataclasses.is_dataclass(p) else p for p in parts], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
