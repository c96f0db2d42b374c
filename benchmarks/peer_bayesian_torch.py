"""edgebayes against bayesian-torch, the tool a user would otherwise pick (issue 37, item 4).

    .venv/bin/pip install bayesian-torch     # for this benchmark only: not a dependency of edgebayes
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/peer_bayesian_torch.py --mnist-root ../shared/datasets

One process, one torch thread. LeNet-5 (conv 20 5x5, max pool, conv 50 5x5, max pool, fc 800 -> 500 -> 10;
export_common.lenet5_caffe) on MNIST, Adam 1e-3, batch 128, every method from the same initial weights:
  dnn                       the plain network: its best validation NLL over --max-epochs, + 10%, is the target
  edgebayes-bnn / -ss-gl    eb.bayesianize(net, family) + eb.fit of a --max-epochs run one epoch at a time
                            (until_epoch, resumed from its checkpoint: the same run as an uninterrupted one, KL
                            warm-up included); the ELBO with KL / N. The prior and the
                            optimizer settings of the config edgebayes ships for this net (SHIPPED: inclusion and
                            rho learning rates, ordered KL warm-up), batch and lr as every method's; bnn takes those
                            that apply to it (rho learning rate, a plain KL warm-up of the same length: it has no
                            inclusion logits to order); with fit's defaults the SS-GL median model empties at about
                            epoch 8 (README, issue 20)
  edgebayes-bnn-fit-defaults  bnn with fit's defaults (rho at the lr, no KL warm-up): what a user passing batch size
                            and lr gets. The shipped rho learning rate, 3x the lr, was chosen at batch 1024; at this
                            benchmark's 128 (8x the steps per epoch) it widened bnn's posterior past its best NLL
  bayesian-torch-reparam /  bayesian_torch.models.dnn_to_bnn with the prior settings of its README (prior N(0, 1),
  -flipout                  posterior rho init -3), loss = cross-entropy + KL / batch size as its README trains
The Bayesian methods train in interleaved rounds (round r: epoch r of each, in turn), so that load from other
processes falls on each alike. After every epoch each is evaluated the same way: the validation NLL of the
average of M = 8 forward passes' softmax (edgebayes: train/trainer.py's mc_predict; bayesian-torch: 8 forward
passes, each draws its weights). Reported per method: training seconds (the epochs' training loops only,
evaluation excluded) and epochs until the validation NLL first reaches the target, or "not reached".

Inference: M = 8 MC-averaged class probabilities at batch 1, 1 thread, timed in interleaved rounds:
edgebayes' packed ONNX of 8 posterior samples (eb.compress + eb.save; ss-gl pruned by surgery) in onnxruntime,
against bayesian-torch's 8 eager forward passes in PyTorch (how its README predicts).
A method whose median model has an emptied layer (ss-gl's collapse) cannot be exported: its row says so.

Several seeds: one process per seed (--seed S --out DIR/seedS; they may run side by side, one core each), then
`--merge DIR/seed*.json` writes the result: per method, the seeds that reached the target and the median of the
training seconds over every seed (one that did not reach it counts as the slowest), then each seed's tables.

Results: benchmarks/results/peer_bayesian_torch.{json,md} (machine, commit and versions in the JSON).
"""

import argparse
import copy
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import edgebayes as eb
from edgebayes.compressed.samples import EmptyLayerError
from edgebayes.config import SPIKE_SLAB_FAMILIES, DataConfig
from edgebayes.data import DataError, load_data
from edgebayes.ondevice.runtimes import make_backend
from edgebayes.provenance import atomic_path, provenance, read_json, result_path
from edgebayes.train.metrics import classification_metrics
from edgebayes.train.trainer import mc_predict

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export_common import lenet5_caffe, time_calls  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BATCH, LR, M = 128, 1e-3, 8
# name -> (family, whether it takes SHIPPED's optimizer settings; without them: fit's defaults, what a user who
# passes only batch size and lr gets)
EDGEBAYES = {"edgebayes-bnn": ("bnn", True), "edgebayes-bnn-fit-defaults": ("bnn", False),
             "edgebayes-ss-gl": ("ss-gl", True)}
