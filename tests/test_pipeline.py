"""End to end: the real pipeline on the embedded default (digits), its cache, and a corrupted bundle.

The first test runs `edgebayes pipeline` on pipeline.yaml exactly as a user does (150 epochs, about half
a minute on 2 cores) and checks the figures the foundation issue asks for. The others reuse its run folder.
"""

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from edgebayes.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def run(pipeline_run):
    return pipeline_run   # conftest.py: trained once per session, shared with the device tests


def test_pipeline_meets_the_foundation_targets(run):
    report = json.loads((run / "report/local/report.json").read_text())
    s = report["summary"]
    results = report["results"]
    assert results["metrics"]["accuracy"] >= 0.93
    assert s["pruned_fraction_hidden"] > 0
    assert s["fidelity_max_abs_prob_diff"] < 1e-4
    assert results["max_abs_prob_diff"] < 1e-4
    assert s["onnx_params"] == s["kept_weights_total"]
    assert (run / "report/local/report.html").stat().st_size > 10_000
    # The runner measured what the protocol asks for.
    lat = results["latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"]
    assert results["runs"] >= 300
    # The exported graph holds exactly M samples of the kept weights.
    export = json.loads((run / "export/local/export.json").read_text())
    kept = list(export["kept_units"].values())
    widths = [64] + kept
    assert export["kept_weights_per_sample"] == sum((i + 1) * o for i, o in zip(widths[:-1], widths[1:]))
    assert export["onnx_params"] == export["mc_samples"] * export["kept_weights_per_sample"]
    # The report describes the deployed model's structure, not training's default threshold.
    hidden = kept[:-1]
    assert s["pruned_fraction_hidden"] == pytest.approx(1 - sum(hidden) / (64 * len(hidden)))
    assert s["compression_ratio"] == pytest.approx(export["kept_weights_per_sample"] / (65 * 64 + 65 * 64 + 65 * 10))
    # What ships is the candidate select scored: the temperature it fitted on the validation split
    # (select.temperature_scaling, on by default), baked into the graph the runner ran.
    chosen = json.loads((run / "select/local/choice.json").read_text())["candidate"]
    assert export["temperature"] == chosen["temperature"] != 1.0
    # ... and the same samples without it, beside the shipped figures (the README quotes both ECEs)
    before = export["before_temperature"]
    assert before["n"] == results["metrics"]["n"] and before["accuracy"] == pytest.approx(
        results["metrics"]["accuracy"], abs=0.02)
    assert before["ece"] != results["metrics"]["ece"]
    # ... set against the same samples at T in PyTorch too: the shipped figure also carries the precision's
    # change (an int8 graph's), so T's own effect is shown like for like (probe)
    at_t = before["at_fitted_t"]
    manifest = json.loads((run / "export/local/bundle/manifest.json").read_text())
    assert at_t["ece"] == pytest.approx(manifest["reference"]["ece"])
    page = (run / "report/local/report.html").read_text()
    assert f"PyTorch {before['ece']:.4g} at T = 1, {at_t['ece']:.4g} at T = " in page
    from edgebayes.deploy.summary import summary_text, terminal_summary

    text = "\n".join(summary_text(terminal_summary(json.loads((run / "report/local/report.json").read_text()))))
    assert f"(PyTorch {before['ece']:.4g} at T=1, {at_t['ece']:.4g} at T=" in text
    # The Training section's test metrics are training's own evaluation (its default knob, T = 1), and say so;
    # the shipped widths stand beside the trained architecture.
    html = (run / "report/local/report.html").read_text()
    assert "Test metrics at the end of training" in html and "not the shipped point" in html
    assert " → ".join(str(k) for k in kept) in html
    assert "kept / dense weights per sample" in html   # the model-file card's ratio, named for what it is


def test_second_run_skips_every_stage(run, capsys, monkeypatch):
    """... and reads no data: a cached pipeline over 50,000 images decoded them all (37 s) only to check them."""
    from edgebayes import stages

    def no_loading(*_):
        raise AssertionError("the data was loaded")

    monkeypatch.setattr(stages, "_splits_cache", {})
    monkeypatch.setattr(stages, "load_data", no_loading)
    checkpoint = run / "train/checkpoint.pt"
    before = checkpoint.stat().st_mtime_ns
    capsys.readouterr()
    assert main(["pipeline", "--config", str(ROOT / "pipeline.yaml"), "--runs-dir", str(run.parent)]) == 0
    out = capsys.readouterr().out
    for stage in ("train", "select", "export", "deploy", "report"):
        assert f"{stage}: up to date" in out
    assert checkpoint.stat().st_mtime_ns == before


