"""Fail in seconds, not after training (export/preflight.py): `train` compresses and exports the untrained
network in every requested format before its first epoch."""

import json
import textwrap
from pathlib import Path

import pytest
import yaml

from edgebayes.cli import main

USER_MODULE = textwrap.dedent('''
    import torch
    from torch import nn


    class CustomOpNet(nn.Module):
        """An operation the ONNX exporter (opset 17) has no conversion for: torch.cummax."""

        def __init__(self, num_classes=10):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
            self.fc = nn.Linear(8, num_classes)

        def forward(self, x):
            h = torch.cummax(torch.relu(self.bn(self.conv(x))), dim=3)[0]   # a running max along the width
            return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(h, 1), 1))
''')


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    pkg = tmp_path / "preflightpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "preflightpkg.nets"


def test_a_network_the_exporter_cannot_handle_is_refused_before_its_first_epoch(user_package, tmp_path, capsys):
    """An operation with no ONNX conversion: the pipeline used to train, then fail at select's export; it is
    refused at once, with the exporter's own message, and no epoch ran."""
    cfg = yaml.safe_load((__import__("pathlib").Path(__file__).parents[1] / "pipeline.yaml").read_text())
    cfg["name"] = "preflight"
    cfg["model"] = {"family": "ss-gl", "arch": f"{user_package}:CustomOpNet"}
    cfg["train"].update(epochs=2)
    cfg["export"]["layout"] = "unrolled"   # the packed layout refuses it too (its own message), or falls back
    config = tmp_path / "preflight.yaml"
    config.write_text(yaml.safe_dump(cfg))
    code = main(["pipeline", "--config", str(config), "--runs-dir", str(tmp_path / "runs")])
    out, err = capsys.readouterr()
    assert code != 0 and "epoch" not in out.replace("first epoch", "")
    assert "refused before the first epoch" in err and "cannot export format onnx" in err and "cummax" in err
    train = tmp_path / "runs" / "preflight" / "train"
    assert not (train / "checkpoint.pt").exists() and not (train / "metrics.json").exists()


def test_a_network_too_large_for_the_model_budget_is_told_the_share_that_fits_before_training():
    """The device's model_mb budget against the untrained network's file, at the fewest MC samples select may
    ship: the share of its weights that fits, as the train.flops_target to set (export/preflight.py)."""
    from pathlib import Path

    from edgebayes.config import load_device_profile, load_pipeline_config
    from edgebayes.deploy.budget_targets import model_budget_advice

    cfg = load_pipeline_config(Path(__file__).parents[1] / "pipeline.yaml", ["train.flops_target=null"])
    profile = load_device_profile("local")
    profile = profile.model_copy(update={"budgets": profile.budgets.model_copy(update={"model_mb": 0.5})})
    fewest = min(cfg.select.mc_samples)
    sizes = {"onnx": 4_000_000, "tflite-fp32": 3_000_000}   # bytes, each holding M=2 samples
    advice = model_budget_advice(cfg, profile, sizes, 2)
    share = 0.5 / (3.0 / 2 * fewest)
    assert f"set train.flops_target to {int(share * 100) / 100:.2f} or less" in advice and "tflite-fp32" in advice
    strict = cfg.model_copy(update={"train": cfg.train.model_copy(update={"flops_target": round(share, 2)})})
    assert model_budget_advice(strict, profile, sizes, 2) is None          # the target already fits
    loose = cfg.model_copy(update={"train": cfg.train.model_copy(update={"flops_target": 0.9})})
    assert "train.flops_target 0.9 is too large" in model_budget_advice(loose, profile, sizes, 2)
    dense = cfg.model_copy(update={"model": cfg.model.model_copy(update={"family": "bnn"})})
    assert "removes none" in model_budget_advice(dense, profile, sizes, 2)
    roomy = profile.model_copy(update={"budgets": profile.budgets.model_copy(update={"model_mb": 100})})
    assert model_budget_advice(cfg, roomy, sizes, 2) is None


