"""Exit codes that follow the verdict, the closing summary (text and --json), a report of predictions when
the device cannot be reached, importing the device's results by hand, the devices comparison page.

The runs reuse the session's trained model (conftest.trained_runs / pipeline_run): only select, export,
deploy and report run here, with a short benchmark.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, cli, write_profile
from edgebayes.cli import EXIT_BAD_INPUT, EXIT_BUDGET, EXIT_PREDICTED
from edgebayes.deploy import localsshd

CONFIG = str(ROOT / "pipeline.yaml")



@pytest.fixture
def quick_config(tmp_path):
    """pipeline.yaml with a short benchmark: train's fingerprint is unchanged, so training is reused."""
    cfg = yaml.safe_load(Path(CONFIG).read_text())
    cfg["benchmark"] = {"warmup": 2, "min_runs": 40, "min_seconds": 0.05, "rounds": 2}
    path = tmp_path / "quick.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# ---------------------------------------------------------------------------------------------
# 0: every budget passes; the summary, also when every stage was cached, and --json
# ---------------------------------------------------------------------------------------------
def test_all_budgets_pass_exit_0_with_a_summary_also_when_cached(pipeline_run, capsys):
    runs = pipeline_run.parent
    # Another test may have run this folder with another config (digits-formats): bring it back first.
    assert cli(capsys, "pipeline", "--config", CONFIG, "--runs-dir", runs)[0] == 0
    code, out, err = cli(capsys, "pipeline", "--config", CONFIG, "--runs-dir", runs)
    assert code == 0, err
    assert all(f"{stage}: up to date" in out for stage in ("train", "select", "export", "deploy", "report"))
    summary = out[out.index("summary: digits-ssgl on local (measured)"):]
    for line in ("chosen point  inclusion threshold", "accuracy", "OOD AUROC", "latency       p50", "size",
                 "memory", "budget        latency", "budget        memory", "budget        model size",
                 "verdict       pass, exit code 0", f"report        {pipeline_run / 'report/local/report.html'}"):
        assert line in summary, (line, summary)

    code, out, err = cli(capsys, "pipeline", "--config", CONFIG, "--runs-dir", runs, "--json")
    assert code == 0, err
    s = json.loads(out)            # stdout holds the summary alone; the log went to stderr
    assert "train: up to date" in err and "summary:" not in out
    report = json.loads((pipeline_run / "report/local/report.json").read_text())
    assert s["exit_code"] == 0 and s["verdict"] == "pass" and s["mode"] == "measured"
    assert s["device"] == "local" and s["chosen"]["knob_value"] == report["summary"]["knob_value"]
    assert s["accuracy"] == report["results"]["metrics"]["accuracy"]
    assert s["ood_auroc"] == report["results"]["ood"]["auroc"] > 0.5      # measured on the device's outputs
    assert s["latency_ms"]["p99"] == report["results"]["latency_ms"]["p99"]
    assert set(s["budgets"]) == {"latency_ms", "memory_mb", "model_mb"}
    assert all(b["verdict"] == "pass" for b in s["budgets"].values())
    # memory_mb is the model's own memory: the runner's model peak less the runtime's set-up (issue 21).
    setup = report["summary"]["memory"]["subtracted_setup_mb"]
    assert setup is not None and s["memory_mb"] == pytest.approx(max(0.0, s["memory_model_mb"] - setup))


