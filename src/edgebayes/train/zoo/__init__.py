"""The architecture zoo: one architecture per file, each built only through a `LayerFactory`.

An architecture never names a layer type: it asks the factory for `linear(...)` and `conv(...)`, so the
same definition gives the deterministic net (plain nn.Linear / nn.Conv2d), the dense BNN, the
spike-and-slab nets and the nested nets (see edgebayes.train.layers.LayerFactory).
"""

from edgebayes.train.zoo.lenet import lenet5_caffe
from edgebayes.train.zoo.mlp import mlp
from edgebayes.train.zoo.mobilenet import mobilenetv2
from edgebayes.train.zoo.resnet import resnet20, resnet32, resnet56
from edgebayes.train.zoo.vgg import vgg11

ARCHITECTURES = {"mlp": mlp, "lenet5-caffe": lenet5_caffe, "resnet20": resnet20, "resnet32": resnet32,
                 "resnet56": resnet56, "vgg11": vgg11, "mobilenetv2": mobilenetv2}
