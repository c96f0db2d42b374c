"""How many optimisation steps does a network cut to a FLOPs target need to recover, on a small training set?
(issue 33: train.batch_size left out, train/flops_target.py fine_tuning_batch_size)

A user's own data set is often small (an image folder of a thousand images). At a batch of 1024 that is one or
two steps an epoch, and a network cut to its target in its first steps has nothing left to repair it with. This
sweep fine-tunes the same trained nets for the same E epochs at several batch sizes, edgebayes SS-GL toward the
target and Torch-Pruning's magnitude pruner pruned to the same physical FLOPs (benchmarks/finetune_compress.py's
functions: the same dense nets, optimizer, schedule and metrics), and says which batch edgebayes picks when
train.batch_size is left out ('auto' row: eb.fit without batch_size).

Data: scikit-learn's 8x8 digits (offline), bilinear to 32x32 RGB: 1,150 training images, the size of a small
user folder; validation and test carved out of the rest (finetune_compress.load_images).

    python benchmarks/finetune_steps.py --out benchmarks/results/finetune_steps        # ~10 min a seed, 1 thread
    python benchmarks/finetune_steps.py --nets custom --batches 64 --seeds 0 --out /tmp/s  # a minute
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import finetune_compress as fc  # noqa: E402

from edgebayes.config import TrainConfig  # noqa: E402
from edgebayes.provenance import atomic_path, provenance, read_json, result_path  # noqa: E402
from edgebayes.train.flops_target import steps_at_final_structure  # noqa: E402

# the trainer's default, which every edgebayes row runs with (the benchmark does not set it)
SCHEDULE_FRACTION = TrainConfig.model_fields["flops_schedule_fraction"].default


def final_steps(n, batch, epochs):
    """Steps after the schedule's last cut, counted as the trainer counts them (fine_tuning_batch_size)."""
    return steps_at_final_structure(epochs * math.ceil(n / batch), SCHEDULE_FRACTION)


def settings_of(args):
    """What makes two runs' rows comparable (--resume, --merge): finetune_compress's settings, the last epoch at a
    tenth of the rate as this sweep always runs it, and the FLOPs target. `args`: the namespace or its saved dict."""
    ns = argparse.Namespace(**{**(args if isinstance(args, dict) else vars(args)), "decay_last_epoch": True})
    return {**fc.settings_of(ns), "target": ns.target}


def batch_label(row, asked):
    """'auto: 16' for the trainer's own choice, the batch asked otherwise."""
    return f"auto: {row.get('batch', '?')}" if asked == "auto" else str(asked)


def row_key(row):
    """What a row is the result of: one per (net, method, batch asked, seed) in a result."""
    return row["net"], row["method"], row["batch_asked"], row["seed"]


def one_per_key(rows):
    """`rows` with one row per row_key, the later one where two share it (a failed row run again, a merged file
    given twice or a seed run in two files): a mean over seeds must count each once."""
    return list({row_key(r): r for r in rows}.values())


def run(args, data, rows, write):
    done = {row_key(r) for r in rows if "error" not in r}
    milestones = fc.fine_tune_milestones(args.epochs, True)
    device = args.device
    n = len(data["train"][1])
    for net in args.nets:
        for seed in args.seeds:
            trained, _ = fc.dense_model(net, seed, data, args, device, Path(args.cache))
            dense = fc.plain_metrics(trained, data)
            base = {"net": net, "seed": seed, "dense_accuracy": dense["accuracy"], "dense_ece": dense["ece"],
                    "target": args.target, "fine_tune_epochs": args.epochs, "train_images": n}
            for asked in args.batches:
                batch = None if asked == "auto" else int(asked)
                wanted = args.target
                for method in ("edgebayes-ss-gl", "tp-magnitude"):
                    if (net, method, asked, seed) in done or (method.startswith("tp") and batch is None):
                        continue   # Torch-Pruning has no batch of its own to pick: its rows are the numbered ones
                    row = {**base, "method": method, "batch_asked": asked}
                    t0 = time.perf_counter()
                    try:
                        if method == "edgebayes-ss-gl":
                            row.update(fc.edgebayes_row(trained, "ss-gl", args.target, data, args.epochs, args.mc,
                                                        seed, device, log=lambda *_: None, milestones=milestones,
                                                        batch=batch))
                            if row["flops_ratio_physical"] <= args.target * (1 + fc.TP_TOLERANCE):
                                wanted = row["flops_ratio_physical"]   # Torch-Pruning at the same FLOPs
                        else:
                            row.update(fc.tp_row(trained, "tp-magnitude", wanted, data, args.epochs, seed, device,
                                                 milestones, batch=batch))
                            row["batch"] = batch
                        row["final_structure_steps"] = final_steps(n, row["batch"], args.epochs)
                    except Exception as e:   # a failure is a result: which method, why
                        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                        row["error"] = f"{type(e).__name__}: {first[:300]}"
                    row["seconds"] = time.perf_counter() - t0
                    rows[:] = one_per_key([*rows, row])
                    print(json.dumps({k: v for k, v in row.items() if k != "flops_ratio_physical_samples"}),
                          flush=True)
                    write(rows)


