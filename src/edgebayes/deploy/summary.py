"""The report's numbers: the summary block of report.json, the terminal summary, and how each figure is
written (units, "n/a"), shared by the page's templates (as filters), its plots and the terminal.

A report is "measured" (the device's runner results) or, when the device could not be reached, "predicted"
(``inputs["predicted"]``): the device's latency model and memory estimate stand for its measurements, the
accuracy figures are the bundle's on this machine, and every figure says which it is.

Units: latencies in µs below 1 ms, else ms (``fmt_ms``); sizes and memory in MB (10^6 bytes) everywhere, as
the budgets are. Missing optional inputs are "n/a" on the page and null in the JSON.
"""

from __future__ import annotations

import datetime as _dt
import math
from pathlib import Path
from typing import Any

from edgebayes.deploy.memory import own_memory

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

def jsonable(x: Any) -> Any:
    """Deep copy into plain JSON types; NaN/inf become None so the file is strict JSON."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
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
            return jsonable(getattr(x, attr)())
    return str(x)


def get(d: Any, *keys: Any) -> Any:
    """d[k1][k2]... or None when any level is absent."""
    for k in keys:
        if isinstance(d, dict):
            d = d.get(k)
        elif isinstance(d, list) and isinstance(k, int) and -len(d) <= k < len(d):
            d = d[k]
        else:
            return None
    return d


def num(x: Any) -> float | None:
    """A finite number as float, else None (bools are not numbers here)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def diff(a: Any, b: Any) -> float | None:
    a, b = num(a), num(b)
    return None if a is None or b is None else a - b


def fmt(x: Any, unit: str = "") -> str:
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


def fmt_diff(x: float | None) -> str:
    if x is None:
        return NA
    if x == 0:
        return "0"
    return f"{x:+.2e}" if abs(x) < 1e-3 else f"{x:+.4f}"


def fmt_ms(x: Any, ascii_only: bool = False) -> str:
    """A latency in the unit that fits: '7.83 µs' below 1 ms, '2.79 ms' above; None -> 'n/a'."""
    v = num(x)
    if v is None:
        return NA
    if abs(v) < 1.0:
        return f"{1000 * v:.3g} {'us' if ascii_only else 'µs'}"
    return f"{v:,.4g} ms" if v < 1000 else f"{v:,.0f} ms"


def fmt_unit(x: Any, unit: str) -> str:
    """fmt, but latencies ('ms') in the unit that fits."""
    return fmt_ms(x) if unit == "ms" else fmt(num(x) if num(x) is not None else x, unit)


def time_axis(values: list[float]) -> tuple[str, float]:
    """Unit and factor for a plot axis of latencies in ms: µs when every value is below 1 ms."""
    return ("µs", 1000.0) if values and max(values) < 1.0 else ("ms", 1.0)


def fmt_pct(x: float | None) -> str:
    return NA if x is None else f"{100 * x:.1f} %"



def knob_label(knob: Any) -> str:
    """'inclusion_threshold' -> 'inclusion threshold' (the family's deploy-time knob)."""
    return str(knob or "knob").replace("_", " ")


def point_label(knob: Any, value: Any) -> str:
    """'inclusion threshold 0.5'; 'every unit kept' for a family without a knob (dnn, bnn: nothing is pruned,
    train/models.py NO_KNOB), whose knob value means nothing."""
    return "every unit kept" if knob == "none" else f"{knob_label(knob)} {fmt(value)}"


def same_point(cand: dict, knob_value: Any, m: Any, fmt: Any = None) -> bool:
    """The candidate of this knob value and M (and export format, when given: a device taking fp32 and int8
    has two candidates of one knob value and M, whose size and memory differ)."""
    t1, t2 = num(cand.get("knob_value")), num(knob_value)
    return (t1 is not None and t2 is not None and math.isclose(t1, t2, rel_tol=1e-9, abs_tol=1e-12)
            and cand.get("mc_samples") == m and (fmt is None or cand.get("format") in (None, fmt)))


def wilson(p: float | None, n: float | None, z: float = 1.96) -> list[float] | None:
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