# ---------------------------------------------------------------------------------------------
# 3: the chosen point fails a budget on the device
# ---------------------------------------------------------------------------------------------
def test_a_budget_failing_on_the_device_exits_3(trained_runs, quick_config, tmp_path, capsys):
    """Selection trusts an optimistic declared throughput (the point 'fits' 1 us); the deployment measures
    this machine's real latency, several us, and the verdict fails."""
    device = write_profile(tmp_path / "optimist.yaml", base="local",
                           budgets={"latency_ms": 0.001, "percentile": 90},
                           latency_model={"kind": "flops", "flops_per_second": 1e18, "overhead_ms": 0.0,
                                          "source": "declared, not measured: a test's optimism"})
    code, out, err = cli(capsys, "pipeline", "--config", quick_config, "--device", device, "--runs-dir", trained_runs,
                         "--json")
    assert code == EXIT_BUDGET, err
    s = json.loads(out)
    assert s["exit_code"] == EXIT_BUDGET and s["verdict"] == "fail" and s["mode"] == "measured"
    assert s["budgets"]["latency_ms"]["verdict"] == "fail" and s["budgets"]["latency_ms"]["value"] > 0.001
    assert s["budgets"]["model_mb"]["verdict"] == "pass"
    choice = json.loads((trained_runs / "digits-ssgl/select/optimist/choice.json").read_text())
    assert choice["candidate"]["fits"]   # selection thought it fitted: the device says otherwise
    # A report that runs again and fails takes its page with it: the last one looked current (probe)
    page = trained_runs / "digits-ssgl/report/optimist"
    (trained_runs / "digits-ssgl/deploy/optimist/results.json").unlink()
    code, _, err = cli(capsys, "report", "--config", quick_config, "--device", device, "--runs-dir", trained_runs)
    assert code == 1 and "results.json" in err
    assert not (page / "report.html").exists() and (page / "report.withdrawn.json").is_file()
    assert not list(page.glob("*.png"))   # its plots too (its marker, which lists them, was gone: review)
    code, out, err = cli(capsys, "report", "--config", quick_config, "--runs-dir", trained_runs, "--devices", device,
                         "--json")
    assert code == EXIT_BUDGET and json.loads(out)["devices"][0]["stale"].startswith("withdrawn"), err


def test_memory_is_judged_on_the_models_own_memory(trained_runs, quick_config, tmp_path, capsys):
    """Issue 21: budgets.memory_mb judges the model's own memory, estimated at selection and measured after
    deployment (the runner's peak above the runtime loaded): 5 MB passes the default digits model although
    the runtime alone takes more; a budget under the model's own estimate is refused at selection."""
    device = write_profile(tmp_path / "small-ram.yaml", base="local", budgets={"memory_mb": 5})
    code, out, err = cli(capsys, "pipeline", "--config", quick_config, "--device", device, "--runs-dir", trained_runs,
                         "--json")
    assert code == 0, err
    s = json.loads(out)
    assert s["budgets"]["memory_mb"]["verdict"] == "pass" and s["memory_runtime_baseline_mb"] > 5
    assert "subtracted" in s["memory_basis"]    # the report names the baseline it took off
    html_text = (trained_runs / "digits-ssgl/report/small-ram/report.html").read_text()
    assert "runtime set-up subtracted" in html_text
    device = write_profile(tmp_path / "tiny-ram.yaml", base="local", budgets={"memory_mb": 0.01})
    code, out, err = cli(capsys, "select", "--config", quick_config, "--device", device, "--runs-dir", trained_runs)
    assert code == 3 and "no operating point fits" in out and "own memory (estimated)" in out and "> budget 0.01" in out


# ---------------------------------------------------------------------------------------------
# 4: the device is unreachable: a report of predictions, then the device's results imported
# ---------------------------------------------------------------------------------------------
def unreachable(tmp_path, trained_runs, name="far-board"):
    """An ssh board at a port nothing listens on; its latency table is the one measured for `local`."""
    return write_profile(tmp_path / f"{name}.yaml", connection={
        "local_sshd": False, "host": "127.0.0.1", "port": localsshd.free_port(), "identity_file": None,
        "options": ["StrictHostKeyChecking=no", f"UserKnownHostsFile={tmp_path / 'known_hosts'}"],
        "connect_timeout_s": 5, "workdir": f"edgebayes/{name}"},
        latency_model={"kind": "table", "table": str(trained_runs / "devices/local/latency_table.json")})


