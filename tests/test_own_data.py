"""Data of your own (issue 18, part 3): the data keys' checks with the config, a bad file reported as bad
input (exit 2) before any work, and the whole pipeline on a tiny npz and a tiny image folder."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from edgebayes.cli import EXIT_BAD_INPUT, main
from edgebayes.config import ConfigError, load_pipeline_config

ROOT = Path(__file__).resolve().parents[1]


def _config(tmp_path, name="own", **data):
    """pipeline.yaml with the given data keys and a model small enough for seconds on one core."""
    cfg = yaml.safe_load((ROOT / "pipeline.yaml").read_text())
    cfg["name"] = name
    cfg["data"] = {"dataset": "digits", "val_fraction": 0.2, "test_fraction": 0.2, "ood": "noise", **data}
    cfg["model"]["hidden"] = [16]
    cfg["train"].update(epochs=2, batch_size=32, mc_samples_eval=2)
    cfg["select"] = {"knob_values": [0.5], "mc_samples": [1], "objective": "accuracy"}
    cfg["benchmark"] = {"warmup": 1, "min_runs": 10, "min_seconds": 0, "rounds": 2}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


BAD_DATA_KEYS = {
    "path required": ({"dataset": "npz"}, r"data\.path: required when data\.dataset is npz"),
    "path refused for a built-in set": ({"path": "x.npz"}, r"data\.path: read for data\.dataset npz, .*digits does not"),
    "unknown data set": ({"dataset": "imagenet"}, r"data\.dataset: expected one of 'digits'.*'csv', or "
                                                   r"package\.module:function.*got 'imagenet'"),
    "loader not importable": ({"dataset": "no_such_module_xyz:load"}, r"data\.dataset: no_such_module_xyz:load: "
                                                                       r"cannot import"),
    "image_size elsewhere": ({"dataset": "npz", "path": "x.npz", "image_size": [8, 8]},
                             r"data\.image_size: only read for data\.dataset image-folder"),
    "channels elsewhere": ({"dataset": "npz", "path": "x.npz", "channels": 3},
                           r"data\.channels: only read for data\.dataset image-folder"),
    "channels value": ({"dataset": "image-folder", "path": "imgs", "channels": 2}, r"data\.channels: .*1.*3"),
    "image_size shape": ({"dataset": "image-folder", "path": "imgs", "image_size": [8]},
                         r"data\.image_size: expected \[height, width\]"),
    "image_size positive": ({"dataset": "image-folder", "path": "imgs", "image_size": [8, 0]},
                            r"data\.image_size: expected \[height, width\]"),
    "label_column elsewhere": ({"dataset": "npz", "path": "x.npz", "label_column": "y"},
                               r"data\.label_column: only read for data\.dataset csv"),
    "label_column type": ({"dataset": "csv", "path": "x.csv", "label_column": True},
                          r"data\.label_column: expected an integer or a string or null"),
    "signals elsewhere": ({"dataset": "image-folder", "path": "imgs", "signals": True},
                          r"data\.signals: only read for data\.dataset npz or a loader"),
}


@pytest.mark.parametrize("case", BAD_DATA_KEYS, ids=list(BAD_DATA_KEYS))
def test_data_keys_are_checked_with_the_config(case, tmp_path):
    data, message = BAD_DATA_KEYS[case]
    with pytest.raises(ConfigError, match=rf"own\.yaml: {message}"):
        load_pipeline_config(_config(tmp_path, **data))


def test_own_data_keys_load(tmp_path):
    cfg = load_pipeline_config(_config(tmp_path, dataset="csv", path="t.csv", label_column=-1))
    assert (cfg.data.dataset, cfg.data.path, cfg.data.label_column) == ("csv", "t.csv", -1)
    cfg = load_pipeline_config(_config(tmp_path, dataset="image-folder", path="imgs", image_size=[8, 6]))
    assert cfg.data.image_size == [8, 6]


def test_a_bad_data_file_exits_2_before_any_work(tmp_path, capsys):
    np.savez(tmp_path / "d.npz", images=np.zeros((10, 4)), labels=np.arange(10) % 2)
    config = _config(tmp_path, dataset="npz", path=str(tmp_path / "d.npz"))
    runs = tmp_path / "runs"
    assert main(["pipeline", "--config", str(config), "--runs-dir", str(runs)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "data.path" in err and "d.npz" in err and "it holds: images, labels" in err
    assert not runs.exists() or not any(runs.rglob("*.json"))


def _npz_data(path):
    """3 classes of 8x8 grayscale images, each class a bright band in its own rows, with noise."""
    rng = np.random.default_rng(0)
    y = np.arange(150) % 3
    x = rng.integers(0, 80, (150, 8, 8)).astype(np.uint8)
    for k in range(3):
        x[y == k, 2 * k: 2 * k + 3, :] += 150
    np.savez(path, x=x, y=np.array(["left", "middle", "right"])[y])
    return path


def _image_data(folder):
    from PIL import Image

    rng = np.random.default_rng(1)
    for k, name in enumerate(("red", "green", "blue")):
        (folder / name).mkdir(parents=True)
        for i in range(12):
            image = rng.integers(0, 60, (8, 8, 3)).astype(np.uint8)
            image[..., k] += 180
            Image.fromarray(image, "RGB").save(folder / name / f"{i}.png")
    return folder


@pytest.mark.parametrize("dataset", ["npz", "image-folder"])
def test_pipeline_runs_on_data_of_your_own(dataset, tmp_path, monkeypatch):
    import edgebayes.data
    import edgebayes.stages

    path = _npz_data(tmp_path / "d.npz") if dataset == "npz" else _image_data(tmp_path / "imgs")
    config = _config(tmp_path, name=f"own-{dataset}", dataset=dataset, path=str(path))
    runs = tmp_path / "runs"
    loads = []   # read once: select's profiling of the device takes the data's sizes from it (it read it again)

    def counted(*args, load=edgebayes.data.load_data):
        loads.append(args)
        return load(*args)

    monkeypatch.setattr(edgebayes.data, "load_data", counted)
    monkeypatch.setattr(edgebayes.stages, "load_data", counted)
    assert main(["pipeline", "--config", str(config), "--runs-dir", str(runs)]) == 0
    assert len(loads) == 1 and (runs / "devices/local/latency_table.json").is_file()
    run = runs / f"own-{dataset}"
    metrics = json.loads((run / "train/metrics.json").read_text())
    total = 150 if dataset == "npz" else 36
    assert metrics["data"]["dataset"] == dataset
    assert metrics["data"]["train"] + metrics["data"]["val"] + metrics["data"]["test"] == total
    assert metrics["model"]["classes"] == 3 and metrics["model"]["in_features"] == (64 if dataset == "npz" else 192)
    assert "ood" in metrics
    manifest = json.loads((run / "export/local/bundle/manifest.json").read_text())
    assert manifest["classes"] == (["left", "middle", "right"] if dataset == "npz" else ["blue", "green", "red"])
    # what a device application must do to its own inputs, and which data (nothing said either: probe)
    steps = manifest["input"]["preprocessing"]
    assert steps.startswith("uint8 arrays / 255" if dataset == "npz" else
                            "images read with PIL as RGB (PIL mode RGB: alpha dropped, grayscale repeated), at "
                            "their own size, 8x8 (HxW); 8-bit values / 255"), steps
    assert manifest["data"] == {"source": f"data.path: {path}", "fingerprint": metrics["data"]["fingerprint"]}
    html = (run / "report/local/report.html").read_text()
    assert f"data.path: {path}" in html and steps.replace("(", "").split(";")[0][:30] in html.replace("(", "")
    results = json.loads((run / "deploy/local/results.json").read_text())
    assert 0 <= results["metrics"]["accuracy"] <= 1
    assert (run / "report/local/report.html").is_file()


def test_a_stage_run_again_for_new_data_says_so(tmp_path, capsys):
    """The files changed, not the config: the log said "config, device profile or code changed" (probe)."""
    import os

    path = _npz_data(tmp_path / "d.npz")
    config = _config(tmp_path, name="own-again", dataset="npz", path=str(path))
    runs = tmp_path / "runs"
    assert main(["train", "--config", str(config), "--runs-dir", str(runs)]) == 0
    arrays = dict(np.load(path))
    np.savez(path, x=arrays["x"][::-1].copy(), y=arrays["y"])
    os.utime(path, ns=(1, 1))
    capsys.readouterr()
    assert main(["select", "--config", str(config), "--runs-dir", str(runs)]) == 1   # a stage after it says so too
    # what changed in it, as far as the files' stat says (review: a sync that touched every file retrained in silence)
    why = ("what data.path holds (its size is the same, but rewritten or with other modification times (a copy or "
           "sync that does not keep them makes every file new)) changed since the stage ran")
    assert f"the train stage is out of date for this config and device ({why})" in capsys.readouterr().err
    assert main(["train", "--config", str(config), "--runs-dir", str(runs)]) == 0
    assert f"train: running ({why})" in capsys.readouterr().out
    np.savez(path, x=arrays["x"][:-5], y=arrays["y"][:-5])
    assert main(["train", "--config", str(config), "--runs-dir", str(runs)]) == 0
    assert re.search(r"train: running \(what data.path holds \(1 file of [0-9.]+ MB now, 1 of [0-9.]+ MB when the "
                     r"stage ran\) changed since the stage ran\)", capsys.readouterr().out)
    assert main(["train", "--config", str(config), "--runs-dir", str(runs), "--set", "train.epochs=1"]) == 0
    assert "train: running (config, device profile or code changed)" in capsys.readouterr().out
    # a marker edited by hand: the plain reason, not a traceback
    marker = runs / "own-again/train/stage.json"
    for epochs, outside in ((2, "x"), (1, {"inputs": [1], "latency_table": 3})):   # each run another config
        done = json.loads(marker.read_text())
        marker.write_text(json.dumps({**done, "outside": outside}))
        assert main(["train", "--config", str(config), "--runs-dir", str(runs), "--set", f"train.epochs={epochs}"]) == 0
        assert "train: running (config, device profile or code changed)" in capsys.readouterr().out


SIGNAL_NET = """
import torch.nn.functional as F
from torch import nn


