"""A FLOPs target for the spike-and-slab families: a trained network fine-tuned into a smaller one (issue 33).

    train:
      flops_target: 0.25          # the median model's physical FLOPs, as a fraction of the dense network's
                                  # (device: the largest the device's budgets allow, deploy/budget_targets.py)
      flops_schedule_fraction: 0.1   # reached after this share of the fine-tuning steps (default)

Why it is needed. Started from a trained network, paper 000's ELBO switches nothing off within a fine-tuning
budget: the inclusion probabilities start at gamma_init = 0.99 and Adam moves a logit by about the learning
rate per step, so at lr 1e-3 a unit needs thousands of steps to cross 0.5, and the KL's pull is the same for
every unit of a layer (train/trainer.py), so it does not tell the units apart when it does.

What this does. During the first `flops_schedule_fraction` of the steps the target of the step follows the
polynomial schedule SQS uses too (Zhu & Gupta 2017, `pruning_schedule`):
r_t = r + (1 - r)(1 - t / (f T))^3, then stays at r. At `POINTS` evenly spaced steps of that span the units
are ranked by importance and the least important ones have their inclusion probability set to
1 - SURE, so that the median model
(z = 1[gamma > 0.5], what export deploys) keeps at most r_t of the dense FLOPs. Between those points, and
after the last, the objective is the family's exact ELBO: it trains the weights of the units that stay (with
the switched-off ones at z ~ Ber(1 - SURE) in training, their slab KL weighted by gamma as paper 000's centered
KL does), and it can still move any inclusion probability. A documented deviation of the optimisation path
of the inclusion logits, not of the objective: the logits are set, as an initialisation is, before the first
step (every unit to at least SURE) and at the schedule's points, where the median model becomes the plan's. So a
unit an earlier point switched off comes back at SURE when a later plan keeps it: the rate falls little between
the schedule's last points, and the plan's "one group more" step takes back the best group left out. Switched off
for good, such units left the shipped network below the plan's count (mobilenet_v2 of
benchmarks/finetune_compress.py at 0.25: 0.2451 of the FLOPs where 0.25 was planned; a small residual net at
0.2: 0.164 where 0.185 was).

Why the target is reached after 10% of the steps (flops_schedule_fraction 0.1) and not gradually over half of
them, as Zhu & Gupta do over a long training: a deep network with batch norms is at chance accuracy right after
a cut, whichever its size (Torch-Pruning's one-shot cuts of the benchmark's nets: 9-25% before fine-tuning, even
at half their FLOPs), and it is the steps at the final structure that repair it. Over half of a 3-epoch
fine-tuning, efficientnet_b0 lost its accuracy at the first cut (0.73 -> 0.31 validation accuracy at 0.79 of its
FLOPs) and was still near chance at the last (0.14), with 48 steps left to recover (0.435). Measured on
benchmarks/finetune_compress.py, SS-GL to 0.25 of the FLOPs, validation accuracy 0.5 -> 0.1:
efficientnet_b0 seeds 0/1/2 0.677/0.435/0.513 -> 0.680/0.664/0.705, resnet18 0.944 -> 0.963, mobilenet_v2
0.864 -> 0.849, the home-made net 0.955 -> 0.952 (seed 0; mean of the six 0.731 -> 0.802). A config that trains
from scratch for many epochs (pipeline.yaml) sets 0.5.
Nor in one cut after the first step, as Torch-Pruning prunes (0.005: one point): measured on the same benchmark
(dense nets of 6 epochs, 5 fine-tuning epochs, 120 steps, target 0.25, seeds 0/1/2 for efficientnet_b0 and 0/1
for the others), validation accuracy 0.1 -> 0.005: efficientnet_b0 0.746/0.807/0.657 -> 0.748/0.697/0.707,
resnet18 0.971/0.971 -> 0.977/0.970, mobilenet_v2 0.912/0.875 -> 0.900/0.867, the home-made net 0.959/0.954 ->
0.961/0.937 (mean of the nine 0.872 -> 0.863, the one cut ahead on four). On 1,150 digits (finetune_steps.py's
batch-16 rows, seeds 0/1) the one cut was ahead on four of six (shufflenet_v2_x0_5 0.719/0.708 -> 0.757/0.733),
but the same efficientnet_b0 moved by 11 points between the two schedules on one seed: the difference is within
what one fine-tuning run varies by, and 0.1 stays.

Why SURE = 1 - 1e-4 and not paper 000's gamma_init = 0.99 (and 0.01 for a unit switched off): z is drawn
once per step, so at 0.99 every kept unit is dropped on 1% of the steps and every switched-off one comes back
on 1%, and a deep network has thousands of units: a hundred or so flip in every step of a fine-tuning that
must repair the cut network. Measured on benchmarks/finetune_compress.py's efficientnet_b0 (SS-GHS, 0.25 of
its FLOPs, 3 epochs, one seed), validation accuracy: 0.487 at 0.99 / 0.01, 0.636 with the kept units at SURE,
0.523 with the switched-off ones at 1 - SURE, 0.704 with both (Torch-Pruning's magnitude pruner, fine-tuned
alike: 71.45% test accuracy).

Why the fine-tuned posterior has one operating point (every inclusion threshold keeps the target's units, and
select scores that network once): units between the inclusion probabilities SURE and 1 - SURE are dropped or
kept at random in training, and a network trained so is worse at every threshold. Tried (issue 33): the groups
between 0.75 and 1.25 of the target given graded probabilities at the last cut (1 - (j - 1/2) / 8 for the
group first kept at the j-th of eight cuts, so that thresholds 0.9 ... 0.1 give networks from 0.81 to 1.19 of
the target), benchmarks/finetune_compress.py's data and dense nets (6 epochs), SS-GL fine-tuned 3 epochs (seed 0
unless said), test accuracy of the target's network
(threshold 0.5) without / with: the home-made net at 0.25 seeds 0/1/2 0.956/0.947/0.9525 against
0.9545/0.943/0.928, at 0.5 seeds 0/1 0.9655/0.946 against 0.949/0.9535; mobilenet_v2 at 0.25 0.8385 against
0.639 (0.774 with its batch-norm statistics re-estimated per sample on 2,000 training images), its band's
other points at 0.50 (0.20 of the FLOPs) to 0.22 (0.30). A range of trained sizes needs each size trained, as the
nested family does (train/nested.py); here a target the accuracy floor does not allow names the closest cut
of the schedule instead (`finish`).

Importance of unit j: gamma_j times the unit's output scale, |batch-norm weight_j| where the layer owns a batch
norm (the unit's output is z BN(conv): network slimming's measure, Liu et al. 2017) and the L2 norm of its
weights' posterior means otherwise. gamma_j lets the posterior's own view count: a unit the ELBO has pushed down
goes first. Units are compared within their family only (`plan`). Tried (issue 33): the L2 norm of the weights'
posterior means for every layer (a magnitude measure, as Torch-Pruning's), SS-GL fine-tuned 3 epochs, seed 0,
test accuracy with / without it at 0.5 and 0.25 of the FLOPs: resnet18 95.1 / 94.75 and 93.9 / 95.85,
mobilenet_v2 82.85 / 89.9 and 70.3 / 87.35, efficientnet_b0 84.1 / 86.4 and 72.55 / 65.25 (mean 83.1 / 86.6); at
5 epochs, seed 0, at 0.25: mobilenet_v2 78.50 / 91.80 and resnet18 97.40 / 97.15 with the last epoch at a tenth
of the rate, efficientnet_b0 85.15 / 79.55 at a constant rate: it wins on efficientnet_b0 and loses a network
that the batch-norm scale keeps. And a first-order Taylor importance, gamma_j times the RMS over the schedule's
steps of the loss change when the unit goes (Molchanov et al. 2019: batch-norm weight and bias times their
gradients where the layer owns a batch norm, else the weights' means times theirs), SS-GL fine-tuned 5 epochs
with the last at a tenth of the rate, seed 0, test accuracy with / without it: efficientnet_b0 at 0.25 71.80 /
76.05, mobilenet_v2 at 0.25 86.55 / 91.80, resnet18 at 0.5 97.85 / 98.10. Nor can the data choose between these
measures by the validation loss right after a one-shot cut (batch norms on batch statistics, seed 0, 0.25 of the
FLOPs): it ranks them against their fine-tuned accuracy, the weight norm lower on mobilenet_v2 (2.65 / 3.14 nats,
then 78.50 / 91.80) and the batch-norm scale far lower on resnet18 (0.58 / 1.44, then 97.15 / 97.40). And the
batch-norm scale times the L2 norm of the unit's columns in the layers that read it (its consumers, over the whole
coupled group, as Torch-Pruning's group magnitude counts them), SS-GL, 5 epochs with the last at a tenth of the
rate, test accuracy with / without it: efficientnet_b0 at 0.25 seeds 0/1/2 79.80/81.10/74.25 against
76.05/81.45/70.10 (mean 78.38 / 75.87, Torch-Pruning's magnitude pruner 78.48), but mobilenet_v2 at 0.25 87.80 /
91.80, resnet18 at 0.5 97.50 / 98.10, the home-made net at 0.25 95.60 / 95.75 (seed 0): the trade of the weight
norm again, smaller. What holds efficientnet_b0 back at 0.25 is not the KL either: with the KL's weight at 1e-6,
74.50 against 79.55 (seed 0, 5 epochs at a constant rate). On the benchmark's dense nets (6 epochs of Adam from
scratch) the batch-norm weights are within about 1% of their initial 1 (coefficient of variation 0.008-0.021 per
layer, all four nets): the measure ranks units by how the training moved them. efficientnet_b0's
squeeze-and-excitation gates vary far more (their mean over 256 images 0.30-0.70 per channel), and |batch-norm
weight| times the mean gate ranks the depthwise channels differently (Spearman 0.05-0.67 against the scale
alone); tried on three other dense nets (SS-GL at 0.25, 5 epochs, the last at a tenth of the rate), validation /
test accuracy with / without the gate: seed 0 0.765 / 76.45 against 0.786 / 79.55, seed 1 0.781 / 82.70 against
0.802 / 80.90, seed 2 0.697 / 72.70 against 0.680 / 68.30: lower on validation (mean 0.748 against 0.756), so the
scale alone stays.

Units go in groups that surgery removes together (`channel_families`): a channel of a residual stream is
switched off in every block that writes it, an expand channel with the depthwise channel it feeds, as
Torch-Pruning's dependency graph couples them (compressed/surgery.py, coupled_channels); most groups are one
unit. A layer coupled to the model's outputs or to a layer that is not Bayesian
stays whole, and so does a family of groups whose dead units surgery still keeps in a probe before the first
step: switching those off would cost accuracy and save no FLOPs. Every family keeps the same share of its
groups, its most important ones (`plan`), as Torch-Pruning's default per-layer ratio does. FLOPs are counted
by paper 000's formula on the median model with dead units zeroed (`paper_flops(effective=True)`), which on
the ranked families is what surgery then removes (tests/test_flops_target.py checks that on a residual net),
and the last cut on the network surgery makes of it, aimed lower where surgery must keep more than the masks
say (a grouped convolution's groups stay equal: `FlopsTargetSchedule._within_after_surgery`). A target below
the smallest network the families allow (one group of each) is a ConfigError before the first step
(`FlopsTargetSchedule._measure`): reaching for it would cut every family to one group and still miss it.
"""

