"""The ELBO trainer: read it top to bottom.

Loss per mini-batch = mean NLL + KL / N_train, i.e. the negative ELBO of paper 000 (NLL summed over the
data set plus the KLs) divided by the data set size N, so the learning rate means the same whatever N is.
Adam as in paper 000 (1e-3 for MLP / LeNet), or SGD with momentum and step decays (ResNets). CPU or CUDA. A checkpoint is written (atomically) after every
epoch with the optimizer and RNG state; a run interrupted at any point resumes from the last finished
epoch and ends with the same result as an uninterrupted one (an epoch's order depends on seed and epoch only).

Speed (none of it changes the objective): the training split lives on the device and is augmented there
in batches (train.augment), the forward runs under bf16 autocast (train.precision) with the KL in fp32,
channels_last convolutions, optional torch.compile: train/accel.py. Several processes (train.processes,
DDP): each adds its shard's share of the batch's NLL and the whole KL / N; why that is the ELBO of the
single-process run is written out in train/distributed.py.

`train.kl_warmup_epochs` (default 0: none) scales the KL term by min(1, step / warm-up steps) during its
first epochs, then leaves the exact ELBO (times kl_weight). A documented deviation of the early objective
only (standard practice in variational deep learning: Bowman et al. 2016, Sonderby et al. 2016); why, for
the spike-and-slab families, in the dynamics paragraph below and issue 20.

`train.kl_weight` (default 1, the exact ELBO) multiplies the KL term: a tempered posterior. This deviates
from the paper and exists for small data sets: on the 1,078 training images of the digits default, the KL
of the slab (about 5 nats per weight at the paper's initial sigma = softplus(-6)) outweighs the summed
likelihood and the exact ELBO switches every node off before the posterior variances have grown. The
paper's MNIST setups (N = 60,000) keep kl_weight = 1.

Spike-and-slab dynamics (measured on LeNet-5-Caffe / MNIST, batch 32, Adam 1e-3; see issue 3): at init the slab
KL of a node (about 5.5 nats per weight at sigma = softplus(-6)) outweighs that node's share of the NLL, and the
same for every node of a layer, so Adam lowers all inclusion logits of a layer together by about lr per step
(fc1: 500 gammas within 0.02 of each other). They cross 0.5 together (about step 3,300 from gamma = 0.99):
`kept_nodes` then drops to 0 and the median model (z = 1[gamma > 0.5]) predicts at chance, while the network with
z ~ q(z) (the paper's MC estimator) still has about 98% validation accuracy. This is the method, not a bug:
the paper's own training logs show the same smooth fall of the sampled fraction of nodes. The fall slows near
gamma = 0.07 (step 9,000 here) and the nodes only then start to separate, so judge pruning by `mean_inclusion`
and train for many more Adam steps (the paper: 1200 epochs x 59 steps at batch 1024, about 70,000) before reading
the median model. SS-GHS learns its slab scale and its slab KL per node falls to about 10 nats within 2,000 steps,
so its gammas barely move early; it prunes much later.

Why they fall together (issue 20, benchmarks/inclusion_collapse.py, SS-GL / SS-IG, batch 32): at init the
slab KL is 5.5 nats per weight (sigma = softplus(-6) against sigma0 = 1), about 4,400 nats per fc1 node, and
its gradient on a node's inclusion logit, 8e-4 per step in loss units, is the same for every node of a layer
(within 6%) and 30x the largest and 3,000x the mean likelihood gradient on a logit (the straight-through
gradient is small while z_soft saturates at gamma = 0.99). The prior inclusion lambda_l (1/800) adds only
log(gamma / lambda) ~ 11 nats per node: not the cause. Adam then moves every logit of the layer by about lr
per step, in lockstep: from logit(0.99) = 4.6 they cross 0 after about 4,600 steps, whatever the size of the
KL. The posterior scales rho move at the same rate (-6 towards about -1.5, where the slab KL per weight is ~1
nat), so the race between "gamma crosses 0.5" and "the slab KL has fallen enough for the likelihood to tell
nodes apart" is decided by the initial values (logit 4.6, rho -6) and is lost. A KL warm-up
(train.kl_warmup_epochs) does not change this: Adam normalises each parameter's step, so once the scaled KL
gradient exceeds the likelihood's (at 3% of the warm-up) the logits fall at lr per step anyway (measured:
the median model empty at epoch 3 with a 2-epoch warm-up as without). What changes the race is the relative
speed of the logits and the scales (benchmarks/results/inclusion_collapse_lenet5_ssgl.md, 3 epochs): logits
at lr / 3 or lr / 10 keep every node (mean inclusion 0.96 / 0.99, nothing pruned yet), and the slab scales
initialised at softplus(-3) instead of softplus(-6) let the nodes separate (fc1 / fc2: 61 / 40 kept at
epoch 3, median-model validation accuracy 0.81 and falling) while softplus(-4) still collapses. None of these
is the default yet: a 20-epoch run of each against the paper's accuracy and FLOPs is what decides.
"""

