"""Select: score every operating point on the validation split, cost it on the device, pick one.

An operating point (candidate) is knob x M: a value of the family's deploy-time knob (inclusion threshold,
width, non-zero rate: `model.knob`) and a number of Monte-Carlo samples. Each is scored (MC-averaged accuracy, NLL, ECE on val) and costed:
  - latency at the budget's percentile and batch size: measured with the device's runtime when the device
    is this machine (`connection.kind: local`, `latency_model.kind: measure`), otherwise predicted from
    the paper's FLOPs count and the profile's declared throughput;
  - model size: the bytes of the exported ONNX file.
The best-scoring candidate that fits every budget wins (objective accuracy: ties broken by NLL, then
latency; objective nll: lowest NLL). Peak memory is only known once the model runs on the device, so it is
checked in the report, not here. If nothing fits, the error lists the closest candidates and what each
exceeds.
"""

import tempfile
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from edgebayes.deploy.runner import make_backend, measure_latency
from edgebayes.errors import StageError
from edgebayes.export.compress import EmptyLayerError, compress, predict
from edgebayes.export.onnx_export import export_onnx
from edgebayes.train.metrics import classification_metrics, count_weights, paper_flops


class SelectionError(StageError):
    pass


def _latency_ms(profile, onnx_path, example, flops):
    b, lm = profile.budgets, profile.latency_model
    key = f"p{b.percentile}"
    if lm.kind == "measure" and profile.connection.kind == "local":
        backend = make_backend(profile.runtime.name, str(onnx_path), profile.runtime.threads)
        batch = np.repeat(example.numpy(), b.batch_size, axis=0)
        timing = measure_latency(backend, batch, warmup=10, min_runs=50, min_seconds=0.2, progress=False)
        return timing["latency_ms"][key], "measured"
    seconds = flops * b.batch_size / lm.flops_per_second
    return lm.overhead_ms + 1000 * seconds, "predicted (FLOPs / declared throughput)"


def violations(candidate, budgets):
    """The budgets a candidate exceeds, as readable strings."""
    out, cost = [], candidate["cost"]
    if budgets.latency_ms is not None and cost["latency_ms"] > budgets.latency_ms:
        out.append(f"latency p{budgets.percentile} {cost['latency_ms']:.3f} ms > budget {budgets.latency_ms} ms")
    if budgets.model_mb is not None and cost["model_mb"] > budgets.model_mb:
        out.append(f"model {cost['model_mb']:.3f} MB > budget {budgets.model_mb} MB")
    return out


def score_candidates(model, cfg, profile, val_x, val_y, log=print):
    """Every (knob value, M) candidate with its validation metrics and device cost."""
    candidates = []
    example = val_x[:1]
    grid = [(k, m) for k in model.operating_points(cfg.select.knob_values) for m in sorted(cfg.select.mc_samples)]
    with tempfile.TemporaryDirectory() as tmp:
        for knob_value, m in tqdm(grid, desc="select", unit="candidate"):
            try:
                compressed = compress(model, knob_value, m, cfg.seed)
            except EmptyLayerError as e:
                log(f"select: {e}; skipped")
                continue
            kept = {name: int(mask.sum()) for name, mask in compressed.kept.items()}
            mc_model = compressed.mc_model()
            probs = predict(mc_model, val_x).numpy()
            onnx_path = Path(tmp) / f"k{knob_value}_m{m}.onnx"
            export_onnx(mc_model, example, onnx_path, cfg.export.opset)
            flops = m * paper_flops(compressed.samples[0], val_x.shape[1:])
            latency, source = _latency_ms(profile, onnx_path, example, flops)
            candidate = {
                "knob": model.knob, "knob_value": knob_value, "mc_samples": m, "kept_units": kept,
                "val": classification_metrics(probs, val_y.numpy()),
                "cost": {"latency_ms": latency, "latency_source": source,
                         "model_mb": onnx_path.stat().st_size / 1e6, "flops": flops,
                         "kept_weights": sum(count_weights(s) for s in compressed.samples)},
            }
            candidate["violations"] = violations(candidate, profile.budgets)
            candidate["fits"] = not candidate["violations"]
            candidates.append(candidate)
    if not candidates:
        raise SelectionError(f"no candidate keeps at least one unit per layer; change select.knob_values "
                             f"({model.knob})")
    return candidates


def choose(candidates, objective, budgets):
    """The best fitting candidate, with the reason; SelectionError listing the closest ones if none fits."""
    fitting = [c for c in candidates if c["fits"]]
    if not fitting:
        def excess(c):
            cost, total = c["cost"], 0.0
            if budgets.latency_ms is not None:
                total += max(0.0, cost["latency_ms"] / budgets.latency_ms - 1)
            if budgets.model_mb is not None:
                total += max(0.0, cost["model_mb"] / budgets.model_mb - 1)
            return total
        closest = sorted(candidates, key=excess)[:3]
        lines = [f"  {c['knob']} {c['knob_value']}, M={c['mc_samples']}: " + "; ".join(c["violations"])
                 for c in closest]
        raise SelectionError("no operating point fits the device budgets; closest candidates:\n" + "\n".join(lines))
    if objective == "accuracy":
        key = lambda c: (-c["val"]["accuracy"], c["val"]["nll"], c["cost"]["latency_ms"])  # noqa: E731
        why = "highest validation accuracy; ties broken by NLL, then latency"
    else:
        key = lambda c: (c["val"]["nll"], c["cost"]["latency_ms"])  # noqa: E731
        why = "lowest validation NLL; ties broken by latency"
    best = min(fitting, key=key)
    reason = f"{why}, among {len(fitting)} of {len(candidates)} candidates within the budgets"
    return {"knob": best["knob"], "knob_value": best["knob_value"], "mc_samples": best["mc_samples"],
            "reason": reason, "candidate": best}
