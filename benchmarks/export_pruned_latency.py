"""Benchmark: latency of a physically pruned network against the same network with masks, the dense one,
and a dense net built directly at the pruned widths, beside their FLOPs ratios (issue 8).

    flock /tmp/edgebayes-bench.lock .venv/bin/python benchmarks/export_pruned_latency.py

Networks: an MLP (784-300-100-10, pruned by the pipeline's surgery to 784-60-30-10) and a
LeNet-5-Caffe (conv 20 5x5, conv 50 5x5, fc 800 -> 500 -> 10 at 28x28; pruned to 8 and 16 channels and
60 hidden units by the same surgery, through Torch-Pruning's dependency graph). Variants, each exported as the pipeline exports
(softmax output, ONNX and TFLite fp32) and timed at batch 1 with 2 threads:
    dense    the trained-shape network
    masked   the same shapes with the pruned units' weights and biases zeroed (what masks give)
    pruned   the masked network with the dead units physically removed
    direct   a network built directly at the pruned widths (fresh weights): the limit surgery can reach
Target: pruned within 1.05x of direct.
"""

import copy
import tempfile
from pathlib import Path

import torch

from export_common import RUNTIMES, export_for, inputs, lenet5_caffe, mlp, np1, time_artifacts, write_results
from edgebayes.compressed.samples import MCAverage
from edgebayes.compressed.surgery import remove_dead_units
from edgebayes.compressed.structure import paper_flops


def keep_first(n, k):
    keep = torch.zeros(n, dtype=torch.bool)
    keep[torch.randperm(n, generator=torch.Generator().manual_seed(n))[:k]] = True
    return keep


def masked_and_pruned(dense, kept, shape):
    """The dense net with the pruned units' rows (and biases) zeroed, and that net after the pipeline's surgery."""
    masked = copy.deepcopy(dense)
    layers = dict(masked.named_modules())
    with torch.no_grad():
        for name, keep in kept.items():
            layers[name].weight[~keep] = 0
            layers[name].bias[~keep] = 0
    return masked, remove_dead_units(masked, kept, torch.zeros((1, *shape)))


def mlp_variants():
    torch.manual_seed(0)
    dense = mlp()
    kept = {"hidden1": keep_first(300, 60), "hidden2": keep_first(100, 30)}  # the zoo MLP's hidden Linears
    masked, pruned = masked_and_pruned(dense, kept, (1, 28, 28))
    return {"dense": dense, "masked": masked, "pruned": pruned, "direct": mlp((784, 60, 30))}, (1, 28, 28)


def lenet_variants():
    torch.manual_seed(0)
    dense = lenet5_caffe()
    kept = {"0": keep_first(20, 8), "2": keep_first(50, 16), "5": keep_first(500, 60)}  # conv1, conv2, fc1
    masked, pruned = masked_and_pruned(dense, kept, (1, 28, 28))
    return {"dense": dense, "masked": masked, "pruned": pruned, "direct": lenet5_caffe(8, 16, 60)}, (1, 28, 28)


PRUNED_TITLE = "Physically pruned vs masked vs dense latency, beside the FLOPs ratio (issue 8)"
PRUNED_MEASURES = ("Median latency at batch 1 (2 threads, rounds interleaved) of an MLP and LeNet-5-Caffe: dense, "
                   "masked (pruned units zeroed), pruned by the pipeline's surgery, and a dense net built directly at "
                   "the pruned widths, in onnxruntime and ai-edge-litert.")


def main():
    results, lines = {}, []
    for net, build in (("mlp", mlp_variants), ("lenet5-caffe", lenet_variants)):
        variants, shape = build()
        x = inputs(shape)
        with torch.no_grad():
            gap = float((variants["pruned"](x) - variants["masked"](x)).abs().max())
        assert gap < 1e-4, f"{net}: the pruned network differs from the masked one by {gap}"
        dense_flops = paper_flops(variants["dense"], shape)
        results[net] = {"pruned_vs_masked_max_abs_logit_diff": gap, "variants": {}}
        with tempfile.TemporaryDirectory() as tmp:
            rows = {name: {"flops": paper_flops(module, shape), "flops_ratio": paper_flops(module, shape) / dense_flops}
                    for name, module in variants.items()}
            for runtime in RUNTIMES:
                timed = time_artifacts({name: export_for(runtime, MCAverage([module]).eval(), x,
                                                         Path(tmp) / f"{net}-{name}", "unrolled")
                                        for name, module in variants.items()}, np1(x))
                for name in variants:
                    rows[name][runtime] = timed[name]
            results[net]["variants"] = rows
        v = results[net]["variants"]
        for runtime in RUNTIMES:
            d = v["dense"][runtime]["median_ms"]
            results[net][f"{runtime}_pruned_over_direct"] = v["pruned"][runtime]["median_ms"] / v["direct"][runtime]["median_ms"]
            results[net][f"{runtime}_pruned_over_dense"] = v["pruned"][runtime]["median_ms"] / d
    lines += ["| net | variant | FLOPs | FLOPs ratio | onnxruntime ms | vs dense | ai-edge-litert ms | vs dense |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    for net, r in results.items():
        v = r["variants"]
        for name, row in v.items():
            cells = []
            for runtime in RUNTIMES:
                ms = row[runtime]["median_ms"]
                cells += [f"{ms:.4f}", f"{ms / v['dense'][runtime]['median_ms']:.2f}x"]
            lines.append(f"| {net} | {name} | {row['flops']:,} | {row['flops_ratio']:.3f} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("| net | runtime | pruned / direct (target <= 1.05) | pruned / dense | FLOPs ratio |")
    lines.append("|---|---|---:|---:|---:|")
    for net, r in results.items():
        for runtime in RUNTIMES:
            lines.append(f"| {net} | {runtime} | {r[f'{runtime}_pruned_over_direct']:.3f} | "
                         f"{r[f'{runtime}_pruned_over_dense']:.3f} | {r['variants']['pruned']['flops_ratio']:.3f} |")
    write_results("export_pruned_latency", {"benchmark": "pruned vs masked vs dense vs direct", "threads": 2,
                                            "batch": 1, "results": results}, lines, PRUNED_TITLE, PRUNED_MEASURES)


if __name__ == "__main__":
    main()
