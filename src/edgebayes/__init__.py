"""edgebayes: compressible Bayesian neural networks, from GPU training to a validated model on an edge device."""

__version__ = "0.1.0"
