"""VGG11 with batch norm for CIFAR (Simonyan & Zisserman 2014, configuration A), as paper 002 uses it.

Eight 3x3 convolutions (64, M, 128, M, 256, 256, M, 512, 512, M, 512, 512, M; M = 2x2 max pooling), each
followed by batch norm, then one dense hidden layer and the output layer (paper 002, appendix 9.1: "we add
one dense layer after the stack of convolutional layers"). `width_multiplier` scales every width (the
paper trains x1.5 and tests the 2/3 of highest importance). The first convolution and the two dense layers
are never pruned (prunable=False): the paper keeps them variational without nested dropout.
"""

from torch import nn

CHANNELS = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


class VGG(nn.Module):
    def __init__(self, make, input_shape, classes, width_multiplier=1.0):
        super().__init__()
        channels, height, width = input_shape
        layers, first = [], True
        for v in CHANNELS:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
                height, width = height // 2, width // 2
                continue
            out = max(1, int(round(v * width_multiplier)))
            layers += [make.conv(channels, out, 3, padding=1, bias=False, norm=True, prunable=not first),
                       make.activation()]
            channels, first = out, False
        if height < 1 or width < 1:
            raise ValueError(f"vgg11 needs inputs of at least 32x32 (five 2x2 poolings), got {tuple(input_shape)}")
        self.features = nn.Sequential(*layers)
        self.flatten = nn.Flatten()
        self.fc1 = make.linear(channels * height * width, channels, prunable=False)
        self.act = make.activation()
        self.fc2 = make.linear(channels, classes, prunable=False)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(self.flatten(self.features(x)))))


def vgg11(make, input_shape, classes, width_multiplier=1.0, **_):
    if len(input_shape) != 3:
        raise ValueError(f"vgg11 needs image inputs (channels, height, width), got shape {input_shape}")
    return VGG(make, input_shape, classes, width_multiplier)
