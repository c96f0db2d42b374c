"""The ELBO trainer: resuming after an interruption gives the same model as an uninterrupted run."""

import copy

import pytest
import torch
from torch import nn

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


def test_geometric_kl_warmup_spends_equal_steps_per_decade_and_ends_at_one():
    """train.kl_warmup_from: from that factor up to 1, geometrically (a linear warm-up leaves the KL below
    1e-3 of its weight for only the first 0.1% of its steps), then exactly 1; 0 keeps the linear ramp."""
    factor = trainer.kl_warmup_factor
    steps = 1000
    geometric = [factor(s, steps, 1e-4) for s in range(steps + 5)]
    assert geometric[0] == pytest.approx(1e-4 ** (1 - 1 / steps))
    assert all(b > a for a, b in zip(geometric[:steps - 1], geometric[1:steps]))
    assert geometric[steps - 1:] == [1.0] * 6
    below = [sum(f < 10.0**-d for f in geometric) for d in (1, 2, 3)]
    assert below == pytest.approx([750, 500, 250], abs=2)   # a quarter of the steps per decade
    assert [factor(s, steps) for s in (0, 499, 999, 2000)] == [pytest.approx(0.001), 0.5, 1.0, 1.0]
    assert factor(7, 0, 1e-4) == 1.0   # no warm-up: the exact ELBO


def test_ordered_kl_warmup_prices_the_units_one_after_another_then_gives_the_exact_elbo():
    """train.kl_warmup_ordered: at progress p, unit j of J feels the KL's whole gradient on its inclusion logit
    once p > (J - 1 - j) / J and `start` times it before (the last unit first). The KL's value and its gradient
    on every other parameter (the slab, the scales) are the exact ones throughout, and from p = 1 the factors
    are gone."""
    from edgebayes.train.spike_slab import GlobalScale, SpikeSlabLinear

    torch.manual_seed(0)
    layer = SpikeSlabLinear(3, 4, prior="ss-gl", prior_inclusion=0.1, prunable=True, sigma0_sq=1.0,
                            temperature=0.5, gamma_init=0.9, global_scale=GlobalScale())
    output = SpikeSlabLinear(4, 2, prior="ss-gl", prior_inclusion=1.0, prunable=False, sigma0_sq=1.0,
                             temperature=0.5, gamma_init=0.9, global_scale=layer.scale.global_scale)
    model = torch.nn.Sequential(layer, output)

    def kl_and_gradients():
        kl = layer.kl()
        grads = torch.autograd.grad(kl, [layer.gamma_logit, layer.weight_rho, layer.weight_mu, layer.scale.mu])
        return kl.item(), grads

    exact, (g_logit, *g_rest) = kl_and_gradients()
    for progress, start, factors in ((0.5, 0.01, [0.01, 0.01, 1, 1]), (0.7, 0.0, [0, 1, 1, 1])):
        trainer.ordered_kl_warmup(model, progress, start)
        assert layer.unit_kl_factor.tolist() == pytest.approx(factors)
        assert output.unit_kl_factor is None   # the output layer has no units to switch off
        value, (logit, *rest) = kl_and_gradients()
        assert value == pytest.approx(exact, rel=1e-6)
        assert torch.allclose(logit, g_logit * torch.tensor(factors), rtol=1e-5, atol=1e-12)
        assert all(torch.allclose(a, b, rtol=1e-5) for a, b in zip(rest, g_rest))
    trainer.ordered_kl_warmup(model, 1.0)
    assert layer.unit_kl_factor is None
    assert torch.equal(kl_and_gradients()[1][0], g_logit)


def test_ordered_kl_warmup_is_refused_where_it_has_nothing_to_order(tmp_path):
    """kl_warmup_ordered needs a warm-up and a spike-and-slab family; the message names the field."""
    from edgebayes.config import ConfigError, load_pipeline_config

    for family, epochs in (("ss-gl", 0), ("bn3", 2), ("bnn", 2)):
        path = tmp_path / f"{family}.yaml"
        path.write_text(f"model: {{family: {family}}}\ntrain: {{epochs: 3, kl_warmup_epochs: {epochs}, "
                        "kl_warmup_ordered: true}\n")
        with pytest.raises(ConfigError, match="train.kl_warmup_ordered"):
            load_pipeline_config(path)


