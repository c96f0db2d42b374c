"""Benchmark: does rounding pruned widths up to the runtime's channel block make pruned networks faster?

    flock /tmp/edgebayes-bench.lock .venv/bin/python benchmarks/channel_multiple.py

Part 1, widths: six 3x3 convolutions (32 -> c -> ... -> c channels at 16x16, then a Linear) for c from 48 to
64, in onnxruntime and ai-edge-litert: where a runtime's convolution time jumps off its channel block.
Part 2, networks: torchvision resnet18, mobilenet_v2 and regnet_x_400mf at 3x32x32, bayesianized (ss-gl) with
25% of every prunable layer's units switched off (as benchmarks/own_models.py's forced case), one posterior
sample: the masked network (dead units zeroed, dense shapes), and the network after surgery with
channel_multiple 1, 4 and 8. Physical FLOPs by paper 000's formula, latency at batch 1 (2 threads, rounds
interleaved; export_common.time_calls). Results: benchmarks/results/channel_multiple.{json,md}.
"""

import sys
import tempfile

import torch
from torch import nn

from export_common import RUNTIMES, export_plain, np1, time_artifacts, write_results
from own_models import force_dead, make_net
from edgebayes.compressed.samples import compress
from edgebayes.compressed.structure import paper_flops
from edgebayes.train.families import bayesianize

WIDTHS = (48, 52, 56, 57, 58, 60, 61, 62, 63, 64)
NETS = ("resnet18", "mobilenet_v2", "regnet_x_400mf")
MULTIPLES = (1, 4, 8)


def conv_stack(c):
    net = nn.Sequential(*[m for i in range(6) for m in (nn.Conv2d(32 if i == 0 else c, c, 3, padding=1), nn.ReLU())],
                        nn.Flatten(), nn.Linear(c * 256, 10))
    return net.eval()


def time_variants(variants, x, tmp):
    """{variant: {runtime: timing}} of plain modules, each exported as the pipeline exports one sample."""
    rows = {name: {} for name in variants}
    for runtime in RUNTIMES:
        timed = time_artifacts(export_plain(runtime, variants, x, tmp), np1(x))
        for name in variants:
            rows[name][runtime] = timed[name]["median_ms"]
    return rows


def main():
    torch.manual_seed(0)
    results = {"widths": {}, "nets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        x = torch.randn(16, 32, 16, 16)
        results["widths"] = time_variants({str(c): conv_stack(c) for c in WIDTHS}, x, tmp)
        for name in NETS:
            torch.manual_seed(0)
            shape = (3, 32, 32)
            net = bayesianize(make_net(name).eval(), "ss-gl", input_shape=shape, n_train=1437)
            force_dead(net)
            variants = {"masked": compress(net.eval(), 0.5, 1, 0).dense_sample}
            for q in MULTIPLES:
                variants[f"pruned, multiple {q}"] = compress(net.eval(), 0.5, 1, 0, channel_multiple=q).samples[0]
            xs = torch.randn(16, *shape)
            with torch.no_grad():
                reference = variants["masked"](xs)
                gaps = {v: float((m(xs) - reference).abs().max()) for v, m in variants.items()}
            dense_flops = paper_flops(variants["masked"], shape)
            rows = time_variants(variants, xs, tmp)
            for v, m in variants.items():
                rows[v]["flops_ratio"] = paper_flops(m, shape) / dense_flops
                rows[v]["max_abs_logit_diff_vs_masked"] = gaps[v]
            results["nets"][name] = rows
            print(name, rows, flush=True)

    lines = ["## Widths: six 3x3 convolutions of c channels at 16x16, batch 1 (ms)", "",
             "| c | " + " | ".join(RUNTIMES) + " |", "|---:|" + "---:|" * len(RUNTIMES)]
    for c, row in results["widths"].items():
        lines.append(f"| {c} | " + " | ".join(f"{row[r]:.3f}" for r in RUNTIMES) + " |")
    lines += ["", "## Networks, 25% of every prunable layer's units dead (ms; ratio to the masked network)", "",
              "| net | variant | FLOPs ratio | " + " | ".join(f"{r} ms | vs masked" for r in RUNTIMES) + " |",
              "|---|---|---:|" + "---:|---:|" * len(RUNTIMES)]
    for net, rows in results["nets"].items():
        for v, row in rows.items():
            cells = " | ".join(f"{row[r]:.3f} | {row[r] / rows['masked'][r]:.2f}x" for r in RUNTIMES)
            lines.append(f"| {net} | {v} | {row['flops_ratio']:.3f} | {cells} |")
    write_results("channel_multiple", results, lines,
                  "Pruned widths rounded to the runtime's channel block (runtime.channel_multiple)",
                  "Median latency at batch 1 (2 threads, rounds interleaved) of a conv stack per width, and of "
                  "torchvision nets with 25% of their units dead: masked, and pruned by surgery with channel_multiple "
                  "1, 4 and 8, in onnxruntime and ai-edge-litert; physical FLOPs by paper 000's formula.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
