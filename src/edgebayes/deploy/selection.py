"""Select: score every operating point on the validation split, cost it on the device, pick one.

An operating point (candidate) is knob x M x precision: a value of the family's deploy-time knob
(inclusion threshold, width, non-zero rate: `model.knob`), a number of Monte-Carlo samples, and an export
format the device's runtime loads at one of the precisions it takes (`export.formats.FORMATS`, filtered by
the profile's `runtime.name` and `runtime.precision`). Each is exported, scored on val (MC-averaged
accuracy, NLL, ECE of the exported file, run by the device's runtime where it is installed here; else the
PyTorch fp32 graph, and the candidate says so) and costed:
  - latency at the budget's percentile and batch size, measured on the device or predicted by its latency
    model (deploy/latency_model.py); both figures are kept when both exist;
  - model size: the bytes of the exported file, the one shipped (onnx-codebook's low-bit file for SQS);
  - memory (`memory_estimate`): the model's own memory (the file, the runtime's copy of its weights, the
    activations), so that `budgets.memory_mb` rules out candidates before anything is deployed; with the
    runtime's baseline and one-off set-up as the runner measured them on the device (at selection, or in
    its latency table) it also gives the whole deployed process's estimate.
Constraints: the device budgets (latency, memory, model size, allowed M) and, for the
ece-constrained-accuracy objective, select.max_ece. Among the candidates that meet them, the best by the
objective (accuracy: ties broken by NLL, then latency; nll: lowest NLL, then latency) is only the reference:
selection decides on what the validation split can tell apart. Every fitting candidate whose accuracy, NLL
and ECE are not worse than the best's beyond their noise (`tied_with`: worse only where a paired bootstrap
over the validation images tells them apart at 95%, by more than MIN_DIFFERENCE) is tied with it, and the cheapest tied candidate wins: fewest MC samples, then the
lowest latency (within SAME_LATENCY, the measurement's own noise), then the smallest file. (An NLL lower in
its 10th digit or by 3e-5 on 5,000 images must not ship a 24x bigger file or twice the samples.) The choice
lists the tied candidates. The Pareto front (accuracy up, latency and size down) is marked on every candidate. The memory measured after deployment is set against the estimate in the
report. If nothing fits, the closest candidate is the choice, marked `fits: false`: the pipeline exports it,
deploys nothing and ends with a report of every candidate against the budgets and exit code 3.
"""

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from edgebayes.compressed.samples import EmptyLayerError, compress, predict
from edgebayes.compressed.structure import count_weights, paper_flops
from edgebayes.deploy.latency_model import (PERCENTILES, LatencyModelError, TablePredictor, measure_models,
                                            predictor_for, profile_device, profiling, table_set_aside)
from edgebayes.deploy.memory import deployed_estimate, memory_estimate
from edgebayes.deploy.transport import DeviceUnavailable
from edgebayes.errors import StageError, UnreachableWithoutTable
from edgebayes.export.formats import formats_for, operator_count
from edgebayes.ondevice.backends import RuntimeProblem
from edgebayes.ondevice.metrics import per_example
from edgebayes.ondevice.runtimes import make_backend, predict_all
from edgebayes.train.metrics import classification_metrics


# Latencies closer than this (relative) do not tell two candidates apart: a round-to-round spread of a few
# per cent is usual on a shared CPU (the report shows each run's own spread).
SAME_LATENCY = 0.05
# The paired bootstrap that decides which validation differences are noise: resamples and the level of
# the interval of (candidate - best) that must exclude 0 for a candidate to be worse.
BOOTSTRAP_RESAMPLES, TIE_LEVEL = 1000, 0.95
# Practical-equivalence margins (accuracy, NLL in nats, ECE): a consistent difference below them (an NLL
# 3e-5 lower on 5,000 images, 1e-10 between two files of one sample) does not make a candidate worse.
MIN_DIFFERENCE = np.array([0.005, 0.005, 0.005])


class SelectionError(StageError):
    pass


