"""Why the inclusion probabilities of a spike-and-slab layer fall below 0.5 together, measured.

Two measurements on MNIST LeNet-5-Caffe (the paper config, batch 32, Adam 1e-3, the pipeline's trainer):

  gradients   at initialisation, per prunable layer: the mean |d NLL / d logit gamma_j| of one batch against
              d (KL / N) / d logit gamma_j, and the slab KL per weight (what makes the KL term large);
  variants    short trainings (a few epochs) of one family under a variant, with the trainer's per-epoch
              record: kept units of the median model, mean inclusion per layer, validation accuracy of the
              median model, NLL and KL:
                baseline      the config as it is;
                paper         without the schedule of issue 20 (inclusion_lr, ordered KL warm-up): the paper's
                              optimizer;
                warmupE       train.kl_warmup_epochs = E (the KL scaled up linearly over E epochs);
                fromF         train.kl_warmup_from = F: the warm-up is geometric, from F up to 1 (with warmupE);
                ordered       train.kl_warmup_ordered: the KL's gradient reaches the inclusion logits unit after
                              unit (with warmupE);
                logitlrK      train.inclusion_lr = lr / K: the inclusion logits at Adam learning rate lr / K,
                              everything else at lr (an optimizer setting, not the objective);
                rhoR          the slab's posterior scales initialised at softplus(R) instead of softplus(-6);
                gammaG        the inclusion probabilities initialised at G instead of prior.gamma_init;
                spreadL       each unit's inclusion logit drawn uniformly in [L, logit gamma_init] (L = 0 if
                              left out) instead of all at logit gamma_init;
                sigma0sqS     the slab variance sigma0^2 = S instead of the config's;
                noncentered   the non-centered family (w = z tau* w0), whose exact KL does not weight w0's
                              KL by gamma (train/spike_slab.py);
              parts joined by '+' combine (logitlr3+rho-3).

Results: <out>.json (histories, gradients, provenance) and <out>.md. Checkpoints under --work (resumable).

    EDGEBAYES_DATA=/work/shared/datasets python benchmarks/inclusion_collapse.py --family ss-gl --epochs 3 \
        --variants baseline warmup2 logitlr10 --out benchmarks/results/inclusion_collapse_lenet5_ssgl
"""

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from edgebayes.config import load_pipeline_config
from edgebayes.data import load_data
from edgebayes.provenance import provenance, write_json
from edgebayes.train import families, trainer

ROOT = Path(__file__).resolve().parents[1]


def config(family, epochs, batch_size):
    cfg = load_pipeline_config(ROOT / f"configs/mnist-lenet5-{family.replace('-', '')}.yaml")
    t = cfg.train
    t.epochs, t.batch_size, t.mc_samples_val, t.device, t.lr_milestones = epochs, batch_size, 1, "cpu", []
    return cfg


def gradients_at_init(cfg, splits, seed=0):
    """Per prunable layer: likelihood vs KL gradient on the inclusion logits at initialisation."""
    n = len(splits.train_x)
    torch.manual_seed(seed)
    model = families.build(cfg, splits).train()
    layers = [(name, layer) for name, layer in model.bayesian_layers() if layer.prunable]
    logits = [layer.gamma_logit for _, layer in layers]
    x, y = splits.train_x[: cfg.train.batch_size], splits.train_y[: cfg.train.batch_size]
    g_nll = torch.autograd.grad(F.cross_entropy(model(x), y), logits)
    g_kl = torch.autograd.grad(model.kl() / n, logits)
    return {name: {"prior_inclusion": layer.prior_inclusion,
                   "nll_grad_mean_abs": float(a.abs().mean()), "nll_grad_max_abs": float(a.abs().max()),
                   "kl_grad_mean": float(b.mean()), "kl_grad_min": float(b.min()),
                   "slab_kl_per_weight": float(layer.weight_kl_per_group().detach().mean() / layer.weight_mu[0].numel())}
            for (name, layer), a, b in zip(layers, g_nll, g_kl)}


def _scales_at(rho):
    """The slab's posterior scales start at softplus(rho) instead of softplus(-6)."""
    def modify(model):
        with torch.no_grad():
            for _, layer in model.bayesian_layers():
                layer.weight_rho.fill_(rho)
                if layer.bias_rho is not None:
                    layer.bias_rho.fill_(rho)
        return model
    return modify


def _spread_logits(then, gamma_init, low=0.0):
    """Inclusion logits drawn uniformly between `low` (0: gamma 0.5) and logit gamma_init (per unit) instead
    of all at logit gamma_init: units of a layer no longer start equal."""
    def modify(model):
        model = then(model)
        top = math.log(gamma_init / (1 - gamma_init))
        with torch.no_grad():
            for _, layer in model.bayesian_layers():
                if layer.prunable:
                    layer.gamma_logit.uniform_(low, top)
        return model
    return modify


