"""SQS (paper 001) over training seeds: the accuracy drop against the full-precision start and the
compression rate measured from file bytes, per config (issue 5's criterion: at most 1 point lost, at least
25x by bytes, at 2 bits and 50% non-zero on MNIST).

For each config and seed the pipeline's own train stage runs: the deterministic network is trained (the
seed sets its initial weights and batch order; the data split stays the config's), then SQS fine-tuning.
Test accuracy is the pipeline's: MC average of train.mc_samples_eval samples at the config's non-zero rate.
The compressed file of one sample (train/model.sqs, as the pipeline writes it) gives the rate by bytes, and
compressed/codebook.py's section_bytes where those bytes go.

Deployed bytes (issue 21): the same sample (M = 1, the one model.sqs holds) exported as the fp32 ONNX and as
"onnx-codebook" (export/lowbit.py: bit-packed level indices + codebooks, pruned inputs removed), each file's
bytes, its test accuracy and its largest probability difference to model.sqs's network in PyTorch, batch-1
latency of both in interleaved rounds (benchmarks/export_common.py time_artifacts, --threads threads), and
the RSS that onnxruntime's session adds for each file (a fresh process per file: import, then session +
one run), for the codebook file also with constant folding off (the weights then stay packed in memory
and are decoded at every call). Results: <out>/<name>.json (with provenance:
machine, commit, versions), <name>.md and <name>.png (drop against rate by bytes, one point per seed).
Finished runs resume from their checkpoints in --work.

    .venv/bin/python benchmarks/sqs_compression.py --threads 2 \\
        --configs configs/mnist-mlp100-sqs.yaml configs/mnist-mlp100-sqs-inputs.yaml --seeds 0 1 2
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from edgebayes.compressed import codebook
from edgebayes.compressed.samples import compress, predict
from edgebayes.config import as_dict, load_pipeline_config
from edgebayes.data import load_data
from edgebayes.errors import InputError
from edgebayes.export.formats import artifact_predict, export_artifact
from edgebayes.export.lowbit import breakdown
from edgebayes.provenance import atomic_path, provenance, write_json
from edgebayes.train.sqs import load_compressed, stage_summary, train_sqs
from edgebayes.train.trainer import evaluate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export_common import time_artifacts  # noqa: E402

MAX_DROP, MIN_RATE = 0.01, 25.0  # issue 5
MIN_DEPLOYED_RATE = {"per-input": 20.0, "per-weight": 12.0}  # issue 21: fp32 ONNX bytes / onnx-codebook bytes
FIDELITY = 1e-4

# Run in a fresh interpreter: the RSS that one onnxruntime session (created, run once) adds to the process.
SESSION_RSS = """
import sys, numpy as np, onnxruntime as ort
from edgebayes.ondevice.machine import current_rss_mb
path, fold, threads = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
x = np.load(sys.argv[4])
before = current_rss_mb()
opts = ort.SessionOptions()
opts.intra_op_num_threads = threads
s = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"],
                         disabled_optimizers=[] if fold else ["ConstantFolding"])
s.run(None, {"input": x})
import time
lat = []
for _ in range(300):
    t0 = time.perf_counter(); s.run(None, {"input": x}); lat.append(time.perf_counter() - t0)
