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
    with pytest.raises(ConfigError, match="section.key=value"):
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

    # the merged table reads the benchmark's own results file
    import structured_sparsity_table
    assert structured_sparsity_table.main([str(tmp_path / "t"), str(out.with_suffix(".json"))]) == 0
    table = json.loads((tmp_path / "t.json").read_text())
    assert [(s["family"], s["setting"], s["seeds"]) for s in table["summary"]] == [("dnn", "train.lr_milestones=[1]", [0])]


def _train_log(path, kept, test=True):
    lines = ["train: 1 torch threads (train.threads)"]
    lines += [f"train: epoch {e}/{len(kept)}: loss=1.0, val_acc=0.9, kept_nodes={units}" for e, units in enumerate(kept, 1)]
    if test:
        lines.append(f"train: test accuracy 0.9850, NLL 0.0500, ECE 0.0100; kept nodes {kept[-1] + [10]}; "
                     "compression 0.010, FLOPs ratio 0.120 (after surgery 0.120)")
    path.write_text("\n".join(lines) + "\n")


def test_table_merges_logs_by_family_and_setting_and_flags_empty_median_models(tmp_path, capsys):
    import structured_sparsity_table as table
    _train_log(tmp_path / "base-ss-gl-s0.log", [[5, 5], [3, 3]])
    _train_log(tmp_path / "base-ss-gl-s1.log", [[5, 5], [3, 3], [2, 2], [0, 4], [2, 2]])   # epoch 4 empty
    _train_log(tmp_path / "train.scale_lr=1e-2-ss-gl-s0.log", [[5, 5]])
    _train_log(tmp_path / "train.a=1,train.b=2-ss-gl-s0.log", [[5, 5]])   # two --set: a JSON row's label
    _train_log(tmp_path / "base-ss-ghs-s2.log", [[5, 5]], test=False)                    # still training
    out = tmp_path / "t"
    assert table.main([str(out), *map(str, sorted(tmp_path.glob("*.log")))]) == 0
    summary = {(s["family"], s["setting"]): s for s in json.loads(out.with_suffix(".json").read_text())["summary"]}
    assert set(summary) == {("ss-gl", "config file"), ("ss-gl", "train.scale_lr=1e-2"),
                            ("ss-gl", "train.a=1, train.b=2")}
    committed = summary[("ss-gl", "config file")]
    assert committed["seeds"] == [0, 1] and committed["accuracy"] == "98.50 ± 0.00" and committed["flops"] == "12.00 ± 0.00"
    assert committed["late_empty"] == {"1": [4]} and committed["met"] == "FLOPs only"   # 98.5 < 98.8, 12 <= 15
    assert committed["val_accuracy"] == "90.00 ± 0.00"   # the last epoch's, from the logs
    md = out.with_suffix(".md").read_text()
    assert "seed 1: epochs [4]" in md and "SS-GHS config file seed 2 after 1 epochs" in md
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"

    (tmp_path / "ss-gl-s0.log").write_text("")   # no setting in the name
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "other.json").write_text('{"rows": [{"family": "ss-gl", "seed": 0}]}')
    for bad, says in (("ss-gl-s0.log", "<setting>-<family>-s<seed>.log"), ("broken.json", "not valid JSON"),
                      ("other.json", "rows[0] lacks accuracy, flops_ratio, compression")):
        assert table.main([str(tmp_path / "u"), str(tmp_path / bad)]) == 2
        assert says in capsys.readouterr().err
    assert not (tmp_path / "u.md").exists()


def test_scale_lr_of_the_config_stays_with_its_family():
    """configs/mnist-lenet5-ssgl.yaml sets train.scale_lr for SS-GL; the benchmark's other rows derived from it
    must run as their own configs do (SS-IG and the baselines would refuse it, SS-GHS's config has none)."""
    cfg = structured_sparsity.with_settings(str(ROOT / "configs/mnist-lenet5-ssgl.yaml"), [])
    assert cfg.train.scale_lr == 0.01
    own = (cfg.model.family,)
    assert structured_sparsity.variant(cfg, "ss-gl", 0, 2, None, own).train.scale_lr == 0.01
    for family in ("dnn", "bnn", "ss-ig", "ss-ghs"):
        assert structured_sparsity.variant(cfg, family, 0, 2, None, own).train.scale_lr is None
    assert structured_sparsity.variant(cfg, "ss-ghs", 0, 2, None, ("ss-gl", "ss-ghs")).train.scale_lr == 0.01


def test_each_family_trains_from_its_own_config(tmp_path):
    """With one config per family, every spike-and-slab row runs exactly its own config file (its optimizer
    settings included); DNN / BNN come from the first; two configs of one family are refused."""
    gl, ghs = (str(ROOT / f"configs/mnist-lenet5-{n}.yaml") for n in ("ssgl", "ssghs"))
    configs = structured_sparsity.configs_by_family([gl, ghs], ["train.rho_lr=1e-2"])
    assert configs[None][0] == gl and configs["ss-ghs"][0] == ghs and "ss-ig" not in configs
    assert configs["ss-ghs"][1].name == "mnist-lenet5-ssghs" and configs["ss-ghs"][1].train.rho_lr == 0.01
    with pytest.raises(SystemExit, match="both ss-gl configs"):
        structured_sparsity.configs_by_family([gl, gl], [])

    out = tmp_path / "r"
    assert structured_sparsity.main(["--config", gl, ghs, "--families", "dnn", "ss-gl", "ss-ghs", "--epochs", "2",
                                     "--runs-dir", str(tmp_path / "runs"), "--measure-only", "--out", str(out)]) == 0
    md = out.with_suffix(".md").read_text()
    # SS-GL's own scale_lr is named for SS-GL and for no other row; SS-GHS's settings come from its own file
    logits = structured_sparsity.with_settings(gl, []).train.inclusion_lr
    assert f"SS-GL (`{gl}`) Adam 0.001, inclusion logits at {logits}, the slab's rho at 0.003, the scale variables at 0.01" in md
    assert f"SS-GHS (`{ghs}`) Adam 0.001, inclusion logits at" in md and md.count("the scale variables") == 1
    assert json.loads(out.with_suffix(".json").read_text())["untrained"] == ["DNN seed 0", "SS-GL seed 0", "SS-GHS seed 0"]


def test_a_missing_or_broken_config_is_one_message_naming_it(tmp_path, capsys):
    broken = tmp_path / "broken.yaml"
    broken.write_text("train: [\n")
    for path, settings in ((tmp_path / "nosuch.yaml", []), (tmp_path / "nosuch.yaml", ["--set", "train.lr=1"]),
                           (broken, ["--set", "train.lr=1"])):
        with pytest.raises(SystemExit) as e:
            structured_sparsity.main(["--config", CONFIG, str(path), *settings, "--measure-only", "--out", str(tmp_path / "r")])
        assert e.value.code == 2 and str(path) in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()
