"""Paper 000's comparison on one config: DNN, BNN, SS-IG, SS-GL and SS-GHS, trained by the pipeline's own
train stage, evaluated as the paper does, and timed as physically pruned ONNX beside the dense one.

For each family and seed: train (resumable, cached by the stage fingerprint under --runs-dir), then on the
test split with 10 MC samples: the paper's posterior-mean accuracy (z ~ q(z) in each sample), and at
inclusion threshold 0.5 (the median model, what export deploys): accuracy, NLL, ECE; compression (%) and pruned
FLOPs (%) by paper 000 (appendix A.1, counted by the masks), the FLOPs of the physically pruned network;
and the batch-1 onnxruntime latency (2 threads, interleaved rounds: onnx_latencies_ms) of one
posterior sample, dense (dead units zeroed, full shapes) and physically pruned, in the same run.

Results: <out>.json (every run, provenance: machine, commit, versions) and <out>.md (mean and spread over
seeds). Timing takes /tmp/edgebayes-bench.lock so timing runs of parallel sessions never overlap.

    python benchmarks/structured_sparsity.py --config configs/mnist-lenet5-ssghs.yaml --seeds 0 \
        --epochs 12 --batch-size 128 --out benchmarks/results/lenet5-mnist-cpu

Several configs (`--config A.yaml B.yaml ...`): each family's rows are trained from the config whose
model.family it is, so that every spike-and-slab row runs exactly its own config file; a family without one
(DNN, BNN) is derived from the first. Paper 000's comparison as committed:

    python benchmarks/structured_sparsity.py --config configs/mnist-lenet5-ss{gl,ig,ghs}.yaml --seeds 0 1 2 \
        --epochs 20 --batch-size 128 --out benchmarks/results/lenet5-mnist-20ep

Training settings to compare: `--set train.lr_milestones=[15]` (repeatable; YAML values, validated like the
config file) changes the config before the families are derived, and the results name the changes. Runs of
several settings or seeds can train in parallel processes (`--train-only`, one `--runs-dir` per setting),
then `--measure-only` measures what finished and lists what did not.
"""

import argparse
import copy
import fcntl
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from edgebayes.config import ConfigError, load_device_profile, load_pipeline_config
from edgebayes.export.onnx_export import export_onnx
from edgebayes.ondevice.atomic import atomic_path
from edgebayes.provenance import provenance, read_json, write_json
from edgebayes.stages import Context, load_trained_model, run_stage, splits_for
from edgebayes.compressed.structure import structure_report
from edgebayes.compressed.samples import EmptyLayerError
from edgebayes.train.trainer import evaluate, posterior_mean_metrics
from export_common import time_artifacts

FAMILIES = ("dnn", "bnn", "ss-ig", "ss-gl", "ss-ghs")
PAPER_LABEL = {"dnn": "DNN", "bnn": "BNN", "ss-ig": "SS-IG", "ss-gl": "SS-GL", "ss-ghs": "SS-GHS"}


def variant(cfg, family, seed, epochs, batch_size, scale_lr_families):
    """The config for one run. DNN and BNN take appendix A.4's baseline learning rate (1e-4) with Adam.
    train.scale_lr stays only for the families in `scale_lr_families` (main: the family of the config `cfg` was
    read from, the one it was chosen for, or SS-GL and SS-GHS when --set gives it); the other rows run without it."""
    v = copy.deepcopy(cfg)
    v.model.family, v.seed = family, seed
    v.name = f"{cfg.name}-{family}-s{seed}"
    if epochs:
        v.train.epochs = epochs
        v.train.lr_milestones = [m for m in v.train.lr_milestones if m <= epochs]
    if batch_size:
        v.train.batch_size = batch_size
    if family not in scale_lr_families:
        v.train.scale_lr = None
    if family in ("dnn", "bnn"):   # no inclusion logits to schedule
        v.train.inclusion_lr, v.train.rho_lr, v.train.kl_warmup_ordered = None, None, False
        v.train.flops_target = None
        if v.train.optimizer == "adam":
            v.train.lr = 1e-4
    v.train.kl_warmup_epochs = min(v.train.kl_warmup_epochs, v.train.epochs)
    return v


