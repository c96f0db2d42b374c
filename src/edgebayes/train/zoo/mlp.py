"""Multilayer perceptron: Flatten -> [Linear -> activation] x hidden -> Linear (paper 000: 2x400, SiLU)."""

from collections import OrderedDict

import numpy as np
from torch import nn


class MLP(nn.Sequential):
    def __init__(self, make, input_shape, hidden, classes, activation):
        widths = [int(np.prod(input_shape))] + list(hidden)
        layers = [("flatten", nn.Flatten())]
        for i, (fan_in, units) in enumerate(zip(widths[:-1], widths[1:])):
            layers += [(f"hidden{i + 1}", make.linear(fan_in, units)), (f"act{i + 1}", make.activation())]
        layers.append(("output", make.linear(widths[-1], classes, prunable=False)))
        super().__init__(OrderedDict(layers))


def mlp(make, input_shape, classes, hidden=(400, 400), **_):
    return MLP(make, input_shape, hidden, classes, make.activation_name)