print(current_rss_mb() - before, 1e3 * float(np.median(lat)))
"""


def session_cost(path, x1, fold, threads):
    """(MB of RSS a session of `path` adds, median ms of 300 batch-1 calls), in a fresh process."""
    import os
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".npy") as f:
        np.save(f.name, x1)
        out = subprocess.run([sys.executable, "-c", SESSION_RSS, str(path), "1" if fold else "0", str(threads), f.name],
                             capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    mb, ms = map(float, out.stdout.split())
    return {"session_rss_mb": mb, "median_ms_300_calls": ms}


def deployed(model, cfg, splits, work: Path, threads: int) -> dict:
    """model.sqs's sample as the fp32 ONNX and as onnx-codebook: bytes, accuracy, fidelity, latency, memory."""
    rate, y = cfg.sqs.nonzero_rate, splits.test_y.numpy()
    mc = compress(model, rate, 1, seed=0).mc_model()  # the sample model.sqs holds (layer_codes' seed 0)
    sqs_net = load_compressed(work / "model.sqs", model.base)
    reference = torch.softmax(predict(sqs_net, splits.test_x), -1).numpy()  # model.sqs's network in PyTorch
    x = splits.test_x
    out = {"reference_accuracy": float((reference.argmax(1) == y).mean()), "formats": {}}
    paths = {}
    for fmt in ("onnx", "onnx-codebook"):
        details = {}
        path = export_artifact(mc, fmt, work / f"deployed-{fmt}.onnx", x[:16], details=details)
        probs = artifact_predict(path, fmt, x.numpy(), threads=threads)
        paths[fmt] = (path, fmt)
        out["formats"][fmt] = {"bytes": path.stat().st_size, "accuracy": float((probs.argmax(1) == y).mean()),
                               "max_abs_prob_diff": float(np.abs(probs - reference).max()),
                               "breakdown": details.get("bytes_breakdown") or breakdown(path),
                               "inputs_removed": details.get("inputs_removed")}
    x1 = np.ascontiguousarray(x[:1].numpy(), dtype=np.float32)
    timing = time_artifacts(paths, x1, threads=threads)
    for fmt, (path, _) in paths.items():
        out["formats"][fmt]["latency"] = timing[fmt]
        out["formats"][fmt]["session"] = session_cost(path, x1, True, threads)
    out["codebook_unfolded_session"] = session_cost(paths["onnx-codebook"][0], x1, False, threads)
    f = out["formats"]
    out["deployed_rate"] = f["onnx"]["bytes"] / f["onnx-codebook"]["bytes"]
    return out


def run_one(cfg, splits, work: Path, log, threads=1) -> dict:
    """Pretrain + fine-tune one seed (resumable) and measure it."""
    t0 = time.perf_counter()
    model, history = train_sqs(cfg, splits, work / "checkpoint.pt", log=log)
    rate = cfg.sqs.nonzero_rate
    test, _, _ = evaluate(model, splits.test_x, splits.test_y, rate, cfg.train.mc_samples_eval, cfg.seed)
    rates = stage_summary(model, splits, work, rate, test)  # the train stage's figures, model.sqs written
    parts = codebook.section_bytes(model.layer_codes(rate, m=1))
    first = model.keep_masks(rate)[model.wrapped[0]]
    drop = rates["accuracy_drop"]
    dep = deployed(model, cfg, splits, work, threads)
    codebook_onnx = dep["formats"]["onnx-codebook"]
    return {"deployed": dep,"seed": cfg.seed, "full_precision_accuracy": rates["full_precision_test"]["accuracy"],
            "val_accuracy": history[-1]["val_accuracy"],
            "test_accuracy": test["accuracy"], "test_nll": test["nll"], "test_ece": test["ece"], "drop": drop,
            "fine_tune_seconds": sum(h["seconds"] for h in history), "seconds": time.perf_counter() - t0,
            "first_layer_inputs_kept": int(first.reshape(first.shape[0], -1).any(0).sum()),
            "first_layer_inputs": int(first[0].numel()),
            **{k: rates[k] for k in ("weights", "kept_weights", "nonzero_rate", "rate_formula", "fp32_bytes",
                                     "file_bytes", "rate_bytes", "bits_per_weight_file")},
            **{f"{k}_bits_per_weight": 8 * v / rates["weights"] for k, v in parts.items()},
            "meets": {"drop_at_most_1_point": drop <= MAX_DROP, "rate_bytes_at_least_25x": rates["rate_bytes"] >= MIN_RATE,
                      "deployed_rate": dep["deployed_rate"] >= MIN_DEPLOYED_RATE[cfg.sqs.first_layer_scores],
                      "deployed_fidelity": codebook_onnx["max_abs_prob_diff"] <= FIDELITY}}


def summary(runs) -> dict:
    keys = ("drop", "test_accuracy", "rate_bytes", "mask_bits_per_weight", "indices_bits_per_weight")
    return {**{f"{k}_mean": float(np.mean([r[k] for r in runs])) for k in keys},
            "drop_max": max(r["drop"] for r in runs), "rate_bytes_min": min(r["rate_bytes"] for r in runs),
            "all_meet": all(all(r["meets"].values()) for r in runs)}