import copy
import functools
import itertools
import math

import torch

from edgebayes.compressed.structure import paper_flops
from edgebayes.compressed.surgery import SurgeryError, coupled_channels, kept_summary, remove_dead_units
from edgebayes.config import ConfigError
from edgebayes.train.bayesianize import load_matching
from edgebayes.train.models import drop_outputs

POINTS = 10   # schedule points where units are switched off: gradual, and each costs a few FLOPs counts
SURGERY_TRIES = 6   # re-aims of the last cut where surgery keeps more than the masks count (_within_after_surgery)
TOLERANCE = 0.01   # a cut within 1% above its target counts as reaching it
SURE = 1 - 1e-4   # inclusion probability of a kept unit from the first step, 1 - SURE of a switched-off one (docstring)
REPAIR_STEPS = 100   # optimisation steps a cut network needs at its final structure (fine_tuning_batch_size)
DEFAULT_BATCH = 1024   # train.batch_size where it is left out (null) and there is no FLOPs target
SMALLEST_BATCH = 16   # the smallest batch fine_tuning_batch_size picks: batch norm's statistics of fewer are noise


def steps_at_final_structure(total_steps, fraction, nested=False):
    """The optimisation steps after the schedule's last cut (a nested network is served at its final width from
    the first step)."""
    return total_steps if nested else total_steps - max(1, math.ceil(fraction * total_steps))


