"""Small plain networks built from torch modules, as `compress()` hands them over: posterior samples of one
architecture (same widths) with different weights. Shared by the export tests."""

import torch
import torch.nn.functional as F
from torch import nn


def mlp(seed, widths=(64, 32, 16), classes=10):
    torch.manual_seed(seed)
    layers = [nn.Flatten()]
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.SiLU()]
    layers.append(nn.Linear(widths[-1], classes))
    return nn.Sequential(*layers).eval()


def lenet(seed, c1=6, c2=8, hidden=32, classes=10):
    """LeNet-like at 28x28: conv 5x5, pool, conv 5x5, pool, fc, fc."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, c1, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(c1, c2, 5), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(c2 * 4 * 4, hidden), nn.ReLU(),
                         nn.Linear(hidden, classes)).eval()


class ConvBnFc(nn.Module):
    """A user's smallest convolutional net: conv 3x3 + batch norm + ReLU over a one-channel `side` x `side` input,
    then a Linear head."""

    def __init__(self, channels, side, num_classes):
        super().__init__()
        self.conv = nn.Conv2d(1, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.fc = nn.Linear(channels * side * side, num_classes)

    def forward(self, x):
        return self.fc(torch.flatten(torch.relu(self.bn(self.conv(x))), 1))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + x)


class ResCat(nn.Module):
    """Residual block with batch norm, a channel concatenation, global pooling and a Linear head."""

    def __init__(self, classes=10):
        super().__init__()
        self.stem, self.bn = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.block = Block(4)
        self.side = nn.Conv2d(4, 3, 1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(7, classes)

    def forward(self, x):
        x = torch.relu(self.bn(self.stem(x)))
        x = self.block(x)
        x = torch.cat([x, self.side(x)], dim=1)
        return self.fc(torch.flatten(self.pool(x), 1))


def rescat(seed):
    torch.manual_seed(seed)
    net = ResCat()
    with torch.no_grad():  # non-trivial statistics, so folding them is tested
        for mod in net.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.uniform_(-0.5, 0.5)
                mod.running_var.uniform_(0.5, 2.0)
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    return net.eval()


def _norm(c, shift):
    """A batch norm with non-trivial statistics; shift=True makes beta - gamma mu / sigma > 0 (a dead
    convolution in front of it then leaves a positive constant behind)."""
    bn = nn.BatchNorm2d(c)
    with torch.no_grad():
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        bn.running_mean.uniform_(-0.5, 0.0) if shift else bn.running_mean.uniform_(-0.5, 0.5)
        bn.bias.uniform_(0.1, 0.3) if shift else bn.bias.uniform_(-0.2, 0.2)
    return bn.eval()


class CatPoolFlatten(nn.Module):
    """Two convolution branches concatenated on channels, max-pooled, flattened into a Linear (8x8 inputs):
    Torch-Pruning 1.6 leaves this concatenation's offsets unset (it checks them against the Linear's
    C * 4 * 4 input features), which crashed surgery with an IndexError. Branch a has a batch norm.
    global_pool=True pools to 1x1 instead (the case that always worked: C features)."""

    def __init__(self, a=4, b=3, classes=5, global_pool=False):
        super().__init__()
        self.a, self.bn = nn.Conv2d(3, a, 3, padding=1), _norm(a, shift=True)
        self.b = nn.Conv2d(3, b, 1)
        self.pool = nn.AdaptiveAvgPool2d(1) if global_pool else nn.MaxPool2d(2)
        self.fc, self.out = nn.Linear((a + b) * (1 if global_pool else 16), 8), nn.Linear(8, classes)

    def forward(self, x):
        x = torch.cat([torch.relu(self.bn(self.a(x))), torch.relu(self.b(x))], dim=1)
        return self.out(torch.relu(self.fc(torch.flatten(self.pool(x), 1))))


class Depthwise(nn.Module):
    """Inverted residual without the residual: 1x1 expand -> BN -> ReLU -> 3x3 depthwise -> BN -> ReLU ->
    1x1 project, global pooling, Linear head. With side=True a second 1x1 convolution also reads the
    expanded channels, so the depthwise layer is not their only reader."""

    def __init__(self, hidden=8, c=4, classes=5, side=False):
        super().__init__()
        self.expand, self.bn1 = nn.Conv2d(3, hidden, 1, bias=False), _norm(hidden, shift=False)
        self.depthwise = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False)
        self.bn2 = _norm(hidden, shift=False)
        self.project = nn.Conv2d(hidden, c, 1)
        self.side = nn.Conv2d(hidden, c, 1) if side else None
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        h = torch.relu(self.bn1(self.expand(x)))
        y = self.project(torch.relu(self.bn2(self.depthwise(h))))
        if self.side is not None:
            y = y + self.side(h)
        return self.fc(y.mean((2, 3)))


class ConstantAfterNorm(nn.Module):
    """conv 3x3 -> BN (shift > 0) -> ReLU on 6x6 inputs, read by `reader`: "conv1x1", "conv3x3" (padding 1)
    or "linear" (after a flatten), then a Linear head. A dead channel of conv (zero weights and bias) is
    the constant relu(beta - gamma mu / sigma) > 0 where the reader reads it."""

    def __init__(self, reader, c=6, classes=5):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, c, 3, padding=1), _norm(c, shift=True)
        self.read = {"conv1x1": lambda: nn.Conv2d(c, 4, 1), "conv3x3": lambda: nn.Conv2d(c, 4, 3, padding=1),
                     "linear": lambda: nn.Linear(c * 36, 4)}[reader]()
        self.fc = nn.Linear(4, classes)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        if isinstance(self.read, nn.Linear):
            return self.fc(torch.relu(self.read(torch.flatten(h, 1))))
        return self.fc(torch.relu(self.read(h)).mean((2, 3)))


NETS = {"mlp": (mlp, (64,)), "lenet": (lenet, (1, 28, 28)), "rescat": (rescat, (1, 12, 12))}


def samples_and_inputs(name, m, n=32, seed=123):
    make, shape = NETS[name]
    x = torch.randn((n, *shape), generator=torch.Generator().manual_seed(seed))
    return [make(i) for i in range(m)], x


# -- Packed layout on real code (tests/test_packed.py): the idioms users write, attention blocks, torchvision nets.

IDIOMS = {  # [B, 8, 4, 4] -> [B, F] as user code writes it
    "view-size": lambda x: x.view(x.size(0), -1),
    "reshape-shape": lambda x: x.reshape(x.shape[0], -1),
    "view-minus-one": lambda x: x.view(-1, 8 * 4 * 4),
    "torch-reshape": lambda x: torch.reshape(x, (x.size(0), -1)),
    "torch-flatten": lambda x: torch.flatten(x, 1),
    "flatten-method": lambda x: x.flatten(1),
    "nn-flatten": None,  # self.flatten = nn.Flatten()
    "mean": lambda x: x.mean((2, 3)),
    "mean-keepdim": lambda x: x.mean((2, 3), keepdim=True).view(x.size(0), -1),
    "mean-dim-list": lambda x: x.mean(dim=[2, 3]),
    "mean-negative-dims": lambda x: x.mean(dim=(-2, -1)),
    "torch-mean": lambda x: torch.mean(x, dim=(2, 3)),
    "torch-amax": lambda x: torch.amax(x, (2, 3)),
    "amax-method": lambda x: x.amax(dim=(2, 3)),
    "adaptive-pool-1": lambda x: torch.flatten(F.adaptive_avg_pool2d(x, 1), 1),
    "adaptive-pool-1x1": lambda x: F.adaptive_avg_pool2d(x, (1, 1)).reshape(x.shape[0], -1),
    "view-size-0-1": lambda x: F.adaptive_avg_pool2d(x, 1).view(x.size(0), x.size(1)),
    "squeeze": lambda x: F.adaptive_avg_pool2d(x, 1).squeeze(-1).squeeze(-1),
    "mean-then-scale": lambda x: x.mean((2, 3)) * 2.0,  # reaches the Linear through a mul, not as [B, M*F, 1, 1]
}


def _random_batch_norms(net, gen):
    """Non-trivial eval statistics and affine parameters, so that folding them is tested."""
    with torch.no_grad():
        for mod in net.modules():
            if isinstance(mod, nn.modules.batchnorm._BatchNorm):
                mod.running_mean.copy_(torch.randn(mod.running_mean.shape, generator=gen) * 0.3)
                mod.running_var.copy_(torch.rand(mod.running_var.shape, generator=gen) + 0.5)
                mod.weight.copy_(torch.rand(mod.weight.shape, generator=gen) + 0.5)
                mod.bias.copy_((torch.rand(mod.bias.shape, generator=gen) - 0.5) * 0.4)
    return net.eval()


class IdiomNet(nn.Module):
    """Two conv-BN-ReLU with ONE shared self.relu (a parameter-free module called three times), then an
    idiom of IDIOMS from [B, 8, 4, 4] to features, then Linear-BatchNorm1d-ReLU-Linear."""

    def __init__(self, idiom):
        super().__init__()
        self.idiom = idiom
        self.conv1, self.bn1 = nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6)
        self.conv2, self.bn2 = nn.Conv2d(6, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.flatten = nn.Flatten()
        features = self.head(torch.zeros(1, 8, 4, 4)).shape[1]
        self.fc1, self.bn3, self.fc2 = nn.Linear(features, 12), nn.BatchNorm1d(12), nn.Linear(12, 5)

    def head(self, x):
        return self.flatten(x) if self.idiom == "nn-flatten" else IDIOMS[self.idiom](x)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.relu(self.bn2(self.conv2(x)))
        return self.fc2(self.relu(self.bn3(self.fc1(self.head(x)))))


class Attention(nn.Module):
    """Squeeze-and-excitation by 1x1 convolutions ([B, C, 1, 1] * [B, C, H, W]) and by Linears reshaped with
    x.view(b, c, 1, 1), and a spatial attention map broadcast over the channels ([B, 1, H, W] with [B, C, H, W])."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6)
        self.act = nn.Hardswish()
        self.se1, self.se2 = nn.Conv2d(6, 3, 1), nn.Conv2d(3, 6, 1)
        self.fc_a, self.fc_b = nn.Linear(6, 3), nn.Linear(3, 6)
        self.spatial = nn.Conv2d(6, 1, 3, padding=1)
        self.fc = nn.Linear(6, 5)

    def forward(self, x):
        h = self.act(self.bn(self.conv(x)))
        h = h * torch.sigmoid(self.se2(F.relu(self.se1(F.adaptive_avg_pool2d(h, 1)))))
        b, c = h.size(0), h.size(1)
        h = torch.sigmoid(self.fc_b(F.relu(self.fc_a(h.mean((2, 3)))))).view(b, c, 1, 1) * h
        a = torch.sigmoid(self.spatial(h))
        return self.fc((h * a + a).amax((2, 3)))


