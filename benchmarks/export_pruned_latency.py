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

import torch

from export_common import RUNTIMES, export_plain, inputs, lenet5_caffe, mlp, np1, time_artifacts, write_results
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


PRUNED_TITLE = "Physically pruned vs masked vs dense latency, beside the FLOPs ratio (issues 8, 37)"
PRUNED_MEASURES = ("Median latency at batch 1 (1 and 2 intra-op threads, rounds interleaved) of an MLP and "
                   "LeNet-5-Caffe: dense, masked (pruned units zeroed), pruned by the pipeline's surgery, and a dense "
                   "net built directly at the pruned widths, in onnxruntime and ai-edge-litert. Issue 37's target: "
                   "pruned / dense <= 1.5x the FLOPs ratio for LeNet-5-Caffe in onnxruntime.")
THREAD_COUNTS = (1, 2)


def main():
    results, lines = {}, []
    for net, build in (("mlp", mlp_variants), ("lenet5-caffe", lenet_variants)):
        variants, shape = build()
        x = inputs(shape)
        with torch.no_grad():
            gap = float((variants["pruned"](x) - variants["masked"](x)).abs().max())
        assert gap < 1e-4, f"{net}: the pruned network differs from the masked one by {gap}"
        dense_flops = paper_flops(variants["dense"], shape)
        rows = {name: {"flops": paper_flops(module, shape), "flops_ratio": paper_flops(module, shape) / dense_flops}
                for name, module in variants.items()}
        results[net] = {"pruned_vs_masked_max_abs_logit_diff": gap, "variants": rows, "ratios": {}}
        with tempfile.TemporaryDirectory() as tmp:
            for runtime in RUNTIMES:
                artifacts = export_plain(runtime, variants, x, tmp)
                for threads in THREAD_COUNTS:
                    timed = time_artifacts(artifacts, np1(x), threads=threads)
                    for name in variants:
                        rows[name][f"{runtime}, {threads} threads"] = timed[name]
                    ms = {name: timed[name]["median_ms"] for name in variants}
                    results[net]["ratios"][f"{runtime}, {threads} threads"] = {
                        "pruned_over_direct": ms["pruned"] / ms["direct"], "pruned_over_dense": ms["pruned"] / ms["dense"],
                        "pruned_over_dense_per_flops_ratio": ms["pruned"] / ms["dense"] / rows["pruned"]["flops_ratio"]}
    settings = [f"{runtime}, {threads} threads" for runtime in RUNTIMES for threads in THREAD_COUNTS]
    lines += ["| net | variant | FLOPs | FLOPs ratio | " + " | ".join(f"{k} ms (vs dense)" for k in settings) + " |",
              "|---|---|---:|---:|" + "---:|" * len(settings)]
    for net, r in results.items():
        v = r["variants"]
        for name, row in v.items():
            cells = [f"{row[k]['median_ms']:.4f} ({row[k]['median_ms'] / v['dense'][k]['median_ms']:.2f}x)" for k in settings]
            lines.append(f"| {net} | {name} | {row['flops']:,} | {row['flops_ratio']:.3f} | " + " | ".join(cells) + " |")
    lines += ["", "| net | runtime, threads | pruned / direct (target <= 1.05) | pruned / dense | FLOPs ratio | "
                  "pruned / dense over the FLOPs ratio (target <= 1.5, LeNet-5-Caffe, onnxruntime) |",
              "|---|---|---:|---:|---:|---:|"]
    for net, r in results.items():
        for k, ratio in r["ratios"].items():
            lines.append(f"| {net} | {k} | {ratio['pruned_over_direct']:.3f} | {ratio['pruned_over_dense']:.3f} | "
                         f"{r['variants']['pruned']['flops_ratio']:.3f} | {ratio['pruned_over_dense_per_flops_ratio']:.2f} |")
    write_results("export_pruned_latency", {"benchmark": "pruned vs masked vs dense vs direct",
                                            "threads": list(THREAD_COUNTS), "batch": 1, "results": results},
                  lines, PRUNED_TITLE, PRUNED_MEASURES)


if __name__ == "__main__":
    main()
