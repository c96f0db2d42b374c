"""This process's memory (RSS now and at its peak) and the facts of the machine it runs on."""

import datetime
import os
import platform
import socket
import sys

import numpy as np


def _proc_status_mb(key):
    """A VmRSS / VmHWM line of /proc/self/status in MB, or None where there is none (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return float(line.split()[1]) / 1024.0  # kB -> MB
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
    divisor = 1024.0 * 1024.0 if sys.platform == "darwin" else 1024.0
    return float(peak / divisor)


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
        "processor": platform.processor(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "numpy": np.__version__,
        "board": board,
    }



def utc_now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
