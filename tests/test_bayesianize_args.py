"""bayesianize's keyword arguments: arrays for calibration_x (as eb.fit takes), dicts for prior / nested, and
refusals that name the argument instead of a TypeError / AttributeError from deep inside."""
import numpy as np
import pytest
import torch

from _nets import ConvBnFc

import edgebayes as eb
from edgebayes.config import ConfigError
from edgebayes.errors import ArchError


X = np.random.default_rng(0).random((40, 1, 4, 4), dtype=np.float32)


def test_calibration_x_as_a_numpy_array():
    net = eb.bayesianize(ConvBnFc(8, 4, 3), "bn3", input_shape=(1, 4, 4), n_train=40, calibration_x=X)
    assert isinstance(net.calibration_x, torch.Tensor) and net.calibration_x.dtype == torch.float32
    eb.compress(net, m=2)


def test_calibration_x_of_another_shape_is_refused_by_name():
    with pytest.raises(ArchError, match="calibration_x"):
        eb.bayesianize(ConvBnFc(8, 4, 3), "bn3", input_shape=(1, 4, 4), n_train=40, calibration_x=X.reshape(40, -1))


def test_prior_and_nested_as_dicts():
    net = eb.bayesianize(ConvBnFc(8, 4, 3), "ss-gl", input_shape=(1, 4, 4), n_train=40, prior={"a0": 3.0})
    assert net.global_scale is not None
    net = eb.bayesianize(ConvBnFc(8, 4, 3), "bn3", input_shape=(1, 4, 4), n_train=40, nested={"groups": 4, "fixed_groups": 1})
    assert net.groups == 4


@pytest.mark.parametrize("kw", [{"prior": {"a0": -1}}, {"prior": {"learning_rate": 1}}, {"nested": {"groupz": 4}},
                                {"prior": 3}])
def test_bad_prior_or_nested_is_refused_by_name(kw):
    with pytest.raises((ConfigError, ArchError), match=next(iter(kw))):
        eb.bayesianize(ConvBnFc(8, 4, 3), "bn3" if "nested" in kw else "ss-gl", input_shape=(1, 4, 4), n_train=40, **kw)


def test_an_unknown_activation_is_refused_by_name():
    """It was taken silently (it shapes the zoo's networks; a module of yours keeps its own)."""
    with pytest.raises(ArchError, match=r"bayesianize: activation: expected one of \('silu', 'relu', 'tanh'\)"):
        eb.bayesianize(ConvBnFc(8, 4, 3), "ss-gl", input_shape=(1, 4, 4), n_train=40, activation="bogus")