def configs_by_family(paths, settings):
    """{family: (path, config with `settings`)} for each config's model.family, and None: the first config, from
    which the families without a config of their own are derived. Two configs of one family are an error."""
    configs = {}
    for path in paths:
        cfg = with_settings(path, settings)
        family = cfg.model.family
        if family in configs:
            raise SystemExit(f"--config: {configs[family][0]} and {path} are both {family} configs; give one per family")
        configs[family] = (path, cfg)
        configs.setdefault(None, (path, cfg))
    return configs


def with_settings(config_path, settings):
    """The config at `config_path` with `settings` ("section.key=YAML value") applied: the CLI's own --set
    (config.load_pipeline_config), validated as a config file is, so a bad key or value is one message naming it."""
    return load_pipeline_config(config_path, settings)


def onnx_latencies_ms(modules, example):
    """{name: module} -> {name: batch-1 onnxruntime latency in ms} (2 threads): the median over 7 rounds of
    each round's median of 200 calls, the rounds of the networks interleaved (export_common.time_artifacts),
    so load from other processes falls on dense and pruned alike."""
    with tempfile.TemporaryDirectory() as tmp:
        artifacts = {}
        for name, module in modules.items():
            path = Path(tmp) / f"{name}.onnx"
            export_onnx(module, example, path)
            artifacts[name] = (path, "onnx")
        timed = time_artifacts(artifacts, example.numpy())
    return {name: t["median_ms"] for name, t in timed.items()}


def empty_epochs(history):
    """Epochs at whose end the median model had a layer with no unit kept (from the trainer's history)."""
    return [h["epoch"] for h in history if h.get("kept_nodes") and min(h["kept_nodes"]) == 0]


