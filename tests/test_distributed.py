"""Two CPU processes (gloo, DDP) against one: the ELBO's scaling across processes (train/distributed.py).

- dnn (a deterministic forward), through the user's command: `edgebayes train` with train.processes: 2
  relaunches itself under torchrun and ends with the parameters of the one-process run, to float tolerance.
- ss-gl with the training noise made identical (zero) in every process: the same, KL terms included; a
  run whose KL were counted twice (kl_weight 2) lands far from both, so the comparison can fail.
- ss-ig with each process's own noise: resuming a two-process run from its checkpoint gives exactly the
  uninterrupted two-process run (every process's RNG state is in the checkpoint).
"""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
import _ddp_worker as worker  # noqa: E402

from edgebayes.cli import main  # noqa: E402
from edgebayes.config import ConfigError, load_pipeline_config  # noqa: E402
from edgebayes.data import load_data  # noqa: E402
from edgebayes.train.families import fit  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"
QUIET = dict(log=lambda *_: None)


def _assert_close(a, b, atol):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), atol=atol, rtol=0), (k, (a[k] - b[k]).abs().max())


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """The worker's trainings in two gloo processes (one torchrun launch for all of them)."""
    out = tmp_path_factory.mktemp("ddp")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(Path(worker.__file__)), str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out / "results.pt", weights_only=True)


def test_dnn_two_processes_through_the_cli_match_one(tmp_path):
    runs = {}
    for processes in (1, 2):
        cfg = {"name": "ddp", "seed": 0, "model": {"family": "dnn", "hidden": [16, 16]},
               "train": {"epochs": 3, "batch_size": 128, "lr": 3e-3, "device": "cpu", "mc_samples_eval": 1,
                         "mc_samples_val": 1, "processes": processes}}
        path = tmp_path / f"p{processes}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        assert main(["train", "--config", str(path), "--runs-dir", str(tmp_path / f"runs{processes}")]) == 0
        runs[processes] = tmp_path / f"runs{processes}" / "ddp" / "train"
    one, two = (torch.load(runs[p] / "checkpoint.pt", weights_only=True) for p in (1, 2))
    _assert_close(one["model"], two["model"], atol=1e-5)
    assert one["model"]["net.hidden1.weight"].abs().sum() > 0
    assert [h["loss"] for h in two["history"]] == pytest.approx([h["loss"] for h in one["history"]], rel=1e-5)
    assert len(two["rng_states"]) == 2 and len(one["rng_states"]) == 1
    for name in ("metrics.json", "stage.json", "run.json"):  # process 0 wrote the stage's files
        assert (runs[2] / name).is_file(), name


def test_bayesian_two_processes_match_one_when_the_noise_is_identical(two_processes, tmp_path):
    splits = load_data(worker.PipelineConfig().data, 0)
    cfg = worker.config("ss-gl", 3)
    with worker.zero_noise():
        one, one_history = fit(cfg, splits, tmp_path / "one.pt", **QUIET)
        double_kl = copy.deepcopy(cfg)
        double_kl.train.kl_weight = 2.0
        wrong, _ = fit(double_kl, splits, tmp_path / "kl2.pt", **QUIET)
    two, two_history = two_processes["ss-gl zero noise"]
    _assert_close(one.state_dict(), two, atol=1e-5)
    assert [h["kl"] for h in two_history] == pytest.approx([h["kl"] for h in one_history], rel=1e-5)
    assert [h["loss"] for h in two_history] == pytest.approx([h["loss"] for h in one_history], rel=1e-5)
    # The check has teeth: the KL counted twice moves the parameters by far more than the tolerance.
    gap = max((wrong.state_dict()[k] - two[k]).abs().max().item() for k in two)
    assert gap > 1e-3


def test_two_process_resume_matches_the_uninterrupted_run(two_processes):
    straight, straight_history = two_processes["ss-ig straight"]
    resumed, resumed_history = two_processes["ss-ig resumed"]
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k
    assert [h["epoch"] for h in resumed_history] == [1, 2, 3]


def test_processes_are_validated(tmp_path):
    for train_cfg, key in (({"processes": 0}, "train.processes"),
                           ({"processes": 4, "batch_size": 2}, "train.batch_size")):
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump({"train": train_cfg}))
        with pytest.raises(ConfigError, match=f"{path}: {key}"):
            load_pipeline_config(path)
    path.write_text(yaml.safe_dump({"model": {"family": "sqs"}, "train": {"processes": 2}}))
    with pytest.raises(ConfigError, match=f"{path}: train.processes"):
        load_pipeline_config(path)
    # eb.fit took processes=2, then trained in one process without a word (probe)
    import edgebayes as eb
    from torch import nn

    net = eb.bayesianize(nn.Sequential(nn.Flatten(), nn.Linear(4, 2)), "ss-gl", input_shape=(4,), n_train=8)
    with pytest.raises(ConfigError, match=r"fit: processes: fit trains in this process; for 2 processes run "
                                          r"`edgebayes train` with train.processes: 2"):
        eb.fit(net, torch.randn(8, 4), torch.arange(8) % 2, epochs=1, processes=2)



