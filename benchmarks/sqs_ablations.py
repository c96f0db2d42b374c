"""The ablations of paper 001 (SQS) on the data available here: MNIST, the pipeline's MLP, on CPU.

  prior      spike-and-slab vs Gaussian prior (appendix D.2) across non-zero rates (paper: Table 4);
  inference  Bayesian averaging over M samples (eq. 10) vs greedy argmax (eq. 34) across K, no pruning
             (paper: Figure 3);
  windows    outlier-aware vs equal windows (appendix C / D.2; paper: Figure 2), plus one window per layer:
             accuracy, file bytes and how well the quantized weights match the full-precision distribution;
  scores     the first layer's keep scores per weight (the paper) vs per input pixel (sqs.first_layer_scores,
             not in the paper) across non-zero rates: accuracy and where the file's bytes go;
  mask       training under the hard top-r_t mask (train/sqs.py's documented deviation, the default) vs eq. 8
             without it (train_sqs(masked=False)), across non-zero rates.

Every variant fine-tunes the same full-precision network (pretrained once, cached in --work) with the
config's SQS settings, changing only what the ablation varies. Accuracy drops are against that network on
the 10,000 MNIST test images. Results: <out>/sqs_ablations.json (with provenance: machine, commit,
versions) and sqs_ablations.md. Re-running resumes finished variants from their checkpoints.

    .venv/bin/python benchmarks/sqs_ablations.py --config configs/mnist-mlp100-sqs.yaml --epochs 10 --threads 2
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import wasserstein_distance

from edgebayes.config import as_dict, load_pipeline_config
from edgebayes.data import load_data
from edgebayes.compressed import codebook
from edgebayes.compressed.samples import MCAverage, compress, predict
from edgebayes.provenance import provenance, write_json
from edgebayes.train.metrics import classification_metrics
from edgebayes.train.sqs import assign_windows, pretrained_base, train_sqs

RATES = (0.5, 0.3, 0.2)
COMPONENTS = (2, 4, 16)
MC = (1, 4, 8)


def accuracy(model, splits, rate, m=None, greedy=False, seed=0):
    """Test accuracy at a non-zero rate: MC average of m samples (eq. 10) or the greedy network (eq. 34)."""
    if greedy:
        module = MCAverage([model.posterior_sample(rate, None, greedy=True)[0]])
    else:
        module = compress(model, rate, m, seed).mc_model()
    probs = predict(module, splits.test_x).numpy()
    return classification_metrics(probs, splits.test_y.numpy())["accuracy"]


class Runner:
    def __init__(self, cfg, splits, work, epochs, log):
        self.cfg, self.splits, self.work, self.epochs, self.log = cfg, splits, work, epochs, log
        self.base, self.base_test = pretrained_base(cfg, splits, work, log)
        self.cache = {}

    def fine_tune(self, masked=True, **sqs):
        """Fine-tune one variant (memoised by its settings); returns (model, seconds). `masked=False`: eq. 8
        without the training forward's hard top-r_t mask (train_sqs)."""
        key = json.dumps({**sqs, "masked": masked}, sort_keys=True)
        if key not in self.cache:
            name = "_".join(f"{k}-{v}" for k, v in sorted(sqs.items())) + ("" if masked else "_unmasked")
            cfg = self.cfg.model_copy(update={
                "train": self.cfg.train.model_copy(update={"epochs": self.epochs}),
                "sqs": self.cfg.sqs.model_copy(update={"checkpoint": str(self.work / "pretrained.pt"), **sqs})})
            t0 = time.perf_counter()
            model, history = train_sqs(cfg, self.splits, self.work / name / "checkpoint.pt", log=lambda *a: None,
                                       masked=masked)
            seconds = sum(h["seconds"] for h in history)
            self.log(f"  {name}: {seconds:.0f} s of fine-tuning ({time.perf_counter() - t0:.0f} s here)")
            self.cache[key] = (model, seconds)
        return self.cache[key]

    def drop(self, acc):
        return self.base_test["accuracy"] - acc