def select_bench(benchmark):
    """The timing protocol of selection and profiling: the run's, with a shorter minimum time per model
    (tens of models are timed; p90/p99 settle after a few hundred runs)."""
    return {"warmup": benchmark.warmup, "min_runs": benchmark.min_runs,
            "min_seconds": min(benchmark.min_seconds, 0.25), "rounds": benchmark.rounds}


def _figure(x):
    """A cost as the log shows it: 4 significant digits (a fixed 3 decimals showed 45 us and 0.005 MB files as
    alike), whole numbers from 1000 on. (Not the report's fmt: select's code must not hash the report's.)"""
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def violations(candidate, budgets, max_ece=None):
    """The budgets (and the ECE constraint) a candidate exceeds, as readable strings."""
    out, cost = [], candidate["cost"]
    if budgets.latency_ms is not None and cost["latency_ms"] > budgets.latency_ms:
        out.append(f"latency p{budgets.percentile} {_figure(cost['latency_ms'])} ms > budget {budgets.latency_ms} ms")
    if budgets.model_mb is not None and cost["model_mb"] > budgets.model_mb:
        out.append(f"model {_figure(cost['model_mb'])} MB > budget {budgets.model_mb} MB")
    memory = cost.get("memory_estimate_mb")
    if budgets.memory_mb is not None and memory is not None and memory > budgets.memory_mb:
        at_least = "at least " if cost.get("memory_estimate_lower_bound") else ""
        out.append(f"model's own memory (estimated) {at_least}{memory:.3g} MB > budget {budgets.memory_mb} MB")
    out += budgets.mc_samples_violations(candidate["mc_samples"])
    if max_ece is not None and candidate["val"]["ece"] > max_ece:
        out.append(f"val ECE {candidate['val']['ece']:.4f} > max_ece {max_ece}")
    return out