def markdown(result) -> str:
    p, machine = result["provenance"], result["provenance"]["machine"]
    lines = [f"# SQS on {result['dataset']} over {len(result['seeds'])} training seeds: accuracy drop and "
             "compression rate by file bytes", "",
             f"`{result['command']}`", "",
             f"Machine: {machine.get('processor') or machine.get('machine')}, {machine.get('cpu_count')} CPU cores "
             f"(shared); torch threads {result['threads']}; commit {p['git_commit']}; {p['created_at']}. "
             f"Drop: full-precision minus SQS test accuracy in points ({result['test_images']:,} test images; "
             f"positive = worse), "
             f"the SQS net MC-averaged. Rate by bytes: fp32 weights and biases / bytes of train/model.sqs (one "
             f"sample, as the train stage writes it). Mask and index bits per weight: each stream entropy-coded alone "
             f"(compressed/codebook.py section_bytes). Issue 5 asks for a drop <= {100 * MAX_DROP:g} point and >= "
             f"{MIN_RATE:g}x by bytes.", ""]
    for entry in result["configs"]:
        s = entry["sqs"]
        lines += [f"## {entry['config']}: {entry['arch']} {entry['hidden']}, K = {s['components']}, "
                  f"{s['nonzero_rate']:.0%} non-zero, first-layer scores {s['first_layer_scores']}, "
                  f"{entry['epochs']} epochs", "",
                  "| Seed | Full precision | SQS val | SQS test | Drop (points) | Rate (formula) | File bytes | "
                  "Rate by bytes | Bits / weight | Mask bits / weight | Index bits / weight | Inputs kept | Meets |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in entry["runs"]:
            lines.append(f"| {r['seed']} | {r['full_precision_accuracy']:.4f} | {r['val_accuracy']:.4f} | "
                         f"{r['test_accuracy']:.4f} | {100 * r['drop']:+.2f} | {r['rate_formula']:.0f}x | "
                         f"{r['file_bytes']} | {r['rate_bytes']:.1f}x | {r['bits_per_weight_file']:.2f} | "
                         f"{r['mask_bits_per_weight']:.2f} | {r['indices_bits_per_weight']:.2f} | "
                         f"{r['first_layer_inputs_kept']} / {r['first_layer_inputs']} | "
                         f"{'yes' if all(r['meets'].values()) else 'no'} |")
        lines += deployed_table(entry)
        m = entry["summary"]
        lines += [f"| mean | | | {m['test_accuracy_mean']:.4f} | {100 * m['drop_mean']:+.2f} (max "
                  f"{100 * m['drop_max']:+.2f}) | | | {m['rate_bytes_mean']:.1f}x (min {m['rate_bytes_min']:.1f}x) | | "
                  f"{m['mask_bits_per_weight_mean']:.2f} | {m['indices_bits_per_weight_mean']:.2f} | | "
                  f"{'yes' if m['all_meet'] else 'no'} |", ""]
    return "\n".join(lines)


def deployed_table(entry) -> list:
    """Issue 21: the deployed files of each seed's model.sqs sample (M = 1), fp32 ONNX beside onnx-codebook."""
    need = MIN_DEPLOYED_RATE[entry["sqs"]["first_layer_scores"]]
    lines = ["", f"Deployed bytes (M = 1, model.sqs's sample; issue 21 asks >= {need:g}x against the fp32 ONNX, "
             f"max |p - p_torch| <= {FIDELITY:g}). Sections of the codebook file: indices / mask / codebooks / "
             "biases / graph (bytes). Session RSS: what one onnxruntime session adds to a fresh process; 'unfolded': "
             "the codebook file with constant folding off (weights kept packed, decoded every call).", "",
             "| Seed | Format | Deployed bytes | Ratio to fp32 ONNX | Test accuracy | model.sqs net accuracy | "
             "max abs p - p_torch | Latency p50 (interleaved) | Session RSS MB | Inputs removed | Sections |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in entry["runs"]:
        d = r["deployed"]
        fp32 = d["formats"]["onnx"]["bytes"]
        for fmt, f in d["formats"].items():
            sec = f["breakdown"]["sections"]
            parts = ("fp32 weights {weights}, biases {biases}, graph {graph}" if fmt == "onnx" else
                     "{indices} / {mask} / {codebooks} / {biases} / {graph}").format(**sec)
            lines.append(f"| {r['seed']} | {fmt} | {f['bytes']:,} | {fp32 / f['bytes']:.1f}x | {f['accuracy']:.4f} | "
                         f"{d['reference_accuracy']:.4f} | {f['max_abs_prob_diff']:.1e} | "
                         f"{1e3 * f['latency']['median_ms']:.1f} us | {f['session']['session_rss_mb']:.2f} | "
                         f"{f['inputs_removed'] if f['inputs_removed'] is not None else '-'} | {parts} |")
        u = d["codebook_unfolded_session"]
        lines.append(f"| {r['seed']} | onnx-codebook, unfolded | | | | | | {1e3 * u['median_ms_300_calls']:.1f} us "
                     f"(300 calls, not interleaved) | {u['session_rss_mb']:.2f} | | |")
    return lines + [""]


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for entry in result["configs"]:
        runs = entry["runs"]
        ax.scatter([r["rate_bytes"] for r in runs], [100 * r["drop"] for r in runs],
                   label=f"{Path(entry['config']).stem} (first-layer scores {entry['sqs']['first_layer_scores']})")
    ax.axhline(100 * MAX_DROP, color="grey", ls="--", lw=1)
    ax.axvline(MIN_RATE, color="grey", ls="--", lw=1)
    ax.set_xlabel("compression rate by file bytes (x)")
    ax.set_ylabel("accuracy drop against full precision (points)")
    ax.set_title("SQS, 2 bits, 50% non-zero: one point per seed; issue 5's target: right of 25x, below 1 point",
                 fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", required=True, help="SQS pipeline configs")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds")
    parser.add_argument("--work", default="runs/sqs-compression", help="checkpoints (resumable)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="sqs_mnist_mlp100", help="file name of the results (no suffix)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds {args.seeds} are not all different")
    torch.set_num_threads(args.threads)
    try:
        cfgs = [load_pipeline_config(c) for c in args.configs]
    except InputError as e:
        print(f"sqs_compression: {e}", file=sys.stderr)
        return 2
    not_sqs = [c for c, cfg in zip(args.configs, cfgs) if cfg.model.family != "sqs"]
    if not_sqs:
        print(f"sqs_compression: {', '.join(not_sqs)}: model.family is not sqs", file=sys.stderr)
        return 2
    result = {"command": "python benchmarks/sqs_compression.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "dataset": cfgs[0].data.dataset, "test_images": None, "seeds": args.seeds, "threads": args.threads, "configs": []}
    for path, cfg in zip(args.configs, cfgs):
        splits = load_data(cfg.data, cfg.seed)  # one split and test set; the seeds vary training only
        result["test_images"] = len(splits.test_x)
        runs = []
        for seed in args.seeds:
            print(f"{path}: seed {seed}", flush=True)
            work = Path(args.work) / Path(path).stem / f"seed{seed}"
            work.mkdir(parents=True, exist_ok=True)
            runs.append(run_one(cfg.model_copy(update={"seed": seed}), splits, work, log=lambda *a: None,
                                threads=args.threads))
            r = runs[-1]
            print(f"  drop {100 * r['drop']:+.2f} points, {r['rate_bytes']:.1f}x by bytes "
                  f"({r['file_bytes']} B), {r['fine_tune_seconds']:.0f} s", flush=True)
        result["configs"].append({"config": path, "arch": cfg.model.arch, "hidden": cfg.model.hidden,
                                  "epochs": cfg.train.epochs, "sqs": as_dict(cfg.sqs), "runs": runs,
                                  "summary": summary(runs)})
    result["provenance"] = provenance("sqs-compression")
    out = Path(args.out)
    write_json(out / f"{args.name}.json", result)
    with atomic_path(out / f"{args.name}.md") as tmp:
        Path(tmp).write_text(markdown(result))
    plot(result, out / f"{args.name}.png")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
