"""Compress the network a user already has (issue 33): a trained plain network fine-tuned for E epochs by
edgebayes into a smaller Bayesian one, against Torch-Pruning's pruners at the same physical FLOPs.

Per net and seed:
  1. dense     the net trained here as a plain network (Adam 1e-3, batch 128, --dense-epochs): the reference
               accuracy, ECE, NLL. Every method below starts from a copy of THESE trained weights.
  2. edgebayes bayesianize(trained, family) + fit(E epochs, flops_target=target; bn3: one training per target,
               as every other method, serving the widths from the target's to full) + compress(M samples)
               -> surgery; MC-averaged test metrics, FLOPs of the network after surgery (edgebayes_row: the one
               function the recipe lives in).
  3. tp-*      Torch-Pruning on a copy of the trained net, pruned to the physical FLOPs of the edgebayes rows
               of the same target that reached it (the target itself if none did; tp_flops_wanted), then
               fine-tuned with the same optimizer, schedule, batch and E epochs. The two pruners as Torch-Pruning's own
               benchmarks define them (benchmarks/main.py there): "l1" = BasePruner + MagnitudeImportance(p=1)
               and "group_norm" = GroupNormPruner + GroupMagnitudeImportance(p=2), one-shot, layer-wise
               (global_pruning=False), without the sparsity-learning pass ("group_sl"): training beyond the
               shared budget. Where Torch-Pruning breaks a net (own_models.Custom: a concatenation read by
               flatten -> Linear), it prunes again with the layers it breaks on kept whole, as its user would
               (tp_unprunable), and the row names them.
  dense-ft     the dense net trained the same E more epochs, uncompressed: how much of a row's change is the
               extra training (the issue's criteria compare with the dense row).
Fine-tuning, every method alike: Adam LR, batch BATCH, E = 5 epochs (the issue's largest budget), the last at a
tenth of the rate (fine_tune_milestones; edgebayes: train.lr_milestones [E - 1]; --no-decay-last-epoch keeps it
constant). Chosen on validation accuracy, edgebayes SS-GL, seed 0: at a constant rate the network after the last
epoch is a draw from a trajectory that still swings by points (resnet18 at 0.5 of its FLOPs, 3 epochs, seeds
0/1/2, validation accuracy by epoch 0.933/0.936/0.930, 0.932/0.919/0.954, 0.903/0.938/0.961; at 5 epochs its last
0.894), and the decayed last epoch settles it (5 epochs, constant -> decayed: resnet18 at 0.5 0.894 -> 0.973,
mobilenet_v2 at 0.25 0.913 -> 0.914, efficientnet_b0 at 0.25 0.772 -> 0.761; mean 0.860 -> 0.883). With 3 epochs
the decay cost the networks that need their full-rate steps to repair the cuts (mobilenet_v2 at 0.25: 84 -> 80);
with 5 it costs them about a point at most.
FLOPs: paper 000's formula (compressed/structure.py paper_flops) on the network after surgery / pruning,
relative to the dense net; the ratio of one sample (the MC model runs M of them).

    python benchmarks/finetune_compress.py                                  # everything (hours on a CPU)
    python benchmarks/finetune_compress.py --nets small-cnn --quick --out /tmp/q   # seconds: the code path

Results: benchmarks/results/finetune_compress.{json,md,png} (machine, commit and versions in the JSON),
written after every row; --resume keeps the rows of an earlier run with the same settings.
"""

import argparse
import copy
import functools
import hashlib
import json
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from edgebayes.compressed.samples import MCAverage, fit_temperature, predict
from edgebayes.compressed.structure import count_weights, paper_flops, structure_report
from edgebayes.config import DataConfig
from edgebayes.data import DataError, load_data
from edgebayes.provenance import ROOT, atomic_path, atomic_torch_save, load_checkpoint, provenance, read_json, result_path
from edgebayes.train.metrics import classification_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from own_models import Custom  # noqa: E402  (the home-made net of the own-models benchmark)

RESULTS = Path(__file__).resolve().parent / "results"
SHAPE = (3, 32, 32)
BATCH, LR = 128, 1e-3                     # one optimizer for the dense net, edgebayes and Torch-Pruning
FINE_TUNE_GAMMA = 0.1                     # the fine-tuning's last epoch at LR times this (fine_tune_milestones)
EDGEBAYES = {"edgebayes-ss-gl": "ss-gl", "edgebayes-ss-ghs": "ss-ghs", "edgebayes-bn3": "bn3"}
TORCH_PRUNING = ("tp-magnitude", "tp-group-norm")
NETS = ("resnet18", "mobilenet_v2", "efficientnet_b0", "custom", "small-cnn")
# What a run does where its command leaves --nets, --methods, --targets or --seeds out
DEFAULTS = {"nets": ["resnet18", "mobilenet_v2", "efficientnet_b0", "custom"],
            "methods": ["dense-ft", *EDGEBAYES, *TORCH_PRUNING], "targets": [0.5, 0.25], "seeds": [0]}
TP_TOLERANCE = 0.01                       # |FLOPs ratio / wanted - 1| the TP bisection stops at
# The issue's criteria (Done when): within 1 point of dense, at least TP's best - 0.3 points, ECE below both.
DENSE_GAP, TP_GAP = 0.01, 0.003
# 10 dense epochs: from scratch on 4,000 MNIST images at 32x32 (Adam 1e-3, batch 128), efficientnet_b0 is at 79% test
# accuracy after 3 epochs and 94% after 6, mobilenet_v2 at 87% after 3: a reference still climbing would credit the
# fine-tuning's extra epochs to compression (the dense-ft row shows what is left of that).
FULL = {"train_size": 4000, "val_size": 1000, "test_size": 2000, "dense_epochs": 10, "epochs": 5, "mc": 4}
QUICK = {"train_size": 256, "val_size": 64, "test_size": 128, "dense_epochs": 1, "epochs": 1, "mc": 2}