class Signal(nn.Module):
    def __init__(self, num_classes=3):
        super().__init__()
        self.c1, self.bn = nn.Conv1d(2, 8, 5, padding=2), nn.BatchNorm1d(8)
        self.fc1, self.fc = nn.Linear(8, 16), nn.Linear(16, num_classes)

    def forward(self, x):
        return self.fc(F.relu(self.fc1(F.relu(self.bn(self.c1(x))).mean(-1))))
"""


def test_one_dimensional_signals_load_as_they_are_and_run_the_pipeline(tmp_path, monkeypatch):
    """data.signals: an npz of (N, channels, length) arrays reaches a Conv1d network as it is (without it, a 3-D
    array is a stack of grayscale images and gains a channel axis); 2-D arrays are one-channel signals."""
    from edgebayes.data import DataError, _inputs

    assert tuple(_inputs(np.zeros((5, 2, 40)), "x", "here", signals=True).shape) == (5, 2, 40)
    assert tuple(_inputs(np.zeros((5, 2, 40)), "x", "here").shape) == (5, 1, 2, 40)
    assert tuple(_inputs(np.zeros((5, 40)), "x", "here", signals=True).shape) == (5, 1, 40)
    with pytest.raises(DataError, match=r"here: x has shape \(5, 1, 2, 40\); data.signals expects"):
        _inputs(np.zeros((5, 1, 2, 40)), "x", "here", signals=True)
    (tmp_path / "signet.py").write_text(SIGNAL_NET)
    monkeypatch.syspath_prepend(str(tmp_path))
    rng = np.random.default_rng(0)
    y = np.arange(120) % 3
    x = rng.normal(0, 0.3, (120, 2, 40)).astype(np.float32)
    x[:, 0] += np.sin(np.linspace(0, 2 * np.pi, 40))[None] * (y[:, None] + 1)   # frequency by class
    np.savez(tmp_path / "s.npz", x=x, y=y)
    config = _config(tmp_path, name="signals", dataset="npz", path=str(tmp_path / "s.npz"), signals=True)
    cfg = yaml.safe_load(config.read_text())
    cfg["model"] = {"family": "ss-gl", "arch": "signet:Signal"}
    cfg["train"]["flops_target"] = None
    config.write_text(yaml.safe_dump(cfg))
    runs = tmp_path / "runs"
    assert main(["pipeline", "--config", str(config), "--runs-dir", str(runs)]) == 0
    metrics = json.loads((runs / "signals/train/metrics.json").read_text())
    assert metrics["model"]["in_features"] == 80
    # The Conv1d is the family's layer (a height-1 Conv2d with its batch norm), not a plain layer kept whole
    assert "c1.conv.conv" in [layer["name"] for layer in metrics["sparsity"]["layers"]]
    assert json.loads((runs / "signals/deploy/local/results.json").read_text())["metrics"]["accuracy"] >= 0
