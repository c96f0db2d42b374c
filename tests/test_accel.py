"""The fast training path (train/accel.py): device augmentation, bf16 autocast with fp32 KL, channels_last,
torch.compile with its fallback. Run on the CPU here; the same code runs on CUDA."""

import copy

import pytest
import torch
import torch.nn.functional as F

from edgebayes.train.families import fit
from edgebayes.config import PipelineConfig
from edgebayes.data import load_data
from edgebayes.train import accel
from edgebayes.train.accel import DeviceData, augment, autocast
from edgebayes.train.models import build_model
from edgebayes.train.sqs import build_sqs

QUIET = dict(log=lambda *_: None)


@pytest.fixture(scope="module")
def digits():
    cfg = PipelineConfig()
    cfg.model.hidden = [16, 16]
    cfg.train.device, cfg.train.batch_size, cfg.train.mc_samples_val = "cpu", 64, 1
    return cfg, load_data(cfg.data, cfg.seed)


def _matches(out, image, padding):
    """(dy, dx, flipped) such that `out` is the crop at (dy, dx) of the zero-padded image, mirrored if flipped."""
    padded = F.pad(image, (padding,) * 4)
    h, w = image.shape[-2:]
    found = []
    for dy in range(2 * padding + 1):
        for dx in range(2 * padding + 1):
            crop = padded[:, dy: dy + h, dx: dx + w]
            for flipped, candidate in ((False, crop), (True, crop.flip(-1))):
                if torch.equal(out, candidate):
                    found.append((dy, dx, flipped))
    return found


def test_augment_is_a_crop_of_the_padded_image_then_a_flip_drawn_per_sample():
    torch.manual_seed(0)
    x = torch.rand(256, 3, 12, 10)  # random content: a crop / flip matches exactly one candidate
    out = augment(x, 4)
    assert out.shape == x.shape and out.dtype == x.dtype
    draws = []
    for i in range(len(x)):
        found = _matches(out[i], x[i], 4)
        assert len(found) == 1, (i, found)
        draws.append(found[0])
    offsets = {(dy, dx) for dy, dx, _ in draws}
    flips = [f for _, _, f in draws]
    assert len(offsets) > 40  # 81 possible offsets, 256 samples: each sample draws its own
    assert 0.35 < sum(flips) / len(flips) < 0.65
    assert {dy for dy, _ in offsets} == {dx for _, dx in offsets} == set(range(9))  # offsets span 0..2p
    # Shifted content with zeros where the window leaves the image: the sum of a crop never exceeds the image's.
    assert bool((out.flatten(1).sum(1) <= x.flatten(1).sum(1) + 1e-5).all())
    assert not torch.equal(augment(x, 4), out)  # a new draw per call


def test_augment_without_padding_only_flips():
    x = torch.rand(64, 1, 5, 5)
    out = augment(x, 0)
    for i in range(len(x)):
        assert torch.equal(out[i], x[i]) or torch.equal(out[i], x[i].flip(-1))


def test_device_data_shards_are_the_single_process_batch():
    x, y = torch.arange(50.0).view(50, 1, 1, 1), torch.arange(50)
    single = list(DeviceData(x, y, torch.device("cpu"), 8, seed=3).batches(epoch=1))
    shards = [list(DeviceData(x, y, torch.device("cpu"), 8, seed=3, rank=r, world_size=2).batches(epoch=1))
              for r in range(2)]
    assert len(single) == 7 and [b[2] for b in single] == [8] * 6 + [2]
    for (xs, ys, b), (x0, y0, b0), (x1, y1, b1) in zip(single, *shards):
        assert b == b0 == b1 and sorted(torch.cat([y0, y1]).tolist()) == sorted(ys.tolist())
        assert len(y0) == len(y1) == b // 2
    other_epoch = [b[1] for b in DeviceData(x, y, torch.device("cpu"), 8, seed=3).batches(epoch=2)]
    assert not torch.equal(torch.cat(other_epoch), torch.cat([b[1] for b in single]))


@pytest.mark.parametrize("family", ["bnn", "ss-ig", "ss-gl", "ss-ghs"])
def test_kl_under_bf16_autocast_is_fp32_and_equals_the_fp32_kl(digits, family):
    cfg = copy.deepcopy(digits[0])
    cfg.model.family = family
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.prior, (1, 8, 8), 10, n_train=1000)
    torch.manual_seed(1)  # SS-GHS estimates one expectation by sampling: the same draws both times
    reference = model.kl()
    torch.manual_seed(1)
    with autocast(torch.device("cpu"), "bf16"):
        kl = model.kl()
        logits = model.train()(torch.rand(4, 1, 8, 8))
    assert logits.dtype == torch.bfloat16  # the forward did run in bf16 ...
    assert kl.dtype == torch.float32 and torch.equal(kl, reference)  # ... the KL did not
    assert all(p.dtype == torch.float32 for p in model.parameters())  # log-variances (rho) included


