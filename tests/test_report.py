"""Tests for edgebayes.deploy.report (loaded from its file so no install is needed)."""

import base64
import copy
import importlib.util
import json
import math
import os
import random
import re
from pathlib import Path

import pytest

REPORT_PY = Path(__file__).resolve().parents[1] / "src" / "edgebayes" / "deploy" / "report.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load():
    spec = importlib.util.spec_from_file_location("edgebayes_report_under_test", REPORT_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


report_mod = _load()


def _candidate(t, m, acc, lat, fits, violations=()):
    return {"knob": "inclusion_threshold", "knob_value": t, "mc_samples": m,
            "val": {"accuracy": acc, "nll": 0.12 + 0.01 * m, "ece": 0.03, "n": 360},
            "cost": {"latency_ms": lat, "latency_source": "measured", "model_mb": 0.02 * m,
                     "flops": 12345 * m, "kept_weights": 3000},
            "fits": fits, "violations": list(violations)}


def make_inputs():
    """A realistic run: 6 candidates, two of them over the latency budget."""
    history = [{"epoch": e, "loss": 2.3 / e, "nll": 2.2 / e, "kl": 0.1, "val_accuracy": min(0.97, 0.5 + 0.05 * e),
                "kept_nodes": [64 - 2 * e, 64 - 3 * e]} for e in range(1, 11)]
    rng = random.Random(0)  # right-skewed like real latencies
    samples = [0.03 + rng.lognormvariate(math.log(0.01), 0.6) for _ in range(1000)]
    return {
        "run_name": "digits-ssgl",
        "device": {"name": "local", "runtime": "onnxruntime",
                   "budgets": {"latency_ms": 5.0, "percentile": 90, "batch_size": 1,
                               "memory_mb": 512.0, "model_mb": 10.0}},
        "train": {
            "family": "ss-gl", "model": {"arch": "mlp", "in_features": 64, "hidden": [64, 64], "classes": 10},
            "epochs": 150,
            "test": {"accuracy": 0.97, "nll": 0.1, "ece": 0.02, "brier": 0.05, "n": 360, "mc_samples": 10},
            "sparsity": {"layers": [{"name": "hidden1", "kept": 40, "total": 64},
                                    {"name": "hidden2", "kept": 30, "total": 64},
                                    {"name": "output", "kept": 10, "total": 10}]},
            "compression_ratio": 0.45, "flops_ratio": 0.46, "history": history,
        },
        "candidates": [
            _candidate(0.3, 1, 0.950, 0.02, True),
            _candidate(0.3, 4, 0.958, 0.06, True),
            _candidate(0.5, 4, 0.960, 0.05, True),
            _candidate(0.5, 16, 0.962, 7.1, False, ["latency_ms 7.1 > budget 5.0"]),
            _candidate(0.7, 1, 0.940, 0.015, True),
            _candidate(0.7, 32, 0.955, 12.0, False, ["latency_ms 12.0 > budget 5.0", "model_mb 11 > budget 10.0"]),
        ],
        "objective": "accuracy",
        "choice": {"knob": "inclusion_threshold", "knob_value": 0.5, "mc_samples": 4,
                   "reason": "highest val accuracy among 4 of 6 candidates within budget; "
                             "ties broken by NLL then latency"},
        "export": {"onnx_params": 12000, "kept_weights_total": 12000, "kept_weights_per_sample": 3000,
                   "fidelity_max_abs_prob_diff": 3e-7, "model_bytes": 50000, "format": "onnx", "precision": "fp32"},
        "results": {
            "runtime": {"name": "onnxruntime", "version": "1.31.1", "providers": ["CPUExecutionProvider"],
                        "threads": 0},
            "device": {"hostname": "h", "platform": "Linux-6.1-x86_64", "machine": "x86_64", "processor": "",
                       "python": "3.11.7", "cpu_count": 2, "numpy": "2.4.6"},
            "latency_ms": {"p50": 0.04, "p90": 0.05, "p99": 0.08, "mean": 0.045, "min": 0.03, "max": 0.2},
            "latency_samples_ms": samples,
            "runs": 1000, "seconds": 2.0, "warmup": 10, "batch_size": 1, "throughput_per_s": 20000.0,
            "peak_rss_mb": 80.0,
            "metrics": {"accuracy": 0.9694, "nll": 0.1012, "ece": 0.021, "brier": 0.0501, "n": 360},
            "reference": {"accuracy": 0.9722, "nll": 0.1, "ece": 0.02, "brier": 0.05, "n": 360},
            "max_abs_prob_diff": 2e-7,
        },
        "reliability": {"bin_confidence": [None] * 10 + [0.72, 0.79, 0.86, 0.93, 0.99],
                        "bin_accuracy": [None] * 10 + [0.6, 0.75, 0.85, 0.95, 0.99],
                        "bin_count": [0] * 10 + [5, 8, 15, 40, 292]},
        "provenance": {"git_commit": "abc1234", "config_hash": "sha256:deadbeef",
                       "versions": {"torch": "2.9.0", "onnxruntime": "1.31.1"},
                       "machine": {"hostname": "trainbox", "gpu": "none"}, "created_at": "2025-01-01T00:00:00Z"},
    }


def _images(html_text):
    return re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html_text)


