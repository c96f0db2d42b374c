"""Compress: draw M posterior samples at a knob value and make each a small plain module.

Every family ends here in the same form: a deterministic architecture (the kept
widths) plus M posterior samples of its weights. `MCAverage` turns the M samples into one module whose
output is the average of their softmax outputs: the graph that export writes and the device runs.

Samples are drawn from one generator seeded by the run's seed, so sample s is the same whatever M is
(the M = 4 samples are the first four of the M = 8 ones) and select, export and the report agree.

Calibration (`fit_temperature`): one temperature T for the MC average, softmax(logits / T) in every sample,
fitted on validation data (Guo et al. 2017's temperature scaling, applied to each posterior sample's logits).
Not in the papers, which average the samples' softmaxes as they are. Why: a network fine-tuned for a few epochs
after its cut is under-confident (issue 33: the home-made net at 0.25 of its FLOPs, SS-GL, 5 epochs, M = 4,
mean confidence 0.936 at 95.7 % test accuracy, ECE 0.027 against the dense net's 0.014), and the weight
posterior is not the cause: its scales stay near their initial 0.0025 and the posterior-mean network is as
under-confident (0.937), with or without the KL (weight 1e-6: 0.936). T = 0.74 fitted on 1,000 validation
images: test ECE 0.0106, accuracy unchanged. T = 1 is the papers' predictive, and what
select.temperature_scaling false ships.
"""

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

from edgebayes.compressed.surgery import NOT_PRUNED, SurgeryError, remove_dead_units


class EmptyLayerError(SurgeryError):
    pass


class MCAverage(nn.Module):
    """Average of the softmax outputs of M plain modules: the MC predictive distribution.

    The posterior samples are baked in as constants: no random op is in the graph, because ONNX tools
    and TFLite converters freeze or drop them. `temperature` divides every sample's logits (`fit_temperature`);
    at 1 the graph has no such operator.
    """

    def __init__(self, samples, temperature: float = 1.0):
        super().__init__()
        self.samples = nn.ModuleList(samples)
        self.temperature = float(temperature)

    def forward(self, x):
        total = None
        for sample in self.samples:
            logits = sample(x)
            p = torch.softmax(logits if self.temperature == 1.0 else logits * (1.0 / self.temperature), dim=-1)
            total = p if total is None else total + p
        # One sample: no division, which would be one more operator in the exported graph (onnxruntime runs it:
        # about 3 % of a pruned LeNet-5's latency at M = 1).
        return total if len(self.samples) == 1 else total / len(self.samples)


@dataclass
class Compressed:
    knob: float
    samples: list           # M pruned plain modules
    dense_sample: nn.Module  # the first sample before surgery (dense shapes, dead rows zeroed)
    kept: dict               # name of each Linear in the plain module -> boolean mask of kept outputs
    surgery: dict = None     # surgery's report on the first sample: per layer, dead / removed / why kept
    temperature: float = 1.0  # of the MC average's softmaxes: fit_temperature (module docstring), 1: none
    input_shape: tuple = None  # of one example, the network's (what an export's example must have)

    @property
    def distinct_samples(self) -> int:
        """How many of the M samples differ in any weight: an MC average of identical samples is one network
        (SQS at tau = 5e-4: phi is one-hot for nearly every weight, so every draw picks the same levels)."""
        def same(a, b):
            return len(a) == len(b) and all(s.shape == t.shape and torch.equal(s, t) for s, t in zip(a, b))

        seen = []
        for sample in self.samples:
            state = [t.detach().cpu() for t in sample.state_dict().values()]
            if not any(same(state, other) for other in seen):
                seen.append(state)
        return len(seen)

    @property
    def not_pruned(self):
        """Why surgery left the whole network masked (it could not trace it), or None."""
        reasons = {why for row in (self.surgery or {}).values() for why in row["kept"]}
        return next((why[len(NOT_PRUNED):] for why in sorted(reasons) if why.startswith(NOT_PRUNED)), None)

    def mc_model(self, m=None):
        return MCAverage(self.samples[: m or len(self.samples)], self.temperature).eval()

    def calibrate(self, x, y) -> float:
        """Set `temperature` to the one fitted on (x, y), validation data (`fit_temperature`); returns it."""
        from edgebayes.data import as_inputs, class_indices   # here: data imports nothing of compressed/, but
        # compressed/ is the exported core and stays free of the data loaders at import
        x, y = as_inputs(x), class_indices(y, "y", "calibrate")
        if len(x) == 0 or len(x) != len(y):
            raise ValueError(f"calibrate: expected validation inputs and one label each, got {len(x)} inputs and "
                             f"{len(y)} labels")
        if self.input_shape is not None and tuple(x.shape[1:]) != tuple(self.input_shape):
            raise ValueError(f"calibrate: x: expected inputs of shape {tuple(self.input_shape)}, got "
                             f"{tuple(x.shape[1:])}")
        try:
            self.temperature = fit_temperature(self.samples, x, y)
        except ValueError as e:   # its checks of the labels and logits, said as the caller's
            raise ValueError(str(e).replace("fit_temperature:", "calibrate:", 1)) from None
        return self.temperature


