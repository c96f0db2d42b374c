"""Benchmark: the packed MC layout against the unrolled one for M = 1, 2, 4, 8 (issues 8, 37).

    flock /tmp/edgebayes-bench.lock .venv/bin/python benchmarks/export_packed_latency.py

M posterior samples of a LeNet-5-Caffe (conv 20 5x5, conv 50 5x5, fc 800 -> 500 -> 10) and of an
MLP (784-300-100-10), different weights per sample, at their dense widths and at the pruned widths of
export_pruned_latency.py (LeNet 8 / 16 channels, 60 hidden; MLP 60-30): the pipeline exports the
physically pruned network, so the pruned rows are what a device runs. And three small transformers a user
might ship at 32x32 (torchvision's builders: a ViT of 4 layers, width 64, patch 4, 65 tokens; a Swin of
two stages, width 32; a ConvNeXt of three stages, widths 32-128), bayesianized (ss-gl) with their M
posterior samples drawn by compress: their Linears on tokens, LayerNorms and attention are what the packed
layout could not pack before (they were exported unrolled). Both layouts exported by the
pipeline's export_artifact (fp32 ONNX and TFLite) and timed at batch 1 with 1 and 2 threads on onnxruntime
and ai-edge-litert, rounds interleaved.

What M samples must cost at least (issue 37): the M = 1 graph run on a batch of M inputs in onnxruntime
(`floor`). It does the M samples' multiply-adds, with each weight read once where M distinct samples read M
weight sets, so no layout of M samples at batch 1 can beat it by much; packed / floor is what the packed
graph spends beyond the samples' own arithmetic. The per-operator profile (onnxruntime's profiler, one
thread, M = 8 packed) says where that goes. ai-edge-litert has no Python per-operator profiler and its batch-1
TFLite files run a batch of M as M calls, so its floor is not measured.

Packing saves per-operator dispatch (one operator per layer instead of M), so it pays where that
dominates: the pruned nets. The dense LeNet's fc1 at M = 8 streams 8 x 1.6 MB of weights per inference
and its grouped conv2 is not moved to onnxruntime's NCHWc kernels (the unrolled M convolutions are), so
there the two layouts do nearly the same memory-bound work. At M = 1 export uses the plain graph for both
layouts (packed.mc_graph), so the M = 1 rows compare a graph with itself."""

import collections
import json
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from export_common import QUICK, RUNTIMES, export_for, inputs, lenet5_caffe, mlp, np1, time_calls, write_results
from edgebayes.compressed.samples import MCAverage
from edgebayes.export.formats import FORMATS
from edgebayes.ondevice.runtimes import make_backend

MS = (1, 2, 4, 8)
THREAD_COUNTS = (1, 2)


def samples(build, m):
    out = []
    for s in range(m):
        torch.manual_seed(100 + s)
        out.append(build())
    return out


def transformer(name):
    """A small torchvision ViT, Swin or ConvNeXt at 32x32, 10 classes (module docstring)."""
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt
    from torchvision.models.swin_transformer import SwinTransformer
    from torchvision.models.vision_transformer import VisionTransformer

    if name == "vit":
        return VisionTransformer(image_size=32, patch_size=4, num_layers=4, num_heads=4, hidden_dim=64, mlp_dim=128,
                                 num_classes=10)
    if name == "swin":
        return SwinTransformer(patch_size=[4, 4], embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4],
                               num_classes=10)
    return ConvNeXt([CNBlockConfig(32, 64, 2), CNBlockConfig(64, 128, 2), CNBlockConfig(128, None, 2)], num_classes=10)


def posterior_samples(name, m):
    """M posterior samples of the bayesianized (ss-gl) transformer, as export receives them: the Bayesian layers
    differ per sample, LayerNorm and attention are the same in each (the weights' values do not change the
    latency)."""
    from edgebayes.compressed.samples import compress
    from edgebayes.train.families import bayesianize

    torch.manual_seed(0)
    net = bayesianize(transformer(name), "ss-gl", input_shape=(3, 32, 32), n_train=1000)
    return compress(net.eval(), 0.5, m, 0).samples


def operator_profile(path, x1, calls=500):
    """{operator type: mean microseconds per inference} of an ONNX file in onnxruntime, one thread, from its
    profiler (which adds a little to every operator), plus "model_run" (the whole call)."""
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.enable_profiling = 1, True
        options.profile_file_prefix = str(Path(tmp) / "profile")
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        for _ in range(calls if not QUICK else 3):
            session.run(None, {name: x1})
        events = json.loads(Path(session.end_profiling()).read_text())
    total = collections.Counter()
    runs = 0
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            total[e["args"]["op_name"]] += e["dur"]
        elif e.get("cat") == "Session" and e["name"] == "model_run":
            total["model_run"] += e["dur"]
            runs += 1
    return {op: us / runs for op, us in total.most_common()}


