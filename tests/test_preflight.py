"""Fail in seconds, not after training (export/preflight.py): `train` compresses and exports the untrained
network in every requested format before its first epoch."""

import textwrap

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