def sample_generator(seed: int) -> torch.Generator:
    # An offset keeps posterior-sample draws apart from the data split stream of the same seed.
    return torch.Generator().manual_seed(10_000 + seed)


@torch.no_grad()
def compress(model, knob: float, m: int, seed: int, channel_multiple: int = 1, allow_no_network=False) -> Compressed:
    """Draw m posterior samples at `knob` and physically remove their dead units.

    channel_multiple: every pruned convolution keeps a multiple of this many channels, the block of the device
    runtime's fast kernels (the profile's runtime.channel_block; surgery's `_round_width`).

    Raises EmptyLayerError when the knob removes every unit of a layer, or leaves a network whose output does
    not depend on its input (no network is left). The second is for unstructured cuts, which remove no unit:
    SQS ranks the weights over the whole network (paper 001), and a small layer (a depthwise first convolution)
    can lose every weight; the samples then shipped one constant prediction with exit 0 (probe).
    `allow_no_network` (a training's validation, which scores whatever the schedule has reached) keeps them.
    Surgery degrades rather than fails (compressed/surgery.py): what it kept, and why, is in `surgery`, and
    `not_pruned` says why when it could not prune the network at all.
    """
    gen = sample_generator(seed)
    samples, dense0, kept, report = [], None, None, {}
    for _ in range(m):
        dense, kept = model.posterior_sample(knob, gen)
        empty = [name for name, mask in kept.items() if not bool(mask.any())]
        if empty:
            raise EmptyLayerError(f"{model.knob} {knob} removes every unit of layer(s) {empty}")
        cut = [] if allow_no_network else [name for name, mod in dense.named_modules()
                                          if isinstance(getattr(mod, "weight", None), torch.Tensor)
                                          and mod.weight.dim() > 1 and not bool(mod.weight.any())]
        # a layer without weights, and no path around it (a residual branch's empty layer leaves one)
        if cut and output_ignores_input(dense, model.input_shape):
            raise EmptyLayerError(f"{model.knob} {knob} leaves the network's output the same for every input: "
                                  f"layer(s) {cut} keep no weight; a larger {model.knob} keeps them")
        dense0 = dense if dense0 is None else dense0
        samples.append(remove_dead_units(dense, kept, torch.zeros((1,) + tuple(model.input_shape)),
                                         report=None if samples else report, channel_multiple=channel_multiple))
    return Compressed(knob, samples, dense0, kept, report, input_shape=tuple(model.input_shape))


@torch.no_grad()
def output_ignores_input(net, input_shape) -> bool:
    """The network gives bit-identical outputs for four different inputs (zeros, ones, two normal draws): a
    constant net. Asked by compress only of a network with a layer that kept no weight, where it tells an
    empty layer on every path (a constant) from one a residual path goes around: a trained net on unscaled
    inputs can have every ReLU off at these four and still work on its data (review)."""
    if input_shape is None:
        return False
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.zeros((1,) + tuple(input_shape)), torch.ones((1,) + tuple(input_shape)),
                   torch.randn((2,) + tuple(input_shape), generator=gen)])
    was_training = net.training
    try:
        out = net.eval()(x)
    finally:
        net.train(was_training)
    return isinstance(out, torch.Tensor) and out.dim() > 0 and len(out) == len(x) and bool((out == out[:1]).all())


TEMPERATURES = (0.05, 20.0)   # fit_temperature's search range: beyond it a network is broken, not miscalibrated
GRID = 81                      # log-spaced points over it (neighbours 8% apart), then golden section
MIN_CALIBRATION_EXAMPLES = 20   # fewer validation examples than this: T = 1 (one parameter, but on 5 images...)
CHUNK = 4096                    # examples per step of the NLL: temporaries stay small for many classes and M
# Why fit_temperature returned exactly 1 (a fitted T is never exactly 1: it is the exp of a bracket's midpoint)
NOT_FITTED = (f"the validation split cannot fit one: fewer than {MIN_CALIBRATION_EXAMPLES} examples, or its NLL "
              f"is lowest at an end of {TEMPERATURES[0]:g}..{TEMPERATURES[1]:g} (a split the network gets all right)")


