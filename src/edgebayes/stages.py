"""The pipeline's stages: train -> select -> export (compress inside) -> deploy (+ benchmark) -> report.

Each stage reads the previous stage's artifacts from disk and writes its own under runs/<name>/, so any
stage can be re-run alone. A stage is skipped when its `stage.json` holds the same fingerprint: the hash
of the config sections it depends on plus the fingerprints of the stages it reads. A changed config or
device therefore re-runs exactly what depends on it. (Code changes do not invalidate a stage: use
`--force` or `make clean` after editing the code.)

    runs/<name>/train/{checkpoint.pt, metrics.json}
    runs/<name>/select/<device>/{candidates.json, choice.json}
    runs/<name>/export/<device>/{export.json, bundle/}
    runs/<name>/deploy/<device>/results.json
    runs/<name>/report/<device>/{report.json, report.html, *.png}

Selection depends on the device, so its folder is per device (DESIGN.md puts it at select/; the code wins).
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from edgebayes.config import ConfigError, as_dict, fingerprint
from edgebayes.data import load_data
from edgebayes.errors import StageError
from edgebayes.provenance import atomic_path, provenance, read_json, write_json

STAGES = ("train", "select", "export", "deploy", "report")


@dataclass
class Context:
    cfg: object
    profile: object
    runs_dir: Path = Path("runs")
    force: bool = False
    log: object = print
    config_path: str = "pipeline.yaml"   # named in error messages

    @property
    def run_dir(self):
        return self.runs_dir / self.cfg.name

    def stage_dir(self, stage):
        if stage == "train":
            return self.run_dir / "train"
        return self.run_dir / stage / self.profile.name

    def fingerprint(self, stage):
        c, p = self.cfg, self.profile
        if stage == "train":
            sqs = [c.sqs] if c.model.family == "sqs" else []  # other families' fingerprints stay as they were
            return fingerprint("train", c.seed, c.data, c.model, c.prior, c.train, *sqs)
        if stage == "select":
            return fingerprint("select", self.fingerprint("train"), c.select, c.export, p)
        if stage == "export":
            return fingerprint("export", self.fingerprint("select"), c.export)
        if stage == "deploy":
            return fingerprint("deploy", self.fingerprint("export"), c.benchmark, p)
        return fingerprint("report", self.fingerprint("deploy"))

    def is_fresh(self, stage):
        marker = self.stage_dir(stage) / "stage.json"
        return (not self.force and marker.is_file()
                and read_json(marker).get("fingerprint") == self.fingerprint(stage))

    def mark_done(self, stage):
        write_json(self.stage_dir(stage) / "stage.json", {"stage": stage, "fingerprint": self.fingerprint(stage)})

    def provenance(self, stage):
        return provenance(self.fingerprint(stage))

    def require(self, stage, *files):
        for f in files:
            path = self.stage_dir(stage) / f
            if not path.exists():
                raise StageError(f"{path} is missing: run `edgebayes {stage}` (or `make {stage}`) first")
        return self.stage_dir(stage)


_splits_cache = {}


def splits_for(ctx):
    key = fingerprint(ctx.cfg.data, ctx.cfg.seed)
    if key not in _splits_cache:
        _splits_cache[key] = load_data(ctx.cfg.data, ctx.cfg.seed)
    return _splits_cache[key]


def load_trained_model(ctx):
    from edgebayes.train.trainer import model_for

    out = ctx.require("train", "checkpoint.pt")
    model = model_for(ctx.cfg, splits_for(ctx))
    state = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    return model.eval()


# ---------------------------------------------------------------------------------------------
def run_train(ctx):
    from edgebayes.train.metrics import ood_scores, reliability_bins, structure_report
    from edgebayes.train.trainer import evaluate, train

    cfg, splits = ctx.cfg, splits_for(ctx)  # first: bad data must fail before anything is touched
    out = ctx.stage_dir("train")
    checkpoint = out / "checkpoint.pt"
    # A checkpoint of another config must not be resumed: start over.
    marker = out / "run.json"
    if checkpoint.exists() and (ctx.force or not marker.is_file()
                                or read_json(marker).get("fingerprint") != ctx.fingerprint("train")):
        checkpoint.unlink()
    write_json(marker, {"fingerprint": ctx.fingerprint("train")})

    model, history = train(cfg, splits, checkpoint, log=ctx.log)
    knob_value, m = model.default_knob, cfg.train.mc_samples_eval
    test, compressed, probs = evaluate(model, splits.test_x, splits.test_y, knob_value, m, cfg.seed)
    structure = structure_report(compressed.dense_sample, compressed.samples[0], compressed.kept,
                                 splits.input_shape)
    metrics = {
        "family": cfg.model.family,
        "model": {"arch": cfg.model.arch, "in_features": int(np.prod(splits.input_shape)),
                  "hidden": cfg.model.hidden, "classes": len(splits.classes)},
        "data": {"dataset": cfg.data.dataset, "train": len(splits.train_x), "val": len(splits.val_x),
                 "test": len(splits.test_x)},
        "epochs": cfg.train.epochs,
        "test": {**test, "mc_samples": m, "knob": model.knob, "knob_value": knob_value},
        "reliability": reliability_bins(probs, splits.test_y.numpy()),
        "sparsity": {"layers": structure["layers"]},
        **{k: structure[k] for k in ("compression_ratio", "flops_ratio", "physical_compression_ratio",
                                     "physical_flops_ratio", "dense_weights", "kept_weights",
                                     "dense_flops", "pruned_flops")},
        "history": history,
        "provenance": ctx.provenance("train"),
    }
    if cfg.model.family == "sqs":  # accuracy against the full-precision start, compression by formula and bytes
        from edgebayes.train.sqs import stage_summary
        metrics["sqs"] = stage_summary(model, splits, out, knob_value, test)
        ctx.log(f"train: SQS drop {metrics['sqs']['accuracy_drop']:+.4f} against full precision; compression "
                f"{metrics['sqs']['rate_formula']:.1f}x by formula, {metrics['sqs']['rate_bytes']:.1f}x by file bytes")
    if splits.ood_x is not None:
        ood_probs = compressed.mc_model()(splits.ood_x).detach().numpy()
        metrics["ood"] = {"set": cfg.data.ood, **ood_scores(probs, ood_probs)}
    write_json(out / "metrics.json", metrics)
    ctx.log(f"train: test accuracy {test['accuracy']:.4f}, NLL {test['nll']:.4f}, ECE {test['ece']:.4f}; "
            f"kept nodes {[l['kept'] for l in structure['layers']]}; compression {structure['compression_ratio']:.3f}, "
            f"FLOPs ratio {structure['flops_ratio']:.3f} (after surgery {structure['physical_flops_ratio']:.3f})")


def run_select(ctx):
    from edgebayes.deploy.select import choose, score_candidates

    model, splits = load_trained_model(ctx), splits_for(ctx)
    try:
        model.operating_points(ctx.cfg.select.knob_values)
    except ValueError as e:
        raise ConfigError(f"{ctx.config_path}: select.knob_values: {e}") from None
    candidates = score_candidates(model, ctx.cfg, ctx.profile, splits.val_x, splits.val_y, log=ctx.log)
    out = ctx.stage_dir("select")
    common = {"device": ctx.profile.name, "budgets": as_dict(ctx.profile.budgets),
              "objective": ctx.cfg.select.objective, "provenance": ctx.provenance("select")}
    write_json(out / "candidates.json", {**common, "candidates": candidates})
    choice = choose(candidates, ctx.cfg.select.objective, ctx.profile.budgets)
    write_json(out / "choice.json", {**common, **choice})
    c = choice["candidate"]
    ctx.log(f"select: {choice['knob']} {choice['knob_value']}, M={choice['mc_samples']} "
            f"(val accuracy {c['val']['accuracy']:.4f}, latency {c['cost']['latency_ms']:.3f} ms); {choice['reason']}")


def run_export(ctx):
    from edgebayes.export.bundle import write_bundle
    from edgebayes.export.compress import compress, predict
    from edgebayes.export.onnx_export import export_onnx, onnx_parameter_count, onnx_predict
    from edgebayes.train.metrics import classification_metrics, count_weights, structure_report

    choice = read_json(ctx.require("select", "choice.json") / "choice.json")
    model, splits = load_trained_model(ctx), splits_for(ctx)
    knob_value, m = choice["knob_value"], choice["mc_samples"]
    compressed = compress(model, knob_value, m, ctx.cfg.seed)
    mc_model = compressed.mc_model()
    x, y = splits.test_x, splits.test_y.numpy()
    reference_probs = predict(mc_model, x).numpy()
    out = ctx.stage_dir("export")
    with atomic_path(out / "model.onnx") as tmp:
        export_onnx(mc_model, x[:1], tmp, ctx.cfg.export.opset)
        onnx_probs = onnx_predict(tmp, x.numpy())
        gap = float(np.abs(onnx_probs - reference_probs).max())
        tol = ctx.cfg.export.fidelity_tolerance
        if gap > tol:
            raise StageError(f"export: ONNX probabilities differ from the PyTorch MC average by {gap:.2e} "
                             f"> export.fidelity_tolerance {tol:.0e}; the bundle was not written")
        onnx_params = onnx_parameter_count(tmp)
        kept_per_sample = count_weights(compressed.samples[0], fold_batch_norm=True)
        manifest = write_bundle(
            out / "bundle", tmp, x.numpy(), y, reference_probs, classes=splits.classes, mc_samples=m,
            knob_name=model.knob, knob_value=knob_value,
            reference_metrics=classification_metrics(reference_probs, y), provenance=ctx.provenance("export"))
    structure = structure_report(compressed.dense_sample, compressed.samples[0], compressed.kept,
                                 splits.input_shape)
    summary = {
        "format": "onnx", "precision": "fp32", "mc_samples": m, "knob": model.knob, "knob_value": knob_value,
        "sparsity": {"layers": structure["layers"]},
        **{k: structure[k] for k in ("compression_ratio", "flops_ratio", "physical_compression_ratio",
                                     "physical_flops_ratio")},
        "kept_units": {name: int(k.sum()) for name, k in compressed.kept.items()},
        "onnx_params": onnx_params, "kept_weights_per_sample": kept_per_sample,
        "kept_weights_total": kept_per_sample * m, "params_match": onnx_params == kept_per_sample * m,
        "fidelity_max_abs_prob_diff": gap, "fidelity_tolerance": tol,
        "model_bytes": manifest["files"]["model.onnx"]["bytes"], "reference": manifest["reference"],
        "provenance": ctx.provenance("export"),
    }
    if hasattr(model, "write_compressed"):  # SQS: the real compressed form of the M exported samples
        summary["compressed_form"] = {"file": "model.sqs", **model.write_compressed(out / "model.sqs", knob_value, m,
                                                                                    ctx.cfg.seed)}
    write_json(out / "export.json", summary)
    ctx.log(f"export: {out / 'bundle'}; ONNX parameters {onnx_params} = {m} x {kept_per_sample} kept weights: "
            f"{summary['params_match']}; fidelity max |p_onnx - p_torch| = {gap:.2e}")


def run_deploy(ctx):
    from edgebayes.deploy.transport import RUNNER, transport_for

    bundle = ctx.require("export", "bundle/manifest.json") / "bundle"
    out = ctx.stage_dir("deploy")
    transport = transport_for(ctx.profile, out / "device")
    transport.put(bundle, "bundle")
    transport.put(RUNNER, "runner.py")
    b, r = ctx.cfg.benchmark, ctx.profile
    args = ["runner.py", "--bundle", "bundle", "--out", "results.json", "--warmup", b.warmup,
            "--min-runs", b.min_runs, "--min-seconds", b.min_seconds, "--batch-size", r.budgets.batch_size,
            "--threads", r.runtime.threads, "--runtime", r.runtime.name]
    code, last_line = transport.run(args)
    if code != 0:
        raise StageError(f"the runner failed on device {r.name} (exit code {code}): {last_line}; "
                         f"local artifacts are kept, re-run `edgebayes deploy`")
    transport.get("results.json", out / "results.json")
    res = read_json(out / "results.json")
    lat = res["latency_ms"]
    ctx.log(f"deploy: on {r.name} accuracy {res['metrics']['accuracy']:.4f}, ECE {res['metrics']['ece']:.4f}; "
            f"latency p50 {lat['p50']:.3f} / p90 {lat['p90']:.3f} / p99 {lat['p99']:.3f} ms over {res['runs']} runs")


def run_report(ctx):
    from edgebayes.deploy.report import write_report

    train_metrics = read_json(ctx.require("train", "metrics.json") / "metrics.json")
    candidates = read_json(ctx.require("select", "candidates.json") / "candidates.json")
    choice = read_json(ctx.stage_dir("select") / "choice.json")
    export = read_json(ctx.require("export", "export.json") / "export.json")
    results = read_json(ctx.require("deploy", "results.json") / "results.json")
    # Structure (kept nodes, compression, FLOPs) of the deployed operating point, not of training's
    # default knob value; the training metrics stay as they are.
    deployed = {k: export[k] for k in ("sparsity", "compression_ratio", "flops_ratio", "physical_flops_ratio")}
    inputs = {
        "run_name": ctx.cfg.name, "device": as_dict(ctx.profile), "train": {**train_metrics, **deployed},
        "candidates": candidates["candidates"], "objective": candidates["objective"],
        "choice": {k: choice[k] for k in ("knob", "knob_value", "mc_samples", "reason")},
        "export": export, "results": results, "reliability": results.get("reliability"),
        "provenance": ctx.provenance("report"),
    }
    report = write_report(inputs, ctx.stage_dir("report"))
    ctx.log(f"report: {ctx.stage_dir('report') / 'report.html'}")
    return report


RUNNERS = {"train": run_train, "select": run_select, "export": run_export, "deploy": run_deploy, "report": run_report}


def run_stage(ctx, stage):
    if ctx.is_fresh(stage):
        ctx.log(f"{stage}: up to date (config and inputs unchanged), skipped")
        return
    ctx.log(f"{stage}: running")
    RUNNERS[stage](ctx)
    ctx.mark_done(stage)


def run_pipeline(ctx, stages=STAGES):
    for stage in stages:
        run_stage(ctx, stage)
