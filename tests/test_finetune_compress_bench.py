"""benchmarks/finetune_compress.py (issue 33): its quick path end to end on a small home-made CNN and
scikit-learn's digits (offline, seconds), and Torch-Pruning pruned to the FLOPs it is asked for."""

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from edgebayes.compressed.structure import paper_flops

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import finetune_compress as fc  # noqa: E402

pytest.importorskip("torch_pruning")

ISSUE_KEYS = {"net", "method", "seed", "target", "fine_tune_epochs", "flops_ratio_physical", "params_ratio",
              "accuracy", "dense_accuracy", "ece", "nll", "dense_ece", "dense_nll"}


def test_quick_run_writes_one_row_per_method_with_the_issues_keys(tmp_path):
    out, cache = tmp_path / "r_0.5", tmp_path / "cache"   # a dot in the name: r_0.5.json, not r_0.json
    argv = ["--quick", "--data", "digits", "--nets", "small-cnn", "--targets", "0.5", "--methods", "dense-ft",
            "edgebayes-ss-gl", *fc.TORCH_PRUNING, "--out", str(out), "--cache", str(cache)]
    assert fc.main(argv) == 0
    assert sorted(p.name for p in tmp_path.glob("r_*")) == ["r_0.5.json", "r_0.5.md", "r_0.5.png"]
    result = json.loads((tmp_path / "r_0.5.json").read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {"dense", "dense-ft", "edgebayes-ss-gl", *fc.TORCH_PRUNING}
    dense = rows["dense"]
    for r in rows.values():
        assert "error" not in r, r
        assert ISSUE_KEYS <= set(r)
        assert r["dense_accuracy"] == dense["accuracy"] and r["dense_ece"] == dense["ece"]   # one trained net
        assert 0 <= r["accuracy"] <= 1 and 0 < r["flops_ratio_physical"] <= 1 and 0 < r["params_ratio"] <= 1
    assert rows["dense-ft"]["fine_tune_epochs"] == 1 and rows["dense-ft"]["flops_ratio_physical"] == 1
    # edgebayes ships its fitted temperature (select.temperature_scaling), the plain nets T = 1; both figures in each
    for r in rows.values():
        shipped = "ts" if r["method"] in fc.EDGEBAYES else "raw"
        assert r["temperature"] > 0 and r["ece"] == r[f"ece_{shipped}"] and r["nll"] == r[f"nll_{shipped}"]
        assert r["nll_ts"] <= r["nll_raw"] + 0.05   # fitted on validation, scored on test: about as good or better
    eb = rows["edgebayes-ss-gl"]
    assert eb["mc_samples"] == 2 and eb["fine_tune_epochs"] == 1 and eb["target"] == 0.5
    reached = eb["flops_ratio_physical"] <= 0.5 * (1 + fc.TP_TOLERANCE)
    for method in fc.TORCH_PRUNING:   # pruned to the edgebayes row's physical FLOPs where it reached the target
        tp = rows[method]
        assert tp["flops_ratio_wanted"] == (eb["flops_ratio_physical"] if reached else 0.5)
        assert tp["matched_to"] == ("edgebayes-ss-gl" if reached else "target")
        # within what the channels of a 32 / 64-channel net allow (a 5% FLOPs step at most)
        assert abs(tp["flops_ratio_physical"] / tp["flops_ratio_wanted"] - 1) <= 0.06
        assert tp["fine_tune_epochs"] == 1 and "mc_samples" not in tp
    prov = result["provenance"]
    assert prov["git_commit"] and "torch" in prov["versions"] and prov["machine"]
    assert result["args"]["sizes"] == {"train": 256, "val": 64, "test": 128}
    md = (tmp_path / "r_0.5.md").read_text()
    assert md.startswith("# Compress a trained network") and result["command"] in md and "## small-cnn" in md
    assert "| 0.5 | tp-group-norm | 0 |" in md and "digits" in md and "256 training" in md
    assert (tmp_path / "r_0.5.png").read_bytes()[:4] == b"\x89PNG"
    assert len(list(cache.glob("small-cnn-seed0-*.pt"))) == 1   # the trained dense net, for later runs

    # --resume keeps every row of a finished run and trains nothing
    before = (tmp_path / "r_0.5.json").read_text()
    assert fc.main(argv + ["--resume"]) == 0
    assert json.loads((tmp_path / "r_0.5.json").read_text())["rows"] == json.loads(before)["rows"]
    with pytest.raises(SystemExit):   # other settings: refused, nothing mixed
        fc.main(argv + ["--resume", "--epochs", "2"])


def conv_stack(widths=(48, 80, 112, 144)):
    """Layers of different widths: FLOPs fine-grained enough in the pruning ratio for TP_TOLERANCE (a net
    whose layers share one width moves in steps of 1/width of every layer at once)."""
    layers, c = [], 3
    for w in widths:
        layers += [nn.Conv2d(c, w, 3, padding=1, stride=1 if c == 3 else 2, bias=False), nn.BatchNorm2d(w), nn.ReLU()]
        c = w
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))