def test_unreachable_device_gives_a_predicted_report_and_exit_4(trained_runs, quick_config, tmp_path, capsys):
    device = unreachable(tmp_path, trained_runs)
    code, out, err = cli(capsys, "pipeline", "--config", quick_config, "--device", device, "--runs-dir", trained_runs)
    assert code == EXIT_PREDICTED, err
    assert "host unreachable" in out and "verdict       likely pass (predicted), exit code 4" in out
    run = trained_runs / "digits-ssgl"
    report = json.loads((run / "report/far-board/report.json").read_text())
    s = report["summary"]
    assert s["mode"] == "predicted" and report["results"] is None
    assert s["latency_prediction"]["has_table"] and s["latency_predicted_ms"]["p90"] > 0
    assert s["budgets"]["latency_ms"]["basis"] == "predicted"
    assert s["budgets"]["latency_ms"]["measured"] == s["latency_predicted_ms"]["p90"]
    assert s["budgets"]["memory_mb"]["basis"] == "estimated" and s["budgets"]["memory_mb"]["measured"] > 0
    # the bundle's accuracy on this machine: the same figures export measured
    export = json.loads((run / "export/far-board/export.json").read_text())
    assert s["metrics_measured_on"] == "this machine"
    assert s["metrics"]["accuracy"]["device"] == pytest.approx(export["artifacts"]["onnx"]["fidelity"]["accuracy"])
    assert s["ood"]["auroc"] > 0.5
    # how to finish: copy, run, import, with the device named
    finish = s["finish"]
    assert finish[-1].startswith("edgebayes report") and "--device" in finish[-1] and "--results" in finish[-1]
    assert str(device) in finish[-1] and "--results results-far-board.json" in finish[-1]
    assert any("scp" in step and "bundle" in step for step in finish)
    assert any("bundle/runner.pyz --bundle bundle" in step for step in finish)   # the bundle's own runner
    assert finish[0].startswith("the board needs") and "numpy" in finish[0] and "onnxruntime" in finish[0]
    assert "  to finish     1. the board needs" in out     # the summary lists them, one a line (and --json)
    html = (run / "report/far-board/report.html").read_text()
    assert "(predicted)" in html and "PREDICTED, not measured on the device" in html and "--results" in html
    assert not (run / "deploy/far-board/stage.json").exists()   # the next pipeline deploys when it is back

    # `edgebayes report` alone repeats the verdict: the report of predictions, how to finish, exit 4 (it was 1)
    code, out, err = cli(capsys, "report", "--config", quick_config, "--device", device, "--runs-dir", trained_runs)
    assert code == EXIT_PREDICTED and f"--device {device}" in out and "--results" in out, err
    assert "host unreachable" in json.loads((run / "report/far-board/report.json").read_text())["predicted"]["reason"]
    assert not (run / "report/far-board/stage.json").exists()   # still to finish: the next pipeline deploys

    # Finish by hand: run the bundle with its runner.pyz "on the device" (here), import its results.
    board = tmp_path / "board"
    shutil.copytree(run / "export/far-board/bundle", board / "bundle")
    done = subprocess.run([sys.executable, "bundle/runner.pyz", "--bundle", "bundle", "--out", "results.json", "--min-runs",
                           "30", "--min-seconds", "0", "--threads", "1", "--quiet", "--tag", "device=far-board"],   # as the steps say
                          cwd=board, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    code, out, err = cli(capsys, "report", "--config", quick_config, "--device", device, "--runs-dir", trained_runs,
                         "--results", board / "results.json", "--json")
    assert code == 0, err
    s = json.loads(out)
    assert s["mode"] == "measured" and s["verdict"] == "pass" and "imported" in err
    imported = json.loads((board / "results.json").read_text())
    assert s["latency_ms"]["p90"] == imported["latency_ms"]["p90"]
    report = json.loads((run / "report/far-board/report.json").read_text())
    assert report["summary"]["mode"] == "measured" and report["results"]["runs"] == imported["runs"]
    # ... and says where they came from: edgebayes did not run them (probe)
    assert s["imported_from"] == str((board / "results.json").resolve())
    assert f"Results imported</b> from <code>{(board / 'results.json').resolve()}" in \
        (run / "report/far-board/report.html").read_text()
    # the pipeline now finds deploy done (imported) and ends with the same verdict
    code, out, err = cli(capsys, "pipeline", "--config", quick_config, "--device", device, "--runs-dir", trained_runs)
    assert code == 0 and "deploy: up to date" in out, err


def test_results_of_another_bundle_are_refused(trained_runs, quick_config, pipeline_run, tmp_path, capsys):
    device = unreachable(tmp_path, trained_runs, "other-board")
    assert cli(capsys, "pipeline", "--config", quick_config, "--device", device,
               "--runs-dir", trained_runs)[0] == EXIT_PREDICTED
    results = json.loads((pipeline_run / "deploy/local/results.json").read_text())
    results["bundle"]["model_sha256"] = "0" * 64
    wrong = tmp_path / "results.json"
    wrong.write_text(json.dumps(results))
    code, _, err = cli(capsys, "report", "--config", quick_config, "--device", device, "--runs-dir", trained_runs,
                       "--results", wrong)
    assert code == EXIT_BAD_INPUT and "results of another bundle" in err
    assert not (trained_runs / "digits-ssgl/deploy/other-board/results.json").exists()


def test_a_device_that_computes_something_else_gets_no_report():
    """A model swapped under the hashed name, or a broken runtime, ran at the accuracy of a guess and read
    'verdict pass, exit 0' (probe): the shipped artifact's accuracy on the device must reach export's floor."""
    from edgebayes.config import load_device_profile, load_pipeline_config
    from edgebayes.errors import StageError
    from edgebayes.stages import Context, device_fidelity

    ctx = Context(load_pipeline_config(ROOT / "pipeline.yaml"), load_device_profile("local"))
    drop = ctx.cfg.export.max_accuracy_drop
    manifest = {"format": "onnx-int8", "reference": {"accuracy": 0.96},
                "artifacts": {"onnx-int8": {"fidelity": {"accuracy": 0.95}}}}

    def res(accuracy):
        return {"bundle": {"artifact": "onnx-int8"}, "metrics": {"accuracy": accuracy}, "max_abs_prob_diff": 0.9}

    device_fidelity(ctx, res(0.95 - drop + 1e-9), manifest)   # the int8 artifact's own accuracy sets the floor
    with pytest.raises(StageError, match=r"device local: onnx-int8 reaches accuracy 0.0530 on the bundle's test set "
                                         r"there, below 0.9300 .*does not compute what was exported"):
        device_fidelity(ctx, res(0.053), manifest)


def test_results_with_a_key_twice_are_refused(tmp_path):
    """A second "metrics" after the real one (accuracy 1.0) was imported: json keeps the last (probe)."""
    from edgebayes.deploy.results import ResultsError, read_results

    path = tmp_path / "results.json"
    path.write_text('{"schema": 1, "metrics": {"accuracy": 0.9}, "metrics": {"accuracy": 1.0}}')
    with pytest.raises(ResultsError, match=r"results.json: not a runner's results file: not JSON \(ValueError: key "
                                           r"'metrics' appears twice in one object\)"):
        read_results(path)


def test_results_timed_at_another_thread_count_are_refused():
    """A runner run with --threads 1 for a profile of runtime.threads 2 imported silently, and the latency budget
    was judged on 1-thread figures (probe)."""
    from edgebayes.deploy.results import ResultsError, identity

    expected = {"tags.device": "box", "protocol.threads": 2}
    identity({"tags": {"device": "box"}, "protocol": {"threads": 2}}, expected, "r.json", "box")
    with pytest.raises(ResultsError, match=r"r.json: protocol.threads: 1, but this run's profile for box has 2: "
                                           r"results of another thread count \(runtime.threads\)"):
        identity({"tags": {"device": "box"}, "protocol": {"threads": 1}}, expected, "r.json", "box")


# ---------------------------------------------------------------------------------------------
# The devices comparison page
# ---------------------------------------------------------------------------------------------
def test_devices_comparison_page(trained_runs, quick_config, tmp_path, capsys):
    far = unreachable(tmp_path, trained_runs, "far")
    assert cli(capsys, "pipeline", "--config", quick_config, "--runs-dir", trained_runs)[0] == 0
    assert cli(capsys, "pipeline", "--config", quick_config, "--device", far, "--runs-dir", trained_runs)[0] == 4
    code, out, err = cli(capsys, "report", "--config", quick_config, "--runs-dir", trained_runs,
                         "--devices", "local", far, "local", "--json")
    assert code == EXIT_PREDICTED, err   # the worst of the devices' verdicts: far's is a prediction (it was 0)
    rows = {r["device"]: r for r in json.loads(out)["devices"]}
    assert len(json.loads(out)["devices"]) == 2 and set(rows) == {"local", "far"}   # local once
    assert rows["local"]["mode"] == "measured" and rows["far"]["mode"] == "predicted"
    html = (trained_runs / "digits-ssgl/report/devices.html").read_text()
    assert "href='local/report.html'" in html and "href='far/report.html'" in html
    assert "predicted" in html and "<img" in html
    assert not rows["local"]["stale"] and not rows["far"]["stale"] and "stale report" not in html
    assert cli(capsys, "report", "--config", quick_config, "--runs-dir", trained_runs, "--devices", "local")[0] == 0
    # Judged as `report` judges it, by the markers and hashes, not file times (probe): a copy that changed the
    # times alone is current; a bundle edited by hand is not, and the row says so (it passed, exit 0)
    choice = trained_runs / "digits-ssgl/select/local/choice.json"
    later = (trained_runs / "digits-ssgl/report/local/report.json").stat().st_mtime + 60
    os.utime(choice, (later, later))
    assert cli(capsys, "report", "--config", quick_config, "--runs-dir", trained_runs, "--devices", "local")[0] == 0
    onnx = trained_runs / "digits-ssgl/export/local/bundle/model.onnx"
    kept = onnx.read_bytes()
    onnx.write_bytes(kept[:-1] + bytes([kept[-1] ^ 0xFF]))
    code, out, err = cli(capsys, "report", "--config", quick_config, "--runs-dir", trained_runs,
                         "--devices", "local", far, "--json")
    onnx.write_bytes(kept)
    rows = {r["device"]: r for r in json.loads(out)["devices"]}
    assert code == EXIT_BUDGET and "model.onnx changed" in rows["local"]["stale"] and not rows["far"]["stale"]
    assert "local: stale report" in (trained_runs / "digits-ssgl/report/devices.html").read_text()
    assert "local's report is stale" in err
    # A device without a report is bad input (it was exit 1, 'a stage failed', which no stage had), named with the
    # command that makes one, and the last page stays as it was
    page = (trained_runs / "digits-ssgl/report/devices.html").read_bytes()
    code, _, err = cli(capsys, "report", "--config", quick_config, "--runs-dir", trained_runs, "--devices", "local",
                       "jetson")
    assert code == 2 and "report --devices: jetson has no report" in err and "--device jetson" in err
    assert (trained_runs / "digits-ssgl/report/devices.html").read_bytes() == page


def test_an_mc_samples_budget_that_allows_none_of_the_grid_is_refused_before_any_work(quick_config, tmp_path,
                                                                                       capsys):
    """budgets.mc_samples [3] against select.mc_samples [1, 2, 4, 8]: train, select and export ran, then 'no fit'
    (exit 3) with the reason in select's log only. Now bad input naming both keys, nothing written."""
    device = write_profile(tmp_path / "three.yaml", base="local", budgets={"mc_samples": [3]})
    code, _, err = cli(capsys, "pipeline", "--config", quick_config, "--device", device, "--runs-dir",
                       str(tmp_path / "runs"))
    assert code == 2, err
    assert "budgets.mc_samples [3] of device" in err, err and "allows none of select.mc_samples [1, 2, 4, 8]" in err
    assert not (tmp_path / "runs").exists()


def test_an_unreachable_device_without_a_latency_table_exits_4_saying_how_to_make_one(trained_runs, quick_config,
                                                                                       tmp_path, capsys):
    """Nothing to predict from and no device: no report can be written, and the exit code is the unreachable
    device's (4, what a CI script retries on), not a stage's failure (1)."""
    device = unreachable(tmp_path, trained_runs, name="no-table-board")
    profile = yaml.safe_load(Path(device).read_text())
    profile["latency_model"] = {"kind": "measure"}
    Path(device).write_text(yaml.safe_dump(profile))
    code, _, err = cli(capsys, "pipeline", "--config", quick_config, "--device", device, "--runs-dir", trained_runs)
    assert code == EXIT_PREDICTED, err
    assert "host unreachable" in err and "no latency table to predict from either" in err
    assert not (trained_runs / "digits-ssgl/report/no-table-board/report.json").exists()
    # a table that is there but of another thread count is named as such, not as missing (review)
    table = trained_runs / "devices/no-table-board/latency_table.json"
    table.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(trained_runs / "devices/local/latency_table.json", table)
    profile["runtime"] = {**profile.get("runtime", {}), "threads": 3}
    Path(device).write_text(yaml.safe_dump(profile))
    code, _, err = cli(capsys, "pipeline", "--config", quick_config, "--device", device, "--runs-dir", trained_runs)
    assert code == EXIT_PREDICTED, err
    assert f"its latency table is not used ({table} was measured at 1 runtime threads" in err, err
    shutil.rmtree(table.parent)