def test_full_report(tmp_path):
    inputs = make_inputs()
    original = copy.deepcopy(inputs)
    rep = report_mod.write_report(inputs, tmp_path)
    assert inputs == original  # the caller's dict is not mutated

    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk == rep
    for key in original:  # inputs verbatim beside the summary
        assert on_disk[key] == original[key]

    s = on_disk["summary"]
    assert s["device"] == "local"
    assert s["knob"] == "inclusion_threshold" and s["knob_value"] == 0.5 and s["mc_samples"] == 4
    assert s["pruned_fraction_hidden"] == pytest.approx(1 - 70 / 128)
    assert s["metrics"]["accuracy"]["device"] == 0.9694
    assert s["metrics"]["accuracy"]["reference"] == 0.9722
    assert s["metrics"]["accuracy"]["diff"] == pytest.approx(0.9694 - 0.9722)
    assert s["metrics"]["nll"]["diff"] == pytest.approx(0.0012)
    assert s["latency_ms"] == {"p50": 0.04, "p90": 0.05, "p99": 0.08}
    assert s["latency_stat"] == "p90" and s["latency_at_percentile_ms"] == 0.05
    assert {k: v["verdict"] for k, v in s["budgets"].items()} == {
        "latency_ms": "pass", "memory_mb": "pass", "model_mb": "pass"}
    assert s["budgets"]["model_mb"]["measured"] == pytest.approx(0.05)
    assert s["overall_verdict"] == "pass"
    assert s["params_match"] is True
    assert s["compression_ratio"] == 0.45 and s["flops_ratio"] == 0.46
    assert s["onnx_params"] == 12000 and s["kept_weights_total"] == 12000
    assert s["fidelity_max_abs_prob_diff"] == 3e-7
    lo, hi = s["accuracy_ci95"]
    assert lo < 0.9694 < hi
    assert s["warnings"] == []

    html_text = (tmp_path / "report.html").read_text()
    assert "edgebayes report: digits-ssgl on local" in html_text
    assert "digits-ssgl" in html_text and "0.5" in html_text
    imgs = _images(html_text)
    assert len(imgs) >= 3
    for b64 in imgs:
        assert base64.b64decode(b64).startswith(PNG_MAGIC)
    for name in ("tradeoff.png", "sparsity.png", "latency_hist.png", "reliability.png", "training.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG_MAGIC), name
    assert 'class="chosen"' in html_text  # chosen candidate row highlighted
    assert "http://" not in html_text and "https://" not in html_text and "<script" not in html_text
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "report.json").stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600


def test_latency_fails_memory_passes_and_params_mismatch(tmp_path):
    inputs = make_inputs()
    inputs["device"]["budgets"]["latency_ms"] = 0.045  # p90 = 0.05 > 0.045
    inputs["device"]["budgets"]["percentile"] = 99      # judged at p99 = 0.08
    inputs["results"]["peak_rss_mb"] = 300.0           # < 512
    inputs["export"]["onnx_params"] = 12001
    s = report_mod.write_report(inputs, tmp_path)["summary"]
    assert s["latency_stat"] == "p99" and s["latency_at_percentile_ms"] == 0.08
    assert s["budgets"]["latency_ms"]["verdict"] == "fail"
    assert s["budgets"]["memory_mb"]["verdict"] == "pass"
    assert s["budgets"]["model_mb"]["verdict"] == "pass"
    assert s["overall_verdict"] == "fail"
    assert s["params_match"] is False
    assert any("12001" in w for w in s["warnings"])
    html_text = (tmp_path / "report.html").read_text()
    assert 'class="badge fail"' in html_text and 'class="badge pass"' in html_text


def test_a_training_that_lost_the_trained_network_is_among_the_warnings():
    inputs = make_inputs()
    inputs["train"]["history"][-1]["accuracy_lost"] = "validation accuracy fell from 0.905 to 0.276"
    s = report_mod._summarize(report_mod._jsonable(inputs))
    assert "Validation accuracy fell from 0.905 to 0.276." in s["warnings"]


def test_a_shipped_network_above_its_flops_target_is_among_the_warnings():
    inputs = make_inputs()
    inputs["export"]["flops_target_exceeded"] = "the shipped network has 0.297 of the dense FLOPs"
    s = report_mod._summarize(report_mod._jsonable(inputs))
    assert "The shipped network has 0.297 of the dense FLOPs." in s["warnings"]


def test_percentile_not_reported_uses_next_higher():
    inputs = make_inputs()
    inputs["device"]["budgets"]["percentile"] = 95
    s = report_mod._summarize(report_mod._jsonable(inputs))
    assert s["latency_stat"] == "p99"
    assert any("p95" in w for w in s["warnings"])


def test_html_escaping(tmp_path):
    inputs = make_inputs()
    inputs["run_name"] = "<script>alert('x')</script>"
    inputs["candidates"][3]["violations"] = ["latency <b>7.1</b> > 5"]
    rep = report_mod.write_report(inputs, tmp_path)
    html_text = (tmp_path / "report.html").read_text()
    assert "<script>" not in html_text
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in html_text
    assert "<b>7.1</b>" not in html_text
    assert rep["run_name"] == "<script>alert('x')</script>"  # JSON keeps the raw value