def activation_mb(sample, x):
    """Peak activation memory of one posterior sample on the batch `x`, fp32, in MB: the largest input +
    output of any leaf module (a runtime frees a tensor once its last reader ran, so at most about one
    operator's input and output are alive at a time)."""
    peak = 0

    def hook(module, inputs, output):
        nonlocal peak
        tensors = [t for t in (*inputs, output) if torch.is_tensor(t)]
        peak = max(peak, sum(t.numel() for t in tensors))

    handles = [m.register_forward_hook(hook) for m in sample.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            sample(x)
    finally:
        for h in handles:
            h.remove()
    return 4 * peak / 1e6


def _val_probs(fmt, path, mc_model, val_x):
    """Val probabilities of the exported file run by its runtime here (a TensorRT format's shipped ONNX by
    onnxruntime: engines are built on the target), or of the PyTorch graph when that runtime is absent."""
    runtime = "onnxruntime" if fmt.runtime == "tensorrt" else fmt.runtime
    try:
        return predict_all(make_backend(runtime, str(path)), val_x.numpy()), f"{fmt.name} file, {runtime}"
    except RuntimeProblem:
        return predict(mc_model, val_x).numpy(), f"PyTorch fp32 ({runtime} is not installed here)"


def _latencies(cfg, profile, transport, models, example, bench, runs_dir, log, table_read=None, sizes=None):
    """({id: measured ms or None}, predictor or None, measured-on facts or None).

    A reachable `measure` device without a latency table is profiled first, so every report can set the
    latency model's prediction against the measurement; `table_read()` is then called while no other
    profiling can write the table (the run's record of the table it used: Context.pin_latency_table). Only a device that cannot be used (DeviceUnavailable)
    falls back to a prediction; any other failure (the runner crashed, a full disk) stops selection as it is.
    `sizes` (inputs per example, classes) size the profiling sweep as the data this selection holds.
    """
    key = f"p{profile.budgets.percentile}"
    predictor = predictor_for(profile, runs_dir)
    if profile.latency_model.kind == "measure":
        try:
            # a table of another runtime or thread count is profiled again, also where a spec sheet predicts
            if predictor is None or table_set_aside(profile, runs_dir):
                with profiling(profile, runs_dir, log=log):
                    predictor = predictor_for(profile, runs_dir)   # profiled by another run while this one waited
                    aside = table_set_aside(profile, runs_dir)
                    if (predictor is None or aside) and cfg.model.arch != "mlp":   # the sweep is of MLPs
                        log(f"select: {aside or f'no latency table for {profile.name}'}; the latency table's sweep "
                            f"(edgebayes devices profile) is of MLPs, not {cfg.model.arch}: every candidate is "
                            f"measured on the device")
                    elif predictor is None or aside:
                        log(f"select: {aside or f'no latency table for {profile.name} yet'}: profiling it first "
                            f"(edgebayes devices profile)")
                        try:
                            path, _ = profile_device(profile, cfg, transport, runs_dir, bench, log=log, sizes=sizes)
                            predictor = TablePredictor.load(path)
                            if table_read is not None:
                                table_read()
                        except LatencyModelError as e:   # measured only; the report then shows no prediction
                            log(f"select: {e}")
            timed = measure_models(transport, profile, models, example, bench, log=log)
            return {i: timed[i]["latency_ms"][key] for i, _, _ in models}, predictor, timed[None]
        except DeviceUnavailable as e:
            if predictor is None:
                aside = table_set_aside(profile, runs_dir)
                table = f"its latency table is not used ({aside})" if aside else "no latency table to predict from"
                raise UnreachableWithoutTable(f"{e}; {table} either: run `edgebayes devices profile {profile.name}` "
                                              f"while the device is reachable") from None
            log(f"select: {e}; latency {predictor.describe()}")
    return {i: None for i, _, _ in models}, predictor, None


def _measure_uncovered(uncovered, measured, measured_on, predictor, profile, transport, models, example, bench, log):
    """Candidates the latency table does not cover (TablePredictor.covers) are timed on the device when it can
    be used, instead of trusting an extrapolation; otherwise their prediction stays, marked. Returns the
    measured-on facts (the device's, if it measured anything)."""
    todo = [m for m in models if m[0] in uncovered and measured[m[0]] is None]
    if not uncovered:
        return measured_on
    why = sorted(set(uncovered.values()))
    log(f"select: {predictor.path.name} does not cover {len(uncovered)} of {len(models)} candidates "
        f"({'; '.join(why[:2])}{'; ...' if len(why) > 2 else ''})")
    if not todo:
        return measured_on
    try:
        timed = measure_models(transport, profile, todo, example, bench, log=log)
    except DeviceUnavailable as e:
        log(f"select: {e}; those {len(todo)} candidates keep the table's prediction, marked as not covered")
        return measured_on
    key = f"p{profile.budgets.percentile}"
    measured.update({i: timed[i]["latency_ms"][key] for i, _, _ in todo})
    log(f"select: measured those {len(todo)} candidates on {profile.name} instead")
    return measured_on or timed[None]


def score_candidates(model, cfg, profile, val_x, val_y, calib_x, transport, runs_dir, log=print, table_read=None):
    """Every (knob value, M, format) candidate with its validation metrics and device cost, the facts the
    runner measured on (or None) and each candidate's per-example terms on val (`per_example`, for `choose`).

    calib_x: training inputs that calibrate the int8 formats (as export calibrates the deployed one)."""
    from edgebayes.export.formats import export_artifact

    fmts = formats_for(profile, cfg.model.family)
    b = profile.budgets
    example = val_x[:1]
    batch = val_x[torch.arange(b.batch_size) % len(val_x)]
    values = cfg.select.knob_values
    if values is None and model.knob == "width" and cfg.train.flops_target is not None:
        # A nested net fitted to a FLOPs target ships the width its training made within it: the wider widths got
        # 1 - nested.target_width_probability of the steps, and one of them, ahead by a few thousandths of a nat,
        # shipped 0.40 of the FLOPs for a target of 0.3 with exit 0 (probe). Asked for by knob_values, they are tried.
        values = [model.default_knob]
        log(f"select: width {model.default_knob}, the training's within train.flops_target (the wider widths it "
            f"also served are tried where select.knob_values names them)")
    knobs = model.operating_points(values)
    untrained = getattr(model, "untrained_widths", lambda _: [])(knobs)   # nested nets (train/models.py)
    if untrained:   # a config's widths are written before a FLOPs target's width is known (all: check_select)
        knobs = [k for k in knobs if k not in untrained]
        log(f"select: width(s) {untrained} of select.knob_values left out: narrower than the narrowest width the "
            f"training served ({model.fixed_groups + 1} of {model.groups} groups), so never trained")
    grid = [(k, m) for k in knobs for m in sorted(cfg.select.mc_samples)]
    layout, refused_logged = cfg.export.layout, False
    candidates, models, evidence = [], [], {}
    # Inclusion thresholds that keep the same units give the same network (the samples' draws do not depend on
    # the threshold): scored once. After a FLOPs target every inclusion probability is near 0 or 1, and all do.
    same_network, first_of = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        progress = tqdm(total=len(grid) * len(fmts), desc="select", unit="candidate",
                        disable=not sys.stderr.isatty())   # a bar only on a terminal; select logs its result
        for knob_value, m in grid:
            try:
                compressed = compress(model, knob_value, m, cfg.seed, profile.runtime.channel_block)
            except EmptyLayerError as e:
                log(f"select: {e}; skipped")
                progress.update(len(fmts))
                continue
            if model.knob == "inclusion_threshold":
                key = (m, tuple(mask.numpy().tobytes() for mask in compressed.kept.values()))
                if key in first_of:
                    same_network.setdefault(first_of[key], []).append(knob_value)
                    progress.update(len(fmts))
                    continue
                first_of[key] = knob_value
            if compressed.not_pruned:
                log(f"select: {model.knob} {knob_value}, M={m}: {compressed.not_pruned}")
            if cfg.select.temperature_scaling:
                compressed.calibrate(val_x, val_y)
            mc_model = compressed.mc_model()
            kept_weights = sum(count_weights(s, fold_batch_norm=True) for s in compressed.samples)
            activations = activation_mb(compressed.samples[0], batch)
            for fmt in fmts:
                progress.update(1)
                ident = f"k{knob_value}-m{m}-{fmt.name}"
                details = {}
                try:
                    path = export_artifact(mc_model, fmt.name, Path(tmp) / f"{ident}{fmt.suffix}", val_x[:16],
                                           calib_x, cfg.export.opset, layout=layout, details=details)
                except (ImportError, RuntimeError, ValueError, NotImplementedError) as e:
                    raise SelectionError(f"device {profile.name}: cannot export format {fmt.name} here: {e}") from None
                if "packed_refused" in details and not refused_logged:
                    refused_logged = log(f"select: {details['packed_refused']}") or True
                probs, scored_as = _val_probs(fmt, path, mc_model, val_x)
                evidence[ident] = per_example(probs, val_y.numpy())
                candidates.append({
                    "id": ident, "knob": model.knob, "knob_value": knob_value, "mc_samples": m,
                    "format": fmt.name, "precision": fmt.precision, "runtime": fmt.runtime,
                    "temperature": compressed.temperature,
                    "layout": details["layout"], "packed_refused": details.get("packed_refused"),
                    "kept_units": {name: int(mask.sum()) for name, mask in compressed.kept.items()},
                    "not_pruned": compressed.not_pruned,
                    "val": classification_metrics(probs, val_y.numpy()), "val_scored_as": scored_as,
                    "cost": {"model_mb": path.stat().st_size / 1e6,
                             "flops": m * paper_flops(compressed.samples[0], val_x.shape[1:]),
                             "operators": operator_count(path), "kept_weights": kept_weights,
                             "activations_mb_per_sample": activations,
                             "runtime_weights_mb": (details["runtime_weight_bytes"] / 1e6
                                                    if "runtime_weight_bytes" in details else None)},
                })
                models.append((ident, path, fmt.runtime))
        progress.close()
        for first, same in same_network.items():
            log(f"select: {model.knob} {', '.join(f'{v:g}' for v in sorted(set(same)))} keep the same units as "
                f"{first:g}: that network is scored once")
        if not candidates:
            raise SelectionError(f"no candidate leaves a network (each {model.knob} removes a whole layer, or makes "
                                 f"the output the same for every input); change select.knob_values ({model.knob})")
        in_features = int(torch.tensor(val_x.shape[1:]).prod())
        measured, predictor, measured_on = _latencies(cfg, profile, transport, models, example.numpy(),
                                                      select_bench(cfg.benchmark), runs_dir, log, table_read,
                                                      sizes=(in_features, probs.shape[1]))
        uncovered = {} if predictor is None else {
            c["id"]: why for c in candidates
            if (why := predictor.covers(c["cost"]["operators"], c["cost"]["flops"], c["cost"]["kept_weights"],
                                        c["precision"], b.percentile, in_features, cfg.model.arch))}
        measured_on = _measure_uncovered(uncovered, measured, measured_on, predictor, profile, transport, models,
                                         example.numpy(), select_bench(cfg.benchmark), log)
    # The runtime's memory on the device: measured now, else as the latency table recorded it.
    runtime_memory = (measured_on or {}).get("memory") or getattr(predictor, "memory", None)
    for c in candidates:
        cost = c["cost"]
        try:
            by_percentile = None if predictor is None else {
                p: predictor.predict(cost["operators"], cost["flops"], cost["kept_weights"], c["precision"],
                                     int(p[1:]), b.batch_size) for p in PERCENTILES}
        except LatencyModelError as e:
            if measured[c["id"]] is None:
                raise SelectionError(str(e)) from None
            by_percentile = None
        predicted = None if by_percentile is None else by_percentile[f"p{b.percentile}"]
        cost["predicted_latency_ms"] = predicted
        cost["predicted_latency_ms_by_percentile"] = by_percentile
        cost["predicted_by"] = None if predictor is None else predictor.describe()
        cost["latency_model_has_table"] = None if predictor is None else predictor.has_table
        # the prediction's basis (table, spec sheet) and band, and why the table does not cover it (if so)
        cost["prediction_basis"] = None if predictor is None else predictor.basis
        cost["predicted_latency_band_ms"] = (None if predicted is None else
                                             predictor.band(predicted, c["precision"], b.percentile))
        cost["prediction_not_covered"] = uncovered.get(c["id"])
        estimate, lower_bound, parts = memory_estimate(cost["model_mb"], cost["activations_mb_per_sample"],
                                                       c["mc_samples"], runtime_memory, cost["runtime_weights_mb"])
        cost.update(memory_estimate_mb=estimate, memory_estimate_lower_bound=lower_bound, memory_parts_mb=parts,
                    deployed_memory_estimate_mb=deployed_estimate(parts))
        cost["measured_latency_ms"] = measured[c["id"]]
        if measured[c["id"]] is not None:
            cost["latency_ms"], cost["latency_source"] = measured[c["id"]], "measured"
        else:
            cost["latency_ms"], cost["latency_source"] = cost["predicted_latency_ms"], cost["predicted_by"]
        c["violations"] = violations(c, b, cfg.select.max_ece)
        c["fits"] = not c["violations"]
    mark_pareto(candidates)
    return candidates, measured_on, evidence


def _dominates(a, b):
    """a is at least as good as b on accuracy, latency and size, and better on one."""
    ka = (-a["val"]["accuracy"], a["cost"]["latency_ms"], a["cost"]["model_mb"])
    kb = (-b["val"]["accuracy"], b["cost"]["latency_ms"], b["cost"]["model_mb"])
    return all(x <= y for x, y in zip(ka, kb)) and ka != kb


def mark_pareto(candidates):
    """candidate["pareto"]: on the accuracy / latency / size front; ["pareto_latency"]: on accuracy / latency."""
    for c in candidates:
        c["pareto"] = not any(_dominates(o, c) for o in candidates)
        c["pareto_latency"] = not any(
            o["val"]["accuracy"] >= c["val"]["accuracy"] and o["cost"]["latency_ms"] <= c["cost"]["latency_ms"]
            and (o["val"]["accuracy"], o["cost"]["latency_ms"]) != (c["val"]["accuracy"], c["cost"]["latency_ms"])
            for o in candidates)


def choose(candidates, objective, budgets, max_ece=None, evidence=None, seed=0):
    """The cheapest fitting candidate tied with the best (module docstring, `tied_with`), with the reason;
    if none fits, the closest one with `fits` false and the reason listing the closest ones. Marks
    `tied_with_best` on every candidate."""
    fitting = [c for c in candidates if c["fits"]]
    key, why = objective_key(objective, max_ece)
    if not fitting:
        def excess(c):
            cost, total = c["cost"], float(len(c["violations"]))   # non-numeric violations count 1 each
            if budgets.latency_ms is not None:
                total += max(0.0, cost["latency_ms"] / budgets.latency_ms - 1)
            if budgets.model_mb is not None:
                total += max(0.0, cost["model_mb"] / budgets.model_mb - 1)
            if budgets.memory_mb is not None and cost.get("memory_estimate_mb") is not None:
                total += max(0.0, cost["memory_estimate_mb"] / budgets.memory_mb - 1)
            return total
        # A budget verdict, not a failure: the closest candidate stands as the choice, marked as not
        # fitting, so the pipeline reports every candidate against the budgets and exits 3. Among candidates as
        # close (an SQS net's rates share one dense graph, so one predicted latency), the objective's best
        closest = sorted(candidates, key=lambda c: (excess(c), *key(c)))
        lines = [f"  {c['knob']} {c['knob_value']}, M={c['mc_samples']}, {c['format']} ({c['precision']}; val "
                 f"accuracy {c['val']['accuracy']:.4f}): " + "; ".join(c["violations"]) for c in closest[:3]]
        for c in candidates:
            c["tied_with_best"] = False
        best = closest[0]
        return {"knob": best["knob"], "knob_value": best["knob_value"], "mc_samples": best["mc_samples"],
                "format": best["format"], "precision": best["precision"], "candidate": best, "fits": False,
                "reason": "no operating point fits the device budgets; closest candidates:\n" + "\n".join(lines),
                "best_by_objective": None, "tied": []}
    best = min(fitting, key=lambda c: (*key(c), c["cost"]["latency_ms"]))
    tied = tied_with(best, fitting, evidence, seed)
    for c in candidates:
        c["tied_with_best"] = c["id"] in tied
    # The cheapest of the tied: fewest MC samples, then the lowest latency (within the measurement's
    # noise), then the smallest file.
    fewest = [c for c in tied.values() if c["mc_samples"] == min(t["mc_samples"] for t in tied.values())]
    fastest = min(c["cost"]["latency_ms"] for c in fewest)
    chosen = min((c for c in fewest if c["cost"]["latency_ms"] <= (1 + SAME_LATENCY) * fastest),
                 key=lambda c: (c["cost"]["model_mb"], c["cost"]["latency_ms"]))
    n = best["val"].get("n")
    if len(tied) == 1:
        reason = f"{why}; no other candidate within the validation split's noise of it"
    else:
        names = ", ".join(t for t in tied if t != chosen["id"])
        how = f"paired bootstrap over {n} images, {TIE_LEVEL:.0%}" if evidence else "identical figures"
        reason = (f"the best by {why} is {best['id']}; {len(tied)} candidates are within the validation split's "
                  f"noise of it ({how}) and the cheapest wins: fewest MC samples, then latency (within "
                  f"{SAME_LATENCY:.0%}), then the smaller file; tied with the chosen: {names}")
    reason += f"; among {len(fitting)} of {len(candidates)} candidates within the budgets"
    return {"knob": chosen["knob"], "knob_value": chosen["knob_value"], "mc_samples": chosen["mc_samples"],
            "format": chosen["format"], "precision": chosen["precision"], "reason": reason, "candidate": chosen,
            "fits": True, "best_by_objective": best["id"], "tied": list(tied)}


def objective_key(objective, max_ece=None):
    """(a sort key, best first, on a candidate's validation figures; what it means in words)."""
    if objective in ("accuracy", "ece-constrained-accuracy"):
        return ((lambda c: (-c["val"]["accuracy"], c["val"]["nll"])),
                "highest validation accuracy" + (f" with val ECE <= {max_ece}" if max_ece is not None else ""))
    return (lambda c: (c["val"]["nll"],)), "lowest validation NLL"


def tied_with(best, candidates, evidence=None, seed=0):
    """{id: candidate} of the candidates the validation split cannot tell from `best` (itself included):
    none is worse than it on accuracy, NLL or ECE beyond noise. With `evidence` (score_candidates' per-
    example terms), from a bootstrap over the validation images, the same resamples for every candidate:
    a candidate is worse on a metric when both (a) the paired TIE_LEVEL interval of (its metric - best's)
    lies wholly on the worse side of 0, and (b) the difference exceeds MIN_DIFFERENCE, a margin of practical
    equivalence. (a) alone would call a consistent 1e-10 of NLL between two files of one sample a difference.
    (b) is a fixed margin, not the noise of the best's own figure (the half-width of its unpaired interval):
    that one ignores what pairing removes (the images' shared difficulty) and, on a small split, tied a
    candidate 2 points of accuracy worse that the paired interval told apart (288 images: M = 2 shipped
    against the M = 4 the budget allowed, with a worse test NLL and ECE). Without evidence (candidates of
    another origin) only identical figures tie."""
    metrics = ("accuracy", "nll", "ece")
    if not evidence or any(c["id"] not in evidence for c in (best, *candidates)):
        return {c["id"]: c for c in candidates if all(c["val"][k] == best["val"][k] for k in metrics)}
    n_bins = 15

    def features(ident):   # n x (2 + bins): correct, nll, (correct - confidence) in its bin
        correct, nll, bins, gap = evidence[ident]
        binned = np.zeros((len(correct), n_bins))
        binned[np.arange(len(correct)), bins] = gap
        return np.column_stack([correct, nll, binned])

    def scores(sums):      # resamples x 3: accuracy, nll, ece
        return np.column_stack([sums[:, 0], sums[:, 1], np.abs(sums[:, 2:]).sum(axis=1)])

    n = len(evidence[best["id"]][0])
    rng = np.random.default_rng(seed)
    feats = {c["id"]: features(c["id"]) for c in candidates}
    feats.setdefault(best["id"], features(best["id"]))
    diffs = {ident: [] for ident in feats}
    for start in range(0, BOOTSTRAP_RESAMPLES, 100):    # 100 resamples at a time: memory n x 100
        idx = rng.integers(0, n, size=(min(100, BOOTSTRAP_RESAMPLES - start), n))
        weights = np.stack([np.bincount(row, minlength=n) for row in idx]).astype(np.float64) / n
        ref = scores(weights @ feats[best["id"]])
        for ident, f in feats.items():
            diffs[ident].append(scores(weights @ f) - ref)
    tail = 100 * (1 - TIE_LEVEL) / 2
    sign = np.array([-1.0, 1.0, 1.0])                      # worse: accuracy lower; NLL, ECE higher
    observed = {c["id"]: np.array([c["val"][k] - best["val"][k] for k in metrics]) for c in candidates}
    tied = {}
    for c in candidates:
        d = np.concatenate(diffs[c["id"]]) * sign
        # worse: the split tells them apart (the paired interval lies above 0) by more than a negligible gap
        worse = (np.percentile(d, tail, axis=0) > 0) & (observed[c["id"]] * sign > MIN_DIFFERENCE)
        if not worse.any():
            tied[c["id"]] = c
    tied.setdefault(best["id"], best)
    return tied