def latency_key(lat: dict, percentile: Any) -> str | None:
    """Reported latency statistic to judge the budget with: p<percentile> if reported,
    else the nearest reported percentile above it (conservative), else max."""
    pct = num(percentile)
    if pct is None:
        pct = 90.0
    exact = f"p{pct:g}"
    if num(lat.get(exact)) is not None:
        return exact
    reported = sorted(
        (float(k[1:]), k) for k in lat
        if k.startswith("p") and k[1:].replace(".", "", 1).isdigit() and num(lat[k]) is not None
    )
    for value, key in reported:
        if value >= pct:
            return key
    if num(lat.get("max")) is not None:
        return "max"
    return reported[-1][1] if reported else None


def verdict_of(limit: float | None, measured: float | None, band: Any = None) -> str:
    """pass / fail; with a band (a spec-sheet estimate: nothing measured) likely pass when all of the band is
    within the limit, likely fail when all of it is over, else unknown."""
    if limit is None:
        return "not set"
    if measured is None:
        return NA
    low, high = (num(x) for x in band) if isinstance(band, list) and len(band) == 2 else (None, None)
    if low is not None and high is not None:
        return "likely pass" if high <= limit else "likely fail" if low > limit else "unknown"
    return "pass" if measured <= limit else "fail"


# From worst to best: the overall verdict is the worst of the budgets' (n/a and unknown: not judged).
VERDICT_ORDER = ("fail", "likely fail", NA, "unknown", "likely pass", "pass")


def latency_basis(cost: dict) -> str | None:
    """One line for a candidate's predicted latency: its basis and band, and a table that does not cover it."""
    p, band = num(cost.get("predicted_latency_ms")), cost.get("predicted_latency_band_ms")
    if p is None:
        return None
    text = str(cost.get("predicted_by") or "predicted")
    if isinstance(band, list) and len(band) == 2 and None not in (num(band[0]), num(band[1])):
        text += f", band {fmt_ms(band[0])} to {fmt_ms(band[1])}"
    if cost.get("prediction_not_covered"):
        text += f"; NOT COVERED by the table: {cost['prediction_not_covered']}"
    return text


def pruned_fraction(layers: Any) -> float | None:
    """1 - kept/total over hidden layers; the output layer (named 'output', else the last) is excluded."""
    if not isinstance(layers, list) or not layers:
        return None
    layers = [l for l in layers if isinstance(l, dict)]
    hidden = [l for l in layers if l.get("name") != "output"]
    if len(hidden) == len(layers):
        hidden = layers[:-1]
    kept = [num(l.get("kept")) for l in hidden]
    total = [num(l.get("total")) for l in hidden]
    if not hidden or None in kept or None in total or sum(total) <= 0:
        return None
    return 1.0 - sum(kept) / sum(total)


def dict_or_empty(x: Any) -> dict:
    return x if isinstance(x, dict) else {}


NO_FIT_WARNING = ("No operating point fits the device budgets (the candidates table shows each against them): "
                  "nothing was deployed; the figures are the closest candidate's, predicted.")