def test_changed_device_reruns_what_depends_on_it(run, tmp_path, capsys):
    profile = yaml.safe_load((ROOT / "devices/local.yaml").read_text())
    profile["name"] = "local-tight"
    profile["budgets"]["model_mb"] = 0.1  # forces a smaller M than the default budget allows
    device = tmp_path / "local-tight.yaml"
    device.write_text(yaml.safe_dump(profile))
    capsys.readouterr()
    assert main(["pipeline", "--config", str(ROOT / "pipeline.yaml"), "--device", str(device),
                 "--runs-dir", str(run.parent)]) == 0
    out = capsys.readouterr().out
    assert "train: up to date" in out
    for stage in ("select", "export", "deploy", "report"):
        assert f"{stage}: running" in out
    choice = json.loads((run / "select/local-tight/choice.json").read_text())
    assert choice["candidate"]["cost"]["model_mb"] <= 0.1
    assert (run / "report/local-tight/report.json").is_file()


def test_budget_nothing_meets_lists_closest_candidates(run, tmp_path, capsys):
    profile = yaml.safe_load((ROOT / "devices/local.yaml").read_text())
    profile["name"] = "impossible"
    profile["budgets"]["model_mb"] = 1e-6
    device = tmp_path / "impossible.yaml"
    device.write_text(yaml.safe_dump(profile))
    assert main(["select", "--config", str(ROOT / "pipeline.yaml"), "--device", str(device),
                 "--runs-dir", str(run.parent)]) == 3          # a budget verdict (issue 36)
    out = capsys.readouterr().out
    assert "no operating point fits" in out and "model" in out and "> budget" in out
    assert json.loads((run / "select/impossible/choice.json").read_text())["fits"] is False


def test_deploy_refuses_a_corrupted_bundle(run, tmp_path, capsys):
    runs = tmp_path / "runs"
    shutil.copytree(run, runs / run.name)
    shutil.copytree(run.parent / "devices", runs / "devices")   # the latency table select predicted from
    model = runs / run.name / "export/local/bundle/model.onnx"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))
    assert main(["deploy", "--force", "--config", str(ROOT / "pipeline.yaml"), "--runs-dir", str(runs)]) == 1
    err = capsys.readouterr().err
    # Refused before copying: the export stage's marker holds another sha256 for model.onnx (the runner's
    # own check of the manifest's hashes is in test_runner.py); the advice re-runs export, not deploy.
    assert f"{model} is not what the export stage wrote" in err
    assert "run `edgebayes export --config " in err


def test_a_single_stage_refuses_to_build_on_an_earlier_stage_of_another_config(run, tmp_path, capsys):
    """`report` alone after a config change re-reported the old bundle and recorded the new config beside
    its figures (exit 0): a stage run alone now names the earlier stage that is out of date, and writes nothing."""
    runs = tmp_path / "runs"
    shutil.copytree(run, runs / run.name)
    shutil.copytree(run.parent / "devices", runs / "devices")   # the latency table select predicted from
    report = runs / run.name / "report/local/report.json"
    before = report.read_bytes()
    args = ["--config", str(ROOT / "pipeline.yaml"), "--runs-dir", str(runs)]
    capsys.readouterr()
    assert main(["report", *args, "--set", "select.mc_samples=[1]"]) == 1
    err = capsys.readouterr().err
    assert "report: the select stage is out of date for this config and device" in err
    assert "run `edgebayes select --config" in err
    assert report.read_bytes() == before
    assert main(["report", *args]) == 0   # the config the run was made with: up to date
    # an interrupted re-train (no marker, another config's checkpoint in its folder): the earlier report was
    # 'up to date' while `report --devices` called it stale (probe)
    marker = runs / run.name / "train/stage.json"
    kept = marker.read_bytes()
    marker.unlink()
    capsys.readouterr()
    assert main(["report", *args]) == 1
    assert "report: the train stage is out of date for this config and device (it has not finished" in \
        capsys.readouterr().err
    marker.write_bytes(kept)
    # an earlier stage that ran again since select read its output
    select = runs / run.name / "select/local/stage.json"
    done = json.loads(select.read_text())
    rel = sorted(done["inputs"])[0]
    select.write_text(json.dumps({**done, "inputs": {**done["inputs"], rel: "0" * 64}}))
    assert main(["report", *args]) == 1
    assert f"the select stage is out of date for this config and device (its input {rel} changed" in \
        capsys.readouterr().err
    assert report.read_bytes() == before


