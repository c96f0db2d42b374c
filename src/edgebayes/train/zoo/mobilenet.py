"""MobileNetV2 for CIFAR (Sandler et al. 2018; the common CIFAR variant: stride 1 in the stem and in the
second stage, so 32x32 inputs end at 4x4 before the global pooling).

Inverted residual block: 1x1 expand (t x channels) -> 3x3 depthwise (stride s) -> 1x1 linear projection,
each with batch norm, a residual connection when shapes allow. Paper 002 (appendix 9.1) nests only the
depthwise convolution of each block: its mask also drops the expand convolution's filters (`truncates`)
and the projection's matching input channels. The first block (t = 1) has no expand convolution, so its
depthwise reads the stem's channels directly: it is not nested (dropping its channels could not remove
anything physically). Stem, last 1x1 convolution and classifier are never pruned.
"""

from torch import nn

# (expansion t, output channels c, blocks n, stride s of the first block)
SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))


class InvertedResidual(nn.Module):
    def __init__(self, make, in_channels, out_channels, stride, expansion):
        super().__init__()
        hidden = in_channels * expansion
        self.expand = (make.conv(in_channels, hidden, 1, bias=False, norm=True, prunable=False)
                       if expansion != 1 else None)
        self.depthwise = make.conv(hidden, hidden, 3, stride=stride, padding=1, groups=hidden, bias=False,
                                   norm=True, prunable=self.expand is not None, truncates=self.expand)
        self.project = make.conv(hidden, out_channels, 1, bias=False, norm=True, prunable=False)
        self.act1, self.act2 = make.activation(), make.activation()
        self.residual = stride == 1 and in_channels == out_channels

    def forward(self, x):
        out = x if self.expand is None else self.act1(self.expand(x))
        out = self.project(self.act2(self.depthwise(out)))
        return out + x if self.residual else out


class MobileNetV2(nn.Module):
    def __init__(self, make, input_shape, classes, width_multiplier=1.0):
        super().__init__()
        scale = lambda c: max(1, int(round(c * width_multiplier)))  # noqa: E731
        channels = scale(32)
        self.stem = make.conv(input_shape[0], channels, 3, padding=1, bias=False, norm=True, prunable=False)
        self.act = make.activation()
        blocks = []
        for t, c, n, s in SETTINGS:
            for i in range(n):
                blocks.append(InvertedResidual(make, channels, scale(c), s if i == 0 else 1, t))
                channels = scale(c)
        self.blocks = nn.Sequential(*blocks)
        last = scale(1280)
        self.head = make.conv(channels, last, 1, bias=False, norm=True, prunable=False)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = make.linear(last, classes, prunable=False)

    def forward(self, x):
        x = self.blocks(self.act(self.stem(x)))
        return self.fc(self.pool(self.act(self.head(x))).flatten(1))


def mobilenetv2(make, input_shape, classes, width_multiplier=1.0, **_):
    if len(input_shape) != 3:
        raise ValueError(f"mobilenetv2 needs image inputs (channels, height, width), got shape {input_shape}")
    return MobileNetV2(make, input_shape, classes, width_multiplier)
