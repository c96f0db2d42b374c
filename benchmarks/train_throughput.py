"""Training throughput of each family against the deterministic network: same architecture, device, run.

For each architecture (LeNet-5-Caffe at MNIST shapes, ResNet-20 at CIFAR-10 shapes), precision and family
(dnn, bnn, ss-ig, ss-gl, ss-ghs, bn3, sqs), the pipeline's own trainer (train/trainer.py; train/sqs.py for sqs)
trains on random tensors of the data set's shape (throughput does not depend on the pixel values, and the
KL is weighted as in a run on the real set's size, see `main`) for
--epochs epochs; the epoch time is the shortest training time (the trainer's `train_seconds`: the
optimisation steps, without validation) of the epochs after the first, which is warm-up (cuDNN autotuning,
torch.compile), and images/s = training images / epoch time. The shortest, not the mean: on a shared
machine other processes only ever add time (on this project's 2-core VM one ResNet-20 step took 0.9 s or
10.5 s minutes apart), so the minimum is the estimate of what the hardware does. The settings are the
paper configs' (configs/mnist-lenet5-ssgl.yaml, configs/cifar10-resnet20-ssgl.yaml: optimizer, batch size,
priors, the ResNet's augmentation) with the family swapped (bn3 with the nested section's defaults); `sqs` times its fine-tuning epochs (its one-epoch
deterministic pretraining is not timed).

Results: <out>.json (every row; device name, commit, versions, machine) and <out>.md. The GPU figures:

    python benchmarks/train_throughput.py --device cuda --precisions fp32 bf16 --epochs 3 \\
        --out benchmarks/results/train_throughput_gpu
    python benchmarks/train_throughput.py --device cuda --precisions bf16 --compile --epochs 3 \\
        --out benchmarks/results/train_throughput_gpu_compiled

The CPU figures committed here (small training sets, so the epoch time is of that set, not of MNIST):

    python benchmarks/train_throughput.py --device cpu --train-size 4096 2048 --epochs 6 --threads 1 --cpu-clock --profile \\
        --out benchmarks/results/train_throughput_cpu_1thread

`--cpu-clock` times epochs by the process's CPU time instead of wall time: with one thread on a machine other
processes load, what the work costs without the time they held the core (caches and memory bandwidth are
still shared). `--threads N` sets torch's intra-op threads (the CPU figures: 1 and 2); `--profile` adds, per family, the
operators that took the most CPU time in one more (profiled, untimed) epoch, from torch.profiler: where a
Bayesian step spends its time beyond the two convolutions / matmuls of local reparameterization. `--label`
names the code measured (e.g. a checkout of an older commit put first on PYTHONPATH, for a before/after).
"""

import argparse
import copy
import math
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

from edgebayes.config import load_pipeline_config
from edgebayes.data import Splits
from edgebayes.provenance import provenance, write_json
from edgebayes.train.families import build, fit
from edgebayes.train.nested import NestedLayer
from edgebayes.train.spike_slab import BLOCK_ELEMENTS, SpikeSlabLayer
from edgebayes.train.trainer import resolve_device

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("dnn", "bnn", "ss-ig", "ss-gl", "ss-ghs", "bn3", "sqs")
# (paper config, input shape, training images of the real data set)
SETUPS = {"lenet5-caffe": ("configs/mnist-lenet5-ssgl.yaml", (1, 28, 28), 60000),
          "resnet20": ("configs/cifar10-resnet20-ssgl.yaml", (3, 32, 32), 50000)}
WITHIN = 2.0  # issue 20: a Bayesian epoch within 2.0x of the deterministic one (issue 6 asked for 2.5x)