def test_sqs_regularizer_under_bf16_autocast_is_fp32_and_equal(digits):
    cfg = copy.deepcopy(digits[0])
    cfg.model.family = "sqs"
    torch.manual_seed(0)
    model = build_sqs(cfg, (1, 8, 8), 10, 1000).initialise(0.99, 0)
    weights, reference = model.weights_and_regularizer(0.8)
    with autocast(torch.device("cpu"), "bf16"):
        weights_bf16, reg = model.weights_and_regularizer(0.8)
    assert reg.dtype == torch.float32 and torch.equal(reg, reference)
    assert all(torch.equal(weights[k], weights_bf16[k]) for k in weights)


def test_training_under_bf16_autocast_learns_digits(digits, tmp_path):
    cfg, splits = copy.deepcopy(digits[0]), digits[1]
    cfg.model.family, cfg.train.precision = "ss-gl", "bf16"
    cfg.train.epochs, cfg.train.kl_weight, cfg.train.lr = 15, 0.1, 3e-3
    model, history = fit(cfg, splits, tmp_path / "bf16.pt", **QUIET)
    assert history[-1]["loss"] < history[0]["loss"]
    assert history[-1]["val_accuracy"] > 0.8
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_channels_last_and_augmentation_train_a_convolutional_net(digits, tmp_path):
    """ResNet-20 (dnn) on digits: channels_last changes only the memory layout, so one epoch gives the
    contiguous run's loss up to the convolution algorithm's rounding; augmentation changes the inputs."""
    cfg, splits = copy.deepcopy(digits[0]), digits[1]
    cfg.model.family, cfg.model.arch, cfg.train.epochs, cfg.train.batch_size = "dnn", "resnet20", 1, 256
    _, plain = fit(cfg, splits, tmp_path / "plain.pt", **QUIET)
    cfg.train.channels_last = True
    model, nhwc = fit(cfg, splits, tmp_path / "nhwc.pt", **QUIET)
    assert nhwc[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-4)
    assert all(p.is_contiguous() for p in model.parameters())  # handed back in the default layout
    cfg.train.augment, cfg.train.augment_padding = True, 2
    _, augmented = fit(cfg, splits, tmp_path / "aug.pt", **QUIET)
    assert augmented[0]["loss"] != pytest.approx(nhwc[0]["loss"], rel=1e-4)


def test_compile_falls_back_to_eager_and_says_why(digits, tmp_path, monkeypatch):
    cfg, splits = copy.deepcopy(digits[0]), digits[1]
    cfg.model.family, cfg.train.epochs, cfg.train.compile = "dnn", 1, True

    def broken(*_, **__):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch, "compile", broken)
    messages = []
    _, history = fit(cfg, splits, tmp_path / "c.pt", log=messages.append)
    assert any("torch.compile failed (RuntimeError: no C++ compiler found)" in m and "eager" in m for m in messages)
    cfg.train.compile = False
    _, eager = fit(cfg, splits, tmp_path / "e.pt", **QUIET)
    assert history[0]["loss"] == eager[0]["loss"]