def measure(ctx, log, latency=True):
    """Test figures of a trained run (module docstring); latency=False leaves the ONNX timing out."""
    model, splits = load_trained_model(ctx), splits_for(ctx)
    history = read_json(ctx.stage_dir("train") / "metrics.json").get("history", [])
    row = {"family": ctx.cfg.model.family, "seed": ctx.cfg.seed, "epochs": ctx.cfg.train.epochs,
           "batch_size": ctx.cfg.train.batch_size, "lr": ctx.cfg.train.lr, "inclusion_lr": ctx.cfg.train.inclusion_lr,
           "rho_lr": ctx.cfg.train.rho_lr, "kl_warmup_epochs": ctx.cfg.train.kl_warmup_epochs,
           "kl_warmup_ordered": ctx.cfg.train.kl_warmup_ordered,
           "kept_per_epoch": [h.get("kept_nodes") for h in history], "empty_epochs": empty_epochs(history),
           "val_accuracy_per_epoch": [h.get("val_accuracy") for h in history],   # what settings are chosen by
           "posterior_mean_accuracy": posterior_mean_metrics(model, splits.test_x, splits.test_y, 10,
                                                             ctx.cfg.seed)["accuracy"]}
    try:
        test, compressed, _ = evaluate(model, splits.test_x, splits.test_y, 0.5, 10, ctx.cfg.seed)
    except EmptyLayerError as e:  # inclusion probabilities still falling together: nothing to deploy yet
        log(f"{ctx.cfg.name}: posterior-mean accuracy {row['posterior_mean_accuracy']:.4f}; median model: {e}")
        return {**row, "median_model_empty": str(e)}
    s = structure_report(compressed.dense_sample, compressed.samples[0], compressed.kept, splits.input_shape)
    row.update({"accuracy": test["accuracy"], "nll": test["nll"], "ece": test["ece"],
                "compression": s["compression_ratio"], "flops_ratio": s["flops_ratio"],
                "physical_flops_ratio": s["physical_flops_ratio"],
                "kept": {layer["name"]: [layer["kept"], layer["total"]] for layer in s["layers"]}})
    if not latency:
        log(f"{ctx.cfg.name}: posterior-mean accuracy {row['posterior_mean_accuracy']:.4f}, median-model accuracy "
            f"{row['accuracy']:.4f}, compression {100 * row['compression']:.2f}%, FLOPs {100 * row['flops_ratio']:.2f}%")
        return row
    example = splits.test_x[:1]
    with open("/tmp/edgebayes-bench.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ms = onnx_latencies_ms({"dense": compressed.dense_sample, "pruned": compressed.samples[0]}, example)
        dense_ms, pruned_ms = ms["dense"], ms["pruned"]
    row.update({"latency_dense_ms": dense_ms, "latency_pruned_ms": pruned_ms, "latency_ratio": pruned_ms / dense_ms})
    log(f"{ctx.cfg.name}: posterior-mean accuracy {row['posterior_mean_accuracy']:.4f}, median-model accuracy "
        f"{row['accuracy']:.4f}, compression {100 * row['compression']:.2f}%, FLOPs {100 * row['flops_ratio']:.2f}% "
        f"(physical {100 * row['physical_flops_ratio']:.2f}%), latency {pruned_ms:.3f} / {dense_ms:.3f} ms = "
        f"{row['latency_ratio']:.3f}")
    return row


def _mean_spread(values, scale=1.0, digits=2):
    values = [scale * v for v in values]
    mean = float(np.mean(values))
    spread = f" ± {float(np.std(values, ddof=1)):.{digits}f}" if len(values) > 1 else ""
    return f"{mean:.{digits}f}{spread}"


def markdown(rows, title, facts):
    lines = [f"# {title}", "", *facts, "",
             "| model | accuracy, z ~ q (%) | accuracy, median model (%) | compression (%) | pruned FLOPs (%) | "
             "physical FLOPs (%) | latency pruned / dense (ms) | latency ratio | ECE |",
             "|---|---|---|---|---|---|---|---|---|"]
    for family in FAMILIES:
        r = [row for row in rows if row["family"] == family]
        if not r:
            continue
        ok = [x for x in r if "median_model_empty" not in x]
        def col(k, scale=1.0, d=2, of=ok):
            if not of:
                return "empty"
            return _mean_spread([x[k] for x in of], scale, d) if all(k in x for x in of) else "not measured"
        lines.append(f"| {PAPER_LABEL[family]} | {col('posterior_mean_accuracy', 100, of=r)} | {col('accuracy', 100)} | "
                     f"{col('compression', 100)} | {col('flops_ratio', 100)} | {col('physical_flops_ratio', 100)} | "
                     f"{col('latency_pruned_ms', 1, 3)} / {col('latency_dense_ms', 1, 3)} | "
                     f"{col('latency_ratio', 1, 3)} | {col('ece', 1, 4)} |")
    lines += ["", "Median model per epoch: epochs at whose end a layer of the median model was empty "
              "(every unit below inclusion 0.5)", ""]
    for x in rows:
        if x.get("kept_per_epoch") and x["kept_per_epoch"][0] is not None:
            late = [e for e in x["empty_epochs"] if e > 3]
            lines.append(f"- {PAPER_LABEL[x['family']]} seed {x['seed']}: "
                         f"{'none' if not x['empty_epochs'] else x['empty_epochs']}"
                         f"{' (after epoch 3: ' + str(late) + ')' if late else ''}; kept units at the end "
                         f"{x['kept_per_epoch'][-1]}")
    empty = [f"{PAPER_LABEL[x['family']]} seed {x['seed']}: {x['median_model_empty']}" for x in rows
             if "median_model_empty" in x]
    if empty:
        lines += ["", "Empty median model (every unit of a layer below inclusion 0.5 when training stopped; the "
                  "probabilities of a layer fall together, see train/trainer.py and issue 20): " + "; ".join(empty) + "."]
    return "\n".join(lines) + "\n"


def spike_slab_optimizer(t):
    """The spike-and-slab optimizer settings of a config's train section, in words."""
    return (f"Adam {t.lr}, inclusion logits at {t.inclusion_lr or t.lr}, the slab's rho at {t.rho_lr or t.lr}"
            f"{f', the scale variables at {t.scale_lr}' if t.scale_lr else ''}, KL warm-up {t.kl_warmup_epochs} "
            f"epochs{' (ordered: train/trainer.py)' if t.kl_warmup_ordered else ''}, the exact ELBO after it"
            f"{f'; learning rate times {t.lr_gamma} after epochs {t.lr_milestones}' if t.lr_milestones else ''}")


def write_results(args, cfg, family_configs, rows, untrained, pending):
    """<out>.json and <out>.md of the rows measured so far (atomically); returns the md. `cfg`: the first
    config as given; `family_configs`: {family: (config path, the config its runs train)}."""
    epochs = args.epochs or cfg.train.epochs
    t = cfg.train
    optimizer = "; ".join(f"{PAPER_LABEL[f]} (`{p}`) {spike_slab_optimizer(c.train)}"
                          for f, (p, c) in family_configs.items() if f not in ("dnn", "bnn"))
    facts = [f"Config{'s' if len(args.config) > 1 else ''} {', '.join(f'`{p}`' for p in args.config)} "
             f"({cfg.model.arch} on {cfg.data.dataset}), {epochs} epochs "
             f"(paper: {t.epochs}), batch {args.batch_size or t.batch_size}, seeds {args.seeds}; "
             "test split, 10 MC samples: accuracy with z ~ q(z) (the paper's estimator) and of the median "
             "model (inclusion threshold 0.5, what export deploys). Compression and pruned FLOPs by paper 000 "
             "(appendix A.1, by the masks); physical FLOPs of the network after surgery; latency of one "
             "posterior sample at batch 1, onnxruntime CPU, 2 threads, median of 7 interleaved rounds of 200 calls.",
             "", f"Optimizer: DNN and BNN Adam 1e-4 (appendix A.4){'; ' + optimizer if optimizer else ''}."]
    if args.set:
        facts += ["", "Changed from the config file: " + ", ".join(f"`{s}`" for s in args.set) + "."]
    if untrained:
        facts += ["", "Not trained when measured (left out of the table): " + ", ".join(untrained) + "."]
    if pending:
        facts += ["", "Not measured yet (the measurement was interrupted): " + ", ".join(pending) + "."]
    result = {"config": args.config, "settings": args.set, "epochs": epochs, "seeds": args.seeds, "rows": rows,
              "untrained": untrained, "not_measured": pending, "provenance": provenance(None)}
    write_json(Path(args.out + ".json"), result)
    md = markdown(rows, f"Structured sparsity: {cfg.model.arch} on {cfg.data.dataset}", facts)
    md += f"\nMachine: {result['provenance']['machine']}; commit {result['provenance']['git_commit']}.\n"
    with atomic_path(Path(args.out + ".md")) as tmp:
        tmp.write_text(md)
    return md


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, nargs="+",
                    help="one config, or one per family (each family's rows from its own; DNN/BNN from the first)")
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--epochs", type=int, help="override train.epochs (say so in the results)")
    ap.add_argument("--batch-size", type=int, help="override train.batch_size")
    ap.add_argument("--runs-dir", default="runs/bench")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="change the config before the families are derived (repeatable; named in the results)")
    ap.add_argument("--train-only", action="store_true", help="train (or resume) and stop")
    ap.add_argument("--measure-only", action="store_true",
                    help="measure the runs that finished training, list the others; train nothing")
    ap.add_argument("--no-latency", action="store_true", help="leave the ONNX latency out")
    ap.add_argument("--out", help="results path without suffix (.json and .md are written)")
    args = ap.parse_args(argv)
    if not args.train_only and not args.out:
        ap.error("--out is required unless --train-only")

    if args.train_only and args.measure_only:
        ap.error("--train-only and --measure-only exclude each other")

    try:
        configs = configs_by_family(args.config, args.set)
    except ConfigError as e:
        ap.error(str(e))
    set_scale_lr = any(s.startswith("train.scale_lr=") for s in args.set)
    profile = load_device_profile("local")
    family_configs = {}   # family -> (config path, the config of its first seed): what the results describe
    runs, untrained = [], []
    for seed in args.seeds:
        for family in args.families:
            path, source = configs.get(family, configs[None])
            scale_lr_families = ("ss-gl", "ss-ghs") if set_scale_lr else (source.model.family,)
            v = variant(source, family, seed, args.epochs, args.batch_size, scale_lr_families)
            family_configs.setdefault(family, (path, v))
            ctx = Context(v, profile, runs_dir=Path(args.runs_dir), config_path=path)
            if args.measure_only and not ctx.is_fresh("train"):
                untrained.append(f"{PAPER_LABEL[family]} seed {seed}")
            else:
                runs.append(ctx)
    rows = []
    label = [f"{PAPER_LABEL[c.cfg.model.family]} seed {c.cfg.seed}" for c in runs]
    if not args.train_only:
        md = write_results(args, configs[None][1], family_configs, rows, untrained, label)
    for i, ctx in enumerate(runs):
        run_stage(ctx, "train")
        if not args.train_only:   # written after every run, so an interrupted measurement keeps what it has
            rows.append(measure(ctx, print, latency=not args.no_latency))
            md = write_results(args, configs[None][1], family_configs, rows, untrained, label[i + 1:])
    if not args.train_only:
        print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