def summarize(d: dict) -> dict:
    """Compute the summary block from the (JSON-clean) inputs."""
    device = dict_or_empty(d.get("device"))
    budgets = dict_or_empty(device.get("budgets"))
    predicted_in = d.get("predicted") if isinstance(d.get("predicted"), dict) else None
    mode = "predicted" if predicted_in is not None else "measured"
    results = dict_or_empty(d.get("results"))
    here = dict_or_empty(get(predicted_in, "here"))   # predicted: the bundle run on this machine
    outputs = here if predicted_in is not None else results   # where accuracy, OOD and rejection come from
    export = dict_or_empty(d.get("export"))
    train = dict_or_empty(d.get("train"))
    choice = dict_or_empty(d.get("choice"))
    candidates = [c for c in (d.get("candidates") or []) if isinstance(c, dict)]
    lat = dict_or_empty(results.get("latency_ms"))
    warnings: list[str] = []

    metrics = {}
    for m in METRICS:
        dev, ref = get(outputs, "metrics", m), get(outputs, "reference", m)
        metrics[m] = {"device": dev, "reference": ref, "diff": diff(dev, ref)}
    n_eval = get(outputs, "metrics", "n")
    ci = wilson(num(metrics["accuracy"]["device"]), num(n_eval))

    chosen = next((c for c in candidates
                   if same_point(c, choice.get("knob_value"), choice.get("mc_samples"), choice.get("format"))), None)
    cost = dict_or_empty(get(chosen, "cost"))
    has_table = cost.get("latency_model_has_table")
    by_pct = dict_or_empty(cost.get("predicted_latency_ms_by_percentile"))
    if not by_pct and num(cost.get("predicted_latency_ms")) is not None and budgets.get("percentile") is not None:
        by_pct = {f"p{num(budgets['percentile']):g}": cost["predicted_latency_ms"]}
    # One prediction per candidate, the same in the log, the candidates table, the plots and here: a table's,
    # or the spec sheet's estimate (has_table False), each with its basis and band (latency_model.py).
    predicted_lat = {k: num(v) for k, v in by_pct.items()}
    band = cost.get("predicted_latency_band_ms")
    spec_sheet = has_table is False

    # Budget verdicts.
    measured_at_selection = False   # a report of predictions whose chosen point select timed on the device
    if predicted_in is None:
        lat_key = latency_key(lat, budgets.get("percentile"))
        lat_value = num(lat.get(lat_key)) if lat_key else None
        lat_src = f"{lat_key} latency over all timed runs" if lat_key else "latency"
    else:
        lat_key = latency_key(predicted_lat, budgets.get("percentile"))
        lat_value = num(predicted_lat.get(lat_key)) if lat_key else None
        lat_src = (f"{lat_key} {latency_basis(cost)}" if lat_value is not None
                   else "not predicted: the device has no latency table and its profile no spec-sheet figures")
        if num(cost.get("measured_latency_ms")) is not None and budgets.get("percentile"):
            # select timed this candidate on the device (a no-fit report of a reachable board): that is its
            # figure, as select judged it, not the prediction beside it
            lat_key, lat_value = f"p{num(budgets['percentile']):g}", num(cost["measured_latency_ms"])
            lat_src, measured_at_selection = f"{lat_key} measured on the device at selection", True
    model_bytes = num(export.get("model_bytes"))
    if model_bytes is not None:
        model_mb, model_src = model_bytes / BYTES_PER_MB, "export.model_bytes"
    else:  # fall back to the selection stage's estimate for the chosen point
        model_mb, model_src = num(cost.get("model_mb")), "candidate cost estimate"
    mem = dict_or_empty(results.get("memory"))
    estimate = num(cost.get("memory_estimate_mb"))
    lower = bool(cost.get("memory_estimate_lower_bound"))
    own = own_memory(mem, cost.get("memory_parts_mb")) or {}
    if predicted_in is not None:
        memory = (estimate, "estimated at selection" + (" (a lower bound: no measurement of the runtime)"
                                                         if lower else "") if estimate is not None else "estimate")
    elif own:
        memory = (num(own["own_mb"]), own["measured_as"])
    else:
        memory = (num(results.get("peak_rss_mb")), "peak RSS")
    measured = {"latency_ms": (lat_value, lat_src), "memory_mb": memory, "model_mb": (model_mb, model_src)}
    stand_in = bool(own.get("stand_in"))   # the weights' bytes: below what the measurement resolves
    basis = {"latency_ms": "measured" if predicted_in is None or measured_at_selection else "predicted",
             "memory_mb": "estimated" if predicted_in is not None else "weights' bytes" if stand_in else "measured",
             "model_mb": "file"}
    budget_rows = {}
    for key, (label, unit) in BUDGETS.items():
        limit = num(budgets.get(key))
        value, source = measured[key]
        verdict = verdict_of(limit, value, band if key == "latency_ms" and basis[key] == "predicted" and spec_sheet
                             else None)
        if key == "memory_mb" and predicted_in is not None and verdict in ("pass", "fail"):
            # an estimate, not a measurement (the embedded default's was 85% below the runner's figure): likely pass / fail;
            # a lower bound under the budget says nothing, over it the budget fails for sure
            verdict = (NA if lower else "likely pass") if verdict == "pass" else ("fail" if lower else "likely fail")
        budget_rows[key] = {"label": label, "unit": unit, "limit": limit, "measured": value,
                            "measured_as": source, "verdict": verdict, "basis": basis[key]}
    verdicts = [r["verdict"] for r in budget_rows.values() if r["verdict"] != "not set"]
    overall = next((v for v in VERDICT_ORDER if v in verdicts), "not set")
    no_fit = bool(get(predicted_in, "no_fit"))   # no operating point fits: the closest one, not deployed
    if no_fit:
        overall = "fail"
        warnings.append(NO_FIT_WARNING)

    onnx_params, kept_total = export.get("onnx_params"), export.get("kept_weights_total")
    params_match = (None if num(onnx_params) is None or num(kept_total) is None
                    else onnx_params == kept_total)

    # Things an engineer should not miss when trusting the numbers.
    if predicted_in is not None and predicted_in.get("here_failed"):   # (the page's banner says the rest)
        warnings.append(f"The bundle did not run on this machine: {predicted_in['here_failed']}.")
    if spec_sheet and num(cost.get("predicted_latency_ms")) is not None:
        warnings.append(f"{device.get('name') or 'This device'} has no latency table: its latency is "
                        f"{latency_basis(cost)}; for models this small its fixed overhead is nearly all of it, so "
                        f"latency hardly tells the candidates apart. Run `edgebayes devices profile "
                        f"{device.get('name') or 'DEVICE'}` on the board to measure one.")
    if cost.get("prediction_not_covered"):
        warnings.append(f"The latency table does not cover the chosen point ({cost['prediction_not_covered']}): "
                        + ("it was measured on the device instead." if num(cost.get("measured_latency_ms")) is not None
                           else "its prediction is an extrapolation; measure it on the device."))
    history = train.get("history") if isinstance(train.get("history"), list) else []
    last_epoch = history[-1] if history and isinstance(history[-1], dict) else {}
    for said in (last_epoch.get("flops_target_verdict"),   # train.max_accuracy_drop: the target cost more
                 export.get("flops_target_exceeded"),       # the runtime's channel block rounded past the target
                 last_epoch.get("accuracy_lost")):          # the training wrecked the network it was given
        if isinstance(said, str) and said:
            warnings.append(said[0].upper() + said[1:] + ".")
    counts = export.get("test_class_counts")
    accuracy = num(metrics["accuracy"]["device"])
    if isinstance(counts, list) and len(counts) > 1 and sum(counts) > 0 and accuracy is not None \
            and accuracy <= max(counts) / sum(counts):   # an imbalanced test set: accuracy alone misleads
        warnings.append(f"The accuracy ({fmt(accuracy)}) is no better than always answering the test split's most "
                        f"frequent class ({max(counts)} of its {sum(counts)} examples, {fmt(max(counts) / sum(counts))}); "
                        f"on so imbalanced a split the NLL and ECE say more than the accuracy.")
    distinct, m_shipped = export.get("distinct_samples"), choice.get("mc_samples")
    if isinstance(distinct, int) and isinstance(m_shipped, int) and distinct < m_shipped:
        warnings.append(f"Only {distinct} of the M = {m_shipped} posterior samples in the shipped graph differ: the "
                        f"MC average repeats the same network, at {m_shipped}x the cost of M = {distinct}, and its "
                        f"uncertainty is that of {distinct} network(s).")
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
    pct = num(budgets.get("percentile"))
    if lat_key and pct is not None and lat_key != f"p{pct:g}":
        warnings.append(f"p{pct:g} latency not reported; judged with {lat_key} (conservative).")

    # Predicted (the device's latency model) against measured (the deployment's benchmark) latency of the
    # chosen point, at the budget's percentile and at each percentile: how far the latency model can be
    # trusted on this device. Both are over all timed samples (runner.latency_summary).
    predicted = num(cost.get("predicted_latency_ms"))
    lat_measured = None if predicted_in is not None else lat_value
    error = None if predicted is None or not lat_measured else (predicted - lat_measured) / lat_measured
    # The measurement's own noise: the range of the benchmark rounds' percentiles relative to the best round.
    spread = num(get(results, "latency_spread", lat_key)) if lat_key else None
    by_percentile = {}
    for k in ("p50", "p90", "p99"):
        pk, mk = num(predicted_lat.get(k)), num(lat.get(k))
        by_percentile[k] = {"predicted_ms": pk, "measured_ms": mk,
                            "error": None if pk is None or not mk else (pk - mk) / mk}
    latency_prediction = {"percentile": budgets.get("percentile"), "predicted_ms": predicted,
                          "predicted_by": cost.get("predicted_by"), "basis": cost.get("prediction_basis"),
                          "band_ms": band, "basis_text": latency_basis(cost),
                          "not_covered": cost.get("prediction_not_covered"), "measured_ms": lat_measured,
                          "error": error, "abs_error": None if error is None else abs(error),
                          "measurement_spread": spread, "has_table": has_table, "by_percentile": by_percentile}

    deployed_mb = num(mem.get("deployed_mb"))
    own_mb = num(own.get("own_mb"))
    memory_block = {
        "own_mb": own_mb, "own_is_stand_in": stand_in, "subtracted_setup_mb": num(own.get("setup_mb")),
        "runtime_baseline_mb": num(mem.get("runtime_baseline_mb")), "model_mb": num(mem.get("model_mb")),
        "deployed_mb": deployed_mb, "runner_peak_rss_mb": num(results.get("peak_rss_mb")),
        "estimate_mb": estimate, "estimate_lower_bound": lower if estimate is not None else None,
        "estimate_parts_mb": cost.get("memory_parts_mb"),
        # none against a stand-in: the estimate holds the same weights' bytes, so it would check itself; none
        # where no set-up was subtracted (imported results of an unprofiled board): the figure holds the runtime's
        # set-up, the estimate does not, and -97 % read as a bad estimate (probe)
        "estimate_error": (None if estimate is None or not own_mb or stand_in or own.get("setup_mb") is None
                           else (estimate - own_mb) / own_mb),
    }
    ood_train = dict_or_empty(train.get("ood"))
    ood = dict_or_empty(outputs.get("ood"))

    names = export.get("classes") if isinstance(export.get("classes"), list) else []
    counts = counts if isinstance(counts, list) and len(counts) == len(names) else [None] * len(names)
    classes_text = ", ".join(f"{n} ({c})" if c is not None else str(n) for n, c in list(zip(names, counts))[:20]) \
        + (f", ... ({len(names)} classes)" if len(names) > 20 else "")

    return {
        "run_name": d.get("run_name"),
        "device": device.get("name"),
        "mode": mode,
        "classes_text": classes_text or None,   # the shipped classes, with their test examples
        "runtime": device.get("runtime"),
        "knob": choice.get("knob"),
        "knob_value": choice.get("knob_value"),
        "mc_samples": choice.get("mc_samples"),
        "temperature": export.get("temperature"),   # of the shipped graph (select.temperature_scaling)
        "before_temperature": export.get("before_temperature"),   # the same samples at T = 1 (test, PyTorch)
        "precision": choice.get("precision"),
        "format": choice.get("format"),
        "objective": d.get("objective"),
        "max_ece": d.get("max_ece"),
        "latency_prediction": latency_prediction,
        "pareto": [c.get("id") or f"{point_label(c.get('knob'), c.get('knob_value'))}, M={c.get('mc_samples')}"
                   for c in candidates if c.get("pareto")],
        "choice_reason": choice.get("reason"),
        "metrics": metrics,
        "metrics_measured_on": "this machine" if predicted_in is not None else "device",
        # results of the runner run by hand on the device (report --results), not by deploy: the file they came from
        "imported_from": None if predicted_in is not None else get(d, "imported", "from"),
        "n_eval": n_eval,
        "accuracy_ci95": ci,
        "max_abs_prob_diff": outputs.get("max_abs_prob_diff"),
        "latency_ms": {k: lat.get(k) for k in ("p50", "p90", "p99")},
        "latency_max_ms": lat.get("max"),
        "latency_ms_best_round": {k: get(results, "latency_ms_best_round", k) for k in ("p50", "p90", "p99")},
        "latency_predicted_ms": {k: predicted_lat.get(k) for k in ("p50", "p90", "p99")},
        "cold_start": results.get("cold_start"),
        "latency_percentile": budgets.get("percentile"),
        "latency_stat": lat_key,
        "latency_at_percentile_ms": lat_value,
        "latency_measured_at_selection": measured_at_selection,
        "latency_budget_ms": num(budgets.get("latency_ms")),
        "budgets": budget_rows,
        "overall_verdict": overall,
        "no_fit": no_fit,
        # what keeps the closest candidate out: a budget, or select.max_ece / budgets.mc_samples, which no
        # budget row shows (every row can pass while nothing fits)
        "no_fit_violations": (list(chosen.get("violations") or []) if no_fit and chosen is not None else []),
        "memory": memory_block,
        "ood": {"auroc": num(ood.get("auroc")), "aupr": num(ood.get("aupr")), "score": ood.get("score"),
                "n_out": ood.get("n_out"), "train_auroc": num(ood_train.get("auroc")),
                "train_aupr": num(ood_train.get("aupr")), "set": ood_train.get("set")},
        "selective": outputs.get("selective") if isinstance(outputs.get("selective"), dict) else None,
        "model_mb": model_mb,
        "pruned_fraction_hidden": pruned_fraction(get(train, "sparsity", "layers")),
        "compression_ratio": train.get("compression_ratio"),
        "flops_ratio": train.get("flops_ratio"),
        # of the shipped network (after surgery: with the dead channels a runtime's channel block keeps)
        "shipped_compression_ratio": train.get("physical_compression_ratio", train.get("compression_ratio")),
        "shipped_flops_ratio": train.get("physical_flops_ratio", train.get("flops_ratio")),
        "onnx_params": onnx_params,
        "kept_weights_total": kept_total,
        "kept_weights_per_sample": export.get("kept_weights_per_sample"),
        "kept_units": export.get("kept_units"),
        "shipped_params": export.get("shipped_params"),   # where the file holds fewer (stages._shipped_structure)
        "weights_dropped_with_inputs": export.get("weights_dropped_with_inputs"),
        "params_match": params_match,
        "fidelity_max_abs_prob_diff": export.get("fidelity_max_abs_prob_diff"),
        "finish": (predicted_in or {}).get("finish"),
        "warnings": warnings,
        "report_created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }



# ----------------------------------------------------------------------------
# fidelity of every exported artifact (export formats, issue 8)
# ----------------------------------------------------------------------------

def fidelity_rows(d: dict) -> list[dict]:
    """One row per exported artifact: its metrics at export (beside the PyTorch MC average's), the
    largest probability difference, the tolerance check, and what the device measured running it."""
    artifacts = get(d, "export", "artifacts")
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
            "measured_with": fid.get("measured_with"),   # a TensorRT engine's: its ONNX in onnxruntime
            "device_accuracy": get(dev, "metrics", "accuracy"), "device_ece": get(dev, "metrics", "ece"),
            "device_p50_ms": get(dev, "latency_ms", "p50"), "device_skipped": dev.get("skipped"),
        })
    return rows



