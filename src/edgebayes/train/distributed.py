"""Training in several processes (DDP): NCCL between GPUs, gloo between CPU processes.

`train.processes: N` (N > 1) makes `edgebayes train` (and the train stage of `edgebayes pipeline`) run
itself again under torchrun, N processes on this machine (`launch`); running `torchrun --nproc_per_node N
-m edgebayes.cli train --config ...` by hand does the same (then WORLD_SIZE decides, not the config).

The ELBO across processes. The single-process loss of a step is

    L = (1/B) sum_{i in batch} NLL_i + KL / N        (B: the global batch, N: the training set size)

Process r of W sees its shard S_r of the batch (train/accel.py: DeviceData) and minimises

    L_r = (W/B) sum_{i in S_r} NLL_i + KL / N

DDP all-reduces the gradients and divides by W, so the update follows

    (1/W) sum_r grad L_r = (1/B) sum_i grad NLL_i + grad KL / N = grad L.

The KL is therefore added whole by every process and divided by W once, by DDP's averaging: it is not
counted W times, and it is scaled by the data set size N, not by the shard's. Summing the shard's NLL and
dividing by B / W (rather than taking the shard's mean) keeps this exact when the shards of the last batch
differ in size. With equal shards L_r is the mean NLL of the shard + KL / N.

What matches a single-process run: for a deterministic forward (family dnn without batch norm) the
updates are the single-process updates up to float summation order (tests/test_distributed.py). For the
Bayesian families each process draws its own training noise (seed + rank), so process r's shard sees
other weight noise and node indicators than the single process's would: the gradient is another unbiased
estimate of the same ELBO gradient (it averages W draws of z per step, one per process), not the same
numbers. With the noise made identical (zero) the runs match again, which the test checks, KL included.
Batch-norm statistics are per process (plain DDP, as torchvision's reference scripts without SyncBN).

Only process 0 validates, writes checkpoints and keeps the history; the checkpoint holds every process's
RNG state, so a run resumed with the same number of processes continues exactly.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":   # torchrun, as `launch` runs it: a Ctrl-C while torch imports (before torchrun sets its
    signal.signal(signal.SIGINT, signal.SIG_DFL)   # own handlers) ended it in a 15-line traceback (probe)

import torch
import torch.distributed as dist

import edgebayes
from edgebayes.errors import StageError


@dataclass
class World:
    rank: int = 0
    size: int = 1
    owns_group: bool = False            # this process group was opened by `setup` (and is closed by `close`)

    @property
    def main(self):
        return self.rank == 0

    def barrier(self):
        if self.size > 1:
            with _peer_stops():
                dist.barrier()

    def all_reduce_sum(self, tensor):
        if self.size > 1:
            with _peer_stops():
                dist.all_reduce(tensor)
        return tensor

    def all_gather_object(self, obj):
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        with _peer_stops():
            dist.all_gather_object(out, obj)
        return out

    def close(self):
        if self.owns_group:
            # Every process reaches the end before any closes its connections: process 0 still validates and
            # writes while the others are done, and a gloo process that tears its group down while a peer
            # works on it can abort at exit (SIGABRT, 'terminate called without an active exception').
            dist.barrier()
            dist.destroy_process_group()
            self.owns_group = False


@contextmanager
def _peer_stops():
    """A collective that fails because another process stopped (gloo: 'Connection closed by peer') is that
    process's failure, which it says itself: here a StageError of one line, where it was a traceback of gloo's
    RuntimeError after the other's message (probe)."""
    try:
        yield
    except RuntimeError as e:
        raise StageError(f"train: another training process stopped ({str(e).splitlines()[0][:160]}); its message "
                         f"says why") from None


def launched() -> bool:
    """Whether torchrun started this process: WORLD_SIZE with torchrun's own TORCHELASTIC_RUN_ID. WORLD_SIZE,
    RANK or MASTER_* left in a user's shell (from another job) are not a launch: taken as one, a pipeline
    waited forever in init_process_group for processes that never came, or skipped train.processes (probe)."""
    return "WORLD_SIZE" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ


def stray_launch_variables():
    """The launch variables set in this process's environment that torchrun did not set (launched)."""
    return [] if launched() else [k for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK") if k in os.environ]


def is_main_process() -> bool:
    return not launched() or int(os.environ.get("RANK", "0")) == 0


def setup(device: torch.device):
    """(World, device) of this process; opens the process group when torchrun started several processes."""
    size = int(os.environ["WORLD_SIZE"]) if launched() else 1
    if size == 1:
        return World(), device
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":  # one GPU per process
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return World(rank, size, owns), device


def launch(cli_args, processes, stdout=None):
    """Run `python -m edgebayes.cli <cli_args>` in `processes` processes under torchrun; returns the exit code.
    `stdout`: where their output goes (None: this process's stdout; `pipeline --json` keeps it for the summary).

    The training processes end with this one: torchrun starts its workers in sessions of their own, so a
    signal this process gets alone (kill, a scheduler's SIGTERM) never reached them, and subprocess.call
    then SIGKILLed torchrun, whose workers trained on with no lock on the run folder (probe). torchrun runs
    in its own session too, gets Ctrl-C / SIGTERM from here once (a second signal during its shutdown would
    cut its own clean-up short) and is waited for; it stops its workers. Where this process is killed
    outright, Linux's parent-death signal sends torchrun SIGTERM."""
    logs = tempfile.mkdtemp(prefix="edgebayes-torchrun-")   # torchrun's own folder (error files): removed after
    cmd = [sys.executable, "-m", __name__, "--standalone", f"--nproc_per_node={processes}",   # torchrun (below)
           f"--log-dir={logs}", "-m", "edgebayes.cli", *cli_args]
    # Every process imports this very edgebayes, whatever sys.path the launching process was given. torchrun's
    # warnings (the OMP_NUM_THREADS note, each signal it passes on) are not the user's; its errors stay.
    source = str(Path(edgebayes.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")])),
           "LOGLEVEL": os.environ.get("LOGLEVEL", "ERROR"), RELAUNCHED: "1"}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=stdout,
                            preexec_fn=_terminated_with_parent() if sys.platform.startswith("linux") else None)
    try:
        return proc.wait()
    except BaseException as e:   # KeyboardInterrupt, Terminated (cli), or anything else: the workers stop too
        proc.send_signal(signal.SIGINT if isinstance(e, KeyboardInterrupt) else signal.SIGTERM)
        _wait_for_stop(proc)
        raise
    finally:   # each run left an empty /tmp/torchelastic_* folder (probe)
        shutil.rmtree(logs, ignore_errors=True)


STOP_SECONDS = 90   # torchrun gives its workers 30 s after the signal, then kills them
RELAUNCHED = "EDGEBAYES_RELAUNCHED"   # set for the processes `launch` starts: the launching process speaks for them


def _wait_for_stop(proc):
    """Wait for torchrun to stop its workers. A second Ctrl-C or SIGTERM meanwhile (an impatient user) is not
    passed on: killing torchrun then left its workers training (review). Past STOP_SECONDS it is killed, said."""
    deadline = time.monotonic() + STOP_SECONDS
    while True:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            return
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            print(f"edgebayes: torchrun did not stop its training processes within {STOP_SECONDS} s and was killed; "
                  f"look for leftover `edgebayes.cli train` processes", file=sys.stderr)
            return
        except BaseException:   # a further signal: torchrun has the first and is stopping
            continue


def _terminated_with_parent():
    """The preexec_fn that gives the child SIGTERM when this process dies (prctl PR_SET_PDEATHSIG, Linux).
    prctl is looked up here, in the parent: a dlopen in the child of a threaded process can deadlock. A parent
    that died before the flag was set is noticed by the child's parent id."""
    import ctypes

    prctl, parent = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()

    def in_child():
        prctl(1, signal.SIGTERM)   # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(128 + signal.SIGTERM)
    return in_child


def rng_states(world, device):
    """Every process's RNG state, indexed by rank (a collective: every process calls it)."""
    mine = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":  # the training noise is drawn on the GPU
        mine["cuda"] = torch.cuda.get_rng_state(device)
    return world.all_gather_object(mine)


def restore_rng(states, world, device, seed):
    """Set this process's RNG from a checkpoint's `rng_states`; False (and reseeded) if the count differs."""
    if len(states) != world.size:
        torch.manual_seed(seed + world.rank)
        return False
    mine = states[world.rank]
    torch.set_rng_state(mine["cpu"])
    if device.type == "cuda" and "cuda" in mine:
        torch.cuda.set_rng_state(mine["cuda"], device)
    return True


if __name__ == "__main__":   # torchrun, as `launch` runs it: the signal that stops it ends it without a traceback
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    # A training process that fails says why itself: torchrun's line about it, its traceback and its report of
    # the failure were 25 lines after the one that mattered (probe)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    # `launch` removes its log folder when torchrun ends, but not when it was killed outright (SIGKILL, the OOM
    # killer): torchrun, stopped by the parent-death signal, removes it then; one folder a kill was left (review)
    options = sys.argv[1:sys.argv.index("-m")] if "-m" in sys.argv else []
    logs = next((a.split("=", 1)[1] for a in options if a.startswith("--log-dir=")), None)
    try:
        main()
    except SignalException as e:
        sys.exit(128 + int(e.sigval))
    except ChildFailedError as e:   # the first failed process's own exit code (2: bad input), not torchrun's 1
        code = e.get_first_failure()[1].exitcode
        sys.exit(code if code > 0 else 128 - code)   # killed by a signal: 128 + its number, as a shell says it
    finally:
        if logs:
            shutil.rmtree(logs, ignore_errors=True)