import contextlib
import copy
import time

import numpy as np
import torch
import torch.nn.functional as F
from edgebayes.progress import progress as tqdm  # a bar on a terminal, one line per epoch in a log

from torch.nn.parallel import DistributedDataParallel

from edgebayes.export.compress import compress, predict
from edgebayes.provenance import atomic_torch_save, load_checkpoint
from edgebayes.train import distributed
from edgebayes.train.accel import DeviceData, autocast, compile_step, to_channels_last
from edgebayes.train.metrics import classification_metrics
from edgebayes.train.models import build_model


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device is cuda but no CUDA device is available (use auto or cpu)")
    return torch.device(name)


def model_for(cfg, splits):
    if cfg.model.family == "sqs":  # paper 001 wraps a trained dnn: train/sqs.py
        from edgebayes.train.sqs import build_sqs
        return build_sqs(cfg, splits.input_shape, len(splits.classes), len(splits.train_x))
    if cfg.model.family in ("bn3", "fn3"):  # paper 002's nested nets: train/nested.py
        from edgebayes.train.nested import build_nested
        return build_nested(cfg, splits)
    return build_model(cfg.model, cfg.prior, splits.input_shape, len(splits.classes), n_train=len(splits.train_x))


def evaluate(model, x, y, knob_value, m, seed):
    """MC-averaged metrics of m posterior samples at a knob value (e.g. an inclusion threshold), on the CPU."""
    cpu_model = copy.deepcopy(model).cpu()
    compressed = compress(cpu_model, knob_value, m, seed)
    probs = predict(compressed.mc_model(), x).numpy()
    return classification_metrics(probs, y.numpy()), compressed, probs


@contextlib.contextmanager
def sampled_inclusion(model):
    """Within this block, evaluation forwards of spike-and-slab layers draw z ~ Ber(gamma) per call instead
    of thresholding gamma: paper 000's posterior-mean estimator (its accuracy figures average 10 such
    samples). It matters before the inclusion probabilities have split into ~0 and ~1 (see train)."""
    layers = [mod for mod in model.modules() if hasattr(mod, "sample_inclusion")]
    for layer in layers:
        layer.sample_inclusion = True
    try:
        yield
    finally:
        for layer in layers:
            layer.sample_inclusion = False


def posterior_mean_metrics(model, x, y, m, seed):
    """Accuracy, NLL and ECE of m posterior samples with z ~ q(z) (sampled_inclusion), on the CPU."""
    cpu_model = copy.deepcopy(model).cpu()
    with sampled_inclusion(cpu_model):
        probs = mc_predict(cpu_model, x, m, seed)
    return classification_metrics(probs, y.numpy())


@torch.no_grad()
def mc_predict(model, x, m, seed, batch_size=1024):
    """MC-averaged class probabilities of m eval-mode forward passes (m posterior samples), as numpy.

    The dense, masked network on the training device: cheap enough for every epoch's validation. The
    RNG is forked so that validation does not move the training noise (resume stays exact).
    """
    model.eval()
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        total = 0
        for _ in range(m):
            total = total + torch.cat([torch.softmax(model(x[i: i + batch_size]), -1)
                                       for i in range(0, len(x), batch_size)])
    return (total / m).cpu().numpy()


@torch.no_grad()
def mean_inclusion(model):
    """{layer name: mean inclusion probability gamma} of every prunable layer (empty for dnn / bnn).

    `kept_nodes` counts gamma > 0.5 (the median model). Early in training the gammas of a layer fall together
    (see the module docstring), so a layer can read 0 kept nodes while its gammas sit just below 0.5 and the
    network with z ~ q(z) still predicts well; this record tells the two apart.
    """
    return {name: float(layer.inclusion_probability().mean()) for name, layer in model.bayesian_layers()
            if layer.prunable}


