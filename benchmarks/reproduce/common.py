"""What every paper-table command shares: its flags, one pipeline train run per (config, seed), the header.

Each run goes through the pipeline's own train stage (stages.run_stage: resumable, cached by its config
fingerprint under --runs-dir), so a table comes out of the code users run. A run with fewer epochs than
the config (--epochs) or a training subset (--train-subset) is a SMOKE RUN: the table says so in its
title and file name, and its figures are not the paper's setting.
"""

import argparse
import copy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # structured_sparsity.py's measurement, shared

from edgebayes.config import load_device_profile, load_pipeline_config  # noqa: E402
from edgebayes.errors import InputError  # noqa: E402
from edgebayes.provenance import provenance  # noqa: E402
from edgebayes.stages import Context, run_stage, splits_for  # noqa: E402


def parser(description, default_seeds):
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--seeds", nargs="+", type=int, default=default_seeds, help="one run per seed")
    ap.add_argument("--epochs", type=int, help="override train.epochs (a smoke run when below the paper's)")
    ap.add_argument("--train-subset", type=int, help="train on the first N training images (a smoke run)")
    ap.add_argument("--batch-size", type=int, help="override train.batch_size")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], help="override train.device")
    ap.add_argument("--precision", choices=["fp32", "bf16"], help="override train.precision")
    ap.add_argument("--processes", type=int, help="override train.processes (DDP, train/distributed.py)")
    ap.add_argument("--data-root", help="override data.root (else the config's, $EDGEBAYES_DATA, ./data)")
    ap.add_argument("--runs-dir", default="runs/reproduce", help="where the runs go (resumable)")
    ap.add_argument("--out", help="results path without suffix (default under benchmarks/results/reproduce/)")
    return ap


def variant(config_path, args, seed):
    """The config of one run: the paper config with this seed and the command line's overrides."""
    cfg = copy.deepcopy(load_pipeline_config(config_path))
    cfg.seed = seed
    suffix = []
    if args.epochs:
        cfg.train.epochs = args.epochs
        cfg.train.lr_milestones = [m for m in cfg.train.lr_milestones if m <= args.epochs]
        if cfg.model.family == "sqs":
            cfg.sqs.pretrain_epochs = min(cfg.sqs.pretrain_epochs, args.epochs)
        suffix.append(f"e{args.epochs}")
    if args.train_subset:
        cfg.data.train_subset = args.train_subset
        suffix.append(f"n{args.train_subset}")
    for key in ("batch_size", "device", "precision", "processes"):
        if getattr(args, key) is not None:
            setattr(cfg.train, key, getattr(args, key))
    if args.data_root:
        cfg.data.root = args.data_root
    cfg.name = "-".join([cfg.name, f"s{seed}", *suffix])
    return cfg


def smoke(args, cfg_epochs):
    return bool(args.train_subset) or (args.epochs is not None and args.epochs < cfg_epochs)


def check_data(config_path, args, what):
    """Load the data set once (cached for the runs); exit 2 with the loader's message when it is absent."""
    cfg = variant(config_path, args, args.seeds[0])
    try:
        splits_for(Context(cfg, load_device_profile("local")))
    except InputError as e:
        print(f"{what}: {e}", file=sys.stderr)
        sys.exit(2)


def train_run(config_path, cfg, args):
    """Train (or resume, or reuse) one run through the pipeline's train stage; returns its Context."""
    ctx = Context(cfg, load_device_profile("local"), runs_dir=Path(args.runs_dir), config_path=str(config_path))
    t0 = time.perf_counter()
    run_stage(ctx, "train")
    ctx.train_seconds = time.perf_counter() - t0
    return ctx


def header(title, args, cfg_epochs, paper_setting, extra=()):
    """Title and the facts every table states: seeds, epochs, subset, machine, commit, versions."""
    prov = provenance(None)
    is_smoke = smoke(args, cfg_epochs)
    epochs = args.epochs or cfg_epochs
    lines = [f"# {'SMOKE RUN (not a result): ' if is_smoke else ''}{title}", ""]
    if is_smoke:
        lines += ["**Smoke run**: fewer epochs and/or training images than the paper; it shows the command works "
                  "end to end, its figures say nothing about reproduction.", ""]
    lines += [f"- Paper's setting: {paper_setting}",
              f"- This run: {epochs} epochs (config: {cfg_epochs}), seeds {args.seeds}, training images: "
              f"{args.train_subset or 'all'}, device {args.device or 'config (auto)'}, precision "
              f"{args.precision or 'config'}",
              *[f"- {e}" for e in extra],
              f"- Commit {prov['git_commit']}; versions {prov['versions']}",
              f"- Machine: {prov['machine']}", ""]
    return lines, prov, is_smoke


def out_path(args, default_name, is_smoke):
    if args.out:
        return Path(args.out)
    return ROOT / "benchmarks" / "results" / "reproduce" / (default_name + ("_smoke" if is_smoke else ""))