def test_missing_optional_parts(tmp_path):
    inputs = make_inputs()
    del inputs["train"]["history"]
    del inputs["results"]["latency_samples_ms"]
    del inputs["reliability"]
    del inputs["provenance"]
    inputs["device"]["budgets"] = {"latency_ms": None, "percentile": 90, "memory_mb": None}
    inputs["export"].pop("onnx_params")
    rep = report_mod.write_report(inputs, tmp_path / "nested" / "out")
    out = tmp_path / "nested" / "out"
    s = json.loads((out / "report.json").read_text())["summary"]
    assert s == rep["summary"]
    assert {k: v["verdict"] for k, v in s["budgets"].items()} == {
        "latency_ms": "not set", "memory_mb": "not set", "model_mb": "not set"}
    assert s["overall_verdict"] == "not set"
    assert s["params_match"] is None
    html_text = (out / "report.html").read_text()
    assert "n/a" in html_text
    assert len(_images(html_text)) == 3  # trade-off, accuracy/ECE vs knob and sparsity only
    assert not (out / "training.png").exists() and not (out / "reliability.png").exists()
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


def test_minimal_inputs(tmp_path):
    """Only a run name and a device: nothing to plot, but a report is still written."""
    rep = report_mod.write_report({"run_name": "bare", "device": {"name": "pi"}}, tmp_path)
    assert rep["summary"]["pruned_fraction_hidden"] is None
    assert rep["summary"]["metrics"]["accuracy"] == {"device": None, "reference": None, "diff": None}
    assert "edgebayes report: bare on pi" in (tmp_path / "report.html").read_text()


def test_numpy_and_nan_values_give_strict_json(tmp_path):
    np = pytest.importorskip("numpy")
    inputs = make_inputs()
    inputs["results"]["latency_samples_ms"] = np.asarray(inputs["results"]["latency_samples_ms"])
    inputs["results"]["peak_rss_mb"] = np.float64(80.0)
    inputs["export"]["onnx_params"] = np.int64(12000)
    inputs["results"]["metrics"]["ece"] = float("nan")
    rep = report_mod.write_report(inputs, tmp_path)
    text = (tmp_path / "report.json").read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert rep["summary"]["params_match"] is True
    assert rep["summary"]["metrics"]["ece"]["device"] is None
    assert math.isclose(rep["summary"]["budgets"]["memory_mb"]["measured"], 80.0)