def prior_ablation(r: Runner):
    rows = []
    for rate in RATES:
        row = {"bits": math.log2(r.cfg.sqs.components), "nonzero_rate": rate,
               "rate_formula": 32 / math.log2(r.cfg.sqs.components) / rate}
        for prior in ("gaussian", "spike-slab"):
            model, seconds = r.fine_tune(prior=prior, nonzero_rate=rate)
            acc = accuracy(model, r.splits, rate, m=4)
            rates = model.write_compressed(r.work / "tmp.sqs", rate, m=1)
            row[prior] = {"accuracy": acc, "drop": r.drop(acc), "rate_bytes": rates["rate_bytes"],
                          "seconds": seconds}
        rows.append(row)
        r.log(f"prior: non-zero {rate}: drop gaussian {row['gaussian']['drop']:+.4f}, "
              f"spike-slab {row['spike-slab']['drop']:+.4f}")
    return rows


def mask_ablation(r: Runner):
    """The training forward's hard top-r_t mask (a documented deviation, train/sqs.py) vs eq. 8 unmasked."""
    rows = []
    for rate in RATES:
        row = {"nonzero_rate": rate}
        for masked in (True, False):
            model, seconds = r.fine_tune(masked=masked, nonzero_rate=rate)
            acc = accuracy(model, r.splits, rate, m=4)
            with torch.no_grad():
                keep = torch.cat([model.posterior(n).keep_probability(model.tau_prime).expand(
                    model.posterior(n).theta.shape).reshape(-1) for n in model.wrapped])
            row["masked" if masked else "unmasked"] = {"accuracy": acc, "drop": r.drop(acc), "seconds": seconds,
                                                       "train_keep_fraction": float((keep > 0.5).float().mean())}
        rows.append(row)
        r.log(f"mask: non-zero {rate}: drop masked {row['masked']['drop']:+.4f}, "
              f"unmasked {row['unmasked']['drop']:+.4f}")
    return rows


def inference_ablation(r: Runner):
    rows = []
    for k in COMPONENTS:
        model, seconds = r.fine_tune(components=k, nonzero_rate=1.0, windows="single")
        row = {"components": k, "bits": math.log2(k), "nonzero_rate": 1.0, "seconds": seconds,
               "greedy": r.drop(accuracy(model, r.splits, 1.0, greedy=True))}
        for m in MC:
            row[f"bayes_m{m}"] = r.drop(accuracy(model, r.splits, 1.0, m=m))
        rows.append(row)
        r.log(f"inference: K={k}: drop greedy {row['greedy']:+.4f}, Bayesian M=8 {row['bayes_m8']:+.4f}")
    return rows


def distribution_match(model, base, gen_seed=0):
    """Per network: W1 distance between full-precision and quantized (unpruned, greedy) weights, and the
    mean |Q(theta) - theta| over the outliers (beyond q1 - 5 IQR, q3 + 5 IQR) and over all weights."""
    w1, tail_err, all_err, n_tail = [], [], [], 0
    quantized = model.quantized_weights(1.0, None, greedy=True)
    for name in model.wrapped:
        theta = base.get_submodule(name).weight.detach().numpy().ravel()
        q = quantized[name].numpy().ravel()
        w1.append(wasserstein_distance(theta, q))
        tails = np.isin(assign_windows(theta, "outlier", model.iqr_factor), (0, 3))
        n_tail += int(tails.sum())
        all_err.append(np.abs(q - theta).mean())
        if tails.any():
            tail_err.append(np.abs(q - theta)[tails].mean())
    return {"wasserstein1_mean": float(np.mean(w1)), "abs_error_mean": float(np.mean(all_err)),
            "outliers": n_tail, "outlier_abs_error_mean": float(np.mean(tail_err)) if tail_err else None}


def windows_ablation(r: Runner):
    rows = []
    rate = r.cfg.sqs.nonzero_rate
    for windows in ("outlier", "equal", "single"):
        model, seconds = r.fine_tune(windows=windows, nonzero_rate=rate)
        acc = accuracy(model, r.splits, rate, m=4)
        rates = model.write_compressed(r.work / "tmp.sqs", rate, m=1)
        rows.append({"windows": windows, "components": model.components, "nonzero_rate": rate,
                     "accuracy": acc, "drop": r.drop(acc), "rate_formula": rates["rate_formula"],
                     "rate_bytes": rates["rate_bytes"], "levels_stored_bits": rates["bits_stored"],
                     "seconds": seconds, **distribution_match(model, r.base)})
        r.log(f"windows: {windows}: drop {rows[-1]['drop']:+.4f}, {rates['rate_bytes']:.1f}x by bytes")
    return rows


