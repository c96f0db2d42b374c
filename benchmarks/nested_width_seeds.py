"""Width sweeps of several seeds side by side: is BN3's gap to FN3 larger than seed noise?

Reads two or more results of benchmarks/nested_width_sweep.py that differ only in --seed (same data,
architecture, epochs, optimizer settings, kappa and groups; checked, the config files' paths may differ)
and writes <out>/<name>.json, .md and .png: per width the mean over seeds of each family's accuracy, NLL,
ECE and OOD AUROC, and BN3 - FN3 accuracy per seed and on average.

Seed noise: s is the standard deviation over seeds of one family's test accuracy at one width (ddof 1),
pooled over both families and all widths. The mean over n seeds of BN3 - FN3 then has standard error
s sqrt(2 / n) (independent trainings); a width counts as "BN3 >= FN3 within seed noise" when the mean gap is
above -2 standard errors. BN3's "accuracy does not drop as width grows" is checked on the mean curve with
the same tolerance.

    .venv/bin/python benchmarks/nested_width_seeds.py benchmarks/results/A.json benchmarks/results/B.json \
        --name nested_width_seeds_mnist_lenet5
"""

import argparse
import math
from pathlib import Path

import numpy as np

from edgebayes.errors import InputError
from edgebayes.provenance import provenance, read_json, write_json
from nested_width_sweep import checks as sweep_checks
from nested_width_sweep import largest_drop

FAMILIES = ("bn3", "fn3")
MEAN_METRICS = ("accuracy", "nll", "ece", "ood_auroc")
SAME = ("arch", "dataset", "train_images", "epochs", "batch_size", "lr", "kappa", "groups", "fixed_groups",
        "mc_samples", "widths")


def read_sweep(path):
    """One nested_width_sweep.py result; an unreadable file or one without a seed is refused by name."""
    try:
        r = read_json(path)
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: cannot read a sweep result: {e}") from e
    missing = [k for k in ("seed", "families", *SAME) if k not in r]
    if missing:
        raise InputError(f"{path}: not a nested_width_sweep.py result with a seed (no {', '.join(missing)}; "
                         f"sweeps from before --seed record none)")
    return r


def load(paths):
    runs = [read_sweep(p) for p in paths]
    for path, r in zip(paths[1:], runs[1:]):
        differ = [k for k in SAME if r[k] != runs[0][k]]
        if differ:
            raise InputError(f"{path}: {', '.join(differ)} differ from {paths[0]}; only the seed may")
    seeds = [r["seed"] for r in runs]
    if len(set(seeds)) != len(seeds):
        raise InputError(f"{', '.join(map(str, paths))}: seeds {seeds} are not all different")
    return runs


def combine(runs):
    """Per family and metric an array (seeds, widths); the gap, its noise and the checks."""
    table = {f: {key: np.array([[p.get(key, np.nan) for p in r["families"][f]["points"]] for r in runs])
                 for key in MEAN_METRICS} for f in FAMILIES}
    n = len(runs)
    seed_std = math.sqrt(np.mean([table[f]["accuracy"].var(axis=0, ddof=1) for f in FAMILIES]))
    gap = table["bn3"]["accuracy"] - table["fn3"]["accuracy"]
    tolerance = 2 * seed_std * math.sqrt(2 / n)
    drop = largest_drop(list(table["bn3"]["accuracy"].mean(0)))
    checks = {"seed_std": seed_std, "tolerance": tolerance,
              "bn3_at_least_fn3_within_noise": bool((gap.mean(0) >= -tolerance).all()),
              "bn3_at_least_fn3_every_width_and_seed": bool((gap >= 0).all()),
              "bn3_mean_accuracy_not_dropping": bool(drop <= tolerance), "largest_mean_drop": drop,
              "bn3_full_width_ece_below_dnn_every_seed": all(
                  sweep_checks(r, tolerance)["bn3_full_width_ece_below_dnn"] for r in runs)}
    return table, gap, checks


