"""edgebayes: compressible Bayesian neural networks, from GPU training to a validated model on an edge device."""

__version__ = "0.1.0"

# The pipeline's stages in order (stages.py runs them). Here, so that the command line can parse its
# arguments and check the configs before importing torch: bad input is answered in a fraction of a second.
STAGES = ("train", "select", "export", "deploy", "report")