@torch.no_grad()
def fit_temperature(samples, x, y, batch_size: int = 2048) -> float:
    """The temperature T minimising the NLL of mean_m softmax(logits_m / T) on (x, y): validation data.

    One parameter, searched on a grid of log T over TEMPERATURES and refined by golden section between the
    grid's neighbours of the best point: the NLL of an MC average need not be convex in T, and a grid does not
    stop at a local minimum the way a gradient method can. T = 1 (the papers' average, unchanged) where the data
    cannot fit it: fewer than MIN_CALIBRATION_EXAMPLES examples, or a minimum at an end of the range (a
    validation split the network gets all right has its NLL falling all the way to T -> 0: fitted there, the
    shipped probabilities would be 0 or 1)."""
    x = torch.as_tensor(x, dtype=torch.float32).cpu()   # arrays too, as eb.fit and eb.save take them
    y = torch.as_tensor(y).long().cpu().flatten()
    if len(x) != len(y):
        raise ValueError(f"fit_temperature: {len(x)} validation inputs but {len(y)} labels")
    if len(y) < MIN_CALIBRATION_EXAMPLES:
        return 1.0
    logits = torch.stack([torch.cat([s.eval()(x[i: i + batch_size]) for i in range(0, len(x), batch_size)])
                          for s in samples])   # [M, N, K]
    if not torch.isfinite(logits).all():
        raise ValueError("fit_temperature: a posterior sample gives non-finite logits on the validation data")
    if y.min() < 0 or y.max() >= logits.shape[-1]:
        raise ValueError(f"fit_temperature: validation labels must be classes 0..{logits.shape[-1] - 1}, got "
                         f"{int(y.min())}..{int(y.max())}")

    def nll(log_t):
        total = 0.0
        for i in range(0, len(y), CHUNK):
            part = logits[:, i: i + CHUNK].double() / math.exp(log_t)
            log_p = torch.logsumexp(torch.log_softmax(part, -1), 0) - math.log(len(logits))
            total -= float(log_p.gather(1, y[i: i + CHUNK, None]).sum())
        return total / len(y)

    grid = torch.linspace(math.log(TEMPERATURES[0]), math.log(TEMPERATURES[1]), GRID).tolist()
    best = min(range(GRID), key=lambda i: nll(grid[i]))
    if best in (0, GRID - 1):
        return 1.0
    lo, hi = grid[best - 1], grid[best + 1]
    ratio = (math.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = nll(a), nll(b)
    for _ in range(30):   # golden section: one new point a step, the bracket down to 1e-6 of a grid step
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = nll(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = nll(b)
    return math.exp((lo + hi) / 2)


@torch.no_grad()
def predict(module: nn.Module, x: torch.Tensor, batch_size: int = 2048) -> torch.Tensor:
    """Run a (probability-valued) module over x in batches on the CPU."""
    module = module.eval()
    return torch.cat([module(x[i: i + batch_size]) for i in range(0, len(x), batch_size)])


def predict_float64(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The module's output over x computed in float64: what its arithmetic means, against which an fp32 run's
    rounding is measured. None where the module does not run in float64 (a layer that takes fp32 only)."""
    try:
        return predict(copy.deepcopy(module).double(), x.double())
    except (RuntimeError, TypeError, NotImplementedError):
        return None


def fp32_agreement(outputs, reference32, module, x, atol: float) -> dict:
    """Whether fp32 `outputs` of a graph that should compute `module`(x) agree with PyTorch's fp32 `reference32`.

    Within atol of it passes. Otherwise the float64 output decides: the graph passes when it is within atol plus
    PyTorch fp32's own distance from float64. Why: on an ill-conditioned network two correct fp32 computations
    differ by more than atol, and the difference says nothing about the export. A batch norm over a channel whose
    variance on the calibration data is 0 (a unit that never fired) multiplies its input's rounding by
    1/sqrt(eps) ~ 316: a nested MnasNet at width 3 of 16 trained 2 epochs on 240 images had PyTorch fp32 5.6e-5
    and onnxruntime 7.7e-5 from float64, 1.03e-4 apart. A wrong graph is far from float64 as well.
    Returns {"passed", "max_abs_diff", and where float64 was needed: "max_abs_diff_float64", "torch_fp32_error"}.
    """
    outputs = torch.as_tensor(outputs, dtype=torch.float64)
    reference32 = torch.as_tensor(reference32, dtype=torch.float64)
    facts = {"max_abs_diff": float((outputs - reference32).abs().max())}
    facts["passed"] = facts["max_abs_diff"] <= atol
    if facts["passed"]:
        return facts
    exact = predict_float64(module, x)
    if exact is not None:
        facts["max_abs_diff_float64"] = float((outputs - exact).abs().max())
        facts["torch_fp32_error"] = float((reference32 - exact).abs().max())
        facts["passed"] = facts["max_abs_diff_float64"] <= atol + facts["torch_fp32_error"]
    return facts