def scores_ablation(r: Runner):
    """The first layer's keep scores per weight (paper 001) vs per input pixel (train/sqs.py), across
    non-zero rates: accuracy, and where the file's bytes go (mask vs indices)."""
    rows = []
    for rate in RATES:
        row = {"nonzero_rate": rate, "rate_formula": 32 / math.log2(r.cfg.sqs.components) / rate}
        for scores in ("per-weight", "per-input"):
            extra = {} if scores == "per-weight" else {"first_layer_scores": scores}  # shares prior's variant
            model, seconds = r.fine_tune(prior="spike-slab", nonzero_rate=rate, **extra)
            acc = accuracy(model, r.splits, rate, m=4)
            rates = model.write_compressed(r.work / "tmp.sqs", rate, m=1)
            parts = codebook.section_bytes(model.layer_codes(rate, m=1))
            row[scores] = {"accuracy": acc, "drop": r.drop(acc), "rate_bytes": rates["rate_bytes"],
                           "file_bytes": rates["file_bytes"], "seconds": seconds,
                           **{f"{k}_bits_per_weight": 8 * v / rates["weights"] for k, v in parts.items()}}
        rows.append(row)
        r.log(f"scores: non-zero {rate}: drop per-weight {row['per-weight']['drop']:+.4f} "
              f"({row['per-weight']['rate_bytes']:.1f}x), per-input {row['per-input']['drop']:+.4f} "
              f"({row['per-input']['rate_bytes']:.1f}x)")
    return rows