class SmallCNN(nn.Module):
    """A small home-made CNN that Torch-Pruning can prune (the quick path's net): conv-BN stem, a residual
    block, a depthwise-separable block, global average pooling, Linear."""

    def __init__(self, num_classes=10, width=32):
        super().__init__()
        w = width
        self.stem = nn.Sequential(nn.Conv2d(3, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU())
        self.res = nn.Sequential(nn.Conv2d(w, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU(),
                                 nn.Conv2d(w, w, 3, padding=1, bias=False), nn.BatchNorm2d(w))
        self.dw = nn.Sequential(nn.Conv2d(w, w, 3, stride=2, padding=1, groups=w, bias=False), nn.BatchNorm2d(w),
                                nn.ReLU(), nn.Conv2d(w, 2 * w, 1, bias=False), nn.BatchNorm2d(2 * w), nn.ReLU())
        self.fc = nn.Linear(2 * w, num_classes)

    def forward(self, x):
        h = self.stem(x)
        h = F.relu(self.res(h) + h)
        return self.fc(F.adaptive_avg_pool2d(self.dw(h), 1).flatten(1))


def make_net(name, classes=10):
    if name == "custom":
        return Custom(classes)
    if name == "small-cnn":
        return SmallCNN(classes)
    import torchvision

    return getattr(torchvision.models, name)(weights=None, num_classes=classes)


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------
def load_images(dataset, root, sizes, seed=0):
    """{train, val, test: (x, y)} at 3x32x32: edgebayes' own loader (data.py reads MNIST's .gz files where
    torchvision insists on extracted ones), then seeded subsets, bilinear to 32x32, gray to 3 channels.
    Train and validation come from the training set (load_data carves validation out with `seed`), test from
    the test set (MNIST's own; digits: carved out too)."""
    splits = load_data(DataConfig(dataset=dataset, root=root), seed)
    test = torch.randperm(len(splits.test_x), generator=torch.Generator().manual_seed(seed))[: sizes["test_size"]]

    def resized(x):
        x = F.interpolate(x, size=SHAPE[1:], mode="bilinear", align_corners=False)
        return x.repeat(1, SHAPE[0] // x.shape[1], 1, 1)

    return {"train": (resized(splits.train_x[: sizes["train_size"]]), splits.train_y[: sizes["train_size"]]),
            "val": (resized(splits.val_x[: sizes["val_size"]]), splits.val_y[: sizes["val_size"]]),
            "test": (resized(splits.test_x[test]), splits.test_y[test]), "classes": len(splits.classes)}


# ---------------------------------------------------------------------------------------------
# Plain training (dense reference and Torch-Pruning's fine-tuning: the same loop)
# ---------------------------------------------------------------------------------------------
def fine_tune_milestones(epochs, decay):
    """The fine-tuning's learning-rate milestones, every method alike: with --decay-last-epoch the last epoch at
    FINE_TUNE_GAMMA times the rate (edgebayes: train.lr_milestones, lr_gamma), else none (module docstring)."""
    return [epochs - 1] if decay and epochs > 1 else []


def train_plain(model, x, y, epochs, seed, device, milestones=(), batch=BATCH):
    """Adam (LR), batch `batch`, cross-entropy, the rate times FINE_TUNE_GAMMA at each of `milestones` (epochs);
    a last batch of one example is skipped (batch norm needs two)."""
    model.to(device).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    schedule = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=list(milestones), gamma=FINE_TUNE_GAMMA)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=generator)
        for i in range(0, len(x), batch):
            idx = perm[i: i + batch]
            if len(idx) < 2:
                continue
            loss = F.cross_entropy(model(x[idx].to(device)), y[idx].to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        schedule.step()
    return model.cpu().eval()


def metrics_of(probs, y):
    m = classification_metrics(probs.numpy(), y.numpy())
    return {"accuracy": m["accuracy"], "ece": m["ece"], "nll": m["nll"]}


def tempered_metrics(samples, data, shipped):
    """Test metrics of the MC average of `samples` at T = 1 (`*_raw`) and at the temperature fitted on the
    validation split (`*_ts`, fit_temperature, what edgebayes ships with select.temperature_scaling), and
    accuracy / ece / nll of the one the method ships: `shipped` "ts" (edgebayes) or "raw" (a plain network
    as the user has it; its `_ts` figures say what temperature scaling would give it too)."""
    t = fit_temperature(samples, *data["val"])
    row = {"temperature": t}
    for name, temperature in (("raw", 1.0), ("ts", t)):
        m = metrics_of(predict(MCAverage(samples, temperature), data["test"][0]), data["test"][1])
        row.update({f"{k}_{name}": v for k, v in m.items()})
    return {**row, **{k: row[f"{k}_{shipped}"] for k in ("accuracy", "ece", "nll")}}


def plain_metrics(model, data):
    return tempered_metrics([model.eval()], data, "raw")


# ---------------------------------------------------------------------------------------------
# edgebayes: the recipe a user runs on their trained network
# ---------------------------------------------------------------------------------------------
def edgebayes_row(trained, family, target, data, epochs, m, seed, device, log=print, milestones=(), batch=BATCH):
    """bayesianize a copy of the trained net, fit E epochs toward the FLOPs target, compress M samples.
    `batch` None: train.batch_size left out, as a user's config may (the trainer picks it; the row's `batch`)."""
    import edgebayes as eb
    from edgebayes.train.nested import NESTED_FAMILIES

    x, y = data["train"]
    nested = family in NESTED_FAMILIES
    torch.manual_seed(seed)
    net = eb.bayesianize(copy.deepcopy(trained), family, input_shape=SHAPE, n_train=len(x),
                         calibration_x=x if nested else None)
    train = {"batch_size": batch, "lr": LR, "device": device, "lr_milestones": list(milestones),
             "lr_gamma": FINE_TUNE_GAMMA, "flops_target": target}
    t0 = time.perf_counter()
    history = eb.fit(net, x, y, val=data["val"], epochs=epochs, seed=seed, log=log, **train)
    seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    # the family's default, as eb.compress(net) takes it: the inclusion threshold 0.5; for bn3 fit to the target,
    # the widest width within it (NestedNet.serve_from, found by FLOPs alone; this script computed it itself
    # before a0d860a made it the default)
    knob = net.default_knob
    c = eb.compress(net, knob=knob, m=m, seed=seed)
    s = structure_report(c.dense_sample, c.samples[0], c.kept, SHAPE)
    dense_flops = s["dense_flops"]
    row = {"fine_tune_seconds": seconds, "mc_samples": m, "knob": knob,
           "batch": history[0].get("batch_size", batch) if history else batch,
           "flops_ratio_physical": s["physical_flops_ratio"], "params_ratio": s["physical_compression_ratio"],
           "flops_ratio_masks": s["flops_ratio"],
           "flops_ratio_physical_samples": [paper_flops(p, SHAPE) / dense_flops for p in c.samples],
           "val_accuracy": history[-1].get("val_accuracy") if history else None}
    row.update(tempered_metrics(c.samples, data, "ts"))   # as the pipeline ships it: c.calibrate(*data["val"])
    row["compress_seconds"] = time.perf_counter() - t0
    return row


# ---------------------------------------------------------------------------------------------
# Torch-Pruning
# ---------------------------------------------------------------------------------------------
def tp_prune(trained, method, ratio, classes, ignored=()):
    """A copy of the trained net pruned one-shot at `ratio` of every layer's channels (the classifier and the
    layers named in `ignored` kept)."""
    import torch_pruning as tp

    model = copy.deepcopy(trained).eval()
    if method == "tp-magnitude":
        pruner, importance = tp.pruner.BasePruner, tp.importance.MagnitudeImportance(p=1)
    else:
        pruner, importance = tp.pruner.GroupNormPruner, tp.importance.GroupMagnitudeImportance(p=2)
    kept = tp_classifiers(model, classes) + [model.get_submodule(name) for name in ignored]
    example = torch.randn((1,) + SHAPE)
    pruner(model, example, importance=importance, pruning_ratio=ratio, ignored_layers=kept).step()
    try:
        with torch.no_grad():
            model(example)
    except RuntimeError as e:   # seen on a concatenation read by a flatten -> Linear (own_models.Custom)
        first = str(e).strip().splitlines()[0]
        raise RuntimeError(f"Torch-Pruning ({method}, ratio {ratio:.3f}) left a network whose forward pass "
                           f"fails: {first}") from None
    return model


def tp_classifiers(model, classes):
    return [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features == classes]


def tp_unprunable(trained, classes):
    """Names of the layers whose channels Torch-Pruning cannot remove without breaking the net, as a user of it
    finds them and passes them as ignored_layers: each pruning group of its dependency graph pruned by two
    channels alone, and the root layer of a group after which the forward pass fails kept whole; repeated,
    since keeping one layer splits the groups it was in. Torch-Pruning 1.6 merges the inputs of a concatenation
    into one group and mis-indexes a flatten -> Linear behind it (its issues #146 and #481): on own_models.Custom
    it finds `side`, one of the two layers the concatenation joins; every other layer is still pruned."""
    import torch_pruning as tp

    example, ignored = torch.randn((1,) + SHAPE), []
    while True:
        model = copy.deepcopy(trained).eval()
        names = {m: n for n, m in model.named_modules()}
        kept = tp_classifiers(model, classes) + [model.get_submodule(n) for n in ignored]
        graph = tp.DependencyGraph().build_dependency(model, example_inputs=example)
        roots = [names[g[0].dep.target.module] for g in graph.get_all_groups(
            ignored_layers=kept, root_module_types=[nn.Conv2d, nn.Linear])]
        broken = []
        for name in roots:
            probe = copy.deepcopy(trained).eval()
            layer = probe.get_submodule(name)
            graph = tp.DependencyGraph().build_dependency(probe, example_inputs=example)
            prune = tp.prune_conv_out_channels if isinstance(layer, nn.Conv2d) else tp.prune_linear_out_channels
            n = layer.out_channels if isinstance(layer, nn.Conv2d) else layer.out_features
            graph.get_pruning_group(layer, prune, idxs=list(range(min(2, n - 1)))).prune()
            try:
                with torch.no_grad():
                    probe(example)
            except RuntimeError:
                broken.append(name)
        if not broken:
            return ignored
        ignored += broken


def tp_match_flops(trained, method, wanted, classes, iterations=30, ignored=()):
    """Bisection on the pruning ratio until paper_flops(pruned) / paper_flops(dense) is within TP_TOLERANCE
    of `wanted` (relative); the closest one found when channel granularity does not allow it.
    Returns (model, flops ratio, pruning ratio)."""
    dense = paper_flops(trained, SHAPE)
    lo, hi, best = 0.0, 0.99, (copy.deepcopy(trained).eval(), 1.0, 0.0)   # ratio 0: nothing pruned
    for _ in range(iterations):
        if abs(best[1] / wanted - 1) <= TP_TOLERANCE:
            break
        ratio = (lo + hi) / 2
        model = tp_prune(trained, method, ratio, classes, ignored)
        flops = paper_flops(model, SHAPE) / dense
        if abs(flops - wanted) < abs(best[1] - wanted):
            best = (model, flops, ratio)
        lo, hi = (ratio, hi) if flops > wanted else (lo, ratio)
    return best


def tp_flops_wanted(rows, net, seed, target):
    """(FLOPs ratio, what it is) Torch-Pruning prunes to: the physical FLOPs of the edgebayes rows of this
    target that reached it (the largest, so that Torch-Pruning is never given less than edgebayes), else the
    target itself: the comparison stays at about the target when an edgebayes row misses it."""
    reached = [(r["flops_ratio_physical"], r["method"]) for r in rows if r["net"] == net and r["seed"] == seed and
               r["target"] == target and r["method"] in EDGEBAYES and "error" not in r and
               r["flops_ratio_physical"] <= target * (1 + TP_TOLERANCE)]
    return max(reached) if reached else (target, "target")


def tp_row(trained, method, wanted, data, epochs, seed, device, milestones=(), batch=BATCH):
    """Torch-Pruning as its user runs it: plain, and where it breaks the net, again with the layers it breaks on
    kept whole (tp_unprunable; the row's `tp_ignored_layers`)."""
    t0, ignored = time.perf_counter(), []
    try:
        model, flops, ratio = tp_match_flops(trained, method, wanted, data["classes"])
    except RuntimeError:
        ignored = tp_unprunable(trained, data["classes"])
        if not ignored:
            raise
        model, flops, ratio = tp_match_flops(trained, method, wanted, data["classes"], ignored=ignored)
    row = {"pruning_ratio": ratio, "flops_ratio_physical": flops, "flops_ratio_wanted": wanted,
           "tp_ignored_layers": ignored,
           "params_ratio": count_weights(model) / count_weights(trained),
           "prune_seconds": time.perf_counter() - t0,
           "pruned_accuracy": metrics_of(predict(MCAverage([model.eval()]), data["test"][0]),
                                         data["test"][1])["accuracy"]}   # before fine-tuning
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    train_plain(model, *data["train"], epochs, seed, device, milestones, batch)
    row["fine_tune_seconds"] = time.perf_counter() - t0
    row.update(plain_metrics(model, data))
    return row


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------
# The settings the trained dense net depends on (its cache key): the fine-tuning's are not among them
DENSE_SETTINGS = ("data", "train_size", "val_size", "test_size", "data_seed", "dense_epochs")


def settings_of(args):
    """What makes two runs' rows comparable (--resume keeps rows only under the same settings)."""
    settings = {k: getattr(args, k) for k in DENSE_SETTINGS + ("epochs", "mc")}
    milestones = fine_tune_milestones(args.epochs, getattr(args, "decay_last_epoch", False))
    return {**settings, "fine_tune_lr": f"x{FINE_TUNE_GAMMA:g} at epochs {milestones}"} if milestones else settings


def dense_model(net_name, seed, data, args, device, cache):
    """The trained plain net of (net, seed): from the cache folder where an earlier run with the same settings,
    optimizer and architecture (every tensor's name and shape) left it."""
    torch.manual_seed(seed)
    model = make_net(net_name, data["classes"])
    shapes = [(name, list(t.shape)) for name, t in model.state_dict().items()]
    key = json.dumps({**{k: getattr(args, k) for k in DENSE_SETTINGS}, "net": net_name, "seed": seed,
                      "batch": BATCH, "lr": LR,
                      "torch": torch.__version__, "shapes": shapes}, sort_keys=True)
    path = cache / f"{net_name}-seed{seed}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.pt"
    if path.is_file():
        model.load_state_dict(load_checkpoint(path))
        return model.eval(), None
    t0 = time.perf_counter()
    train_plain(model, *data["train"], args.dense_epochs, seed, device)
    seconds = time.perf_counter() - t0
    cache.mkdir(parents=True, exist_ok=True)
    atomic_torch_save(model.state_dict(), path)
    return model, seconds


def ran_on_label(prov, device):
    """Where a row ran, in a few words: the accelerator or the CPU, and the torch that ran it."""
    torch_version = prov.get("versions", {}).get("torch", "?")
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(torch.device(device))} GPU, torch {torch_version}"
    machine = prov.get("machine", {})
    return f"{machine.get('machine', '?')} CPU, {machine.get('cpu_count', '?')} cores, torch {torch_version}"


def run(args, data, out, rows):
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    done = {(r["net"], r["method"], r["target"], r["seed"]) for r in rows if "error" not in r}
    rows[:] = [r for r in rows if "error" not in r]   # failures are tried again
    eb_methods = [m for m in args.methods if m in EDGEBAYES]
    milestones = fine_tune_milestones(args.epochs, args.decay_last_epoch)
    tp_methods = [m for m in args.methods if m in TORCH_PRUNING]

    prov = provenance("finetune_compress")   # each row says which code made it and where it ran (--merge)
    commit, ran_on = prov.get("git_commit"), ran_on_label(prov, device)

    def add(row):
        row = {**row, "git_commit": commit, "ran_on": ran_on}
        rows[:] = [r for r in rows if (r["net"], r["method"], r["target"], r["seed"]) !=
                   (row["net"], row["method"], row["target"], row["seed"])] + [row]
        print(json.dumps({k: v for k, v in row.items() if k != "flops_ratio_physical_samples"}), flush=True)
        write_results(args, rows, out)

    for net_name in args.nets:
        for seed in args.seeds:
            wanted = [(m, t) for t in args.targets for m in eb_methods + tp_methods] + [("dense", None)]
            wanted += [("dense-ft", None)] if "dense-ft" in args.methods else []
            if all((net_name, m, t, seed) in done for m, t in wanted):
                continue
            trained, seconds = dense_model(net_name, seed, data, args, device, Path(args.cache))
            dense = plain_metrics(trained, data)
            base = {"net": net_name, "seed": seed, "dense_accuracy": dense["accuracy"], "dense_ece": dense["ece"],
                    "dense_nll": dense["nll"], "dense_ece_ts": dense["ece_ts"]}
            add({**base, "method": "dense", "target": None, "fine_tune_epochs": 0, "dense_epochs": args.dense_epochs,
                 "train_seconds": seconds, "flops_ratio_physical": 1.0, "params_ratio": 1.0, **dense,
                 "dense_flops": paper_flops(trained, SHAPE), "dense_params": count_weights(trained)})
            if "dense-ft" in args.methods and (net_name, "dense-ft", None, seed) not in done:
                # the same E more epochs without compression: how much of a row's change is the extra training
                model, t0 = copy.deepcopy(trained), time.perf_counter()
                torch.manual_seed(seed)
                train_plain(model, *data["train"], args.epochs, seed, device, milestones)
                add({**base, "method": "dense-ft", "target": None, "fine_tune_epochs": args.epochs,
                     "fine_tune_seconds": time.perf_counter() - t0, "flops_ratio_physical": 1.0, "params_ratio": 1.0,
                     **plain_metrics(model, data)})
            for target in args.targets:
                for method in eb_methods + tp_methods:
                    if (net_name, method, target, seed) in done:
                        continue
                    row = {**base, "method": method, "target": target, "fine_tune_epochs": args.epochs}
                    try:
                        if method in EDGEBAYES:
                            log = functools.partial(print, f"{net_name}/{method}:", flush=True)
                            row.update(edgebayes_row(trained, EDGEBAYES[method], target, data, args.epochs, args.mc,
                                                     seed, device, log=log, milestones=milestones))
                        else:
                            wanted, row["matched_to"] = tp_flops_wanted(rows, net_name, seed, target)
                            row.update(tp_row(trained, method, wanted, data, args.epochs, seed, device, milestones))
                    except Exception as e:  # a failure is a result: which method, why
                        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                        row["error"] = f"{type(e).__name__}: {first[:300]}"
                    add(row)
    return rows


# ---------------------------------------------------------------------------------------------
# Results: JSON, Markdown, PNG
# ---------------------------------------------------------------------------------------------
def criteria(row, rows):
    """The issue's Done-when for an edgebayes row: '' when all are met, else what is not."""
    same = [r for r in rows if r["net"] == row["net"] and r["seed"] == row["seed"] and r["target"] == row["target"]
            and r["method"] in TORCH_PRUNING]
    tp = [r for r in same if "error" not in r]
    misses = []
    if row["flops_ratio_physical"] > row["target"]:
        misses.append(f"FLOPs {row['flops_ratio_physical']:.3f} > {row['target']}")
    if row["accuracy"] < row["dense_accuracy"] - DENSE_GAP:
        misses.append(f"{100 * (row['accuracy'] - row['dense_accuracy']):+.2f} pts vs dense")
    if tp:
        best = max(r["accuracy"] for r in tp)
        if row["accuracy"] < best - TP_GAP:
            misses.append(f"{100 * (row['accuracy'] - best):+.2f} pts vs TP best")
    else:
        misses.append("Torch-Pruning failed on this net" if same else "no TP row")
    if not (row["ece"] < row["dense_ece"] and all(row["ece"] < r["ece"] for r in tp)):
        misses.append("ECE not below dense and TP")
    return "; ".join(misses)


def ece_if_all_scaled(row, rows):
    """Whether the row's temperature-scaled ECE is below the dense net's and every Torch-Pruning row's, each
    temperature-scaled as well (tempered_metrics): the issue's ECE criterion, had every method a temperature.
    '—' for rows of a run before select.temperature_scaling."""
    tp = [r for r in rows if r["net"] == row["net"] and r["seed"] == row["seed"] and r["target"] == row["target"]
          and r["method"] in TORCH_PRUNING and "error" not in r]
    if "ece_ts" not in row or "dense_ece_ts" not in row or any("ece_ts" not in r for r in tp):
        return "—"
    worse = (["dense"] if row["ece_ts"] >= row["dense_ece_ts"] else []) + [
        r["method"] for r in tp if row["ece_ts"] >= r["ece_ts"]]
    return "below" if not worse else "not below " + ", ".join(worse)


def _epochs(n):
    return f"{n} epoch" + ("s" if n != 1 else "")


def _pct(v):
    return "—" if v is None else f"{100 * v:.2f}"


def _num(v, spec):
    return "—" if v is None else format(v, spec)


def tempered(row):
    """'ECE at T = 1 / at the fitted T (T)' of a row (tempered_metrics), '—' for rows of an earlier run."""
    if "ece_ts" not in row:
        return "—"
    return f"{row['ece_raw']:.4f} / {row['ece_ts']:.4f} ({row['temperature']:.2f})"


def data_line(args):
    n = args.sizes
    source = ("MNIST (edgebayes.data from --mnist-root)" if args.data == "mnist"
              else "scikit-learn's 8x8 digits")
    return (f"Data: {source}, bilinear to 32x32, gray replicated to 3 channels; a seeded subset (data seed "
            f"{args.data_seed}): {n['train']:,} training and {n['val']:,} validation images, both drawn from the "
            f"training set, {n['test']:,} test images drawn from the test set.")


def markdown(result):
    args, rows = argparse.Namespace(**result["args"]), result["rows"]
    prov = result["provenance"]
    flops_target = ("train.flops_target = the target, one training per target; bn3 then ships the widest width "
                    "within it, chosen by FLOPs alone (bn3 rows of runs before 62380cd trained every width; runs "
                    "before nested.target_width_probability trained once toward the smallest target for both)")
    lines = ["# Compress a trained network: edgebayes fine-tuning against Torch-Pruning at the same physical FLOPs "
             "(benchmarks/finetune_compress.py)", "",
             "Issue 33: each net is trained here as a plain network (the dense row: Adam 1e-3, batch 128, "
             f"{_epochs(args.dense_epochs)}); every other row starts from these trained weights and fine-tunes them "
             f"for the same {_epochs(args.epochs)} (Adam 1e-3, batch 128"
             + (f"; learning rate {result['settings']['fine_tune_lr']}, every method" if "fine_tune_lr" in
                result.get("settings", {}) else "") + "). edgebayes rows: bayesianize -> fit "
             f"({flops_target}) -> compress with "
             f"M = {args.mc} posterior samples -> surgery; accuracy, ECE (15 bins) and NLL of the MC-averaged "
             "prediction as the pipeline ships it, each sample's logits divided by the temperature fitted on the "
             "validation split (select.temperature_scaling; rows of runs before it: at T = 1). The plain rows "
             "(dense, Torch-Pruning) ship at T = 1, as their users have them; the 'ECE at T = 1 / fitted T' column "
             "gives every row's both, and the column after it compares the edgebayes row with the others all at "
             "their fitted T. Torch-Pruning rows: its magnitude (L1, BasePruner) and group-norm (GroupNormPruner, "
             "group L2, no sparsity learning) pruners, one-shot and layer-wise, the classifier kept, pruned to the "
             "physical FLOPs of the edgebayes rows that reached the target (the largest of them), else to the "
             f"target (within {TP_TOLERANCE:.0%} where channels allow), then fine-tuned. FLOPs: paper 000's "
             "formula on the network after surgery / pruning, relative to the dense net (one sample; the MC model "
             "runs M). Params: weights and biases of the Conv / Linear layers, same ratio. Seconds: wall clock on "
             "the machine of the row (ran on), indicative only. dense-ft: the dense net trained the same "
             f"{_epochs(args.epochs)} more, uncompressed (how much of a row's change is the extra training).", "",
             data_line(args), "",
             f"Command: `{result['command']}`", "",
             f"Commit {prov.get('git_commit')}, {prov.get('created_at')}; machine and versions in the JSON.", "",
             *([f"Merged (--merge) from runs at several commits; each row's is in the 'commit' column and the JSON: "
                + "; ".join(f"`{m['command']}` at {str(m['git_commit'])[:7]}" for m in result["merged_from"]), ""]
               if result.get("merged_from") else []),
             *machines_lines(rows),
             "Criteria (the issue's Done when), edgebayes rows: physical FLOPs <= target, accuracy within "
             f"{100 * DENSE_GAP:.0f} point of dense, at least Torch-Pruning's best - {100 * TP_GAP:.1f} points at "
             "that target, ECE below the dense net's and every Torch-Pruning row's. 'met', or what is missed.", ""]
    nets = list(dict.fromkeys(r["net"] for r in rows))
    order = ["dense", "dense-ft"] + list(EDGEBAYES) + list(TORCH_PRUNING)

    def reading_order(r):   # net as first listed, dense rows first, larger targets first, methods as listed
        return nets.index(r["net"]), r["target"] is not None, -(r["target"] or 0), order.index(r["method"])
    for net in nets:
        lines += [f"## {net}", "",
                  "| target | method | seed | FLOPs physical | params | accuracy % | vs dense (pts) | ECE | NLL | "
                  "ECE at T = 1 / fitted T (T) | ECE, all at fitted T: vs dense and TP | "
                  "fine-tune s | criteria | commit | ran on |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        mine = sorted((r for r in rows if r["net"] == net), key=lambda r: (*reading_order(r)[1:3], r["seed"],
                                                                           reading_order(r)[3]))
        for r in mine:
            target = "—" if r["target"] is None else r["target"]
            if "error" in r:
                lines.append("| " + " | ".join([str(target), r["method"], str(r["seed"]), f"failed: {r['error']}"]
                                               + [""] * 9 + [str(r.get("git_commit") or "")[:7],
                                                             machine_key(rows, r)]) + " |")
                continue
            crit = "" if r["method"] not in EDGEBAYES else (criteria(r, rows) or "met")
            if r["method"] in TORCH_PRUNING:
                crit = f"pruned to {r['flops_ratio_wanted']:.3f} ({r['matched_to']}); before fine-tuning " \
                       f"{_pct(r['pruned_accuracy'])}%" + (
                           f"; kept whole (Torch-Pruning breaks the net on them): {', '.join(r['tp_ignored_layers'])}"
                           if r.get("tp_ignored_layers") else "")
            delta = "" if r["method"] == "dense" else f"{100 * (r['accuracy'] - r['dense_accuracy']):+.2f}"
            lines.append(f"| {target} | {r['method']} | {r['seed']} | {r['flops_ratio_physical']:.3f} | "
                         f"{r['params_ratio']:.3f} | {_pct(r['accuracy'])} | {delta} | {r['ece']:.4f} | "
                         f"{r['nll']:.4f} | {tempered(r)} | "
                         f"{ece_if_all_scaled(r, rows) if r['method'] in EDGEBAYES else ''} | "
                         f"{_num(r.get('fine_tune_seconds', r.get('train_seconds')), '.0f')} | "
                         f"{crit} | {str(r.get('git_commit') or '')[:7]} | {machine_key(rows, r)} |")
        lines.append("")
    if len(set(r["seed"] for r in rows)) > 1:
        lines += ["## Over seeds (mean ± sd)", "",
                  "| net | target | method | seeds | FLOPs physical | accuracy % | ECE |",
                  "|---|---|---|---|---|---|---|"]
        groups = {}
        for r in sorted(rows, key=reading_order):
            if "error" not in r:
                groups.setdefault((r["net"], r["target"], r["method"]), []).append(r)
        for (net, target, method), rs in groups.items():
            def ms(key, scale=1.0, spec=".3f"):
                v = np.array([r[key] for r in rs]) * scale
                return f"{v.mean():{spec}} ± {v.std():{spec}}"
            lines.append(f"| {net} | {'dense' if target is None else target} | {method} | {len(rs)} | "
                         f"{ms('flops_ratio_physical')} | {ms('accuracy', 100, '.2f')} | {ms('ece', 1, '.4f')} |")
        lines.append("")
    return "\n".join(lines)


