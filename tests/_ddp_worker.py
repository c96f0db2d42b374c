"""Trainings that tests/test_distributed.py runs in two processes under torchrun and in one process.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/_ddp_worker.py OUT_DIR

Process 0 saves {name: (state dict, history)} of each training to OUT_DIR/results.pt.
"""

import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import edgebayes.train.spike_slab as spike_slab
from edgebayes.config import PipelineConfig
from edgebayes.data import load_data
from edgebayes.train.families import fit


def config(family, epochs):
    cfg = PipelineConfig()
    cfg.model.family, cfg.model.hidden = family, [16, 16]
    cfg.train.device, cfg.train.epochs, cfg.train.batch_size, cfg.train.mc_samples_val = "cpu", epochs, 128, 1
    cfg.train.optimizer, cfg.train.lr, cfg.train.kl_weight = "sgd", 0.05, 1.0
    return cfg


@contextlib.contextmanager
def zero_noise():
    """The training noise made identical in every process: no weight noise (eps = 0) and the relaxed Bernoulli
    at u = 1/2 (z = 1[gamma > 1/2], straight-through gradient of sigmoid(logit gamma / t))."""
    saved = spike_slab.normal_in_memory_order_, spike_slab.relaxed_bernoulli_hard

    def z_at_half(gamma_logit, temperature, generator=None, shape=None):
        z_soft = torch.sigmoid(gamma_logit / temperature)
        return ((z_soft > 0.5).to(z_soft.dtype) - z_soft.detach()) + z_soft

    spike_slab.normal_in_memory_order_ = lambda t: t.zero_()   # the local reparameterization's noise
    spike_slab.relaxed_bernoulli_hard = z_at_half
    try:
        yield
    finally:
        spike_slab.normal_in_memory_order_, spike_slab.relaxed_bernoulli_hard = saved


def run_all(out: Path, splits):
    """The trainings; each returns (state dict, history)."""
    quiet = dict(log=lambda *_: None)
    results = {}
    with zero_noise():
        model, history = fit(config("ss-gl", 3), splits, out / "zero_noise.pt", **quiet)
        results["ss-gl zero noise"] = (model.state_dict(), history)
    # Resume with per-process noise: 3 epochs straight, and 2 epochs then 1 more from the checkpoint.
    model, history = fit(config("ss-ig", 3), splits, out / "straight.pt", **quiet)
    results["ss-ig straight"] = (model.state_dict(), history)
    fit(config("ss-ig", 2), splits, out / "resumed.pt", **quiet)
    model, history = fit(config("ss-ig", 3), splits, out / "resumed.pt", **quiet)
    results["ss-ig resumed"] = (model.state_dict(), history)
    return results


if __name__ == "__main__":
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    splits = load_data(PipelineConfig().data, 0)
    results = run_all(out, splits)
    if dist.get_rank() == 0:
        torch.save(results, out / "results.pt")
    dist.barrier()   # as World.close: no process closes its connections while process 0 still writes
    dist.destroy_process_group()