def fine_tuning_batch_size(train_cfg, n, processes=1, nested=False):
    """The training batch size, and a warning (or None) when the fine-tuning leaves the network too few steps.

    A cut network is repaired by the steps it trains at its final structure, and their number, not the epochs,
    is what a small training set runs short of: 1,150 images of a user's image folder at the default batch of
    1024 are 2 steps an epoch, and torchvision's shufflenet_v2_x0_5, cut to half its FLOPs after its first step,
    went from 0.979 validation accuracy to 0.090 in 3 epochs (0.580 at batch 128, 0.729 at 32). On 1,100 digits
    at 32x32, torchvision mobilenet_v2 cut to half its FLOPs in 3 epochs (ss-gl, dense test accuracy 0.923) kept
    0.811 at batch 128 (27 steps), 0.854 at 64, 0.889 at 32 (105 steps); Torch-Pruning's magnitude pruner with
    the same epochs 0.711, 0.871, 0.889 (this CPU, one seed). Over four seeds on 1,150 digits
    (benchmarks/results/finetune_steps.md, mean test accuracy) 24 -> 97 steps gained 6-12 points (mobilenet_v2
    73.0 -> 84.6, shufflenet_v2_x0_5 56.6 -> 66.9) and 97 -> 194 one to five more (85.9, 72.1; the home-made
    net 96.2 -> 96.9): 100 steps is a floor past the steepest part, not an optimum; the largest batch
    that meets it is taken because a smaller batch costs wall time per epoch.

    train.batch_size left out (null): DEFAULT_BATCH without a FLOPs target, and with one the largest power of
    two from DEFAULT_BATCH down to SMALLEST_BATCH that leaves at least REPAIR_STEPS steps at the final
    structure (a large training set keeps the default). Set by the user: kept, with the warning when it leaves
    fewer. The warning names the batch size and the epochs that would leave enough."""
    epochs, target = train_cfg.epochs, train_cfg.flops_target
    fraction = float(train_cfg.flops_schedule_fraction)

    def repair(batch):
        return steps_at_final_structure(epochs * math.ceil(n / batch), fraction, nested)

    chosen = train_cfg.batch_size
    if chosen is None:
        chosen = DEFAULT_BATCH
        while target is not None and repair(chosen) < REPAIR_STEPS and chosen // 2 >= max(SMALLEST_BATCH, processes):
            chosen //= 2
    if target is None or repair(chosen) >= REPAIR_STEPS:
        return chosen, None
    per_epoch = math.ceil(n / chosen)
    # bounded: a fraction just below 1 leaves a step at the final structure in a great many epochs only
    more = next((e for e in range(epochs, 1000 * epochs + 1)
                 if steps_at_final_structure(e * per_epoch, fraction, nested) >= REPAIR_STEPS), None)
    smaller = next((b for b in (2 ** k for k in range(int(math.log2(chosen)), -1, -1))
                    if SMALLEST_BATCH <= b < chosen and repair(b) >= REPAIR_STEPS), None)
    if more is None:
        fix = f"set train.flops_schedule_fraction well below {fraction:g}"
    elif smaller is not None and train_cfg.batch_size is not None:
        fix = f"set train.batch_size to {smaller} or train.epochs to {more}"
    else:
        fix = f"set train.epochs to {more}"
    return chosen, (f"train.flops_target: {n:,} training examples at batch size {chosen} are {per_epoch} step(s) an "
                    f"epoch, {epochs * per_epoch} in {epochs} epoch(s), and {repair(chosen)} of them at the final "
                    f"structure, where a cut network needs about {REPAIR_STEPS} to recover its accuracy "
                    f"(train/flops_target.py): {fix}")