def test_inclusion_lr_puts_the_inclusion_logits_in_their_own_group(setup, tmp_path):
    """train.inclusion_lr: Adam steps the inclusion logits at that rate and every other parameter at lr;
    refused (naming the field) for a family without inclusion logits."""
    from edgebayes.config import ConfigError, load_pipeline_config
    from edgebayes.train import families

    cfg, splits = setup
    cfg = copy.deepcopy(cfg)
    cfg.model.family, cfg.train.inclusion_lr = "ss-gl", 0.05
    model = families.build(cfg, splits)
    optimizer, _ = trainer.ELBO().optimizer(model, cfg.train)
    logits = {id(layer.gamma_logit) for _, layer in model.bayesian_layers() if layer.prunable}
    by_lr = {g["lr"]: {id(p) for p in g["params"]} for g in optimizer.param_groups}
    assert by_lr == {cfg.train.lr: {id(p) for p in model.parameters()} - logits, 0.05: logits}
    assert logits
    for family in ("bnn", "bn3"):
        path = tmp_path / f"{family}.yaml"
        path.write_text(f"model: {{family: {family}}}\ntrain: {{inclusion_lr: 0.01}}\n")
        with pytest.raises(ConfigError, match="train.inclusion_lr"):
            load_pipeline_config(path)


def test_rho_lr_puts_the_slab_rho_in_its_own_group(setup, tmp_path):
    """train.rho_lr: the weights' and biases' rho (sigma = softplus(rho)) step at that rate, beside the inclusion
    logits' own rate, everything else at lr; refused (naming the field) for families without a Gaussian slab."""
    from edgebayes.config import ConfigError, load_pipeline_config
    from edgebayes.train import families

    cfg, splits = setup
    cfg = copy.deepcopy(cfg)
    cfg.model.family, cfg.train.inclusion_lr, cfg.train.rho_lr = "ss-ig", 0.05, 0.02
    model = families.build(cfg, splits)
    optimizer, _ = trainer.ELBO().optimizer(model, cfg.train)
    layers = [layer for _, layer in model.bayesian_layers()]
    logits = {id(layer.gamma_logit) for layer in layers if layer.prunable}
    rhos = {id(layer.weight_rho) for layer in layers} | {id(layer.bias_rho) for layer in layers
                                                           if layer.bias_rho is not None}
    by_lr = {g["lr"]: {id(p) for p in g["params"]} for g in optimizer.param_groups}
    assert by_lr == {cfg.train.lr: {id(p) for p in model.parameters()} - logits - rhos, 0.05: logits, 0.02: rhos}
    assert len(rhos) > len(layers)   # weights and biases
    for family in ("dnn", "bn3", "sqs"):
        path = tmp_path / f"{family}.yaml"
        path.write_text(f"model: {{family: {family}}}\ntrain: {{rho_lr: 0.01}}\n")
        with pytest.raises(ConfigError, match="train.rho_lr"):
            load_pipeline_config(path)


