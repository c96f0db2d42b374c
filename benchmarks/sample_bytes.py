"""Bytes per extra Monte-Carlo sample (issue 21): the deployed ONNX of M = 1, 2, 4, 8 posterior samples of
LeNet-5-Caffe on MNIST, SQS (paper 001) and SS-GHS (paper 000), with fp32 / fp16 / int8 weight storage (and
the low-bit codebook form for SQS), the test accuracy and ECE of each file run by onnxruntime.

Training is the pipeline's own train stage (cached under --runs-dir), on a short budget given by --epochs
(SS-GHS) and --sqs-epochs / --sqs-pretrain-epochs (SQS): the figures are for that budget, not the papers'.
Each model is compressed at its config's default knob (SQS: non-zero rate; SS-GHS: inclusion threshold 0.5)
and exported in the packed layout (export/packed.py): the M samples run as one network. Storage
(export/lowbit.py): fp32 as exported; fp16 and int8 rewrite the weight tensors (fp16 + Cast; int8
symmetric per output channel + DequantizeLinear), biases stay fp32; onnx-codebook (SQS only) stores level
indices and one codebook per layer, the mask once for the M samples where they share it. Bytes per extra
sample = (bytes(M) - bytes(1)) / (M - 1) at the largest M. Accuracy and ECE on the first --test-rows test
images (15 bins, the runner's metric functions).

    EDGEBAYES_DATA=../shared/datasets python benchmarks/sample_bytes.py --epochs 3 --sqs-pretrain-epochs 3 \
        --sqs-epochs 1 --threads 1   (mnist-lenet5-ssghs.yaml names no data.root)
"""

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import torch

from edgebayes.compressed.samples import compress
from edgebayes.config import load_device_profile, load_pipeline_config
from edgebayes.export.formats import artifact_predict, export_artifact
from edgebayes.export.lowbit import breakdown, weight_storage
from edgebayes.ondevice.metrics import classification_metrics
from edgebayes.provenance import atomic_path, provenance, write_json
from edgebayes.stages import Context, load_trained_model, run_stage, splits_for

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"sqs": "configs/mnist-lenet5-sqs.yaml", "ss-ghs": "configs/mnist-lenet5-ssghs.yaml"}
MS = (1, 2, 4, 8)


def variant(name, args):
    cfg = copy.deepcopy(load_pipeline_config(ROOT / CONFIGS[name]))
    cfg.name = f"{cfg.name}-bytes"
    if name == "sqs":
        cfg.train.epochs, cfg.sqs.pretrain_epochs = args.sqs_epochs, args.sqs_pretrain_epochs
    else:
        cfg.train.epochs = args.epochs
    cfg.train.lr_milestones = [m for m in cfg.train.lr_milestones if m <= cfg.train.epochs]
    return cfg


def storages(name):
    return ("fp32", "fp16", "int8", "codebook") if name == "sqs" else ("fp32", "fp16", "int8")


def measure(name, ctx, test_rows, threads, log):
    model, splits = load_trained_model(ctx), splits_for(ctx)
    x, y = splits.test_x[:test_rows], splits.test_y[:test_rows].numpy()
    knob = model.operating_points(None)[0] if name == "sqs" else 0.5
    rows, kept = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for m in MS:
            compressed = compress(model, knob, m, ctx.cfg.seed)
            mc, kept = compressed.mc_model(), {k: int(v.sum()) for k, v in compressed.kept.items()}
            fp32 = export_artifact(mc, "onnx", Path(tmp) / f"m{m}-fp32.onnx", x[:16])
            for storage in storages(name):
                path = Path(tmp) / f"m{m}-{storage}.onnx"
                if storage == "codebook":
                    export_artifact(mc, "onnx-codebook", path, x[:16])
                elif storage != "fp32":
                    weight_storage(fp32, path, storage)
                else:
                    path = fp32
                probs = artifact_predict(path, "onnx", x.numpy(), threads=threads)
                met = classification_metrics(probs, y)
                rows.append({"model": name, "M": m, "storage": storage, "bytes": path.stat().st_size,
                             "accuracy": met["accuracy"], "ece": met["ece"], "nll": met["nll"],
                             "sections": breakdown(path, fp32)["sections"]})
                log(f"{name} M={m} {storage}: {rows[-1]['bytes']:,} B, accuracy {met['accuracy']:.4f}, "
                    f"ECE {met['ece']:.4f}")
    return {"knob": model.knob, "knob_value": knob, "kept_units": kept, "rows": rows}


