"""The ELBO trainer: resuming after an interruption gives the same model as an uninterrupted run."""

import copy

import pytest
import torch

import edgebayes.train.trainer as trainer
from edgebayes.train.families import fit
from edgebayes.config import PipelineConfig
from edgebayes.data import load_data


@pytest.fixture(scope="module")
def setup():
    cfg = PipelineConfig()
    cfg.model.hidden = [16, 16]
    cfg.train.epochs, cfg.train.batch_size, cfg.train.mc_samples_eval, cfg.train.device = 4, 256, 2, "cpu"
    return cfg, load_data(cfg.data, cfg.seed)


def test_resume_after_interruption_matches_uninterrupted_run(setup, tmp_path, monkeypatch):
    cfg, splits = setup
    full, _ = fit(cfg, splits, tmp_path / "full.pt", log=lambda *_: None)

    saves = {"n": 0}
    real_save = trainer.atomic_torch_save

    def save_then_die(obj, path):
        real_save(obj, path)
        saves["n"] += 1
        if saves["n"] == 2:
            raise KeyboardInterrupt  # interrupted right after epoch 2 was checkpointed

    monkeypatch.setattr(trainer, "atomic_torch_save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        fit(cfg, splits, tmp_path / "part.pt", log=lambda *_: None)
    monkeypatch.setattr(trainer, "atomic_torch_save", real_save)
    messages = []
    resumed, history = fit(cfg, splits, tmp_path / "part.pt", log=messages.append)

    assert any("after epoch 2" in m for m in messages)
    assert [h["epoch"] for h in history] == [1, 2, 3, 4]
    for (name, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name


def test_checkpoint_loads_with_weights_only(setup, tmp_path):
    cfg, splits = setup
    cfg = copy.deepcopy(cfg)
    cfg.train.epochs = 1
    fit(cfg, splits, tmp_path / "c.pt", log=lambda *_: None)
    state = torch.load(tmp_path / "c.pt", weights_only=True)
    assert state["epoch"] == 1 and "model" in state and "optimizer" in state


def test_training_reduces_the_loss_and_learns(setup, tmp_path):
    cfg, splits = setup
    cfg = copy.deepcopy(cfg)
    cfg.train.epochs, cfg.train.kl_weight, cfg.train.batch_size, cfg.train.lr = 15, 0.1, 64, 3e-3
    model, history = fit(cfg, splits, tmp_path / "l.pt", log=lambda *_: None)
    assert history[-1]["loss"] < history[0]["loss"]
    assert history[-1]["val_accuracy"] > 0.8


def test_history_records_mean_inclusion_of_prunable_layers(setup, tmp_path):
    """kept_nodes (gamma > 0.5) alone cannot tell a layer whose gammas all sit just below 0.5 from a dead one."""
    cfg, splits = setup
    cfg = copy.deepcopy(cfg)
    cfg.model.family, cfg.train.epochs = "ss-ig", 1
    model, history = fit(cfg, splits, tmp_path / "m.pt", log=lambda *_: None)
    record = history[-1]["mean_inclusion"]
    prunable = [n for n, layer in model.bayesian_layers() if layer.prunable]
    assert list(record) == prunable and len(prunable) == 2
    for name, layer in model.bayesian_layers():
        if layer.prunable:
            assert record[name] == pytest.approx(float(layer.inclusion_probability().mean().detach()))
            assert 0 < record[name] < 1
    state = torch.load(tmp_path / "m.pt", weights_only=True)
    assert state["history"][-1]["mean_inclusion"] == record


def test_posterior_mean_samples_inclusion_where_the_median_model_is_empty(setup, tmp_path):
    """Paper 000's estimator draws z ~ Ber(gamma) per sample: with gamma near 1 it agrees with the median model;
    with every node of a layer at gamma = 0.3 the median model (threshold 0.5) is empty and cannot be
    exported, yet each eval forward inside sampled_inclusion switches on about 30% of the nodes."""
    from edgebayes.compressed.samples import EmptyLayerError

    cfg, splits = copy.deepcopy(setup[0]), setup[1]
    cfg.train.epochs, cfg.train.batch_size = 30, 64  # enough for the digits MLP to learn (~0.9)
    model, _ = fit(cfg, splits, tmp_path / "m.pt", log=lambda *_: None)
    median = trainer.evaluate(model, splits.test_x, splits.test_y, 0.5, 8, cfg.seed)[0]["accuracy"]
    sampled = trainer.posterior_mean_metrics(model, splits.test_x, splits.test_y, 8, cfg.seed)["accuracy"]
    assert median > 0.6 and abs(sampled - median) < 0.05

    layer = next(mod for mod in model.modules() if getattr(mod, "prunable", False))
    with torch.no_grad():
        layer.gamma_logit.fill_(torch.logit(torch.tensor(0.3)).item())
    with pytest.raises(EmptyLayerError):
        trainer.evaluate(model, splits.test_x, splits.test_y, 0.5, 2, cfg.seed)
    outputs = []
    layer.register_forward_hook(lambda mod, inp, out: outputs.append(out))
    model.eval()
    with trainer.sampled_inclusion(model), torch.no_grad():
        for _ in range(200):
            model(splits.test_x[:4])
    on = torch.stack([(o != 0).any(0).float() for o in outputs])  # which nodes were on in each call
    assert abs(on.mean().item() - 0.3) < 0.03
    assert not layer.sample_inclusion  # the block restores the threshold


def test_kl_warmup_scales_the_kl_early_and_leaves_the_exact_elbo_after(setup, tmp_path):
    """train.kl_warmup_epochs: the KL term is scaled by min(1, step / warm-up steps) during the
    warm-up epochs and is the exact ELBO's afterwards; 0 changes nothing."""
    cfg, splits = setup
    cfg = copy.deepcopy(cfg)
    cfg.model.family, cfg.train.epochs, cfg.train.kl_warmup_epochs = "ss-ig", 3, 2
    _, history = fit(cfg, splits, tmp_path / "w.pt", log=lambda *_: None)
    steps = -(-len(splits.train_x) // cfg.train.batch_size)
    assert [h["kl_warmup"] for h in history] == [pytest.approx(steps / (2 * steps)), 1.0, 1.0]
    cfg.train.kl_warmup_epochs = 0
    _, plain = fit(cfg, splits, tmp_path / "p.pt", log=lambda *_: None)
    assert all(h["kl_warmup"] == 1.0 for h in plain)
    assert plain[0]["kl"] != history[0]["kl"]   # the early objective differs, so does the trajectory
