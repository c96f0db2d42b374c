"""The training loop of every family, and the ELBO it minimises for papers 000 and 002: read it top to bottom.

Loss per mini-batch = mean NLL + KL / N_train, i.e. the negative ELBO of paper 000 (NLL summed over the
data set plus the KLs) divided by the data set size N, so the learning rate means the same whatever N is.
Adam as in paper 000 (1e-3 for MLP / LeNet), or SGD with momentum and step decays (ResNets). CPU or CUDA.
A checkpoint is written (atomically) after every epoch with the optimizer and RNG state; a run interrupted at any point resumes from the last finished
epoch and ends with the same result as an uninterrupted one (an epoch's order depends on seed and epoch only).

Speed (none of it changes the objective): the training split lives on the device and is augmented there
in batches (train.augment), the forward runs under bf16 autocast (train.precision) with the KL in fp32,
channels_last convolutions, optional torch.compile: train/accel.py. Several processes (train.processes,
DDP): each adds its shard's share of the batch's NLL and the whole KL / N; why that is the ELBO of the
single-process run is written out in train/distributed.py.

`train.kl_warmup_epochs` (default 0: none) scales the KL term by min(1, step / warm-up steps) during its
first epochs, then leaves the exact ELBO (times kl_weight); with `train.kl_warmup_from` = f in (0, 1) the
factor rises geometrically from f instead (equal steps per decade). A documented deviation of the early
objective only (standard practice in variational deep learning: Bowman et al. 2016, Sonderby et al. 2016).

`train.kl_weight` (default 1, the exact ELBO) multiplies the KL term: a tempered posterior. This deviates
from the paper and exists for small data sets: on the 1,078 training images of the digits default, the KL
of the slab (about 5 nats per weight at the paper's initial sigma = softplus(-6)) outweighs the summed
likelihood and the exact ELBO switches every node off before the posterior variances have grown. The
paper's MNIST setups (N = 60,000) keep kl_weight = 1.

Spike-and-slab dynamics (issue 20; measured in benchmarks/results/inclusion_collapse_*.md). In the centered
family a unit's inclusion logit pays the unit's slab KL, about 5.5 nats per weight at the initial
sigma = softplus(-6) (4,400 nats for a unit of LeNet-5-Caffe's fc1), against a likelihood value that is 1e3-1e4
times smaller for each of hundreds of interchangeable units. The KL's gradient is the same for every unit of a
layer and Adam normalises each parameter's step, so all logits of a layer fall at about lr per step, whatever
the KL's size (a KL warm-up, linear or geometric, changes little: the geometric one let the slab scales grow
so far that the median model fell to 0.96 with almost nothing pruned), and cross 0.5 together: the median
model (z = 1[gamma > 0.5], what export deploys) is empty from epoch 8 at batch 128, while z ~ q(z) is a
dropout-like network that still predicts well. The units never separate within tens of epochs.

Two settings (the LeNet-5-Caffe configs use both) let the units separate without changing the final
objective:
  - `train.inclusion_lr` (default: lr): the inclusion logits' own Adam learning rate. A logit must travel
    from about +4.6 (gamma 0.99) to below -4 for a unit to be really off; at lr 1e-3 and batch 128 that is
    20 epochs. An optimizer setting, not the objective. The SS-GL and SS-GHS LeNet-5 configs set 3e-2 (SS-IG
    1e-2): the KL's pull on a logit is small beside the likelihood's noise, most of all under the horseshoe
    slab, which prices a kept unit at 9-68 nats against SS-GL's 120-470, and at 1e-2 SS-GHS was still pruning
    at epoch 20 (17.3% FLOPs, 3 seeds); at 3e-2 it kept 12.2% at 98.93%, and SS-GL (with scale_lr) 11.7% at
    98.94% instead of 14.6% at 98.92%, validation accuracy within noise of 1e-2's.
  - `train.kl_warmup_ordered` (with kl_warmup_epochs): during the warm-up the KL's gradient reaches the
    inclusion logits of a layer unit after unit, the last unit first (ordered_kl_warmup); its value and its
    gradient on every other parameter (slab means and scales, scale variables) are exact all along. Units are
    exchangeable at initialisation, so the order is an arbitrary tie-break: the priced units fall while the
    others carry the function, so the last ones become worth their KL and stay. After the warm-up the
    objective is the exact ELBO and decides how many stay. A documented deviation of the early gradient.
With both (inclusion_lr 1e-2, 6 warm-up epochs) on LeNet-5-Caffe the median model is never empty; without the
ordering, 1e-2 alone empties every layer within two epochs for good (a layer can only come back through a
path of units that are on). The ELBO then keeps few units (conv2 6-8 of 50, fc 7-13 of 800 / 500) at about
97% validation accuracy, far fewer fully connected weights than the paper (compression 0.37% against its
4.25% for SS-GL) at the same FLOPs. A third setting (the LeNet-5 configs use it too) is about that:
  - `train.rho_lr` (default: lr): the slab's rho (sigma = softplus(rho)) at its own Adam rate. Why: a kept
    unit pays the slab KL of every weight it has, 0.5 (sigma^2 + mu^2 - 1 - log sigma^2) each against
    N(0, 1), and most weights of a fully connected unit read inputs that pruning upstream has cut, so their
    only pull is the KL's, towards sigma = 1. From sigma = softplus(-6) rho must travel about 6.5; at lr 1e-3
    (Adam: about lr per step) that is 6,500 steps, 15 epochs at batch 128, so within a CPU budget the units
    stay priced at about 1.3 nats per weight (1,000 nats per fc1 unit) and the ELBO keeps very few. At 3e-3
    (the LeNet-5 configs) SS-GL seed 0 kept [13, 14, 21, 14] units at 98.36% test accuracy (16.7% FLOPs)
    instead of [18, 6, 8, 7] at about 97.8%; at 1e-2 the weights' noise grew faster than the means settled
    and it kept [11, 4, 98, 137] at 96.9% (8.7% FLOPs) (one seed each, 10 epochs; the three seeds of all five
    rows: benchmarks/results/lenet5_mnist_structured_sparsity_*_rho*.md). An optimizer setting: the objective
    is unchanged.
  - `train.scale_lr` (default: lr; SS-GL and SS-GHS): the LogNormal posteriors of the scale variables (tau per
    group, the global varsigma) at their own Adam rate. In the centered family they enter only the KL, where
    they set the slab's width sigma0^2 tau*^2 and so the price of every kept weight. SS-GL's group-lasso prior
    Gamma(k/2 + 1, rate varsigma^2 / 2) centres tau^2 near (k + 2) / varsigma^2, a few hundred for a unit of
    fan-in 800 at the initial varsigma^2 = e, and at lr 1e-3 the scales follow slowly: minimising the KL over
    them alone (weights and inclusions fixed) took a 10-epoch SS-GL run (LeNet-5-Caffe, seed 1) from 33,877 to
    22,310 nats and each kept unit's slab KL down 15-25%; at 20 epochs the gap was 12,865 -> 11,513 nats
    (4-7% per unit). configs/mnist-lenet5-ssgl.yaml sets 1e-2, chosen on validation over 3 seeds at 20 epochs
    (SS-GL 98.92% at 14.6% FLOPs against 98.66% at 8.0% without, both with the logits at 1e-2). An optimizer
    setting: the objective is unchanged.
The non-centered family (prior.parameterization: non-centered), whose exact KL does not weight w0's KL by
gamma (train/spike_slab.py), never empties a layer but prunes almost nothing in 10 epochs (mean inclusion
0.99 -> 0.98).

The loop is one for every family: a family brings its objective (`ELBO` here; SQS's eq. 8 in
train/sqs.py), which says how to build the optimizer, the loss terms of a step and the per-epoch record.
"""