def train(cfg, splits, checkpoint_path, log=print, model=None):
    """Train (or resume) the configured model, or `model` when given (the Python API); returns (model, history).

    Under torchrun (train/distributed.py) every process returns the trained model; process 0 alone
    validates, writes the checkpoint and keeps the history (the others' is not kept up to date).
    """
    if cfg.model.family == "sqs":  # pretraining stage then SQS fine-tuning: train/sqs.py
        from edgebayes.train.sqs import train_sqs
        return train_sqs(cfg, splits, checkpoint_path, log)
    t = cfg.train
    world, device = distributed.setup(resolve_device(t.device))
    torch.manual_seed(cfg.seed)  # the same initial weights in every process
    model = to_channels_last((model if model is not None else model_for(cfg, splits)).to(device), t.channels_last)
    if t.optimizer == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=t.lr)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=t.lr_milestones, gamma=t.lr_gamma)
    history, start_epoch = [], 0
    if world.size > 1:
        torch.manual_seed(cfg.seed + world.rank)  # each process draws its own training noise

    world.barrier()  # process 0 may just have removed a stale checkpoint (stages.run_train)
    if checkpoint_path.exists():
        state = load_checkpoint(checkpoint_path, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if not distributed.restore_rng(state["rng_states"], world, device, cfg.seed):
            log(f"resuming with {world.size} processes a run checkpointed with {len(state['rng_states'])}: "
                f"the training noise is reseeded, so the result differs from an uninterrupted run")
        history, start_epoch = state["history"], state["epoch"]
        log(f"resuming from {checkpoint_path} after epoch {start_epoch}")

    forward = model if world.size == 1 else DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None)
    data = DeviceData(splits.train_x, splits.train_y, device, t.batch_size, cfg.seed, world.rank, world.size,
                      t.augment_padding if t.augment else None, t.channels_last)
    n = len(data)
    kl_term = model.kl
    warmup_steps = t.kl_warmup_epochs * -(-n // t.batch_size)   # KL warm-up (module docstring); 0: none
    if t.compile:
        forward, kl_term = compile_step(forward, model, data.x[: t.batch_size], log)
    bar = tqdm(range(start_epoch, t.epochs), desc="train", unit="epoch", initial=start_epoch, total=t.epochs,
               disable=not world.main)
    for epoch in bar:
        model.train()
        if hasattr(model, "start_epoch"):  # per-epoch schedules of a family (nested: Downhill temperature)
            model.start_epoch(epoch, cfg.train.epochs)
        t0 = time.perf_counter()
        sums = torch.zeros(2, device=device)  # epoch means of the NLL and the KL, summed on the device
        for b, (x, y, batch) in enumerate(data.batches(epoch)):
            with autocast(device, t.precision):  # bf16 matmuls / convolutions only (train/accel.py)
                logits = forward(x)
            # The shard's NLL sum / (B / W): once DDP averages the W gradients, the batch's mean NLL.
            nll = F.cross_entropy(logits.float(), y, reduction="sum") * world.size / batch
            kl = kl_term()  # fp32, outside autocast; added whole in every process (train/distributed.py)
            step = epoch * -(-n // t.batch_size) + b
            warm = min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0
            loss = nll + warm * t.kl_weight * kl / n
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sums += torch.stack([nll.detach(), kl.detach().to(device)]) * batch / n
        scheduler.step()
        nll_mean, kl_mean = (world.all_reduce_sum(sums) / world.size).tolist()  # over processes (see above)
        train_seconds = time.perf_counter() - t0
        if world.main:  # validation: process 0 only
            val = classification_metrics(mc_predict(model, splits.val_x.to(device), t.mc_samples_val, cfg.seed),
                                         splits.val_y.numpy())
            kept = [int(k.sum()) for k in model.kept_units(model.default_knob).values()][:-1]  # hidden layers
            history.append({"epoch": epoch + 1, "loss": nll_mean + t.kl_weight * kl_mean / n, "nll": nll_mean,
                            "kl": kl_mean, "kl_warmup": warm, "val_accuracy": val["accuracy"], "val_nll": val["nll"],
                            "kept_nodes": kept, "mean_inclusion": mean_inclusion(model),
                            "train_seconds": train_seconds, "seconds": time.perf_counter() - t0})
            bar.set_postfix(loss=f"{history[-1]['loss']:.3f}", val_acc=f"{val['accuracy']:.3f}", kept=kept)
        rng = distributed.rng_states(world, device)  # after validation (kept_units draws); every process
        if world.main:
            atomic_torch_save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                               "scheduler": scheduler.state_dict(), "rng_states": rng, "history": history,
                               "epoch": epoch + 1}, checkpoint_path)
    world.close()
    return model.cpu().to(memory_format=torch.contiguous_format).eval(), history
