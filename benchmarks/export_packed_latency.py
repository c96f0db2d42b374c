"""Benchmark: the packed MC layout against the unrolled one for M = 1, 2, 4, 8 (issue 8).

    flock /tmp/edgebayes-bench.lock .venv/bin/python benchmarks/export_packed_latency.py

M posterior samples of a LeNet-5-Caffe (conv 20 5x5, conv 50 5x5, fc 800 -> 500 -> 10) and of an
MLP (784-300-100-10), different weights per sample, at their dense widths and at the pruned widths of
export_pruned_latency.py (LeNet 8 / 16 channels, 60 hidden; MLP 60-30): the pipeline exports the
physically pruned network, so the pruned rows are what a device runs. Both layouts exported by the
pipeline's export_artifact (fp32 ONNX and TFLite) and timed at batch 1 with 2 threads on onnxruntime and
ai-edge-litert. Target: packed at M = 8 at most 0.6x the unrolled latency on onnxruntime.

Packing saves per-operator dispatch (one operator per layer instead of M), so it pays where that
dominates: the pruned nets. The dense LeNet's fc1 at M = 8 streams 8 x 1.6 MB of weights per inference
and its grouped conv2 is not moved to onnxruntime's NCHWc kernels (the unrolled M convolutions are), so
there the two layouts do nearly the same memory-bound work (0.87x measured, against 0.51x for the pruned LeNet). At M = 1 export uses the plain graph for both
layouts (packed.mc_graph), so the M = 1 rows compare a graph with itself."""

import tempfile
from pathlib import Path

import torch

from export_common import RUNTIMES, export_for, inputs, lenet5_caffe, mlp, np1, time_artifacts, write_results
from edgebayes.compressed.samples import MCAverage

MS = (1, 2, 4, 8)


def samples(build, m):
    out = []
    for s in range(m):
        torch.manual_seed(100 + s)
        out.append(build())
    return out


PACKED_TITLE = "Packed vs unrolled MC layout: M posterior samples in one graph (issue 8)"
PACKED_MEASURES = ("Median latency at batch 1 (2 threads, rounds interleaved) of M = 1, 2, 4, 8 posterior samples of "
                   "LeNet-5-Caffe and an MLP, dense and at the pipeline's pruned widths, exported in the packed and "
                   "the unrolled layout, in onnxruntime and ai-edge-litert.")


def main():
    results, lines = {}, []
    nets = (("lenet5-caffe", lenet5_caffe), ("lenet5-caffe pruned", lambda: lenet5_caffe(8, 16, 60)),
            ("mlp", mlp), ("mlp pruned", lambda: mlp((784, 60, 30))))
    for net, build in nets:
        x = inputs((1, 28, 28))
        results[net] = {}
        with tempfile.TemporaryDirectory() as tmp:
            for m in MS:
                mc = MCAverage(samples(build, m)).eval()
                row = {}
                for runtime in RUNTIMES:
                    row.update({f"{runtime}/{layout}": timed for layout, timed in time_artifacts(
                        {layout: export_for(runtime, mc, x, Path(tmp) / f"{net.replace(' ', '-')}-{m}-{layout}", layout)
                         for layout in ("unrolled", "packed")}, np1(x)).items()})
                    row[f"{runtime}/packed_over_unrolled"] = (row[f"{runtime}/packed"]["median_ms"]
                                                              / row[f"{runtime}/unrolled"]["median_ms"])
                results[net][m] = row
    lines += ["| net | M | onnxruntime unrolled ms | packed ms | packed / unrolled | ai-edge-litert unrolled ms | "
              "packed ms | packed / unrolled |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for net, rows in results.items():
        for m, row in rows.items():
            cells = []
            for runtime in RUNTIMES:
                cells += [f"{row[f'{runtime}/unrolled']['median_ms']:.4f}", f"{row[f'{runtime}/packed']['median_ms']:.4f}",
                          f"{row[f'{runtime}/packed_over_unrolled']:.2f}x"]
            lines.append(f"| {net} | {m} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Unrolled M = 8 over M = 1 (onnxruntime): " + ", ".join(
        f"{net} {rows[8]['onnxruntime/unrolled']['median_ms'] / rows[1]['onnxruntime/unrolled']['median_ms']:.2f}x"
        for net, rows in results.items()) + "; packed M = 8 over M = 1: " + ", ".join(
        f"{net} {rows[8]['onnxruntime/packed']['median_ms'] / rows[1]['onnxruntime/packed']['median_ms']:.2f}x"
        for net, rows in results.items()) + ".")
    write_results("export_packed_latency", {"benchmark": "packed vs unrolled MC layout", "threads": 2, "batch": 1,
                                            "results": results}, lines, PACKED_TITLE, PACKED_MEASURES)


if __name__ == "__main__":
    main()