import contextlib
import copy
import math
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from edgebayes.compressed.samples import compress, predict
from edgebayes.config import ConfigError
from edgebayes.data import pixels_as_float
from edgebayes.errors import StageError
from edgebayes.progress import progress as tqdm  # a bar on a terminal, one line per epoch in a log
from edgebayes.provenance import atomic_torch_save, load_checkpoint
from edgebayes.train import distributed
from edgebayes.train.accel import (DeviceData, autocast, compile_step, fused_optimizer, hold_freed_memory,
                                   to_channels_last)
from edgebayes.train.flops_target import (DEFAULT_BATCH, REPAIR_STEPS, FlopsTargetSchedule, fine_tuning_batch_size,
                                          nested_width_within)
from edgebayes.train.metrics import classification_metrics
from edgebayes.train.spike_slab import SCALE_VARIABLES


class TrainingDiverged(StageError):
    """The loss of an epoch is not finite: the weights are NaN or infinite, and every later stage would work on
    them. The epoch is not checkpointed; the message says what to change."""


def diverged_message(epoch, epochs, nll, kl, n, t, last=None):
    """Why training stopped after a non-finite epoch, and what to change (`train`). The network is back at its
    weights before that epoch (`restore_last_finite`)."""
    rates = ", ".join(f"train.{k} {getattr(t, k):g}" for k in ("lr", "inclusion_lr", "rho_lr", "scale_lr")
                      if getattr(t, k, None) is not None)
    before = ("" if last is None else
              f"; epoch {last['epoch']} had mean NLL {last['nll']:.4g} and KL / n {last['kl'] / n:.4g} per example")
    kept = (f"its weights after epoch {epoch - 1}, which the checkpoint holds" if epoch > 1 else
            "the weights it started from; nothing is checkpointed")
    return (f"train: the loss is not finite after epoch {epoch} of {epochs} (mean NLL {nll:.4g}, KL {kl:.4g}): the "
            f"optimisation diverged{before}. This epoch is not kept: the network is back at {kept}. "
            f"Lower the learning rate ({rates}); the KL is "
            f"divided by the {n} training examples, so with few examples it dominates the loss: a train.kl_weight "
            f"below {t.kl_weight:g} or train.kl_warmup_epochs soften it")