def random_splits(shape, n_train, n_eval=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = lambda n: torch.rand((n,) + shape, generator=g)  # noqa: E731
    y = lambda n: torch.randint(0, 10, (n,), generator=g)  # noqa: E731
    return Splits(x(n_train), y(n_train), x(n_eval), y(n_eval), x(n_eval), y(n_eval), [str(i) for i in range(10)])


def time_family(base_cfg, family, splits, args, precision):
    cfg = copy.deepcopy(base_cfg)
    cfg.model.family, cfg.name = family, f"throughput-{family}"
    t = cfg.train
    t.device, t.epochs, t.precision, t.mc_samples_val, t.lr_milestones = args.device, args.epochs, precision, 1, []
    t.channels_last, t.compile = args.channels_last, args.compile
    if args.batch_size:
        t.batch_size = args.batch_size
    cfg.sqs.pretrain_epochs = 1
    with tempfile.TemporaryDirectory() as tmp:
        _, history = fit(cfg, splits, Path(tmp) / "checkpoint.pt", log=lambda *_: None)
    epoch_seconds = min(h["train_seconds"] for h in history[1:])  # the first epoch is warm-up
    profile = top_operators(cfg, splits) if args.profile else None
    draws = noise_draws_per_batch(cfg, splits)
    return {"family": family, "precision": precision, "batch_size": t.batch_size, "epochs": t.epochs,
            "train_images": len(splits.train_x), "epoch_seconds": epoch_seconds,
            "noise_draws_per_batch": draws,
            "noise_seconds": math.ceil(len(splits.train_x) / t.batch_size) * normal_seconds(draws, args.clock),
            "images_per_second": len(splits.train_x) / epoch_seconds,
            "all_epoch_seconds": [h["train_seconds"] for h in history], "augment": t.augment,
            "channels_last": t.channels_last, "compile": t.compile, "optimizer": t.optimizer,
            "profile": profile}


def noise_draws_per_batch(cfg, splits):
    """N(0, 1) draws of one training batch: local reparameterization draws one per output element of every
    spike-and-slab layer (train/spike_slab.py) and every Bayesian nested layer (train/nested.py); counted by
    forward hooks on one training-mode forward (0 for a family without such layers)."""
    net, count = build(cfg, splits).train(), [0]
    noisy = [m for m in net.modules()
             if isinstance(m, SpikeSlabLayer) or (isinstance(m, NestedLayer) and m.bayesian)]
    hooks = [m.register_forward_hook(lambda _m, _i, out: count.__setitem__(0, count[0] + out.numel())) for m in noisy]
    with torch.no_grad():
        net(splits.train_x[: cfg.train.batch_size])
    for h in hooks:
        h.remove()
    return count[0]


def normal_seconds(draws, clock, repeats=5):
    """Time (by `clock`, the epochs' clock) of `draws` N(0, 1) draws by torch's normal_, in the blocks the
    training forward draws them in (spike_slab.BLOCK_ELEMENTS): what the noise of local reparameterization
    costs a step on its own. torch's CPU generator fills a tensor on one thread, whatever the thread count."""
    if not draws:
        return 0.0
    block = torch.empty(min(draws, BLOCK_ELEMENTS))
    best = math.inf
    for _ in range(repeats):
        t0 = clock()
        for start in range(0, draws, BLOCK_ELEMENTS):
            block[: min(BLOCK_ELEMENTS, draws - start)].normal_()
        best = min(best, clock() - t0)
    return best


def top_operators(cfg, splits, rows=10):
    """The operators with the most self CPU time in one epoch (training and a validation pass) under
    torch.profiler: [{name, self_cpu_ms, calls, share of the total}], largest first, plus the total."""
    from torch.profiler import ProfilerActivity, profile

    cfg = copy.deepcopy(cfg)
    cfg.train.epochs = 1
    with tempfile.TemporaryDirectory() as tmp, profile(activities=[ProfilerActivity.CPU]) as prof:
        fit(cfg, splits, Path(tmp) / "checkpoint.pt", log=lambda *_: None)
    ops = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in ops)
    ops.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return {"total_self_cpu_ms": total / 1e3,
            "top": [{"name": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3, "calls": e.count,
                     "share": e.self_cpu_time_total / total} for e in ops[:rows]]}


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def markdown(result):
    lines = [f"# Training throughput ({result['device_name']}){' - ' + result['label'] if result.get('label') else ''}", "",
             f"Device `{result['device']}` ({result['device_name']}); commit {result['provenance']['git_commit']}; "
             f"torch {torch.__version__}; clock: {result.get('clock', 'wall')}; "
             f"{result['epochs']} epochs per run, epoch time = the shortest after the "
             "first (training steps only, no validation); random tensors of the data set's shape; the paper configs' settings. "
             f"'x dnn' is the family's epoch time over the deterministic network's (same architecture, "
             f"precision and run); issue 20 asks for at most {WITHIN}x. 'noise draws' is the time torch's normal_ "
             "takes for the N(0, 1) draws of local reparameterization in an epoch (one per output element of every "
             "Bayesian layer, timed alone with the same clock), and 'x dnn without them' the ratio once that time "
             "is taken off: what the rest of a Bayesian step costs against the deterministic one.", "",
             f"`python benchmarks/train_throughput.py {shlex.join(result.get('argv', []))}`", ""]
    if not result["device"].startswith("cuda"):
        lines += ["**CPU figures** (small training sets, few steps): they show the benchmark runs and how the "
                  "families compare on this CPU; issue 6's 2.5x was about a GPU, whose figures come from the "
                  "GPU command in benchmarks/train_throughput.py.", ""]
    for arch in result["archs"]:
        rows = [r for r in result["rows"] if r["arch"] == arch]
        r0 = rows[0]
        lines += [f"## {arch}, input {tuple(r0['input_shape'])}, batch {r0['batch_size']}, {r0['train_images']} "
                  f"training images per epoch (the real set has {r0['full_train_images']})", "",
                  f"| family | precision | epoch time (s) | images/s | x dnn | within {WITHIN}x | noise draws (s) | "
                  "x dnn without them | epoch time at the full set (s, extrapolated) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            ratio, rest = r.get("ratio_to_dnn"), r.get("ratio_to_dnn_without_noise")
            lines.append(f"| {r['family']} | {r['precision']} | {r['epoch_seconds']:.3f} | "
                         f"{r['images_per_second']:.1f} | {'' if ratio is None else f'{ratio:.2f}'} | "
                         f"{'' if ratio is None else ('yes' if ratio <= WITHIN else 'no')} | "
                         f"{r.get('noise_seconds', 0):.3f} | {'' if rest is None else f'{rest:.2f}'} | "
                         f"{r['full_train_images'] / r['images_per_second']:.1f} |")
        lines.append("")
    profiled = [r for r in result["rows"] if r.get("profile")]
    if profiled:
        lines += ["## Where the time goes (torch.profiler, one epoch, self CPU time)", ""]
        for r in profiled:
            p = r["profile"]
            top = "; ".join(f"{o['name']} {o['share']:.0%} ({o['calls']} calls)" for o in p["top"][:8])
            lines.append(f"- {r['arch']} {r['family']}: {p['total_self_cpu_ms']:.0f} ms in all; {top}")
        lines.append("")
    lines.append(f"Machine: {result['provenance']['machine']}; load average (1, 5, 15 min) before "
                 f"{result['load_average_before']}, after {result['load_average_after']} (a shared machine loads "
                 f"every figure).")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archs", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--precisions", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--train-size", nargs="+", type=int,
                    help="training images per epoch, one per --archs entry (default: the real sets' 60000 / 50000)")
    ap.add_argument("--batch-size", type=int, help="override the configs' batch size (1024 LeNet, 128 ResNet)")
    ap.add_argument("--epochs", type=int, default=3, help="epochs per run; the first is warm-up")
    ap.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--compile", action="store_true", help="torch.compile the forward (train.compile)")
    ap.add_argument("--out", required=True, help="results path without suffix (.json and .md are written)")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--profile", action="store_true", help="top operators of one more epoch per family")
    ap.add_argument("--label", default="", help="what code was measured (written into the results)")
    ap.add_argument("--cpu-clock", action="store_true",
                    help="epoch time = this process's CPU time, not wall time (a shared machine, 1 thread)")
    args = ap.parse_args(argv)
    if args.epochs < 2:
        ap.error("--epochs must be at least 2 (the first epoch is warm-up)")
    if args.train_size and len(args.train_size) != len(args.archs):
        ap.error("--train-size takes one number per --archs entry")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_clock:   # the trainer's train_seconds from the process's CPU time (module docstring)
        import types
        import edgebayes.train.sqs as sqs_module
        import edgebayes.train.trainer as trainer_module
        trainer_module.time = sqs_module.time = types.SimpleNamespace(perf_counter=time.process_time)
    args.clock = time.process_time if args.cpu_clock else time.perf_counter
    device = resolve_device(args.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    rows, load_before = [], os.getloadavg()
    for i, arch in enumerate(args.archs):
        config, shape, full = SETUPS[arch]
        cfg = load_pipeline_config(ROOT / config)
        splits = random_splits(shape, args.train_size[i] if args.train_size else full)
        # The KL is divided by the training images: with a few thousand of them instead of the real set's, it
        # weighs 10-25x more per step than in a real run, and ResNet-20's SS-GL at lr 0.1 diverged in its first
        # steps (the trainer now stops such a run; before, its NaN epochs were timed). Weighted by the share
        # of the real set, each step's loss is the real run's.
        cfg.train.kl_weight *= len(splits.train_x) / full
        for precision in args.precisions:
            timed = []
            for family in args.families:
                row = {"arch": arch, "input_shape": list(shape), "full_train_images": full,
                       **time_family(cfg, family, splits, args, precision)}
                timed.append(row)
                print(f"{arch} {precision} {family}: epoch {row['epoch_seconds']:.3f} s, "
                      f"{row['images_per_second']:.1f} images/s", flush=True)
            dnn = next((r for r in timed if r["family"] == "dnn"), None)
            for r in timed:
                if dnn is not None:
                    r["ratio_to_dnn"] = r["epoch_seconds"] / dnn["epoch_seconds"]
                    r["ratio_to_dnn_without_noise"] = (r["epoch_seconds"] - r["noise_seconds"]) / dnn["epoch_seconds"]
            rows += timed
    result = {"device": str(device), "device_name": device_name(device), "archs": args.archs, "label": args.label,
              "clock": "process CPU time" if args.cpu_clock else "wall",
              "threads": torch.get_num_threads(), "code": str(Path(fit.__code__.co_filename).parents[2]),
              "epochs": args.epochs, "argv": sys.argv[1:] if argv is None else argv, "rows": rows,
              "cuda": torch.version.cuda, "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "provenance": provenance(None)}
    write_json(Path(args.out + ".json"), result)
    md = markdown(result)
    Path(args.out + ".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
