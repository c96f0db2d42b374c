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


NETS = {"mlp": (mlp, (64,)), "lenet": (lenet, (1, 28, 28)), "rescat": (rescat, (1, 12, 12))}


def samples_and_inputs(name, m, n=32, seed=123):
    make, shape = NETS[name]
    x = torch.randn((n, *shape), generator=torch.Generator().manual_seed(seed))
    return [make(i) for i in range(m)], x