def restore_last_finite(model, checkpoint_path, start_state, device):
    """Put the network back at its last finite weights after a diverged epoch: the checkpoint's (written after
    the last finite epoch, by process 0 before the others go on), or `start_state` when none was written, so
    that a caller training its own module in place (api.fit) does not keep the non-finite ones."""
    state = (load_checkpoint(checkpoint_path, map_location=device)["model"] if checkpoint_path.exists()
             else start_state)
    if state is not None:
        model.load_state_dict(state)


def resolve_device(name: str, key: str = "train.device") -> torch.device:
    """`key`: how the refusal names the setting (the config's train.device, or eb.fit's device argument)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{key}: cuda, but no CUDA device is available (use auto or cpu)")
    return torch.device(name)


def evaluate(model, x, y, knob_value, m, seed, allow_no_network=False):
    """MC-averaged metrics of m posterior samples at a knob value (e.g. an inclusion threshold), on the CPU.
    allow_no_network: score a cut that leaves the output the same for every input (compress) instead of raising."""
    cpu_model = copy.deepcopy(model).cpu()
    compressed = compress(cpu_model, knob_value, m, seed, allow_no_network=allow_no_network)
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


class ELBO:
    """The negative ELBO per mini-batch (module docstring), with Adam or SGD and step decays: papers 000, 002.

    What a family's objective answers, for the one loop below: `optimizer`, `prepare` (DDP wrapper and
    torch.compile), `schedule_steps` (how long a schedule cuts the network), `start_epoch` (per-epoch
    schedules), `terms` (logits and KL of a step), `validate` (the per-epoch record beyond loss, NLL and KL)
    and `shown` (the record keys on the progress bar).
    """

    name = "train"
    shown = ("kept_nodes",)

    def optimizer(self, model, t):
        # parameters with their own learning rate (module docstring): the inclusion logits, the slab's rho, the
        # slab-scale variables
        own = {"gamma_logit": t.inclusion_lr, "weight_rho": t.rho_lr, "bias_rho": t.rho_lr}
        scales = {id(p) for module in model.modules() if isinstance(module, SCALE_VARIABLES)
                  for p in module.parameters()} if t.scale_lr else set()
        groups = {}   # lr (None: t.lr) -> parameters
        for name, p in model.named_parameters():
            lr = t.scale_lr if id(p) in scales else next((lr for suffix, lr in own.items() if name.endswith(suffix)),
                                                         None)
            groups.setdefault(lr, []).append(p)
        params = [{"params": ps} if lr is None else {"params": ps, "lr": lr} for lr, ps in groups.items()]
        if t.optimizer == "adam":
            optimizer = torch.optim.Adam(params, lr=t.lr, **fused_optimizer(params))
        else:
            optimizer = torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, **fused_optimizer(params))
        return optimizer, torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=t.lr_milestones,
                                                               gamma=t.lr_gamma)

    def prepare(self, model, forward, example, t, log):
        """(forward, kl term) of a step: compiled when train.compile asks for it (train/accel.py)."""
        if t.compile:
            return compile_step(forward, model, example, log)
        return forward, model.kl

    def schedule_steps(self, total_steps):
        """Steps a schedule of the objective changes the network's structure for (SQS's pruning rate); none here."""
        return 0

    def start_epoch(self, model, epoch, epochs):
        if hasattr(model, "start_epoch"):  # per-epoch schedules of a family (nested: Downhill temperature)
            model.start_epoch(epoch, epochs)

    def terms(self, model, forward, kl_term, x, step, total_steps, device, precision):
        with autocast(device, precision):  # bf16 matmuls / convolutions only (train/accel.py)
            logits = forward(x)
        return logits, kl_term()  # the KL in fp32, outside autocast; added whole in every process

    def validate(self, model, splits, cfg, device):
        if getattr(model, "validate_compressed", False):   # nested nets with batch norms (train/models.py)
            val, _, _ = evaluate(model, splits.val_x, splits.val_y, model.default_knob, cfg.train.mc_samples_val,
                                 cfg.seed)
        else:
            val = classification_metrics(mc_predict(model, splits.val_x.to(device), cfg.train.mc_samples_val,
                                                    cfg.seed), splits.val_y.numpy())
        kept = [int(k.sum()) for k in model.kept_units(model.default_knob).values()][:-1]  # hidden layers
        return {"val_accuracy": val["accuracy"], "val_nll": val["nll"], "kept_nodes": kept,
                "mean_inclusion": mean_inclusion(model)}


LOST_ACCURACY = 0.10   # validation accuracy a training may lose against the best it had, unsaid


def lost_accuracy(before, history, settled_epoch=1, flops_target=None, start=None):
    """The warning when training ended more than LOST_ACCURACY below the best validation accuracy it had, else
    None. The best of: the network as given (a user's trained network that the fine-tuning wrecked; one trained
    from scratch starts near chance and never counts) and the epochs from `settled_epoch` on (a run that reached
    a good network and lost it: in the centered spike-and-slab families the inclusion probabilities of a layer
    falling together, module docstring; LeNet-5 on 20,000 MNIST images went from 0.971 after epoch 4 to chance,
    benchmarks/results/peer_bayesian_torch.md). The epochs before `settled_epoch` are left out: a FLOPs target's
    or SQS's schedule is still cutting the network there, and what its cut costs is said by its own verdict.
    `flops_target`: the run's train.flops_target, whose cut is then what the advice is about. `start`: (what the
    network before the first step is, the advice when training fell below it) where the objective says
    otherwise (SQS validates the given network already quantized: its advice is SQS's own)."""
    after = history[-1]["val_accuracy"]
    start_label, start_advice = start or ("the network as given", None)
    peaks = [] if before is None else [(before, f"{start_label}, before the first step")]
    peaks += [(h["val_accuracy"], f"after epoch {h['epoch']}") for h in history[:-1] if h["epoch"] >= settled_epoch]
    if not peaks:
        return None
    best, when = max(peaks, key=lambda p: p[0])
    if best - after <= LOST_ACCURACY:
        return None
    said = f"validation accuracy fell from {best:.3f} ({when}) to {after:.3f} after the last epoch: "
    if best == before and start_advice:
        return said + start_advice
    if best == before and flops_target is not None:
        return (said + f"the fine-tuning did not recover what the cut to {flops_target:g} of the dense FLOPs cost. "
                "More epochs, or a larger train.flops_target, keeps more of it; train.max_accuracy_drop names the "
                "smallest cut of the schedule within a floor (train/flops_target.py)")
    if best == before:
        return (said + "the training lost the trained network. A smaller lr or kl_weight keeps more of it, and a "
                "spike-and-slab family with train.flops_target is the recipe for trained networks "
                "(train/flops_target.py; bn3 / fn3 keep their narrow widths poorly in a few epochs: train/nested.py)")
    return (said + "the training lost the network it had reached, and the checkpoint holds the last epoch's. In a "
            "spike-and-slab family that is the KL outweighing the data, most often on a small training set: a "
            "smaller train.kl_weight, train.kl_warmup_ordered or a lower lr keeps it (train/trainer.py)")


def kl_warmup_factor(step, warmup_steps, start=0.0):
    """The KL term's factor at `step` (module docstring): 1 after the warm-up; during it linear from 0, or, with
    0 < start < 1, geometric from `start` (start ** (1 - progress))."""
    if not warmup_steps or step + 1 >= warmup_steps:
        return 1.0
    progress = (step + 1) / warmup_steps
    return start ** (1 - progress) if start > 0 else progress


def ordered_kl_warmup(model, progress, start=0.0):
    """Per-unit factors of an ordered warm-up at `progress` (0..1) in every prunable spike-and-slab layer
    (module docstring): the inclusion logit of unit j of a layer of J units gets the KL's whole gradient once
    progress > (J - 1 - j) / J and `start` times it before, so the last unit first and unit 0 last. The KL's
    value and its gradient on every other parameter stay exact (SpikeSlabLayer.kl). progress >= 1 removes
    the factors. They are updated in place (one tensor per layer, so a compiled KL is not retraced)."""
    for layer in model.modules():
        if getattr(layer, "prunable", False) and hasattr(layer, "unit_kl_factor"):
            if progress >= 1:
                layer.unit_kl_factor = None
                continue
            units = layer.out_units
            priced = progress > torch.arange(units - 1, -1, -1, dtype=torch.float32) / units
            factor = torch.where(priced, 1.0, float(start))
            if layer.unit_kl_factor is None:
                layer.unit_kl_factor = factor.to(layer.weight_mu.device)
            else:
                layer.unit_kl_factor.copy_(factor)


def checkpoint_differences(saved, identity):
    """What a checkpoint's run identity ({name: value}, `train`'s `identity`) differs in from this run's, in
    words: ["train.lr 0.001 -> 0.5", "the data"]. Nested mappings (the train keys) are compared key by key."""
    said = []
    for key in sorted(set(saved) | set(identity)):
        old, new = saved.get(key), identity.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            said += [f"{key}.{k} {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
                     if old.get(k) != new.get(k)]
        elif old != new:
            said.append(f"the {key}" if key in ("data", "network") else f"{key} {old!r} -> {new!r}")
    return said


def train(cfg, splits, checkpoint_path, build, objective=None, log=print, until_epoch=None, identity=None):
    """Train (or resume) the net that `build()` makes, under `objective` (default: the ELBO); returns
    (model, history). `build` is called after seeding with cfg.seed, so every process starts from the same
    weights; the family registry (train/families.py) passes the configured family's builder.

    until_epoch: stop after this epoch of the cfg.train.epochs-epoch run (its checkpoint written); called again
    with a later one, it goes on from the checkpoint. Everything that depends on the run's length (KL warm-up,
    annealing, the FLOPs target's schedule, the learning-rate schedule) is of the whole run, so a run in slices
    is the same run as an uninterrupted one.

    Under torchrun (train/distributed.py) every process returns the trained model; process 0 alone
    validates, writes the checkpoint and keeps the history (the others' is not kept up to date).

    identity: what makes this run this run ({name: value}: settings, digests of the data and the network), kept in
    the checkpoint; a checkpoint of another identity is refused rather than resumed (eb.fit passes one; the
    pipeline's stages remove a stale checkpoint themselves).
    """
    objective = objective or ELBO()
    t = cfg.train
    hold_freed_memory()   # every step frees and reallocates the same large blocks (train/accel.py)
    world, device = distributed.setup(resolve_device(t.device))
    torch.manual_seed(cfg.seed)  # the same initial weights in every process
    model = to_channels_last(build().to(device), t.channels_last)
    nested = t.flops_target is not None and hasattr(model, "serve_from")
    if nested:   # a nested net trains and serves the widths within reach of the target only (train/nested.py)
        log(f"train: flops target {t.flops_target:g}: counting the FLOPs of {model.family}'s widths after surgery")
        width, ratio = nested_width_within(model, t.flops_target, t.flops_channel_multiple)
        model.serve_from(width)
        log(f"train: flops target {t.flops_target:g}: {model.family} serves widths {width}..{model.groups} of "
            f"{model.groups} groups, the narrowest at {ratio:.3f} of the dense FLOPs (after surgery)")
    # train.batch_size null: the default, or one that leaves a FLOPs target's cut network steps to recover in
    batch_size, few_steps = fine_tuning_batch_size(t, len(splits.train_x), world.size, nested)
    if t.batch_size is None and batch_size != DEFAULT_BATCH and not few_steps:
        log(f"train: batch size {batch_size}: {len(splits.train_x):,} training examples, {t.epochs} epoch(s) and "
            f"train.flops_target leave the cut network at least {REPAIR_STEPS} steps at its final structure "
            f"(train.batch_size null; train/flops_target.py)")
    if few_steps:   # names the batch size chosen
        log(f"train: WARNING {few_steps}")
    t = t.model_copy(update={"batch_size": batch_size})
    optimizer, scheduler = objective.optimizer(model, t)
    history, start_epoch = [], 0
    if world.size > 1:
        torch.manual_seed(cfg.seed + world.rank)  # each process draws its own training noise

    world.barrier()  # process 0 may just have removed a stale checkpoint (stages.run_train)
    if checkpoint_path.exists():
        state = load_checkpoint(checkpoint_path, map_location=device)
        saved = state.get("identity")   # None: written by the pipeline's stage, or before identities were kept
        differs = checkpoint_differences(saved, identity) if saved is not None and identity is not None else []
        if differs:   # resuming would mix two runs, or train the old one on
            raise ConfigError(f"checkpoint {checkpoint_path} holds another run (it differs in: {'; '.join(differs)}): "
                              f"give the same settings, data and network to go on from it, or another checkpoint "
                              f"path (or delete it) to start over")
        try:
            model.load_state_dict(state["model"])
        except (RuntimeError, ValueError) as e:   # another architecture or family; a nested width out of range
            raise ConfigError(f"checkpoint {checkpoint_path} is of another network: "
                              f"{str(e).strip().splitlines()[0][:300]}; give another checkpoint path (or delete it) "
                              f"to start over") from None
        optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        if not distributed.restore_rng(state["rng_states"], world, device, cfg.seed):
            log(f"resuming with {world.size} processes a run checkpointed with {len(state['rng_states'])}: "
                f"the training noise is reseeded, so the result differs from an uninterrupted run")
        history, start_epoch = state["history"], state["epoch"]
        log(f"train: resuming from {checkpoint_path} after epoch {start_epoch}")

    # The weights a diverged first epoch goes back to (restore_last_finite); later ones go back to the checkpoint's
    start_state = None if checkpoint_path.exists() else {k: v.detach().to("cpu", copy=True)
                                                         for k, v in model.state_dict().items()}
    forward = model if world.size == 1 else DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None)
    data = DeviceData(splits.train_x, splits.train_y, device, t.batch_size, cfg.seed, world.rank, world.size,
                      t.augment_padding if t.augment else None, t.channels_last)
    n = len(data)
    steps_per_epoch = math.ceil(n / t.batch_size)
    forward, kl_term = objective.prepare(model, forward, pixels_as_float(data.x[: t.batch_size]), t, log)
    warmup_steps = t.kl_warmup_epochs * steps_per_epoch   # KL warm-up (module docstring); 0: none
    flops_target = None if t.flops_target is None or nested else FlopsTargetSchedule(   # train/flops_target.py
        model, t, t.epochs * steps_per_epoch, log if world.main else (lambda *_: None),
        evaluate=(lambda m: objective.validate(m, splits, cfg, device)["val_accuracy"]) if world.main else None,
        points=history[-1].get("flops_target_points", []) if history else [])
    # The network as given, validated once: a trained network that the training loses is said at the end. A FLOPs
    # target's schedule validates it at its step 0 anyway (flops_target.trajectory[0]): that figure is taken
    before = history[0].get("val_accuracy_before") if history else None
    if not history and world.main and flops_target is None:
        model.eval()
        with torch.random.fork_rng(devices=[]):   # as the flops target's validation: no training noise changes
            before = objective.validate(model, splits, cfg, device)["val_accuracy"]
    last = t.epochs if until_epoch is None else min(t.epochs, until_epoch)
    bar = tqdm(range(start_epoch, last), desc=objective.name, unit="epoch", initial=start_epoch,
               total=t.epochs, disable=not world.main)
    for epoch in bar:
        model.train()
        objective.start_epoch(model, epoch, t.epochs)
        t0 = time.perf_counter()
        sums = torch.zeros(2, device=device)  # epoch means of the NLL and the KL, summed on the device
        for b, (x, y, batch) in enumerate(data.batches(epoch)):
            step = epoch * steps_per_epoch + b
            if flops_target is not None:   # switches the least important units off at its schedule's points
                flops_target.step(model, step)
            if t.kl_warmup_ordered and step < warmup_steps:   # per-unit factors inside the KL; its last
                ordered_kl_warmup(model, (step + 1) / warmup_steps, t.kl_warmup_from)   # step removes them
            logits, kl = objective.terms(model, forward, kl_term, x, step, t.epochs * steps_per_epoch, device,
                                         t.precision)
            # The shard's NLL sum / (B / W): once DDP averages the W gradients, the batch's mean NLL.
            nll = F.cross_entropy(logits.float(), y, reduction="sum") * world.size / batch
            # the ordered warm-up keeps the KL's value exact: no factor on the term
            warm = 1.0 if t.kl_warmup_ordered else kl_warmup_factor(step, warmup_steps, t.kl_warmup_from)
            loss = nll + warm * t.kl_weight * kl / n
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sums += torch.stack([nll.detach(), kl.detach().to(device)]) * batch / n
        if scheduler is not None:
            scheduler.step()
        nll_mean, kl_mean = (world.all_reduce_sum(sums) / world.size).tolist()  # over processes (see above)
        if not (math.isfinite(nll_mean) and math.isfinite(kl_mean)):   # every process sees the same sums
            restore_last_finite(model, checkpoint_path, start_state, device)
            world.close()
            raise TrainingDiverged(diverged_message(epoch + 1, t.epochs, nll_mean, kl_mean, n, t,
                                                    history[-1] if history else None))
        train_seconds = time.perf_counter() - t0
        if world.main:  # validation: process 0 only
            model.eval()
            history.append({"epoch": epoch + 1, "loss": nll_mean + t.kl_weight * kl_mean / n, "nll": nll_mean,
                            "kl": kl_mean, "kl_warmup": warm, **objective.validate(model, splits, cfg, device),
                            "train_seconds": train_seconds, "seconds": time.perf_counter() - t0})
            if epoch == 0:
                if flops_target is not None:
                    before = flops_target.trajectory[0]["val_accuracy"]
                history[-1]["val_accuracy_before"] = before
                history[-1]["batch_size"] = batch_size   # chosen where train.batch_size is null
            if flops_target is not None:   # the schedule's cuts so far, validated (a resumed run goes on with them)
                history[-1]["flops_target_points"] = [dict(p) for p in flops_target.trajectory]
            bar.set_postfix(loss=f"{history[-1]['loss']:.3f}", val_acc=f"{history[-1]['val_accuracy']:.3f}",
                            **{k: history[-1][k] for k in objective.shown})
        rng = distributed.rng_states(world, device)  # after validation (it may draw); every process
        if world.main:
            atomic_torch_save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                               "scheduler": None if scheduler is None else scheduler.state_dict(),
                               "rng_states": rng, "history": history, "epoch": epoch + 1, "identity": identity},
                              checkpoint_path)
    finished = bool(history) and history[-1]["epoch"] == t.epochs
    if flops_target is not None and world.main and finished:
        curve, verdict = flops_target.finish(history[-1]["val_accuracy"])   # and train.max_accuracy_drop
        history[-1]["flops_target_points"] = [dict(p) for p in flops_target.trajectory]
        for line in (curve, verdict):
            if line:
                log(line)
        if verdict:
            history[-1]["flops_target_verdict"] = verdict
    # the first epoch whose network has its final structure: a schedule's last cut falls in it
    settled = max(objective.schedule_steps(t.epochs * steps_per_epoch), flops_target.points[-1] if flops_target else 0)
    settled_epoch = max(0, settled - 1) // steps_per_epoch + 1
    lost = lost_accuracy(before, history, settled_epoch, None if nested else t.flops_target,
                         getattr(objective, "start", None)) if world.main and finished else None
    if lost and few_steps:   # the likely cause, said where the report shows the loss
        lost = f"{lost}; the likely cause: {few_steps}"
    if lost:
        log(f"train: WARNING {lost}")
        history[-1]["accuracy_lost"] = lost
    world.close()
    return model.cpu().to(memory_format=torch.contiguous_format).eval(), history