def idiom_samples(idiom, m, n=8, seed=123):
    """M samples of IdiomNet(idiom) (or Attention for idiom 'attention') at 8x8, and inputs."""
    samples = []
    for i in range(m):
        torch.manual_seed(i)
        samples.append(_random_batch_norms(Attention() if idiom == "attention" else IdiomNet(idiom),
                                           torch.Generator().manual_seed(100 + i)))
    return samples, torch.randn((n, 3, 8, 8), generator=torch.Generator().manual_seed(seed))


def torchvision_samples(name, m, n=4, seed=123):
    """M 'posterior samples' of torchvision.models.<name>(num_classes=10) at 32x32: one random network with
    random batch-norm statistics, each sample's weights perturbed by 5% of their mean magnitude. The last
    Linear is scaled so the logits have a standard deviation of about 3 on the inputs (random classifiers
    give nearly flat softmaxes, which would compare nothing)."""
    import copy

    import torchvision

    torch.manual_seed(0)
    base = _random_batch_norms(getattr(torchvision.models, name)(weights=None, num_classes=10),
                               torch.Generator().manual_seed(1))
    x = torch.randn((n, 3, 32, 32), generator=torch.Generator().manual_seed(seed))
    last = [mod for mod in base.modules() if isinstance(mod, nn.Linear)][-1]
    with torch.no_grad():
        scale = 3.0 / float(base(x).std())
        last.weight.mul_(scale)
        last.bias.mul_(scale)
    samples = []
    for i in range(m):
        gen = torch.Generator().manual_seed(1000 + i)
        sample = copy.deepcopy(base)
        with torch.no_grad():
            for p in sample.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05 * p.abs().mean())
        samples.append(sample.eval())
    return samples, x