def markdown(result):
    args, rows = result["args"], result["rows"]
    prov = result["provenance"]
    lines = ["# Fine-tuning steps after the cut, on a small training set (benchmarks/finetune_steps.py)", "",
             f"Issue 33: {rows[0]['train_images'] if rows else '?'} training images (scikit-learn's digits at "
             f"32x32 RGB), each net trained here as a plain network ({args['dense_epochs']} epochs, Adam 1e-3, "
             f"batch {fc.BATCH}), then fine-tuned {args['epochs']} epochs (the last at a tenth of the rate) toward "
             f"{args['target']:g} of its FLOPs at each batch size: edgebayes SS-GL (M = {args['mc']}, the temperature "
             "it ships) and Torch-Pruning's magnitude pruner pruned to the same physical FLOPs. 'steps after the cut': "
             "the optimisation steps the network trains at its final structure (edgebayes cuts during the first "
             f"{SCHEDULE_FRACTION:.0%} of the steps; the same count is given for Torch-Pruning, which prunes before the first). 'auto': "
             "train.batch_size left out, the trainer's choice (train/flops_target.py fine_tuning_batch_size). Test "
             "accuracy %, ECE in brackets.", "",
             f"`{result['command']}`", "",
             f"Machine: {prov.get('machine', {}).get('machine', '?')} CPU, {prov.get('machine', {}).get('cpu_count')} "
             f"cores, {args['threads']} thread(s); commit {prov.get('git_commit')}; torch "
             f"{prov.get('versions', {}).get('torch')}.", "",
             "Mean over the seeds (each seed its own dense net, trained here), test accuracy % and ECE:", ""]

    def cell(r):
        if r is None:
            return "—"
        if "error" in r:
            return f"fails: {r['error'][:80]}"
        return f"{100 * r['accuracy']:.2f} ({r['ece']:.4f})"

    lines += summary(rows) + ["", "Per seed:", "",
                              "| net (dense %) | seed | batch | steps after the cut | physical FLOPs | edgebayes SS-GL "
                              "| Torch-Pruning magnitude |", "|---|---|---|---|---|---|---|"]
    keys = dict.fromkeys((r["net"], r["seed"], r["batch_asked"]) for r in rows)
    for net, seed, asked in keys:
        eb = next((r for r in rows if (r["net"], r["seed"], r["batch_asked"], r["method"]) ==
                   (net, seed, asked, "edgebayes-ss-gl")), None)
        tp = next((r for r in rows if (r["net"], r["seed"], r["batch_asked"], r["method"]) ==
                   (net, seed, asked, "tp-magnitude")), None)
        first = eb or tp
        shown = batch_label(first, asked)
        flops = "—" if eb is None or "error" in eb else f"{eb['flops_ratio_physical']:.3f}"
        lines.append(f"| {net} ({100 * first['dense_accuracy']:.2f}) | {seed} | {shown} | "
                     f"{first.get('final_structure_steps', '—')} | {flops} | {cell(eb)} | {cell(tp)} |")
    return "\n".join(lines) + "\n"


def summary(rows):
    """One line per (net, batch): each method's mean accuracy and ECE over the seeds that ran, the failures counted."""
    lines = ["| net (mean dense %) | batch | seeds | steps after the cut | edgebayes SS-GL | Torch-Pruning magnitude |",
             "|---|---|---|---|---|---|"]
    for net, asked in dict.fromkeys((r["net"], r["batch_asked"]) for r in rows):
        group = [r for r in rows if (r["net"], r["batch_asked"]) == (net, asked)]
        seeds = sorted({r["seed"] for r in group})
        dense = 100 * sum({r["seed"]: r["dense_accuracy"] for r in group}.values()) / len(seeds)

        def mean(method):
            ran = [r for r in group if r["method"] == method]
            ok = [r for r in ran if "error" not in r]
            if not ran:
                return "—"
            if not ok:
                return f"fails on {len(ran)} of {len(ran)}"
            failed = f", fails on {len(ran) - len(ok)}" if len(ok) < len(ran) else ""
            return (f"{100 * sum(r['accuracy'] for r in ok) / len(ok):.2f} "
                    f"({sum(r['ece'] for r in ok) / len(ok):.4f}){failed}")

        first = next((r for r in group if "error" not in r), group[0])
        lines.append(f"| {net} ({dense:.2f}) | {batch_label(first, asked)} | {len(seeds)} | {first.get('final_structure_steps', '—')} | "
                     f"{mean('edgebayes-ss-gl')} | {mean('tp-magnitude')} |")
    return lines