def test_compiled_training_matches_eager(digits, tmp_path):
    """The real torch.compile of the forward and the KL (inductor needs a C++ compiler on the CPU). Inductor
    draws its own random numbers unless told to use eager's: with fallback_random the runs are comparable.
    (inductor's own config.patch, not monkeypatch: monkeypatch's undo deletes the option, which hides it and
    breaks every later torch.export in the session, litert-torch's TFLite conversion among them.)"""
    import torch._inductor.config

    cfg, splits = copy.deepcopy(digits[0]), digits[1]
    cfg.model.family, cfg.train.epochs, cfg.train.batch_size = "ss-gl", 1, 256
    _, eager = fit(cfg, splits, tmp_path / "e.pt", **QUIET)
    cfg.train.compile = True
    messages = []
    with torch._inductor.config.patch(fallback_random=True):
        _, compiled = fit(cfg, splits, tmp_path / "c.pt", log=messages.append)
    assert "train.compile: forward and KL compiled with torch.compile" in messages
    assert compiled[0]["loss"] == pytest.approx(eager[0]["loss"], rel=1e-4)
    assert compiled[0]["kl"] == pytest.approx(eager[0]["kl"], rel=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_fast_path_learns_digits(digits, tmp_path):
    """On a GPU: the split on the device, bf16 autocast, channels_last (the CPU bf16 test's settings; it
    asks 0.8 there); then the augmentation's crop / flip on the device. (With augmentation the digits MLP
    learns slower: 0.63 after these 15 epochs on the CPU.)"""
    cfg, splits = copy.deepcopy(digits[0]), digits[1]
    cfg.model.family, cfg.train.device, cfg.train.precision, cfg.train.channels_last = "ss-gl", "cuda", "bf16", True
    cfg.train.epochs, cfg.train.kl_weight, cfg.train.lr = 15, 0.1, 3e-3
    model, history = fit(cfg, splits, tmp_path / "cuda.pt", **QUIET)
    assert history[-1]["loss"] < history[0]["loss"] and history[-1]["val_accuracy"] > 0.7
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    x = torch.rand(16, 3, 6, 6, device="cuda")
    out = augment(x, 2)
    assert out.device.type == "cuda" and all(len(_matches(out[i].cpu(), x[i].cpu(), 2)) == 1 for i in range(16))


@pytest.mark.parametrize("busy,expected", [(0.0, 4), (0.4, 4), (1.2, 3), (3.6, 1), (9.0, 1)])
def test_free_cores_are_the_affinity_set_minus_the_busy_ones(monkeypatch, busy, expected):
    monkeypatch.setattr(accel.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert accel.free_cores(busy) == expected


# /proc/stat of a 4-core machine (the aggregate line first, then one line per core, then other counters)
PROC_STAT = """cpu  400 0 0 400 0 0 0 0 0 0
cpu0 100 0 0 0 0 0 0 0 0 0
cpu1 50 0 10 30 10 0 5 0 0 0
cpu2 0 0 0 100 0 0 0 0 0 0
cpu3 0 0 0 100 0 0 0 0 0 0
intr 12345 0 0
ctxt 999
"""


def test_proc_stat_ticks_count_idle_and_iowait_as_free_and_only_the_cores_asked():
    assert accel.proc_stat_ticks(PROC_STAT, {0, 1}) == (100 + 65, 100 + 105)
    assert accel.proc_stat_ticks(PROC_STAT, {2, 3}) == (0, 200)
    assert accel.proc_stat_ticks(PROC_STAT, {7}) == (0, 0)      # a core not listed counts nothing


def test_cores_busy_elsewhere_subtract_this_process_own_cpu_time():
    """Issue 20: a process started a second before must count, which the 1-minute load average misses."""
    # 2 cores over 1 s (100 ticks each): one busy all the time, the other idle
    assert accel.cores_busy_elsewhere((0, 0), (100, 200), 2, own_cpu_seconds=0.0, wall_seconds=1.0) == 1.0
    # both busy, this process's spinning threads held one of them: one core busy elsewhere
    assert accel.cores_busy_elsewhere((0, 0), (200, 200), 2, own_cpu_seconds=1.0, wall_seconds=1.0) == 1.0
    # this process alone: nothing elsewhere (never negative); no ticks elapsed: nothing known to be busy
    assert accel.cores_busy_elsewhere((0, 0), (50, 200), 2, own_cpu_seconds=0.6, wall_seconds=1.0) == 0.0
    assert accel.cores_busy_elsewhere((10, 20), (10, 20), 2, own_cpu_seconds=0.0, wall_seconds=1.0) == 0.0


@pytest.mark.parametrize("load,expected", [(0.0, 2), (1.2, 1)])
def test_free_cores_fall_back_on_the_load_average_without_proc_stat(monkeypatch, tmp_path, load, expected):
    monkeypatch.setattr(accel, "PROC_STAT", str(tmp_path / "no-proc-stat"))   # macOS has none
    monkeypatch.setattr(accel.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(accel.os, "getloadavg", lambda: (load, 0.0, 0.0))
    assert accel.free_cores() == expected


def test_set_threads_never_exceeds_the_cores_and_defaults_to_the_free_ones(monkeypatch):
    """train.threads (issue 20): torch's default, every core, made two threads wait for each other when
    another process held one of two cores."""
    before = torch.get_num_threads()
    monkeypatch.setattr(accel.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(accel, "busy_elsewhere", lambda: 1.1)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        assert accel.set_threads(8) == 2 == torch.get_num_threads()      # capped at the cores
        assert accel.set_threads(0) == 1 == torch.get_num_threads()      # one core is busy elsewhere
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        assert accel.set_threads(0) == 1                                 # the environment chose already
    finally:
        torch.set_num_threads(before)


def test_hold_freed_memory_applies_on_glibc_linux_only(monkeypatch):
    """glibc's mallopt where there is one (this process keeps freed memory from then on, which a test run
    does not mind); a no-op elsewhere."""
    import platform

    from edgebayes.train import accel

    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert accel.hold_freed_memory() is glibc
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    assert accel.hold_freed_memory() is False


def test_both_trainers_step_with_the_fused_optimizer_on_cpu_and_stay_unfused_elsewhere(digits):
    """Adam / SGD of the ELBO trainer and AdamW of SQS take torch's fused kernel for CPU (and CUDA) parameters;
    parameters it has no kernel for (here on the meta device) keep torch's default loop."""
    from edgebayes.train.sqs import SQSObjective
    from edgebayes.train.trainer import ELBO

    cfg = digits[0]
    model = build_model(cfg.model, cfg.prior, (1, 8, 8), 10, n_train=1000)
    for optimizer in ("adam", "sgd"):
        t = copy.deepcopy(cfg.train)
        t.optimizer = optimizer
        opt, _ = ELBO().optimizer(model, t)
        assert opt.defaults["fused"] is True, optimizer
    sqs_opt, _ = SQSObjective(cfg.sqs).optimizer(build_sqs(cfg, (1, 8, 8), 10, 1000), cfg.train)
    assert sqs_opt.defaults["fused"] is True
    assert accel.fused_optimizer([torch.nn.Parameter(torch.zeros(2, device="meta"))]) == {}
    assert accel.fused_optimizer([{"params": [torch.nn.Parameter(torch.zeros(2))]}]) == {"fused": True}
