"""benchmarks/finetune_steps.py (issue 33): the batch-size sweep end to end on a small CNN and scikit-learn's
digits (offline), its 'auto' row being the trainer's own choice, --merge and --resume."""

import json
import sys
from pathlib import Path

import pytest

from edgebayes.config import TrainConfig
from edgebayes.train.flops_target import fine_tuning_batch_size

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import finetune_steps as fs  # noqa: E402

pytest.importorskip("torch_pruning")


def test_a_sweep_writes_both_methods_per_batch_and_the_auto_row_is_the_trainers_choice(tmp_path):
    out, cache = tmp_path / "s0", tmp_path / "cache"
    argv = ["--nets", "small-cnn", "--batches", "256", "auto", "--seeds", "0", "--epochs", "1", "--dense-epochs", "1",
            "--mc", "2", "--out", str(out), "--cache", str(cache)]
    assert fs.main(argv) == 0
    rows = json.loads((tmp_path / "s0.json").read_text())["rows"]
    assert sorted((r["method"], r["batch_asked"]) for r in rows) == [
        ("edgebayes-ss-gl", "256"), ("edgebayes-ss-gl", "auto"), ("tp-magnitude", "256")]
    for r in rows:
        assert "error" not in r, r
        assert r["final_structure_steps"] == fs.final_steps(r["train_images"], r["batch"], 1)
    auto = next(r for r in rows if r["batch_asked"] == "auto")
    assert auto["batch"] == fine_tuning_batch_size(TrainConfig(epochs=1, flops_target=0.5), auto["train_images"])[0]
    tp = next(r for r in rows if r["method"] == "tp-magnitude")
    eb = next(r for r in rows if r["method"] == "edgebayes-ss-gl" and r["batch_asked"] == "256")
    assert tp["batch"] == 256 and tp["flops_ratio_wanted"] == pytest.approx(eb["flops_ratio_physical"])
    assert "| small-cnn" in (tmp_path / "s0.md").read_text() and "auto: " in (tmp_path / "s0.md").read_text()

    # the same file given twice: each (net, method, batch, seed) counted once in the merged result
    assert fs.main(["--merge", str(tmp_path / "s0.json"), str(tmp_path / "s0.json"), "--out", str(tmp_path / "m")]) == 0
    merged = json.loads((tmp_path / "m.json").read_text())
    assert len(merged["rows"]) == len(rows) and "--merge" in merged["command"]

    # a failed row is run again by --resume and replaced, not kept beside the new one
    result = json.loads((tmp_path / "s0.json").read_text())
    failed = next(r for r in result["rows"] if r["method"] == "tp-magnitude")
    failed["error"] = "RuntimeError: made to fail by the test"
    (tmp_path / "s0.json").write_text(json.dumps(result))
    assert fs.main([*argv, "--resume"]) == 0
    resumed = json.loads((tmp_path / "s0.json").read_text())["rows"]
    assert len(resumed) == len(rows) and not any("error" in r for r in resumed)


def test_bad_batches_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        fs.main(["--batches", "0", "--out", str(tmp_path / "x")])
    assert e.value.code == 2 and "--batches" in capsys.readouterr().err
    for argv, flag in ((["--nets", "no_such_net"], "--nets"), (["--epochs", "0"], "--epochs"),
                       (["--mc", "0"], "--mc")):
        with pytest.raises(SystemExit) as e:
            fs.main([*argv, "--out", str(tmp_path / "x")])
        assert e.value.code == 2 and flag in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_the_summary_averages_each_method_over_its_seeds_and_counts_failures():
    base = {"net": "n", "batch_asked": "32", "batch": 32, "final_structure_steps": 97}
    rows = [{**base, "seed": 0, "dense_accuracy": 0.9, "method": "edgebayes-ss-gl", "accuracy": 0.8, "ece": 0.02},
            {**base, "seed": 1, "dense_accuracy": 0.8, "method": "edgebayes-ss-gl", "accuracy": 0.7, "ece": 0.04},
            {**base, "seed": 0, "dense_accuracy": 0.9, "method": "tp-magnitude", "accuracy": 0.6, "ece": 0.1},
            {**base, "seed": 1, "dense_accuracy": 0.8, "method": "tp-magnitude", "error": "ZeroDivisionError: x"}]
    line = fs.summary(rows)[-1]
    assert line == "| n (85.00) | 32 | 2 | 97 | 75.00 (0.0300) | 60.00 (0.1000), fails on 1 |"


def test_merge_and_resume_refuse_rows_made_with_other_settings(tmp_path, capsys):
    row = {"net": "n", "seed": 0, "batch_asked": "32", "method": "edgebayes-ss-gl", "error": "x"}
    args = {"data": "digits", "train_size": 1150, "val_size": 300, "test_size": 360, "data_seed": 0,
            "dense_epochs": 10, "epochs": 3, "mc": 4, "target": 0.5}
    for name, target in (("a", 0.5), ("b", 0.25)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"rows": [row], "command": "c",
                                                            "args": {**args, "target": target}}))
    with pytest.raises(SystemExit) as e:
        fs.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "m")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--merge" in err and "b.json" in err and "'target': 0.25" in err
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SystemExit) as e:
        fs.main(["--merge", str(tmp_path / "bad.json"), "--out", str(tmp_path / "m")])
    assert e.value.code == 2 and "bad.json" in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()

    with pytest.raises(SystemExit) as e:   # a.json made at target 0.5, resumed at 0.25
        fs.main(["--resume", "--target", "0.25", "--out", str(tmp_path / "a")])
    assert e.value.code == 2 and "--resume" in capsys.readouterr().err