def write_result(result, out):
    """out.json and out.md, each written whole or not at all."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(result_path(out, ".json")) as tmp:
        Path(tmp).write_text(json.dumps(result, indent=1, default=str))
    with atomic_path(result_path(out, ".md")) as tmp:
        Path(tmp).write_text(markdown(result))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nets", nargs="+", default=["mobilenet_v2", "custom", "shufflenet_v2_x0_5"])
    parser.add_argument("--batches", nargs="+", default=["128", "64", "32", "16", "auto"],
                        help="fine-tuning batch sizes; auto: edgebayes' own choice (train.batch_size left out)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--target", type=float, default=0.5, help="FLOPs fraction of the dense net")
    parser.add_argument("--epochs", type=int, default=3, help="fine-tuning epochs")
    parser.add_argument("--dense-epochs", type=int, default=10)
    parser.add_argument("--mc", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--cache", default=str(fc.ROOT / "runs" / "finetune_steps_cache"))
    parser.add_argument("--out", default=str(fc.RESULTS / "finetune_steps"))
    parser.add_argument("--resume", action="store_true", help="keep the rows of --out's JSON (same settings)")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="write --out from the rows of these results files "
                        "(runs split over processes, one seed each; the same settings; where two files hold the same "
                        "net, method, batch and seed, the later file's row)")
    args = parser.parse_args(argv)
    command = "python benchmarks/finetune_steps.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.merge:
        results = []
        for path in args.merge:
            try:
                result = read_json(Path(path))
            except (OSError, ValueError) as e:
                parser.error(f"--merge: {path}: {type(e).__name__}: {e}")
            if not (isinstance(result, dict) and {"rows", "args", "command"} <= set(result)):
                parser.error(f"--merge: {path} is not a results file of this benchmark (rows, args, command)")
            if settings_of(result["args"]) != settings_of(results[0]["args"] if results else result["args"]):
                parser.error(f"--merge: {path} was made with other settings ({settings_of(result['args'])}) than "
                             f"{args.merge[0]} ({settings_of(results[0]['args'])})")
            results.append(result)
        commands = "; ".join(r["command"] for r in results)
        merged = {**results[0], "rows": one_per_key([row for r in results for row in r["rows"]]),
                  "command": f"{commands}, then {command}", "provenance": provenance("finetune_steps")}
        write_result(merged, Path(args.out))
        print(f"wrote {result_path(Path(args.out), '.json')} and .md")
        return 0
    for asked in args.batches:
        if asked != "auto" and not (asked.isdigit() and int(asked) >= 2):
            parser.error(f"--batches: expected integers >= 2 or auto, got {asked!r}")
    if not 0 < args.target <= 1:
        parser.error(f"--target: expected a FLOPs fraction in (0, 1], got {args.target}")
    for flag in ("epochs", "dense_epochs", "mc", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: expected at least 1, got {getattr(args, flag)}")
    import torchvision

    for net in args.nets:   # the benchmark's own nets, or any torchvision classification builder
        if net not in fc.NETS and not callable(getattr(torchvision.models, net, None)):
            parser.error(f"--nets: {net!r} is neither one of {', '.join(fc.NETS)} nor a torchvision model builder")
    torch.set_num_threads(args.threads)
    # finetune_compress's dense-net cache key and data loader read these
    args.data, args.data_seed, args.train_size, args.val_size, args.test_size = "digits", 0, 1150, 300, 360
    data = fc.load_images("digits", None, {"train_size": args.train_size, "val_size": args.val_size,
                                           "test_size": args.test_size}, args.data_seed)
    out = Path(args.out)
    rows = []
    if args.resume and result_path(out, ".json").is_file():
        earlier = read_json(result_path(out, ".json"))
        if settings_of(earlier["args"]) != settings_of(args):
            parser.error(f"--resume: {result_path(out, '.json')} was made with other settings "
                         f"({settings_of(earlier['args'])}); use another --out or the same settings")
        rows = earlier["rows"]
    prov = provenance("finetune_steps")
    saved_args = dict(vars(args))

    run(args, data, rows, lambda rows: write_result({"rows": rows, "args": saved_args, "command": command,
                                                     "provenance": prov}, out))
    print(f"wrote {result_path(out, '.json')} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
