"""Benchmark report writer: one JSON + one self-contained HTML page per run.

`write_report(inputs, out_dir)` takes what the earlier stages produced
(training metrics, candidate operating points, the chosen point, export
facts, the device runner's results) and writes

* ``report.json``  - a computed ``summary`` block followed by the inputs verbatim,
* ``report.html``  - a single page with every plot embedded as a data URI,
* ``*.png``        - the same plots as separate files.

Every file is written through ``provenance.atomic_path`` (a temp file in ``out_dir``
renamed into place), so a crash never leaves a half-written report behind.
Missing optional inputs are shown as "n/a" on the page and stored as null in
the JSON summary.

A report is "measured" (the device's runner results) or, when the device could
not be reached, "predicted" (``inputs["predicted"]``): the device's latency
model and memory estimate stand for its measurements, the accuracy figures are
the bundle's on this machine, and every figure says which it is.
``write_comparison`` writes one page setting several devices' reports side by
side; ``terminal_summary`` / ``summary_text`` are the block `edgebayes` prints.

Units: latencies in µs below 1 ms, else ms (``fmt_ms``); sizes and memory in MB
(10^6 bytes) everywhere, as the budgets are.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import io
import json
import math
from pathlib import Path
from typing import Any

from edgebayes.deploy.memory import own_memory
from edgebayes.provenance import atomic_path

__all__ = ["write_report", "write_comparison", "terminal_summary", "summary_text", "fmt_ms"]

NA = "n/a"
# Model size in MB = 10^6 bytes, as the selection stage computes candidates' model_mb,
# so "fits" in selection and the verdict here agree.
BYTES_PER_MB = 1_000_000
# Budget key in device.budgets -> (label on the page, unit).
BUDGETS = {
    "latency_ms": ("latency", "ms"),
    "memory_mb": ("memory", "MB"),
    "model_mb": ("model size", "MB"),
}
METRICS = ("accuracy", "nll", "ece", "brier")
METRIC_LABELS = {"accuracy": "accuracy", "nll": "NLL", "ece": "ECE", "brier": "Brier", "n": "n"}


# ----------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------

def _jsonable(x: Any) -> Any:
    """Deep copy into plain JSON types; NaN/inf become None so the file is strict JSON."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (bool, str)) or x is None:
        return x
    if isinstance(x, int):
        return int(x)
    if isinstance(x, float):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, Path):
        return str(x)
    # numpy scalars/arrays (and anything else exposing tolist/item) without importing numpy
    for attr in ("tolist", "item"):
        if hasattr(x, attr):
            return _jsonable(getattr(x, attr)())
    return str(x)


def _get(d: Any, *keys: Any) -> Any:
    """d[k1][k2]... or None when any level is absent."""
    for k in keys:
        if isinstance(d, dict):
            d = d.get(k)
        elif isinstance(d, list) and isinstance(k, int) and -len(d) <= k < len(d):
            d = d[k]
        else:
            return None
    return d