# ----------------------------------------------------------------------------
# what the terminal shows at the end of a run, and a page comparing devices
# ----------------------------------------------------------------------------

def shipped_bytes_rows(d: dict) -> list[dict]:
    """Where the shipped bytes go, per ONNX artifact that export broke down (export/lowbit.py breakdown, in
    export.json): bytes per section, the fp32 ONNX of the same network and the shipped file's compression."""
    artifacts = get(d, "export", "artifacts")
    return [{"artifact": name, **art["bytes_breakdown"]}
            for name, art in (artifacts.items() if isinstance(artifacts, dict) else [])
            if isinstance(art, dict) and isinstance(art.get("bytes_breakdown"), dict)]


def terminal_summary(report: dict, report_path: Any = None) -> dict:
    """The figures a run ends with (`edgebayes pipeline` / `report`, `--json`): device, chosen point,
    accuracy, ECE, OOD AUROC, latency percentiles, size, memory, each budget's verdict, the report's path."""
    s = dict_or_empty(report.get("summary"))
    predicted = s.get("mode") == "predicted"
    lat = s.get("latency_predicted_ms") if predicted else {**dict_or_empty(s.get("latency_ms")), "max": s.get("latency_max_ms")}
    basis = (str(get(s, "latency_prediction", "basis_text") or "no prediction") if predicted
             else "measured, all timed runs")
    if predicted and s.get("latency_measured_at_selection"):   # select timed the candidate on the device
        lat, basis = {s.get("latency_stat"): s.get("latency_at_percentile_ms")}, "measured on the device at selection"
    return {
        "run": s.get("run_name"), "device": s.get("device"), "mode": s.get("mode"),
        "settings": get(report, "config", "settings") or [],
        "chosen": {k: s.get(k) for k in ("knob", "knob_value", "mc_samples", "temperature", "format", "precision")},
        "accuracy": get(s, "metrics", "accuracy", "device"), "ece": get(s, "metrics", "ece", "device"),
        # what the fitted temperature changed, in PyTorch fp32 (the same samples at T = 1 and at T)
        "ece_at_t1": get(s, "before_temperature", "ece"),
        "ece_at_fitted_t": get(s, "before_temperature", "at_fitted_t", "ece"),
        "metrics_measured_on": s.get("metrics_measured_on"), "imported_from": s.get("imported_from"),
        "ood_auroc": get(s, "ood", "auroc"), "ood_aupr": get(s, "ood", "aupr"),
        "latency_ms": lat, "latency_basis": basis,
        "latency_ms_best_round": None if predicted else s.get("latency_ms_best_round"),
        "model_mb": s.get("model_mb"),
        "memory_mb": get(s, "budgets", "memory_mb", "measured"),
        "memory_basis": get(s, "budgets", "memory_mb", "measured_as"),
        "memory_runtime_baseline_mb": get(s, "memory", "runtime_baseline_mb"),
        "memory_model_mb": get(s, "memory", "model_mb"),
        "memory_setup_mb": get(s, "memory", "subtracted_setup_mb"),
        "memory_is_stand_in": bool(get(s, "memory", "own_is_stand_in")),
        "budgets": {k: {"limit": r.get("limit"), "value": r.get("measured"), "basis": r.get("basis"),
                        "verdict": r.get("verdict")} for k, r in dict_or_empty(s.get("budgets")).items()},
        "verdict": s.get("overall_verdict"), "no_fit": bool(s.get("no_fit")),
        "no_fit_violations": s.get("no_fit_violations") or [],
        # the shipped network's share of the dense FLOPs, and what the report warns of (a FLOPs target the
        # runtime's channel block rounded past, an accuracy floor missed): they were on the page only (probe)
        "flops_ratio": s.get("shipped_flops_ratio"),
        "warnings": [w for w in s.get("warnings") or [] if isinstance(w, str)
                     and w != NO_FIT_WARNING],   # the summary's own "no fit" line says it
        "finish": s.get("finish"),   # a report of predictions: the steps that finish it on the device
        "report": None if report_path is None else str(report_path),
    }