def test_failed_write_leaves_no_temp_files(tmp_path, monkeypatch):
    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        report_mod.write_report(make_inputs(), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_latency_prediction_error_of_the_chosen_point(tmp_path):
    inputs = make_inputs()
    for c in inputs["candidates"]:
        c["cost"]["predicted_latency_ms"] = 1.1 * c["cost"]["latency_ms"]
        c["cost"]["measured_latency_ms"] = c["cost"]["latency_ms"]
        c["cost"]["predicted_by"] = "predicted (table fit, latency_table.json)"
    inputs["candidates"][0]["pareto"] = inputs["candidates"][2]["pareto"] = True
    rep = report_mod.write_report(inputs, tmp_path)
    lp = rep["summary"]["latency_prediction"]
    # chosen: threshold 0.5, M=4 -> predicted 1.1 x 0.05 ms; measured on device: p90 0.05 ms
    assert lp["predicted_ms"] == pytest.approx(0.055) and lp["measured_ms"] == 0.05
    assert lp["error"] == pytest.approx(0.1) and lp["abs_error"] == pytest.approx(0.1)
    html_text = (tmp_path / "report.html").read_text()
    assert "+10.0 %" in html_text and "Pareto" in html_text
    assert (tmp_path / "latency_prediction.png").read_bytes().startswith(PNG_MAGIC)
    assert (tmp_path / "knob.png").read_bytes().startswith(PNG_MAGIC)
    assert rep["summary"]["pareto"] == ["inclusion threshold 0.3, M=1", "inclusion threshold 0.5, M=4"]


def test_an_accuracy_no_better_than_the_majority_class_is_warned(tmp_path):
    """On an imbalanced test split (79:1) always answering the frequent class scores 0.9875: an accuracy of 0.97
    reads as good and is worse than that."""
    inputs = make_inputs()
    inputs["export"]["test_class_counts"] = [356, 4] + [0] * 8
    inputs["export"]["classes"] = ["ok <part>", "defect"] + [f"c{i}" for i in range(8)]
    rep = report_mod.write_report(inputs, tmp_path / "a")
    assert "ok &lt;part&gt; (356), defect (4), c0 (0)" in (tmp_path / "a" / "report.html").read_text()
    said = [w for w in rep["summary"]["warnings"] if "most frequent class" in w]
    assert said == ["The accuracy (0.9694) is no better than always answering the test split's most frequent class "
                    "(356 of its 360 examples, 0.9889); on so imbalanced a split the NLL and ECE say more than the "
                    "accuracy."]
    inputs["export"]["test_class_counts"] = [36] * 10
    rep = report_mod.write_report(inputs, tmp_path / "b")
    assert not any("most frequent class" in w for w in rep["summary"]["warnings"])

def test_identical_posterior_samples_in_the_shipped_graph_are_warned(tmp_path):
    """SQS at the paper's tau: its level probabilities are one-hot, every draw the same network; an M = 4 graph
    then costs 4x one sample and averages nothing (probe)."""
    inputs = make_inputs()
    m = inputs["choice"]["mc_samples"]
    inputs["export"]["distinct_samples"] = 1
    said = [w for w in report_mod.write_report(inputs, tmp_path / "a")["summary"]["warnings"] if "differ" in w]
    assert said == [f"Only 1 of the M = {m} posterior samples in the shipped graph differ: the MC average repeats "
                    f"the same network, at {m}x the cost of M = 1, and its uncertainty is that of 1 network(s)."]
    inputs["export"]["distinct_samples"] = m
    assert not any("differ" in w for w in report_mod.write_report(inputs, tmp_path / "b")["summary"]["warnings"])


def test_candidates_name_their_format_and_the_fidelity_line_the_rule_the_artifact_passed(tmp_path):
    """An fp16 and an fp32 candidate of one point differed only in MB; an fp16 point's fidelity read
    '6.57e-04 (tolerance 1.00e-04)', a failure to the eye, for a point that passed its own rule (probe)."""
    inputs = make_inputs()
    inputs["candidates"][0]["format"], inputs["candidates"][0]["precision"] = "onnx-fp16w", "fp16"
    rule = "accuracy >= 0.9500 (PyTorch MC accuracy - 0.01)"
    inputs["choice"]["format"] = "onnx"
    inputs["export"]["artifacts"] = {"onnx": {"fidelity": {"check": {"rule": rule, "passed": True}}}}
    report_mod.write_report(inputs, tmp_path)
    html_text = (tmp_path / "report.html").read_text()
    assert "format (precision)" in html_text and "onnx-fp16w (fp16)" in html_text
    assert "(passed by accuracy &gt;= 0.9500 (PyTorch MC accuracy - 0.01))" in html_text


def test_a_family_without_a_knob_is_reported_as_one_network(tmp_path):
    """dnn and bnn have no inclusion variables: their one network is not 'inclusion threshold 0.5', and select
    sweeps one point whatever select.knob_values (written for ss-gl) says."""
    from edgebayes.config import PriorConfig
    from edgebayes.train.models import BayesianNet

    for family, knob in (("bnn", "none"), ("dnn", "none"), ("ss-gl", "inclusion_threshold")):
        net = BayesianNet("mlp", family, PriorConfig(), (8,), 3, 100, hidden=[4])
        assert net.knob == knob
        assert net.operating_points([0.5, 0.7, 0.9]) == ([0.5] if knob == "none" else [0.5, 0.7, 0.9])
    inputs = make_inputs()
    inputs["train"]["family"] = "bnn"
    inputs["candidates"] = [c for c in inputs["candidates"] if c["knob_value"] == 0.5]
    for c in inputs["candidates"] + [inputs["choice"]]:
        c["knob"] = "none"
    rep = report_mod.write_report(inputs, tmp_path)
    html_text = (tmp_path / "report.html").read_text()
    assert "every unit kept, M = 4" in html_text and "inclusion threshold" not in html_text
    assert "against the knob" not in html_text and not (tmp_path / "knob.png").exists()
    line = next(l for l in report_mod.summary_text(report_mod.terminal_summary(rep), 0) if "chosen point" in l)
    assert "every unit kept, M=4" in line and "0.5" not in line


# ---------------------------------------------------------------------------------------------
# issue 22: units, tail and memory figures, predicted reports, the comparison page, the summary block
# ---------------------------------------------------------------------------------------------
def test_units_fit_latencies_and_sizes_are_in_one_unit(tmp_path):
    inputs = make_inputs()
    inputs["export"]["artifacts"] = {"onnx": {"precision": "fp32", "layout": "packed", "bytes": 50000,
                                              "fidelity": {"accuracy": 0.97, "nll": 0.1, "ece": 0.02,
                                                           "max_abs_prob_diff": 1e-7, "reference": {},
                                                           "check": {"passed": True, "rule": "ok"}}}}
    report_mod.write_report(inputs, tmp_path)
    html_text = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", (tmp_path / "report.html").read_text())
    assert "40 µs" in html_text and "50 µs" in html_text          # p50, p90 of 0.04 / 0.05 ms
    assert "0.04 ms" not in html_text and "KiB" not in html_text
    assert report_mod.fmt_ms(0.007831) == "7.83 µs" and report_mod.fmt_ms(2.789) == "2.789 ms"
    assert report_mod.fmt_ms(0.007831, ascii_only=True) == "7.83 us"


def test_histogram_axis_is_on_the_data_not_on_a_far_tail():
    xs = sorted([0.008 + 0.0001 * (i % 50) for i in range(5000)] + [4.2, 3.9])
    lo, hi, pad = report_mod._hist_window(xs)
    assert lo == 0.008 and hi < 0.02 and pad < 0.001          # the two slow runs are named, not plotted


def test_tail_cold_start_memory_and_uncertainty_in_the_summary(tmp_path):
    inputs = make_inputs()
    r = inputs["results"]
    r["latency_ms_best_round"] = {"p50": 0.035, "p90": 0.04, "p99": 0.05}
    r["cold_start"] = {"session_create_ms": 4.0, "first_inference_ms": 0.6, "engine_build_ms": None}
    r["memory"] = {"runtime_baseline_mb": 50.0, "model_mb": 12.0, "deployed_mb": 62.0, "batch_size": 1}
    r["ood"] = {"auroc": 0.98, "aupr": 0.97, "score": "predictive entropy", "n_in": 360, "n_out": 360}
    r["selective"] = {"rejected": [0.0, 0.1, 0.2, 0.5], "accuracy": [0.96, 0.98, 0.99, 1.0], "kept": [360, 324, 288, 180]}
    # memory_mb judges the model's own memory: the runner's 12 MB less the runtime's 9 MB set-up (issue 21).
    inputs["candidates"][2]["cost"].update(memory_estimate_mb=2.9, memory_estimate_lower_bound=False,
                                           memory_parts_mb={"runtime_baseline_mb": 50.0, "runtime_setup_mb": 9.0})
    rep = report_mod.write_report(inputs, tmp_path)
    s = rep["summary"]
    assert s["budgets"]["memory_mb"]["measured"] == 3.0 and s["budgets"]["memory_mb"]["verdict"] == "pass"
    assert "subtracted: 9.00 MB of runtime set-up" in s["budgets"]["memory_mb"]["measured_as"]
    assert s["memory"]["estimate_error"] == pytest.approx(2.9 / 3 - 1)
    assert s["ood"]["auroc"] == 0.98 and s["latency_max_ms"] == 0.2
    assert s["latency_ms_best_round"]["p90"] == 0.04
    html_text = (tmp_path / "report.html").read_text()
    for text in ("OOD AUROC", "best round (undisturbed device)", "cold start: session creation", "4 ms",
                 "runtime baseline", "estimate error", "-3.3 %", "runtime set-up subtracted", "accuracy with the 20 % most uncertain rejected"):
        assert text in html_text, text
    assert (tmp_path / "selective.png").read_bytes().startswith(PNG_MAGIC)
    t = report_mod.terminal_summary(rep, tmp_path / "report.html")
    assert t["ood_auroc"] == 0.98 and t["memory_model_mb"] == 12.0 and t["latency_ms"]["max"] == 0.2
    lines = report_mod.summary_text(t, 0)
    assert lines[0] == "summary: digits-ssgl on local (measured)"
    assert any(line.startswith("  latency       p50 40 us, p90 50 us, p99 80 us, max 200 us") for line in lines)
    assert lines[-2] == "  verdict       pass, exit code 0"


def predicted_inputs(has_table=True):
    inputs = make_inputs()
    here = {k: inputs["results"][k] for k in ("metrics", "reference", "max_abs_prob_diff")}
    here["ood"] = {"auroc": 0.95, "aupr": 0.9}
    inputs["results"] = None
    inputs["predicted"] = {"reason": "device pi: host unreachable", "here": here,
                           "finish": ["scp -r bundle pi:edgebayes/", "ssh pi 'cd edgebayes && python3 bundle/runner.pyz'",
                                      "edgebayes report --config pipeline.yaml --device pi --results results.json"]}
    cost = inputs["candidates"][2]["cost"]
    cost.update(predicted_latency_ms=0.3, predicted_latency_ms_by_percentile={"p50": 0.2, "p90": 0.3, "p99": 0.4},
                predicted_by="predicted (table fit, pi.json)" if has_table else "predicted (FLOPs / declared throughput)",
                latency_model_has_table=has_table, memory_estimate_mb=700.0, memory_estimate_lower_bound=False)
    return inputs


def test_a_predicted_report_says_what_is_predicted(tmp_path):
    rep = report_mod.write_report(predicted_inputs(), tmp_path)
    s = rep["summary"]
    assert s["mode"] == "predicted" and s["metrics_measured_on"] == "this machine"
    assert s["budgets"]["latency_ms"] | {} == {**s["budgets"]["latency_ms"], "measured": 0.3, "basis": "predicted",
                                               "verdict": "pass"}
    # an estimate over the budget: likely fail, not fail (nor pass under it: it is not a measurement)
    assert s["budgets"]["memory_mb"]["measured"] == 700.0 and s["budgets"]["memory_mb"]["verdict"] == "likely fail"
    assert s["overall_verdict"] == "likely fail" and s["ood"]["auroc"] == 0.95
    assert s["latency_prediction"]["measured_ms"] is None and s["latency_prediction"]["error"] is None
    html_text = (tmp_path / "report.html").read_text()
    assert "on local (predicted)" in html_text and "PREDICTED, not measured on the device" in html_text
    assert "--device pi --results results.json" in html_text and "overall (predicted): likely fail" in html_text
    t = report_mod.terminal_summary(rep)
    assert t["mode"] == "predicted" and t["latency_ms"] == {"p50": 0.2, "p90": 0.3, "p99": 0.4}


def test_a_predicted_report_over_a_measured_one_leaves_none_of_its_figures(tmp_path):
    """A board measured before and unreachable now: the measured report's latency histogram must not stay
    beside the report of predictions, as if it were this run's; a file the user put there stays."""
    report_mod.write_report(make_inputs(), tmp_path)
    measured = {p.name for p in tmp_path.glob("*.png")}
    (tmp_path / "mine.png").write_bytes(b"user's")
    report_mod.write_report(predicted_inputs(), tmp_path)
    left = {p.name for p in tmp_path.glob("*.png")}
    assert "latency_hist.png" in measured - left and "mine.png" in left
    assert left - {"mine.png"} <= measured


@pytest.mark.parametrize("band, verdict", [([0.15, 0.9], "likely pass"), ([5.5, 9.0], "likely fail"),
                                           ([0.15, 6.0], "unknown")])
def test_a_board_without_a_latency_table_gets_the_spec_sheet_estimate_with_its_band(band, verdict, tmp_path):
    """Issue 35: no n/a for a board never profiled; its spec-sheet estimate is judged with its band against the
    5 ms budget, and the same figure and basis are in the summary, the terminal and the page."""
    inputs = predicted_inputs(has_table=False)
    inputs["candidates"][2]["cost"].update(prediction_basis="spec sheet", predicted_latency_band_ms=band,
                                           predicted_by="estimated from the spec sheet")
    rep = report_mod.write_report(inputs, tmp_path)
    s = rep["summary"]
    assert s["latency_predicted_ms"] == {"p50": 0.2, "p90": 0.3, "p99": 0.4}
    assert s["budgets"]["latency_ms"]["verdict"] == verdict and s["budgets"]["latency_ms"]["measured"] == 0.3
    assert s["latency_prediction"]["band_ms"] == band and "estimated from the spec sheet" in s["latency_prediction"]["basis_text"]
    assert any("has no latency table" in w and "edgebayes devices profile local" in w for w in s["warnings"])
    lines = report_mod.summary_text(report_mod.terminal_summary(rep), 4)
    latency = next(line for line in lines if line.startswith("  latency "))
    assert "p90 300 us" in latency and "estimated from the spec sheet, band" in latency
    assert f"budget        latency 300 us <= 5 ms: {verdict}" in "\n".join(lines)
    inputs["device"]["budgets"]["latency_ms"] = 0.25   # a prediction over the budget says so, whatever the verdict
    lines = report_mod.summary_text(report_mod.terminal_summary(report_mod.write_report(inputs, tmp_path / "o")), 4)
    assert re.search(r"budget        latency 300 us > 250 us: (likely fail|unknown)", "\n".join(lines))
    assert report_mod.terminal_summary(rep)["finish"] == inputs["predicted"]["finish"]   # --json has the steps
    assert "  to finish     1. scp -r bundle pi:edgebayes/" in lines and lines[-1].startswith("                3. ")
    page = (tmp_path / "report.html").read_text()
    assert "No latency table for local" in page and f"latency 300 µs / 5 ms: {verdict}" in page
    assert "Source: not given in the profile" in page    # a profile's latency_model.source is named there


def test_a_table_that_does_not_cover_the_chosen_point_says_so(tmp_path):
    inputs = predicted_inputs()
    inputs["candidates"][2]["cost"]["prediction_not_covered"] = "it was measured with 64 input features, this model has 784"
    rep = report_mod.write_report(inputs, tmp_path)
    assert any("does not cover the chosen point" in w and "784" in w for w in rep["summary"]["warnings"])
    assert "NOT COVERED by the table" in rep["summary"]["latency_prediction"]["basis_text"]
    assert "does not cover the chosen point: it was measured with 64 input features" in (tmp_path / "report.html").read_text()


def test_a_lower_bound_memory_estimate_cannot_pass(tmp_path):
    inputs = predicted_inputs()
    inputs["candidates"][2]["cost"].update(memory_estimate_mb=0.3, memory_estimate_lower_bound=True)
    s = report_mod.write_report(inputs, tmp_path)["summary"]
    assert s["budgets"]["memory_mb"]["verdict"] == "n/a" and "lower bound" in s["budgets"]["memory_mb"]["measured_as"]


@pytest.mark.parametrize("estimate, lower, verdict", [(0.3, False, "likely pass"), (700.0, False, "likely fail"),
                                                      (0.3, True, "n/a"), (700.0, True, "fail")])
def test_an_estimated_memory_is_judged_as_an_estimate(estimate, lower, verdict, tmp_path):
    """A board not reached: selection's memory estimate is no measurement (a probe's was 84% below the runner's
    figure), so under the budget it is a likely pass, not a pass; a lower bound over the budget fails for sure."""
    inputs = predicted_inputs()
    inputs["candidates"][2]["cost"].update(memory_estimate_mb=estimate, memory_estimate_lower_bound=lower)
    s = report_mod.write_report(inputs, tmp_path)["summary"]
    assert s["budgets"]["memory_mb"]["verdict"] == verdict


def test_comparison_page(tmp_path):
    measured = report_mod.write_report(make_inputs(), tmp_path / "local")
    predicted = report_mod.write_report(predicted_inputs(), tmp_path / "pi")
    predicted["summary"]["device"] = "pi"
    data = report_mod.write_comparison([(measured, tmp_path / "local/report.html"),
                                        (predicted, tmp_path / "pi/report.html")], tmp_path)
    assert [r["device"] for r in data["devices"]] == ["local", "pi"]
    assert [r["mode"] for r in data["devices"]] == ["measured", "predicted"]
    html_text = (tmp_path / "devices.html").read_text()
    assert "href='local/report.html'" in html_text and "href='pi/report.html'" in html_text
    assert "50 µs" in html_text and "300 µs" in html_text     # p90 measured / predicted, each device's own
    # the predicted row's percentiles are not a measured spread, and its memory is an estimate (probe)
    assert "200 µs / 300 µs / 400 µs (predicted)" in html_text and "40 µs / 50 µs / 80 µs (" not in html_text
    assert "memory MB (predicted rows: estimated)" in html_text
    assert (tmp_path / "devices.png").read_bytes().startswith(PNG_MAGIC)
    assert json.loads((tmp_path / "devices.json").read_text()) == json.loads(json.dumps(data))


def test_every_user_supplied_name_is_escaped_on_both_pages(tmp_path):
    """The templates autoescape: a tag in a run, device, knob, artifact, layer or provenance name is text."""
    evil = "<i>x</i>"
    inputs = make_inputs()
    inputs["run_name"] = inputs["device"]["name"] = inputs["device"]["runtime"] = evil
    inputs["choice"]["knob"] = inputs["choice"]["reason"] = inputs["objective"] = evil
    inputs["train"]["family"] = inputs["train"]["model"]["arch"] = evil
    inputs["results"]["device"]["hostname"] = inputs["provenance"]["git_commit"] = evil
    inputs["provenance"]["versions"] = {evil: evil}
    inputs["export"]["artifacts"] = {evil: {"precision": evil, "layout": evil, "bytes": 50000,
                                            "fidelity": {"check": {"passed": True, "rule": evil}}}}
    inputs["artifact_results"] = {evil: {"skipped": evil}}
    inputs["predicted"] = None
    rep = report_mod.write_report(inputs, tmp_path / "run")
    report_mod.write_comparison([(rep, tmp_path / "run" / "report.html")], tmp_path)
    for page in (tmp_path / "run" / "report.html", tmp_path / "devices.html"):
        text = page.read_text()
        assert "<i>" not in text and "&lt;i&gt;x&lt;/i&gt;" in text, page.name


def test_the_histogram_counts_every_timed_run(tmp_path):
    """Issue 35: the runner counts every run (not a sample) and the report's histogram draws those counts:
    its total is the table's run count and its last edge the table's maximum."""
    import numpy as np

    from edgebayes.deploy import plots
    from edgebayes.ondevice.timing import latency_summary

    rng = np.random.default_rng(0)
    rounds = [{"samples_ms": list(0.02 + 0.01 * rng.random(3000)), "runs": 3000, "seconds": 0.1} for _ in range(4)]
    rounds[3]["samples_ms"].append(5.0)   # one slow run far out: counted, not drawn, named
    rounds[3]["runs"] += 1
    summary = latency_summary(rounds, 1)
    hist = summary["histogram"]
    assert sum(hist["counts"]) == summary["runs"] == 12001 and len(summary["samples_ms"]) < summary["runs"]
    assert hist["edges_ms"][0] == summary["latency_ms"]["min"] and hist["edges_ms"][-1] == summary["latency_ms"]["max"]
    png = plots.plot_latency_hist(summary["samples_ms"], summary["latency_ms"], 2.0, hist, summary["runs"], 1)
    assert png.startswith(PNG_MAGIC)
    inputs = make_inputs()
    inputs["results"].update(latency_histogram=hist, runs=summary["runs"], latency_ms=summary["latency_ms"])
    report_mod.write_report(inputs, tmp_path)
    assert (tmp_path / "latency_hist.png").read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize("layers", [3, 56])
def test_training_plot_of_a_network_of_many_layers_keeps_its_axes(layers):
    """A torchvision CNN has dozens of hidden layers: a legend line for each collapsed the training figure's
    axes (matplotlib: "constrained_layout not applied", printed in the user's run). Past LEGEND_LAYERS the
    layers are grey and unnamed beside their named total; drawn without a warning either way."""
    import warnings

    from edgebayes.deploy import plots

    history = [{"epoch": e + 1, "val_accuracy": 0.5 + 0.1 * e, "kept_nodes": [64 - e - j % 7 for j in range(layers)]}
               for e in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        png = plots.plot_history(history, [f"features.{j}" for j in range(layers)])
    assert png.startswith(PNG_MAGIC)


def test_the_shipped_temperature_is_in_the_summary_and_the_headline(tmp_path):
    """select.temperature_scaling: the graph's temperature (export.json) is said beside M; at 1 nothing is."""
    inputs = make_inputs()
    inputs["export"]["temperature"] = 0.7412
    rep = report_mod.write_report(inputs, tmp_path)
    assert rep["summary"]["temperature"] == 0.7412
    line = next(l for l in report_mod.summary_text(report_mod.terminal_summary(rep), 0) if "chosen point" in l)
    assert "M=4, T=0.7412," in line
    assert "at temperature 0.7412 (fitted on the validation split)" in (tmp_path / "report.html").read_text()
    inputs["export"]["temperature"] = 1.0
    rep = report_mod.write_report(inputs, tmp_path)
    assert "T=" not in next(l for l in report_mod.summary_text(report_mod.terminal_summary(rep), 0)
                            if "chosen point" in l)
    assert "at temperature" not in (tmp_path / "report.html").read_text()


def test_the_summary_says_no_budget_set_once_not_as_a_second_verdict():
    from edgebayes.deploy.summary import summary_text

    lines = summary_text({"run": "r", "device": "d", "mode": "measured", "latency_basis": "measured", "chosen": {},
                          "budgets": {"latency_ms": {"value": 0.0385, "limit": None, "verdict": "not set"},
                                      "model_mb": {"value": 0.03, "limit": 5, "verdict": "pass"}}})
    budget = [ln for ln in lines if ln.startswith("  budget")]
    assert budget[0].endswith("38.5 us: no budget set") and "not set" not in budget[0], budget
    assert budget[1].endswith("<= 5 MB: pass"), budget


def test_a_model_below_what_the_memory_measurement_resolves_counts_its_weights_not_zero():
    """The runtime's set-up, measured in another process, can exceed this process's whole rise for a model of a
    few KB: the difference (clamped to 0 MB) passed every memory budget. The weights' exact bytes stand for it."""
    from edgebayes.deploy.memory import own_memory

    parts = {"runtime_setup_mb": 9.348, "weights_mb": 0.04}
    small = own_memory({"model_mb": 9.285, "runtime_baseline_mb": 60.0}, parts)
    assert small["own_mb"] == 0.04 and "below what the measurement resolves" in small["measured_as"]
    large = own_memory({"model_mb": 30.0, "runtime_baseline_mb": 60.0}, parts)
    assert large["own_mb"] == pytest.approx(30.0 - 9.348) and "subtracted: 9.35 MB" in large["measured_as"]
    assert own_memory({"model_mb": 5.0}, {})["own_mb"] == 5.0   # no set-up measured: nothing subtracted
    assert small["stand_in"] and not large["stand_in"]


def test_a_stand_in_for_the_models_memory_is_said_everywhere_and_not_checked_against_itself(tmp_path):
    """The weights' bytes standing for a model too small to measure were labelled the model's own less the
    set-up, judged as "measured", and the estimate (which holds the same bytes) was 'validated' against them."""
    inputs = make_inputs()
    inputs["results"]["memory"] = {"runtime_baseline_mb": 50.0, "model_mb": 9.2, "deployed_mb": 59.2, "batch_size": 1}
    inputs["candidates"][2]["cost"].update(memory_estimate_mb=0.041, memory_estimate_lower_bound=False, memory_parts_mb={
        "runtime_baseline_mb": 50.0, "runtime_setup_mb": 9.3, "weights_mb": 0.04, "activations_mb": 0.001})
    rep = report_mod.write_report(inputs, tmp_path)
    s = rep["summary"]
    assert s["budgets"]["memory_mb"]["measured"] == 0.04 and s["budgets"]["memory_mb"]["basis"] == "weights' bytes"
    assert s["memory"]["own_is_stand_in"] and s["memory"]["estimate_error"] is None
    html = (tmp_path / "report.html").read_text()
    assert "the weights&#x27; bytes, standing for the model&#x27;s own" in html and "too small to measure" in html
    assert "the weights' bytes: the measurement does not resolve" in "\n".join(
        report_mod.summary_text(report_mod.terminal_summary(rep)))


def test_memory_without_a_set_up_to_subtract_says_it_holds_it():
    """Imported results of a board never profiled: nothing is subtracted, yet the summary said "of its own" and
    the report gave the estimate an error of -97 % against a figure holding the runtime's set-up (probe)."""
    from edgebayes.deploy.summary import _memory_note

    line = {"mode": "measured", "memory_model_mb": 3.5, "memory_setup_mb": None, "memory_runtime_baseline_mb": 50.0}
    assert _memory_note(line) == ("(of its own, the runtime's set-up in it: none measured to subtract; "
                                  "whole process 53.5 MB)")
    assert _memory_note({**line, "memory_setup_mb": 3.0}).startswith("(of its own, less 3 MB runtime set-up;")


def test_a_predicted_tensorrt_summary_says_whose_accuracy_it_shows(tmp_path):
    """The engine is built on the device: the figures here are its ONNX in onnxruntime, which the summary
    called "the bundle on this machine" (probe)."""
    rep = report_mod.write_report(predicted_inputs(), tmp_path)
    t = report_mod.terminal_summary(rep)
    accuracy = next(line for line in report_mod.summary_text(t, 4) if line.startswith("  accuracy"))
    assert accuracy.endswith("(the bundle on this machine)")
    t["chosen"]["format"] = "tensorrt-fp16"
    accuracy = next(line for line in report_mod.summary_text(t, 4) if line.startswith("  accuracy"))
    assert accuracy.endswith("(the bundle's ONNX in onnxruntime on this machine: the engine is built on the device)")