def train_variant(cfg, splits, variant, work):
    """The trainer's history of one variant (module docstring): the one training loop with the family's
    net, a modified config or build. Parts joined by '+' combine (logitlr3+rho-3)."""
    modify = lambda model: model   # noqa: E731
    # paper first (the others change it), spread last (it wraps the other builds)
    for part in sorted(variant.split("+"), key=lambda p: (p != "paper", p.startswith("spread"))):
        if part.startswith("warmup"):
            cfg.train.kl_warmup_epochs = int(part[len("warmup"):])
        elif part == "ordered":
            cfg.train.kl_warmup_ordered = True
        elif part.startswith("from"):
            cfg.train.kl_warmup_from = float(part[len("from"):])
        elif part.startswith("logitlr"):
            cfg.train.inclusion_lr = cfg.train.lr / float(part[len("logitlr"):])
        elif part == "paper":
            cfg.train.inclusion_lr, cfg.train.kl_warmup_epochs, cfg.train.kl_warmup_ordered = None, 0, False
        elif part.startswith("rho"):
            modify = _scales_at(float(part[len("rho"):]))
        elif part.startswith("spread"):
            modify = _spread_logits(modify, cfg.prior.gamma_init, float(part[len("spread"):] or 0))
        elif part.startswith("sigma0sq"):
            cfg.prior.sigma0_sq = float(part[len("sigma0sq"):])
        elif part == "noncentered":
            cfg.prior.parameterization = "non-centered"
        elif part.startswith("gamma"):
            cfg.prior.gamma_init = float(part[len("gamma"):])
        elif part != "baseline":
            raise SystemExit(f"unknown variant {part!r} (module docstring; joined by +)")
    _, history = trainer.train(cfg, splits, work / f"{cfg.name}_{variant}.pt",
                               lambda: modify(families.build(cfg, splits)), log=print)
    return history


def markdown(r):
    lines = [f"# Inclusion-probability collapse, {r['family']} on MNIST LeNet-5-Caffe (batch {r['batch_size']})", "",
             f"Commit {r['provenance']['git_commit']}; {r['train_images']} training images (N in KL / N), Adam "
             f"{r['lr']}, {r['steps_per_epoch']} steps per epoch, 1 thread.", "",
             "## Gradients on the inclusion logits at initialisation (one batch)", "",
             "| layer | prior inclusion | mean abs d NLL / d logit | max abs | d (KL/N) / d logit, mean | "
             "slab KL per weight (nats) |", "|---|---|---|---|---|---|"]
    for name, g in r["gradients_at_init"].items():
        lines.append(f"| {name} | {g['prior_inclusion']:.2e} | {g['nll_grad_mean_abs']:.2e} | "
                     f"{g['nll_grad_max_abs']:.2e} | {g['kl_grad_mean']:.2e} | {g['slab_kl_per_weight']:.2f} |")
    lines += ["", "## Variants: per epoch, kept units of the median model [conv1, conv2, fc1, fc2], mean inclusion "
              "(fc1, fc2), validation accuracy of the median model", "",
              "| variant | epoch | kept units | mean inclusion fc1 / fc2 | val accuracy (median model) | NLL | KL |",
              "|---|---|---|---|---|---|---|"]
    for variant, history in r["variants"].items():
        for h in history:
            inc = h["mean_inclusion"]
            lines.append(f"| {variant} | {h['epoch']} | {h['kept_nodes']} | {inc.get('fc1', 0):.3f} / "
                         f"{inc.get('fc2', 0):.3f} | {h['val_accuracy']:.4f} | {h['nll']:.3f} | {h['kl']:.3g} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="ss-gl", choices=["ss-ig", "ss-gl", "ss-ghs"])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--variants", nargs="+", default=["baseline", "warmup2", "logitlr10"])
    ap.add_argument("--work", default="runs/inclusion_collapse", help="checkpoints (resumable)")
    ap.add_argument("--out", required=True, help="results path without suffix")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    base = config(args.family, args.epochs, args.batch_size)
    splits = load_data(base.data, base.seed)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    result = {"family": args.family, "batch_size": args.batch_size, "lr": base.train.lr,
              "train_images": len(splits.train_x), "steps_per_epoch": -(-len(splits.train_x) // args.batch_size),
              "gradients_at_init": gradients_at_init(base, splits), "variants": {}}
    for variant in args.variants:
        result["variants"][variant] = train_variant(config(args.family, args.epochs, args.batch_size), splits,
                                                    variant, work)
        result["provenance"] = provenance("inclusion_collapse")
        write_json(Path(args.out + ".json"), result)   # after every variant: a cut-short run keeps what finished
        Path(args.out + ".md").write_text(markdown(result))
    print(Path(args.out + ".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
