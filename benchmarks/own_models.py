"""Users' own networks through the whole compression path: bayesianize -> posterior samples -> surgery ->
MC graph -> ONNX in both layouts, for every torchvision classification CNN builder (and the Linear layers
of vit_b_16 and swin_t), a home-made net and a home-made 1-D (Conv1d) net, on the CPU.

For each network and family, the cases:
  forced   the bayesianized net with 25% of the units of every prunable layer switched off (inclusion
           logits set to -10, seeded): what surgery can cut when a quarter of everything is dead;
  trained  (--cases trained) the bayesianized net after a short real training on digits (8x8 upscaled,
           3 channels), kl_weight 0.1 as the embedded default: the channels the posterior switched off.
  target   (--cases target) the same training with train.flops_target (--flops-target, default 0.25,
           train/flops_target.py): whether the recipe for a user's trained network reaches the share on
           every architecture, counted after surgery (the nets start untrained here: no downloads).
Input 3x32x32 where the network takes it, else the smallest of 64, 75, 96, 128, 160, 224 it runs on (the
`input` key says which; vit_b_16 is built with image_size=32). Per row: `status` ("ok", or "degraded: ..."
when surgery could not prune the network or the packed layout fell back to unrolled; "target missed: ..."
where the physical FLOPs exceed the target, "target unreachable: ..." with fit's message where the architecture
allows no network that small; "error: ..." would be a bug), dead units and how many surgery removed (overall, and of those not coupled to a live residual
stream), max |pruned - masked| over a probe batch (and relative to the largest |logit|: float rounding
grows with it, and untrained nets with a quarter of their batch norms zeroed reach 1e5), the FLOPs the masks promise (paper 000's formula)
against the physical FLOPs after surgery, the ONNX's largest probability difference against PyTorch in
the packed layout (what the pipeline ships; `layout_shipped` is unrolled where it fell back) and in the
unrolled one, surgery's per-layer account of every dead channel it kept and why, and the seconds.

    python benchmarks/own_models.py                     # every net, ss-gl, forced
    python benchmarks/own_models.py --nets custom resnet18 --families ss-gl ss-ghs --cases forced trained

Results: benchmarks/results/own_models.{json,md} (machine, commit and versions in the JSON); rows are
written as they come, so an interrupted run keeps the nets it finished (--resume skips them).
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
from edgebayes.config import ConfigError
from edgebayes.export.formats import artifact_predict, export_artifact
from edgebayes.provenance import atomic_path, provenance, result_path
from edgebayes.train.families import bayesianize
from edgebayes.train.flops_target import TOLERANCE
from edgebayes.compressed.structure import structure_report

RESULTS = Path(__file__).resolve().parent / "results"


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


class Sensor1d(nn.Module):
    """A home-made 1-D net as sensor and keyword-spotting models are written (TC-ResNet's shape): Conv1d +
    BatchNorm1d stem, a residual block of "same"-padded convolutions, a dilated one, a strided one, global
    average pooling and a Linear head. Input (96, 32): an image's rows as time steps, its 3 x 32 pixels of a
    row as the channels (benchmarks take digits so, as row-sequential MNIST does)."""

    signal_shape = (96, 32)

    def __init__(self, num_classes=10):
        super().__init__()
        self.stem, self.bn0 = nn.Conv1d(96, 32, 3, padding=1, bias=False), nn.BatchNorm1d(32)
        self.res1, self.bn1 = nn.Conv1d(32, 32, 9, padding="same", bias=False), nn.BatchNorm1d(32)
        self.res2, self.bn2 = nn.Conv1d(32, 32, 9, padding="same", bias=False), nn.BatchNorm1d(32)
        self.dilated, self.bn3 = nn.Conv1d(32, 48, 3, padding=2, dilation=2, bias=False), nn.BatchNorm1d(48)
        self.down, self.bn4 = nn.Conv1d(48, 64, 3, stride=2, padding=1, bias=False), nn.BatchNorm1d(64)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        h = F.relu(self.bn0(self.stem(x)))
        h = F.relu(self.bn2(self.res2(F.relu(self.bn1(self.res1(h))))) + h)
        h = F.relu(self.bn4(self.down(F.relu(self.bn3(self.dilated(h))))))
        return self.fc(h.mean(-1))


NETS = ["custom", "sensor1d", "alexnet", "vgg11_bn", "resnet18", "resnext50_32x4d", "wide_resnet50_2", "densenet121",
        "googlenet", "inception_v3", "squeezenet1_1", "mobilenet_v2", "mobilenet_v3_small", "mnasnet0_5",
        "shufflenet_v2_x0_5", "efficientnet_b0", "efficientnet_v2_s", "regnet_x_400mf", "regnet_y_400mf",
        "convnext_tiny", "vit_b_16", "swin_t"]
SIZES = (32, 64, 75, 96, 128, 160, 224)


def make_net(name, classes=10):
    if name == "custom":
        return Custom(classes)
    if name == "sensor1d":
        return Sensor1d(classes)
    import torchvision

    options = {"image_size": 32} if name.startswith("vit_") else {}
    if name in ("googlenet", "inception_v3"):   # their auxiliary heads: a tuple in training mode, which fit refuses
        options["aux_logits"] = False
    return getattr(torchvision.models, name)(weights=None, num_classes=classes, **options)


def input_shape(module):
    """(3, s, s) for the smallest s of SIZES the module runs on in eval mode; a 1-D net's own (C, L)."""
    if hasattr(module, "signal_shape"):
        return module.signal_shape
    for size in SIZES:
        try:
            with torch.no_grad():
                module.eval()(torch.zeros(1, 3, size, size))
            return (3, size, size)
        except Exception:
            continue
    raise ValueError(f"runs on none of the sizes {SIZES}")


def digits(shape, seed=0):
    """scikit-learn's digits, bilinear to the input size, gray replicated to 3 channels; seeded 80/20 split. For a
    1-D shape (3 L, L): the L x L images' rows as L time steps of 3 L channels."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32)[:, None] / 16
    size = shape[1:] if len(shape) == 3 else (shape[1], shape[1])
    x = F.interpolate(x, size=size, mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    if len(shape) == 2:
        x = x.permute(0, 1, 3, 2).flatten(1, 2)   # (N, 3, H, W) -> (N, 3 W, H): row h is time step h
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


RESIDUAL = "residual stream"


def measure(net, x_eval, shape, m):
    """One row's measurements (see the module docstring) of a bayesianized net with its units switched off."""
    t0 = time.perf_counter()
    compressed = compress(net.eval(), 0.5, m, 0)
    dense, pruned, report = compressed.dense_sample, compressed.samples[0], compressed.surgery
    with torch.no_grad():
        masked = dense(x_eval[:8])
        gap = float((pruned(x_eval[:8]) - masked).abs().max())
    structure = structure_report(dense, pruned, compressed.kept, shape)
    kept_why = {}
    for layer in report.values():
        for reason, n in layer["kept"].items():
            kept_why[reason] = kept_why.get(reason, 0) + n
    dead = sum(layer["dead"] for layer in report.values())
    removed = sum(layer["removed"] for layer in report.values())
    residual = sum(n for reason, n in kept_why.items() if reason.startswith(RESIDUAL))
    row = {"kept_units": sum(int(k.sum()) for k in compressed.kept.values()),
           "units": sum(int(k.numel()) for k in compressed.kept.values()),
           "dead_units": dead, "dead_removed": removed, "dead_not_residual": dead - residual,
           "removed_of_not_residual": removed / (dead - residual) if dead > residual else None,
           "pruned_vs_masked": gap, "masked_max_abs_logit": float(masked.abs().max()),
           "pruned_vs_masked_relative": gap / max(1.0, float(masked.abs().max())), "flops_promised": structure["flops_ratio"],
           "flops_physical": structure["physical_flops_ratio"], "surgery_kept": kept_why,
           "surgery_report": report}
    degraded = [compressed.not_pruned] if compressed.not_pruned else []
    mc = compressed.mc_model()
    with torch.no_grad():
        reference = mc(x_eval).numpy()
    with tempfile.TemporaryDirectory() as tmp:
        for layout in ("packed", "unrolled"):
            path, details = Path(tmp) / f"{layout}.onnx", {}
            export_artifact(mc, "onnx", path, x_eval[:16], opset=17, layout=layout, details=details)
            probs = artifact_predict(path, "onnx", x_eval.numpy())
            row[f"onnx_max_abs_prob_diff_{layout}"] = float(np.abs(probs - reference).max())
            row[f"onnx_mb_{layout}"] = path.stat().st_size / 1e6
            if layout == "packed":
                row["layout_shipped"] = details["layout"]
                row["onnx_batch_norm_nodes"], row["onnx_mul_nodes"] = onnx_batch_norms(path)
                if "packed_refused" in details:
                    degraded.append(f"packed layout refused, shipped unrolled: {details['packed_refused'].split('. ')[0]}")
            path.unlink()
    row["status"] = "degraded: " + "; ".join(degraded) if degraded else "ok"
    row["seconds"] = time.perf_counter() - t0
    return row


def run(args, done=()):
    import edgebayes as eb

    for name in args.nets:
        torch.manual_seed(0)
        module = make_net(name).eval()
        shape = input_shape(module)
        x_train, y_train, x_val, y_val = digits(shape)
        x_train, y_train = x_train[: args.train_size], y_train[: args.train_size]
        x_eval = x_val[: args.probes]
        for family in args.families:
            for case in args.cases:
                if (name, family, case) in done:
                    continue
                row = {"net": name, "family": family, "case": case, "input": "x".join(map(str, shape)),
                       "batch_norms": sum(isinstance(mod, nn.modules.batchnorm._BatchNorm) for mod in module.modules()),
                       "linear_layers": sum(isinstance(mod, nn.Linear) for mod in module.modules()),
                       "conv_layers": sum(isinstance(mod, (nn.Conv1d, nn.Conv2d)) for mod in module.modules())}
                t0 = time.perf_counter()
                try:
                    net = bayesianize(module, family, input_shape=shape, n_train=len(x_train))
                    if case == "forced":
                        force_dead(net)
                    else:
                        target = {"flops_target": args.flops_target} if case == "target" else {}
                        history = eb.fit(net, x_train, y_train, val=(x_val, y_val), epochs=args.train_epochs,
                                         batch_size=64, lr=1e-3, kl_weight=0.1, log=lambda *_: None, **target)
                        row.update(epochs=args.train_epochs, val_accuracy=history[-1]["val_accuracy"], **target)
                    row.update(measure(net, x_eval, shape, args.m))
                    if case == "target" and row["flops_physical"] > args.flops_target * (1 + TOLERANCE):
                        row["status"] = (("" if row["status"] == "ok" else row["status"] + "; ")
                                         + f"target missed: physical FLOPs {row['flops_physical']:.3f}")
                except ConfigError as e:   # a target below the smallest network the architecture allows: said
                    row["status"] = f"target unreachable: {str(e).split('; set ')[0]}"   # before the first step
                except Exception as e:  # a bug: the row says where, the run goes on
                    row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                row["seconds"] = time.perf_counter() - t0
                print(json.dumps({k: v for k, v in row.items() if k not in ("surgery_report", "surgery_kept")}),
                      flush=True)
                yield row


def _fmt(v, spec):
    return "—" if v is None else format(v, spec)


def markdown(rows, args):
    lines = ["# Users' own networks: bayesianize -> surgery -> ONNX (benchmarks/own_models.py)", "",
             f"M = {args['m']} posterior samples at inclusion threshold 0.5; 'forced': 25% of every prunable layer's "
             f"units off; 'trained': {args['train_epochs']} epoch(s) on {args['train_size']} digits images; 'target': the "
             f"same with train.flops_target {args.get('flops_target', 0.25)}, reached where FLOPs physical <= it (1% "
             f"tolerance). 'val acc': after that training, from untrained weights (no downloads): near chance for "
             f"most nets after so few steps; these rows check structure (reached, cut, exported equal), "
             f"benchmarks/finetune_compress.py measures accuracy. FLOPs by paper 000's formula, relative to "
             f"the dense net. 'not residual': dead channels that are not kept because a live block writes the same "
             f"residual-stream channel. ONNX differences over {args['probes']} digits inputs, fp32, onnxruntime. "
             f"In vit_b_16 and swin_t the prunable units are the Linear layers' outputs (the patch embedding is a "
             f"convolution): the MLP hidden units of every encoder block go; attention projections and the "
             f"residual stream, normalized together by LayerNorm or read by the class token / position embedding "
             f"parameters, stay. 'input': the smallest size of 32, 64, 75, ... the net runs on.", "",
             f"    {args['command']}", "",
             "| net | input | case | status | dead removed | of not residual | max abs pruned - masked | FLOPs promised | "
             "FLOPs physical | ONNX packed (shipped) | ONNX unrolled | val acc | s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        share = r.get("removed_of_not_residual")
        share = "—" if share is None else f"{share:.0%} of {r['dead_not_residual']}"
        logit = r.get("masked_max_abs_logit", 0)
        scale = "" if logit <= 1 else f" (max abs logit {logit:.0e})"
        status = r["status"] if len(r["status"]) < 120 else r["status"][:117] + "..."
        lines.append(f"| {r['net']} | {r['input']} | {r['family']} {r['case']} | {status} | "
                     f"{r.get('dead_removed', '—')}/{r.get('dead_units', '—')} | "
                     f"{share} | "
                     f"{_fmt(r.get('pruned_vs_masked'), '.1e')}"
                     f"{scale} | "
                     f"{_fmt(r.get('flops_promised'), '.3f')} | "
                     f"{_fmt(r.get('flops_physical'), '.3f')} | {_fmt(r.get('onnx_max_abs_prob_diff_packed'), '.1e')}"
                     f"{' (unrolled)' if r.get('layout_shipped') == 'unrolled' else ''} | "
                     f"{_fmt(r.get('onnx_max_abs_prob_diff_unrolled'), '.1e')} | {_fmt(r.get('val_accuracy'), '.3f')} | "
                     f"{r['seconds']:.0f} |")
    kept = [(r["net"], r["family"], r["case"], r["surgery_kept"]) for r in rows if r.get("surgery_kept")]
    if kept:
        lines += ["", "## Dead channels surgery kept, and why (per-layer tables in the JSON's surgery_report)", ""]
        for net, family, case, why in kept:
            kinds = {}   # "residual stream: also written by live layer1.0.conv2" -> "residual stream"
            for reason, n in why.items():
                kind = reason.split(":")[0].split(" of ")[0].split(" (")[0]
                kind = " ".join(w for w in kind.split() if "." not in w)   # layer names out
                kinds[kind] = kinds.get(kind, 0) + n
            lines.append(f"- {net} / {family} / {case}: " + "; ".join(f"{n} {kind}" for kind, n in kinds.items()))
    return "\n".join(lines) + "\n"


def write(out, rows, args, origin):
    result = {"rows": rows, "args": args, "provenance": origin}
    with atomic_path(result_path(out, ".json")) as tmp:
        Path(tmp).write_text(json.dumps(result, indent=1, default=str))
    with atomic_path(result_path(out, ".md")) as tmp:
        Path(tmp).write_text(markdown(rows, args))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nets", nargs="+", default=NETS)
    parser.add_argument("--families", nargs="+", default=["ss-gl"], choices=["ss-ig", "ss-gl", "ss-ghs"])
    parser.add_argument("--cases", nargs="+", default=["forced"], choices=["forced", "trained", "target"])
    parser.add_argument("--flops-target", type=float, default=0.25, help="train.flops_target of the target case")
    parser.add_argument("--m", type=int, default=2, help="posterior samples in the MC graph")
    parser.add_argument("--probes", type=int, default=16, help="inputs of the ONNX and surgery checks")
    parser.add_argument("--train-epochs", type=int, default=2)
    parser.add_argument("--train-size", type=int, default=1437)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="nothing written")
    parser.add_argument("--resume", action="store_true", help="keep the rows of the results file, run the others")
    parser.add_argument("--out", default=str(RESULTS / "own_models"))
    parser.add_argument("--markdown-only", action="store_true", help="rewrite the .md from the .json, run nothing")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.markdown_only:
        saved = json.loads(result_path(out, ".json").read_text())
        with atomic_path(result_path(out, ".md")) as tmp:
            Path(tmp).write_text(markdown(saved["rows"], saved["args"]))
        return 0
    if args.train_epochs < 1 or args.m < 1:
        parser.error("--train-epochs and --m: expected positive integers")
    if not 0 < args.flops_target <= 1:
        parser.error(f"--flops-target: expected a share of the dense FLOPs in (0, 1], got {args.flops_target}")
    torch.set_num_threads(args.threads)
    settings = {k: v for k, v in vars(args).items() if k not in ("quick", "resume", "markdown_only")}
    settings["command"] = "python benchmarks/own_models.py " + " ".join(argv if argv is not None else sys.argv[1:])
    rows = json.loads(result_path(out, ".json").read_text())["rows"] if args.resume else []
    # Taken before the first row is written: the rows this run writes make the checkout dirty after it
    origin = provenance("benchmark")
    done = {(r["net"], r["family"], r["case"]) for r in rows}
    for row in run(args, done):
        rows.append(row)
        if not args.quick:   # after every row: an interrupted run keeps what it measured
            write(out, rows, settings, origin)
    if not args.quick:
        print(f"wrote {result_path(out, '.json')} and {result_path(out, '.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
