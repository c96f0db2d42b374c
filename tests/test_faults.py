"""Issue 19: the pipeline used as a careless or hostile user would. Each failure of the issue is reproduced
here and shown fixed:

1. a killed or Ctrl-C'd training must not leave a marker that lies (stages.Context: markers written last,
   with the hashes of outputs and inputs); an altered checkpoint or bundle re-runs its stage;
2. a name cannot make a stage write outside --runs-dir;
3. two pipelines on one run folder: the second fails at once (Context.lock);
4. a YAML alias bomb is refused in milliseconds;
and the weaknesses: ranges checked before any work, one message per failure instead of a traceback, ssh
argv safety, the runner runnable from any folder, runner deaths and select errors reported as they are.

The pipelines run on a small digits config (40 epochs, 2 x 2 candidates, a FLOPs-model device so that
nothing is profiled), trained once per module (`base`); each test works on a copy of that run folder.
"""

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

import edgebayes
from edgebayes.cli import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, main

ROOT = Path(__file__).resolve().parents[1]
EPOCHS = 40
ENV = {**os.environ, "OMP_NUM_THREADS": "1",   # subprocesses import this checkout's edgebayes
       "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(edgebayes.__file__).resolve().parents[1]),
                                                   os.environ.get("PYTHONPATH")]))}


def cli(capsys, *args):
    capsys.readouterr()
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line(err):
    """The command line's contract: one message, no traceback."""
    return err.startswith("edgebayes: ") and err.count("\n") == 1 and "Traceback" not in err


def write_config(path, **sections):
    cfg = yaml.safe_load((ROOT / "pipeline.yaml").read_text())
    cfg["name"] = "faults"
    cfg["train"]["epochs"] = EPOCHS
    cfg["select"].update(knob_values=[0.5, 0.9], mc_samples=[1, 2])
    cfg["benchmark"] = {"warmup": 2, "min_runs": 20, "min_seconds": 0.05, "rounds": 2}
    for section, values in sections.items():
        cfg[section].update(values)
    path.write_text(yaml.safe_dump(cfg))
    return path


def write_device(path, **sections):
    profile = yaml.safe_load((ROOT / "devices/local.yaml").read_text())
    profile["name"] = path.stem
    profile["latency_model"] = {"kind": "flops", "flops_per_second": 1e9}
    for section, values in sections.items():
        if isinstance(values, dict):
            profile.setdefault(section, {}).update(values)
        else:
            profile[section] = values
    path.write_text(yaml.safe_dump(profile))
    return path


def flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The small config's whole pipeline, run once; the figures every later run must reproduce."""
    tmp = tmp_path_factory.mktemp("faults")
    config, device = write_config(tmp / "faults.yaml"), write_device(tmp / "flops.yaml")
    assert main(["pipeline", "--config", str(config), "--device", str(device), "--runs-dir", str(tmp / "runs")]) == 0
    return SimpleNamespace(tmp=tmp, config=config, device=device, runs=tmp / "runs",
                           deployed=figures(tmp / "runs"))


@pytest.fixture
def runs(base, tmp_path):
    shutil.copytree(base.runs, tmp_path / "runs")
    return tmp_path / "runs"


def assert_same_run(got, expected):
    """The run is the uninterrupted one: the same deployed accuracy and knob value, and the same test metrics
    up to float summation order (threaded reductions may differ in the 8th digit between processes)."""
    assert (got["accuracy"], got["knob_value"]) == (expected["accuracy"], expected["knob_value"])
    numbers = {k for k, v in expected["test"].items() if isinstance(v, float)}
    assert {k: v for k, v in got["test"].items() if k not in numbers} == \
        {k: v for k, v in expected["test"].items() if k not in numbers}
    assert {k: got["test"][k] for k in numbers} == pytest.approx({k: expected["test"][k] for k in numbers}, rel=1e-6)


def figures(runs):
    """What was deployed and what the report says, checked to agree with each other and the checkpoint."""
    run = runs / "faults"
    state = torch.load(run / "train/checkpoint.pt", weights_only=True)
    metrics = json.loads((run / "train/metrics.json").read_text())
    choice = json.loads((run / "select/flops/choice.json").read_text())
    export = json.loads((run / "export/flops/export.json").read_text())
    results = json.loads((run / "deploy/flops/results.json").read_text())
    report = json.loads((run / "report/flops/report.json").read_text())
    assert state["epoch"] == metrics["epochs"] == len(metrics["history"]) == EPOCHS
    assert report["train"]["test"] == metrics["test"]                       # the report shows this training
    assert (choice["knob_value"], choice["mc_samples"]) == (export["knob_value"], export["mc_samples"]) \
        == (results["bundle"]["knob"]["value"], results["bundle"]["mc_samples"])  # choice == bundle
    assert report["choice"]["knob_value"] == choice["knob_value"]             # == report
    accuracy = results["metrics"]["accuracy"]
    assert accuracy == export["reference"]["accuracy"] == report["results"]["metrics"]["accuracy"]
    return {"accuracy": accuracy, "test": metrics["test"], "knob_value": choice["knob_value"]}


def pipeline(capsys, base, runs, config=None):
    code, out, err = cli(capsys, "pipeline", "--config", config or base.config, "--device", base.device,
                         "--runs-dir", runs)
    assert code == 0, err
    return out