def _memory_note(t: dict) -> str:
    """The memory line's basis in a few words (the report has the parts): the model's own, less the runtime's
    set-up, and the whole process beside it."""
    if t.get("mode") == "predicted" or t.get("memory_model_mb") is None:
        return f"({t.get('memory_basis')})"
    setup = t.get("memory_setup_mb")
    own = ("the weights' bytes: the measurement does not resolve a model this small" if t.get("memory_is_stand_in")
           else "of its own" + (f", less {fmt(setup, 'MB')} runtime set-up" if setup is not None
                                else ", the runtime's set-up in it: none measured to subtract"))
    base = num(t.get("memory_runtime_baseline_mb"))
    whole = None if base is None else base + num(t["memory_model_mb"])
    return f"({own}; whole process {fmt(whole, 'MB')})"


def summary_text(t: dict, exit_code: int | None = None) -> list[str]:
    """terminal_summary as the block of lines printed at the end of a run (ASCII units)."""
    def ms(x):
        return fmt_ms(x, ascii_only=True)

    c = t["chosen"]
    lat = dict_or_empty(t.get("latency_ms"))
    predicted = t.get("mode") == "predicted"
    lat_txt = ", ".join(f"{k} {ms(v)}" for k, v in lat.items() if v is not None) or "n/a"
    best = dict_or_empty(t.get("latency_ms_best_round"))
    imported = f", results imported from {t['imported_from']}" if t.get("imported_from") else ""
    lines = [f"summary: {t.get('run')} on {t.get('device')} ({t.get('mode')}{imported})"
             + "".join(f" --set {x}" for x in t.get("settings") or []),
             f"  chosen point  {point_label(c.get('knob'), c.get('knob_value'))}, M={c.get('mc_samples')}, "
             + (f"T={fmt(c['temperature'])}, " if c.get("temperature") not in (None, 1.0) else "")
             + f"{c.get('format')} ({c.get('precision')})",
             f"  accuracy      {fmt(t.get('accuracy'))}, ECE {fmt(t.get('ece'))}"
             + (f" (PyTorch {fmt(t['ece_at_t1'])} at T=1"
                + (f", {fmt(t['ece_at_fitted_t'])} at T={fmt(c.get('temperature'))})"
                   if t.get("ece_at_fitted_t") is not None else ")") if t.get("ece_at_t1") is not None else "")
             + f", OOD AUROC {fmt(t.get('ood_auroc'))}"
             + ((" (the bundle's ONNX in onnxruntime on this machine: the engine is built on the device)"
                 if str(c.get("format") or "").startswith("tensorrt") else " (the bundle on this machine)")
                if predicted else " (on the device)"),
             f"  latency       {lat_txt} ({t.get('latency_basis')})"
             + (f"; best round p90 {ms(best.get('p90'))}" if best.get("p90") is not None else ""),
             f"  size          {fmt(t.get('model_mb'), 'MB')}"
             + (f", {fmt(t['flops_ratio'])} of the dense FLOPs" if (num(t.get("flops_ratio")) or 1) < 1 else ""),
             f"  memory        {fmt(t.get('memory_mb'), 'MB')} " + _memory_note(t)]
    for key, b in dict_or_empty(t.get("budgets")).items():
        label, unit = BUDGETS.get(key, (key, ""))
        value = ms(b.get("value")) if unit == "ms" else fmt(b.get("value"), unit)
        if b.get("limit") is None:   # "latency 38.5 us not set: not set" read as a second verdict
            lines.append(f"  budget        {label} {value}: no budget set")
            continue
        # the sign the numbers have ("1.52 ms <= 1 ms: unknown" read as a comparison that holds)
        value_number, limit_number = num(b.get("value")), num(b["limit"])
        sign = ">" if value_number is not None and limit_number is not None and value_number > limit_number else "<="
        limit = f"{sign} {ms(b['limit']) if unit == 'ms' else fmt(b['limit'], unit)}"
        lines.append(f"  budget        {label} {value} {limit}: {b.get('verdict')}"
                     + (f" ({b.get('basis')})" if b.get("basis") not in (None, "measured", "file") else ""))
    if t.get("no_fit"):
        lines.append("  no fit        no operating point fits the budgets: the closest candidate, not deployed"
                     + (f" ({'; '.join(t['no_fit_violations'])})" if t.get("no_fit_violations") else ""))
    for warning in t.get("warnings") or []:
        lines.append(f"  warning       {warning}")
    lines.append(f"  verdict       {t.get('verdict')}" + (" (predicted)" if predicted else "")
                 + (f", exit code {exit_code}" if exit_code is not None else ""))
    lines.append(f"  report        {t.get('report')}")
    for i, step in enumerate(t.get("finish") or []):
        lines.append(f"  {'to finish' if i == 0 else '':13s} {i + 1}. {step}")
    return [line.replace("µs", "us") for line in lines]   # a terminal may not print µs