def small_transformer(name):
    """torchvision's ViT, Swin and ConvNeXt builders at a test's size (32x32 inputs, 10 classes)."""
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt
    from torchvision.models.swin_transformer import SwinTransformer
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    if name == "vit":   # class token expanded to the batch size, positional embedding, MultiheadAttention
        return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32,
                                 num_classes=10)
    if name == "swin":  # shifted windows (roll, pad, window attention with relative position tables), patch merging
        return SwinTransformer(patch_size=[4, 4], embed_dim=8, depths=[2, 2], num_heads=[2, 2], window_size=[4, 4],
                               num_classes=10)
    return ConvNeXt([CNBlockConfig(8, 16, 1), CNBlockConfig(16, None, 1)], num_classes=10)   # LayerNorm2d, layer scale


def transformer_samples(name, m):
    """M posterior samples of small_transformer(name) bayesianized (ss-gl), with the weights' posterior scales
    at softplus(-2) so that the samples differ visibly and the untrained net's probabilities are not flat
    (torchvision's ViT starts its head at zero), and 8 inputs."""
    from edgebayes.compressed.samples import compress
    from edgebayes.train.families import bayesianize

    net = bayesianize(small_transformer(name), "ss-gl", input_shape=(3, 32, 32), n_train=100)
    with torch.no_grad():
        for _, layer in net.bayesian_layers():
            layer.weight_rho.fill_(-2.0)
    return compress(net.eval(), 0.5, m, 0).samples, torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
