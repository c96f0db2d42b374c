"""LeNet-5-Caffe as paper 000 defines it: conv 5x5 (20) -> pool -> conv 5x5 (50) -> pool -> flatten (800 for
28x28 images) -> fc 800 -> fc 500 -> fc classes.

Paper 000 (section 5, and its authors' code: 1,071,880 parameters) puts two hidden layers of 800 and 500
nodes after the 800 flattened features; the Caffe original has one of 500. Activations are SiLU as in the
paper (Caffe used ReLU).
"""

from torch import nn


class LeNet5Caffe(nn.Module):
    def __init__(self, make, input_shape, classes):
        super().__init__()
        channels, height, width = input_shape
        self.conv1 = make.conv(channels, 20, 5)
        self.conv2 = make.conv(20, 50, 5)
        self.act, self.pool = make.activation(), nn.MaxPool2d(2)
        out_h, out_w = ((height - 4) // 2 - 4) // 2, ((width - 4) // 2 - 4) // 2  # two (conv 5x5, pool 2)
        flat = 50 * out_h * out_w
        self.fc1 = make.linear(flat, 800)
        self.fc2 = make.linear(800, 500)
        self.fc3 = make.linear(500, classes, prunable=False)

    def forward(self, x):
        x = self.pool(self.act(self.conv1(x)))
        x = self.pool(self.act(self.conv2(x)))
        x = self.act(self.fc1(x.flatten(1)))
        return self.fc3(self.act(self.fc2(x)))


def lenet5_caffe(make, input_shape, classes, **_):
    if len(input_shape) != 3:
        raise ValueError(f"lenet5-caffe needs image inputs (channels, height, width), got shape {input_shape}")
    return LeNet5Caffe(make, input_shape, classes)