def test_a_network_slower_than_the_latency_budget_is_told_the_flops_share_that_fits_before_training():
    """The device's latency model (a spec sheet here, what select predicts with) at the fewest MC samples:
    the largest share of the FLOPs (and weights) predicted within the latency budget, as the train.flops_target
    to set; a budget under the per-operator overhead is told that no share fits (export/preflight.py)."""
    from pathlib import Path

    from edgebayes.config import load_device_profile, load_pipeline_config
    from edgebayes.deploy.latency_model import predictor_for
    from edgebayes.deploy.budget_targets import latency_budget_advice

    cfg = load_pipeline_config(Path(__file__).parents[1] / "pipeline.yaml", ["train.flops_target=null"])
    pi = load_device_profile("raspberry-pi-4")     # latency_model kind flops: 2.9 GFLOP/s, 0.1 ms overhead
    per_sample = {"flops": 20e6, "weights": 100_000, "in_features": 64}
    operators = {"tflite-fp32": 12, "tflite-int8": 14}
    fewest = min(cfg.select.mc_samples)
    predictor = predictor_for(pi, Path("runs"))
    dense_ms = min(predictor.predict(ops, fewest * 20e6, fewest * 100_000, p, 90, 1)
                   for ops, p in ((12, "fp32"), (14, "int8")))
    budget = dense_ms / 4
    tight = pi.model_copy(update={"budgets": pi.budgets.model_copy(update={"latency_ms": budget})})
    advice = latency_budget_advice(cfg, tight, operators, per_sample)
    share = float(advice.split("set train.flops_target to ")[1].split()[0])
    assert f"predicted at {dense_ms:.3g} ms" in advice and "spec sheet" in advice
    fits = min(predictor.predict(ops, fewest * 20e6 * share, fewest * 100_000 * share, p, 90, 1)
               for ops, p in ((12, "fp32"), (14, "int8")))
    assert fits <= budget and share > 0.15          # within the budget, and not far under it
    strict = cfg.model_copy(update={"train": cfg.train.model_copy(update={"flops_target": 0.1})})
    assert latency_budget_advice(strict, tight, operators, per_sample) is None     # the target already fits
    roomy = pi.model_copy(update={"budgets": pi.budgets.model_copy(update={"latency_ms": 10 * dense_ms})})
    assert latency_budget_advice(cfg, roomy, operators, per_sample) is None
    overhead = pi.model_copy(update={"budgets": pi.budgets.model_copy(update={"latency_ms": 0.05})})
    assert "overhead alone exceeds it" in latency_budget_advice(cfg, overhead, operators, per_sample)
    local = load_device_profile("local")             # measured, no latency table under runs_dir: nothing said
    local = local.model_copy(update={"budgets": local.budgets.model_copy(update={"latency_ms": 1e-6})})
    assert latency_budget_advice(cfg, local, {"onnx": 12}, per_sample, runs_dir=Path("/nonexistent")) is None


def test_flops_target_device_trains_to_the_share_the_devices_budgets_allow_and_a_resume_keeps_it(
        tmp_path, capsys, monkeypatch):
    """train.flops_target: device. The pre-flight's shares of the device's model_mb and latency_ms budgets
    (a spec-sheet device here) become the target, the trained network is at or under it after surgery, and
    a run interrupted after its first epoch resumes with the same target (run.json), without a new
    pre-flight."""
    import json

    import edgebayes.train.trainer as trainer
    from edgebayes.config import load_device_profile

    pi = load_device_profile("raspberry-pi-4")
    device = tmp_path / "tiny-board.yaml"
    profile = json.loads(pi.model_copy(update={"name": "tiny-board", "budgets": pi.budgets.model_copy(
        update={"model_mb": 0.005, "latency_ms": 10.0})}).model_dump_json())
    device.write_text(yaml.safe_dump(profile))
    args = ["train", "--config", str(Path(__file__).parents[1] / "pipeline.yaml"), "--device", str(device),
            "--runs-dir", str(tmp_path / "runs"), "--set", "train.epochs=3", "--set", "train.flops_target=device"]
    real_save = trainer.atomic_torch_save

    def save_then_die(obj, path):
        real_save(obj, path)
        if obj["epoch"] == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "atomic_torch_save", save_then_die)
    assert main(args) != 0
    first = capsys.readouterr().out
    monkeypatch.setattr(trainer, "atomic_torch_save", real_save)
    line = [x for x in first.splitlines() if x.startswith("train: flops target from tiny-board's budgets: ")][0]
    target = float(line.split("budgets: ")[1].split()[0])
    assert 0 < target < 1 and "model_mb budget of 0.005 MB" in line
    run = tmp_path / "runs" / "digits-ssgl" / "train"
    good = (run / "run.json").read_text()
    assert json.loads(good)["device_flops_target"] == target
    # a run.json edited by hand is refused, naming it, and not trained with
    (run / "run.json").write_text(json.dumps({**json.loads(good), "device_flops_target": 5}))
    assert main(args) != 0
    assert "run.json does not hold the FLOPs target" in capsys.readouterr().err
    (run / "run.json").write_text(good)
    assert main(args) == 0
    second = capsys.readouterr().out
    assert "resuming" in second and "pre-flight" not in second
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["physical_flops_ratio"] <= target + 1e-9
    assert (metrics["flops_target"], metrics["flops_target_from"]) == (target, "device")