def markdown(result) -> str:
    p = result["provenance"]
    machine = p["machine"]
    lines = [f"# SQS ablations (paper 001) on {result['dataset']}, MLP {result['hidden']}",
             "", f"Machine: {machine.get('processor') or machine.get('machine')}, {machine.get('cpu_count')} CPU cores "
             f"(shared), {machine.get('platform')}; torch threads {result['threads']}; commit {p['git_commit']}; seed {result['seed']}; "
             f"{result['epochs']} fine-tuning epochs per variant from one full-precision network "
             f"({result['pretrain_epochs']} epochs, test accuracy {result['full_precision_accuracy']:.4f}). "
             f"Drops are full-precision minus compressed test accuracy ({result['test_images']} test images; "
             f"positive = worse). Fine-tuning: batch {result['batch_size']}, train.kl_weight {result['kl_weight']}. "
             f"Settings otherwise as {result['config']}. Total time {result['seconds'] / 60:.1f} min.", ""]
    if "prior" in result:
        lines += ["## Prior: Gaussian vs spike-and-slab (MC average, M = 4)", "",
                  "| Bits | Non-zero | Rate (formula) | Drop, Gaussian prior | Drop, spike-and-slab | Rate by bytes (G / SS) |",
                  "|---|---|---|---|---|---|"]
        for row in result["prior"]:
            g, s = row["gaussian"], row["spike-slab"]
            lines.append(f"| {row['bits']:g} | {row['nonzero_rate']:.0%} | {row['rate_formula']:.0f}x | "
                         f"{g['drop']:+.2%} | {s['drop']:+.2%} | {g['rate_bytes']:.1f}x / {s['rate_bytes']:.1f}x |")
        lines.append("")
    if "inference" in result:
        lines += ["## Inference: greedy (eq. 34) vs Bayesian averaging (eq. 10), no pruning", "",
                  "| K | Bits | Drop, greedy | " + " | ".join(f"Drop, Bayesian M = {m}" for m in MC) + " |",
                  "|---|---|---|" + "---|" * len(MC)]
        for row in result["inference"]:
            lines.append(f"| {row['components']} | {row['bits']:g} | {row['greedy']:+.2%} | "
                         + " | ".join(f"{row[f'bayes_m{m}']:+.2%}" for m in MC) + " |")
        lines.append("")
    if "windows" in result:
        lines += ["## Windows: outlier-aware vs equal (vs one per layer), K = 4, MC average M = 4", "",
                  "| Windows | Non-zero | Drop | Rate (formula) | Rate by bytes | Stored bits per index | "
                  "W1(theta, Q(theta)) | mean abs error | outliers | mean abs error on outliers |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for row in result["windows"]:
            tail = row["outlier_abs_error_mean"]
            lines.append(f"| {row['windows']} | {row['nonzero_rate']:.0%} | {row['drop']:+.2%} | "
                         f"{row['rate_formula']:.0f}x | {row['rate_bytes']:.1f}x | {row['levels_stored_bits']} | "
                         f"{row['wasserstein1_mean']:.2e} | {row['abs_error_mean']:.2e} | {row['outliers']} | "
                         f"{'n/a' if tail is None else f'{tail:.2e}'} |")
        lines.append("")
    if "mask" in result:
        lines += ["## Training with the hard top-r_t mask (the default, a deviation) vs eq. 8 unmasked (MC average, "
                  "M = 4)", "", "Keep fraction: share of weights with lambda~ > 0.5 at the end of training; both "
                  "are pruned to the non-zero rate at inference.", "",
                  "| Non-zero | Drop, masked | Drop, unmasked | Keep fraction masked / unmasked |", "|---|---|---|---|"]
        for row in result["mask"]:
            a, b = row["masked"], row["unmasked"]
            lines.append(f"| {row['nonzero_rate']:.0%} | {a['drop']:+.2%} | {b['drop']:+.2%} | "
                         f"{a['train_keep_fraction']:.2f} / {b['train_keep_fraction']:.2f} |")
        lines.append("")
    if "scores" in result:
        lines += ["## First layer's keep scores: per weight (paper 001) vs per input pixel (MC average, M = 4)", "",
                  "Mask and indices: bits per weight of each stream entropy-coded alone (compressed/codebook.py "
                  "section_bytes).", "",
                  "| Non-zero | Rate (formula) | Scores | Drop | Rate by bytes | File bytes | Mask bits / weight | "
                  "Index bits / weight |", "|---|---|---|---|---|---|---|---|"]
        for row in result["scores"]:
            for scores in ("per-weight", "per-input"):
                v = row[scores]
                lines.append(f"| {row['nonzero_rate']:.0%} | {row['rate_formula']:.0f}x | {scores} | {v['drop']:+.2%} | "
                             f"{v['rate_bytes']:.1f}x | {v['file_bytes']} | {v['mask_bits_per_weight']:.2f} | "
                             f"{v['indices_bits_per_weight']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/mnist-mlp-sqs.yaml")
    parser.add_argument("--epochs", type=int, default=2, help="SQS fine-tuning epochs per variant")
    parser.add_argument("--only", nargs="*", choices=("prior", "inference", "windows", "scores", "mask"),
                        default=["inference", "windows", "prior", "scores", "mask"])
    parser.add_argument("--work", default="runs/sqs-ablations", help="checkpoints (resumable)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hidden", type=int, nargs="*", help="MLP widths instead of the config's (CPU budget)")
    parser.add_argument("--batch-size", type=int, help="instead of the config's train.batch_size")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = load_pipeline_config(args.config)
    if args.hidden:
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"hidden": args.hidden})})
    if args.batch_size:
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"batch_size": args.batch_size})})
    splits = load_data(cfg.data, cfg.seed)
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    runner = Runner(cfg, splits, work, args.epochs, log=lambda *a: print(*a, flush=True))
    result = {"config": args.config, "dataset": cfg.data.dataset, "test_images": len(splits.test_x),
              "threads": args.threads, "hidden": cfg.model.hidden, "seed": cfg.seed, "epochs": args.epochs,
              "pretrain_epochs": cfg.sqs.pretrain_epochs, "full_precision_accuracy": runner.base_test["accuracy"],
              "sqs": as_dict(cfg.sqs), "kl_weight": cfg.train.kl_weight, "batch_size": cfg.train.batch_size}
    for name in args.only:  # results are written after each ablation, so a cut-short run keeps what finished
        result[name] = {"prior": prior_ablation, "inference": inference_ablation, "windows": windows_ablation,
                        "scores": scores_ablation, "mask": mask_ablation}[name](runner)
        result["seconds"] = time.perf_counter() - t0
        result["provenance"] = provenance("sqs-ablations")
        write_json(out / "sqs_ablations.json", result)
        (out / "sqs_ablations.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
