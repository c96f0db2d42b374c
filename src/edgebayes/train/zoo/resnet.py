"""ResNet-20 / 32 / 56 for CIFAR (He et al. 2016, section 4.2): 3 stages of 16, 32, 64 channels, depth
6n + 2 with n = 3, 5, 9 basic blocks per stage.

Every convolution is followed by batch norm (owned by the layer, so a switched-off channel is exactly
zero, see train/spike_slab.py). Shortcuts that change shape are 1x1 convolutions with batch norm (option B)
rather than option A's zero padding: a projection is a prunable layer that torch-pruning's dependency graph
understands, while channel padding is not.
"""

from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, make, in_channels, channels, stride):
        super().__init__()
        self.conv1 = make.conv(in_channels, channels, 3, stride=stride, padding=1, bias=False, norm=True)
        self.conv2 = make.conv(channels, channels, 3, padding=1, bias=False, norm=True)
        self.act = make.activation()
        self.shortcut = (nn.Identity() if stride == 1 and in_channels == channels
                         else make.conv(in_channels, channels, 1, stride=stride, bias=False, norm=True))

    def forward(self, x):
        return self.act(self.conv2(self.act(self.conv1(x))) + self.shortcut(x))


class ResNetCifar(nn.Module):
    def __init__(self, make, input_shape, classes, blocks_per_stage):
        super().__init__()
        self.stem = make.conv(input_shape[0], 16, 3, padding=1, bias=False, norm=True)
        self.act = make.activation()
        stages, in_channels = [], 16
        for i, channels in enumerate((16, 32, 64)):
            blocks = []
            for b in range(blocks_per_stage):
                blocks.append(BasicBlock(make, in_channels, channels, 2 if (b == 0 and i > 0) else 1))
                in_channels = channels
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = make.linear(64, classes, prunable=False)

    def forward(self, x):
        x = self.act(self.stem(x))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(self.pool(x).flatten(1))


def _resnet(depth, make, input_shape, classes):
    if len(input_shape) != 3:
        raise ValueError(f"resnet{depth} needs image inputs (channels, height, width), got shape {input_shape}")
    return ResNetCifar(make, input_shape, classes, (depth - 2) // 6)


def resnet20(make, input_shape, classes, **_):
    return _resnet(20, make, input_shape, classes)


def resnet32(make, input_shape, classes, **_):
    return _resnet(32, make, input_shape, classes)


def resnet56(make, input_shape, classes, **_):
    return _resnet(56, make, input_shape, classes)