def test_runner_reports_its_own_peak_memory(run):
    """The runner imports no torch, so its peak RSS is far below this (torch-loaded) process's: a runner
    that inherited its parent's high-water mark across fork/exec would report at least the parent's."""
    import resource

    results = json.loads((run / "deploy/local/results.json").read_text())
    parent_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6   # KiB -> MB
    assert 0 < results["peak_rss_mb"] < 0.6 * parent_mb


def test_pipeline_runs_a_convolutional_spike_and_slab_resnet(tmp_path, capsys):
    """The same stages on a non-centered SS-GHS ResNet-20 (batch norm, residual streams) on digits: the
    deployed ONNX graph holds exactly M physically pruned samples and matches PyTorch. A few epochs only:
    this checks the plumbing, not accuracy."""
    cfg = yaml.safe_load((ROOT / "pipeline.yaml").read_text())
    cfg["name"] = "digits-resnet"
    cfg["model"].update(family="ss-ghs", arch="resnet20")
    cfg["prior"].update(parameterization="non-centered", sigma0_sq=0.04)
    cfg["train"].update(epochs=2, batch_size=128, mc_samples_eval=2)   # 1 by --set below
    cfg["select"].update(knob_values=[0.5], mc_samples=[1, 2])
    cfg["benchmark"].update(warmup=2, min_runs=10, min_seconds=0.1)
    path = tmp_path / "resnet.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["pipeline", "--config", str(path), "--runs-dir", str(tmp_path / "runs"), "--set", "train.epochs=1"]) == 0
    run = tmp_path / "runs/digits-resnet"
    report = json.loads((run / "report/local/report.json").read_text())   # --set is in the run and its report
    assert report["train"]["epochs"] == report["config"]["values"]["train"]["epochs"] == 1
    assert report["config"]["settings"] == ["train.epochs=1"]
    assert "train.epochs=1" in (run / "report/local/report.html").read_text()
    export = json.loads((run / "export/local/export.json").read_text())
    assert export["onnx_params"] == export["mc_samples"] * export["kept_weights_per_sample"]
    assert export["fidelity_max_abs_prob_diff"] < 1e-4
    assert "layer1.0.conv1.conv" in export["kept_units"] and "fc" in export["kept_units"]
    metrics = json.loads((run / "train/metrics.json").read_text())
    assert metrics["family"] == "ss-ghs" and 0 < metrics["flops_ratio"] <= 1
    assert metrics["physical_flops_ratio"] >= metrics["flops_ratio"] - 1e-12  # surgery can't beat the masks
    assert (run / "report/local/report.html").is_file()


def test_every_export_format_is_built_benchmarked_and_reported(run, capsys):
    """configs/digits-formats.yaml asks for onnx, onnx-int8, tflite-fp32, tflite-fp16, tflite-int8: each is
    exported, run and timed by the runner, and has its fidelity line in the report (training is reused)."""
    config = yaml.safe_load((ROOT / "configs/digits-formats.yaml").read_text())
    config["name"] = run.name  # the same run folder: train is up to date
    config["benchmark"] = {"warmup": 2, "min_runs": 20, "min_seconds": 0.05}
    path = run.parent / "formats.yaml"
    path.write_text(yaml.safe_dump(config))
    capsys.readouterr()
    assert main(["pipeline", "--config", str(path), "--runs-dir", str(run.parent)]) == 0
    assert "train: up to date" in capsys.readouterr().out
    formats = ["onnx", "onnx-int8", "tflite-fp32", "tflite-fp16", "tflite-int8"]
    manifest = json.loads((run / "export/local/bundle/manifest.json").read_text())
    assert list(manifest["artifacts"]) == formats
    deployed = json.loads((run / "deploy/local/artifacts.json").read_text())
    assert list(deployed) == formats
    report = json.loads((run / "report/local/report.json").read_text())
    rows = {row["artifact"]: row for row in report["fidelity"]}
    assert list(rows) == formats
    for fmt, row in rows.items():
        assert row["check"]["passed"] and row["device_p50_ms"] > 0
        assert row["device_accuracy"] == pytest.approx(row["accuracy"])  # the device ran the same artifact
        if fmt in ("onnx", "tflite-fp32"):
            assert row["max_abs_prob_diff"] <= 1e-4
        else:
            assert row["accuracy"] >= row["reference"]["accuracy"] - 0.02
    assert "Fidelity of every exported artifact" in (run / "report/local/report.html").read_text()