def _num(x: Any) -> float | None:
    """A finite number as float, else None (bools are not numbers here)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def _diff(a: Any, b: Any) -> float | None:
    a, b = _num(a), _num(b)
    return None if a is None or b is None else a - b


def _fmt(x: Any, unit: str = "") -> str:
    """Human formatting; None -> 'n/a'. Tiny values (fidelity ~1e-7) go scientific."""
    if x is None:
        return NA
    if isinstance(x, bool):
        s = "yes" if x else "no"
    elif isinstance(x, int):
        s = f"{x:,}"
    elif isinstance(x, float):
        if x == 0:
            s = "0"
        elif abs(x) >= 1000:
            s = f"{x:,.0f}"
        elif abs(x) < 1e-3:
            s = f"{x:.2e}"
        else:
            s = f"{x:.4g}"
    else:
        s = str(x)
    return f"{s} {unit}" if unit else s


def _fmt_diff(x: float | None) -> str:
    if x is None:
        return NA
    if x == 0:
        return "0"
    return f"{x:+.2e}" if abs(x) < 1e-3 else f"{x:+.4f}"


def fmt_ms(x: Any, ascii_only: bool = False) -> str:
    """A latency in the unit that fits: '7.83 µs' below 1 ms, '2.79 ms' above; None -> 'n/a'."""
    v = _num(x)
    if v is None:
        return NA
    if abs(v) < 1.0:
        return f"{1000 * v:.3g} {'us' if ascii_only else 'µs'}"
    return f"{v:,.4g} ms" if v < 1000 else f"{v:,.0f} ms"


def _fmt_unit(x: Any, unit: str) -> str:
    """_fmt, but latencies ('ms') in the unit that fits."""
    return fmt_ms(x) if unit == "ms" else _fmt(_num(x) if _num(x) is not None else x, unit)


def _time_axis(values: list[float]) -> tuple[str, float]:
    """Unit and factor for a plot axis of latencies in ms: µs when every value is below 1 ms."""
    return ("µs", 1000.0) if values and max(values) < 1.0 else ("ms", 1.0)


def _pct(x: float | None) -> str:
    return NA if x is None else f"{100 * x:.1f} %"


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _knob_label(knob: Any) -> str:
    """'inclusion_threshold' -> 'inclusion threshold' (the family's deploy-time knob)."""
    return str(knob or "knob").replace("_", " ")


def _same_point(cand: dict, knob_value: Any, m: Any) -> bool:
    t1, t2 = _num(cand.get("knob_value")), _num(knob_value)
    return (t1 is not None and t2 is not None and math.isclose(t1, t2, rel_tol=1e-9, abs_tol=1e-12)
            and cand.get("mc_samples") == m)


def _wilson(p: float | None, n: float | None, z: float = 1.96) -> list[float] | None:
    """95% Wilson interval for an accuracy measured on n examples (how much is noise)."""
    if p is None or n is None or n <= 0 or not 0 <= p <= 1:
        return None
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return [max(0.0, mid - half), min(1.0, mid + half)]


# ----------------------------------------------------------------------------
# summary
# ----------------------------------------------------------------------------

def _latency_key(lat: dict, percentile: Any) -> str | None:
    """Reported latency statistic to judge the budget with: p<percentile> if reported,
    else the nearest reported percentile above it (conservative), else max."""
    pct = _num(percentile)
    if pct is None:
        pct = 90.0
    exact = f"p{pct:g}"
    if _num(lat.get(exact)) is not None:
        return exact
    reported = sorted(
        (float(k[1:]), k) for k in lat
        if k.startswith("p") and k[1:].replace(".", "", 1).isdigit() and _num(lat[k]) is not None
    )
    for value, key in reported:
        if value >= pct:
            return key
    if _num(lat.get("max")) is not None:
        return "max"
    return reported[-1][1] if reported else None


def _verdict(limit: float | None, measured: float | None) -> str:
    if limit is None:
        return "not set"
    if measured is None:
        return NA
    return "pass" if measured <= limit else "fail"


def _pruned_fraction(layers: Any) -> float | None:
    """1 - kept/total over hidden layers; the output layer (named 'output', else the last) is excluded."""
    if not isinstance(layers, list) or not layers:
        return None
    layers = [l for l in layers if isinstance(l, dict)]
    hidden = [l for l in layers if l.get("name") != "output"]
    if len(hidden) == len(layers):
        hidden = layers[:-1]
    kept = [_num(l.get("kept")) for l in hidden]
    total = [_num(l.get("total")) for l in hidden]
    if not hidden or None in kept or None in total or sum(total) <= 0:
        return None
    return 1.0 - sum(kept) / sum(total)


def _dict(x: Any) -> dict:
    return x if isinstance(x, dict) else {}


def _summarize(d: dict) -> dict:
    """Compute the summary block from the (JSON-clean) inputs."""
    device = _dict(d.get("device"))
    budgets = _dict(device.get("budgets"))
    predicted_in = d.get("predicted") if isinstance(d.get("predicted"), dict) else None
    mode = "predicted" if predicted_in is not None else "measured"
    results = _dict(d.get("results"))
    here = _dict(_get(predicted_in, "here"))   # predicted: the bundle run on this machine
    outputs = here if predicted_in is not None else results   # where accuracy, OOD and rejection come from
    export = _dict(d.get("export"))
    train = _dict(d.get("train"))
    choice = _dict(d.get("choice"))
    candidates = [c for c in (d.get("candidates") or []) if isinstance(c, dict)]
    lat = _dict(results.get("latency_ms"))
    warnings: list[str] = []

    metrics = {}
    for m in METRICS:
        dev, ref = _get(outputs, "metrics", m), _get(outputs, "reference", m)
        metrics[m] = {"device": dev, "reference": ref, "diff": _diff(dev, ref)}
    n_eval = _get(outputs, "metrics", "n")
    ci = _wilson(_num(metrics["accuracy"]["device"]), _num(n_eval))

    chosen = next((c for c in candidates
                   if _same_point(c, choice.get("knob_value"), choice.get("mc_samples"))), None)
    cost = _dict(_get(chosen, "cost"))
    has_table = cost.get("latency_model_has_table")
    by_pct = _dict(cost.get("predicted_latency_ms_by_percentile"))
    if not by_pct and _num(cost.get("predicted_latency_ms")) is not None and budgets.get("percentile") is not None:
        by_pct = {f"p{_num(budgets['percentile']):g}": cost["predicted_latency_ms"]}
    # A latency model without a table (FLOPs / declared throughput) gives small models its fixed overhead:
    # the same figure for every candidate, which is not a prediction of this model's latency.
    predicted_lat = {} if has_table is False else {k: _num(v) for k, v in by_pct.items()}

    # Budget verdicts.
    if predicted_in is None:
        lat_key = _latency_key(lat, budgets.get("percentile"))
        lat_value = _num(lat.get(lat_key)) if lat_key else None
        lat_src = f"{lat_key} latency over all timed runs" if lat_key else "latency"
    else:
        lat_key = _latency_key(predicted_lat, budgets.get("percentile"))
        lat_value = _num(predicted_lat.get(lat_key)) if lat_key else None
        lat_src = (f"{lat_key} predicted by {cost.get('predicted_by') or 'the latency model'}" if lat_value is not None
                   else "not predicted: the device has no latency table")
    model_bytes = _num(export.get("model_bytes"))
    if model_bytes is not None:
        model_mb, model_src = model_bytes / BYTES_PER_MB, "export.model_bytes"
    else:  # fall back to the selection stage's estimate for the chosen point
        model_mb, model_src = _num(cost.get("model_mb")), "candidate cost estimate"
    mem = _dict(results.get("memory"))
    estimate = _num(cost.get("memory_estimate_mb"))
    lower = bool(cost.get("memory_estimate_lower_bound"))
    if predicted_in is not None:
        memory = (estimate, "estimated at selection" + (" (a lower bound: no measurement of the runtime)"
                                                         if lower else "") if estimate is not None else "estimate")
    elif own_memory(mem, cost.get("memory_parts_mb")) is not None:
        own = own_memory(mem, cost.get("memory_parts_mb"))
        memory = (_num(own["own_mb"]), own["measured_as"])
    else:
        memory = (_num(results.get("peak_rss_mb")), "peak RSS")
    measured = {"latency_ms": (lat_value, lat_src), "memory_mb": memory, "model_mb": (model_mb, model_src)}
    basis = {"latency_ms": "predicted" if predicted_in is not None else "measured",
             "memory_mb": "estimated" if predicted_in is not None else "measured", "model_mb": "file"}
    budget_rows = {}
    for key, (label, unit) in BUDGETS.items():
        limit = _num(budgets.get(key))
        value, source = measured[key]
        verdict = _verdict(limit, value)
        if key == "memory_mb" and predicted_in is not None and lower and verdict == "pass":
            verdict = NA   # a lower bound under the budget says nothing
        budget_rows[key] = {"label": label, "unit": unit, "limit": limit, "measured": value,
                            "measured_as": source, "verdict": verdict, "basis": basis[key]}
    verdicts = [r["verdict"] for r in budget_rows.values() if r["verdict"] != "not set"]
    overall = ("fail" if "fail" in verdicts else NA if NA in verdicts
               else "pass" if verdicts else "not set")

    onnx_params, kept_total = export.get("onnx_params"), export.get("kept_weights_total")
    params_match = (None if _num(onnx_params) is None or _num(kept_total) is None
                    else onnx_params == kept_total)

    # Things an engineer should not miss when trusting the numbers.
    if predicted_in is not None and predicted_in.get("here_failed"):   # (the page's banner says the rest)
        warnings.append(f"The bundle did not run on this machine: {predicted_in['here_failed']}.")
    if has_table is False:
        warnings.append(f"{device.get('name') or 'This device'} has no latency table: its latency model is FLOPs / "
                        f"declared throughput, which gives these models about its fixed overhead "
                        f"({fmt_ms(_num(cost.get('predicted_latency_ms')))} for the chosen point), so latency did not "
                        f"tell the candidates apart. Run `edgebayes devices profile {device.get('name') or 'DEVICE'}` "
                        "on the board to measure one.")
    if params_match is False:
        warnings.append(f"ONNX parameter count {onnx_params} != kept weights {kept_total}: "
                        "the exported graph does not match the pruned model.")
    b_bs, r_bs = budgets.get("batch_size"), results.get("batch_size")
    if b_bs is not None and r_bs is not None and b_bs != r_bs:
        warnings.append(f"latency measured at batch size {r_bs}, budget is for batch size {b_bs}.")
    if choice and chosen is None:
        warnings.append("chosen operating point is not among the candidates.")
    elif chosen is not None and chosen.get("fits") is False:
        warnings.append("chosen operating point did not fit the budget during selection.")
    pct = _num(budgets.get("percentile"))
    if lat_key and pct is not None and lat_key != f"p{pct:g}":
        warnings.append(f"p{pct:g} latency not reported; judged with {lat_key} (conservative).")

    # Predicted (the device's latency model) against measured (the deployment's benchmark) latency of the
    # chosen point, at the budget's percentile and at each percentile: how far the latency model can be
    # trusted on this device. Both are over all timed samples (runner.latency_summary).
    predicted = _num(cost.get("predicted_latency_ms")) if has_table is not False else None
    lat_measured = None if predicted_in is not None else lat_value
    error = None if predicted is None or not lat_measured else (predicted - lat_measured) / lat_measured
    # The measurement's own noise: the range of the benchmark rounds' percentiles relative to the best round.
    spread = _num(_get(results, "latency_spread", lat_key)) if lat_key else None
    by_percentile = {}
    for k in ("p50", "p90", "p99"):
        pk, mk = _num(predicted_lat.get(k)), _num(lat.get(k))
        by_percentile[k] = {"predicted_ms": pk, "measured_ms": mk,
                            "error": None if pk is None or not mk else (pk - mk) / mk}
    latency_prediction = {"percentile": budgets.get("percentile"), "predicted_ms": predicted,
                          "predicted_by": cost.get("predicted_by"), "measured_ms": lat_measured,
                          "error": error, "abs_error": None if error is None else abs(error),
                          "measurement_spread": spread, "has_table": has_table, "by_percentile": by_percentile}

    deployed_mb = _num(mem.get("deployed_mb"))
    own = own_memory(mem, cost.get("memory_parts_mb")) or {}
    memory_block = {
        "own_mb": _num(own.get("own_mb")), "subtracted_setup_mb": _num(own.get("setup_mb")),
        "runtime_baseline_mb": _num(mem.get("runtime_baseline_mb")), "model_mb": _num(mem.get("model_mb")),
        "deployed_mb": deployed_mb, "runner_peak_rss_mb": _num(results.get("peak_rss_mb")),
        "estimate_mb": estimate, "estimate_lower_bound": lower if estimate is not None else None,
        "estimate_parts_mb": cost.get("memory_parts_mb"),
        "estimate_error": None if estimate is None or not own.get("own_mb") else (estimate - own["own_mb"]) / own["own_mb"],
    }
    ood_train = _dict(train.get("ood"))
    ood = _dict(outputs.get("ood"))

    return {
        "run_name": d.get("run_name"),
        "device": device.get("name"),
        "mode": mode,
        "runtime": device.get("runtime"),
        "knob": choice.get("knob"),
        "knob_value": choice.get("knob_value"),
        "mc_samples": choice.get("mc_samples"),
        "precision": choice.get("precision"),
        "format": choice.get("format"),
        "objective": d.get("objective"),
        "max_ece": d.get("max_ece"),
        "latency_prediction": latency_prediction,
        "pareto": [c.get("id") or f"{_knob_label(c.get('knob'))} {c.get('knob_value')}, M={c.get('mc_samples')}"
                   for c in candidates if c.get("pareto")],
        "choice_reason": choice.get("reason"),
        "metrics": metrics,
        "metrics_measured_on": "this machine" if predicted_in is not None else "device",
        "n_eval": n_eval,
        "accuracy_ci95": ci,
        "max_abs_prob_diff": outputs.get("max_abs_prob_diff"),
        "latency_ms": {k: lat.get(k) for k in ("p50", "p90", "p99")},
        "latency_max_ms": lat.get("max"),
        "latency_ms_best_round": {k: _get(results, "latency_ms_best_round", k) for k in ("p50", "p90", "p99")},
        "latency_predicted_ms": {k: predicted_lat.get(k) for k in ("p50", "p90", "p99")},
        "cold_start": results.get("cold_start"),
        "latency_percentile": budgets.get("percentile"),
        "latency_stat": lat_key,
        "latency_at_percentile_ms": lat_value,
        "latency_budget_ms": _num(budgets.get("latency_ms")),
        "budgets": budget_rows,
        "overall_verdict": overall,
        "memory": memory_block,
        "ood": {"auroc": _num(ood.get("auroc")), "aupr": _num(ood.get("aupr")), "score": ood.get("score"),
                "n_out": ood.get("n_out"), "train_auroc": _num(ood_train.get("auroc")),
                "train_aupr": _num(ood_train.get("aupr")), "set": ood_train.get("set")},
        "selective": outputs.get("selective") if isinstance(outputs.get("selective"), dict) else None,
        "model_mb": model_mb,
        "pruned_fraction_hidden": _pruned_fraction(_get(train, "sparsity", "layers")),
        "compression_ratio": train.get("compression_ratio"),
        "flops_ratio": train.get("flops_ratio"),
        "onnx_params": onnx_params,
        "kept_weights_total": kept_total,
        "kept_weights_per_sample": export.get("kept_weights_per_sample"),
        "params_match": params_match,
        "fidelity_max_abs_prob_diff": export.get("fidelity_max_abs_prob_diff"),
        "finish": (predicted_in or {}).get("finish"),
        "warnings": warnings,
        "report_created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


# ----------------------------------------------------------------------------
# plots (Figure + Agg canvas: no pyplot state, never touches a display)
# ----------------------------------------------------------------------------

def _new_fig(w: float, h: float, **kw: Any):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=110, layout="constrained", **kw)
    FigureCanvasAgg(fig)
    return fig


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _plot_tradeoff(candidates: list, choice: dict, budget_ms: float | None,
                   budget_mb: float | None = None) -> bytes | None:
    """Val accuracy vs latency (left) and vs model size (right) for every candidate; colour = M, marker =
    fits or not; the Pareto front, the budget lines and the chosen point drawn on both."""
    pts = [(c, _num(_get(c, "cost", "latency_ms")), _num(_get(c, "val", "accuracy")))
           for c in candidates]
    pts = [p for p in pts if p[1] is not None and p[2] is not None]
    if not pts:
        return None
    from matplotlib.lines import Line2D

    unit, k = _time_axis([x for _, x, _ in pts] + ([budget_ms] if budget_ms is not None else []))
    pts = [(c, k * x, y) for c, x, y in pts]
    budget_label = None if budget_ms is None else fmt_ms(budget_ms)
    budget_ms = None if budget_ms is None else k * budget_ms

    fig = _new_fig(11.0, 5.0)
    ax, ax_mb = fig.subplots(1, 2, width_ratios=[3, 2])
    _plot_size_panel(ax_mb, candidates, choice, budget_mb)
    front = sorted((x, y) for c, x, y in pts if c.get("pareto_latency"))
    if len(front) > 1:
        ax.step(*zip(*front), where="post", color="#555", linewidth=1.1, zorder=1)
    ms = sorted({c.get("mc_samples") for c, _, _ in pts}, key=lambda m: (_num(m) is None, _num(m) or 0, str(m)))
    # Sequential colours: more posterior samples = darker, and no red (red means "violates").
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    colours = {m: cmap(0.85 * i / max(1, len(ms) - 1)) for i, m in enumerate(ms)}
    for c, x, y in pts:
        col = colours[c.get("mc_samples")]
        if c.get("fits"):
            ax.scatter(x, y, s=46, marker="o", color=col, edgecolor="black", linewidth=0.5, zorder=3)
        else:
            ax.scatter(x, y, s=46, marker="X", color=col, alpha=0.55, zorder=2)
    chosen = [(x, y) for c, x, y in pts if _same_point(c, choice.get("knob_value"), choice.get("mc_samples"))]
    for x, y in chosen[:1]:
        ax.scatter(x, y, s=320, facecolor="none", edgecolor="crimson", linewidth=2.2, zorder=4)
        ax.annotate(f"chosen: {_knob_label(choice.get('knob'))} {_fmt(choice.get('knob_value'))}, "
                    f"M={choice.get('mc_samples')}",
                    (x, y), xytext=(12, -18), textcoords="offset points", color="crimson",
                    fontsize=9, fontweight="bold")
    xs = [x for _, x, _ in pts] + ([budget_ms] if budget_ms is not None else [])
    if min(xs) > 0 and max(xs) / min(xs) > 10:  # wide spread: linear axis would squash the points
        ax.set_xscale("log")
    if budget_ms is not None:
        ax.axvline(budget_ms, color="crimson", linestyle="--", linewidth=1.3)
    ax.set_xlabel(f"latency per batch ({unit})" + (", log scale" if ax.get_xscale() == "log" else ""))
    ax.set_ylabel("validation accuracy")
    ax.set_title("Candidate operating points: accuracy vs latency")
    ax.grid(True, alpha=0.3)
    handles = [Line2D([], [], marker="o", linestyle="", color=colours[m], markeredgecolor="black",
                      markeredgewidth=0.5, label=f"M = {m}") for m in ms]
    handles += [Line2D([], [], marker="o", linestyle="", color="grey", label="fits budget"),
                Line2D([], [], marker="X", linestyle="", color="grey", alpha=0.55, label="violates budget")]
    if chosen:
        handles.append(Line2D([], [], marker="o", linestyle="", markerfacecolor="none",
                              markeredgecolor="crimson", markersize=12, label="chosen"))
    if len(front) > 1:
        handles.append(Line2D([], [], color="#555", label="Pareto front"))
    if budget_ms is not None:
        handles.append(Line2D([], [], color="crimson", linestyle="--", label=f"latency budget {budget_label}"))
    if budget_mb is not None:
        handles.append(Line2D([], [], color="darkorange", linestyle="--", label=f"size budget {_fmt(budget_mb)} MB"))
    ax.legend(handles=handles, loc="lower right", fontsize=7, framealpha=0.85)
    return _png(fig)


def _plot_size_panel(ax, candidates: list, choice: dict, budget_mb: float | None) -> None:
    """Val accuracy vs model size: Pareto-optimal points (accuracy, latency, size) filled, others hollow."""
    pts = [(c, _num(_get(c, "cost", "model_mb")), _num(_get(c, "val", "accuracy"))) for c in candidates]
    pts = [p for p in pts if p[1] is not None and p[2] is not None]
    for c, x, y in pts:
        on_front = bool(c.get("pareto"))
        ax.scatter(x, y, s=40, marker="o", facecolor="#2c7fb8" if on_front else "none", edgecolor="#2c7fb8",
                   alpha=1.0 if c.get("fits") else 0.45, zorder=3)
        if _same_point(c, choice.get("knob_value"), choice.get("mc_samples")) and \
                c.get("precision", choice.get("precision")) == choice.get("precision"):
            ax.scatter(x, y, s=320, facecolor="none", edgecolor="crimson", linewidth=2.2, zorder=4)
    if budget_mb is not None:
        ax.axvline(budget_mb, color="darkorange", linestyle="--", linewidth=1.3)
    xs = [x for _, x, _ in pts] + ([budget_mb] if budget_mb is not None else [])
    if xs and min(xs) > 0 and max(xs) / min(xs) > 10:
        ax.set_xscale("log")
    ax.set_xlabel("model file size (MB)")
    ax.set_ylabel("validation accuracy")
    ax.set_title("Accuracy vs size (filled: Pareto-optimal)")
    ax.grid(True, alpha=0.3)


def _plot_knob(candidates: list, knob: Any) -> bytes | None:
    """Validation accuracy and ECE against the knob, one line per M (and precision)."""
    series: dict = {}
    for c in candidates:
        k, acc, ece = _num(c.get("knob_value")), _num(_get(c, "val", "accuracy")), _num(_get(c, "val", "ece"))
        if k is not None and acc is not None and ece is not None:
            label = f"M = {c.get('mc_samples')}" + (f", {c['precision']}" if c.get("precision") not in (None, "fp32") else "")
            series.setdefault(label, []).append((k, acc, ece))
    if not series:
        return None
    fig = _new_fig(9.0, 3.4)
    a1, a2 = fig.subplots(1, 2)
    for label, rows in sorted(series.items()):
        rows.sort()
        a1.plot([r[0] for r in rows], [r[1] for r in rows], marker="o", label=label)
        a2.plot([r[0] for r in rows], [r[2] for r in rows], marker="o", label=label)
    for ax, what in ((a1, "validation accuracy"), (a2, "validation ECE")):
        ax.set_xlabel(_knob_label(knob))
        ax.set_ylabel(what)
        ax.set_title(f"{what[:1].upper()}{what[1:]} vs {_knob_label(knob)}")
        ax.grid(True, alpha=0.3)
    a1.legend(fontsize=8)
    return _png(fig)


def _plot_latency_prediction(candidates: list, lp: dict) -> bytes | None:
    """Predicted against measured latency: every candidate measured at selection, and the chosen point's
    deployment benchmark at p50 / p90 / p99 (all over every timed run); the diagonal is a perfect latency
    model, the band +-25 %."""
    pts = [(_num(_get(c, "cost", "measured_latency_ms")), _num(_get(c, "cost", "predicted_latency_ms")))
           for c in candidates]
    pts = [(m, p) for m, p in pts if m is not None and p is not None]
    chosen = {k: (_num(v.get("measured_ms")), _num(v.get("predicted_ms")))
              for k, v in _dict(lp.get("by_percentile")).items() if isinstance(v, dict)}
    chosen = {k: v for k, v in chosen.items() if None not in v}
    if not chosen and None not in (_num(lp.get("measured_ms")), _num(lp.get("predicted_ms"))):
        chosen = {f"p{_fmt(lp.get('percentile'))}": (_num(lp["measured_ms"]), _num(lp["predicted_ms"]))}
    if not pts and not chosen:
        return None
    values = [v for pt in pts + list(chosen.values()) for v in pt]
    unit, k = _time_axis(values)
    fig = _new_fig(4.8, 4.2)
    ax = fig.add_subplot()
    if pts:
        ax.scatter([k * m for m, _ in pts], [k * p for _, p in pts], s=28, color="#74a9cf", edgecolor="black",
                   linewidth=0.4, label=f"candidates at selection (p{_fmt(lp.get('percentile'))})", zorder=3)
    for (name, (m, pr)), marker in zip(sorted(chosen.items()), ("o", "*", "D", "s")):
        ax.scatter(k * m, k * pr, s=110, marker=marker, color="crimson", zorder=4,
                   label=f"chosen, deployed, {name} (error {100 * (pr - m) / m:+.1f} %)")
    lo, hi = k * min(values) * 0.8, k * max(values) * 1.2
    ax.plot([lo, hi], [lo, hi], color="grey", linestyle="--", linewidth=1)
    ax.fill_between([lo, hi], [0.75 * lo, 0.75 * hi], [1.25 * lo, 1.25 * hi], color="grey", alpha=0.12,
                    label="±25 %")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel(f"measured latency, all timed runs ({unit})")
    ax.set_ylabel(f"predicted latency ({unit})")
    ax.set_title("Latency model: predicted vs measured", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    return _png(fig)


def _plot_sparsity(layers: Any) -> bytes | None:
    rows = [l for l in (layers or []) if isinstance(l, dict)
            and _num(l.get("kept")) is not None and _num(l.get("total")) is not None]
    if not rows:
        return None
    fig = _new_fig(7.0, 0.9 + 0.55 * max(3, len(rows)))
    ax = fig.add_subplot()
    names = [str(l.get("name", f"layer {i + 1}")) for i, l in enumerate(rows)]
    y = list(range(len(rows)))[::-1]  # first layer on top
    totals = [_num(l["total"]) for l in rows]
    kept = [_num(l["kept"]) for l in rows]
    ax.barh(y, totals, color="#d9d9d9", label="total nodes")
    ax.barh(y, kept, color="#2c7fb8", height=0.55, label="kept nodes")
    for yi, k, t in zip(y, kept, totals):
        ax.text(t, yi, f"  {k:g}/{t:g}", va="center", fontsize=9)
    ax.set_yticks(y, names)
    ax.set_xlim(0, max(totals) * 1.18)
    ax.set_xlabel("nodes (units)")
    ax.set_title("Kept nodes per layer after pruning")
    ax.legend(loc="lower right", fontsize=8)
    return _png(fig)


def _hist_window(xs: list[float]) -> tuple[float, float, float]:
    """(low, high, padding) of the histogram's x-axis for sorted samples: from the fastest run to the
    99.9th percentile, or 1.5 x the 99th where the last 0.9 % stretch further, so that a few runs 10-100x
    slower (a 2-core machine's other work) do not squeeze the rest into one bar; the legend names them."""
    p99, p999 = (xs[min(len(xs) - 1, int(q * len(xs)))] for q in (0.99, 0.999))
    lo, hi = xs[0], min(p999, 1.5 * p99)
    return lo, hi, 0.05 * (hi - lo) if hi > lo else 0.05 * hi


def _plot_latency_hist(samples: Any, lat: dict, budget_ms: float | None) -> bytes | None:
    """Histogram of the timed runs. The x-axis covers the data up to its 99.9th percentile (a few slow
    runs far out would squeeze the rest into one bar); the runs beyond, the maximum and a budget off the
    axis are named in the legend, not drawn."""
    xs = sorted(v for v in (_num(s) for s in (samples or [])) if v is not None)
    if not xs:
        return None
    lo, hi, pad = _hist_window(xs)
    unit, k = _time_axis([hi])
    shown = [v for v in xs if v <= hi]
    fig = _new_fig(5.2, 3.6)
    ax = fig.add_subplot()
    ax.hist([k * v for v in shown], bins=min(60, max(10, len(shown) // 20)), range=(k * lo, k * hi),
            color="#74a9cf", edgecolor="white", linewidth=0.3)
    for key, style in (("p50", ":"), ("p90", "--"), ("p99", "-.")):
        v = _num(lat.get(key))
        if v is not None and v <= hi + pad:
            ax.axvline(k * v, color="black", linestyle=style, linewidth=1, label=f"{key} {fmt_ms(v)}")
    from matplotlib.lines import Line2D

    extra = []
    beyond = len(xs) - len(shown)
    if beyond:
        extra.append(Line2D([], [], linestyle="", label=f"{beyond} slower runs not shown (max {fmt_ms(xs[-1])})"))
    if budget_ms is not None and budget_ms <= hi + pad:
        ax.axvline(k * budget_ms, color="crimson", linestyle="--", linewidth=1.3, label=f"budget {fmt_ms(budget_ms)}")
    elif budget_ms is not None:
        extra.append(Line2D([], [], color="crimson", linestyle="--", label=f"budget {fmt_ms(budget_ms)} (off the axis)"))
    ax.set_xlim(k * (lo - pad), k * (hi + pad))
    ax.set_title("Latency on the device (all timed runs)", fontsize=10)
    ax.set_xlabel(f"latency per batch ({unit})")
    ax.set_ylabel("runs")
    handles, _ = ax.get_legend_handles_labels()
    ax.legend(handles=handles + extra, fontsize=7)
    return _png(fig)


def _plot_selective(selective: Any) -> bytes | None:
    """Accuracy against the fraction of inputs rejected, the most uncertain (highest predictive entropy)
    first: what a Bayesian net's uncertainty buys when it may say "not sure"."""
    if not isinstance(selective, dict):
        return None
    pts = [(_num(r), _num(a)) for r, a in zip(selective.get("rejected") or [], selective.get("accuracy") or [])]
    pts = [(r, a) for r, a in pts if r is not None and a is not None]
    if len(pts) < 2:
        return None
    fig = _new_fig(4.8, 3.6)
    ax = fig.add_subplot()
    ax.plot([100 * r for r, _ in pts], [a for _, a in pts], marker="o", markersize=3, color="#2c7fb8",
            label="by predictive entropy")
    ax.axhline(pts[0][1], color="grey", linestyle=":", linewidth=1, label=f"no rejection ({_fmt(pts[0][1])})")
    ax.set_xlabel("inputs rejected, most uncertain first (%)")
    ax.set_ylabel("accuracy on the rest")
    ax.set_title("Selective prediction: accuracy vs rejection", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return _png(fig)


def _plot_reliability(rel: Any, ece: Any) -> bytes | None:
    acc = rel.get("bin_accuracy") if isinstance(rel, dict) else None
    if not isinstance(acc, list) or not acc:
        return None
    conf = rel.get("bin_confidence") or [None] * len(acc)
    count = rel.get("bin_count") or [None] * len(acc)
    nb = len(acc)
    width = 1.0 / nb
    centers = [(i + 0.5) * width for i in range(nb)]
    fig = _new_fig(4.7, 4.7)
    gs = fig.add_gridspec(2, 1, height_ratios=[4, 1])
    ax = fig.add_subplot(gs[0])
    axc = fig.add_subplot(gs[1], sharex=ax)
    # Empty bins (count 0 or no value) are left blank rather than drawn as zero accuracy.
    bx, bh, cx, cy = [], [], [], []
    for c, a, v, n in zip(centers, acc, conf, count):
        if n == 0:
            continue
        if _num(a) is not None:
            bx.append(c)
            bh.append(_num(a))
        if _num(v) is not None:
            cx.append(c)
            cy.append(_num(v))
    ax.bar(bx, bh, width=width * 0.95, color="#2c7fb8", edgecolor="white", label="accuracy in bin")
    ax.scatter(cx, cy, color="black", s=14, zorder=3, label="mean confidence in bin")
    ax.plot([0, 1], [0, 1], linestyle="--", color="grey", label="perfect calibration")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy")
    ax.set_title("Reliability diagram" + (f" (ECE = {_fmt(_num(ece))})" if _num(ece) is not None else ""))
    ax.legend(loc="upper left", fontsize=8)
    ax.tick_params(labelbottom=False)
    axc.bar(centers, [_num(n) or 0 for n in count], width=width * 0.95, color="#bdbdbd")
    axc.set_xlabel("confidence (max predicted probability)")
    axc.set_ylabel("examples")
    return _png(fig)


def _plot_history(history: Any, layer_names: list[str]) -> bytes | None:
    hist = [h for h in (history or []) if isinstance(h, dict)]
    ep = [(_num(h.get("epoch")) if _num(h.get("epoch")) is not None else i + 1) for i, h in enumerate(hist)]
    acc = [(e, _num(h.get("val_accuracy"))) for e, h in zip(ep, hist) if _num(h.get("val_accuracy")) is not None]
    kept = [(e, h["kept_nodes"]) for e, h in zip(ep, hist) if isinstance(h.get("kept_nodes"), list)]
    if not acc and not kept:
        return None
    fig = _new_fig(9.0, 3.4)
    a1, a2 = fig.subplots(1, 2)
    if acc:
        a1.plot(*zip(*acc), color="#2c7fb8")
    a1.set_title("Validation accuracy during training")
    a1.set_xlabel("epoch")
    a1.set_ylabel("val accuracy")
    a1.grid(True, alpha=0.3)
    width = max((len(k) for _, k in kept), default=0)
    for j in range(width):
        pts = [(e, _num(k[j])) for e, k in kept if j < len(k) and _num(k[j]) is not None]
        if pts:
            a2.plot(*zip(*pts), label=layer_names[j] if j < len(layer_names) else f"layer {j + 1}")
    a2.set_title("Kept nodes per hidden layer")
    a2.set_xlabel("epoch")
    a2.set_ylabel("kept nodes")
    a2.grid(True, alpha=0.3)
    if width:
        a2.legend(fontsize=8)
    return _png(fig)


# ----------------------------------------------------------------------------
# HTML
# ----------------------------------------------------------------------------

CSS = """
body{font-family:-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:0;background:#f4f5f7;color:#222}
main{max-width:1100px;margin:0 auto;padding:20px 28px 48px;background:#fff}
h1{font-size:1.55em;margin:0 0 6px;word-break:break-word}
h2{font-size:1.18em;margin:30px 0 10px;padding-bottom:4px;border-bottom:2px solid #e3e6ea}
h3{font-size:1em;margin:18px 0 6px}
table{border-collapse:collapse;margin:6px 0 12px;font-size:.9em}
th,td{border:1px solid #dde1e6;padding:4px 9px;text-align:left;vertical-align:top}
th{background:#f0f2f5}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
tr.chosen td{background:#fff4d6;font-weight:600}
.badge{display:inline-block;padding:3px 9px;margin:2px 6px 2px 0;border-radius:11px;font-size:.85em;font-weight:600;color:#fff}
.pass{background:#2e8540}.fail{background:#c62828}.na{background:#8a8f98}
.headline{background:#f7f9fc;border:1px solid #dde3ea;border-radius:8px;padding:14px 18px;margin-top:10px}
.cards{display:flex;flex-wrap:wrap;gap:12px;margin-top:12px}
.card{background:#fff;border:1px solid #dde3ea;border-radius:6px;padding:8px 14px;min-width:150px}
.card .v{font-size:1.35em;font-weight:700}.card .l{font-size:.8em;color:#555}
.muted{color:#666;font-size:.88em}
.warn{background:#fff3e0;border-left:4px solid #ef6c00;padding:6px 12px;margin:8px 0}
.predicted{background:#e8eaf6;border-left:6px solid #3949ab;padding:8px 14px;margin:10px 0}
.predicted code{font-size:.85em;word-break:break-all}
img{max-width:100%;height:auto;display:block;margin:8px 0}
.row{display:flex;flex-wrap:wrap;gap:18px;align-items:flex-start}
.row img{max-width:520px}
ul.violations{margin:0;padding-left:16px}
"""


def _badge(verdict: str, text: str) -> str:
    cls = {"pass": "pass", "fail": "fail"}.get(verdict, "na")
    return f'<span class="badge {cls}">{_e(text)}</span>'


def _table(header: list[str], rows: list[list[Any]], num_cols: set[int] = frozenset(),
           row_classes: list[str] | None = None) -> str:
    """rows hold already-escaped HTML strings (cells built with _e/_fmt)."""
    out = ["<table><thead><tr>", *(f"<th>{_e(h)}</th>" for h in header), "</tr></thead><tbody>"]
    for i, row in enumerate(rows):
        cls = row_classes[i] if row_classes and row_classes[i] else ""
        out.append(f'<tr class="{cls}">' if cls else "<tr>")
        out += [f'<td class="num">{c}</td>' if j in num_cols else f"<td>{c}</td>" for j, c in enumerate(row)]
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _kv_table(d: Any) -> str:
    if not isinstance(d, dict) or not d:
        return f'<p class="muted">{NA}</p>'
    rows = [[_e(k), _e(json.dumps(v) if isinstance(v, (dict, list)) else _fmt(v))] for k, v in d.items()]
    return _table(["key", "value"], rows)


def _img(png: bytes | None, alt: str) -> str:
    if png is None:
        return f'<p class="muted">{_e(alt)}: {NA} (no data)</p>'
    return f'<img src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}" alt="{_e(alt)}">'


def _budget_text(row: dict) -> str:
    if row["verdict"] == "not set":
        return f"{row['label']}: not set"
    return (f"{row['label']} {_fmt_unit(row['measured'], row['unit'])} / {_fmt_unit(row['limit'], row['unit'])}: "
            f"{row['verdict']}")


def _predicted_section(p: list, s: dict, pngs: dict) -> None:
    """A predicted report's latency and memory: the latency model's percentiles and the memory estimate's
    parts, where a measured report has the device's tables."""
    p.append("<h2>Latency and memory: predicted, not measured on the device</h2>")
    lp = s["latency_prediction"]
    rows = [[_e(k), _e(fmt_ms(v))] for k, v in (s.get("latency_predicted_ms") or {}).items() if v is not None]
    lat_html = (_table(["percentile", "predicted"], rows, {1})
                + f"<p class='muted'>{_e(lp.get('predicted_by') or '')}</p>" if rows else
                "<p>No latency table for this device: no prediction.</p>")
    mem = s["memory"]
    parts = mem.get("estimate_parts_mb") or {}
    labels = {"runtime_baseline_mb": "runtime baseline (measured on the device)",
              "runtime_setup_mb": "runtime set-up (measured on the device)", "weights_mb": "2 x the model file",
              "activations_mb": "activations (M x one sample's largest)"}
    mem_rows = [[_e(label), _e("not measured yet" if parts.get(k) is None else _fmt(_num(parts[k]), "MB"))]
                for k, label in labels.items()]
    mem_rows.append([_e("estimate" + (" (a lower bound)" if mem.get("estimate_lower_bound") else "")),
                     _e(_fmt(mem.get("estimate_mb"), "MB"))])
    p.append("<div class='row'><div><h3>Latency (the device's latency model)</h3>" + lat_html
             + "</div><div><h3>Memory (selection's estimate)</h3>" + _table(["", "MB"], mem_rows, {1}) + "</div>"
             + (f"<div>{_img(pngs['reliability.png'], 'reliability diagram')}</div>" if pngs.get("reliability.png")
                else "") + "</div>")


def _render_html(d: dict, s: dict, pngs: dict[str, bytes | None]) -> str:
    results = d.get("results") if isinstance(d.get("results"), dict) else {}
    train = d.get("train") if isinstance(d.get("train"), dict) else {}
    choice = d.get("choice") if isinstance(d.get("choice"), dict) else {}
    lat = results.get("latency_ms") if isinstance(results.get("latency_ms"), dict) else {}
    predicted = s.get("mode") == "predicted"
    here = _dict(_get(d, "predicted", "here"))
    title = f"edgebayes report: {s['run_name'] or NA} on {s['device'] or NA}" + (" (predicted)" if predicted else "")
    p = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
         f"<meta name='viewport' content='width=device-width,initial-scale=1'>"
         f"<title>{_e(title)}</title><style>{CSS}</style></head><body><main>"]

    # 1. headline
    acc = _num(s["metrics"]["accuracy"]["device"])
    ci = s["accuracy_ci95"]
    ci_txt = f"95% CI {_fmt(ci[0])}-{_fmt(ci[1])} (n={_fmt(s['n_eval'])})" if ci else f"n={_fmt(s['n_eval'])}"
    p.append(f"<h1>{_e(title)}</h1>")
    if predicted:
        p.append("<div class='predicted'><b>PREDICTED, not measured on the device.</b> "
                 f"{_e(s['device'] or 'The device')} could not be reached: {_e(_get(d, 'predicted', 'reason') or NA)}. "
                 "Latency is the device's latency model, memory the selection's estimate, accuracy, ECE and OOD "
                 "figures are the bundle's on this machine. To finish on the device:"
                 "<ol>" + "".join(f"<li><code>{_e(step)}</code></li>" for step in s.get("finish") or []) + "</ol></div>")
    p.append("<div class='headline'>")
    p.append(f"<div><b>Chosen operating point:</b> {_e(_knob_label(s['knob']))} {_e(_fmt(s['knob_value']))}, "
             f"M = {_e(_fmt(s['mc_samples']))} posterior samples averaged"
             + (f", {_e(s['precision'])} ({_e(s['format'])})" if s.get("precision") else "")
             + f" &middot; objective: {_e(_fmt(s['objective']))}"
             + (f" (val ECE &le; {_e(_fmt(s['max_ece']))})" if s.get("max_ece") is not None else "") + "</div>")
    overall = f"overall{' (predicted)' if predicted else ''}: {s['overall_verdict']}"
    p.append("<div style='margin-top:8px'>" + _badge(s["overall_verdict"], overall)
             + "".join(_badge(r["verdict"], _budget_text(r)) for r in s["budgets"].values()) + "</div>")
    where = "this machine" if predicted else "on-device"
    pct_key = s["latency_stat"] or "p90"
    lat_card = s["latency_at_percentile_ms"]
    ood = s["ood"]
    cards = [(_fmt(acc), f"{where} accuracy", ci_txt),
             (_fmt(_num(s["metrics"]["ece"]["device"])), "ECE (calibration error)", "lower is better"),
             (_fmt(ood["auroc"]), "OOD AUROC", f"AUPR {_fmt(ood['aupr'])}" if ood["auroc"] is not None else "no OOD set"),
             (fmt_ms(lat_card), f"{pct_key} latency" + (" (predicted)" if predicted else ""),
              "all timed runs" if not predicted else (s["latency_prediction"]["predicted_by"] or "no latency table")),
             (_fmt(_num(s["budgets"]["memory_mb"]["measured"]), "MB"), "memory" + (" (estimated)" if predicted else ""),
              "runtime + model" if not predicted else "selection's estimate"),
             (_fmt(s["model_mb"], "MB"), "model file", f"compression {_fmt(_num(s['compression_ratio']))}")]
    p.append("<div class='cards'>" + "".join(
        f"<div class='card'><div class='v'>{_e(v)}</div><div class='l'>{_e(l)}</div>"
        f"<div class='muted'>{_e(sub)}</div></div>" for v, l, sub in cards) + "</div>")
    if s["choice_reason"]:
        p.append(f"<p class='muted'>Why this point: {_e(s['choice_reason'])}</p>")
    p.append("</div>")
    p += [f"<div class='warn'>&#9888; {_e(w)}</div>" for w in s["warnings"]]

    # 2. budget table
    p.append("<h2>Chosen point against the budget</h2>")
    rows = []
    for r in s["budgets"].values():
        rows.append([_e(r["label"]), _e("not set" if r["limit"] is None else f"≤ {_fmt_unit(r['limit'], r['unit'])}"),
                     _e(f"{_fmt_unit(r['measured'], r['unit'])} ({r['measured_as']})"), _e(r.get("basis") or NA),
                     _badge(r["verdict"], r["verdict"])])
    p.append(_table(["budget", "limit", "figure", "basis", "verdict"], rows))
    used = f"p{_fmt(s['latency_percentile'])}"
    if s["latency_stat"] and s["latency_stat"] != used:
        used += f", judged with {s['latency_stat']} because p{_fmt(s['latency_percentile'])} was not reported"
    p.append(f"<p class='muted'>Latency is judged at the budget's percentile ({_e(used)}) over every timed run "
             "(all rounds pooled, as MLPerf LoadGen counts every query); memory on the runtime's baseline plus the "
             "model's own peak (the runner's evaluation data excluded); pass means figure &le; limit; "
             "1 MB = 10<sup>6</sup> bytes.</p>")

    # 3-4. plots
    p.append("<h2>Accuracy vs latency and size of all candidates: the Pareto front</h2>"
             + _img(pngs["tradeoff.png"], "accuracy vs latency and size, Pareto front, budgets, chosen point"))
    p.append(f"<p class='muted'>Pareto-optimal (accuracy, latency, size): {_e(', '.join(map(str, s['pareto'])) or NA)}.</p>")
    p.append("<h2>Accuracy and calibration against the knob</h2>"
             + _img(pngs.get("knob.png"), f"accuracy and ECE vs {_knob_label(s['knob'])}"))
    lp = s["latency_prediction"]
    p.append("<h2>Latency model: predicted vs measured</h2>")
    if lp.get("has_table") is False:
        p.append(f"<p><b>No latency table for {_e(s['device'] or 'this device')}:</b> its latency model is FLOPs / "
                 "declared throughput, nearly its fixed overhead for models this small, so no prediction is shown. "
                 f"<code>edgebayes devices profile {_e(s['device'] or 'DEVICE')}</code> on the board measures one.</p>")
    rows = [["percentile", _e(f"p{_fmt(lp['percentile'])}")],
            ["predicted for the chosen point", _e(fmt_ms(lp["predicted_ms"]) + (f" ({lp['predicted_by']})" if lp["predicted_by"] else ""))],
            ["measured on the device (deployment, all timed runs)", _e(fmt_ms(lp["measured_ms"]))],
            ["error (predicted - measured) / measured", _e(NA if lp["error"] is None else f"{100 * lp['error']:+.1f} %")],
            ["measurement spread (range of the rounds' values / best round)",
             _e(NA if lp.get("measurement_spread") is None else f"{100 * lp['measurement_spread']:.1f} %")]]
    for k, v in _dict(lp.get("by_percentile")).items():
        if isinstance(v, dict) and (v.get("predicted_ms") is not None or v.get("measured_ms") is not None):
            rows.append([_e(f"{k}: predicted / measured / error"),
                         _e(f"{fmt_ms(v.get('predicted_ms'))} / {fmt_ms(v.get('measured_ms'))} / "
                            + (NA if v.get("error") is None else f"{100 * v['error']:+.1f} %"))])
    p.append(_table(["", "value"], rows))
    p.append(_img(pngs.get("latency_prediction.png"), "predicted vs measured latency"))
    p.append("<h2>Kept nodes per layer</h2>" + _img(pngs["sparsity.png"], "kept nodes per layer"))

    # 5. device vs reference
    col = "this machine" if predicted else "device"
    p.append(f"<h2>{'Bundle on this machine' if predicted else 'On-device metrics'} vs PyTorch reference</h2>")
    rows = []
    for m in METRICS:
        r = s["metrics"][m]
        rows.append([_e(METRIC_LABELS[m]), _e(_fmt(_num(r["device"]))), _e(_fmt(_num(r["reference"]))),
                     _e(_fmt_diff(r["diff"]))])
    src = here if predicted else results
    n_dev, n_ref = _get(src, "metrics", "n"), _get(src, "reference", "n")
    rows.append(["n", _e(_fmt(n_dev)), _e(_fmt(n_ref)), _e(_fmt_diff(_diff(n_dev, n_ref)))])
    p.append(_table(["metric", col, "PyTorch reference", f"{col} - reference"], rows, {1, 2, 3}))
    tol = _num(_get(d, "export", "fidelity_tolerance"))
    tol_txt = f" (tolerance {_fmt(tol)})" if tol is not None else ""
    p.append(f"<p>Max |p<sub>{_e(col)}</sub> - p<sub>torch</sub>| over all test probabilities: "
             f"<b>{_e(_fmt(_num(s['max_abs_prob_diff'])))}</b>; export-time fidelity check: "
             f"{_e(_fmt(_num(s['fidelity_max_abs_prob_diff'])) + tol_txt)}.</p>")

    # 5b. uncertainty: OOD detection and selective prediction, on the outputs the device produced
    p.append("<h2>Uncertainty: OOD detection and selective prediction</h2>")
    rows = [["OOD AUROC / AUPR (" + _e(col) + ")", _e(f"{_fmt(ood['auroc'])} / {_fmt(ood['aupr'])}")],
            ["OOD AUROC / AUPR (PyTorch, training)", _e(f"{_fmt(ood['train_auroc'])} / {_fmt(ood['train_aupr'])}")],
            ["OOD set, score", _e(f"{ood['set'] or NA}, {ood['score'] or 'predictive entropy'}")]]
    sel = s.get("selective") or {}
    for r, a in zip(sel.get("rejected") or [], sel.get("accuracy") or []):
        if any(math.isclose(r, x) for x in (0.1, 0.2, 0.5)):
            rows.append([_e(f"accuracy with the {100 * r:.0f} % most uncertain rejected"), _e(_fmt(a))])
    p.append("<div class='row'><div>" + _table(["", "value"], rows) + "</div><div>"
             + _img(pngs.get("selective.png"), "accuracy vs rejection") + "</div></div>")

    # 6. latency, memory + calibration
    if predicted:
        _predicted_section(p, s, pngs)
    else:
        p.append("<h2>Latency, memory and calibration on device</h2>")
        best = s.get("latency_ms_best_round") or {}
        rows = [[_e(k), _e(fmt_ms(_num(lat.get(k)))), _e(fmt_ms(_num(best.get(k))) if k in best else "")]
                for k in ("p50", "p90", "p99", "mean", "min", "max")]
        rows += [[_e(label), _e(_fmt(results.get(k), unit)), ""] for k, label, unit in (
            ("runs", "timed runs", ""), ("rounds", "rounds (interleaved)", ""),
            ("warmup", "warm-up runs", ""), ("seconds", "wall time", "s"),
            ("batch_size", "batch size", ""), ("throughput_per_s", "throughput", "examples/s"))]
        cold = _dict(s.get("cold_start"))
        rows += [[_e("cold start: session creation"), _e(fmt_ms(cold.get("session_create_ms"))), ""],
                 [_e("cold start: first inference"), _e(fmt_ms(cold.get("first_inference_ms"))), ""]]
        if cold.get("engine_build_ms") is not None or _get(results, "runtime", "name") == "tensorrt":
            rows.append([_e("TensorRT engine build (in session creation)"),
                         _e(fmt_ms(cold.get("engine_build_ms")) if cold.get("engine_build_ms") is not None
                            else "cached engine"), ""])
        mem = s["memory"]
        mem_rows = [["runtime baseline (python, numpy, runtime; no model)", _e(_fmt(mem["runtime_baseline_mb"], "MB"))],
                    ["model's own (peak from loading to the end of the warm-up - RSS before)",
                     _e(_fmt(mem["model_mb"], "MB"))],
                    ["deployed = baseline + model's own", _e(_fmt(mem["deployed_mb"], "MB"))],
                    ["runtime set-up subtracted (first session; measured on the device at selection)",
                     _e(_fmt(mem["subtracted_setup_mb"], "MB"))],
                    ["model's own less the runtime set-up: judged by budgets.memory_mb", _e(_fmt(mem["own_mb"], "MB"))],
                    ["runner's peak RSS (its evaluation data included)", _e(_fmt(mem["runner_peak_rss_mb"], "MB"))],
                    ["estimate at selection" + (" (lower bound)" if mem["estimate_lower_bound"] else ""),
                     _e(_fmt(mem["estimate_mb"], "MB"))],
                    ["estimate error (estimate - model's own) / model's own",
                     _e(NA if mem["estimate_error"] is None else f"{100 * mem['estimate_error']:+.1f} %")]]
        rt, hw = results.get("runtime") or {}, results.get("device") or {}
        measured_on = {
            "runtime": " ".join(str(x) for x in (_get(rt, "name"), _get(rt, "version")) if x) or None,
            "providers": ", ".join(map(str, _get(rt, "providers") or [])) or None,
            "threads": _get(rt, "threads"),
            "host": _get(hw, "hostname"), "platform": _get(hw, "platform"), "machine": _get(hw, "machine"),
            "processor": _get(hw, "processor") or None, "cpu count": _get(hw, "cpu_count"),
            "python": _get(hw, "python"), "numpy": _get(hw, "numpy"),
        }
        p.append("<div class='row'><div><h3>Latency</h3>"
                 + _table(["statistic", "all timed runs", "best round (undisturbed device)"], rows, {1, 2})
                 + "</div><div><h3>Memory</h3>" + _table(["", "MB"], mem_rows, {1})
                 + "<h3>Measured on</h3>" + _kv_table(measured_on) + "</div></div>")
        figs = [_img(pngs[k], alt) for k, alt in (("latency_hist.png", "latency histogram"),
                                                   ("reliability.png", "reliability diagram")) if pngs.get(k)]
        if figs:
            p.append("<div class='row'>" + "".join(figs) + "</div>")

    # 7. training
    p.append("<h2>Training</h2>")
    model = train.get("model") if isinstance(train.get("model"), dict) else {}
    arch = NA
    if model:
        hidden = model.get("hidden") or []
        arch = f"{model.get('arch', NA)}: " + " → ".join(
            str(x) for x in [model.get("in_features", "?"), *hidden, model.get("classes", "?")])
    info = [["family", _e(_fmt(train.get("family")))], ["model", _e(arch)],
            ["epochs", _e(_fmt(train.get("epochs")))],
            ["compression ratio (kept / dense weights)", _e(_fmt(_num(train.get("compression_ratio"))))],
            ["FLOPs ratio (kept / dense, paper 000 A.1 by the masks)", _e(_fmt(_num(train.get("flops_ratio"))))],
            ["FLOPs ratio of the network after surgery", _e(_fmt(_num(train.get("physical_flops_ratio"))))],
            ["hidden nodes pruned", _e(_pct(s["pruned_fraction_hidden"]))],
            ["ONNX parameters", _e(_fmt(s["onnx_params"]))],
            ["kept weights total (all M samples)", _e(_fmt(s["kept_weights_total"]))],
            ["kept weights per sample", _e(_fmt(s["kept_weights_per_sample"]))],
            ["ONNX params match kept weights", _badge({True: "pass", False: "fail"}.get(s["params_match"], NA),
                                                      _fmt(s["params_match"]))]]
    test = train.get("test") if isinstance(train.get("test"), dict) else {}
    test_rows = [[_e(METRIC_LABELS.get(k, k)), _e(_fmt(test.get(k)))] for k in (*METRICS, "n", "mc_samples")]
    p.append("<div class='row'><div>" + _table(["", "value"], info) + "</div><div><h3 style='margin-top:6px'>"
             "Test metrics (PyTorch)</h3>" + _table(["metric", "value"], test_rows, {1}) + "</div></div>")
    if pngs.get("training.png"):
        p.append(_img(pngs["training.png"], "training history"))

    # 8. candidates
    p.append("<h2>All candidates</h2>")
    rows, classes = [], []
    for c in d.get("candidates") or []:
        if not isinstance(c, dict):
            continue
        viol = c.get("violations") or []
        fits = c.get("fits")
        fit_cell = _badge({True: "pass", False: "fail"}.get(fits, NA), {True: "fits", False: "no"}.get(fits, NA))
        if viol:
            fit_cell += "<ul class='violations'>" + "".join(f"<li>{_e(v)}</li>" for v in viol) + "</ul>"
        src = _get(c, "cost", "latency_source")
        rows.append([_e(_fmt(c.get("knob_value"))), _e(_fmt(c.get("mc_samples"))),
                     _e(_fmt(_num(_get(c, "val", "accuracy")))), _e(_fmt(_num(_get(c, "val", "nll")))),
                     _e(_fmt(_num(_get(c, "val", "ece")))),
                     _e(fmt_ms(_num(_get(c, "cost", "latency_ms"))) + (f" ({src})" if src else "")),
                     _e(_fmt(_num(_get(c, "cost", "model_mb")))),
                     _e(_fmt(_num(_get(c, "cost", "memory_estimate_mb")))), fit_cell])
        classes.append("chosen" if _same_point(c, choice.get("knob_value"), choice.get("mc_samples")) else "")
    if rows:
        p.append(_table([_knob_label(choice.get("knob")), "M", "val acc", "val NLL", "val ECE", "latency (source)", "model MB",
                         "memory MB (est.)", "fits / violations"], rows, {0, 1, 2, 3, 4, 5, 6, 7}, classes))
        p.append("<p class='muted'>Highlighted row: chosen point.</p>")
    else:
        p.append(f"<p class='muted'>{NA}</p>")

    p.append(fidelity_section(d))
    p.append(bytes_section(d))

    # 9. provenance
    prov = d.get("provenance") if isinstance(d.get("provenance"), dict) else {}
    p.append("<h2>Provenance</h2>")
    p.append(_kv_table({"git commit": prov.get("git_commit"), "config hash": prov.get("config_hash"),
                        "run created at": prov.get("created_at"), "report created at": s["report_created_at"]}))
    p.append("<div class='row'><div><h3>Versions</h3>" + _kv_table(prov.get("versions"))
             + "</div><div><h3>Machine</h3>" + _kv_table(prov.get("machine")) + "</div></div>")
    p.append("</main></body></html>\n")
    return "".join(p)


# ----------------------------------------------------------------------------
# fidelity of every exported artifact (export formats, issue 8)
# ----------------------------------------------------------------------------

def fidelity_rows(d: dict) -> list[dict]:
    """One row per exported artifact: its metrics at export (beside the PyTorch MC average's), the
    largest probability difference, the tolerance check, and what the device measured running it."""
    artifacts = _get(d, "export", "artifacts")
    on_device = d.get("artifact_results") if isinstance(d.get("artifact_results"), dict) else {}
    rows = []
    for name, art in (artifacts.items() if isinstance(artifacts, dict) else []):
        fid = art.get("fidelity") if isinstance(art, dict) else None
        if not isinstance(fid, dict):
            continue
        dev = on_device.get(name) if isinstance(on_device.get(name), dict) else {}
        rows.append({
            "artifact": name, "precision": art.get("precision"), "layout": art.get("layout"),
            "bytes": art.get("bytes"), "accuracy": fid.get("accuracy"), "nll": fid.get("nll"),
            "ece": fid.get("ece"), "reference": fid.get("reference"),
            "max_abs_prob_diff": fid.get("max_abs_prob_diff"), "check": fid.get("check"),
            "device_accuracy": _get(dev, "metrics", "accuracy"), "device_ece": _get(dev, "metrics", "ece"),
            "device_p50_ms": _get(dev, "latency_ms", "p50"), "device_skipped": dev.get("skipped"),
        })
    return rows


def fidelity_section(d: dict) -> str:
    """HTML table of `fidelity_rows`: calibration can shift under quantization, this is where it shows."""
    rows = fidelity_rows(d)
    if not rows:
        return ""
    body = []
    for r in rows:
        ref = r["reference"] if isinstance(r["reference"], dict) else {}
        check = r["check"] if isinstance(r["check"], dict) else {}
        verdict = "pass" if check.get("passed") else "fail" if check else "n/a"
        body.append([_e(r["artifact"]), _e(r["precision"]), _e(r["layout"]),
                     _fmt(r["bytes"] / BYTES_PER_MB if _num(r["bytes"]) is not None else None),
                     f"{_fmt(r['accuracy'])} / {_fmt(ref.get('accuracy'))}", f"{_fmt(r['nll'])} / {_fmt(ref.get('nll'))}",
                     f"{_fmt(r['ece'])} / {_fmt(ref.get('ece'))}", _fmt(r["max_abs_prob_diff"]),
                     _badge(verdict, check.get("rule", NA)),
                     *([f"not run: {_e(r['device_skipped'])}", "", ""] if r.get("device_skipped") else
                       [_fmt(r["device_accuracy"]), _fmt(r["device_ece"]), _e(fmt_ms(r["device_p50_ms"]))])])
    return ("<h2>Fidelity of every exported artifact</h2>"
            "<p class='muted'>Artifact / PyTorch MC average on the eval set at export; max |&Delta;p| is the largest "
            "difference of any class probability. Device columns: the runner on the target.</p>"
            + _table(["artifact", "precision", "layout", "MB", "accuracy", "NLL", "ECE", "max |Δp|", "check",
                      "device accuracy", "device ECE", "device p50"], body, num_cols={3, 9, 10, 11}))


def bytes_section(d: dict) -> str:
    """Where the shipped bytes go, per ONNX artifact and section (export/lowbit.py breakdown, in export.json),
    with the fp32 ONNX of the same network and the compression ratio of the shipped file (issue 21)."""
    artifacts = _get(d, "export", "artifacts")
    rows = [(name, art["bytes_breakdown"]) for name, art in (artifacts.items() if isinstance(artifacts, dict) else [])
            if isinstance(art, dict) and isinstance(art.get("bytes_breakdown"), dict)]
    if not rows:
        return ""
    keys = ("indices", "mask", "codebooks", "biases", "weights", "graph")
    body = [[_e(name), _e(f"{b['bytes']:,}"), *(_e(f"{_get(b, 'sections', k) or 0:,}") for k in keys),
             _e(f"{b['fp32_bytes']:,}" if _num(b.get("fp32_bytes")) is not None else NA),
             _e(f"{b['compression_ratio']:.1f}x" if _num(b.get("compression_ratio")) is not None else NA)]
            for name, b in rows]
    return ("<h2>Where the shipped bytes go</h2>"
            "<p class='muted'>Bytes of each ONNX file by section: level indices, masks (kept inputs, zeros), "
            "codebooks, biases, weights stored whole (fp32, or fp16/int8), graph (nodes, names, shapes). fp32: the "
            "fp32 ONNX of the same network; ratio = fp32 / shipped.</p>"
            + _table(["artifact", "bytes", *keys, "fp32 ONNX bytes", "ratio"], body, num_cols=set(range(1, 10))))


# ----------------------------------------------------------------------------
# what the terminal shows at the end of a run, and a page comparing devices
# ----------------------------------------------------------------------------

def terminal_summary(report: dict, report_path: Any = None) -> dict:
    """The figures a run ends with (`edgebayes pipeline` / `report`, `--json`): device, chosen point,
    accuracy, ECE, OOD AUROC, latency percentiles, size, memory, each budget's verdict, the report's path."""
    s = _dict(report.get("summary"))
    predicted = s.get("mode") == "predicted"
    lat = s.get("latency_predicted_ms") if predicted else {**_dict(s.get("latency_ms")), "max": s.get("latency_max_ms")}
    return {
        "run": s.get("run_name"), "device": s.get("device"), "mode": s.get("mode"),
        "chosen": {k: s.get(k) for k in ("knob", "knob_value", "mc_samples", "format", "precision")},
        "accuracy": _get(s, "metrics", "accuracy", "device"), "ece": _get(s, "metrics", "ece", "device"),
        "metrics_measured_on": s.get("metrics_measured_on"),
        "ood_auroc": _get(s, "ood", "auroc"), "ood_aupr": _get(s, "ood", "aupr"),
        "latency_ms": lat, "latency_basis": (("no latency table" if _get(s, "latency_prediction", "has_table") is False
                                              else str(_get(s, "latency_prediction", "predicted_by")))
                                             if predicted else "measured, all timed runs"),
        "latency_ms_best_round": None if predicted else s.get("latency_ms_best_round"),
        "model_mb": s.get("model_mb"),
        "memory_mb": _get(s, "budgets", "memory_mb", "measured"),
        "memory_basis": _get(s, "budgets", "memory_mb", "measured_as"),
        "memory_runtime_baseline_mb": _get(s, "memory", "runtime_baseline_mb"),
        "memory_model_mb": _get(s, "memory", "model_mb"),
        "budgets": {k: {"limit": r.get("limit"), "value": r.get("measured"), "basis": r.get("basis"),
                        "verdict": r.get("verdict")} for k, r in _dict(s.get("budgets")).items()},
        "verdict": s.get("overall_verdict"),
        "report": None if report_path is None else str(report_path),
    }


def summary_text(t: dict, exit_code: int | None = None) -> list[str]:
    """terminal_summary as the block of lines printed at the end of a run (ASCII units)."""
    def ms(x):
        return fmt_ms(x, ascii_only=True)

    c = t["chosen"]
    lat = _dict(t.get("latency_ms"))
    predicted = t.get("mode") == "predicted"
    lat_txt = ", ".join(f"{k} {ms(v)}" for k, v in lat.items() if v is not None) or "n/a"
    best = _dict(t.get("latency_ms_best_round"))
    lines = [f"summary: {t.get('run')} on {t.get('device')} ({t.get('mode')})",
             f"  chosen point  {_knob_label(c.get('knob'))} {_fmt(c.get('knob_value'))}, M={c.get('mc_samples')}, "
             f"{c.get('format')} ({c.get('precision')})",
             f"  accuracy      {_fmt(t.get('accuracy'))}, ECE {_fmt(t.get('ece'))}, OOD AUROC {_fmt(t.get('ood_auroc'))}"
             + (" (the bundle on this machine)" if predicted else " (on the device)"),
             f"  latency       {lat_txt} ({t.get('latency_basis')})"
             + (f"; best round p90 {ms(best.get('p90'))}" if best.get("p90") is not None else ""),
             f"  size          {_fmt(t.get('model_mb'), 'MB')}",
             f"  memory        {_fmt(t.get('memory_mb'), 'MB')} ({t.get('memory_basis')})"
             + (f": runtime {_fmt(t['memory_runtime_baseline_mb'], 'MB')} + model {_fmt(t['memory_model_mb'], 'MB')}"
                if t.get("memory_model_mb") is not None else "")]
    for key, b in _dict(t.get("budgets")).items():
        label, unit = BUDGETS.get(key, (key, ""))
        limit = "not set" if b.get("limit") is None else f"<= {ms(b['limit']) if unit == 'ms' else _fmt(b['limit'], unit)}"
        value = ms(b.get("value")) if unit == "ms" else _fmt(b.get("value"), unit)
        lines.append(f"  budget        {label} {value} {limit}: {b.get('verdict')}"
                     + (f" ({b.get('basis')})" if b.get("basis") not in (None, "measured", "file") else ""))
    lines.append(f"  verdict       {t.get('verdict')}" + (" (predicted)" if predicted else "")
                 + (f", exit code {exit_code}" if exit_code is not None else ""))
    lines.append(f"  report        {t.get('report')}")
    return lines


def _plot_devices(rows: list[dict]) -> bytes | None:
    pts = [(r["device"], _num(r["latency_ms"]), _num(r["accuracy"]), r["mode"]) for r in rows]
    pts = [p for p in pts if p[1] is not None and p[2] is not None]
    if not pts:
        return None
    unit, k = _time_axis([x for _, x, _, _ in pts])
    fig = _new_fig(6.0, 3.8)
    ax = fig.add_subplot()
    for name, x, y, mode in pts:
        ax.scatter(k * x, y, s=70, marker="o" if mode == "measured" else "^",
                   color="#2c7fb8" if mode == "measured" else "#9e9ac8", edgecolor="black", linewidth=0.5, zorder=3)
        ax.annotate(name, (k * x, y), xytext=(6, 4), textcoords="offset points", fontsize=8)
    xs = [k * x for _, x, _, _ in pts]
    if min(xs) > 0 and max(xs) / min(xs) > 10:
        ax.set_xscale("log")
    ax.set_xlabel(f"latency at each device's budget percentile ({unit})")
    ax.set_ylabel("accuracy")
    ax.set_title("Chosen point per device (circle: measured, triangle: predicted)", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.margins(0.15)
    return _png(fig)


def write_comparison(reports: list, out_dir: Path, name: str = "devices") -> dict:
    """One page setting the chosen points of several devices side by side (`edgebayes report --devices a b
    c`). reports: [(report dict, path of its report.html)]. Writes <name>.html, <name>.json and the plot into
    out_dir; returns the JSON."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for report, path in reports:
        t = terminal_summary(report, path)
        s = _dict(report.get("summary"))
        rows.append({**t, "latency_stat": s.get("latency_stat"), "latency_ms": s.get("latency_at_percentile_ms"),
                     "latency_all": t["latency_ms"], "budget_ms": s.get("latency_budget_ms"),
                     "run_name": s.get("run_name")})
    png = _plot_devices(rows)
    run = ", ".join(sorted({str(r["run_name"]) for r in rows}))
    title = f"edgebayes: {run} on {len(rows)} devices"
    p = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{_e(title)}</title>"
         f"<style>{CSS}</style></head><body><main><h1>{_e(title)}</h1>"
         "<p class='muted'>Each device's chosen operating point, as its own report has it: measured on the device, "
         "or predicted where it could not be reached (accuracy then the bundle's on this machine). Latency at the "
         "device budget's percentile over all timed runs; 1 MB = 10<sup>6</sup> bytes.</p>"]
    body, classes = [], []
    for r in rows:
        c = r["chosen"]
        link = Path(r["report"]).relative_to(out_dir) if r["report"] and Path(r["report"]).is_relative_to(out_dir) \
            else r["report"]
        each = "<br>".join(f"{_e(BUDGETS.get(k, (k,))[0])}: {_e(b['verdict'])}"
                           for k, b in r["budgets"].items() if b["verdict"] != "not set")
        lat_all = _dict(r["latency_all"])
        latency = (f"{r['latency_stat']} {fmt_ms(r['latency_ms'])}" if r["latency_ms"] is not None
                   else "n/a (no latency table)" if r["mode"] == "predicted" else NA)
        body.append([f"<a href='{_e(link)}'>{_e(r['device'])}</a><br><span class='muted'>{_e(r['mode'])}</span>",
                     _e(f"{_knob_label(c['knob'])} {_fmt(c['knob_value'])}, M={c['mc_samples']}, {c['format']}"),
                     _e(_fmt(_num(r["accuracy"]))), _e(_fmt(_num(r["ece"]))), _e(_fmt(_num(r["ood_auroc"]))),
                     _e(latency), _e(" / ".join(fmt_ms(lat_all.get(k)) for k in ("p50", "p90", "p99"))),
                     _e(_fmt(_num(r["model_mb"]))), _e(_fmt(_num(r["memory_mb"]))),
                     _badge(r["verdict"], r["verdict"]) + f"<div class='muted'>{each}</div>"])
        classes.append("")
    p.append(_table(["device", "chosen point", "accuracy", "ECE", "OOD AUROC", "latency (budget pct)",
                     "p50 / p90 / p99", "model MB", "memory MB", "verdict"], body, {2, 3, 4, 5, 6, 7, 8}, classes))
    p.append(_img(png, "chosen point per device: accuracy vs latency"))
    unplotted = [r["device"] for r in rows if _num(r["latency_ms"]) is None]
    if unplotted:
        p.append(f"<p class='muted'>Not in the plot (no latency figure): {_e(', '.join(map(str, unplotted)))}.</p>")
    p.append("</main></body></html>\n")
    data = {"devices": rows}
    files = {f"{name}.html": "".join(p).encode("utf-8"),
             f"{name}.json": (json.dumps(_jsonable(data), indent=2, allow_nan=False) + "\n").encode("utf-8")}
    if png is not None:
        files[f"{name}.png"] = png
    for fname, blob in files.items():
        with atomic_path(out_dir / fname) as tmp:
            tmp.write_bytes(blob)
    return data


# ----------------------------------------------------------------------------
# entry point
# ----------------------------------------------------------------------------

def write_report(inputs: dict, out_dir: Path) -> dict:
    """Write report.json, report.html and the PNG plots into out_dir; return the report dict.

    Everything is rendered in memory first and then written atomically, so a
    failure while plotting leaves no partial report.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    d = _jsonable(dict(inputs))  # numpy/NaN-safe copy; the page and the JSON see the same values
    s = _summarize(d)
    report = {"summary": s, **{k: v for k, v in d.items() if k != "summary"}, "fidelity": fidelity_rows(d)}

    results = d.get("results") if isinstance(d.get("results"), dict) else {}
    train = d.get("train") if isinstance(d.get("train"), dict) else {}
    layers = _get(train, "sparsity", "layers") or []
    candidates = [c for c in d.get("candidates") or [] if isinstance(c, dict)]
    hidden_names = [str(l.get("name")) for l in layers if isinstance(l, dict) and l.get("name") != "output"]
    pngs = {
        "tradeoff.png": _plot_tradeoff(candidates, d.get("choice") or {}, s["latency_budget_ms"],
                                       s["budgets"]["model_mb"]["limit"]),
        "knob.png": _plot_knob(candidates, s["knob"]),
        "latency_prediction.png": _plot_latency_prediction(candidates, s["latency_prediction"]),
        "sparsity.png": _plot_sparsity(layers),
        "latency_hist.png": _plot_latency_hist(results.get("latency_samples_ms"),
                                               results.get("latency_ms") or {}, s["latency_budget_ms"]),
        "reliability.png": _plot_reliability(d.get("reliability") or _get(d, "predicted", "here", "reliability"),
                                             s["metrics"]["ece"]["device"]),
        "selective.png": _plot_selective(s.get("selective")),
        "training.png": _plot_history(train.get("history"), hidden_names),
    }
    page = _render_html(d, s, pngs)
    blob = json.dumps(report, indent=2, allow_nan=False) + "\n"

    files = {name: png for name, png in pngs.items() if png is not None}
    files.update({"report.json": blob.encode("utf-8"), "report.html": page.encode("utf-8")})
    for name, data in files.items():
        with atomic_path(out_dir / name) as tmp:
            tmp.write_bytes(data)
    return report