SHIPPED = Path(__file__).resolve().parents[1] / "configs" / "mnist-lenet5-ssgl.yaml"
# The train keys of SHIPPED that are the optimizer's, not the budget's (epochs, batch, lr are the benchmark's)
SHIPPED_TRAIN = ("inclusion_lr", "rho_lr", "scale_lr", "kl_warmup_epochs", "kl_warmup_ordered", "kl_weight")
# ... and the families they apply to, as config.check_train has them (fit refuses the others by name)
ONLY_FOR = {"inclusion_lr": SPIKE_SLAB_FAMILIES, "kl_warmup_ordered": SPIKE_SLAB_FAMILIES,
            "scale_lr": ("ss-gl", "ss-ghs")}
BAYESIAN_TORCH = {"bayesian-torch-reparam": "Reparameterization", "bayesian-torch-flipout": "Flipout"}


def plain_epoch(model, x, y, optimizer, gen, loss_of):
    """One epoch of minibatch Adam; returns its seconds (the training loop only)."""
    model.train()
    t0 = time.perf_counter()
    for idx in torch.randperm(len(x), generator=gen).split(BATCH):
        loss = loss_of(model, x[idx], y[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return time.perf_counter() - t0


def sampled_probs(model, x, m, seed):
    """The average of m forward passes' softmax (each pass of a bayesian-torch model draws its weights)."""
    model.eval()
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return sum(torch.cat([F.softmax(model(x[i:i + 1024]), -1) for i in range(0, len(x), 1024)])
                   for _ in range(m)).div(m).numpy()


@torch.no_grad()
def eager_mc(model, x):
    """bayesian-torch's MC prediction as its README writes it: M forward passes, softmax averaged."""
    return torch.stack([F.softmax(model(x), -1) for _ in range(M)]).mean(0)


class Plain:
    def __init__(self, net, seed):
        self.net, self.gen = copy.deepcopy(net), torch.Generator().manual_seed(seed)
        self.opt = torch.optim.Adam(self.net.parameters(), lr=LR)

    def epoch(self, x, y, val):
        return plain_epoch(self.net, x, y, self.opt, self.gen, lambda m, a, b: F.cross_entropy(m(a), b))

    def probs(self, x, seed):
        return sampled_probs(self.net, x, 1, seed)


class BayesianTorch:
    def __init__(self, net, kind, seed):
        from bayesian_torch.models.dnn_to_bnn import dnn_to_bnn, get_kl_loss

        self.net, self.kl = copy.deepcopy(net), get_kl_loss
        torch.manual_seed(seed)
        dnn_to_bnn(self.net, {"prior_mu": 0.0, "prior_sigma": 1.0, "posterior_mu_init": 0.0,
                              "posterior_rho_init": -3.0, "type": kind, "moped_enable": False, "moped_delta": 0.5})
        self.gen, self.opt = torch.Generator().manual_seed(seed), torch.optim.Adam(self.net.parameters(), lr=LR)

    def epoch(self, x, y, val):
        return plain_epoch(self.net, x, y, self.opt, self.gen,
                           lambda m, a, b: F.cross_entropy(m(a), b) + self.kl(m) / len(a))

    def probs(self, x, seed):
        return sampled_probs(self.net, x, M, seed)


class Edgebayes:
    def __init__(self, name, net, family, shipped_settings, n_train, seed, work, epochs):
        from edgebayes.config import load_pipeline_config

        shipped = load_pipeline_config(SHIPPED)
        torch.manual_seed(seed)
        self.net = eb.bayesianize(copy.deepcopy(net), family, input_shape=(1, 28, 28), n_train=n_train,
                                  prior=shipped.prior)
        self.train = {k: getattr(shipped.train, k) for k in SHIPPED_TRAIN
                      if shipped_settings and family in ONLY_FOR.get(k, (family,))}
        self.seed, self.checkpoint, self.done, self.epochs = seed, Path(work) / f"{name}.pt", 0, epochs

    def epoch(self, x, y, val):
        self.done += 1   # the same run as an uninterrupted one: fit resumes from the checkpoint's epoch
        history = eb.fit(self.net, x, y, val=val, epochs=self.epochs, until_epoch=self.done, seed=self.seed,
                         checkpoint=self.checkpoint, batch_size=BATCH, lr=LR, log=lambda *_: None, **self.train)
        return history[-1]["train_seconds"]

    def probs(self, x, seed):
        return mc_predict(self.net, x, M, seed)


def train_rounds(methods, data, target, max_epochs, seed, log):
    """Interleaved rounds until every method reached the target or max_epochs: {name: per-epoch records}."""
    (x, y), (vx, vy) = data
    records = {name: [] for name in methods}
    for r in range(max_epochs):
        for name, method in methods.items():
            if any(e["reached"] for e in records[name]):
                continue
            seconds = method.epoch(x, y, (vx, vy))   # val: edgebayes' fit validates on it; the others ignore it
            metrics = classification_metrics(method.probs(vx, seed), vy.numpy())
            total = seconds + (records[name][-1]["seconds_total"] if records[name] else 0.0)
            records[name].append({"epoch": r + 1, "train_seconds": seconds, "seconds_total": total,
                                  "val_nll": metrics["nll"], "val_accuracy": metrics["accuracy"],
                                  "reached": target is not None and metrics["nll"] <= target})
            log(f"{name}: epoch {r + 1}, {seconds:.1f} s, val NLL {metrics['nll']:.4f} "
                f"(target {target if target is None else round(target, 4)}), acc {metrics['accuracy']:.4f}")
    return records


def markdown(result):
    s, target = result["settings"], result["target_val_nll"]
    lines = ["# edgebayes against bayesian-torch: LeNet-5 on MNIST, 1 thread (issue 37)", "",
             "Training seconds and epochs until the validation NLL of the M = 8 MC average reaches the dnn's best "
             "+ 10%, rounds interleaved in one process; M = 8 MC inference at batch 1. What and how: "
             "benchmarks/peer_bayesian_torch.py's docstring.", "", f"`{result['command']}`", "",
             f"{s['train_size']:,} training and {s['val_size']:,} validation images (MNIST's training set), "
             f"Adam {LR:g}, batch {BATCH}, up to {s['max_epochs']} epochs, seed {s['seed']}; dnn best validation NLL "
             f"{result['dnn_best_val_nll']:.4f}, target {target:.4f}.", "",
             "| method | epochs to target | training seconds to target | s / epoch | best val NLL | val acc at the end |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, recs in result["training"].items():
        hit = next((e for e in recs if e["reached"]), None)
        seconds = f"{hit['seconds_total']:.1f}" if hit else f"> {recs[-1]['seconds_total']:.1f}"
        lines.append(f"| {name} | {hit['epoch'] if hit else 'not reached'} | {seconds} | "
                     f"{statistics.mean(e['train_seconds'] for e in recs):.2f} | "
                     f"{min(e['val_nll'] for e in recs):.4f} | {recs[-1]['val_accuracy']:.4f} |")
    lines += ["", "| M = 8 inference, batch 1 | runtime | median ms | vs bayesian-torch-reparam |", "|---|---|---:|---:|"]
    ref = result["inference"]["bayesian-torch-reparam"]["median_ms"]
    for name, r in result["inference"].items():
        if r["median_ms"] is None:
            lines.append(f"| {name} | {r['runtime']} | - | - |")
            continue
        lines.append(f"| {name} | {r['runtime']} | {r['median_ms']:.3f} | {ref / r['median_ms']:.1f}x faster |"
                     if not name.startswith("bayesian-torch") else
                     f"| {name} | {r['runtime']} | {r['median_ms']:.3f} | {ref / r['median_ms']:.2f}x |")
    prov = result["provenance"]
    lines += ["", f"Commit {prov['git_commit']}, {prov['created_at']}; machine and versions in the JSON."]
    return "\n".join(lines) + "\n"


def merged_markdown(result):
    """The summary over seeds (median seconds to target over every seed, one that did not reach it counting as the
    slowest), then each seed's tables."""
    runs = result["runs"]
    lines = ["# edgebayes against bayesian-torch: LeNet-5 on MNIST, 1 thread, "
             f"{len(runs)} seeds (issue 37)", "",
             "Per method and seed: training seconds until the validation NLL of the M = 8 MC average reaches the "
             "seed's dnn best + 10%, rounds interleaved in one process per seed; M = 8 MC inference at batch 1. "
             "What and how: benchmarks/peer_bayesian_torch.py's docstring.", "", f"`{result['command']}`", "",
             "| method | seeds reaching the target | training seconds to target, per seed | median over the seeds "
             "| epochs, per seed | M = 8 inference, median ms |", "|---|---:|---|---:|---|---:|"]
    for name in runs[0]["training"]:
        hits = [next((e for e in r["training"][name] if e["reached"]), None) for r in runs]
        reached = [h["seconds_total"] for h in hits if h]
        median = statistics.median(h["seconds_total"] if h else math.inf for h in hits)   # not reached: slowest
        per_seed = ", ".join(f"{h['seconds_total']:.1f}" if h else "-" for h in hits)
        epochs = ", ".join(str(h["epoch"]) if h else "-" for h in hits)
        timed = [r["inference"][name]["median_ms"] for r in runs if r["inference"][name]["median_ms"] is not None]
        ms = f"{statistics.median(timed):.3f}" if timed else "not exported"
        lines.append(f"| {name} | {len(reached)} of {len(runs)} | {per_seed} | "
                     f"{'not reached' if median == math.inf else f'{median:.1f}'} | {epochs} | {ms} |")
    lines += ["", "'-': not reached within the run's epochs; the median counts it as slower than any seed that "
              "reached. Seeds in the order "
              + ", ".join(str(r["settings"]["seed"]) for r in runs) + "."]
    for r in runs:
        body = markdown(r).split("\n")[2:]   # a seed's own tables, without its title
        lines += ["", f"## Seed {r['settings']['seed']}", "", *body]
    return "\n".join(lines).rstrip("\n") + "\n"


def merge(paths, out, command):
    """One result from runs of several seeds (same settings otherwise); 2 with a message naming the file if not."""
    runs = []
    for path in paths:
        try:
            run = read_json(path)
        except (OSError, ValueError) as e:   # CorruptFileError is a ValueError
            print(f"peer_bayesian_torch: --merge: {path}: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        if not isinstance(run, dict) or not {"settings", "training", "inference", "provenance"} <= set(run):
            print(f"peer_bayesian_torch: --merge: {path} is not a result of this benchmark", file=sys.stderr)
            return 2
        runs.append(run)
    def setup(run):   # what must match between seeds: the settings but the seed, and the methods compared
        return ({k: v for k, v in run["settings"].items() if k != "seed"}, sorted(run["training"]),
                sorted(run["inference"]))

    other = [str(p) for p, r in zip(paths, runs) if setup(r) != setup(runs[0])]
    if other:
        print(f"peer_bayesian_torch: --merge: {', '.join(other)} made with other settings or methods than {paths[0]}",
              file=sys.stderr)
        return 2
    runs.sort(key=lambda r: r["settings"]["seed"])
    result = {"measures": runs[0]["measures"] + ", several seeds", "command": command, "runs": runs,
              "provenance": provenance("benchmark")}
    write(result, Path(out), merged_markdown(result))
    return 0


def write(result, out, text):
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(result_path(out, ".json")) as tmp:
        tmp.write_text(json.dumps(result, indent=1) + "\n")
    with atomic_path(result_path(out, ".md")) as tmp:
        tmp.write_text(text)
    print(text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mnist-root", default=str(Path(__file__).resolve().parents[2] / "shared" / "datasets"))
    parser.add_argument("--train-size", type=int, help="training images (default: all but the validation split)")
    parser.add_argument("--max-epochs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "peer_bayesian_torch"), help="results path without suffix")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="merge these runs' results (one per seed) into --out")
    args = parser.parse_args(argv)
    command = "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    if args.merge:
        return merge(args.merge, args.out, command)
    torch.set_num_threads(1)
    try:
        splits = load_data(DataConfig(dataset="mnist", root=args.mnist_root, val_fraction=1 / 12,
                                      train_subset=args.train_size), args.seed)
    except DataError as e:
        print(f"peer_bayesian_torch: --mnist-root: {e}", file=sys.stderr)
        return 2
    data = ((splits.train_x, splits.train_y), (splits.val_x, splits.val_y))
    torch.manual_seed(args.seed)
    net = lenet5_caffe().train()
    log = lambda m: print(m, flush=True)  # noqa: E731

    dnn = train_rounds({"dnn": Plain(net, args.seed)}, data, None, args.max_epochs, args.seed, log)["dnn"]
    best = min(e["val_nll"] for e in dnn)
    target = 1.1 * best
    with tempfile.TemporaryDirectory() as work:
        methods = {**{name: Edgebayes(name, net, fam, shipped, len(splits.train_x), args.seed, work, args.max_epochs)
                      for name, (fam, shipped) in EDGEBAYES.items()},
                   **{name: BayesianTorch(net, kind, args.seed) for name, kind in BAYESIAN_TORCH.items()}}
        training = train_rounds(methods, data, target, args.max_epochs, args.seed, log)
        x1 = splits.val_x[:1]
        predictors, runtimes, no_model = {}, {}, {}
        for name in EDGEBAYES:
            try:
                packed = eb.compress(methods[name].net, m=M, seed=args.seed)
            except EmptyLayerError as e:   # an emptied median model (ss-gl's collapse): nothing to deploy
                no_model[name] = f"not exported: {e}"
                continue
            path = eb.save(packed, Path(work) / f"{name}.onnx", example=splits.val_x[:16])
            backend = make_backend("onnxruntime", str(path), 1)
            predictors[name], runtimes[name] = (lambda x, b=backend: b.run(x.numpy())), "onnxruntime, packed ONNX"
        for name in BAYESIAN_TORCH:
            model = methods[name].net.eval()
            predictors[name] = lambda x, mdl=model: eager_mc(mdl, x)
            runtimes[name] = "PyTorch eager, 8 passes"
        inference = time_calls(predictors, x1, warmup=20, calls=100, repeats=7)
    for name in inference:
        inference[name]["runtime"] = runtimes[name]
    inference.update({name: {"runtime": why, "median_ms": None} for name, why in no_model.items()})
    from importlib import metadata
    prov = provenance("benchmark")
    prov["versions"]["bayesian-torch"] = metadata.version("bayesian-torch")
    result = {"measures": "seconds and epochs to a validation NLL target, and M = 8 inference latency, edgebayes "
                          "against bayesian-torch (issue 37)",
              "command": command,
              "settings": {"train_size": len(splits.train_x), "val_size": len(splits.val_x),
                           "max_epochs": args.max_epochs, "seed": args.seed, "batch": BATCH, "lr": LR, "mc": M,
                           "threads": 1},
              "dnn": dnn, "dnn_best_val_nll": best, "target_val_nll": target, "training": training,
              "inference": inference, "provenance": prov}
    write(result, Path(args.out), markdown(result))


if __name__ == "__main__":
    sys.exit(main())