def test_a_bn3_pipeline_with_a_flops_target_selects_only_the_widths_its_training_served(tmp_path, capsys):
    """With train.flops_target a nested net trains the widths from the target's up (NestedNet.serve_from): the
    config's narrower widths were never trained, so select leaves them out and says so, the train stage reports
    the target's width (the default knob), and the chosen width is within the target."""
    cfg = yaml.safe_load((ROOT / "configs/digits-mlp-bn3.yaml").read_text())
    cfg["name"] = "digits-bn3-target"
    cfg["train"].update(epochs=2, flops_target=0.5, mc_samples_eval=1)
    cfg["select"].update(knob_values=[2, 3, 8], mc_samples=[1])
    cfg["benchmark"] = {"warmup": 2, "min_runs": 10, "min_seconds": 0.05}
    path = tmp_path / "bn3.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["pipeline", "--config", str(path), "--runs-dir", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    served = re.search(r"bn3 serves widths (\d+)\.\.8 of 8 groups", out)
    assert served, out
    width = int(served.group(1))
    assert width > 3   # 0.5 of the FLOPs is above widths 2 and 3 here, so both are left out
    assert "select: width(s) [2, 3] of select.knob_values left out" in out
    run = tmp_path / "runs/digits-bn3-target"
    metrics = json.loads((run / "train/metrics.json").read_text())
    assert metrics["physical_flops_ratio"] <= 0.5   # the target's width (it was the full width's 1.0)
    chosen = json.loads((run / "select/local/choice.json").read_text())
    assert chosen["knob_value"] in (width, 8)
    # select.knob_values of none but the widths the training never served: a setting of the config (exit 2),
    # refused before the last selection is withdrawn (it was exit 1, after select had started)
    before = (run / "select/local/choice.json").read_bytes()
    cfg["select"]["knob_values"] = [2, 3]
    path.write_text(yaml.safe_dump(cfg))
    capsys.readouterr()
    assert main(["select", "--config", str(path), "--runs-dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert (f"select.knob_values: every width ([2, 3]) is narrower than the narrowest one the training served "
            f"({width} of 8 groups") in err, err
    assert (run / "select/local/choice.json").read_bytes() == before
    assert (run / "report/local/report.json").is_file()   # the last run's report is not withdrawn
    # without select.knob_values the width within the target ships: a wider one, a few thousandths of a nat
    # ahead, shipped 0.40 of the FLOPs for a target of 0.3 (probe)
    del cfg["select"]["knob_values"]
    path.write_text(yaml.safe_dump(cfg))
    capsys.readouterr()
    assert main(["select", "--config", str(path), "--runs-dir", str(tmp_path / "runs")]) == 0
    assert f"select: width {width}, the training's within train.flops_target" in capsys.readouterr().out
    candidates = json.loads((run / "select/local/candidates.json").read_text())["candidates"]
    assert {c["knob_value"] for c in candidates} == {width}


def test_knob_values_only_at_or_below_fixed_groups_are_a_config_error(tmp_path):
    """Widths no training step serves (nested.fixed_groups or fewer groups) are refused when the config loads,
    not after training."""
    from edgebayes.config import ConfigError, load_pipeline_config

    cfg = yaml.safe_load((ROOT / "configs/digits-mlp-bn3.yaml").read_text())
    cfg.setdefault("nested", {})["fixed_groups"] = 3
    cfg["select"]["knob_values"] = [2, 3]
    path = tmp_path / "bn3.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match=r"select.knob_values: every width \(\[2, 3\]\) is at or below "
                                          r"nested.fixed_groups = 3, which no training step serves; give widths in 4..8"):
        load_pipeline_config(path)
    cfg["select"]["knob_values"] = [2, 4]
    path.write_text(yaml.safe_dump(cfg))
    assert load_pipeline_config(path).select.knob_values == [2, 4]
