"""edgebayes: compressible Bayesian neural networks, from GPU training to a validated model on an edge device.

The Python API (edgebayes/api.py): bayesianize, register_arch, fit, compress, save, run, metrics. They are
imported on first use, so `import edgebayes` stays light (no torch until one is called).
"""

__version__ = "0.1.0"

# The pipeline's stages in order (stages.py runs them). Here, so that the command line can parse its
# arguments and check the configs before importing torch: bad input is answered in a fraction of a second.
STAGES = ("train", "select", "export", "deploy", "report")

_API = ("bayesianize", "register_arch", "fit", "compress", "save", "run", "metrics")


def __getattr__(name):
    if name in _API:
        from edgebayes import api
        return getattr(api, name)
    raise AttributeError(f"module 'edgebayes' has no attribute {name!r}")