def test_scale_lr_puts_the_scale_variables_in_their_own_group(setup, tmp_path):
    """train.scale_lr: the LogNormal posteriors of SS-GL's and SS-GHS's scale variables (tau per group, the global
    varsigma) step at that rate, everything else as before; refused (naming the field) for families without them."""
    from edgebayes.config import ConfigError, load_pipeline_config
    from edgebayes.train import families
    from edgebayes.train.spike_slab import GlobalHorseshoeScale, GlobalScale

    cfg, splits = setup
    for family, global_type in (("ss-gl", GlobalScale), ("ss-ghs", GlobalHorseshoeScale)):
        c = copy.deepcopy(cfg)
        c.model.family, c.train.inclusion_lr, c.train.scale_lr = family, 0.05, 0.03
        model = families.build(c, splits)
        optimizer, _ = trainer.ELBO().optimizer(model, c.train)
        layers = [layer for _, layer in model.bayesian_layers()]
        logits = {id(layer.gamma_logit) for layer in layers if layer.prunable}
        scales = {id(p) for layer in layers for p in layer.scale.parameters()}
        assert isinstance(model.global_scale, global_type)
        scales |= {id(p) for p in model.global_scale.parameters()}
        by_lr = {g["lr"]: {id(p) for p in g["params"]} for g in optimizer.param_groups}
        assert by_lr == {c.train.lr: {id(p) for p in model.parameters()} - logits - scales, 0.05: logits, 0.03: scales}
        assert len(scales) > 2 * len(layers)   # each layer's mu and rho, and the global scale's
    for family in ("ss-ig", "bnn", "dnn"):
        path = tmp_path / f"{family}.yaml"
        path.write_text(f"model: {{family: {family}}}\ntrain: {{scale_lr: 0.01}}\n")
        with pytest.raises(ConfigError, match="train.scale_lr"):
            load_pipeline_config(path)


def test_a_run_with_an_ordered_warmup_ends_on_the_exact_elbo(setup, tmp_path, monkeypatch):
    """The trainer sets the ordered warm-up's factors every warm-up step and removes them at its last, so the
    model it returns (and the KL of its last epochs) carries none; the KL term has no factor on it."""
    cfg, splits = setup
    cfg = copy.deepcopy(cfg)
    cfg.model.family, cfg.train.epochs = "ss-gl", 2
    cfg.train.kl_warmup_epochs, cfg.train.kl_warmup_ordered, cfg.train.inclusion_lr = 1, True, 1e-2
    seen = []
    real = trainer.ordered_kl_warmup
    monkeypatch.setattr(trainer, "ordered_kl_warmup",
                        lambda model, progress, start=0.0: (seen.append(progress), real(model, progress, start)))
    model, history = fit(cfg, splits, tmp_path / "o.pt", log=lambda *_: None)
    steps = -(-len(splits.train_x) // cfg.train.batch_size)
    assert seen == [(s + 1) / steps for s in range(steps)]   # the warm-up's steps, the last one at 1
    assert all(layer.unit_kl_factor is None for _, layer in model.bayesian_layers())
    assert len(history) == 2 and all(h["kl_warmup"] == 1.0 for h in history)


def test_a_diverged_run_stops_with_one_message_and_keeps_the_last_finite_checkpoint(setup, tmp_path, monkeypatch):
    """A learning rate far too large sends the weights to inf / NaN in the first epoch: the run stops there with
    one message naming the epoch and what to change, and writes no checkpoint. Weights that blow up in the
    second epoch (scaled by 1e30 as it starts, standing for a late divergence): the checkpoint keeps the first."""
    cfg, splits = setup
    cfg = copy.deepcopy(cfg)
    cfg.train.epochs, cfg.train.optimizer, cfg.train.lr = 3, "sgd", 1e6
    with pytest.raises(trainer.TrainingDiverged) as e:
        fit(cfg, splits, tmp_path / "a.pt", log=lambda *_: None)
    assert "not finite after epoch 1 of 3" in str(e.value) and "train.lr 1e+06" in str(e.value)
    assert "back at the weights it started from; nothing is checkpointed" in str(e.value)
    assert not (tmp_path / "a.pt").exists()

    cfg.train.lr = 1e-3
    real_start = trainer.ELBO.start_epoch

    def blow_up_in_epoch_2(self, model, epoch, epochs):
        real_start(self, model, epoch, epochs)
        if epoch == 1:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1e30)
    monkeypatch.setattr(trainer.ELBO, "start_epoch", blow_up_in_epoch_2)
    with pytest.raises(trainer.TrainingDiverged) as e:
        fit(cfg, splits, tmp_path / "b.pt", log=lambda *_: None)
    message = str(e.value)
    assert "not finite after epoch 2 of 3" in message and "epoch 1 had mean NLL" in message
    assert "back at its weights after epoch 1, which the checkpoint holds" in message
    state = torch.load(tmp_path / "b.pt", weights_only=True)
    assert state["epoch"] == 1 and len(state["history"]) == 1
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