def pruning_schedule(step, total_steps, keep_init, target, fraction, power=3):
    """The kept share at a step: polynomial decay from keep_init to target over the first `fraction` of the
    steps, then target (Zhu & Gupta 2017). SQS's prior inclusion probability (train/sqs.py) and a FLOPs
    target's rate (here)."""
    end = max(1, fraction * total_steps)
    progress = min(1.0, step / end)
    return target + (keep_init - target) * (1 - progress) ** power


def prunable_layers(model):
    """[(name, layer)] of the spike-and-slab layers a FLOPs target can switch units off in."""
    layers = getattr(model, "bayesian_layers", lambda: [])()
    return [(n, m) for n, m in layers if getattr(m, "prunable", False) and hasattr(m, "gamma_logit")]


@torch.no_grad()
def importance(layer):
    """gamma_j times unit j's output scale (module docstring)."""
    if layer.norm is not None and getattr(layer.norm, "weight", None) is not None:
        scale = layer.norm.weight.abs()
    else:
        scale = layer.weight_mu.flatten(1).norm(dim=1)
    return (layer.inclusion_probability() * scale.to(layer.weight_mu.device)).cpu()


@torch.no_grad()
def _dense_sample(model):
    """A posterior sample with every unit kept (threshold 0), as a plain module, and {layer: plain name}."""
    plain, _ = model.posterior_sample(0.0, torch.Generator().manual_seed(0))
    return plain, {name: model._plain_name(name, layer) for name, layer in prunable_layers(model)}


@torch.no_grad()
def masked_flops(model, keep, plain_names=None, base=None, terms=None):
    """Paper-formula FLOPs of the model's plain twin with the units `keep` ({layer name: mask}) leaves out
    switched off, for one example (`terms`: as paper_flops')."""
    if base is None:
        base, plain_names = _dense_sample(model)
    plain = {k: v.clone() for k, v in base.state_dict().items()}
    try:
        for name, mask in keep.items():
            drop_outputs(base, plain_names[name], mask)
        return paper_flops(base, model.input_shape, effective=True, terms=terms)
    finally:
        load_matching(base, plain)   # with the module's state-dict versions: MNASNet refuses a state without them