def start(base, runs, *args):
    # SIGINT back to its default in the child: a shell starts background jobs with SIGINT ignored, the tests
    # inherit that when run in the background (`pytest &`), and Python then never raises KeyboardInterrupt
    return subprocess.Popen([sys.executable, "-m", "edgebayes.cli", *args, "--device", str(base.device),
                             "--runs-dir", str(runs)], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for_epoch(proc, checkpoint, at_least, timeout=120):
    """Watch the checkpoint the subprocess writes (atomically, once per epoch) until it holds a new run's
    epoch `at_least` (and not the finished run's); returns that epoch."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            epoch = torch.load(checkpoint, weights_only=True)["epoch"]
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError):
            epoch = None
        if epoch is not None and at_least <= epoch < EPOCHS:
            return epoch
        time.sleep(0.05)
    raise AssertionError("the training subprocess never reached the epoch")


# ---------------------------------------------------------------------------------------------
# 1. Markers that cannot lie
# ---------------------------------------------------------------------------------------------
def test_training_killed_mid_run_resumes_and_deploys_what_it_reports(base, runs, capsys):
    """`train --force` killed (SIGKILL) at a known epoch, then `pipeline`: the training resumes and
    finishes, and everything after it runs again: the deployed model is the reported one (and, resumed
    exactly, the same as the uninterrupted run's)."""
    proc = start(base, runs, "train", "--force", "--config", str(base.config))
    killed_at = wait_for_epoch(proc, runs / "faults/train/checkpoint.pt", 5)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert not (runs / "faults/train/stage.json").exists()
    out = pipeline(capsys, base, runs)
    assert "train: running (no finished run: never run, interrupted or failed)" in out
    assert int(re.search(r"resuming from .*checkpoint.pt after epoch (\d+)", out).group(1)) >= killed_at
    for stage in ("select", "export", "deploy", "report"):
        assert f"{stage}: running" in out
    assert "select: running (its input train/checkpoint.pt changed since it was read)" in out
    assert_same_run(figures(runs), base.deployed)


def test_ctrl_c_while_training_an_edited_config_then_revert(base, runs, capsys):
    """Another lr, Ctrl-C during its training (exit 130, one line), back to the original config: the
    original is trained again, not taken for up to date. Meanwhile a second pipeline on the same run
    folder fails at once, naming the first one's pid."""
    edited = write_config(runs.parent / "edited.yaml", train={"lr": 1e-2})
    proc = start(base, runs, "pipeline", "--config", str(edited))
    wait_for_epoch(proc, runs / "faults/train/checkpoint.pt", 3)

    t0 = time.monotonic()
    code, _, err = cli(capsys, "pipeline", "--config", base.config, "--device", base.device, "--runs-dir", runs)
    assert code == EXIT_FAILED and one_line(err) and f"in use by another edgebayes (pid {proc.pid})" in err, err
    assert time.monotonic() - t0 < 5

    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    err = err.decode()
    assert proc.returncode == EXIT_INTERRUPTED == 130
    assert err.strip().splitlines()[-1] == "edgebayes: interrupted; run again to resume" and "Traceback" not in err

    out = pipeline(capsys, base, runs)
    assert "train: running" in out and "resuming" not in out   # the edited run's checkpoint is not resumed
    assert_same_run(figures(runs), base.deployed)


def test_altered_checkpoint_reruns_train_from_scratch(base, runs, capsys):
    checkpoint = runs / "faults/train/checkpoint.pt"
    flip_byte(checkpoint)
    # A stage run alone refuses it instead of loading it:
    code, _, err = cli(capsys, "select", "--config", base.config, "--device", base.device, "--runs-dir", runs)
    assert code == EXIT_FAILED and one_line(err) and f"{checkpoint} is not what the train stage wrote" in err, err
    out = pipeline(capsys, base, runs)
    assert "train: running (its output checkpoint.pt changed since the stage wrote it)" in out
    assert "resuming" not in out
    assert_same_run(figures(runs), base.deployed)


def test_altered_bundle_reruns_export_and_stale_temporaries_go(base, runs, capsys):
    export = runs / "faults/export/flops"
    flip_byte(export / "bundle/model.onnx")
    (export / ".artifacts.k1ll3d_0").mkdir()            # what a killed export leaves behind (tempfile's name)
    (export / ".artifacts.k1ll3d_0/onnx.onnx").write_bytes(b"partial")
    code, _, err = cli(capsys, "deploy", "--config", base.config, "--device", base.device, "--runs-dir", runs)
    assert code == EXIT_FAILED and one_line(err), err
    assert "bundle/model.onnx is not what the export stage wrote" in err and "run `edgebayes export --config " in err
    out = pipeline(capsys, base, runs)
    assert "train: up to date" in out and "select: up to date" in out
    assert "export: running (its output bundle/model.onnx changed since the stage wrote it)" in out
    # the refused deploy above touched nothing (its check comes first): it runs for the new bundle
    assert "deploy: running (its input export/flops/bundle" in out
    assert not list(export.glob(".*"))
    assert_same_run(figures(runs), base.deployed)


def test_empty_or_garbled_markers_rerun_their_stage(base, runs, capsys):
    (runs / "faults/deploy/flops/stage.json").write_text("")
    (runs / "faults/report/flops/stage.json").write_text("{")
    out = pipeline(capsys, base, runs)
    assert "export: up to date" in out
    # (the report's garbled marker went with the report deploy's re-run withdrew: Context.withdraw_report)
    assert "deploy: running (no valid stage.json" in out and "report: running (no finished run" in out
    assert_same_run(figures(runs), base.deployed)


def test_code_version_is_part_of_the_fingerprint(base, runs, monkeypatch, capsys):
    """An upgrade (another code version) re-runs the stages instead of reusing older code's artifacts."""
    import edgebayes.stages

    monkeypatch.setattr(edgebayes.stages, "stage_code", lambda stage: "other code")
    code, out, err = cli(capsys, "train", "--config", base.config, "--device", base.device, "--runs-dir", runs)
    assert code == 0, err
    assert "train: running (config, device profile or code changed)" in out


# ---------------------------------------------------------------------------------------------
# 2. Names and paths
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["../../outside", "/abs/outside", "..", ".hidden", "-rf", "a/b"])
def test_names_that_point_elsewhere_are_refused(name, tmp_path, capsys):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    runs = tmp_path / "a/b/runs"
    device = write_device(tmp_path / "dev.yaml", name=name)
    code, _, err = cli(capsys, "pipeline", "--config", write_config(tmp_path / "c.yaml"), "--device", device,
                       "--runs-dir", runs)
    assert code == EXIT_BAD_INPUT and one_line(err) and f"{device}: name: expected letters" in err, err
    config = tmp_path / "named.yaml"
    config.write_text((tmp_path / "c.yaml").read_text().replace("name: faults", f"name: '{name}'"))
    code, _, err = cli(capsys, "pipeline", "--config", config, "--runs-dir", runs)
    assert code == EXIT_BAD_INPUT and f"{config}: name: expected letters" in err, err
    assert not runs.exists() and [p.name for p in outside.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("settings, named", [
    (["model.pretrained=garbage.pt"], "model.pretrained"), (["train.device=cuda"], "train.device"),
    (["model.family=sqs", "sqs.checkpoint=other.pt", "train.flops_target=null"], "sqs.checkpoint"),
    (["train.flops_target=0.001"], "train.flops_target: 0.001 of the dense FLOPs cannot be reached")])
def test_bad_training_input_leaves_the_finished_run_as_it_was(settings, named, base, runs, tmp_path, capsys,
                                                               monkeypatch):
    """A bad model.pretrained, or train.device cuda without CUDA, deleted the finished run's checkpoint, marker
    and report before it was refused (exit 2, probe): what train refuses is checked before anything is touched;
    an sqs.checkpoint of another network too (review), and a FLOPs target below the smallest network the
    architecture allows (its schedule found it at the first step, after the last run was set aside: probe)."""
    import torch

    monkeypatch.chdir(tmp_path)
    (tmp_path / "garbage.pt").write_text("garbage\n")
    torch.save({"something": torch.zeros(3)}, tmp_path / "other.pt")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = {p: p.read_bytes() for p in runs.rglob("*") if p.is_file() and p.name != ".lock"}
    code, _, err = cli(capsys, "pipeline", "--config", base.config, "--device", base.device, "--runs-dir", runs,
                       *(x for setting in settings for x in ("--set", setting)))
    assert code == EXIT_BAD_INPUT and one_line(err) and named in err, err
    after = {p: p.read_bytes() for p in runs.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == before


def test_deploy_of_an_edited_bundle_leaves_the_report_as_it_was(base, runs, capsys):
    """deploy withdrew the good report, then refused the bundle edited by hand (probe): the bundle is checked
    against export's marker first."""
    flip_byte(runs / "faults/export/flops/bundle/model.onnx")
    before = {p: p.read_bytes() for p in (runs / "faults/report/flops").iterdir()}
    code, _, err = cli(capsys, "deploy", "--config", base.config, "--device", base.device, "--runs-dir", runs, "--force")
    assert code == EXIT_FAILED and one_line(err) and "model.onnx" in err, err
    assert {p: p.read_bytes() for p in (runs / "faults/report/flops").iterdir()} == before


def test_a_profile_named_after_another_device_is_refused(tmp_path, capsys):
    """A copy of local.yaml saved as mybox.yaml that kept `name: local` wrote over local's results (probe); an
    alias names a profile, not a path."""
    device = write_device(tmp_path / "mybox.yaml", name="local")
    code, _, err = cli(capsys, "pipeline", "--config", write_config(tmp_path / "c.yaml"), "--device", device,
                       "--runs-dir", tmp_path / "runs")
    assert code == EXIT_BAD_INPUT and one_line(err) and f"{device}: name: 'local' is not the file's name 'mybox'" in err
    assert "set `name: mybox`" in err and not (tmp_path / "runs").exists()
    alias = tmp_path / "elsewhere.yaml"
    alias.write_text("alias: ../boards/evil\n")
    code, _, err = cli(capsys, "devices", "check", str(alias))
    assert code == EXIT_BAD_INPUT and f"{alias}: alias: expected a profile's name" in err, err
    # a mistyped --devices-dir was passed over, the shipped profiles answering (probe)
    code, _, err = cli(capsys, "devices", "list", "--devices-dir", tmp_path / "no-such-folder")
    assert code == EXIT_BAD_INPUT and f"--devices-dir {tmp_path / 'no-such-folder'}: not a folder" in err, err


def test_an_m_or_a_knob_value_given_twice_is_refused(tmp_path, capsys):
    for setting in ("select.mc_samples=[1,1]", "select.knob_values=[0.5,0.5]"):
        code, _, err = cli(capsys, "report", "--config", write_config(tmp_path / "c.yaml"), "--set", setting,
                           "--runs-dir", tmp_path / "runs")
        assert code == EXIT_BAD_INPUT and one_line(err) and "once, got [" in err, err


def test_stage_folder_linked_outside_the_runs_folder_is_refused(base, runs, tmp_path, capsys):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    report = runs / "faults/report/flops"
    shutil.rmtree(report)
    report.symlink_to(outside)
    code, _, err = cli(capsys, "report", "--config", base.config, "--device", base.device, "--runs-dir", runs)
    assert code == EXIT_FAILED and one_line(err) and "outside --runs-dir" in err, err
    assert [p.name for p in outside.iterdir()] == ["keep.txt"]


def test_a_marker_cannot_name_files_outside_its_folder(base, runs, tmp_path, capsys):
    """Altered outputs are removed before a stage re-runs: only inside the stage's own folder."""
    keep = tmp_path / "keep.txt"
    keep.write_text("mine")
    marker = runs / "faults/report/flops/stage.json"
    done = json.loads(marker.read_text())
    done["outputs"].update({str(keep): "0" * 64, f"../../../../{keep.name}": "0" * 64})
    marker.write_text(json.dumps(done))
    code, out, err = cli(capsys, "report", "--config", base.config, "--device", base.device, "--runs-dir", runs)
    assert code == 0 and "report: running (its output" in out, err
    assert keep.read_text() == "mine"


# ---------------------------------------------------------------------------------------------
# 4. The YAML loader, and every range before any work
# ---------------------------------------------------------------------------------------------
def test_alias_bomb_exits_2_within_a_second_and_100_mb(tmp_path):
    """Nine levels of nine aliases (9^9 items if expanded) under a known key: refused by the loader, in a
    process that never imports torch (configs are checked first)."""
    bomb = 'x: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    for x, y in zip("abcdefgh", "bcdefghi"):
        bomb += f"x{y}: &{y} [" + ",".join([f"*{x}"] * 9) + "]\n"
    config = tmp_path / "bomb.yaml"
    config.write_text(bomb + "name: *i\nselect:\n  knob_values: *i\n")
    # The command line in a child that reports its own peak memory (VmHWM: this address space only;
    # ru_maxrss of a forked child would include this test process's).
    probe = ("import sys; from edgebayes.cli import main; code = main(sys.argv[1:]); "
             "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0]); sys.exit(code)")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", probe, "train", "--config", str(config), "--runs-dir",
                           str(tmp_path / "runs")], env=ENV, capture_output=True, text=True)
    elapsed = time.monotonic() - t0
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr
    assert one_line(proc.stderr) and f"{config}: line 2: alias *a: YAML aliases are not accepted" in proc.stderr
    peak_mb = int(proc.stdout) / 1024
    assert elapsed < 1.0 and peak_mb < 100, (elapsed, peak_mb)
    assert not (tmp_path / "runs").exists()


BAD_PIPELINE = {
    "lr .inf": ("train:\n  lr: .inf\n", r"train\.lr: expected a finite number, got inf"),
    "seed 1e23": ("seed: 1e23\n", r"seed: expected an integer, got 1e\+23 \(float\)"),
    "seed 2^70": (f"seed: {2 ** 70}\n", r"seed: expected an integer in 0\.\.2\^32 - 1"),
    "huge int for a float": (f"train:\n  lr: {10 ** 400}\n", r"train\.lr: expected a finite number"),
    "opset 1": ("export:\n  opset: 1\n", r"export\.opset: expected an ONNX opset in 7\.\.20"),
    "knob out of range": ("select:\n  knob_values: [0.5, 1.5]\n",
                          r"select\.knob_values: expected inclusion thresholds in \(0, 1\), got \[0\.5, 1\.5\]"),
    "warmup -1": ("benchmark:\n  warmup: -1\n", r"benchmark\.warmup: expected a non-negative integer"),
    "lr_gamma -5": ("train:\n  lr_gamma: -5\n", r"train\.lr_gamma: expected a number in \(0, 1\]"),
    "M 1e6": ("select:\n  mc_samples: [1, 1000000]\n", r"select\.mc_samples: expected integers in 1\.\.1000"),
    "duplicate key": ("train:\n  epochs: 3\ntrain:\n  epochs: 4\n",
                      r"line 3: key 'train' appears twice in the same mapping"),
    "alias under a known key": ("x: &v [0.5]\nselect:\n  knob_values: *v\n", r"line 3: alias \*v"),
    "empty file": ("# nothing here\n", r"empty file \(expected a mapping of keys"),
    "long value shortened": ("name: " + "x" * 100_000 + "\n",   # then the key's description (issue 35)
                             r"name: expected letters.*got 'x{20,}\.\.\.x+'\. name: the run's name[^']*$"),
}


@pytest.mark.parametrize("case", list(BAD_PIPELINE))
def test_bad_pipeline_values_exit_2_before_any_work(case, tmp_path, capsys):
    text, pattern = BAD_PIPELINE[case]
    config = tmp_path / "p.yaml"
    config.write_text(text)   # the keys not given keep their defaults
    code, _, err = cli(capsys, "pipeline", "--config", config, "--runs-dir", tmp_path / "runs")
    assert code == EXIT_BAD_INPUT and one_line(err) and len(err) < 400, err
    assert re.search(re.escape(str(config)) + ": " + pattern, err.strip()), err
    assert not (tmp_path / "runs").exists()


BAD_DEVICE = {
    "threads -1": ({"runtime": {"threads": -1}}, r"runtime\.threads: expected an integer in 0\.\.1024"),
    "threads 1e20": ({"runtime": {"threads": 10 ** 20}}, r"runtime\.threads: expected an integer in 0\.\.1024"),
    "batch 1e9": ({"budgets": {"batch_size": 1e9}}, r"budgets\.batch_size: expected an integer, got 1000000000\.0"),
    "batch 10^9": ({"budgets": {"batch_size": 10 ** 9}}, r"budgets\.batch_size: expected an integer in 1\.\.4096"),
    "user option": ({"connection": {"kind": "ssh", "host": "board", "user": "-oProxyCommand=touch /tmp/x"}},
                    r"connection\.user: must not be empty or start with '-'"),
    "host option": ({"connection": {"kind": "ssh", "host": "-oProxyCommand=x"}}, r"connection\.host: must not"),
    "ProxyCommand": ({"connection": {"kind": "ssh", "host": "board", "options": ["ProxyCommand=touch /tmp/x"]}},
                     r"connection\.options: ssh reads ProxyCommand 'touch /tmp/x' from them, which makes ssh run "
                     r"code on this machine; allowed only with `connection\.trusted: true`"),
    "LocalCommand": ({"connection": {"kind": "ssh", "host": "board",
                                     "options": ["PermitLocalCommand=yes", "localcommand=touch /tmp/x"]}},
                     r"connection\.options: ssh reads LocalCommand 'touch /tmp/x' from them, which makes ssh run"),
    "min_free_mb": ({"connection": {"min_free_mb": -1}}, r"connection\.min_free_mb: expected a number >= 0"),
}


@pytest.mark.parametrize("case", list(BAD_DEVICE))
def test_bad_device_values_exit_2_before_any_work(case, tmp_path, capsys):
    changes, pattern = BAD_DEVICE[case]
    device = write_device(tmp_path / "dev.yaml", **changes)
    code, _, err = cli(capsys, "pipeline", "--config", write_config(tmp_path / "c.yaml"), "--device", device,
                       "--runs-dir", tmp_path / "runs")
    assert code == EXIT_BAD_INPUT and one_line(err), err
    assert re.search(re.escape(str(device)) + ": " + pattern, err), err
    assert not (tmp_path / "runs").exists()


def test_ssh_argv_ends_options_before_the_destination_and_trusted_profiles_may_proxy(tmp_path):
    from edgebayes.config import load_device_profile
    from edgebayes.deploy.transport import transport_for

    device = write_device(tmp_path / "board.yaml", connection={
        "kind": "ssh", "host": "board", "user": "pi", "trusted": True, "options": ["ProxyCommand=ssh -W %h:%p gw"]})
    argv = transport_for(load_device_profile(str(device)), tmp_path).ssh
    assert argv[-2:] == ["--", "pi@board"] and "ProxyCommand=ssh -W %h:%p gw" in argv


# ---------------------------------------------------------------------------------------------
# One message per failure
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["a file", "read-only"])
def test_unusable_runs_folder(kind, tmp_path, capsys):
    runs = tmp_path / "runs"
    if kind == "a file":
        runs.write_text("not a folder")
    else:  # root ignores permission bits, not a read-only mount (mounting needs root, as CI runs)
        runs.mkdir()
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(runs)], capture_output=True)
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        code, _, err = cli(capsys, "train", "--config", write_config(tmp_path / "c.yaml"), "--runs-dir", runs)
    finally:
        if kind == "read-only":
            subprocess.run(["umount", str(runs)], check=False)
    assert code == EXIT_FAILED and one_line(err), err
    assert f"train failed: {runs / 'faults'}: " + ("Not a directory" if kind == "a file" else "Read-only file system") \
        in err, err


