"""What makes training fast on a GPU without changing the objective; used by both trainers (trainer.py, sqs.py).

- `DeviceData`: the training split held as tensors on the training device (MNIST, Fashion-MNIST and CIFAR-10
  fit in GPU memory many times over), an epoch's order from a permutation seeded by (seed, epoch), so every
  process of a distributed run draws the same one and a resumed run the same as an uninterrupted one; each
  process takes its shard of every global batch (train/distributed.py). `augment` crops and flips on the
  device, a whole batch at a time: no per-sample Python, no DataLoader workers.
- `autocast`: bf16 autocast of the forward pass (train.precision: bf16). Autocast runs only the matmuls and
  convolutions in bf16; parameters stay fp32 (so do the log-variances rho, the inclusion logits and the
  scale posteriors), and the trainers compute the KL terms and the cross-entropy outside autocast, in fp32
  (tests/test_accel.py checks the KL under autocast is fp32 and equal to the fp32 one). bf16 has fp32's
  exponent range, so the small posterior variances (softplus(-6)^2, about 6e-6) do not underflow the way
  they would in fp16, and no gradient scaler is needed.
- `channels_last`: NHWC memory format for the model and its inputs (tensor-core convolutions on GPUs).
- `set_threads`: torch's intra-op threads for a stage (train.threads; by default the cores no other process
  is busy on, from /proc/stat sampled for half a second: `free_cores`). torch's default is every core: with another process busy on one of two cores, the two
  threads wait for each other at every operator (issue 20: the embedded default pipeline took 10 min 39 s
  instead of 36 s).
- `in_layout`: a tensor with another's strides (e.g. a weight computed each step in its parameter's layout),
  so that passes over the two run in one memory order and a convolution keeps the network's layout.
- `hold_freed_memory`: glibc's malloc keeps freed large blocks instead of giving them back to the OS, so a
  training step does not fault the same pages in again at every step (CPU).
- `fused_optimizer`: the optimizer's fused kernel (one pass over all parameters per step) where torch has one for
  the parameters' device.
- `compile_step`: optional torch.compile of the forward and of the KL, tried once on a copy of the model;
  if compiling fails (no compiler, an unsupported op, an old GPU), training runs eager and the log says why.
"""

import copy
import ctypes
import ctypes.util
import math
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from edgebayes.data import pixels_as_float


def augment(x, padding):
    """Random crop with zero padding and random horizontal flip of a batch (N, C, H, W), on x's device.

    Each image is padded by `padding` zeros on every side and an H x W window is cut at an offset drawn
    uniformly from 0..2 padding in each direction (torchvision's RandomCrop(size, padding)); then it is
    mirrored with probability 1/2 (RandomHorizontalFlip). One gather for the whole batch.
    """
    n, c, h, w = x.shape
    padded = F.pad(x, (padding,) * 4)
    dy = torch.randint(0, 2 * padding + 1, (n, 1), device=x.device)
    dx = torch.randint(0, 2 * padding + 1, (n, 1), device=x.device)
    rows = (dy + torch.arange(h, device=x.device))[:, None, :, None]          # (n, 1, h, 1)
    cols = (dx + torch.arange(w, device=x.device))[:, None, None, :]          # (n, 1, 1, w)
    flip = torch.rand(n, device=x.device) < 0.5
    cols = torch.where(flip[:, None, None, None], cols.flip(-1), cols)        # a mirrored window = a flip
    batch = torch.arange(n, device=x.device)[:, None, None, None]
    channel = torch.arange(c, device=x.device)[None, :, None, None]
    return padded[batch, channel, rows, cols]