def markdown(runs, table, gap, checks, paths):
    r0, n = runs[0], len(runs)
    seeds = [r["seed"] for r in runs]
    lines = [f"# Width sweep over {n} seeds: BN3 vs FN3 ({r0['arch']}, {r0['dataset']})", "",
             f"Seeds {seeds}, from {', '.join(f'`{Path(p).name}`' for p in paths)} (commit "
             f"{provenance('')['git_commit']}). {r0['train_images']} training images, {r0['epochs']} epochs, "
             f"kappa {r0['kappa']:g}, D = {r0['groups']} ({r0['fixed_groups']} fixed), BN3 M = {r0['mc_samples']}.",
             "",
             "| width | BN3 acc (mean) | FN3 acc (mean) | " + " | ".join(f"BN3 - FN3, seed {s}" for s in seeds)
             + " | BN3 - FN3, mean | BN3 NLL | FN3 NLL | BN3 ECE | FN3 ECE | BN3 OOD AUROC | FN3 OOD AUROC |",
             "|---" * (10 + n) + "|"]
    for i, k in enumerate(r0["widths"]):
        cells = [f"{k}/{r0['groups']}", f"{table['bn3']['accuracy'][:, i].mean():.4f}",
                 f"{table['fn3']['accuracy'][:, i].mean():.4f}"]
        cells += [f"{g * 100:+.2f}" for g in gap[:, i]] + [f"{gap[:, i].mean() * 100:+.2f}"]
        cells += [f"{table[f][key][:, i].mean():.4f}" for key in MEAN_METRICS[1:] for f in FAMILIES]
        lines.append("| " + " | ".join(cells) + " |")
    c = checks
    lines += ["", f"Gaps in points (1 point = {r0['test_images'] // 100} of the test images). Seed noise: "
              f"the pooled seed-to-seed standard deviation of one family's accuracy at one width is "
              f"{c['seed_std'] * 100:.3f} points; the mean gap's tolerance (2 standard errors) is "
              f"{c['tolerance'] * 100:.3f} points.", "",
              f"- BN3 >= FN3 at every width within seed noise: {c['bn3_at_least_fn3_within_noise']}",
              f"- BN3 >= FN3 at every width in every seed: {c['bn3_at_least_fn3_every_width_and_seed']}",
              f"- BN3 mean accuracy does not drop as width grows (within the tolerance): "
              f"{c['bn3_mean_accuracy_not_dropping']} (largest drop {c['largest_mean_drop'] * 100:.3f} points)",
              f"- BN3 ECE at full width below the dnn's in every seed: {c['bn3_full_width_ece_below_dnn_every_seed']}",
              ""]
    return "\n".join(lines)


def plot(runs, table, checks, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r0 = runs[0]
    x = np.array(r0["widths"]) / r0["groups"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for f, style in (("bn3", "o-"), ("fn3", "s--")):
        acc = table[f]["accuracy"]
        axes[0].errorbar(x, acc.mean(0), yerr=[acc.mean(0) - acc.min(0), acc.max(0) - acc.mean(0)], fmt=style,
                         markersize=4, capsize=3, label=f"{f.upper()} (mean, seed range)")
    axes[0].set_title("test accuracy")
    gap = (table["bn3"]["accuracy"] - table["fn3"]["accuracy"]) * 100
    for s, g in zip((r["seed"] for r in runs), gap):
        axes[1].plot(x, g, ".", alpha=0.6, label=f"seed {s}")
    axes[1].plot(x, gap.mean(0), "k-", label="mean")
    axes[1].axhspan(-checks["tolerance"] * 100, checks["tolerance"] * 100, color="grey", alpha=0.2,
                    label="+-2 s.e. (seed noise)")
    axes[1].axhline(0, color="grey", linewidth=0.8)
    axes[1].set_title("BN3 - FN3 accuracy (points)")
    for ax in axes:
        ax.set_xlabel("width (fraction of groups kept)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{r0['arch']} on {r0['dataset']}: {len(runs)} seeds, {r0['epochs']} epochs, "
                 f"{r0['train_images']} training images")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", type=Path, help="nested_width_sweep.py results (.json), one per seed")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--name", default="nested_width_seeds", help="file name of the results (.json, .md, .png)")
    args = p.parse_args()
    if len(args.results) < 2:
        p.error("give at least two results (one per seed)")
    try:
        runs = load(args.results)
    except InputError as e:
        raise SystemExit(f"nested_width_seeds: {e}")
    table, gap, checks = combine(runs)
    md = markdown(runs, table, gap, checks, args.results)
    write_json(args.out / f"{args.name}.json", {
        "inputs": [str(p) for p in args.results], "seeds": [r["seed"] for r in runs], "widths": runs[0]["widths"],
        "mean": {f: {k: v.mean(0).tolist() for k, v in table[f].items()} for f in FAMILIES},
        "bn3_minus_fn3_accuracy": gap.tolist(), "checks": checks,
        "provenance": provenance("nested_width_seeds " + " ".join(map(str, args.results)))})
    (args.out / f"{args.name}.md").write_text(md)
    plot(runs, table, checks, args.out / f"{args.name}.png")
    print(md)


if __name__ == "__main__":
    main()