def test_hostile_pickle_as_checkpoint_is_refused_without_running_it(base, tmp_path, capsys):
    """A checkpoint that would run a command when unpickled: torch's weights_only refuses it, and the
    refusal is one line naming the file. (run.json says "same run", so the trainer tries to resume.)"""
    from edgebayes.config import load_device_profile, load_pipeline_config
    from edgebayes.stages import Context

    canary = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {canary}",))

    train = tmp_path / "runs/faults/train"
    train.mkdir(parents=True)
    (train / "checkpoint.pt").write_bytes(pickle.dumps(Evil(), protocol=2))
    fp = Context(load_pipeline_config(base.config), load_device_profile(str(base.device))).fingerprint("train")
    (train / "run.json").write_text(json.dumps({"fingerprint": fp}))
    code, _, err = cli(capsys, "train", "--config", base.config, "--device", base.device,
                       "--runs-dir", tmp_path / "runs")
    assert code == EXIT_FAILED and one_line(err), err
    assert f"{train / 'checkpoint.pt'}: not a checkpoint edgebayes can load (UnpicklingError" in err
    assert not canary.exists()


@pytest.mark.parametrize("error, code, message", [
    (OSError(28, "No space left on device", "/r/faults/export/flops/export.json"), EXIT_FAILED,
     "pipeline failed: /r/faults/export/flops/export.json: No space left on device"),
    (PermissionError(13, "Permission denied", "/r/faults/.lock"), EXIT_FAILED,
     "pipeline failed: /r/faults/.lock: Permission denied"),
    (MemoryError(), EXIT_FAILED, "pipeline failed: out of memory"),
    (KeyboardInterrupt(), EXIT_INTERRUPTED, "interrupted; run again to resume"),
    (json.JSONDecodeError("Expecting value", "", 0), EXIT_FAILED, "pipeline failed: unreadable file content"),
])
def test_top_level_handler_one_line_per_failure(error, code, message, base, monkeypatch, capsys, tmp_path):
    import edgebayes.stages

    def fail(ctx):
        raise error

    monkeypatch.setattr(edgebayes.stages, "run_pipeline", fail)
    rc, _, err = cli(capsys, "pipeline", "--config", base.config, "--device", base.device, "--runs-dir", tmp_path)
    assert rc == code and one_line(err) and err.startswith(f"edgebayes: {message}"), err


def test_a_stage_out_of_memory_or_disk_names_the_stage(base, runs, monkeypatch, capsys):
    """MemoryError and a nameless OSError (matplotlib on a full disk) in a stage: the stage and its folder."""
    import edgebayes.stages

    def no_space(ctx):
        raise OSError(28, "No space left on device")

    monkeypatch.setitem(edgebayes.stages.RUNNERS, "report", no_space)
    code, _, err = cli(capsys, "report", "--force", "--config", base.config, "--device", base.device,
                       "--runs-dir", runs)
    assert code == EXIT_FAILED and one_line(err), err
    assert f"report: No space left on device (writing in {runs / 'faults/report/flops'})" in err


def test_full_disk_under_atomic_writes_names_the_file(tiny_disk):
    """A real full disk (a 64 KiB tmpfs; mounting needs root, as CI runs): torch's own writer would say
    `RuntimeError: unexpected pos`; the atomic writers raise ENOSPC with the file's name."""
    from edgebayes.provenance import atomic_torch_save, write_json

    mnt = tiny_disk
    with pytest.raises(OSError, match="No space left on device") as e:
        atomic_torch_save({"x": torch.zeros(100_000)}, mnt / "checkpoint.pt")
    assert e.value.filename == str(mnt / "checkpoint.pt")
    with pytest.raises(OSError) as e:
        write_json(mnt / "metrics.json", {"x": "y" * 200_000})
    assert e.value.filename == str(mnt / "metrics.json")
    assert not list(mnt.iterdir())   # no temporary left behind


