"""Users' own networks through the whole compression path: bayesianize -> posterior samples -> surgery ->
packed MC graph -> ONNX, for torchvision classifiers and a home-made net, on the CPU.

For each network and family (ss-gl, ss-ghs), two cases:
  forced   the bayesianized net with 25% of the units of every prunable layer switched off (inclusion
           logits set to -10, seeded): what surgery can cut when a quarter of everything is dead;
  trained  the bayesianized net after a short real training on digits (8x8 upscaled to 32x32, 3 channels),
           kl_weight 0.1 as the embedded default: the channels the posterior itself switched off.
Per case: max |pruned - masked| over a probe batch (surgery's exactness), the FLOPs the masks promise
(paper 000's formula, `flops_ratio`) against the physical FLOPs after surgery, surgery's per-layer account
of every dead channel it kept and why, the packed M=4 ONNX's largest probability difference against
PyTorch, and the batch norms left unfolded in the packed graph.

    python benchmarks/own_models.py                     # all nets, both families, 2 training epochs
    python benchmarks/own_models.py --nets custom resnet18 --families ss-gl --train-epochs 1 --quick

Results: benchmarks/results/own_models.{json,md} (machine, commit and versions in the JSON).
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from torch import nn

from edgebayes.compressed.samples import compress
from edgebayes.compressed.surgery import remove_dead_units
from edgebayes.export.formats import artifact_predict, export_artifact
from edgebayes.provenance import atomic_path, provenance
from edgebayes.train.families import bayesianize
from edgebayes.compressed.structure import structure_report

RESULTS = Path(__file__).resolve().parent / "results"
SHAPE = (3, 32, 32)


class Custom(nn.Module):
    """A home-made net: residual add, depthwise-separable block, concatenation -> max-pool -> flatten ->
    Linear, and a second head on global average pooling (two output layers)."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.stem, self.bn0 = nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.res1, self.bn1 = nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.res2, self.bn2 = nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.dw, self.bn3 = nn.Conv2d(16, 16, 3, stride=2, padding=1, groups=16, bias=False), nn.BatchNorm2d(16)
        self.pw, self.bn4 = nn.Conv2d(16, 24, 1, bias=False), nn.BatchNorm2d(24)
        self.side, self.bn5 = nn.Conv2d(16, 8, 1, stride=2, bias=False), nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(4)
        self.fc1, self.fc2 = nn.Linear(32 * 4 * 4, 64), nn.Linear(64, num_classes)
        self.head = nn.Linear(32, num_classes)

    def forward(self, x):
        h = self.relu(self.bn0(self.stem(x)))
        h = self.relu(self.bn2(self.res2(self.relu(self.bn1(self.res1(h))))) + h)
        d = self.relu(self.bn4(self.pw(self.relu(self.bn3(self.dw(h))))))
        c = torch.cat([d, self.relu(self.bn5(self.side(h)))], 1)            # 32 x 16 x 16
        flat = torch.flatten(self.pool(c), 1)
        return self.fc2(self.relu(self.fc1(flat))) + self.head(F.adaptive_avg_pool2d(c, 1).flatten(1))


def make_net(name, classes=10):
    if name == "custom":
        return Custom(classes)
    import torchvision

    return getattr(torchvision.models, name)(weights=None, num_classes=classes)


