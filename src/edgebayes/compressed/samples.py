"""Compress: draw M posterior samples at a knob value and make each a small plain module.

Every family ends here in the same form: a deterministic architecture (the kept
widths) plus M posterior samples of its weights. `MCAverage` turns the M samples into one module whose
output is the average of their softmax outputs: the graph that export writes and the device runs.

Samples are drawn from one generator seeded by the run's seed, so sample s is the same whatever M is
(the M = 4 samples are the first four of the M = 8 ones) and select, export and the report agree.
"""

import copy
from dataclasses import dataclass

import torch
from torch import nn

from edgebayes.compressed.surgery import NOT_PRUNED, SurgeryError, remove_dead_units


class EmptyLayerError(SurgeryError):
    pass


class MCAverage(nn.Module):
    """Average of the softmax outputs of M plain modules: the MC predictive distribution.

    The posterior samples are baked in as constants: no random op is in the graph, because ONNX tools
    and TFLite converters freeze or drop them.
    """

    def __init__(self, samples):
        super().__init__()
        self.samples = nn.ModuleList(samples)

    def forward(self, x):
        total = None
        for sample in self.samples:
            p = torch.softmax(sample(x), dim=-1)
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

    @property
    def not_pruned(self):
        """Why surgery left the whole network masked (it could not trace it), or None."""
        reasons = {why for row in (self.surgery or {}).values() for why in row["kept"]}
        return next((why[len(NOT_PRUNED):] for why in sorted(reasons) if why.startswith(NOT_PRUNED)), None)

    def mc_model(self, m=None):
        return MCAverage(self.samples[: m or len(self.samples)]).eval()


def sample_generator(seed: int) -> torch.Generator:
    # An offset keeps posterior-sample draws apart from the data split stream of the same seed.
    return torch.Generator().manual_seed(10_000 + seed)


@torch.no_grad()
def compress(model, knob: float, m: int, seed: int, channel_multiple: int = 1) -> Compressed:
    """Draw m posterior samples at `knob` and physically remove their dead units.

    channel_multiple: every pruned convolution keeps a multiple of this many channels, the block of the device
    runtime's fast kernels (the profile's runtime.channel_block; surgery's `_round_width`).

    Raises EmptyLayerError when the knob removes every unit of a layer (no network is left). Surgery
    degrades rather than fails (compressed/surgery.py): what it kept, and why, is in `surgery`, and
    `not_pruned` says why when it could not prune the network at all.
    """
    gen = sample_generator(seed)
    samples, dense0, kept, report = [], None, None, {}
    for _ in range(m):
        dense, kept = model.posterior_sample(knob, gen)
        empty = [name for name, mask in kept.items() if not bool(mask.any())]
        if empty:
            raise EmptyLayerError(f"{model.knob} {knob} removes every unit of layer(s) {empty}")
        dense0 = dense if dense0 is None else dense0
        samples.append(remove_dead_units(dense, kept, torch.zeros((1,) + tuple(model.input_shape)),
                                         report=None if samples else report, channel_multiple=channel_multiple))
    return Compressed(knob, samples, dense0, kept, report)


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