def test_flops_target_device_needs_a_device_and_one_process(tmp_path):
    import numpy as np
    from torch import nn

    import edgebayes as eb
    from edgebayes.config import ConfigError, load_pipeline_config

    net = eb.bayesianize(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), "ss-gl", input_shape=(4,),
                         n_train=32)
    with pytest.raises(ConfigError, match="flops_target: device needs a device profile"):
        eb.fit(net, np.zeros((32, 4)), np.zeros(32, dtype=int), epochs=1, flops_target="device", log=lambda *_: None)
    with pytest.raises(ConfigError, match="train.flops_target"):
        load_pipeline_config(Path(__file__).parents[1] / "pipeline.yaml",
                             ["train.flops_target=device", "train.processes=2"])


def test_the_model_budget_share_counts_a_files_fixed_bytes():
    """A file is fixed bytes + M x a sample's (the pre-flight sizes it at M = 2 and M = 1): the digits MLP's int8
    file is 16.0 kB at M = 1 and 26.2 kB at M = 2, 5.7 kB of it fixed. Against an 8 kB budget the proportional
    rule told 0.61 (train.flops_target device trained to it; the int8 file then was 12.1 kB: exit 3); the share
    that fits is (8 - 5.7) / 10.2."""
    from pathlib import Path

    from edgebayes.config import load_device_profile, load_pipeline_config
    from edgebayes.deploy.budget_targets import model_budget_share

    cfg = load_pipeline_config(Path(__file__).parents[1] / "pipeline.yaml",
                               ["train.flops_target=null", "select.mc_samples=[1,4]"])
    profile = load_device_profile("local")
    profile = profile.model_copy(update={"budgets": profile.budgets.model_copy(update={"model_mb": 0.008})})
    sizes, sizes_one = {"onnx-int8": 26_200}, {"onnx-int8": 15_960}
    share, where = model_budget_share(cfg, profile, sizes, 2, sizes_one)
    assert abs(share - (8_000 - 5_720) / 10_240) < 1e-3 and "fixed" in where
    assert model_budget_share(cfg, profile, sizes, 2)[0] > 0.6          # without the M = 1 size: the old rule
    tight = profile.model_copy(update={"budgets": profile.budgets.model_copy(update={"model_mb": 0.005})})
    assert model_budget_share(cfg, tight, sizes, 2, sizes_one)[0] == 0.0   # under the fixed bytes: none fits


def test_a_latency_budget_without_a_latency_model_is_said_unjudged_not_met(tmp_path, capsys):
    """flops_target device on a measured device without a latency table said 'none (the dense network fits
    them)' of a 0.001 ms budget never judged, then failed at select (probe); and a budget no share can meet
    ended as 'a stage failed' (exit 1) where an unreachable numeric target is bad input (exit 2)."""
    from edgebayes.config import load_device_profile

    local = load_device_profile("local")
    device = tmp_path / "tiny-lat.yaml"
    profile = json.loads(local.model_copy(update={"name": "tiny-lat", "budgets": local.budgets.model_copy(
        update={"latency_ms": 0.001})}).model_dump_json())
    device.write_text(yaml.safe_dump(profile))
    args = ["train", "--config", str(Path(__file__).parents[1] / "pipeline.yaml"), "--device", str(device),
            "--runs-dir", str(tmp_path / "runs"), "--set", "train.epochs=1", "--set", "train.flops_target=device"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert ("train: flops target from tiny-lat's budgets: none (the dense network fits those judged here); its "
            "latency budget (0.001 ms) is not judged before training: no latency table of tiny-lat covers") in out
    pi = load_device_profile("raspberry-pi-4")
    device = tmp_path / "overhead.yaml"
    profile = json.loads(pi.model_copy(update={"name": "overhead", "budgets": pi.budgets.model_copy(
        update={"latency_ms": 0.001})}).model_dump_json())
    device.write_text(yaml.safe_dump(profile))
    args[args.index("--device") + 1] = str(device)
    assert main(args) == 2
    assert "train.flops_target device: " in capsys.readouterr().err