def test_fit_leaves_a_diverged_network_at_its_last_finite_weights(monkeypatch):
    """eb.fit trains the user's module in place: after a diverged epoch it holds the weights before that epoch
    (the start's when the first diverges, the last finite epoch's after), never the non-finite ones. The weights
    are blown up (x 1e30) as the diverging epoch starts, standing for a learning rate far too large."""
    import edgebayes as eb

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(96, 1, 6, 6, generator=g), torch.randint(0, 3, (96,), generator=g)
    real_start = trainer.ELBO.start_epoch
    for diverging, says in ((0, "the weights it started from; nothing is checkpointed"),
                            (1, "its weights after epoch 1, which the checkpoint holds")):
        net = eb.bayesianize(nn.Sequential(nn.Flatten(), nn.Linear(36, 16), nn.ReLU(), nn.Linear(16, 3)), "ss-gl",
                             input_shape=(1, 6, 6), n_train=len(x))
        before = {}

        def blow_up(self, model, epoch, epochs):
            real_start(self, model, epoch, epochs)
            if epoch == diverging:
                before.update(copy.deepcopy(model.state_dict()))
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(1e30)
        monkeypatch.setattr(trainer.ELBO, "start_epoch", blow_up)
        with pytest.raises(trainer.TrainingDiverged, match=f"not finite after epoch {diverging + 1} of 2") as e:
            eb.fit(net, x, y, epochs=2, lr=1e-3, log=lambda *_: None)
        assert says in str(e.value)
        assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())


def test_a_training_that_loses_the_trained_network_says_so_and_one_from_scratch_does_not(tmp_path):
    """bn3 fine-tuned a trained MobileNetV2 from 90% to 23% and said nothing (train/nested.py); any training that
    ends more than LOST_ACCURACY below the network it was given now says so, in the log and the history (the
    report's warnings read it). Here: a trained net fine-tuned on labels shifted by one class."""
    import edgebayes as eb

    g = torch.Generator().manual_seed(0)
    y = torch.randint(4, (400,), generator=g)
    x = torch.randn(400, 8, generator=g) * 0.3 + nn.functional.one_hot(y, 8).float() * 2   # separable classes
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(module.parameters(), 1e-2)
    for _ in range(100):
        opt.zero_grad()
        nn.functional.cross_entropy(module(x), y).backward()
        opt.step()
    relabelled = (y + 1) % 4
    val = (x[:100], y[:100])
    lines = []
    net = eb.bayesianize(module, "bnn", input_shape=(8,), n_train=400)
    history = eb.fit(net, x, relabelled, val=val, epochs=3, batch_size=50, lr=5e-2, log=lines.append)
    assert history[0]["val_accuracy_before"] > 0.9 and history[-1]["val_accuracy"] < 0.6
    assert "validation accuracy fell from" in history[-1]["accuracy_lost"]
    assert any(str(line).startswith("train: WARNING validation accuracy fell") for line in lines)
    # in slices (until_epoch) the same: the network as given is the first slice's
    sliced = eb.bayesianize(module, "bnn", input_shape=(8,), n_train=400)
    for k in (1, 2, 3):
        h = eb.fit(sliced, x, relabelled, val=val, epochs=3, batch_size=50, lr=5e-2, log=lambda *_: None,
                   checkpoint=tmp_path / "sliced.pt", until_epoch=k)
    assert h[-1]["accuracy_lost"] == history[-1]["accuracy_lost"]
    scratch = eb.bayesianize(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), "bnn", input_shape=(8,),
                             n_train=400)
    history = eb.fit(scratch, x, y, val=val, epochs=2, batch_size=50, lr=1e-2, log=lambda *_: None)
    assert "accuracy_lost" not in history[-1] and history[-1]["val_accuracy"] > history[0]["val_accuracy_before"]