def epoch_permutation(n, seed, epoch):
    """The order of an epoch: the same in every process and after a resume (it depends on seed and epoch only)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


class DeviceData:
    """The training split on the device; `batches(epoch)` yields this process's shard of each global batch.

    A global batch is `batch_size` consecutive indices of the epoch's permutation; process r of W takes
    every W-th of them (idx[r::W]), so the W shards together are exactly the single-process batch. Yields
    (x, y, global batch size). With several processes, a final batch with fewer than W images is dropped
    (a process with an empty shard cannot run batch norm); with one process nothing is dropped.
    """

    def __init__(self, x, y, device, batch_size, seed, rank=0, world_size=1, augment_padding=None,
                 channels_last=False):
        self.x, self.y = x.to(device), y.to(device)
        self.batch_size, self.seed, self.rank, self.world_size = batch_size, seed, rank, world_size
        self.augment_padding, self.channels_last = augment_padding, channels_last and x.dim() == 4

    def __len__(self):
        return len(self.x)

    def batches(self, epoch):
        perm = epoch_permutation(len(self.x), self.seed, epoch).to(self.x.device)
        for i in range(0, len(perm), self.batch_size):
            idx = perm[i: i + self.batch_size]
            if len(idx) < self.world_size:
                continue
            shard = idx[self.rank:: self.world_size]
            x = pixels_as_float(self.x[shard])   # uint8 pixels: scaled a batch at a time
            if self.augment_padding is not None:
                x = augment(x, self.augment_padding)
            if self.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            yield x, self.y[shard], len(idx)


def autocast(device, precision):
    """The forward pass's autocast context: bf16 on CUDA or CPU, or a no-op for fp32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def to_channels_last(model, enabled):
    return model.to(memory_format=torch.channels_last) if enabled else model


def memory_format_of(t):
    """torch.channels_last for a 4-D tensor laid out NHWC (and not also plainly contiguous), else
    torch.contiguous_format."""
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def in_layout(t, like):
    """`t` (the same shape as the dense tensor `like`) with exactly `like`'s strides: `t` itself when they match,
    else a copy. A memory format is not enough: a (20, 1, 5, 5) weight is both contiguous and channels_last,
    yet a convolution reads its strides to choose its output's layout (an SQS mean weight with NCHW strides
    made LeNet-5-Caffe's first convolution write NCHW in a channels_last network, and the max-pool backward
    after it copied its whole gradient at every step: issue 20)."""
    if t.stride() == like.stride():
        return t
    return torch.empty_strided(like.shape, like.stride(), dtype=t.dtype, device=t.device).copy_(t)


