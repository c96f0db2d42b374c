"""Temperature scaling of the MC average (compressed/samples.py fit_temperature, select.temperature_scaling):
the fitted T is the NLL's minimiser, the exported graphs divide by it as MCAverage does, and the pipeline ships
what select fitted."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from _nets import samples_and_inputs
from edgebayes.compressed.samples import MIN_CALIBRATION_EXAMPLES, MCAverage, fit_temperature
from edgebayes.export.formats import FORMATS, artifact_predict, export_artifact
from edgebayes.export.packed import pack_samples


class Fixed(nn.Module):
    """A 'network' whose logits are given: row i of `logits` for input i (inputs are row indices)."""

    def __init__(self, logits):
        super().__init__()
        self.register_buffer("logits", logits)

    def forward(self, idx):
        return self.logits[idx.long().flatten()]


def _nll(logits, y, t):
    log_p = torch.logsumexp(torch.log_softmax(logits / t, -1), 0) - math.log(len(logits))
    return -float(log_p[torch.arange(len(y)), y].mean())


@pytest.mark.parametrize("true_t", [0.5, 1.0, 3.0])
def test_the_fitted_temperature_recovers_the_one_the_labels_were_drawn_at(true_t):
    """Labels drawn from softmax(z / T): the NLL's minimiser in T is T itself, up to sampling noise."""
    g = torch.Generator().manual_seed(0)
    z = 3 * torch.randn(20_000, 10, generator=g, dtype=torch.float64)
    y = torch.multinomial(torch.softmax(z / true_t, -1), 1, generator=g).flatten()
    t = fit_temperature([Fixed(z)], torch.arange(len(z)).float(), y)
    assert abs(t / true_t - 1) < 0.05


def test_the_fitted_temperature_minimises_the_nll_of_the_mc_average():
    """Over M samples the NLL is of the average of their tempered softmaxes: no grid point beats the fit.
    Samples four times sharper than the labels' distribution: an over-confident average, T > 1."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(500, 5, generator=g)
    y = torch.multinomial(torch.softmax(z, -1), 1, generator=g).flatten()
    samples = [Fixed(4 * (z + 0.3 * torch.randn(z.shape, generator=g))) for _ in range(3)]
    x = torch.arange(len(z)).float()
    logits = torch.stack([s(x) for s in samples]).double()
    t = fit_temperature(samples, x, y)
    assert 1 < t < 20
    best = _nll(logits, y, t)
    assert all(best <= _nll(logits, y, other) + 1e-9 for other in np.geomspace(0.05, 20, 300))
    with torch.no_grad():   # MCAverage at T is that average
        p = MCAverage(samples, t)(x).double()
    assert abs(-float(p[torch.arange(len(y)), y].log().mean()) - best) < 1e-5


def test_too_few_validation_examples_leave_the_temperature_at_one():
    samples, x = samples_and_inputs("mlp", 2, n=MIN_CALIBRATION_EXAMPLES - 1)
    assert fit_temperature(samples, x, torch.zeros(len(x), dtype=torch.long)) == 1.0


def test_non_finite_logits_are_refused_by_name():
    z = torch.zeros(30, 3)
    z[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite logits"):
        fit_temperature([Fixed(z)], torch.arange(30).float(), torch.zeros(30, dtype=torch.long))


@pytest.mark.parametrize("net, m", [("mlp", 4), ("lenet", 3), ("rescat", 2)])
def test_packed_graph_divides_by_the_temperature_as_the_mc_average_does(net, m):
    samples, x = samples_and_inputs(net, m)
    with torch.no_grad():
        tempered, plain = MCAverage(samples, 0.4)(x), MCAverage(samples)(x)
        packed = pack_samples(samples, x[:4], temperature=0.4)(x)
    assert (packed - tempered).abs().max() <= 1e-5
    assert (tempered - plain).abs().max() > 1e-2   # and the temperature changed the probabilities


@pytest.mark.parametrize("fmt, layout", [("onnx", "packed"), ("onnx", "unrolled"), ("tflite-fp32", "packed")])
def test_the_exported_artifact_carries_the_temperature(fmt, layout, tmp_path):
    samples, x = samples_and_inputs("lenet", 3)
    mc = MCAverage(samples, 2.5).eval()
    path = export_artifact(mc, fmt, tmp_path / f"m{FORMATS[fmt].suffix}", x[:8], layout=layout)
    with torch.no_grad():
        ref = mc(x).numpy()
    assert np.abs(artifact_predict(path, fmt, x.numpy()) - ref).max() <= 1e-5


def test_a_validation_split_without_errors_leaves_the_temperature_at_one():
    """Every label the argmax: the NLL falls all the way to T -> 0, which would ship probabilities of 0 and 1."""
    z = torch.randn(200, 4, generator=torch.Generator().manual_seed(3))
    assert fit_temperature([Fixed(z)], torch.arange(200).float(), z.argmax(1)) == 1.0


@pytest.mark.parametrize("fmt", ["onnx-fp16w", "onnx-int8", "tflite-int8"])
def test_low_precision_artifacts_keep_the_temperature(fmt, tmp_path):
    """The fp16 / int8 graphs divide by T too: closer to the tempered average than to the plain one."""
    samples, x = samples_and_inputs("lenet", 3, n=64)
    mc = MCAverage(samples, 0.25).eval()   # sharp: far from T = 1's probabilities
    calib = samples_and_inputs("lenet", 1, n=64, seed=7)[1]
    path = export_artifact(mc, fmt, tmp_path / f"m{FORMATS[fmt].suffix}", x[:8], calib)
    probs = artifact_predict(path, fmt, x.numpy())
    with torch.no_grad():
        tempered, plain = mc(x).numpy(), MCAverage(samples)(x).numpy()
    assert np.abs(probs - tempered).max() < 0.5 * np.abs(plain - tempered).max()


def test_calibrate_takes_arrays_and_refuses_mismatched_or_foreign_labels_by_name():
    """Compressed.calibrate, as a user calls it with numpy validation data."""
    samples, x = samples_and_inputs("mlp", 2, n=64)
    with torch.no_grad():
        y = MCAverage(samples)(x).argmax(1)
    y[::3] = (y[::3] + 1) % 3
    assert fit_temperature(samples, x.numpy(), y.numpy()) == fit_temperature(samples, x, y)
    with pytest.raises(ValueError, match="64 validation inputs but 63 labels"):
        fit_temperature(samples, x, y[:63])
    with pytest.raises(ValueError, match=r"labels must be classes 0\.\.\d+, got 0\.\.99"):
        fit_temperature(samples, x, torch.cat([y[:-1], torch.tensor([99])]))