PACKED_TITLE = "Packed vs unrolled MC layout: M posterior samples in one graph (issues 8, 37)"
PACKED_MEASURES = ("Median latency at batch 1 (1 and 2 threads, rounds interleaved) of M = 1, 2, 4, 8 posterior samples "
                   "of LeNet-5-Caffe and an MLP, dense and at the pipeline's pruned widths, and of a small ViT, Swin and "
                   "ConvNeXt (bayesianized, ss-gl), exported in the packed and "
                   "the unrolled layout, in onnxruntime and ai-edge-litert; beside them the floor of M samples (the "
                   "M = 1 graph on a batch of M, onnxruntime) and where the packed graph's time goes.")


def main():
    results, profiles, lines = {}, {}, []
    nets = [("lenet5-caffe", lambda m: samples(lenet5_caffe, m), (1, 28, 28)),
            ("lenet5-caffe pruned", lambda m: samples(lambda: lenet5_caffe(8, 16, 60), m), (1, 28, 28)),
            ("mlp", lambda m: samples(mlp, m), (1, 28, 28)),
            ("mlp pruned", lambda m: samples(lambda: mlp((784, 60, 30)), m), (1, 28, 28))]
    nets += [(name, lambda m, name=name: posterior_samples(name, m), (3, 32, 32)) for name in ("vit", "swin", "convnext")]
    for net, draw, shape in nets:
        x = inputs(shape)
        results[net] = {}
        with tempfile.TemporaryDirectory() as tmp:
            artifacts = {}
            for m in MS:
                mc = MCAverage(draw(m)).eval()
                for runtime in RUNTIMES:
                    for layout in ("unrolled", "packed"):
                        artifacts[(m, runtime, layout)] = export_for(
                            runtime, mc, x, Path(tmp) / f"{net.replace(' ', '-')}-{m}-{layout}", layout)
            profiles[net] = operator_profile(artifacts[(max(MS), "onnxruntime", "packed")][0], np1(x))
            one = artifacts[(1, "onnxruntime", "packed")][0]
            for threads in THREAD_COUNTS:
                # every graph of this net and thread count in one interleaved timing, so that the ratios
                # between them (the figures the targets are about) see the same machine
                fns = {}
                for (m, runtime, layout), (path, fmt) in artifacts.items():
                    fns[(m, runtime, layout)] = make_backend(FORMATS[fmt].runtime, str(path), threads).run
                floor = make_backend("onnxruntime", str(one), threads)
                for m in MS:  # the floor: the M = 1 graph on M inputs (the same multiply-adds, each weight read once)
                    xm = np.ascontiguousarray(x[:m].numpy(), dtype=np.float32)
                    fns[(m, "onnxruntime", "floor")] = lambda _x, xm=xm: floor.run(xm)
                for (m, runtime, layout), timed in time_calls(fns, np1(x)).items():
                    results[net].setdefault(m, {})[f"{runtime}/{threads}/{layout}"] = timed
        results[net] = {m: results[net][m] for m in MS}
    ms = lambda row, key: row[key]["median_ms"]  # noqa: E731
    lines += ["| net | M | threads | onnxruntime unrolled ms | packed ms | floor ms | packed / floor | packed / M=1 | "
              "ai-edge-litert unrolled ms | packed ms | packed / M=1 |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for net, rows in results.items():
        for threads in THREAD_COUNTS:
            for m, row in rows.items():
                o, t = f"onnxruntime/{threads}", f"ai-edge-litert/{threads}"
                lines.append(
                    f"| {net} | {m} | {threads} | {ms(row, o + '/unrolled'):.4f} | {ms(row, o + '/packed'):.4f} | "
                    f"{ms(row, o + '/floor'):.4f} | {ms(row, o + '/packed') / ms(row, o + '/floor'):.2f}x | "
                    f"{ms(row, o + '/packed') / ms(rows[1], o + '/packed'):.2f}x | {ms(row, t + '/unrolled'):.4f} | "
                    f"{ms(row, t + '/packed'):.4f} | {ms(row, t + '/packed') / ms(rows[1], t + '/packed'):.2f}x |")
    lines += ["", f"Where the packed M = {max(MS)} graph's time goes (onnxruntime's profiler, 1 thread, microseconds per "
              "inference by operator type; the profiler adds a little to each operator):", ""]
    for net, ops in profiles.items():
        lines.append(f"- {net}: " + ", ".join(f"{op} {us:.1f}" for op, us in ops.items()))
    write_results("export_packed_latency", {"benchmark": "packed vs unrolled MC layout", "threads": list(THREAD_COUNTS),
                                            "batch": 1, "results": results, "onnxruntime_profile_packed_m8": profiles},
                  lines, PACKED_TITLE, PACKED_MEASURES)


if __name__ == "__main__":
    main()