# mallopt parameters of glibc's malloc.h
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def hold_freed_memory():
    """Keep freed memory in this process's heap instead of returning it to the OS (glibc on Linux; elsewhere a
    no-op). Returns whether it applied.

    By default glibc serves a large allocation (from 128 KiB, the threshold growing to at most 32 MiB as such
    blocks are freed) with its own mmap, unmaps it at free, and trims the heap's free top. A CPU training step
    allocates and frees the same activations and gradients, tens of MiB each, at every step, so their pages
    were faulted in and zeroed by the kernel again every time. mallopt(M_MMAP_MAX, 0) serves every allocation
    from the heap and M_TRIM_THRESHOLD = 2 GiB (mallopt takes an int) keeps its free memory there for the
    next step. Measured (issue 20, one thread, LeNet-5-Caffe at batch 1024): a dnn step 280 -> 250 ms, a bnn
    step 633 -> 573 ms; with the mmap threshold at its 32 MiB maximum instead, about half of that, because the
    47 MB activations of the first convolution stay above it. The cost: the process keeps the memory of its
    largest step until it exits (for the pipeline's later stages too). Called when a trainer starts; calling
    it again changes nothing.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        return bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)) and bool(libc.mallopt(_M_MMAP_MAX, 0))
    except (OSError, AttributeError):
        return False


def fused_optimizer(params):
    """{"fused": True} for torch.optim's Adam, AdamW and SGD when every parameter is a floating-point tensor on a
    CPU or CUDA device (where torch has their fused kernels), else {} (torch's default, a loop over parameters).

    Why: by default torch steps CPU parameters one tensor at a time, several elementwise passes each; the fused
    kernel does the whole update of a tensor in one pass. The same update rule and hyperparameters: only the
    floating-point order of the arithmetic differs. Measured (one thread, LeNet-5-Caffe, 2.1 M variational
    parameters): 7.1 -> 1.5 ms per Adam step, about 5 % of a bnn step at batch 128 (issue 37).
    """
    params = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    supported = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return {"fused": True} if params and supported else {}


def compile_step(forward, model, example, log):
    """(torch.compile(forward), torch.compile(model.kl)), or both uncompiled when compiling fails; `log` says
    which and why.

    `forward` is what the training loop calls (the model, or its DDP wrapper), `model` the plain network.
    The KL is compiled too: it is hundreds of small elementwise ops over every variational parameter (a
    kernel launch each on a GPU, eager), which the compiler fuses. Compilation is lazy (errors surface at
    the first call), so it is tried once on a deep copy of `model` with a forward and backward pass of
    `example` (RNG forked: the run's noise is untouched); the copy's compiled code is thrown away and the
    real forward compiles again on its first step.
    """
    try:
        trial = copy.deepcopy(model)
        devices = [example.device] if example.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            (torch.compile(trial)(example).float().sum() + torch.compile(trial.kl)()).backward()
    except Exception as e:  # noqa: BLE001 (any compiler failure means: train eager)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        log(f"train.compile: torch.compile failed ({type(e).__name__}: {first}); training without it (eager)")
        return forward, model.kl
    log("train.compile: forward and KL compiled with torch.compile")
    return torch.compile(forward), torch.compile(model.kl)


def cpu_set():
    """The cores this process may run on (its CPU affinity set where the OS has one)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def _cores():
    return len(cpu_set())


PROC_STAT = "/proc/stat"


def proc_stat_ticks(text, cpus):
    """(busy, all) clock ticks of the cores `cpus`, summed, from the text of /proc/stat (Linux).

    A core's line is `cpuN user nice system idle iowait irq softirq steal guest guest_nice`; idle and iowait
    are the time it was free, the rest busy (steal too: a hypervisor gave the core to someone else; guest is
    already inside user)."""
    busy = total = 0
    for line in text.splitlines():
        name, *fields = line.split() or [""]
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            ticks = [int(f) for f in fields[:8]]
            total += sum(ticks)
            busy += sum(ticks) - ticks[3] - ticks[4]
    return busy, total


def cores_busy_elsewhere(before, after, cores, own_cpu_seconds, wall_seconds):
    """Cores kept busy by other processes between two proc_stat_ticks readings of `cores` cores: the busy
    share of their ticks times `cores`, minus what this process itself used in the window (its CPU time over
    the window's wall time: torch's threads may still be spinning after the last stage)."""
    busy, total = after[0] - before[0], after[1] - before[1]
    if total <= 0:
        return 0.0
    return max(0.0, cores * busy / total - own_cpu_seconds / wall_seconds)


def busy_elsewhere(sample_seconds=0.5):
    """Cores of this process's CPU set that other processes keep busy now: /proc/stat sampled over
    `sample_seconds`, so that a process started a few seconds ago counts (the 1-minute load average grows by
    only about 8 % of a core in its first 5 s). Without /proc/stat (macOS), the 1-minute load average, which
    counts this process too when it is busy; without either (Windows), 0."""
    cpus = cpu_set()
    try:
        before, own, start = proc_stat_ticks(Path(PROC_STAT).read_text(), cpus), time.process_time(), time.perf_counter()
        time.sleep(sample_seconds)
        after = proc_stat_ticks(Path(PROC_STAT).read_text(), cpus)
        return cores_busy_elsewhere(before, after, len(cpus), time.process_time() - own, time.perf_counter() - start)
    except OSError:
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def free_cores(busy=None):
    """Cores this process may run on that no other process keeps busy: the CPU affinity set minus `busy`
    (default: busy_elsewhere(), a half-second sample), rounded, between 1 and the size of the set."""
    cores = _cores()
    busy = busy_elsewhere() if busy is None else busy
    return max(1, min(cores, math.floor(cores - busy + 0.5)))


def set_threads(requested=0):
    """torch.set_num_threads for a stage (train, select, export): `requested` (train.threads) when > 0,
    else free_cores(), unless OMP_NUM_THREADS in the environment chose already (then torch's default, which
    follows it). Never more threads than cores. Returns the number set."""
    cores = _cores()
    if requested > 0:
        threads = min(requested, cores)
    elif os.environ.get("OMP_NUM_THREADS"):
        threads = min(torch.get_num_threads(), cores)
    else:
        threads = free_cores()
    torch.set_num_threads(threads)
    return threads