def _tiny(tmp_path, processes, epochs=3):
    cfg = {"name": "ddp", "seed": 0, "model": {"family": "dnn", "hidden": [16, 16]},
           "train": {"epochs": epochs, "batch_size": 128, "lr": 3e-3, "device": "cpu", "mc_samples_eval": 1,
                     "mc_samples_val": 1, "processes": processes}}
    path = tmp_path / f"p{processes}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_launch_variables_left_in_the_shell_are_not_a_launch(tmp_path, monkeypatch, capsys):
    """WORLD_SIZE / RANK / MASTER_* from another job in the user's shell: the pipeline waited forever in
    init_process_group for processes that never came (train.processes 1), or trained one process where the
    config said 2, with no lock (probe). Only torchrun's own launch counts."""
    from edgebayes.train import distributed

    for key, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29533"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert not distributed.launched() and distributed.is_main_process()
    assert main(["train", "--config", str(_tiny(tmp_path, 1)), "--runs-dir", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert "train: WORLD_SIZE, RANK, LOCAL_RANK set in the environment, but torchrun did not start this process: " \
           "ignored" in out
    assert (tmp_path / "runs/ddp/train/stage.json").is_file()   # RANK=1 did not make it a process that writes nothing


def _processes_of(runs):
    """pids of the processes whose command line names `runs`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(runs).encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; the parent-death signal is Linux's")
@pytest.mark.parametrize("signal_name, code", [("SIGTERM", 143), ("SIGKILL", -9), ("SIGINT twice", 130)])
def test_a_signal_to_the_launching_process_alone_stops_the_training_processes(signal_name, code, tmp_path):
    """SIGTERM (a scheduler's, `kill`) or SIGKILL to `edgebayes train` alone: it exited and its two training
    processes trained on, orphaned and unlocked, and wrote stage.json after the command said it stopped (probe).
    torchrun's log folder in the temporary directory goes with them: after SIGKILL one was left a run (review)."""
    import signal
    import time

    runs, temp = tmp_path / "runs", tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1", "TMPDIR": str(temp)}
    proc = subprocess.Popen([sys.executable, "-m", "edgebayes.cli", "train", "--config", str(_tiny(tmp_path, 2, 400)),
                             "--runs-dir", str(runs)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    for line in proc.stdout:   # the workers are training
        if "train: epoch 1/400" in line:
            break
    else:
        pytest.fail(f"no epoch ended (exit {proc.wait()})")
    os.kill(proc.pid, getattr(signal, signal_name.split()[0]))
    if signal_name.endswith("twice"):   # an impatient user: the second one killed torchrun, orphaning its workers
        time.sleep(0.3)
        os.kill(proc.pid, getattr(signal, signal_name.split()[0]))
    proc.stdout.read()
    assert proc.wait(timeout=120) == code
    deadline = time.monotonic() + 30
    while _processes_of(runs) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_of(runs) == []
    assert not (runs / "ddp/train/stage.json").exists()
    assert [p.name for p in temp.iterdir() if p.name.startswith("edgebayes-torchrun-")] == []


def test_pipeline_json_keeps_stdout_for_the_summary_with_several_processes(tmp_path, capfd):
    """The relaunched training printed its log on the inherited stdout, corrupting `pipeline --json` (review);
    and each run left torchrun's empty log folder in the temporary directory (probe)."""
    import json
    import tempfile

    def leftovers():
        return {p.name for p in Path(tempfile.gettempdir()).iterdir() if p.name.startswith(("torchelastic_",
                                                                                               "edgebayes-torchrun-"))}

    before = leftovers()
    assert main(["pipeline", "--config", str(_tiny(tmp_path, 2)), "--runs-dir", str(tmp_path / "runs"), "--json"]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out)["exit_code"] == 0 and "train: epoch 3/3" in err
    assert leftovers() <= before


def test_a_training_process_that_fails_says_why_once_with_its_exit_code(tmp_path, capfd, monkeypatch):
    """A failure inside the training processes ended with torchrun's error line, a 20-line traceback of
    ChildFailedError and exit 1, bad input included (probe); two processes' messages ran into one line. Now: the
    failing process's own line (numbered where it is not process 0), the code it exited with (2: bad input), the
    launching process's one line, and nothing of torchrun's."""
    (tmp_path / "rankfail.py").write_text(
        "import os\nfrom torch import nn\n\n\n"
        "def build(num_classes=10):\n"
        "    if os.environ.get('RANK') == '1':   # a module the second process cannot build\n"
        "        raise ValueError('no weights here')\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))\n")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"name": "ddp", "model": {"family": "ss-gl", "arch": "rankfail:build"},
                                    "train": {"epochs": 1, "batch_size": 128, "device": "cpu", "processes": 2,
                                              "flops_target": None}}))
    monkeypatch.chdir(tmp_path)   # a module in the working folder imports as it is, in every process
    code = main(["train", "--config", str(path), "--runs-dir", str(tmp_path / "runs")])
    out, err = capfd.readouterr()
    assert code == 2, err
    assert "edgebayes: process 1: model.arch: rankfail:build(**{'num_classes': 10}) failed (ValueError: no weights " \
           "here)" in err, err
    assert "Traceback" not in err and "ChildFailedError" not in err and "exitcode" not in err, err
    assert "edgebayes: train failed: train: another training process stopped (" in err   # process 0, at a collective
    assert err.rstrip().splitlines()[-1] == ("edgebayes: train: the 2 training processes refused their input (their "
                                             "messages are above)")