def _machines(rows):
    return list(dict.fromkeys(r.get("ran_on") or "?" for r in rows))


def machine_key(rows, row):
    """The row's machine as a letter of the legend machines_lines writes."""
    return "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[_machines(rows).index(row.get("ran_on") or "?") % 26]


def machines_lines(rows):
    """Which machine ran which rows (seconds compare only within one machine)."""
    legend = [f"{machine_key(rows, {'ran_on': m})} = {m} (seeds "
              f"{sorted(set(r['seed'] for r in rows if (r.get('ran_on') or '?') == m))})" for m in _machines(rows)]
    return ["Machines ('ran on' column): " + "; ".join(legend) + ".", ""]


FAR_BELOW = 35   # accuracy points under a net's best row beyond which the plot puts a row on the axis' floor


def plot(rows, path):
    """Test accuracy against physical FLOPs, one panel per net: every method, the dense point; rows more than
    FAR_BELOW points under the net's best sit on the axis' floor with their accuracy written beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    nets = list(dict.fromkeys(r["net"] for r in ok))
    if not nets:
        return
    cols = min(2, len(nets))
    n_rows = (len(nets) + cols - 1) // cols
    fig, axes = plt.subplots(n_rows, cols, figsize=(5.5 * cols, 4 * n_rows), squeeze=False)
    markers = {"dense": "*", "dense-ft": "P", "edgebayes-ss-gl": "o", "edgebayes-ss-ghs": "s", "edgebayes-bn3": "D",
               "tp-magnitude": "v", "tp-group-norm": "^"}
    colors = dict(zip(markers, plt.rcParams["axes.prop_cycle"].by_key()["color"]))   # one colour per method
    for ax, net in zip(axes.flat, nets):
        # A row far below the rest (a collapsed fine-tuning) would squash every other point into a line: the
        # axis stops FAR_BELOW points under the net's best row and such rows sit on its floor, labelled
        net_rows = [r for r in ok if r["net"] == net]
        best = max(100 * r["accuracy"] for r in net_rows)
        floor = min(100 * r["accuracy"] for r in net_rows if 100 * r["accuracy"] >= best - FAR_BELOW)
        floor -= 0.05 * (best - floor) + 0.1
        for method, marker in markers.items():
            pts = [r for r in net_rows if r["method"] == method]
            if pts:
                ax.scatter([r["flops_ratio_physical"] for r in pts], [max(100 * r["accuracy"], floor) for r in pts],
                           marker=marker, color=colors[method], s=120 if method == "dense" else 45, label=method)
                below = {}   # one label per FLOPs point: the seeds' accuracies there
                for r in pts:
                    if 100 * r["accuracy"] < floor:
                        below.setdefault(round(r["flops_ratio_physical"], 2), []).append(100 * r["accuracy"])
                for x, values in below.items():
                    ax.annotate(" / ".join(f"{v:.1f}" for v in sorted(values)) + "%", (x, floor), fontsize=6,
                                xytext=(5, 4), textcoords="offset points", color=colors[method])
        ax.set_ylim(bottom=floor - 0.02 * (best - floor))
        ax.set_title(net)
        ax.set_xlabel("physical FLOPs / dense")
        ax.set_ylabel("test accuracy %")
        ax.set_xlim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(nets):]:
        ax.axis("off")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def settings_provenance(settings):
    return provenance(hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16])


def write_results(args, rows, out):
    write_result({"rows": rows, "args": {k: v for k, v in vars(args).items()}, "settings": settings_of(args),
                  "command": args.command, "provenance": settings_provenance(settings_of(args))}, out)


def write_result(result, out, json_too=True):
    """out.json (unless json_too is False), out.md and out.png of one result."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if json_too:
        with atomic_path(result_path(out, ".json")) as tmp:
            Path(tmp).write_text(json.dumps(result, indent=1, default=str))
    with atomic_path(result_path(out, ".md")) as tmp:
        Path(tmp).write_text(markdown(result))
    plot(result["rows"], result_path(out, ".png"))