def test_a_training_that_loses_the_network_it_reached_says_so():
    """A spike-and-slab run on a small training set learnt the task during its KL warm-up, then the exact KL
    switched its units off together and it ended near chance, with nothing said (LeNet-5 on 20,000 MNIST images:
    0.971 after epoch 4, 0.116 after epoch 12, benchmarks/results/peer_bayesian_torch.md). The warning now names
    the best epoch; the setting it names (a smaller kl_weight) keeps the network, and says nothing."""
    import edgebayes as eb

    g = torch.Generator().manual_seed(0)
    y = torch.randint(4, (400,), generator=g)
    x = torch.randn(400, 8, generator=g) * 0.3 + nn.functional.one_hot(y, 8).float() * 2
    val = (x[:100], y[:100])

    def run(**kw):
        torch.manual_seed(0)
        net = eb.bayesianize(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)), "ss-gl", input_shape=(8,),
                             n_train=400)
        lines = []
        history = eb.fit(net, x, y, val=val, epochs=8, batch_size=50, lr=1e-2, kl_warmup_epochs=3, inclusion_lr=0.3,
                         log=lines.append, **kw)
        return history, lines

    history, lines = run()
    best = max(history[:-1], key=lambda h: h["val_accuracy"])
    assert best["val_accuracy"] - history[-1]["val_accuracy"] > trainer.LOST_ACCURACY
    said = history[-1]["accuracy_lost"]
    assert f"fell from {best['val_accuracy']:.3f} (after epoch {best['epoch']})" in said and "kl_weight" in said
    assert any(str(line) == f"train: WARNING {said}" for line in lines)
    history, _ = run(kl_weight=0.01)
    assert history[-1]["val_accuracy"] > 0.9 and "accuracy_lost" not in history[-1]


def test_what_a_schedule_cut_costs_is_not_said_as_a_lost_network():
    """Epochs before the one with a FLOPs target's (or SQS's) last cut are left out of the comparison: the
    schedule is still cutting the network there, and its own verdict says what the target costs."""
    history = [{"epoch": 1, "val_accuracy": 0.95}, {"epoch": 2, "val_accuracy": 0.90}, {"epoch": 3, "val_accuracy": 0.80}]
    assert trainer.lost_accuracy(None, history, settled_epoch=2) is None
    assert "after epoch 1" in trainer.lost_accuracy(None, history, settled_epoch=1)
    assert "the network as given" in trainer.lost_accuracy(0.97, history, settled_epoch=2)
    assert "what the cut to 0.5 of the dense FLOPs cost" in trainer.lost_accuracy(0.97, history, 2, flops_target=0.5)
    # SQS validates the given network already quantized: said as that, with SQS's own advice (it advised a
    # spike-and-slab family)
    from edgebayes.train.sqs import SQSObjective

    said = trainer.lost_accuracy(0.97, history, 2, start=SQSObjective.start)
    assert "0.970 (the network SQS starts from, quantized" in said and "sqs.lr_quantization" in said
    assert "spike-and-slab" not in said


def test_a_checkpoint_of_another_config_is_not_resumed_and_the_log_says_so(tmp_path, capsys, monkeypatch):
    """An interrupted run's checkpoint, then the config changed: training started over without a word (probe)."""
    from pathlib import Path

    from edgebayes.cli import main

    real_save = trainer.atomic_torch_save

    def save_then_die(obj, path):
        real_save(obj, path)
        raise KeyboardInterrupt

    args = ["train", "--config", str(Path(__file__).parents[1] / "pipeline.yaml"), "--runs-dir", str(tmp_path),
            "--set", "train.flops_target=null"]
    monkeypatch.setattr(trainer, "atomic_torch_save", save_then_die)
    assert main([*args, "--set", "train.epochs=3"]) == 130
    monkeypatch.setattr(trainer, "atomic_torch_save", real_save)
    capsys.readouterr()
    assert main([*args, "--set", "train.epochs=2"]) == 0
    out = capsys.readouterr().out
    assert "train: starting over: " in out and "is of another config, data or code" in out, out
