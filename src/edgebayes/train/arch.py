"""Where `model.arch` comes from: a zoo name, a name registered from a notebook, or an import path.

`resolve_arch(model_cfg)` turns the config's model section into one callable,

    build(factory, input_shape, classes) -> nn.Module

that every family calls with its own `LayerFactory` (train/layers.py): once with the dnn factory for the
plain twin that posterior samples are copied into, once with the family's factory for the trained net.

`model.arch` may be
  - a zoo name (`mlp`, `lenet5-caffe`, ...): train/zoo/, with `model.hidden` and `model.width_multiplier`;
  - a name given to `register_arch(name, builder)` in the same process (notebooks, tests);
  - an import path `package.module:attribute`, either
      * a builder in the zoo's form, `builder(factory, input_shape, classes, **model.options)`: its first
        parameter is the layer factory (named `factory` or `make`), or
      * any other callable returning a plain `nn.Module` (a torchvision constructor such as
        `torchvision.models:resnet18`, or a user's class): it is called as `fn(**model.options)` with
        `num_classes` = the data's class count where it takes that argument, and made Bayesian by
        `bayesianize` (train/bayesianize.py), optionally from `model.pretrained` weights.

The factory contract (what a builder may rely on and must respect) is in one place, LayerFactory's
docstring: `factory.linear(in, out, prunable=True, bias=True)`, `factory.conv(in, out, k, stride, padding, groups,
bias, norm, prunable)` and `factory.activation()`. A layer that produces the network's outputs must be
built with `prunable=False`; batch norm after a convolution is asked for with `norm=True` (the layer owns
it, so a switched-off channel is exactly zero after it); everything else is ordinary PyTorch.
"""

import inspect

from edgebayes.errors import ArchError
from edgebayes.plugins import IMPORT_PATH, load_callable
from edgebayes.train.bayesianize import check_runs, module_builder, with_pretrained
from edgebayes.train.zoo import ARCHITECTURES

_REGISTERED = {}


def register_arch(name: str, builder):
    """Make `name` usable as `model.arch` in this process (a builder in the zoo's form, or a plain-module
    constructor, as for import paths). Returns the builder, so it also works as a decorator argument."""
    if not callable(builder):
        raise ArchError(f"register_arch({name!r}): expected a callable, got {type(builder).__name__}")
    if name in ARCHITECTURES or IMPORT_PATH.match(name):
        raise ArchError(f"register_arch({name!r}): the name is taken by the zoo or looks like an import path")
    _REGISTERED[name] = builder
    return builder


def known_archs():
    return list(ARCHITECTURES) + list(_REGISTERED)


def takes_factory(fn) -> bool:
    """A builder in the zoo's form takes the layer factory as its first positional parameter."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD) \
        and params[0].name in ("factory", "make")


def _lookup(name: str):
    if name in ARCHITECTURES:
        return ARCHITECTURES[name]
    if name in _REGISTERED:
        return _REGISTERED[name]
    if IMPORT_PATH.match(name):
        return load_callable(name, "model.arch", ArchError)
    raise ArchError(f"model.arch: unknown architecture {name!r}; expected a zoo name ({', '.join(known_archs())}) "
                    f"or an import path package.module:builder")


def resolve_arch(model_cfg):
    """model section -> build(factory, input_shape, classes) (module docstring)."""
    fn = _lookup(model_cfg.arch)
    if model_cfg.arch in ARCHITECTURES or takes_factory(fn):
        kw = (dict(hidden=model_cfg.hidden, width_multiplier=model_cfg.width_multiplier)
              if model_cfg.arch in ARCHITECTURES else dict(model_cfg.options or {}))
        build = checked_builder(fn, kw, model_cfg.arch)
        return with_pretrained(build, model_cfg.pretrained) if model_cfg.pretrained else build
    options = dict(model_cfg.options or {})

    return module_builder(lambda classes: make_plain_module(fn, classes, options, model_cfg.arch),
                          pretrained=model_cfg.pretrained)


def checked_builder(fn, kw, name):
    """build(factory, input_shape, classes) of a builder in the zoo's form, whose failures on the data's shape
    are bad input (one ArchError naming model.arch and the shape), not a traceback or a later stage's failure:
    a builder that raises (vgg11 on 8x8 digits), or a net that does not run on that shape (lenet5-caffe's 5x5
    kernels on 8x8), found by one forward pass on zeros per shape, in both modes, outside the seeded stream."""
    checked = set()

    def build(factory, input_shape, classes):
        try:
            net = fn(factory, input_shape, classes, **kw)
        except ArchError:
            raise
        except Exception as e:
            raise ArchError(f"model.arch: {name} cannot be built for inputs of shape {tuple(input_shape)} and "
                            f"{classes} classes ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        if (tuple(input_shape), classes) not in checked:
            check_runs(net, input_shape, name)
            checked.add((tuple(input_shape), classes))
        return net
    return build


def as_builder(arch, **zoo_kw):
    """A build callable as is, or a zoo / registered name with its keyword arguments (hidden, ...) bound."""
    if callable(arch):
        return arch
    fn = _lookup(arch)
    return lambda factory, input_shape, classes: fn(factory, input_shape, classes, **zoo_kw)


def make_plain_module(fn, classes, options, what):
    """Call a plain-module constructor, with num_classes = the data's class count when it takes one."""
    kwargs = dict(options)
    try:
        params = inspect.signature(fn).parameters
        takes_classes = "num_classes" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())
    except (TypeError, ValueError):
        takes_classes = False
    if takes_classes:
        kwargs.setdefault("num_classes", classes)
    try:
        module = fn(**kwargs)
    except Exception as e:
        raise ArchError(f"model.arch: {what}(**{kwargs}) failed ({type(e).__name__}: {e})") from None
    from torch import nn

    if not isinstance(module, nn.Module):
        raise ArchError(f"model.arch: {what} returned {type(module).__name__}, not a torch.nn.Module")
    return module