def _made_by(run, row):
    """Whether a run ({"command", "git_commit"}) made a row: its commit, and its command's nets, seeds, methods
    and targets (the defaults where the command leaves one out; a dense row comes with every method)."""
    asked, flag = {k: [str(v) for v in values] for k, values in DEFAULTS.items()}, None
    for token in shlex.split(run["command"]):
        if token.startswith("--"):
            flag = token[2:]
            if flag in DEFAULTS:
                asked[flag] = []
        elif flag in DEFAULTS:
            asked[flag].append(token)
    return (str(row.get("git_commit")) == str(run["git_commit"]) and row["net"] in asked["nets"]
            and str(row["seed"]) in asked["seeds"] and row["method"] in ["dense", *asked["methods"]]
            and (row["target"] is None or float(row["target"]) in map(float, asked["targets"])))


def merge(paths, out, command):
    """Rows of runs split over processes (or resumed at a later commit) as one result; each row keeps the commit
    of the run that made it (`git_commit`), the result's provenance is this merge's."""
    results = []
    for path in paths:
        try:
            result = read_json(Path(path))
        except (OSError, ValueError) as e:
            print(f"finetune_compress: --merge: {path}: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        missing = {"settings", "rows", "command", "provenance"} - set(result if isinstance(result, dict) else ())
        if missing:
            print(f"finetune_compress: --merge: {path} is not a results file of this benchmark (no "
                  f"{', '.join(sorted(missing))})", file=sys.stderr)
            return 2
        results.append(result)
    if any(r["settings"] != results[0]["settings"] for r in results):
        print(f"finetune_compress: --merge: the files were made with other settings: "
              f"{[r['settings'] for r in results]}", file=sys.stderr)
        return 2
    rows = {}
    for result in results:
        for row in result["rows"]:
            rows[(row["net"], row["method"], row["target"], row["seed"])] = {
                **row, "git_commit": row.get("git_commit") or result["provenance"].get("git_commit"),
                "ran_on": row.get("ran_on") or ran_on_label(result["provenance"], "cpu")}
    merged_from = [m for r in results for m in r.get("merged_from") or   # a merged file: the runs it was made of
                   [{"command": r["command"], "git_commit": r["provenance"].get("git_commit")}]]
    # the runs a row is still left of (a later file replaced every row of the others)
    merged_from = [m for m in merged_from if any(_made_by(m, row) for row in rows.values())]
    write_result({**results[-1], "rows": list(rows.values()), "command": command, "merged_from": merged_from,
                  "provenance": settings_provenance(results[0]["settings"])}, out)
    print(f"wrote {result_path(out, '.json')}, .md and .png from {len(paths)} files")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nets", nargs="+", default=DEFAULTS["nets"],
                        choices=NETS)
    parser.add_argument("--methods", nargs="+", default=DEFAULTS["methods"],
                        choices=["dense-ft", *EDGEBAYES, *TORCH_PRUNING],
                        help="dense-ft: the dense net trained E more epochs, uncompressed (the dense rows always run)")
    parser.add_argument("--targets", nargs="+", type=float, default=DEFAULTS["targets"],
                        help="FLOPs fractions of the dense net")
    parser.add_argument("--seeds", nargs="+", type=int, default=DEFAULTS["seeds"])
    parser.add_argument("--epochs", type=int, help="fine-tuning epochs E, every method (1..5; default 5, quick 1)")
    parser.add_argument("--dense-epochs", type=int, help="training epochs of the dense reference (default 10)")
    parser.add_argument("--mc", type=int, help="posterior samples M of the edgebayes rows (default 4)")
    parser.add_argument("--train-size", type=int, help="training images (default 4000)")
    parser.add_argument("--val-size", type=int, help="validation images, from the training set (default 1000)")
    parser.add_argument("--test-size", type=int, help="test images (default 2000)")
    parser.add_argument("--data", default="mnist", choices=["mnist", "digits"],
                        help="digits: scikit-learn's, offline (tests)")
    parser.add_argument("--mnist-root",
                        default=os.environ.get("EDGEBAYES_DATA") or str(ROOT.parent / "shared" / "datasets"),
                        help="folder holding MNIST/raw (default: $EDGEBAYES_DATA, else ../shared/datasets beside "
                             "the repo)")
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--decay-last-epoch", action=argparse.BooleanOptionalAction, default=True,
                        help=f"every method's last fine-tuning epoch at {FINE_TUNE_GAMMA:g} x the learning rate "
                             "(default; --no-decay-last-epoch: a constant rate)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true",
                        help="256 training images, 1 epoch, M = 2: the code path in seconds")
    parser.add_argument("--out", help="results path without suffix (default benchmarks/results/finetune_compress; "
                                      "--quick: runs/finetune_compress_quick)")
    parser.add_argument("--cache", default=str(ROOT / "runs" / "finetune_compress_cache"),
                        help="folder of the trained dense nets, reused by later runs with the same settings")
    parser.add_argument("--resume", action="store_true", help="keep the rows of --out's JSON (same settings)")
    parser.add_argument("--markdown-only", action="store_true", help="rewrite the .md and .png from the .json")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="write --out from the rows of these results files (the same settings; a later file's "
                             "row replaces an earlier one of the same net, method, target and seed), each row "
                             "keeping the commit its run was made at")
    args = parser.parse_args(argv)
    args.command = "python benchmarks/finetune_compress.py " + " ".join(sys.argv[1:] if argv is None else argv)
    out = Path(args.out or (ROOT / "runs" / "finetune_compress_quick" if args.quick else RESULTS / "finetune_compress"))
    if args.merge:
        return merge(args.merge, out, args.command)
    if args.markdown_only:
        write_result(read_json(result_path(out, ".json")), out, json_too=False)
        return 0
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not 1 <= args.epochs <= 5:
        parser.error(f"--epochs: expected 1..5 (the issue's fine-tuning budget), got {args.epochs}")
    for key in ("dense_epochs", "mc", "train_size", "val_size", "test_size", "threads"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')}: expected a positive integer, got {getattr(args, key)}")
    if any(not 0 < t <= 1 for t in args.targets):
        parser.error(f"--targets: expected FLOPs fractions in (0, 1], got {args.targets}")
    torch.set_num_threads(args.threads)

    try:
        data = load_images(args.data, args.mnist_root if args.data == "mnist" else None,
                           {k: getattr(args, k) for k in ("train_size", "val_size", "test_size")}, args.data_seed)
    except DataError as e:
        print(f"finetune_compress: --mnist-root: {e}", file=sys.stderr)
        return 2
    args.sizes = {s: len(data[s][1]) for s in ("train", "val", "test")}   # what the subsets hold
    rows = []
    if args.resume and result_path(out, ".json").is_file():
        earlier = read_json(result_path(out, ".json"))
        if earlier.get("settings") != settings_of(args):
            parser.error(f"--resume: {result_path(out, '.json')} was made with other settings "
                         f"({earlier.get('settings')}); use another --out or the same settings")
        rows = earlier["rows"]
    run(args, data, out, rows)
    print(f"wrote {result_path(out, '.json')}, .md and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