def test_torch_pruning_is_given_the_most_flops_of_the_edgebayes_rows_that_reached_the_target():
    def row(method, flops, target=0.5, net="n", seed=0, **kw):
        return {"net": net, "seed": seed, "target": target, "method": method, "flops_ratio_physical": flops, **kw}
    rows = [row("edgebayes-ss-gl", 0.43), row("edgebayes-ss-ghs", 0.48), row("edgebayes-bn3", 0.71),
            row("edgebayes-ss-gl", 0.49, seed=1), row("edgebayes-ss-ghs", 0.30, target=0.25),
            row("edgebayes-ss-gl", 0.20, net="other"), row("edgebayes-ss-gl", 0.1, seed=2, error="x"),
            row("tp-magnitude", 0.45)]
    assert fc.tp_flops_wanted(rows, "n", 0, 0.5) == (0.48, "edgebayes-ss-ghs")   # bn3 missed 0.5: not it
    assert fc.tp_flops_wanted(rows, "n", 1, 0.5) == (0.49, "edgebayes-ss-gl")
    assert fc.tp_flops_wanted(rows, "n", 0, 0.25) == (0.25, "target")             # none reached 0.25
    assert fc.tp_flops_wanted(rows, "n", 2, 0.5) == (0.5, "target")               # a failed row is no row


@pytest.mark.parametrize("method", fc.TORCH_PRUNING)
def test_torch_pruning_reaches_the_flops_asked_for(method):
    torch.manual_seed(0)
    net = conv_stack()
    dense = paper_flops(net, fc.SHAPE)
    for wanted in (0.5, 0.37, 0.25):
        model, flops, ratio = fc.tp_match_flops(net, method, wanted, 10)
        assert flops == pytest.approx(paper_flops(model, fc.SHAPE) / dense)   # counted on the pruned net
        assert abs(flops / wanted - 1) <= fc.TP_TOLERANCE and 0 < ratio < 1
        assert model(torch.zeros((2,) + fc.SHAPE)).shape == (2, 10)
    model, flops, ratio = fc.tp_match_flops(net, method, 1.0, 10)
    assert (flops, ratio) == (1.0, 0.0) and model is not net


def test_a_network_torch_pruning_breaks_is_pruned_again_with_the_layers_it_breaks_on_kept_whole():
    torch.manual_seed(0)
    net = fc.make_net("custom").eval()
    with pytest.raises(RuntimeError, match="forward pass fails"):
        fc.tp_prune(net, "tp-magnitude", 0.3, 10)   # concatenation -> flatten -> Linear
    ignored = fc.tp_unprunable(net, 10)
    assert ignored and fc.tp_unprunable(conv_stack(), 10) == []
    dense = paper_flops(net, fc.SHAPE)
    for method in fc.TORCH_PRUNING:
        model, flops, ratio = fc.tp_match_flops(net, method, 0.5, 10, ignored=ignored)
        assert abs(flops / 0.5 - 1) <= fc.TP_TOLERANCE and flops == pytest.approx(paper_flops(model, fc.SHAPE) / dense)
        assert model(torch.zeros((2,) + fc.SHAPE)).shape == (2, 10)
        for name in ignored:   # its outputs kept whole (its inputs as the layers it reads are pruned)
            assert model.get_submodule(name).weight.shape[0] == net.get_submodule(name).weight.shape[0]