class GroupFlops:
    """masked_flops of a plan, counted from which group of units each channel depends on.

    Why: `plan` counts FLOPs some 20 + (number of families) times per cut, and masked_flops runs surgery's probe
    (two forward passes of the network) each time: 46% of an efficientnet_b0 epoch with a FLOPs target
    (benchmarks/finetune_compress.py's net, 1 epoch, 1 thread: 61 s of 201 in `plan`).

    How: the FLOPs of a masked network are sums over its layers of (live output rows, live input channels),
    and with whole groups switched off, and at least one group of every family kept as a plan keeps it, each
    row and channel is live, dead, or live exactly when one group is kept. Which, is read once from
    masked_flops' own probe: log2(groups) + 20 runs, each with a random half of every family's groups switched
    off (one kept), give every group its own pattern of runs it was kept in; a channel live in the runs of one group's
    pattern depends on that group, one live in all of them is live whatever is cut, in none, dead. `build`
    returns None (plan counts with masked_flops) where a channel fits none of these (it depends on two groups)
    or where the count differs from masked_flops on check masks; plan checks its result with masked_flops."""

    def __init__(self, model, groups, sources):
        self.sources, self.other = sources, 0   # other: FLOPs no mask changes, set by build
        # each group's first unit, as an index into the masks laid end to end (count reads them so)
        sizes = {name: layer.out_units for name, layer in prunable_layers(model)}
        self.layers = list(sizes)
        offsets = dict(zip(self.layers, itertools.accumulate([0] + [sizes[n] for n in self.layers])))
        self.first_units = torch.tensor([offsets[g[0][0]] + g[0][1] for g in groups])

    @classmethod
    @torch.no_grad()
    def build(cls, model, families, plain, plain_names, spare_runs=20):
        groups = [g for family in families for g in family]
        if not groups:
            return None
        # random patterns, distinct with probability about 1 - (groups)^2 2^-runs; at most 62: int64 keys
        runs = min(62, max(1, math.ceil(math.log2(len(groups)))) + spare_runs)
        generator = torch.Generator().manual_seed(0)
        kept = torch.stack([cls._draw(families, 0.5, generator) for _ in range(runs)])   # runs x groups
        weights = 1 << torch.arange(runs, dtype=torch.long)[:, None]
        patterns = (kept.long() * weights).sum(0)
        everything = (1 << runs) - 1
        several = torch.tensor([len(f) > 1 for f in families for _ in f])
        if len(set(patterns.tolist())) < len(groups) or bool((patterns[several] == everything).any()):
            return None
        terms, totals = [], []
        for alive in kept:
            terms.append([])
            totals.append(masked_flops(model, cls._keep(model, groups, alive), plain_names, plain, terms[-1]))
        if any([t[0] for t in run] != [t[0] for t in terms[0]] for run in terms):
            return None
        order = torch.argsort(patterns)
        sources = []
        for i, (layer, *_, kernel, positions) in enumerate(terms[0]):
            decoded = []
            for part in (1, 2):   # live output rows, live input channels
                seen = (torch.stack([run[i][part] for run in terms]).long() * weights).sum(0)
                at = torch.searchsorted(patterns[order], seen).clamp_max(len(groups) - 1)
                group = order[at]
                single = patterns[group] == seen
                always, never = seen == everything, seen == 0
                if not bool((single | always | never).all()):
                    return None
                decoded.append(torch.where(always & ~single, len(groups), torch.where(never, len(groups) + 1, group)))
            sources.append((decoded[0], decoded[1], getattr(layer, "groups", 1), kernel, positions))
        counter = cls(model, groups, sources)
        counter.other = totals[0] - counter._layers(kept[0])   # what no mask changes: attention's (structure.py)
        for share in (1.0, 0.5, 0.2):
            keep = cls._keep(model, groups, cls._draw(families, share, generator))
            if counter.count(keep) != masked_flops(model, keep, plain_names, plain):
                return None
        return counter

    @staticmethod
    def _draw(families, share, generator):
        """Groups kept, each with probability `share`, at least one of every family."""
        alive = []
        for family in families:
            on = torch.rand(len(family), generator=generator) < share
            if not bool(on.any()):
                on[int(torch.randint(len(family), (1,), generator=generator))] = True
            alive.append(on)
        return torch.cat(alive)

    @staticmethod
    def _keep(model, groups, alive):
        keep = {n: torch.ones(layer.out_units, dtype=torch.bool) for n, layer in prunable_layers(model)}
        for group, on in zip(groups, alive.tolist()):
            if not on:
                for name, unit in group:
                    keep[name][unit] = False
        return keep

    def _layers(self, alive):
        live = torch.cat([alive, torch.tensor([True, False])])   # then "always live", "never live"
        flops = 0
        for row_source, in_source, groups, kernel, positions in self.sources:
            rows, live_in = live[row_source], live[in_source]
            c_in = int(live_in.view(groups, -1).sum(1).repeat_interleave(len(rows) // groups)[rows].sum())
            flops += (c_in * kernel + int(rows.sum())) * positions
        return flops

    def count(self, keep):
        """FLOPs of the masks `keep` ({layer name: mask}), each group kept when its first unit is."""
        return self.other + self._layers(torch.cat([keep[name] for name in self.layers])[self.first_units])


@torch.no_grad()
def physical_flops(model, keep, plain_names, base, report=None, channel_multiple=1):
    """Paper-formula FLOPs of the network surgery makes of `base` with the units `keep` leaves out switched off,
    or None where surgery cannot run on it (compress says why after training). `report`, `channel_multiple`:
    remove_dead_units'."""
    pruned = copy.deepcopy(base)
    for name, mask in keep.items():
        drop_outputs(pruned, plain_names[name], mask)
    try:
        pruned = remove_dead_units(pruned, {plain_names[n]: m for n, m in keep.items()},
                                   torch.zeros((1,) + tuple(model.input_shape)), report=report,
                                   channel_multiple=channel_multiple)
    except SurgeryError:
        return None
    return paper_flops(pruned, model.input_shape)


@torch.no_grad()
def channel_families(model, seed=0, log=print, whole=None):
    """[family]: the units a FLOPs target may switch off, in groups that go together (module docstring).

    A group is a list of (layer name, unit) that surgery removes only together (compressed/surgery.py,
    coupled_channels): a residual stream's channel in every block that writes it, an expand channel with its
    depthwise channel; most groups are one unit. A family is the groups over the same layers (the 64 channels
    of one residual stream); `plan` keeps the same share of every family. A family whose dead units surgery
    still keeps in a probe (half of its groups off at random) is left whole: switching it off would cost
    accuracy and save no FLOPs. `whole`, when a dict is passed, receives {layer name: why it is left whole}."""
    plain, plain_names = _dense_sample(model)
    by_plain = {p: n for n, p in plain_names.items()}
    example = torch.zeros((1,) + tuple(model.input_shape))
    try:
        groups, blocked = coupled_channels(plain, list(by_plain), example)
    except SurgeryError as e:   # compress will say so again after training; every unit its own group meanwhile
        log(f"flops target: the network's coupled channels cannot be traced ({e}); each unit is ranked alone")
        groups, blocked = [{(p, c)} for p in by_plain for c in range(plain.get_submodule(p).weight.shape[0])], set()
    families = {}
    for g in groups:
        if not any(p in blocked for p, _ in g):
            members = sorted((by_plain[p], c) for p, c in g)
            families.setdefault(frozenset(n for n, _ in members), []).append(members)
    generator = torch.Generator().manual_seed(seed)
    keep = {n: torch.ones(plain.get_submodule(p).weight.shape[0], dtype=torch.bool) for n, p in plain_names.items()}
    for family in families.values():
        off = torch.randperm(len(family), generator=generator)[: len(family) // 2].tolist()
        for i in off:
            for name, unit in family[i]:
                keep[name][unit] = False
    for name, mask in keep.items():
        drop_outputs(plain, plain_names[name], mask)
    report = {}
    try:
        remove_dead_units(plain, {plain_names[n]: m for n, m in keep.items()}, example, report=report)
    except SurgeryError as e:
        log(f"flops target: surgery cannot probe this network ({e}); every family is ranked")
        return list(families.values())
    ranked, left = [], []
    for layers, family in families.items():
        rows = [report.get(plain_names[n], {}) for n in layers]
        dead, removed = sum(r.get("dead", 0) for r in rows), sum(r.get("removed", 0) for r in rows)
        (ranked if dead == 0 or removed >= 0.5 * dead else left).append(family)
    why = {}   # each a phrase that starts with the layer's name; surgery's own reasons first (the surprising ones)
    for family in left:
        for name, _ in family[0]:
            why[name] = (kept_summary({name: report.get(plain_names[name], {"kept": {}})}, limit=1)
                         or f"{name}: surgery keeps its channels")
    for p in sorted(blocked):
        name = by_plain.get(p, p)
        why.setdefault(name, f"{name} is coupled to the model's outputs or to a layer that is not Bayesian")
    if why:
        log(f"flops target: {len(why)} layer(s) whose dead units surgery cannot remove are kept whole: "
            f"{'; '.join(list(why.values())[:6])}{' ...' if len(why) > 6 else ''}")
    if whole is not None:
        whole.update(why)
    return ranked


@torch.no_grad()
def plan(model, target_flops, families, plain=None, plain_names=None, counter=None):
    """{layer name: kept mask} within `target_flops` (paper-formula FLOPs), and the FLOPs of that plan.

    Every family keeps the same share k of its groups, its most important ones (at least one), as
    Torch-Pruning's default per-layer ratio does: a global ranking across layers emptied the cheapest layers
    first and left units of one (a home-made CNN fell to chance at a 25% target). A group's importance is
    the sum of its units' importance, each over its layer's mean. k is the largest share within the target,
    by bisection (FLOPs fall as k falls); then each family takes one group more where that still fits.
    `counter` (a GroupFlops) counts the trial masks; the plan found is counted by masked_flops again, and
    planned with masked_flops alone where the two differ."""
    if plain is None:
        plain, plain_names = _dense_sample(model)

    def exact(keep):
        return masked_flops(model, keep, plain_names, plain)
    if counter is not None:
        keep, flops = _plan(model, target_flops, families, counter.count)
        if flops == exact(keep):
            return keep, flops
    return _plan(model, target_flops, families, exact)


def _plan(model, target_flops, families, count):
    """plan, with `count(keep)` the FLOPs of masks {layer name: kept mask}."""
    layers = dict(prunable_layers(model))
    scores = {}
    for name, layer in layers.items():
        s = importance(layer)
        scores[name] = s / s.mean().clamp_min(1e-12)
    order = [sorted(f, key=lambda g: -sum(float(scores[n][u]) for n, u in g)) for f in families]
    # Each family's units best group first, as indices into the masks laid end to end, and where each group ends
    sizes = [layers[n].out_units for n in layers]
    offsets = dict(zip(layers, itertools.accumulate([0] + sizes)))
    units = [torch.tensor([offsets[n] + u for g in best_first for n, u in g], dtype=torch.long) for best_first in order]
    ends = [[0] + list(itertools.accumulate(len(g) for g in best_first)) for best_first in order]

    def keep_at(k):
        flat = torch.ones(sum(sizes), dtype=torch.bool)
        for best_first, family_units, family_ends in zip(order, units, ends):
            flat[family_units[family_ends[max(1, math.ceil(k * len(best_first)))]:]] = False
        return dict(zip(layers, flat.split(sizes)))

    flops = count(keep_at(1.0))
    if flops <= target_flops:
        return keep_at(1.0), flops
    lo_flops = count(keep_at(0.0))
    if lo_flops > target_flops:
        return keep_at(0.0), lo_flops   # the closest the ranked families can reach
    lo, hi, best = 0.0, 1.0, lo_flops   # invariant: flops(lo) <= target < flops(hi)
    for _ in range(14):   # k to within 1e-4: below one group of any family here
        mid = (lo + hi) / 2
        f = count(keep_at(mid))
        if f <= target_flops:
            lo, best = mid, f
        else:
            hi = mid
    # One group more in each family where it still fits: a family of 16 channels moves in steps of 1/16
    keep = keep_at(lo)
    for best_first in order:
        kept = max(1, math.ceil(lo * len(best_first)))
        if kept < len(best_first):
            trial = {n: m.clone() for n, m in keep.items()}
            for name, unit in best_first[kept]:
                trial[name][unit] = True
            f = count(trial)
            if f <= target_flops:
                keep, best = trial, f
    return keep, best


@torch.no_grad()
def nested_width_within(model, target, channel_multiple=1):
    """(width, FLOPs ratio): the widest width of a nested net (train/nested.py) whose network after surgery has
    at most `target` of the dense network's paper-formula FLOPs, found by bisection (the FLOPs grow with the
    width; structure alone: no weights, no data). ConfigError if even the narrowest width has more.
    `channel_multiple`: surgery rounds each convolution's width up to it (train.flops_channel_multiple)."""
    base = model._build_plain()
    dense = paper_flops(base, model.input_shape)
    plain_names = {name: name for name in model.kept_units(model.groups)}   # kept_units names plain layers

    reports = {}   # width -> surgery's report: what the message names when even the narrowest is too large

    @functools.cache   # each width's surgery once: the bisection and the message read a width again
    def ratio(width):
        reports[width] = {}
        flops = physical_flops(model, model.kept_units(width), plain_names, base, reports[width],
                               channel_multiple=channel_multiple)
        if flops is None:
            raise SurgeryError(f"surgery cannot remove the channels of width {width} of this nested network")
        return flops / dense

    low, high = model.configured_fixed_groups + 1, model.groups - 1   # the widest leaves one group to order
    if low > high:   # a traceback from serve_from (probe)
        raise ConfigError(f"train.flops_target: nested.fixed_groups {model.configured_fixed_groups} of "
                          f"{model.groups} groups leaves no width narrower than the full one to train to it; "
                          f"nested.fixed_groups {model.groups - 2} or less, or no train.flops_target")
    if ratio(low) > target:
        why = kept_summary(reports[low])
        raise ConfigError(f"train.flops_target: {target:g} of the dense FLOPs cannot be reached by this nested "
                          f"network: its narrowest width ({low} of {model.groups} groups, nested.fixed_groups + 1) "
                          f"has {ratio(low):.3g} of them after surgery{f' ({why})' if why else ''}; set "
                          f"train.flops_target to {math.ceil(ratio(low) * 100) / 100:g} or more, or lower "
                          f"nested.fixed_groups")
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if ratio(middle) <= target else (low, middle - 1)
    return low, ratio(low)


class FlopsTargetSchedule:
    """The trainer's hook (train/trainer.py): `step(model, step)` before each optimisation step, `finish` after
    the last epoch.

    With `evaluate` (the trainer's validation accuracy of a model; process 0 only), the network is validated
    before the first step and each cut once it has been fine-tuned until the next cut (the last one: after the
    last epoch): `trajectory` lists {"step" of the cut, "flops_ratio" after it, "val_accuracy"}, the trainer
    keeps it in its history (a resumed run goes on with it), and `finish` sets the fine-tuned network's
    accuracy against train.max_accuracy_drop: a target that costs more gets one message naming the smallest
    cut within the floor. A cut's accuracy is after fewer steps than the whole fine-tuning gives a target: a
    lower bound of what a run with its FLOPs as the target reaches."""

    def __init__(self, model, train_cfg, total_steps, log=print, evaluate=None, points=()):
        layers = prunable_layers(model)
        if not layers:
            raise ConfigError("train.flops_target: the network has no prunable spike-and-slab layer: every layer "
                              "that became the family's produces the outputs (or feeds them alone), and the others "
                              "stay plain, so no unit can be switched off; leave the target out")
        self.target, self.log = float(train_cfg.flops_target), log
        self.fraction, self.total_steps = float(train_cfg.flops_schedule_fraction), total_steps
        self.channel_multiple = train_cfg.flops_channel_multiple
        self.on_logit = math.log(SURE / (1 - SURE))
        self.off_logit = -self.on_logit   # gamma = 1 - SURE
        end = max(1, math.ceil(self.fraction * total_steps))
        self.points = sorted({min(end, math.ceil(end * (i + 1) / POINTS)) for i in range(POINTS)})
        self.reached = None
        self.max_drop, self.evaluate = train_cfg.max_accuracy_drop, evaluate
        # {"step", "flops_ratio", "val_accuracy"}; a resumed run's. Process 0's only (it validates): a pending
        # point resumed in another DDP process called its evaluate of None (probe)
        self.trajectory = [dict(p) for p in points] if evaluate is not None else []
        self._measure(model)

    def _measure(self, model):
        """The families of units and the dense FLOPs (surgery on a sample: seconds), and a ConfigError before the
        first step when the smallest network the families allow is above the target: cutting to it would
        leave one group of every family (a 1-D net whose Conv1d layers hold 98% of the FLOPs lost its whole
        classifier for a 1.5% saving, at chance accuracy) and still miss the target."""
        snapshot = copy.deepcopy(model).cpu().eval()
        with torch.random.fork_rng(devices=[]):   # plain twins initialise from the global generator
            whole = {}
            self.families = channel_families(snapshot, log=self.log, whole=whole)
            plain, plain_names = _dense_sample(snapshot)
            self.dense_flops = paper_flops(plain, snapshot.input_shape)
            self.counter = GroupFlops.build(snapshot, self.families, plain, plain_names)
            _, smallest = plan(snapshot, 0.0, self.families, plain, plain_names, self.counter)
        smallest /= self.dense_flops
        if smallest > self.target * (1 + TOLERANCE):
            names = [n for m in model.modules() for n in getattr(m, "plain_layers", [])]
            plain = (f"; {len(names)} layer(s) without a Bayesian twin stay whole: {', '.join(names[:4])}"
                     f"{' ...' if len(names) > 4 else ''}" if names else "")
            cut = f": {'; '.join(list(whole.values())[:3])}{' ...' if len(whole) > 3 else ''}" if whole else ""
            raise ConfigError(f"train.flops_target: {self.target:g} of the dense FLOPs cannot be reached on this "
                              f"network: the smallest it allows is {smallest:.3g} (one group of units left in each "
                              f"family, the layers surgery cannot cut whole{cut}{plain}); "
                              + (f"set train.flops_target to {math.ceil(smallest * 100) / 100:g} or more"
                                 if smallest < 0.995 else "nothing of it can be cut: leave train.flops_target out"))

    def step(self, model, step):
        if step == 0:   # a fresh run (a resumed one starts later): every unit kept for sure (docstring)
            for _, layer in prunable_layers(model):
                layer.gamma_logit.data.clamp_(min=self.on_logit)
            if self.evaluate is not None:   # the network the fine-tuning starts from
                self.trajectory.append({"step": 0, "flops_ratio": 1.0, "val_accuracy": self._validate(model)})
        if step + 1 not in self.points:
            return
        pending = self.trajectory and self.trajectory[-1]["val_accuracy"] is None
        if pending:   # the last cut, fine-tuned until now
            self.trajectory[-1]["val_accuracy"] = self._validate(model)
        # Building plain twins initialises layers from the global generator: fork it, so that the training noise
        # is the same whether or not this process measured the families first (a resumed run must end where an
        # uninterrupted one does)
        with torch.random.fork_rng(devices=[]):
            self._switch_off_to_schedule(model, step)
        if self.evaluate is not None and (not self.trajectory or self.reached < self.trajectory[-1]["flops_ratio"]):
            self.trajectory.append({"step": step + 1, "flops_ratio": float(self.reached), "val_accuracy": None})
        elif pending:   # nothing more was cut: the same point trains on, validated again later
            self.trajectory[-1]["val_accuracy"] = None

    def _validate(self, model):
        training = model.training
        # The trainer's validation draws from its own seeded generator, but counting kept units builds a plain
        # twin, whose layers initialise from the global one: forked, so that validating changes no training noise
        with torch.random.fork_rng(devices=[]):
            accuracy = self.evaluate(model)
        model.train(training)
        return float(accuracy)

    def finish(self, val_accuracy):
        """After the last epoch, with its validation accuracy: the curve's log line, and the message when the
        fine-tuning lost more than train.max_accuracy_drop against the network it started from, naming the
        closest point within the floor (None else). Returns (curve or None, verdict or None)."""
        if not self.trajectory or self.trajectory[0]["step"] != 0:
            return None, None
        if self.trajectory[-1]["val_accuracy"] is None:
            self.trajectory[-1]["val_accuracy"] = float(val_accuracy)   # the last cut: the fine-tuned network
        curve = ("flops target: validation accuracy of each cut, fine-tuned until the next one (FLOPs ratio: "
                 "accuracy): " + ", ".join(f"{p['flops_ratio']:.2f}: {p['val_accuracy']:.3f}" for p in self.trajectory)
                 + " (the first before fine-tuning, the last after it)")
        start = self.trajectory[0]["val_accuracy"]
        floor = None if self.max_drop is None else start - self.max_drop
        if floor is None or val_accuracy >= floor:
            return curve, None
        cost = (f"flops target: {self.target:g} of the dense FLOPs costs {100 * (start - val_accuracy):.1f} points "
                f"of validation accuracy ({start:.4f} before fine-tuning, {val_accuracy:.4f} after), more than "
                f"train.max_accuracy_drop {self.max_drop:g}")
        within = [p for p in self.trajectory[1:] if p["val_accuracy"] >= floor]
        if not within:
            return curve, cost + "; no cut of the schedule stayed within it: fine-tune for more epochs or allow a larger drop"
        best = min(within, key=lambda p: p["flops_ratio"])
        return curve, (cost + f"; the smallest cut within it: {best['flops_ratio']:.3f} of the FLOPs, at validation "
                       f"accuracy {best['val_accuracy']:.4f} after {best['step']} steps and fine-tuned until the next "
                       f"cut: set train.flops_target to {best['flops_ratio']:.2f}, or fine-tune for more epochs")

    def _within_after_surgery(self, snapshot, keep, flops, goal, plain, plain_names):
        """The last cut, counted on the network surgery makes of it, and aimed lower while that is above `goal`.

        The plan counts FLOPs on the masks, and surgery removes what they switch off, except where it must keep
        a unit: a grouped convolution keeps its groups of equal size, each as large as the one with the most
        live channels, so an unbalanced cut of its inputs or outputs removes less than the masks say (a user's
        net with a 4-group convolution, cut to 0.39 on the masks, was 0.71 after surgery). Returns (keep, FLOPs
        after surgery: what the deployed network costs); the masks' count where surgery cannot run. With
        train.flops_channel_multiple, surgery rounds each pruned convolution's width up as for that runtime's
        channel block (a `device` target's: the device's), so the network shipped there is within the target;
        counted without it, a device target of 0.18 shipped 0.235 and failed the budget it came from (probe).
        Re-aimed by bisection below the target, from a first guess that FLOPs after surgery fall as the masks'
        do: a channel block makes them fall in steps (8 channels kept as 4 or 8), where that guess alone stalled
        above the target while a lower aim fitted. Where no aim fits, the closest network found."""
        block = self.channel_multiple
        physical = physical_flops(snapshot, keep, plain_names, plain, channel_multiple=block)
        if physical is None or physical <= goal * (1 + TOLERANCE):
            return keep, flops if physical is None else physical
        fits, closest, low, high = None, (keep, physical), 0.0, goal
        aim = goal * goal / physical
        for _ in range(SURGERY_TRIES):
            tried, _ = plan(snapshot, aim, self.families, plain, plain_names, self.counter)
            physical = physical_flops(snapshot, tried, plain_names, plain, channel_multiple=block)
            if physical is None:
                break
            if physical <= goal * (1 + TOLERANCE):
                low = aim
                fits = (tried, physical) if fits is None or physical > fits[1] else fits
            else:
                high = aim
                closest = (tried, physical) if physical < closest[1] else closest
            aim = (low + high) / 2
        return fits or closest

    def _switch_off_to_schedule(self, model, step):
        # A CPU copy to count on: its samples draw from their own generator, not the training noise's stream
        snapshot = copy.deepcopy(model).cpu().eval()
        rate = pruning_schedule(step + 1, self.total_steps, 1.0, self.target, self.fraction)
        plain, plain_names = _dense_sample(snapshot)
        keep, flops = plan(snapshot, rate * self.dense_flops, self.families, plain, plain_names, self.counter)
        if step + 1 == self.points[-1]:
            keep, flops = self._within_after_surgery(snapshot, keep, flops, rate * self.dense_flops, plain, plain_names)
        # The median model becomes the plan: what it leaves out goes off, and what it keeps that is off (an earlier
        # point's cut the plan takes back, docstring) comes back on, so that the FLOPs counted are the network's
        layers = dict(prunable_layers(model))
        for name, mask in keep.items():
            logit, mask = layers[name].gamma_logit.data, mask.to(layers[name].gamma_logit.device)
            logit[~mask & (logit > self.off_logit)] = self.off_logit
            logit[mask & (logit <= 0)] = self.on_logit
        self.reached = flops / self.dense_flops
        if step + 1 == self.points[-1]:
            self.log(f"flops target: {self.reached:.3f} of the dense FLOPs after {step + 1} steps "
                     f"(target {self.target:g})")
            if self.reached > self.target * (1 + TOLERANCE):   # after surgery: on the masks it was within
                self.log(f"flops target: {self.target:g} cannot be reached: the closest is {self.reached:.3g} "
                         f"after surgery")
