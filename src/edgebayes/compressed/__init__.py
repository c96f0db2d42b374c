"""The compressed network: what training, export and deployment all need, below all three.

Every family ends in the same form: a deterministic architecture (the kept widths) plus M posterior
samples of its weights, each a plain PyTorch module. This package makes and measures that form:
  - samples.py:   draw M posterior samples at a knob value into plain modules (`compress`), their
                  MC average (`MCAverage`) and batched prediction;
  - surgery.py:   physically remove the dead units and channels of a plain module;
  - structure.py: structural metrics of paper 000 (node sparsity, compression and FLOPs ratios);
  - codebook.py:  the on-disk form of a sparse, quantized network (paper 001).
Why a package of its own: the train stage validates and reports on compressed samples (evaluate,
structure_report, SQS's compressed file), and export writes them. Here, below both, train needs no
import of export, and export none of train. It imports nothing of train, export or deploy (tests/test_layers.py).
"""