def test_bad_arguments_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        fc.main(["--epochs", "6", "--out", str(tmp_path / "r")])
    assert "--epochs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fc.main(["--targets", "0", "--out", str(tmp_path / "r")])
    assert fc.main(["--quick", "--mnist-root", str(tmp_path), "--out", str(tmp_path / "r")]) == 2
    assert "MNIST" in capsys.readouterr().err and not list(tmp_path.glob("r.*"))


def test_merge_joins_runs_of_the_same_settings_and_keeps_each_rows_commit(tmp_path):
    common = ["--quick", "--data", "digits", "--nets", "small-cnn", "--targets", "0.5", "--cache", str(tmp_path / "c")]
    assert fc.main([*common, "--methods", "edgebayes-ss-gl", "--out", str(tmp_path / "a")]) == 0
    assert fc.main([*common, "--methods", "tp-magnitude", "--out", str(tmp_path / "b")]) == 0
    b = json.loads((tmp_path / "b.json").read_text())
    b["rows"][0]["git_commit"] = "0123456789"   # as if run at another commit
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert fc.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "m")]) == 0
    merged = json.loads((tmp_path / "m.json").read_text())
    methods = sorted(r["method"] for r in merged["rows"])
    assert methods == ["dense", "edgebayes-ss-gl", "tp-magnitude"]   # the dense row once: the later file's
    assert len(merged["merged_from"]) == 2 and "| 0123456 |" in (tmp_path / "m.md").read_text()
    # Other settings are refused, naming them
    c = dict(b, settings={**b["settings"], "epochs": 5})
    (tmp_path / "c.json").write_text(json.dumps(c))
    assert fc.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "c.json"), "--out", str(tmp_path / "n")]) == 2
    assert not (tmp_path / "n.json").exists()
    # A file that is missing, or not this benchmark's results: one line naming it, exit 2
    (tmp_path / "x.json").write_text("[1, 2]")
    for bad in (tmp_path / "missing.json", tmp_path / "x.json"):
        assert fc.main(["--merge", str(tmp_path / "a.json"), str(bad), "--out", str(tmp_path / "n")]) == 2
    assert not (tmp_path / "n.json").exists()


def test_decay_last_epoch_ends_every_fine_tuning_at_a_tenth_of_the_rate(monkeypatch):
    """With --decay-last-epoch, Torch-Pruning's and dense-ft's fine-tuning (train_plain) and edgebayes'
    (train.lr_milestones) share the schedule: the last epoch at LR * FINE_TUNE_GAMMA."""
    seen = []
    adam = torch.optim.Adam
    monkeypatch.setattr(torch.optim, "Adam", lambda *a, **k: seen.append(adam(*a, **k)) or seen[-1])
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    x, y = torch.randn(16, 3, 2, 2), torch.randint(0, 3, (16,))
    fc.train_plain(net, x, y, 3, 0, "cpu", fc.fine_tune_milestones(3, True))
    assert fc.fine_tune_milestones(3, True) == [2] and fc.fine_tune_milestones(1, True) == []
    assert fc.fine_tune_milestones(3, False) == []
    assert seen[0].param_groups[0]["lr"] == pytest.approx(fc.LR * fc.FINE_TUNE_GAMMA ** 1)
    fc.train_plain(net, x, y, 3, 0, "cpu")   # the dense reference: a constant rate
    assert seen[1].param_groups[0]["lr"] == pytest.approx(fc.LR)


