"""Paper 001, Table 1: SQS on CIFAR-10 ResNets (2 bits, K = 4; 50% non-zero; about 10 fine-tuning epochs).

Trains configs/cifar10-resnet{20,32}-sqs.yaml through the pipeline's train stage: the deterministic ResNet
first (sqs.pretrain_epochs; the paper starts from timm's pretrained nets instead, set sqs.checkpoint for
that), then SQS fine-tuning; reads the stage's metrics: full-precision test accuracy, SQS test accuracy
(MC-averaged, train.mc_samples_eval samples), accuracy drop, compression rate by eq. 14 and by file bytes.
Writes <out>.json and <out>.md beside the paper's numbers. ResNet-56 is not in the zoo: its row says so.

    python benchmarks/reproduce/paper001_table1.py --device cuda --precision bf16
    python benchmarks/reproduce/paper001_table1.py --epochs 1 --train-subset 512 --seeds 0   # a smoke run

CIFAR-10 is read by torchvision from data.root (../shared/datasets in the configs), $EDGEBAYES_DATA or
./data; without it the command exits 2 with the loader's message naming the folder.
"""

import statistics
import sys
import time

from common import ROOT, check_data, header, out_path, parser, train_run, variant

from edgebayes.config import load_pipeline_config
from edgebayes.provenance import read_json, write_json

# (label, config or None, paper: full-precision accuracy %, bits, non-zero %, compression x, accuracy drop %)
ROWS = [("ResNet-20", "configs/cifar10-resnet20-sqs.yaml", 92.60, 2, 50, 32, 1.47),
        ("ResNet-32", "configs/cifar10-resnet32-sqs.yaml", 93.53, 2, 50, 32, 1.29),
        ("ResNet-56", None, 94.37, 2, 50, 32, 0.84)]


def mean_sd(values, fmt="{:.2f}"):
    if not values:
        return "-"
    sd = f" ({fmt.format(statistics.stdev(values))})" if len(values) > 1 else ""
    return fmt.format(statistics.mean(values)) + sd


def main(argv=None):
    args = parser(__doc__.split("\n")[0], default_seeds=[0]).parse_args(argv)
    check_data(ROOT / ROWS[0][1], args, "paper 001 Table 1 needs CIFAR-10")
    cfg_epochs = load_pipeline_config(ROOT / ROWS[0][1]).train.epochs
    t0 = time.perf_counter()
    runs = []
    for label, config, *_ in ROWS:
        if config is None:
            continue
        for seed in args.seeds:
            cfg = variant(ROOT / config, args, seed)
            ctx = train_run(ROOT / config, cfg, args)
            m = read_json(ctx.stage_dir("train") / "metrics.json")
            runs.append({"model": label, "config": config, "seed": seed, "epochs": cfg.train.epochs,
                         "pretrain_epochs": cfg.sqs.pretrain_epochs, "train_seconds": ctx.train_seconds,
                         "full_precision_accuracy": m["sqs"]["full_precision_test"]["accuracy"],
                         "accuracy": m["test"]["accuracy"], "accuracy_drop": m["sqs"]["accuracy_drop"],
                         "nonzero_rate": m["sqs"]["nonzero_rate"], "bits": m["sqs"]["bits_formula"],
                         "rate_formula": m["sqs"]["rate_formula"], "rate_bytes": m["sqs"]["rate_bytes"]})
            print(f"{label} seed {seed}: {runs[-1]}")
    lines, prov, is_smoke = header(
        "Paper 001, Table 1 (CIFAR-10, ResNets): SQS", args, cfg_epochs,
        "timm's pretrained ResNets, K = 4 (2 bits), 50% non-zero, about 10 epochs of fine-tuning",
        [f"Wall time of the whole command: {time.perf_counter() - t0:.0f} s",
         "Full-precision start: the pipeline's own deterministic ResNet (sqs.pretrain_epochs), not timm's"])
    lines += ["Accuracies and drops in %, mean (standard deviation) over the seeds.", "",
              "| model | full-precision acc. | paper | SQS acc. | bits | non-zero | compression (eq. 14) | "
              "by file bytes | paper | accuracy drop | paper | seeds | epochs |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, config, fp, bits, nonzero, rate, drop in ROWS:
        rows = [r for r in runs if r["model"] == label]
        if not rows:
            lines.append(f"| {label} | not run: {'no ' + label + ' in the zoo' if config is None else 'no runs'} | "
                         f"{fp:.2f} | | | | | | {rate}x | | {drop:.2f} | | |")
            continue
        pct = lambda key: mean_sd([100 * r[key] for r in rows])  # noqa: E731
        lines.append(f"| {label} | {pct('full_precision_accuracy')} | {fp:.2f} | {pct('accuracy')} | "
                     f"{rows[0]['bits']:g} | {100 * rows[0]['nonzero_rate']:.0f}% | "
                     f"{mean_sd([r['rate_formula'] for r in rows], '{:.1f}')}x | "
                     f"{mean_sd([r['rate_bytes'] for r in rows], '{:.1f}')}x | {rate}x | {pct('accuracy_drop')} | "
                     f"{drop:.2f} | {[r['seed'] for r in rows]} | {rows[0]['epochs']} |")
    out = out_path(args, "paper001_table1", is_smoke)
    write_json(out.with_suffix(".json"), {"smoke_run": is_smoke, "args": vars(args), "rows": runs,
                                          "provenance": prov})
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
