"""Transports: how a bundle (the runner, runner.pyz, inside it) reaches a device, runs there, and how
results come back.

A transport has four verbs: `probe` (python, runtime, free disk and memory on the device: the preflight),
`put` (copy a local file or folder to the device), `run` (run the device's python with an argument list)
and `get` (copy a device file back).

- `LocalTransport` is this machine, with a work folder standing in for the device's disk.
- `SSHTransport` goes through the system OpenSSH client, so the user's ~/.ssh/config, keys, agent, ports and
  jump hosts work as they do in a terminal. Every command is an argument list (no local shell); the one
  string the remote shell sees is built with shlex.quote. Folders travel as a tar stream over ssh (tar is
  on every board we target), unpacked beside the target and renamed into place.

Every failure becomes one `TransportError` that says what went wrong and what to do; local artifacts are
never touched, so the stage can simply be re-run.
"""

import copy
import hashlib
import io
import json
import os
import posixpath
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import uuid
from contextlib import contextmanager
from pathlib import Path

from edgebayes.config import expand_repo, ssh_destination, ssh_options
from edgebayes.errors import StageError
from edgebayes.ondevice.tables import RUNTIME_MODULES

# Run on the device with its own python (any 3.x): what `devices check` shows and deploy's preflight
# needs. Prints one JSON line. argv: runtime modules (comma-separated), work folder.
PROBE = r"""
import importlib, json, os, platform, shutil, sys
mods, workdir = sys.argv[1].split(","), os.path.expanduser(sys.argv[2])
runtime = {"module": None, "version": None, "error": None}
for name in mods:
    try:
        m = importlib.import_module(name)
        top = importlib.import_module(name.split(".")[0])
        runtime = {"module": name, "version": getattr(m, "__version__", getattr(top, "__version__", "?")), "error": None}
        break
    except Exception as e:
        runtime["error"] = "%s: %s" % (type(e).__name__, e)
try:
    import numpy
    np_version = numpy.__version__
except Exception:
    np_version = None
probe = os.path.abspath(workdir)
while not os.path.exists(probe):
    probe = os.path.dirname(probe)
du = shutil.disk_usage(probe)
mem = {}
try:
    for line in open("/proc/meminfo"):
        k, v = line.split(":")
        if k in ("MemTotal", "MemAvailable"):
            mem[k] = int(v.split()[0]) * 1024 / 1e6   # KiB -> MB (10^6 bytes)
except OSError:
    pass
board = None
try:
    board = open("/proc/device-tree/model", "rb").read().rstrip(b"\0\n").decode("utf-8", "replace")
except OSError:
    pass
print(json.dumps({"python": platform.python_version(), "executable": sys.executable, "numpy": np_version,
                  "runtime": runtime, "disk_path": probe, "disk_free_mb": du.free / 1e6,
                  "disk_total_mb": du.total / 1e6, "mem_total_mb": mem.get("MemTotal"),
                  "mem_available_mb": mem.get("MemAvailable"), "cpu_count": os.cpu_count(),
                  "machine": platform.machine(), "platform": platform.platform(), "board": board}))
"""

_UNREACHABLE = ("Could not resolve hostname", "Connection refused", "Connection timed out", "No route to host",
                "Network is unreachable", "Connection closed by", "Connection reset", "connect to host",
                "kex_exchange_identification", "Operation timed out", "proxy dialog")
_AUTH = ("Permission denied", "Too many authentication failures", "Host key verification failed",
         "no matching host key type")
_DISK_FULL = ("No space left on device", "Disk quota exceeded")


def _this_machine():
    """This machine as an own folder names it (Transport.own_folder): its host name (letters, digits, dots) and a
    hash of its machine id and network address, since boards are often shared by machines of one image whose host
    names agree ("raspberrypi", "vm"): a folder of another machine's live run must never look like this one's."""
    ident = str(uuid.getnode())
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            ident += Path(path).read_text().strip()
            break
        except OSError:
            pass
    name = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"
    return f"{name}.{hashlib.sha256(ident.encode()).hexdigest()[:8]}"


_HOST = _this_machine()

# Run on the device: the names in a folder, one a line (none when it does not exist). argv: the folder.
LIST_RUNS = "import os, sys; d = os.path.expanduser(sys.argv[1]); print(chr(10).join(os.listdir(d)) if os.path.isdir(d) else '')"


