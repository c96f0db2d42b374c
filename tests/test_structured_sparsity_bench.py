"""benchmarks/structured_sparsity.py's settings (--set), its measure-only pass and its results written per run,
on the embedded default (digits MLP: seconds)."""

import json
import sys
from pathlib import Path

import pytest

from edgebayes.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import structured_sparsity  # noqa: E402

CONFIG = str(ROOT / "pipeline.yaml")


def test_set_changes_the_config_and_is_validated_like_the_file():
    cfg = structured_sparsity.with_settings(CONFIG, ["train.lr_milestones=[3]", "train.rho_lr=1e-2"])
    assert cfg.train.lr_milestones == [3] and cfg.train.rho_lr == 0.01
    with pytest.raises(ConfigError, match="train.lr_milestones"):
        structured_sparsity.with_settings(CONFIG, ["train.lr_milestones=[9999]"])   # past train.epochs
    with pytest.raises(ConfigError, match="nosuch"):
        structured_sparsity.with_settings(CONFIG, ["train.nosuch=1"])
    with pytest.raises(SystemExit, match="section.key=value"):
        structured_sparsity.with_settings(CONFIG, ["epochs=3"])


def test_measure_only_trains_nothing_and_measures_what_finished(tmp_path):
    common = ["--config", CONFIG, "--families", "dnn", "ss-gl", "--seeds", "0", "--epochs", "2",
              "--runs-dir", str(tmp_path / "runs"), "--no-latency", "--set", "train.lr_milestones=[1]"]
    out = tmp_path / "r"
    assert structured_sparsity.main(common + ["--measure-only", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["rows"] == [] and result["untrained"] == ["DNN seed 0", "SS-GL seed 0"]
    assert not list((tmp_path / "runs").rglob("checkpoint.pt"))   # nothing trained

    assert structured_sparsity.main(common[:3] + ["dnn"] + common[5:] + ["--train-only"]) == 0
    assert structured_sparsity.main(common + ["--measure-only", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert [r["family"] for r in result["rows"]] == ["dnn"] and result["untrained"] == ["SS-GL seed 0"]
    assert result["settings"] == ["train.lr_milestones=[1]"] and result["not_measured"] == []
    row = result["rows"][0]
    assert 0 <= row["accuracy"] <= 1 and row["flops_ratio"] == 1 and "latency_ratio" not in row
    md = out.with_suffix(".md").read_text()
    assert "`train.lr_milestones=[1]`" in md and "Not trained when measured" in md and "| DNN |" in md
    assert "not measured" in md   # the latency columns of a --no-latency run
