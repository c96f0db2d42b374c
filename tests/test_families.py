"""The family registry: every configurable family is registered, builds a net with the posterior-net
interface, and the registry's knob is the net's."""

import typing

import pytest

from edgebayes.config import ModelConfig, NestedConfig, PipelineConfig
from edgebayes.data import load_data
from edgebayes.train.families import FAMILIES, PosteriorNet, bayesianize, build


@pytest.fixture(scope="module")
def splits():
    cfg = PipelineConfig()
    return load_data(cfg.data, cfg.seed)


def test_the_registry_holds_exactly_the_families_the_config_accepts():
    assert set(FAMILIES) == set(typing.get_args(typing.get_type_hints(ModelConfig)["family"]))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_builds_a_posterior_net_with_its_knob(name, splits):
    cfg = PipelineConfig(model=ModelConfig(family=name, hidden=[8]), nested=NestedConfig(groups=4, fixed_groups=1))
    net = build(cfg, splits)
    assert isinstance(net, PosteriorNet)
    assert net.knob == FAMILIES[name].knob
    assert net.operating_points()
    plain, kept = net.posterior_sample(net.default_knob)
    assert set(kept) <= {n for n, _ in plain.named_modules()}
    section = FAMILIES[name].section
    assert section is None or hasattr(cfg, section)


def test_bayesianize_refuses_a_family_without_a_wrapper():
    from torch import nn

    from edgebayes.errors import ArchError

    with pytest.raises(ArchError, match="family sqs runs through the pipeline"):
        bayesianize(nn.Linear(4, 2), "sqs", input_shape=(4,), n_train=10)