def digits_32(seed=0):
    """scikit-learn's digits, bilinear to 32x32, gray replicated to 3 channels; seeded 80/20 split."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32)[:, None] / 16
    x = F.interpolate(x, size=SHAPE[1:], mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    y = torch.tensor(d.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    k = len(x) // 5
    return x[perm[k:]], y[perm[k:]], x[perm[:k]], y[perm[:k]]


def force_dead(net, fraction=0.25, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in net.bayesian_layers():
            if layer.prunable:
                dead = torch.randperm(layer.out_units, generator=g)[: int(layer.out_units * fraction)]
                layer.gamma_logit[dead] = -10.0


def onnx_batch_norms(path):
    """(BatchNormalization nodes, Mul nodes) in an ONNX graph: an unfolded BN shows up as either."""
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    return ops.count("BatchNormalization"), ops.count("Mul")


def measure(net, x_eval, m=4, seed=0):
    t0 = time.perf_counter()
    compressed = compress(net.eval(), 0.5, m, seed)
    dense, pruned = compressed.dense_sample, compressed.samples[0]
    with torch.no_grad():
        gap = float((pruned(x_eval[:8]) - dense(x_eval[:8])).abs().max())
    structure = structure_report(dense, pruned, compressed.kept, SHAPE)
    report = {}   # surgery again on sample 0, for its account of each dead channel it kept
    remove_dead_units(dense, compressed.kept, x_eval[:1], report=report)
    kept_why = {}
    for layer in report.values():
        for reason, n in layer["kept"].items():
            kept_why[reason] = kept_why.get(reason, 0) + n
    row = {"kept_units": sum(int(k.sum()) for k in compressed.kept.values()),
           "units": sum(int(k.numel()) for k in compressed.kept.values()),
           "dead_units": sum(layer["dead"] for layer in report.values()),
           "dead_removed": sum(layer["removed"] for layer in report.values()),
           "pruned_vs_masked": gap, "flops_promised": structure["flops_ratio"],
           "flops_physical": structure["physical_flops_ratio"], "surgery_kept": kept_why,
           "surgery_report": report}
    mc = compressed.mc_model()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        details = {}
        export_artifact(mc, "onnx", path, x_eval[:16], opset=17, layout="packed", details=details)
        probs = artifact_predict(path, "onnx", x_eval.numpy())
        with torch.no_grad():
            reference = mc(x_eval).numpy()
        row["onnx_max_abs_prob_diff"] = float(np.abs(probs - reference).max())
        row["onnx_batch_norm_nodes"], row["onnx_mul_nodes"] = onnx_batch_norms(path)
    from edgebayes.export.packed import pack_samples
    packed = pack_samples(compressed.samples, x_eval[:16])
    row["unfolded_batch_norms"] = len(getattr(packed, "unfolded_batch_norms", []) or [])
    row["seconds"] = time.perf_counter() - t0
    return row


def run(nets, families, epochs, quick):
    import edgebayes as eb

    x_train, y_train, x_val, y_val = digits_32()
    if quick:
        x_train, y_train = x_train[:256], y_train[:256]
    x_eval = x_val[:64]
    rows = []
    for name in nets:
        for family in families:
            torch.manual_seed(0)
            module = make_net(name).eval()
            bn = sum(isinstance(mod, nn.BatchNorm2d) for mod in module.modules())
            for case in ("forced", "trained"):
                net = bayesianize(module, family, input_shape=SHAPE, n_train=len(x_train))
                row = {"net": name, "family": family, "case": case, "batch_norms": bn}
                if case == "forced":
                    force_dead(net)
                else:
                    t0 = time.perf_counter()
                    history = eb.fit(net, x_train, y_train, val=(x_val, y_val), epochs=epochs, batch_size=64,
                                     lr=1e-3, kl_weight=0.1, log=lambda *_: None)
                    row.update(epochs=epochs, train_seconds=time.perf_counter() - t0,
                               val_accuracy=history[-1]["val_accuracy"])
                try:
                    row.update(measure(net, x_eval))
                except Exception as e:  # a failure is a result: say which step and why
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "surgery_report"}), flush=True)
    return rows


def _fmt(v, spec):
    return "—" if v is None else format(v, spec)


def markdown(rows, args):
    lines = ["# Users' own networks: bayesianize -> surgery -> packed ONNX (benchmarks/own_models.py)", "",
             f"Input 3x32x32; M = 4 posterior samples at inclusion threshold 0.5; 'forced': 25% of every prunable "
             f"layer's units off; 'trained': {args.train_epochs} epochs on digits upscaled to 32x32 "
             f"(batch 64, Adam 1e-3, kl_weight 0.1). FLOPs by paper 000's formula, relative to the dense net.", "",
             "| net | family | case | kept units | dead removed | max abs pruned - masked | FLOPs promised | "
             "FLOPs physical | ONNX max abs p - p_torch | BN in net | BN unfolded | val acc | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        note = r.get("error", "")
        lines.append(f"| {r['net']} | {r['family']} | {r['case']} | {r.get('kept_units', '—')}/{r.get('units', '—')} | "
                     f"{r.get('dead_removed', '—')}/{r.get('dead_units', '—')} | "
                     f"{_fmt(r.get('pruned_vs_masked'), '.1e')} | {_fmt(r.get('flops_promised'), '.3f')} | "
                     f"{_fmt(r.get('flops_physical'), '.3f')} | {_fmt(r.get('onnx_max_abs_prob_diff'), '.1e')} | "
                     f"{r['batch_norms']} | {r.get('unfolded_batch_norms', '—')} | "
                     f"{_fmt(r.get('val_accuracy'), '.3f')} | {note} |")
    kept = [(r["net"], r["family"], r["case"], r["surgery_kept"]) for r in rows if r.get("surgery_kept")]
    if kept:
        lines += ["", "## Dead channels surgery kept, and why (per-layer tables in the JSON's surgery_report)", "",
                  "A residual-stream channel is dead in one writer and alive in another: plain modules cannot drop "
                  "it from one block only. A dead expand channel feeding a live depthwise channel still carries "
                  "its batch-norm shift, a constant that the depthwise convolution's zero padding turns into a "
                  "non-constant map, so it cannot be folded exactly. Both are where physical FLOPs stay above the "
                  "promise; mobilenet_v3_small and efficientnet_b0 end below it because the producer of every dead "
                  "depthwise channel goes too, which the masks do not count.", ""]
        for net, family, case, why in kept:
            kinds = {}   # "residual stream: also written by live layer1.0.conv2" -> "residual stream"
            for reason, n in why.items():
                kind = reason.split(":")[0].split(" of ")[0]
                kinds[kind] = kinds.get(kind, 0) + n
            lines.append(f"- {net} / {family} / {case}: " + "; ".join(f"{n} {kind}" for kind, n in kinds.items()))
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nets", nargs="+", default=["custom", "resnet18", "mobilenet_v3_small", "densenet121",
                                                      "efficientnet_b0"])
    parser.add_argument("--families", nargs="+", default=["ss-gl", "ss-ghs"], choices=["ss-ig", "ss-gl", "ss-ghs"])
    parser.add_argument("--train-epochs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="256 training images; nothing written")
    parser.add_argument("--out", default=str(RESULTS / "own_models"))
    parser.add_argument("--markdown-only", action="store_true", help="rewrite the .md from the .json, run nothing")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.markdown_only:
        saved = json.loads(out.with_suffix(".json").read_text())
        args.train_epochs = saved["args"]["train_epochs"]
        with atomic_path(out.with_suffix(".md")) as tmp:
            Path(tmp).write_text(markdown(saved["rows"], args))
        return 0
    if args.train_epochs < 1:
        parser.error("--train-epochs: expected a positive integer")
    torch.set_num_threads(args.threads)
    rows = run(args.nets, args.families, args.train_epochs, args.quick)
    if args.quick:
        return 0
    result = {"rows": rows, "args": vars(args), "provenance": provenance("benchmark")}
    with atomic_path(out.with_suffix(".json")) as tmp:
        Path(tmp).write_text(json.dumps(result, indent=1, default=str))
    with atomic_path(out.with_suffix(".md")) as tmp:
        Path(tmp).write_text(markdown(rows, args))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