def test_a_full_disk_under_the_tflite_export_is_an_error_not_a_silent_exit(tiny_disk):
    """litert-torch wrote the file through LLVM, which ends the process on a full disk: export exited 1 and said
    nothing (probe). Run in a child process, so that a regression ends the child, not the test session."""
    pytest.importorskip("litert_torch")
    script = ("import errno, sys, torch\n"
              "from edgebayes.export.formats import export_tflite\n"
              "net = torch.nn.Sequential(torch.nn.Linear(64, 1000), torch.nn.Softmax(-1))   # 260 KB of weights\n"
              "try:\n"
              "    export_tflite(net.eval(), torch.rand(1, 64), sys.argv[1], 'fp32')\n"
              "except OSError as e:\n"
              "    print('ENOSPC' if e.errno == errno.ENOSPC else repr(e))\n")
    proc = subprocess.run([sys.executable, "-c", script, str(tiny_disk / "model.tflite")], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0 and proc.stdout.strip() == "ENOSPC", (proc.returncode, proc.stdout, proc.stderr[-2000:])


# ---------------------------------------------------------------------------------------------
# The runner and the device
# ---------------------------------------------------------------------------------------------
def test_runner_runs_from_any_folder(tmp_path):
    """The runner zipapp runs from any folder; no module of the package may be named like a standard module
    (deploy/select.py shadowed `select` when the runner was a script beside it)."""
    from edgebayes.ondevice.pack import write_runner

    runner = write_runner(tmp_path / "runner.pyz")
    proc = subprocess.run([sys.executable, "-I", str(runner), "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0 and "usage: runner.pyz" in proc.stdout, proc.stderr
    modules = {p.stem for p in Path(edgebayes.__file__).parent.rglob("*.py")}
    assert not modules & set(sys.stdlib_module_names)


def test_runner_killed_by_a_signal_is_named(tmp_path):
    from edgebayes.deploy.transport import LocalTransport, runner_failure

    script = tmp_path / "runner.py"
    script.write_text("import os, signal, sys\nsys.stderr.write('runner: accuracy 0.97\\n')\n"
                      "sys.stderr.write('runner: timing (300 runs):  45%|####      |\\n')\n"
                      "os.kill(os.getpid(), signal.SIGKILL)\n")
    code, err = LocalTransport("board", tmp_path).run(["runner.py"])
    message = runner_failure("board", code, err)
    assert code == -9 and message.startswith("the runner failed on device board (killed by SIGKILL)")
    assert "%|" not in message and "exit code -9" not in message
    assert runner_failure("board", 137, err) == ("the runner failed on device board (exit code 137: killed by "
                                                 "SIGKILL) (SIGKILL: the device may have run out of memory)")
    assert runner_failure("board", 1, ["runner: x", "ValueError: bad", "runner: t:  3%|#  |"]).endswith(
        "(exit code 1): ValueError: bad")


def test_select_advises_profiling_only_when_the_device_is_unavailable(base):
    """A full disk (or a crashed runner, a read-only folder) is not 'no latency table': it is reported as
    it is; only an unusable device falls back to the prediction."""
    from edgebayes.config import load_device_profile, load_pipeline_config
    from edgebayes.deploy.selection import _latencies
    from edgebayes.deploy.transport import DeviceUnavailable, TransportError

    profile = load_device_profile(str(write_device(base.tmp / "measured.yaml",
                                                   latency_model={"kind": "measure", "flops_per_second": 1e9})))
    cfg = load_pipeline_config(base.config)

    class Device:
        def __init__(self, error):
            self.error = error

        def preflight(self, *args):
            raise self.error

        def where(self):
            return "nowhere"

    bench = {"warmup": 1, "min_runs": 1, "min_seconds": 0, "rounds": 1}
    full = TransportError("device measured: disk full in x on nowhere (No space left on device)")
    example = np.zeros((1, 64), dtype=np.float32)
    with pytest.raises(TransportError) as e:
        _latencies(cfg, profile, Device(full), [], example, bench, base.runs, print)
    assert "disk full" in str(e.value) and "devices profile" not in str(e.value)
    logged = []
    measured, predictor, _ = _latencies(cfg, profile, Device(DeviceUnavailable("device measured: host unreachable")),
                                        [], example, bench, base.runs, logged.append)
    assert predictor is not None and "host unreachable" in logged[0]


# ---------------------------------------------------------------------------------------------
# Issue 36, item 3: ssh settings judged as ssh reads them (`ssh -G`), before ssh runs
# ---------------------------------------------------------------------------------------------
# Profile connections that would make ssh run `touch CANARY` on this machine ({tmp}: the test's folder,
# whose config files _ssh_files writes), and the message each gets.
HOSTILE_SSH = {
    "quoted keyword": ({"options": ['"ProxyCommand"=touch {canary}']},
                       r"connection\.options: ssh reads ProxyCommand 'touch "),
    "keyword's case and spaces": ({"options": ["  pRoXyCoMmAnD = touch {canary}"]},
                                  r"connection\.options: ssh reads ProxyCommand"),
    "LocalCommand": ({"options": ["permitlocalcommand=yes", "LocalCommand=touch {canary}"]},
                     r"connection\.options: ssh reads LocalCommand"),
    "KnownHostsCommand": ({"options": ["KnownHostsCommand=touch {canary}"]},
                          r"connection\.options: ssh reads KnownHostsCommand"),
    "a library loaded": ({"options": ["PKCS11Provider={tmp}/evil.so"]}, r"connection\.options: ssh reads PKCS11Provider"),
    "config file's ProxyCommand": ({"ssh_config": "{tmp}/proxy.conf"},
                                   r"connection\.ssh_config \(.*proxy\.conf\): ssh reads ProxyCommand"),
    "Match exec behind a condition": ({"ssh_config": "{tmp}/match.conf"},
                                      r"connection\.ssh_config: .*match\.conf has a `Match exec`"),
    "Match exec in an Include": ({"ssh_config": "{tmp}/include.conf"},
                                 r"connection\.ssh_config: .*inc1\.conf has a `Match exec` \(included by .*include\.conf\)"),
    "jump host's ProxyCommand": ({"ssh_config": "{tmp}/jump.conf"},
                                 r"connection\.ssh_config \(.*jump\.conf\) for jump host gw: ssh reads ProxyCommand"),
    "agent forwarded": ({"ssh_config": "{tmp}/agent.conf"}, r"connection\.ssh_config \(.*agent\.conf\): ssh reads "
                                                            r"ForwardAgent 'yes' from them, which opens this machine"),
    "FIFO as ssh_config": ({"ssh_config": "{tmp}/fifo"}, r"connection\.ssh_config: .*fifo is not a readable file"),
    "host with a command": ({"host": "board;touch {canary}"}, r"connection\.host: expected a host name .* or an IP address"),
    "host as a URI": ({"host": "ssh://board"}, r"connection\.host: expected a host name"),
    "user with a command": ({"user": "$(touch {canary})"}, r"connection\.user: expected a user name"),
    "jump host with a command": ({"proxy_jump": "gw;touch {canary}"}, r"connection\.proxy_jump: expected \[user@\]host"),
}


def _ssh_files(tmp, canary):
    touch = f"touch {canary}"
    (tmp / "proxy.conf").write_text(f'Host *\n  "ProxyCommand"={touch}\n')
    (tmp / "match.conf").write_text(f'Host other\n  User x\nMATCH host board !Exec "{touch}"\n  User bob\n')
    (tmp / "include.conf").write_text(f"Include {tmp}/inc*.conf\n")
    (tmp / "inc1.conf").write_text(f'Match exec "{touch}"\n  Port 2\n')
    (tmp / "jump.conf").write_text(f"Host gw\n  ProxyCommand {touch}\nHost board\n  ProxyJump gw\n")
    (tmp / "agent.conf").write_text("Host board\n  ForwardAgent yes\n")
    os.mkfifo(tmp / "fifo")


@pytest.mark.skipif(shutil.which("ssh") is None, reason="no OpenSSH client: nothing can run ssh here")
@pytest.mark.parametrize("case", list(HOSTILE_SSH))
def test_ssh_settings_that_run_a_command_here_are_refused_as_ssh_reads_them(case, tmp_path, capsys):
    canary = tmp_path / "pwned"
    _ssh_files(tmp_path, canary)
    changes, pattern = HOSTILE_SSH[case]
    connection = {k: [o.format(tmp=tmp_path, canary=canary) for o in v] if isinstance(v, list)
                  else v.format(tmp=tmp_path, canary=canary) for k, v in changes.items()}
    device = write_device(tmp_path / "board.yaml", connection={"kind": "ssh", "host": "board", **connection})
    code, _, err = cli(capsys, "devices", "check", device)
    assert code == EXIT_BAD_INPUT and one_line(err), err
    assert re.search(re.escape(str(device)) + ": " + pattern, err), err
    assert not canary.exists()
    if "expected" not in pattern:   # the same profile, marked trusted by its author, loads
        from edgebayes.config import load_device_profile

        write_device(device, connection={"trusted": True})
        if "fifo" not in case.lower():
            assert load_device_profile(str(device)).connection.trusted
        assert not canary.exists()


@pytest.mark.skipif(shutil.which("ssh") is None, reason="no OpenSSH client")
def test_ssh_G_never_runs_a_match_exec_it_reads(tmp_path):
    """The judgement itself reads the configuration with a shell that does not exist: a Match exec it
    reaches stops ssh -G instead of running (ssh -G does run them otherwise)."""
    from edgebayes.config import _effective_ssh_config, _MatchExec

    canary = tmp_path / "pwned"
    config = tmp_path / "c.conf"
    config.write_text(f'Match exec "touch {canary}"\n  User bob\n')
    with pytest.raises(_MatchExec):
        _effective_ssh_config(["-F", str(config)], "board")
    assert not canary.exists()
    assert _effective_ssh_config(["-F", os.devnull, "-o", "User=pi"], "board")["user"] == ["pi"]


@pytest.mark.parametrize("host", ["board", "board-2.lan", "my_alias", "10.0.0.7", "::1", "fe80::1%eth0", "jetson."])
def test_host_names_and_addresses_are_accepted(host, tmp_path):
    from edgebayes.config import load_device_profile

    device = write_device(tmp_path / "board.yaml", connection={"kind": "ssh", "host": host, "user": "pi",
                                                               "proxy_jump": "me@gw:2200,[fd00::2]:22"})
    assert load_device_profile(str(device)).connection.host == host


# ---------------------------------------------------------------------------------------------
# Issue 36, item 2: `report --results` checked before anything changes
# ---------------------------------------------------------------------------------------------
def _state(runs):
    """The bytes of every marker and report file of the run: what a refused import must leave alone."""
    return {p: p.read_bytes() for p in sorted((runs / "faults").rglob("*"))
            if p.is_file() and (p.name == "stage.json" or "report" in p.parts or "deploy" in p.parts)}


def _set(results, field, value):
    *parents, last = field.split(".")
    node = results
    for key in parents:
        node = node[key]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value


HOSTILE_RESULTS = {   # field: (value, what the message says)
    "negative latency": ("latency_ms.p90", -5, r"latency_ms\.p90: expected a latency in ms: positive, finite"),
    "accuracy above 1": ("metrics.accuracy", 1.7, r"metrics\.accuracy: expected a number in \[0, 1\], got 1\.7"),
    "accuracy as a word": ("metrics.accuracy", "high", r"metrics\.accuracy: expected a number in \[0, 1\], got \"high\""),
    "NaN": ("metrics.ece", float("nan"), r"metrics\.ece: expected a number in \[0, 1\], got NaN"),
    "Infinity": ("latency_ms.p99", float("inf"), r"latency_ms\.p99: expected a latency in ms: positive, finite.*got Infinity"),
    "1e308": ("latency_ms.max", 1e308, r"latency_ms\.max: expected a latency in ms: positive, finite, at most"),
    "count as a float": ("runs", 300.5, r"runs: expected an integer in 1\.\."),
    "flag as a count": ("metrics.n", True, r"metrics\.n: expected an integer"),
    "unknown key": ("metrics.verdict", "pass", r"metrics\.verdict: unknown key \(not one the runner writes\)"),
    "missing key": ("latency_ms.p90", KeyError, r"latency_ms\.p90: missing \(the runner writes it\)"),
    "percentiles out of order": ("latency_ms.p50", 1e6, r"latency_ms: expected min <= p50 <= p90 <= p99 <= max"),
    "another device's name": ("tags.device", "other-board", r"tags\.device: \"other-board\", but this run's profile "
                                                           r"for flops has \"flops\": results of another device"),
    "another model": ("bundle.model_sha256", "ab" * 32, r"bundle\.model_sha256: (ab){6}\.\.\., but this run's "
                                                        r"choice for flops has .*: results of another bundle's model"),
    "another runtime": ("runtime.name", "tensorrt", r"runtime\.name: \"tensorrt\", but .* has \"onnxruntime\""),
    "another precision": ("bundle.precision", "fp16", r"bundle\.precision: \"fp16\", but .* has \"fp32\""),
    "accuracy raised, bins kept": ("metrics.accuracy", 1.0, r"metrics\.accuracy: expected 0\.\d+, the accuracy of the "
                                                           r"reliability bins, got 1: not the figures the runner"),
    "another schema": ("schema", 999, r"schema: expected 1 \(the schema this edgebayes reads\), got 999"),
}


@pytest.mark.parametrize("case", list(HOSTILE_RESULTS))
def test_hostile_results_are_refused_with_every_marker_and_report_untouched(case, base, runs, tmp_path, capsys):
    field, value, pattern = HOSTILE_RESULTS[case]
    results = json.loads((runs / "faults/deploy/flops/results.json").read_text())
    _set(results, field, value)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))   # json writes NaN and Infinity as Python's json reads them
    before = _state(runs)
    code, _, err = cli(capsys, "report", "--config", base.config, "--device", base.device, "--runs-dir", runs,
                       "--results", path)
    assert code == EXIT_BAD_INPUT and one_line(err), err
    assert re.search(re.escape(f"edgebayes: {path}: ") + pattern, err), err
    assert _state(runs) == before
    # and the run is as it was: pipeline finds every stage done
    out = pipeline(capsys, base, runs)
    assert "deploy: up to date" in out and "report: up to date" in out



def _spread_tail(r):   # the tail moved to the fastest bin: the percentiles no longer match every run's histogram
    r["latency_histogram"]["counts"] = [r["runs"]] + [0] * (len(r["latency_histogram"]["counts"]) - 1)


EDITED_RESULTS = {   # an edit that keeps the schema but not what the runner derives from its own figures
    "ECE lowered": (lambda r: r["metrics"].update(ece=r["metrics"]["ece"] / 2), r"metrics\.ece: expected .*, the ECE "),
    "a bin moved": (lambda r: r["reliability"]["bin_count"].__setitem__(-1, r["reliability"]["bin_count"][-1] + 1),
                    r"reliability\.bin_count: expected counts summing to metrics\.n"),
    "p99 lowered to p90": (lambda r: r["latency_ms"].update(p99=r["latency_ms"]["p50"], p90=r["latency_ms"]["p50"]),
                           r"latency_ms\.p9\d: expected a value in \[.*\] ms, where the histogram of every run"),
    "histogram of other runs": (_spread_tail, r"latency_ms\.p\d\d: expected a value in"),
    "best round better than every round": (lambda r: r["latency_ms_best_round"].update(min=r["latency_ms_best_round"]["min"] / 2),
                                           r"latency_ms_best_round\.min: expected .* from latency_rounds_ms"),
    "throughput doubled": (lambda r: r.update(throughput_per_s=2 * r["throughput_per_s"]),
                           r"throughput_per_s: expected batch_size x runs / seconds"),
    "fewer runs than the protocol": (lambda r: r["protocol"].update(min_runs=r["runs"] + 1), r"runs: expected at least"),
    "selective curve of another set": (lambda r: r["selective"].update(n=r["selective"]["n"] + 1), r"selective: expected"),
    "selective accuracy null": (lambda r: r["selective"]["accuracy"].__setitem__(0, None), r"selective: expected"),
    "selective accuracy empty": (lambda r: r["selective"].update(accuracy=[]), r"selective: expected"),
}


@pytest.mark.parametrize("case", list(EDITED_RESULTS))
def test_results_whose_figures_disagree_with_each_other_are_refused(case, base, tmp_path):
    """What the runner derives (accuracy and ECE from the bins, percentiles from every run, the best round
    from the rounds) is recomputed: an edited file is not shown as the board's figures. The runner's own
    file passes (the guard against a check that refuses everything)."""
    from edgebayes.deploy.results import ResultsError, read_results

    results = json.loads((base.runs / "faults/deploy/flops/results.json").read_text())
    assert read_results(base.runs / "faults/deploy/flops/results.json") == results
    if case == "p99 lowered to p90":   # only an edit when the tail is not in the median's bin
        hist = results["latency_histogram"]
        assert results["latency_ms"]["p99"] > results["latency_ms"]["p50"] * (1 + 2 * (hist["edges_ms"][1] / hist["edges_ms"][0] - 1))
    edit, pattern = EDITED_RESULTS[case]
    edit(results)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    with pytest.raises(ResultsError) as caught:
        read_results(path)
    assert re.search(re.escape(f"{path}: ") + pattern, str(caught.value)), caught.value

@pytest.mark.parametrize("kind", ["FIFO", "/dev/zero", "9 MB", "a folder"])
def test_results_that_are_not_a_small_regular_file_are_refused_at_once(kind, base, runs, tmp_path):
    path = {"/dev/zero": Path("/dev/zero")}.get(kind, tmp_path / "results.json")
    if kind == "FIFO":
        os.mkfifo(path)
    elif kind == "9 MB":
        path.write_text(" " * (9 << 20) + "{}")
    elif kind == "a folder":
        path.mkdir()
    before = _state(runs)
    proc = subprocess.run([sys.executable, "-m", "edgebayes.cli", "report", "--config", str(base.config), "--device",
                           str(base.device), "--runs-dir", str(runs), "--results", str(path)],
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_BAD_INPUT and one_line(proc.stderr), proc.stderr
    assert f"edgebayes: {path}: " in proc.stderr
    assert ("larger than 8 MB" if kind == "9 MB" else "not a regular file") in proc.stderr
    assert _state(runs) == before


def test_another_devices_results_are_not_reported_as_the_boards(base, runs, tmp_path, capsys):
    """The issue's case: this machine's onnxruntime results imported for the Jetson (TensorRT fp16) were
    reported as its measured pass. Refused, and the Jetson's report of predictions stays as it was."""
    code, out, err = cli(capsys, "pipeline", "--config", base.config, "--device", "jetson", "--runs-dir", runs)
    assert code == 4, err
    # the page says whose figures these are: the engine's ONNX in onnxruntime here, not the fp16 engine (probe)
    html = (runs / "faults/report/jetson-orin-nano/report.html").read_text()
    assert "figures are the bundle&#x27;s tensorrt-fp16 run with onnxruntime on this machine (the engine is built " \
           "on the device" in html and "tensorrt-fp16 (onnxruntime on the shipped ONNX" in html
    before = _state(runs)
    code, _, err = cli(capsys, "report", "--config", base.config, "--device", "jetson", "--runs-dir", runs,
                       "--results", runs / "faults/deploy/flops/results.json")
    assert code == EXIT_BAD_INPUT and one_line(err), err
    assert re.search(r"bundle\.artifact: \"onnx\", but this run's choice for jetson-orin-nano has \"tensorrt-fp16\": "
                     r"results of another artifact", err), err
    assert _state(runs) == before and not (runs / "faults/deploy/jetson-orin-nano/stage.json").exists()


# ---------------------------------------------------------------------------------------------
# Issue 36, item 1: a device shared by many runs
# ---------------------------------------------------------------------------------------------
def _ssh_board(path, sshd, workdir):
    return write_device(path, connection={
        "kind": "ssh", "host": "127.0.0.1", "port": sshd.port, "identity_file": str(sshd.client_key),
        "python": sys.executable, "workdir": str(workdir),
        "options": [f"UserKnownHostsFile={sshd.known_hosts}", "StrictHostKeyChecking=yes", "IdentitiesOnly=yes"]})


def test_two_runs_deploying_to_one_device_at_once_each_report_their_own_model(base, runs, sshd, tmp_path):
    """The issue's case: two configs deployed to one SSH device at once, and one run's report showed the
    other's model (one work folder for all). Each run and bundle now has a folder of its own there, and
    the results name the model measured, checked against the bundle."""
    board = _ssh_board(tmp_path / "board.yaml", sshd, tmp_path / "board-disk")
    other = yaml.safe_load(base.config.read_text())
    other.update(name="faults-b")
    other["select"].update(knob_values=[0.9], mc_samples=[1])
    other["export"]["opset"] = 16                   # a different model file whatever the choice
    config_b = tmp_path / "b.yaml"
    config_b.write_text(yaml.safe_dump(other))
    shutil.copytree(runs / "faults/train", runs / "faults-b/train")   # the same training (name is not in it)
    procs = [subprocess.Popen([sys.executable, "-m", "edgebayes.cli", "pipeline", "--config", str(c), "--device",
                               str(board), "--runs-dir", str(runs)], env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for c in (base.config, config_b)]
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, (out, err)
        assert "train: up to date" in out
    for name in ("faults", "faults-b"):
        run = runs / name
        manifest = json.loads((run / "export/board/bundle/manifest.json").read_text())
        results = json.loads((run / "deploy/board/results.json").read_text())
        report = json.loads((run / "report/board/report.json").read_text())
        own = manifest["files"][manifest["model_file"]]["sha256"]
        assert results["bundle"]["model_sha256"] == own
        assert report["results"]["metrics"]["accuracy"] == manifest["reference"]["accuracy"]
    shas = {json.loads((runs / n / "deploy/board/results.json").read_text())["bundle"]["model_sha256"]
            for n in ("faults", "faults-b")}
    assert len(shas) == 2
    assert list((tmp_path / "board-disk" / "runs").iterdir()) == []   # each run's folder removed after


def test_two_latency_tables_measured_on_one_device_at_once(base, tmp_path):
    """Two `devices profile` on one device: they shared one timing folder (KeyError: 'onnx-w4x4-m1').
    Each now sends its models to a folder of its own, and the runner's timing lock makes one wait."""
    device = write_device(tmp_path / "shared.yaml", latency_model={"kind": "measure"})
    runs = tmp_path / "runs"
    procs = [subprocess.Popen([sys.executable, "-m", "edgebayes.cli", "devices", "profile", str(device), "--config",
                               str(base.config), "--runs-dir", str(runs)], env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        assert "table written to" in out
    table = json.loads((runs / "devices/shared/latency_table.json").read_text())
    assert len(table["rows"]) == len({row["id"] for row in table["rows"]}) > 0
    assert all(row["latency_ms"]["p50"] > 0 for row in table["rows"])
    assert list((runs / "devices/shared/device/runs").iterdir()) == []


def test_a_runner_waits_for_another_timing_on_the_device_then_fails_in_one_line(base, tmp_path, monkeypatch):
    import tempfile

    from edgebayes.ondevice.machine import timing_lock

    bundle = base.runs / "faults/export/flops/bundle"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))       # this test's own machine-wide folder
    with timing_lock(10):
        proc = subprocess.run([sys.executable, str(bundle / "runner.pyz"), "--bundle", str(bundle), "--out",
                               str(tmp_path / "r.json"), "--min-runs", "5", "--min-seconds", "0",
                               "--lock-wait-s", "0.5"], env={**ENV, "TMPDIR": str(tmp_path)},
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4, proc.stderr
    assert re.search(r"runner: another edgebayes run \(pid \d+ on .+\) has been timing models on this device for "
                     r"more than 0\.5 s; run again when it is done\n$", proc.stderr), proc.stderr
    assert "waiting for another edgebayes run" in proc.stderr and not (tmp_path / "r.json").exists()


def test_the_runner_names_the_model_it_measured_and_refuses_one_replaced_meanwhile(base, tmp_path, monkeypatch,
                                                                                   capsys):
    from edgebayes.ondevice import cli as runner
    from edgebayes.ondevice.bundle import sha256_file

    bundle = tmp_path / "bundle"
    shutil.copytree(base.runs / "faults/export/flops/bundle", bundle)
    args = ["--bundle", str(bundle), "--out", str(tmp_path / "r.json"), "--min-runs", "5", "--min-seconds", "0",
            "--warmup", "1", "--rounds", "1", "--quiet"]
    assert runner.main(args) == 0
    assert json.loads((tmp_path / "r.json").read_text())["bundle"]["model_sha256"] == sha256_file(bundle / "model.onnx")
    (tmp_path / "r.json").unlink()
    load = runner.make_backend

    def load_then_replace(runtime, path, *a, **k):   # another run writing the same folder meanwhile
        backend = load(runtime, path, *a, **k)
        flip_byte(Path(path))
        return backend
    monkeypatch.setattr(runner, "make_backend", load_then_replace)
    capsys.readouterr()
    assert runner.main(args) == 2
    assert "model.onnx changed after the bundle was verified" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


# ---------------------------------------------------------------------------------------------
# Issue 36, item 4: selection decides on what the validation split can tell apart
# ---------------------------------------------------------------------------------------------
def _scored(ident, probs, y, m, latency, mb, fmt="onnx"):
    """A candidate as score_candidates writes it, and its per-example evidence."""
    from edgebayes.ondevice.metrics import classification_metrics, per_example

    c = {"id": ident, "knob": "nonzero_rate", "knob_value": 0.5, "mc_samples": m, "format": fmt, "precision": "fp32",
         "val": classification_metrics(probs, y), "cost": {"latency_ms": latency, "model_mb": mb},
         "fits": True, "violations": []}
    return c, per_example(probs, y)


def _val_probs(n=5000, classes=10, accuracy=0.97, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    logits = rng.normal(0, 1, (n, classes))
    right = rng.random(n) < accuracy
    logits[np.arange(n), np.where(right, y, (y + 1) % classes)] += 4.0
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    return probs, y


def test_differences_within_the_validation_noise_go_to_the_cheaper_candidate():
    """The issue's MNIST case on synthetic candidates: every candidate at one accuracy, the fp32 ONNX's NLL
    lower in the 10th digit than the codebook file of the same sample (24x smaller), M=2 better than M=1 by
    an NLL of 3e-5 on 5,000 images. Ties all: the cheapest ships (M=1, then the smaller file), and the
    choice lists the tied candidates."""
    from edgebayes.config import Budgets
    from edgebayes.deploy.selection import choose

    probs, y = _val_probs()
    sharper = probs ** 1.0005 / (probs ** 1.0005).sum(1, keepdims=True)      # NLL 3e-5 lower, same argmax
    nudged = probs * (1 + 1e-10)
    scored = [_scored("m2-onnx", sharper, y, 2, 0.050, 0.72), _scored("m2-codebook", sharper * (1 + 1e-10), y, 2, 0.049, 0.030, "onnx-codebook"),
              _scored("m1-onnx", nudged, y, 1, 0.030, 0.36), _scored("m1-codebook", probs, y, 1, 0.0301, 0.015, "onnx-codebook")]
    candidates, evidence = [c for c, _ in scored], {c["id"]: e for c, e in scored}
    assert len({c["val"]["accuracy"] for c in candidates}) == 1
    assert candidates[0]["val"]["nll"] < candidates[3]["val"]["nll"] < candidates[3]["val"]["nll"] + 1e-4
    choice = choose(candidates, "accuracy", Budgets(), evidence=evidence)
    assert choice["best_by_objective"] in ("m2-onnx", "m2-codebook")
    assert choice["candidate"]["id"] == "m1-codebook"
    assert set(choice["tied"]) == {c["id"] for c in candidates} and all(c["tied_with_best"] for c in candidates)
    assert "tied with the chosen: " in choice["reason"] and "m2-onnx" in choice["reason"]
    assert "paired bootstrap over 5000 images" in choice["reason"]
    # the same figures without the per-example evidence: only identical figures tie, the NLL decides
    assert choose(candidates, "accuracy", Budgets())["candidate"]["id"] in ("m2-onnx", "m2-codebook")


def test_a_difference_the_validation_split_can_tell_is_not_a_tie():
    """Accuracy 0.97 against 0.95 on 5,000 images (about 4 standard errors of the paired difference): the
    better candidate wins although it needs more samples and a bigger file; so does a clearly better NLL."""
    from edgebayes.config import Budgets
    from edgebayes.deploy.selection import choose

    probs, y = _val_probs(accuracy=0.97)
    worse = probs.copy()
    rng = np.random.default_rng(1)
    flip = rng.choice(np.flatnonzero(worse.argmax(1) == y), 100, replace=False)   # 2% more errors
    worse[flip] = np.roll(worse[flip], 1, axis=1)
    scored = [_scored("good-m4", probs, y, 4, 0.2, 1.0), _scored("cheap-m1", worse, y, 1, 0.05, 0.1)]
    choice = choose([c for c, _ in scored], "accuracy", Budgets(), evidence={c["id"]: e for c, e in scored})
    assert choice["candidate"]["id"] == "good-m4" and choice["tied"] == ["good-m4"]
    assert "no other candidate within the validation split's noise" in choice["reason"]
    # a clearly better NLL at the same accuracy: calibration the split can see
    soft = probs ** 0.5 / (probs ** 0.5).sum(1, keepdims=True)
    scored = [_scored("sharp-m4", probs, y, 4, 0.2, 1.0), _scored("soft-m1", soft, y, 1, 0.05, 0.1)]
    assert scored[0][0]["val"]["accuracy"] == scored[1][0]["val"]["accuracy"]
    choice = choose([c for c, _ in scored], "nll", Budgets(), evidence={c["id"]: e for c, e in scored})
    assert choice["candidate"]["id"] == "sharp-m4"


def test_a_paired_difference_on_a_small_split_is_not_tied_away_by_the_unpaired_noise():
    """300 validation images, the cheaper candidate wrong on 6 more of them (2 points, the paired interval
    excludes 0) but within the best's own unpaired 95% half-width (about 3 points): worse, not tied. The
    rule that also asked for more than that half-width shipped M = 2 where the budget allowed a better M = 4."""
    from edgebayes.config import Budgets
    from edgebayes.deploy.selection import choose

    probs, y = _val_probs(n=300, accuracy=0.92, seed=3)
    worse = probs.copy()
    rng = np.random.default_rng(4)
    flip = rng.choice(np.flatnonzero(worse.argmax(1) == y), 6, replace=False)
    worse[flip] = np.roll(worse[flip], 1, axis=1)
    acc = (probs.argmax(1) == y).mean()
    assert 6 / 300 < 1.96 * np.sqrt(acc * (1 - acc) / 300)     # within the unpaired noise of the best's figure
    scored = [_scored("m4", probs, y, 4, 0.2, 1.0), _scored("m2", worse, y, 2, 0.1, 1.0)]
    choice = choose([c for c, _ in scored], "accuracy", Budgets(), evidence={c["id"]: e for c, e in scored})
    assert choice["candidate"]["id"] == "m4" and choice["tied"] == ["m4"]


def test_a_failed_rerun_leaves_no_report_of_the_earlier_run(base, runs, tmp_path, capsys):
    """The profile changed (another budget) and the runner now fails: exit 1, and the earlier run's report,
    which said pass for the old profile, is withdrawn, not left describing what the stages no longer hold (probe).
    The device's python runs everything but the bundle, which crashes it."""
    report = runs / "faults/report/flops"
    assert json.loads((report / "report.json").read_text())["summary"]["overall_verdict"] == "pass"
    broken = tmp_path / "python"
    broken.write_text(f"#!/bin/sh\nfor a in \"$@\"; do [ \"$a\" = --bundle ] && exit 139; done\nexec {sys.executable} \"$@\"\n")
    broken.chmod(0o755)
    device = write_device(tmp_path / "flops.yaml", budgets={"model_mb": 4.0}, connection={"python": str(broken)})
    code, _, err = cli(capsys, "pipeline", "--config", base.config, "--device", device, "--runs-dir", runs)
    assert code == 1, err
    assert not (report / "report.json").exists() and not (report / "report.html").exists()
    # the comparison page still lists the device, its withdrawn figures marked so
    code, out, err = cli(capsys, "report", "--config", base.config, "--runs-dir", runs, "--devices", device)
    assert code == 3, err   # a stale report's verdict is of an earlier choice: not a pass
    assert "flops.yaml's report is stale, marked so on the page: withdrawn" in out
    page = (runs / "faults/report/devices.html").read_text()
    assert "flops/report.html" not in page   # the withdrawn report's page is gone: no link to it


def test_a_failed_training_rerun_withdraws_the_report_too(tmp_path, monkeypatch):
    """train is a stage before the report as much as select: a changed training that failed left the old
    report saying pass (review). Its JSON is kept as report.withdrawn.json until a report replaces it."""
    from edgebayes import stages
    from edgebayes.config import load_device_profile, load_pipeline_config
    from edgebayes.errors import StageError

    ctx = stages.Context(load_pipeline_config(ROOT / "pipeline.yaml"), load_device_profile("local"),
                         runs_dir=tmp_path, log=lambda *a: None)
    report = ctx.stage_dir("report")
    other = report.parent / "other-board"   # the training is every device's: all their reports go
    for folder in (report, other):
        folder.mkdir(parents=True)
        (folder / "report.json").write_text('{"summary": {"overall_verdict": "pass"}}')
        (folder / "report.html").write_text("pass")
        (folder / "reliability.png").write_bytes(b"png")   # the report's plots go with it (probe); a user's file stays
        (folder / "notes.txt").write_text("mine")
        (folder / "stage.json").write_text(json.dumps({"outputs": {n: "x" for n in ("report.json", "report.html",
                                                                                   "reliability.png", "../x")}}))

    def failing(ctx):
        raise StageError("train: diverged")

    monkeypatch.setitem(stages.RUNNERS, "train", failing)
    with pytest.raises(StageError, match="diverged"):
        stages.run_stage(ctx, "train")
    for folder in (report, other):
        assert sorted(p.name for p in folder.iterdir()) == ["notes.txt", "report.withdrawn.json"]


# ---------------------------------------------------------------------------------------------
# Issue 36, item 6: a stage owns only the files it writes
# ---------------------------------------------------------------------------------------------
def test_files_a_user_puts_in_a_stage_folder_are_neither_recorded_nor_removed(base, runs, capsys):
    report = runs / "faults/report/flops"
    (report / "notes.txt").write_text("what I saw")
    (report / ".mine").write_text("hidden, mine too")
    (report / ".report.json.abcd1234.tmp").write_text("an interrupted write")   # edgebayes's temporary
    code, out, err = cli(capsys, "report", "--config", base.config, "--device", base.device, "--runs-dir", runs,
                         "--force")
    assert code == 0, err
    marker = json.loads((report / "stage.json").read_text())
    assert "notes.txt" not in marker["outputs"] and "report.json" in marker["outputs"]
    assert (report / "notes.txt").read_text() == "what I saw" and (report / ".mine").exists()
    assert not (report / ".report.json.abcd1234.tmp").exists()
    (report / "notes.txt").write_text("edited")     # the user's file changing is not the stage's output changing
    out = pipeline(capsys, base, runs)
    assert "report: up to date" in out and (report / "notes.txt").read_text() == "edited"


# ---------------------------------------------------------------------------------------------
# Issue 36, item 7: a stage's fingerprint covers the code it runs
# ---------------------------------------------------------------------------------------------
def test_editing_report_code_reruns_the_report_not_training(base, runs, tmp_path):
    """The same run with a copy of edgebayes whose report (then deploy) code was edited: only what runs
    that code runs again. Training's hash moves with training's own code."""
    src = tmp_path / "src"
    shutil.copytree(Path(edgebayes.__file__).resolve().parent, src / "edgebayes",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {**ENV, "PYTHONPATH": str(src)}

    def run_with_edit(module):
        with open(src / "edgebayes" / module, "a") as f:
            f.write("\n# an edit\n")
        proc = subprocess.run([sys.executable, "-m", "edgebayes.cli", "pipeline", "--config", str(base.config),
                               "--device", str(base.device), "--runs-dir", str(runs)], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    out = run_with_edit("deploy/summary.py")
    assert all(f"{s}: up to date" in out for s in ("train", "select", "export", "deploy"))
    assert "report: running (config, device profile or code changed)" in out
    out = run_with_edit("deploy/results.py")
    assert all(f"{s}: up to date" in out for s in ("train", "select", "export"))
    assert "deploy: running (config, device profile or code changed)" in out
    probe = ("import sys; from edgebayes.stages import stage_code; print(stage_code('train'))")
    before = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True).stdout
    with open(src / "edgebayes/train/kl.py", "a") as f:
        f.write("\n# an edit\n")
    after = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True).stdout
    assert before.strip() and before != after


# ---------------------------------------------------------------------------------------------
# Issue 36, item 9: what was a traceback is one line naming the file, exit 2
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["non-UTF-8 byte", "100,000 levels deep", "a FIFO", "9 MB"])
def test_unreadable_configs_are_one_line_naming_the_file(case, tmp_path):
    config = tmp_path / "p.yaml"
    if case == "non-UTF-8 byte":
        config.write_bytes(b"name: x\nseed: 0\n# caf\xe9\n")
        expected = r": line 3: byte 0xe9 is not UTF-8 text; save the file as UTF-8"
    elif case == "100,000 levels deep":
        config.write_text("a: " + "[" * 100_000 + "]" * 100_000 + "\n")
        expected = r": line 1: nested more than 64 levels deep"
    elif case == "a FIFO":
        os.mkfifo(config)
        expected = r": not a regular file"
    else:
        config.write_text("#" * (9 << 20) + "\n")
        expected = r": larger than 4 MB; not a config"
    proc = subprocess.run([sys.executable, "-m", "edgebayes.cli", "train", "--config", str(config), "--runs-dir",
                           str(tmp_path / "runs")], env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_BAD_INPUT and one_line(proc.stderr), proc.stderr[-2000:]
    assert re.search(re.escape(f"edgebayes: {config}") + expected, proc.stderr), proc.stderr
    assert not (tmp_path / "runs").exists()


def _image_folder(root, odd=None):
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(4):
            Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8)).save(root / c / f"{i}.png")
    if odd == "bomb":       # 20000 x 20000: over PIL's decompression-bomb limit (a 1-bit image: a small file)
        Image.new("1", (20000, 20000)).save(root / "a" / "huge.png")
        return root / "a" / "huge.png"
    if odd == "truncated":  # cut after its header: the size reads, the pixels do not
        data = (root / "b" / "0.png").read_bytes()
        (root / "b" / "0.png").write_bytes(data[:60])
        return root / "b" / "0.png"


@pytest.mark.parametrize("case", ["decompression bomb", "truncated PNG", "FIFO as data.path", "/dev/zero as data.path"])
def test_unreadable_data_is_one_line_naming_the_file(case, tmp_path, capsys):
    data = {"dataset": "image-folder", "path": str(tmp_path / "images"), "ood": None}
    if case == "decompression bomb":
        bad = _image_folder(tmp_path / "images", "bomb")
        expected = re.escape(f"{bad}: not a readable image (") + ".*decompression bomb"
    elif case == "truncated PNG":
        bad = _image_folder(tmp_path / "images", "truncated")
        expected = re.escape(f"{bad}: not a readable image (")
    elif case == "FIFO as data.path":
        os.mkfifo(tmp_path / "data.npz")
        data.update(dataset="npz", path=str(tmp_path / "data.npz"))
        expected = r"reads a file, got something else \(a FIFO or a device: not a regular file\)"
    else:
        data.update(dataset="npz", path="/dev/zero")
        expected = r"reads a file, got something else \(a FIFO or a device: not a regular file\)"
    config = write_config(tmp_path / "c.yaml", data=data)
    code, _, err = cli(capsys, "train", "--config", config, "--runs-dir", tmp_path / "runs")
    assert code == EXIT_BAD_INPUT and one_line(err), err[-3000:]
    assert re.search(expected, err, re.IGNORECASE), err


# ---------------------------------------------------------------------------------------------
# Issue 36, item 8: the throwaway sshd shared by commands at once; SIGTERM as Ctrl-C
# ---------------------------------------------------------------------------------------------
def _listening(port):
    import socket
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


@pytest.mark.skipif(shutil.which("sshd") is None and not Path("/usr/sbin/sshd").exists(), reason="no sshd binary")
def test_two_commands_at_once_share_one_throwaway_sshd_and_the_last_stops_it(tmp_path):
    from edgebayes.deploy import localsshd

    keys, port = tmp_path / "sshd", localsshd.free_port()
    device = write_device(tmp_path / "own.yaml", connection={
        "kind": "ssh", "local_sshd": True, "host": "127.0.0.1", "port": port,
        "identity_file": str(keys / "client_key"), "python": sys.executable, "workdir": str(tmp_path / "disk"),
        "options": [f"UserKnownHostsFile={keys / 'known_hosts'}", "StrictHostKeyChecking=yes", "IdentitiesOnly=yes"]})
    procs = [subprocess.Popen([sys.executable, "-m", "edgebayes.cli", "devices", "check", str(device)], env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and "ready to deploy" in out, err
    assert not _listening(port) and localsshd._sshd_pids(keys) == []


@pytest.mark.skipif(shutil.which("sshd") is None and not Path("/usr/sbin/sshd").exists(), reason="no sshd binary")
def test_a_stale_sshd_without_its_pid_file_is_found_and_stopped(tmp_path):
    from edgebayes.deploy import localsshd

    server = localsshd.start(tmp_path / "sshd")
    (tmp_path / "sshd/sshd.pid").unlink()                  # what a lost race left: no pid file
    assert server.pid in localsshd._sshd_pids(tmp_path / "sshd")   # (and the children of a connection, if any)
    proc = subprocess.run([sys.executable, "-m", "edgebayes.deploy.localsshd", "stop", "--dir", str(tmp_path / "sshd")],
                          env=ENV, capture_output=True, text=True, timeout=60)   # make sshd-localhost-stop
    assert proc.returncode == 0, proc.stderr
    assert not _listening(server.port) and localsshd._sshd_pids(tmp_path / "sshd") == []


def test_sigterm_during_training_is_one_line_and_exit_143(base, runs):
    proc = start(base, runs, "train", "--config", str(base.config), "--force")
    wait_for_epoch(proc, runs / "faults/train/checkpoint.pt", 2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert err.decode().splitlines()[-1] == "edgebayes: terminated (SIGTERM); run again to resume"
    assert "Traceback" not in err.decode()


# ---------------------------------------------------------------------------------------------
# Issue 36, item 5: every budget outcome is a verdict with a report
# ---------------------------------------------------------------------------------------------
def test_no_operating_point_fitting_is_exit_3_with_a_report_of_every_candidate(base, runs, tmp_path, capsys):
    device = write_device(tmp_path / "tight.yaml", budgets={"latency_ms": 1e-6})
    code, out, err = cli(capsys, "pipeline", "--config", base.config, "--device", device, "--runs-dir", runs)
    assert code == 3, err
    assert "select: no operating point fits the device budgets; closest candidates:" in out
    assert "no fit        no operating point fits the budgets" in out and "verdict       fail (predicted), exit code 3" in out
    assert re.search(r"no fit .*not deployed \(latency p90 [0-9.]+ ms > budget 1e-06 ms\)", out)   # says which
    report = json.loads((runs / "faults/report/tight/report.json").read_text())
    s = report["summary"]
    assert s["no_fit"] and s["overall_verdict"] == "fail"
    # after the FLOPs target, thresholds 0.5 and 0.9 keep the same units: one network per M, each scored once
    assert sorted((c["knob_value"], c["mc_samples"]) for c in report["candidates"]) == [(0.5, 1), (0.5, 2)]
    assert "select: inclusion_threshold 0.9 keep the same units as 0.5: that network is scored once" in out
    assert all(not c["fits"] and "> budget 1e-06 ms" in c["violations"][0] for c in report["candidates"])
    assert not (runs / "faults/deploy/tight/results.json").exists()          # nothing deployed
    assert "No operating point fits" in (runs / "faults/report/tight/report.html").read_text()
    # cached: the same verdict; `select` alone says so with exit 3 too
    code, out, err = cli(capsys, "pipeline", "--config", base.config, "--device", device, "--runs-dir", runs)
    assert code == 3 and "report: up to date" in out, err
    assert cli(capsys, "select", "--config", base.config, "--device", device, "--runs-dir", runs)[0] == 3
    code, _, err = cli(capsys, "deploy", "--config", base.config, "--device", device, "--runs-dir", runs)
    assert code == 1 and "no operating point fits the budgets of tight: nothing to deploy" in err


def test_a_no_fit_report_gives_the_latency_select_measured_on_the_device(base, runs, tmp_path, capsys):
    """A reachable board timed at selection (latency_model measure, no table): its no-fit report gives the
    closest candidate's measured latency, as select judged it (it said "latency n/a (no prediction)")."""
    device = write_device(tmp_path / "tightm.yaml", budgets={"latency_ms": 1e-6}, latency_model={"kind": "measure"})
    code, out, err = cli(capsys, "pipeline", "--config", base.config, "--device", device, "--runs-dir", runs)
    assert code == 3, err
    assert re.search(r"latency       p90 [0-9.]+ [um]s \(measured on the device at selection\)", out), out
    assert re.search(r"budget        latency [0-9.]+ [um]s > 0.001 us: fail\n", out), out
    row = json.loads((runs / "faults/report/tightm/report.json").read_text())["summary"]["budgets"]["latency_ms"]
    assert row["measured"] > 0 and row["basis"] == "measured" and row["measured_as"].endswith("at selection")
    # the page says so too: the board was reached, and the headline's latency is the selection's measurement
    html = (runs / "faults/report/tightm/report.html").read_text()
    assert "No operating point fits the budgets of tightm: nothing was deployed" in html
    assert "could not be reached" not in html and "To finish on the device" not in html
    assert "latency (measured at selection)" in html and "select timed it on the device" in html


def test_a_board_measured_before_and_unreachable_now_gets_exit_4_and_predictions(base, runs, sshd, tmp_path, capsys):
    """Measured over ssh, then the config changes while the board is down: a report of predictions and exit
    4 (it was exit 1, "deploy/stage.json is missing", with the old measured report left as it was)."""
    from edgebayes.deploy import localsshd

    board = _ssh_board(tmp_path / "board.yaml", sshd, tmp_path / "board-disk")
    assert cli(capsys, "pipeline", "--config", base.config, "--device", board, "--runs-dir", runs)[0] == 0
    profile = yaml.safe_load(board.read_text())
    profile["connection"].update(port=localsshd.free_port(), connect_timeout_s=5)     # down now
    board.write_text(yaml.safe_dump(profile))
    changed = yaml.safe_load(base.config.read_text())
    changed["benchmark"]["min_runs"] = 21
    config = tmp_path / "changed.yaml"
    config.write_text(yaml.safe_dump(changed))
    code, out, err = cli(capsys, "pipeline", "--config", config, "--device", board, "--runs-dir", runs)
    assert code == 4, err
    assert "host unreachable" in out and "(predicted), exit code 4" in out
    assert json.loads((runs / "faults/report/board/report.json").read_text())["summary"]["mode"] == "predicted"
