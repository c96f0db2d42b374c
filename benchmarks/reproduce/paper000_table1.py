"""Paper 000, Table 1, MNIST rows of the spike-and-slab models: LeNet-5-Caffe, SS-IG / SS-GL / SS-GHS.

Trains configs/mnist-lenet5-ss{ig,gl,ghs}.yaml (the paper's setting: Adam 1e-3, batch 1024, 1200 epochs,
mean of 3 runs) through the pipeline's train stage, then measures on the 10,000 test images as
benchmarks/structured_sparsity.py does: accuracy with 10 MC samples, z ~ q(z) in each (the paper's
posterior-mean estimator), and of the median model (inclusion threshold 0.5, what export deploys);
compression (%) and pruned FLOPs (%) by paper 000's appendix A.1, counted by the median model's masks.
Writes <out>.json and <out>.md with the paper's numbers beside ours.

    python benchmarks/reproduce/paper000_table1.py --device cuda --precision bf16          # the paper's setting
    python benchmarks/reproduce/paper000_table1.py --epochs 1 --train-subset 2048 --seeds 0  # a smoke run

MNIST is read from data.root / $EDGEBAYES_DATA / ./data (MNIST/raw); without it the command exits 2 saying
where it looked.
"""

import statistics
import sys
import time

from common import ROOT, check_data, header, out_path, parser, train_run, variant

from edgebayes.config import load_pipeline_config
from edgebayes.provenance import write_json
from structured_sparsity import measure

# (label, config, paper: accuracy, compression, pruned FLOPs as (mean, sd) in % over 3 runs)
ROWS = [("SS-IG", "configs/mnist-lenet5-ssig.yaml", (98.68, 0.09), (6.22, 2.70), (15.05, 0.77)),
        ("SS-GL", "configs/mnist-lenet5-ssgl.yaml", (98.88, 0.14), (4.25, 1.24), (14.25, 1.66)),
        ("SS-GHS", "configs/mnist-lenet5-ssghs.yaml", (98.98, 0.09), (3.01, 0.16), (12.55, 0.83))]


def mean_sd(values, scale=100.0):
    values = [scale * v for v in values]
    if not values:
        return "-"
    sd = f" ({statistics.stdev(values):.2f})" if len(values) > 1 else ""
    return f"{statistics.mean(values):.2f}{sd}"


def main(argv=None):
    args = parser(__doc__.split("\n")[0], default_seeds=[0, 1, 2]).parse_args(argv)
    check_data(ROOT / ROWS[0][1], args, "paper 000 Table 1 needs MNIST")
    cfg_epochs = load_pipeline_config(ROOT / ROWS[0][1]).train.epochs
    t0 = time.perf_counter()
    runs = []
    for label, config, *_ in ROWS:
        for seed in args.seeds:
            ctx = train_run(ROOT / config, variant(ROOT / config, args, seed), args)
            runs.append({"model": label, "config": config, "train_seconds": ctx.train_seconds,
                         **measure(ctx, print, latency=False)})
    lines, prov, is_smoke = header(
        "Paper 000, Table 1 (MNIST, LeNet-5-Caffe): spike-and-slab rows", args, cfg_epochs,
        "Adam 1e-3, batch 1024, 1200 epochs, 3 runs, 10 MC samples at test time (appendix A.4)",
        [f"Wall time of the whole command: {time.perf_counter() - t0:.0f} s"])
    lines += ["Accuracy, compression and pruned FLOPs in %, mean (standard deviation) over the seeds; paper's in "
              "the 'paper' columns. Accuracy z ~ q: the paper's estimator (10 MC samples, node indicators drawn "
              "from q); median model: inclusion threshold 0.5, the network export deploys; compression and "
              "FLOPs are the median model's (appendix A.1).", "",
              "| model | accuracy z ~ q | paper | accuracy, median model | compression | paper | pruned FLOPs | "
              "paper | seeds | epochs |", "|---|---|---|---|---|---|---|---|---|---|"]
    for label, _, acc, comp, flops in ROWS:
        rows = [r for r in runs if r["model"] == label]
        ok = [r for r in rows if "median_model_empty" not in r]
        paper = lambda v: f"{v[0]:.2f} ({v[1]:.2f})"  # noqa: E731
        lines.append(
            f"| {label} | {mean_sd([r['posterior_mean_accuracy'] for r in rows])} | {paper(acc)} | "
            f"{mean_sd([r['accuracy'] for r in ok]) if ok else 'empty'} | "
            f"{mean_sd([r['compression'] for r in ok]) if ok else 'empty'} | {paper(comp)} | "
            f"{mean_sd([r['flops_ratio'] for r in ok]) if ok else 'empty'} | {paper(flops)} | "
            f"{[r['seed'] for r in rows]} | {rows[0]['epochs']} |")
    empty = [f"{r['model']} seed {r['seed']}: {r['median_model_empty']}" for r in runs if "median_model_empty" in r]
    if empty:
        lines += ["", "Empty median model (every unit of a layer below inclusion 0.5: the probabilities fall "
                  "together before they split, train/trainer.py): " + "; ".join(empty) + "."]
    out = out_path(args, "paper000_table1", is_smoke)
    write_json(out.with_suffix(".json"), {"smoke_run": is_smoke, "args": vars(args), "rows": runs,
                                          "paper": {label: {"accuracy": a, "compression": c, "flops": f}
                                                    for label, _, a, c, f in ROWS}, "provenance": prov})
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