def test_the_fine_tuning_decays_its_last_epoch_unless_told_not_to(tmp_path):
    """The benchmark's recipe (module docstring): the last of E epochs at a tenth of the rate by default,
    --no-decay-last-epoch keeps the rate constant; the results' settings say which."""
    common = ["--quick", "--data", "digits", "--nets", "small-cnn", "--targets", "0.5", "--methods", "dense-ft",
              "--epochs", "2", "--cache", str(tmp_path / "c")]
    assert fc.main([*common, "--out", str(tmp_path / "a")]) == 0
    assert fc.main([*common, "--no-decay-last-epoch", "--out", str(tmp_path / "b")]) == 0
    decayed, constant = (json.loads((tmp_path / f"{n}.json").read_text())["settings"] for n in "ab")
    assert decayed["fine_tune_lr"] == f"x{fc.FINE_TUNE_GAMMA:g} at epochs [1]" and "fine_tune_lr" not in constant


def test_runs_that_differ_only_in_the_fine_tuning_share_the_trained_dense_net(tmp_path):
    common = ["--quick", "--data", "digits", "--nets", "small-cnn", "--targets", "0.5", "--methods", "dense-ft",
              "--cache", str(tmp_path / "c")]
    assert fc.main([*common, "--out", str(tmp_path / "a")]) == 0
    assert fc.main([*common, "--epochs", "2", "--mc", "3", "--out", str(tmp_path / "b")]) == 0
    assert len(list((tmp_path / "c").glob("small-cnn-seed0-*.pt"))) == 1
    assert fc.main([*common, "--dense-epochs", "2", "--out", str(tmp_path / "d")]) == 0   # the dense net's own
    assert len(list((tmp_path / "c").glob("small-cnn-seed0-*.pt"))) == 2


def test_the_over_seeds_table_reads_dense_first_then_methods_as_listed(tmp_path):
    common = ["--quick", "--data", "digits", "--nets", "small-cnn", "--targets", "0.5", "--cache", str(tmp_path / "c")]
    assert fc.main([*common, "--methods", "edgebayes-ss-gl", "tp-magnitude", "--out", str(tmp_path / "a")]) == 0
    result = json.loads((tmp_path / "a.json").read_text())
    # a second seed, and the rows in the reverse of their reading order, as a merge of several runs leaves them
    result["rows"] = [dict(r, seed=1) for r in result["rows"]][::-1] + result["rows"][::-1]
    table = fc.markdown(result).split("## Over seeds")[1]
    methods = [line.split(" | ")[2] for line in table.splitlines() if line.startswith("| small-cnn")]
    assert methods == ["dense", "edgebayes-ss-gl", "tp-magnitude"]


def test_a_run_is_listed_while_a_row_of_it_is_left():
    run = {"command": "python benchmarks/finetune_compress.py --nets custom --seeds 1 2 --targets 0.25 --out x",
           "git_commit": "abc"}
    row = {"net": "custom", "seed": 2, "method": "tp-magnitude", "target": 0.25, "git_commit": "abc"}
    assert fc._made_by(run, row)
    assert fc._made_by(run, {**row, "method": "dense", "target": None})                 # with every method
    assert not fc._made_by(run, {**row, "git_commit": "def"})                           # another commit's
    assert not fc._made_by(run, {**row, "seed": 0}) and not fc._made_by(run, {**row, "target": 0.5})
    assert not fc._made_by(run, {**row, "net": "resnet18"})
    assert fc._made_by({**run, "command": "python benchmarks/finetune_compress.py"},    # the defaults
                       {**row, "net": "resnet18", "seed": 0, "target": 0.5})


def test_a_results_path_keeps_the_dots_of_its_name():
    """Every benchmark's --out is given without suffix (provenance.result_path): a name with a dot keeps it, and
    a given .json / .md / .png is not doubled."""
    from edgebayes.provenance import result_path

    assert result_path("/tmp/eff_0.5", ".json") != result_path("/tmp/eff_0.25", ".json")
    assert result_path("/tmp/eff_0.5", ".md").name == "eff_0.5.md"
    assert result_path("/tmp/eff.json", ".png").name == "eff.png"
