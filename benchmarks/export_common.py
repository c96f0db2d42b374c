"""Shared by the export benchmarks: LeNet-5-Caffe / MLP shapes, artifact timing on onnxruntime and
ai-edge-litert, and the results files (JSON with provenance + a Markdown table).

Timing: batch 1, 2 threads, `warmup` untimed calls, then `repeats` rounds of `calls` timed calls,
interleaved across the artifacts compared (time_artifacts); a round's figure is its median call latency,
the reported figure the median over rounds. Run the
benchmarks under `flock /tmp/edgebayes-bench.lock` so timing runs never overlap.
"""

import json
import os
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np
import torch
from torch import nn

from edgebayes.export.formats import FORMATS, export_artifact
from edgebayes.ondevice.runtimes import make_backend
from edgebayes.provenance import atomic_path, provenance
from edgebayes.train.layers import LayerFactory
from edgebayes.train.zoo.mlp import mlp as zoo_mlp

RESULTS = Path(__file__).resolve().parent / "results"
THREADS = 2
QUICK = "--quick" in sys.argv  # a smoke run of the script: few calls, nothing written
RUNTIMES = {"onnxruntime": "onnx", "ai-edge-litert": "tflite-fp32"}  # runtime -> the artifact it runs


def lenet5_caffe(c1=20, c2=50, hidden=500, classes=10):
    """LeNet-5-Caffe at 28x28: conv 5x5 (c1), max pool, conv 5x5 (c2), max pool, fc 16*c2 -> hidden -> 10."""
    return nn.Sequential(nn.Conv2d(1, c1, 5), nn.MaxPool2d(2), nn.Conv2d(c1, c2, 5), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(16 * c2, hidden), nn.ReLU(), nn.Linear(hidden, classes)).eval()


def mlp(widths=(784, 300, 100), classes=10):
    """LeNet-300-100 shaped MLP on flattened 28x28 inputs (the zoo's MLP, deterministic, ReLU)."""
    return zoo_mlp(LayerFactory("dnn", activation="relu"), (widths[0],), classes, hidden=widths[1:]).eval()


def versions():
    found = provenance("benchmark")
    for name in ("nncf", "ai-edge-litert", "litert-torch"):
        try:
            found["versions"][name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def export_for(runtime, mc_model, x, path, layout):
    fmt = RUNTIMES[runtime]
    return export_artifact(mc_model, fmt, Path(str(path) + FORMATS[fmt].suffix), x, opset=17, layout=layout), fmt


def export_plain(runtime, modules, x, folder):
    """{name: (path, fmt)} of plain modules {name: module}, each exported for `runtime` as the pipeline exports
    one posterior sample (the MC average of that one sample)."""
    from edgebayes.compressed.samples import MCAverage

    return {name: export_for(runtime, MCAverage([m]).eval(), x, Path(folder) / f"{name}-{runtime}", "unrolled")
            for name, m in modules.items()}


def time_artifacts(artifacts, x1, warmup=50, calls=200, repeats=7, threads=THREADS):
    """{name: (path, fmt)} -> {name: {"median_ms", "rounds_ms", "calls_per_round"}} at batch 1, each artifact
    in its runtime (time_calls)."""
    backends = {name: make_backend(FORMATS[fmt].runtime, str(path), threads) for name, (path, fmt) in artifacts.items()}
    return time_calls({name: backend.run for name, backend in backends.items()}, x1, warmup, calls, repeats)


def time_calls(fns, x1, warmup=50, calls=200, repeats=7):
    """{name: fn} -> {name: {"median_ms", "rounds_ms", "calls_per_round"}} of fn(x1).

    A round's figure is the median latency (ms) of `calls` calls, the reported figure the median over
    `repeats` rounds. The rounds are interleaved (round 1 of each, then round 2 of each, ...), so that load
    from other processes on a shared machine falls on every one alike and the ratios between them, which the
    targets are about, stay fair.
    """
    if QUICK:
        warmup, calls, repeats = 1, 3, 1
    for fn in fns.values():
        for _ in range(warmup):
            fn(x1)
    rounds = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            lat = []
            for _ in range(calls):
                t0 = time.perf_counter()
                fn(x1)
                lat.append(time.perf_counter() - t0)
            rounds[name].append(statistics.median(lat) * 1e3)
    return {name: {"median_ms": statistics.median(r), "rounds_ms": r, "calls_per_round": calls}
            for name, r in rounds.items()}


def header(title, measures):
    """The opening of a result file: what it measures and the command (benchmarks/README.md), then the table."""
    return [f"# {title}", "", measures, "", f"`{' '.join(['flock /tmp/edgebayes-bench.lock .venv/bin/python', *sys.argv])}`", ""]


def write_results(name, payload, table_lines, title, measures):
    table_lines = header(title, measures) + list(table_lines)
    if QUICK:
        print("\n".join(table_lines))
        return
    RESULTS.mkdir(exist_ok=True)
    # Timing on a shared machine: the load average says how much else ran beside the benchmark.
    payload = {**payload, "provenance": versions(), "command": " ".join(sys.argv), "load_average": os.getloadavg()}
    with atomic_path(RESULTS / f"{name}.json") as tmp:
        tmp.write_text(json.dumps(payload, indent=2) + "\n")
    threads = payload.get("threads", THREADS)   # a benchmark that times at several thread counts says which
    threads = " and ".join(map(str, threads)) if isinstance(threads, list) else threads
    with atomic_path(RESULTS / f"{name}.md") as tmp:
        prov = payload["provenance"]
        tmp.write_text("\n".join(table_lines) + f"\n\nCommit {prov['git_commit']}, {prov['machine']['processor'] or prov['machine']['machine']}, "
                       f"{prov['machine']['cpu_count']} CPUs, {threads} threads, batch 1, load average at the end "
                       f"{payload['load_average'][0]:.1f}; "
                       f"versions: {', '.join(f'{k} {v}' for k, v in prov['versions'].items())}.\n")
    print("\n".join(table_lines))


def inputs(shape, n=16, seed=0):
    return torch.randn((n, *shape), generator=torch.Generator().manual_seed(seed))


def np1(x):
    return np.ascontiguousarray(x[:1].numpy(), dtype=np.float32)