def per_sample(rows):
    """{(model, storage): bytes per extra sample between M = 1 and the largest M}."""
    out = {}
    for r in rows:
        key = (r["model"], r["storage"])
        by_m = {q["M"]: q["bytes"] for q in rows if (q["model"], q["storage"]) == key}
        out[key] = (by_m[MS[-1]] - by_m[1]) / (MS[-1] - 1)
    return out


def markdown(result):
    p = result["provenance"]
    extra = per_sample([r for m in result["models"].values() for r in m["rows"]])
    lines = ["# Bytes per extra MC sample: LeNet-5-Caffe on MNIST, SQS and SS-GHS", "",
             f"`{result['command']}`", "",
             f"Short training budget (not the papers'): {result['budget']}. Accuracy and ECE of each ONNX file run "
             f"by onnxruntime on the first {result['test_rows']:,} test images. Packed layout. Bytes per extra "
             f"sample: (bytes(M = {MS[-1]}) - bytes(M = 1)) / {MS[-1] - 1}. Machine {p['machine'].get('machine')}, "
             f"{p['machine'].get('cpu_count')} CPU cores, commit {p['git_commit']}, {p['created_at']}.", "",
             "What is shared between samples is stored once: the codebooks and (SQS, whose inclusion is "
             "deterministic) the mask; the samples' kept structure is one network (surgery), so no mask is "
             "stored for SS-GHS. At this budget SS-GHS has not pruned a unit yet (kept units below): every "
             "sample is the whole network, and its bytes per sample are the dense weights' in each storage.", ""]
    for name, entry in result["models"].items():
        lines += [f"## {name} (knob {entry['knob']} = {entry['knob_value']}; kept units {entry['kept_units']})", "",
                  "| Storage | M | File bytes | Bytes per extra sample | Accuracy | ECE | indices / mask / codebooks / "
                  "biases / fp32-fp16-int8 weights / graph |", "|---|---|---|---|---|---|---|"]
        for r in entry["rows"]:
            s = r["sections"]
            lines.append(f"| {r['storage']} | {r['M']} | {r['bytes']:,} | "
                         f"{extra[(name, r['storage'])]:,.0f} | {r['accuracy']:.4f} | {r['ece']:.4f} | "
                         f"{s['indices']} / {s['mask']} / {s['codebooks']} / {s['biases']} / {s['weights']} / "
                         f"{s['graph']} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--epochs", type=int, default=3, help="SS-GHS training epochs")
    ap.add_argument("--sqs-pretrain-epochs", type=int, default=3)
    ap.add_argument("--sqs-epochs", type=int, default=1, help="SQS fine-tuning epochs")
    ap.add_argument("--test-rows", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs-dir", default="runs/sample-bytes")
    ap.add_argument("--train-only", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/sample_bytes_lenet5_mnist"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    profile = load_device_profile("local")
    result = {"command": "python benchmarks/sample_bytes.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "budget": f"SS-GHS {args.epochs} epochs; SQS {args.sqs_pretrain_epochs} pretraining + "
                        f"{args.sqs_epochs} fine-tuning epochs",
              "test_rows": args.test_rows, "models": {}}
    for name in args.models:
        cfg = variant(name, args)
        ctx = Context(cfg, profile, runs_dir=Path(args.runs_dir), config_path=CONFIGS[name])
        run_stage(ctx, "train")
        if not args.train_only:
            result["models"][name] = measure(name, ctx, args.test_rows, args.threads, print)
    if args.train_only:
        return 0
    result["provenance"] = provenance("sample-bytes")
    write_json(Path(args.out + ".json"), result)
    with atomic_path(Path(args.out + ".md")) as tmp:
        Path(tmp).write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