def _alive(pid):
    """Whether a process of this pid runs on this machine (one of another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


class TransportError(StageError):
    pass


class DeviceUnavailable(TransportError):
    """The device cannot run anything for us: unreachable, authentication refused, python or runtime
    missing. Only then may selection predict latency instead of measuring it; a runner that crashed or a
    full disk is a real failure, reported as it is (issue 19)."""


_PROGRESS = re.compile(r"\d+%\|")   # a progress bar's line (tqdm or the runner's own), never the message


def describe_exit(code) -> str:
    """`exit code 1`; a process killed by a signal named: `killed by SIGKILL` (a negative code from
    subprocess) or `exit code 137: killed by SIGKILL` (128 + n from the device's shell over ssh)."""
    try:
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        if 128 < code < 128 + 65:
            return f"exit code {code}: killed by {signal.Signals(code - 128).name}"
    except ValueError:
        pass
    return f"exit code {code}"


def runner_failure(device, code, err, what=""):
    """One message for a failed runner: how it ended, and its last line unless a signal ended it (the last
    line is then whatever it printed before, e.g. its accuracy, not the reason)."""
    how = describe_exit(code)
    if "killed by" in how:
        hint = " (SIGKILL: the device may have run out of memory)" if "SIGKILL" in how else ""
        return f"the runner failed on device {device} ({how}){hint}{what}"
    lines = [ln for ln in err if not _PROGRESS.search(ln)]
    return f"the runner failed on device {device} ({how}): {lines[-1] if lines else 'no message'}{what}"


def _lines(data: bytes) -> list:
    return [ln.strip() for ln in data.decode(errors="replace").replace("\r", "\n").splitlines() if ln.strip()]


def _stream(argv, cwd=None, stdin=None, echo=True):
    """Run argv; show its stderr live (progress bars) and keep the tail. Returns (exit code, stderr lines)."""
    proc = subprocess.Popen(argv, cwd=cwd, stdin=stdin if stdin is not None else subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    tail = b""
    try:
        for chunk in iter(lambda: proc.stderr.read1(4096), b""):
            if echo:
                sys.stderr.write(chunk.decode(errors="replace"))
                sys.stderr.flush()
            tail = (tail + chunk)[-8192:]
        return proc.wait(), _lines(tail)
    except BaseException:   # Ctrl-C, SIGTERM (Terminated): stop the runner (or ssh) too, not leave it orphaned
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        raise


class Transport:
    """What both transports share: the preflight built on `run_python`."""

    name = "device"
    workdir = "."

    def where(self) -> str:
        raise NotImplementedError

    def probe(self, runtime):
        """Facts about the device (see PROBE). Raises TransportError if the device or its python is absent."""
        code, out, err = self.run_python(["-c", PROBE, ",".join(RUNTIME_MODULES[runtime]), str(self.workdir)])
        if code != 0 or not out:
            raise DeviceUnavailable(self._python_failure(code, err))
        return json.loads(out[-1])

    def preflight(self, runtime, need_bytes, min_free_mb):
        """Check python, the runtime and free disk before anything is copied; returns the probe."""
        facts = self.probe(runtime)
        rt = facts["runtime"]
        if rt["module"] is None:
            raise DeviceUnavailable(f"device {self.name}: runtime {runtime} is not installed for {facts['executable']} "
                                 f"({rt['error']}); install it on the device (e.g. pip install {runtime})")
        if facts["numpy"] is None:
            raise DeviceUnavailable(f"device {self.name}: numpy is not installed for {facts['executable']}; "
                                 "the runner needs it (pip install numpy)")
        need_mb = need_bytes / 1e6 + min_free_mb
        if facts["disk_free_mb"] < need_mb:
            raise TransportError(f"device {self.name}: disk full: {facts['disk_free_mb']:.2f} MB free in "
                                 f"{facts['disk_path']}, the deployment needs {need_mb:.2f} MB "
                                 f"({need_bytes / 1e6:.2f} MB of files + connection.min_free_mb {min_free_mb}); "
                                 "free space there or set connection.workdir to a roomier disk")
        return facts

    @contextmanager
    def own_folder(self, tag):
        """This transport in a folder of the work folder for one run's files alone,
        `runs/<tag>-<host>-<pid>-<random>` (tag: the run and its bundle; host and pid: this edgebayes process's),
        removed when done: runs sharing a device (two configs, two machines) never read each other's bundle,
        results or timing files. A process killed outright (SIGKILL, power) cannot remove its folder: the next one
        from this machine removes those of this machine whose process is gone (`_sweep_leftovers`), so bundle copies
        do not pile up on the board until its disk check refuses it (after the run's own work: the device is
        reachable then, and an unreachable one costs no second connect timeout)."""
        own = copy.copy(self)
        own.workdir = self._join(f"runs/{tag}-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            yield own
        except DeviceUnavailable:
            raise      # nothing to remove where nothing can be reached (and no second connect timeout)
        except BaseException:
            own._remove_quietly()
            raise
        own._remove_quietly()
        self._sweep_leftovers()

    def _sweep_leftovers(self):
        """Remove the own folders this machine's killed processes left in runs/ (their pid no longer runs here;
        a pid reused since keeps its folder until it too is gone). Nothing else is touched: other machines'
        folders, and live runs of this one."""
        mine = re.compile(rf"-{re.escape(_HOST)}-(\d+)-[0-9a-f]{{8}}$")
        try:
            names = self.list_runs()
        except (TransportError, OSError):
            return   # the device went away, or runs/ is not readable: the folders stay, named as leftovers
        stale = [n for n in names if "/" not in n and not n.startswith(".")   # a name in runs/, nothing above
                 and (hit := mine.search(n)) and not _alive(int(hit.group(1)))]
        for name in stale:
            leftover = copy.copy(self)
            leftover.workdir = self._join(f"runs/{name}")
            leftover._remove_quietly()

    def _remove_quietly(self):
        try:
            self.remove_workdir()
        except TransportError:
            pass   # the device went away meanwhile: the folder stays, named as a run's leftover

    def _python_failure(self, code, err):
        last = err[-1] if err else f"exit code {code}"
        return (f"device {self.name}: python {self.python!r} did not run on {self.where()} ({last}); "
                f"set connection.python in the device profile to the interpreter's path on the device")

    def disk_full(self, err):
        """A disk-full message if these stderr lines say so, else None."""
        hit = next((ln for ln in err if any(k in ln for k in _DISK_FULL)), None)
        return None if hit is None else (f"device {self.name}: disk full in {self.workdir} on {self.where()} "
                                         f"({hit}); free space there or set connection.workdir")


class LocalTransport(Transport):
    def __init__(self, name, workdir, python=None):
        self.name, self.workdir = name, Path(workdir)
        self.python = expand_repo(python) or sys.executable

    def where(self):
        return "this machine"

    def _join(self, sub):
        return self.workdir / sub

    def remove_workdir(self):
        shutil.rmtree(self.workdir, ignore_errors=True)

    def list_runs(self):
        """The names in the work folder's runs/ ([] when there is none)."""
        runs = self.workdir / "runs"
        return [p.name for p in runs.iterdir()] if runs.is_dir() else []

    def run_python(self, args, echo=False):
        try:
            proc = subprocess.run([self.python, *map(str, args)], capture_output=True,
                                  cwd=self.workdir if self.workdir.is_dir() else None)
        except OSError as e:
            return 127, [], [str(e)]
        return proc.returncode, _lines(proc.stdout), _lines(proc.stderr)

    def put(self, local, remote_name):
        dest = self.workdir / remote_name
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
            if dest.is_dir():
                shutil.rmtree(dest)
            if Path(local).is_dir():
                shutil.copytree(local, dest)
            else:
                shutil.copyfile(local, dest)
        except OSError as e:
            raise TransportError(self.disk_full([str(e)]) or f"device {self.name}: cannot copy {local} to {dest}: {e}")
        return dest

    def run(self, args):
        """Run [python, *args] in the work folder. Returns (exit code, stderr lines)."""
        try:
            return _stream([self.python, *map(str, args)], cwd=self.workdir)
        except OSError as e:
            raise DeviceUnavailable(self._python_failure(127, [str(e)])) from None

    def get(self, remote_name, local):
        src = self.workdir / remote_name
        if not src.is_file():
            raise TransportError(f"the device did not produce {remote_name} in {self.workdir}")
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, local)


class SSHTransport(Transport):
    """A device reached with the system `ssh` client; see the module docstring."""

    def __init__(self, name, connection):
        c = connection
        self.name, self.host = name, c.host
        for key in ("host", "user"):  # config.py refuses these too; ssh would read them as options
            if (getattr(c, key) or "").startswith("-"):
                raise TransportError(f"device {name}: connection.{key} {getattr(c, key)!r} must not start with '-'")
        self.python = expand_repo(c.python) or "python3"
        # Relative paths are under the remote home (ssh starts there); `~` is not expanded (it is quoted).
        self.workdir = expand_repo(c.workdir) or f"edgebayes/{name}"
        self.destination = ssh_destination(c)
        self.port = c.port
        # `--`: nothing after it is an option, whatever the destination looks like.
        self.ssh = ["ssh", *ssh_options(c), "--", self.destination]

    def where(self):
        return self.destination + (f":{self.port}" if self.port else "")

    def _join(self, sub):
        return posixpath.join(self.workdir, sub)

    def remove_workdir(self):
        self._ssh(self._remote(["rm", "-rf", self.workdir]))

    def list_runs(self):
        """The names in the work folder's runs/ on the device ([] when there is none)."""
        code, out, err = self.run_python(["-c", LIST_RUNS, self._join("runs")])
        if code != 0:
            raise TransportError(f"device {self.name}: cannot list {self._join('runs')} ({err[-1] if err else code})")
        return [line for line in out if line]

    def _remote(self, *commands):
        """One remote shell line from argument lists, every word quoted; the lines joined with &&."""
        return " && ".join(shlex.join(map(str, cmd)) for cmd in commands)

    def _ssh(self, remote_line, stdin=None, capture=True, echo=False):
        argv = [*self.ssh, remote_line]
        try:
            if capture:
                proc = subprocess.run(argv, input=stdin, capture_output=True)
                code, out, err = proc.returncode, proc.stdout, _lines(proc.stderr)
            else:
                code, err = _stream(argv, echo=echo)
                out = b""
        except FileNotFoundError:
            raise DeviceUnavailable("the OpenSSH client `ssh` is not installed on this machine "
                                    "(apt-get install openssh-client)") from None
        self._raise_if_ssh_failed(code, err)
        return code, out, err

    def _raise_if_ssh_failed(self, code, err):
        """ssh itself exits 255; tell the connection problems apart from the remote command's."""
        if code != 255:
            return
        text = " ".join(err)
        last = next((ln for ln in reversed(err) if any(k in ln for k in _AUTH + _UNREACHABLE)), err[-1] if err else "")
        if any(k in text for k in _AUTH):
            raise DeviceUnavailable(f"device {self.name}: authentication refused by {self.destination} ({last}); "
                                 "check connection.user and connection.identity_file, your ssh-agent and "
                                 "~/.ssh/config (ssh runs with BatchMode=yes: no password prompts)")
        # ssh always says why it could not connect; a silent 255 is the remote command's own exit (or a
        # signal that killed it), which the caller reports as the runner's failure.
        if any(k in text for k in _UNREACHABLE):
            raise DeviceUnavailable(f"device {self.name}: host unreachable: {self.destination} ({last or 'no answer'}); "
                                 "is the device on, on the network, and is sshd running on the port the "
                                 "profile names?")

    def run_python(self, args, echo=False):
        line = self._remote([self.python, *args])
        code, out, err = self._ssh(line)
        return code, _lines(out), err

    def put(self, local, remote_name):
        """Stream `local` as a tar archive; unpack it under a temporary name, then rename it into place."""
        local, part = Path(local), f".{remote_name}.part"
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(local, arcname=remote_name)
        line = self._remote(["mkdir", "-p", self.workdir], ["cd", self.workdir], ["rm", "-rf", part], ["mkdir", part],
                            ["tar", "-C", part, "-xf", "-"], ["rm", "-rf", remote_name],
                            ["mv", f"{part}/{remote_name}", remote_name], ["rmdir", part])
        code, _, err = self._ssh(line, stdin=buf.getvalue())
        if code != 0:
            raise TransportError(self.disk_full(err) or f"device {self.name}: copying {local} to "
                                 f"{self.where()}:{self.workdir}/{remote_name} failed ({err[-1] if err else code})")

    def run(self, args):
        """Run the device's python with args in the work folder; its stderr is shown live."""
        line = self._remote(["cd", self.workdir], [self.python, *args])
        code, _, err = self._ssh(line, capture=False, echo=True)
        return code, err

    def get(self, remote_name, local):
        code, out, err = self._ssh(self._remote(["cat", f"{self.workdir}/{remote_name}"]))
        if code != 0:
            raise TransportError(f"the device did not produce {remote_name} in {self.workdir} on "
                                 f"{self.where()} ({err[-1] if err else code})")
        from edgebayes.provenance import atomic_path

        with atomic_path(local) as tmp:
            tmp.write_bytes(out)


def transport_for(profile, default_workdir):
    """The transport a device profile names; `default_workdir` is the local stand-in for `local` devices."""
    c = profile.connection
    if c.kind == "local":
        return LocalTransport(profile.name, expand_repo(c.workdir) or default_workdir, c.python)
    if c.local_sshd:   # this machine through a throwaway sshd, started for this command (localsshd.ensure)
        from edgebayes.deploy import localsshd

        try:
            localsshd.ensure(c)
        except (localsshd.SSHDUnavailable, OSError, subprocess.CalledProcessError) as e:
            raise DeviceUnavailable(f"device {profile.name}: its local sshd did not start: {e}") from None
    return SSHTransport(profile.name, c)
