"""This process's memory (RSS now and at its peak) and the facts of the machine it runs on."""

import datetime
import os
import platform
import socket
import sys

import numpy as np


KIB_PER_MB = 1e6 / 1024   # /proc's "kB" and Linux's ru_maxrss are KiB; MB here is 10^6 bytes, as everywhere in
#                            the report and the device budgets (KiB / 1024 gave MiB under the name MB: 4.9% low)


def _proc_status_mb(key):
    """A VmRSS / VmHWM line of /proc/self/status in MB (10^6 bytes), or None where there is none (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return float(line.split()[1]) / KIB_PER_MB
    except OSError:
        pass
    return None


def current_rss_mb():
    """Resident set size of this process now, in MB (None where unsupported)."""
    return _proc_status_mb("VmRSS")


def reset_peak_rss():
    """Reset this process's peak RSS to its current RSS (Linux >= 4.0: "5" to /proc/self/clear_refs), so
    that a later peak_rss_mb() is the peak of what came after. Returns whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb():
    """Peak resident set size of this process in MB (None where unsupported).

    On Linux VmHWM from /proc/self/status: it belongs to this address space only. ru_maxrss is kept by
    a forked child across exec, so a runner started by a big parent (edgebayes with torch loaded)
    would report the parent's peak.
    """
    peak = _proc_status_mb("VmHWM")
    if peak is not None:
        return peak
    try:
        import resource  # Unix only
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS reports bytes.
    divisor = 1e6 if sys.platform == "darwin" else KIB_PER_MB
    return float(peak / divisor)


def _cpu_model():
    """The CPU's name from Linux's /proc/cpuinfo ("model name": x86, some ARM kernels), where platform.processor()
    is empty, as it is on Linux: a benchmark's machine read as blank (probe). None where it does not say."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def device_info():
    """Where the numbers came from; the board model helps on Jetson/Pi."""
    board = None
    try:
        with open("/proc/device-tree/model", "rb") as fh:
            board = fh.read().rstrip(b"\x00\n").decode("utf-8", "replace")
    except OSError:
        pass
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or _cpu_model(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "numpy": np.__version__,
        "board": board,
    }



def utc_now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


TIMING_LOCK = "edgebayes-timing.lock"   # in the device's temporary folder: one per machine, every user's


class DeviceBusy(Exception):
    """Another edgebayes runner kept this machine's timing lock past the wait."""


class timing_lock:
    """Held while a runner times models: two runs timing on one device at once would each measure the
    other's load (and a latency table fitted to that is wrong for both). A second runner waits for the
    first, up to `wait_s` seconds, then raises DeviceBusy. An flock on a file in the temporary folder:
    released by the kernel when the process dies, shared by every user and every work folder of the
    machine (opened read-only where another user created it). Without fcntl (Windows) no lock is taken."""

    def __init__(self, wait_s, say=lambda message: None):
        self.wait_s, self.say, self.fd = wait_s, say, None

    def __enter__(self):
        try:
            import fcntl
            import tempfile
        except ImportError:
            return self
        import time

        path = os.path.join(tempfile.gettempdir(), TIMING_LOCK)
        flags = os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
        try:
            try:
                self.fd = os.open(path, os.O_RDWR | flags, 0o644)
            except PermissionError:
                self.fd = os.open(path, os.O_RDONLY | flags)
        except OSError as e:   # e.g. a link planted in its place: time without it, saying so
            self.say(f"no timing lock ({path}: {e.strerror}); timing without one")
            return self
        deadline, told = time.monotonic() + self.wait_s, False
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = self._holder()
                if time.monotonic() >= deadline:
                    os.close(self.fd)
                    self.fd = None
                    raise DeviceBusy(f"another edgebayes run ({holder}) has been timing models on this device for "
                                     f"more than {self.wait_s:g} s; run again when it is done") from None
                if not told:
                    self.say(f"waiting for another edgebayes run ({holder}) timing models on this device")
                    told = True
                time.sleep(0.2)
        try:   # who holds it, for the message of the next one
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        except OSError:
            pass
        return self

    def _holder(self):
        try:
            return os.pread(self.fd, 200, 0).decode(errors="replace").strip() or "pid unknown"
        except OSError:
            return "pid unknown"

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)   # releases the flock
            self.fd = None
