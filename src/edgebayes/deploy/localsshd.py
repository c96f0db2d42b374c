"""A throwaway OpenSSH server on 127.0.0.1: the `ssh-localhost` device, for tests and `make pipeline
DEVICE=ssh-localhost`.

It runs the system `sshd` with a config file of its own in one folder: a fresh host key, a fresh client
key whose public half is the only authorized key, a known_hosts file pinning the host key, listening on
127.0.0.1 only, on an unprivileged port. Nothing of the machine's own ssh setup is read or changed.

    python -m edgebayes.deploy.localsshd start [--dir runs/ssh-localhost] [--port 2222]
    python -m edgebayes.deploy.localsshd stop  [--dir runs/ssh-localhost]

A profile with `connection.local_sshd: true` needs no start: the first command that connects to it starts
the sshd (`ensure`) and stops it when it ends (`stop_started`), unless it was running already; a server
left running would outlive the pipeline that needed it. runs/ is the working directory's (config.expand_repo).
"""

import argparse
import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from edgebayes.config import expand_repo

DEFAULT_PORT = 2222
_started = []   # folders of the sshds this process started (ensure), stopped by stop_started


def default_dir():
    """runs/ssh-localhost of the working directory: the ssh-localhost profile's `{repo}/runs/ssh-localhost`."""
    return Path.cwd() / "runs" / "ssh-localhost"


class SSHDUnavailable(RuntimeError):
    pass


@dataclass
class LocalSSHD:
    dir: Path
    port: int
    pid: int

    @property
    def client_key(self):
        return self.dir / "client_key"

    @property
    def known_hosts(self):
        return self.dir / "known_hosts"

    def stop(self):
        stop(self.dir)


def find_sshd():
    """The sshd binary (it lives in sbin, often not on a user's PATH), or None."""
    return shutil.which("sshd") or next((p for p in ("/usr/sbin/sshd", "/usr/local/sbin/sshd") if os.path.exists(p)), None)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid):
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _keygen(path):
    if not path.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "edgebayes-localsshd", "-f", str(path)],
                       check=True, capture_output=True)


def _pid(pidfile):
    """The pid in sshd's PidFile, or None while there is none: sshd creates the file before it writes the
    number, so a read in between finds it empty."""
    try:
        return int(pidfile.read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return None


def start(directory=None, port=None, timeout_s=10.0) -> LocalSSHD:
    """Start (or reuse, if it already runs from `directory`) sshd on 127.0.0.1:port."""
    directory = Path(directory or default_dir()).resolve()
    sshd = find_sshd()
    if sshd is None:
        raise SSHDUnavailable("sshd is not installed (apt-get install openssh-server)")
    directory.mkdir(parents=True, exist_ok=True)
    pidfile, portfile = directory / "sshd.pid", directory / "port"
    if _pid(pidfile) is not None and portfile.is_file():
        pid, old_port = _pid(pidfile), int(portfile.read_text())
        if _alive(pid) and port in (None, old_port):
            return LocalSSHD(directory, old_port, pid)
    port = port or free_port()
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        raise SSHDUnavailable(f"127.0.0.1:{port} is already taken by another process (an sshd-localhost of "
                              "another checkout?); stop it or choose another port")
    except OSError:
        pass   # nothing listens there: ours can
    _keygen(directory / "host_key")
    _keygen(directory / "client_key")
    shutil.copyfile(directory / "client_key.pub", directory / "authorized_keys")
    host_pub = (directory / "host_key.pub").read_text().split()
    (directory / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_pub[0]} {host_pub[1]}\n")
    (directory / "sshd_config").write_text("\n".join([
        f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {directory / 'host_key'}",
        f"PidFile {pidfile}", f"AuthorizedKeysFile {directory / 'authorized_keys'}",
        "StrictModes no", "UsePAM no", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
        "PubkeyAuthentication yes", "PermitRootLogin prohibit-password", "LogLevel ERROR", "PrintMotd no",
        "AcceptEnv LANG LC_*", ""]))
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(exist_ok=True)   # sshd's privilege-separation folder, needed when root
    pidfile.unlink(missing_ok=True)
    proc = subprocess.run([sshd, "-f", str(directory / "sshd_config"), "-E", str(directory / "sshd.log")],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        log = (directory / "sshd.log").read_text().strip().splitlines() if (directory / "sshd.log").is_file() else []
        raise SSHDUnavailable(f"sshd did not start on 127.0.0.1:{port}: "
                              f"{proc.stderr.strip() or (log[-1] if log else 'no message')} (log: {directory / 'sshd.log'})")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            if _pid(pidfile) is not None:
                portfile.write_text(str(port))
                return LocalSSHD(directory, port, _pid(pidfile))
        except OSError:
            pass
        time.sleep(0.1)
    raise SSHDUnavailable(f"sshd did not listen on 127.0.0.1:{port} within {timeout_s} s "
                          f"(log: {directory / 'sshd.log'})")


def running(directory, port=None):
    """The LocalSSHD that runs from `directory` (on `port`, if given), or None."""
    directory = Path(directory).resolve()
    pidfile, portfile = directory / "sshd.pid", directory / "port"
    pid = _pid(pidfile)
    if pid is None or not portfile.is_file():
        return None
    old_port = int(portfile.read_text())
    return LocalSSHD(directory, old_port, pid) if _alive(pid) and port in (None, old_port) else None


def _flock(path, mode):
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, mode)
    return fd


def ensure(connection):
    """Start the throwaway sshd of a `local_sshd` profile unless it runs: in the folder of its
    identity_file (the client key is made there), on its port. Commands running at once share one sshd:
    the start is serialized (an flock on `start.lock`), each command holds a shared lock on `users.lock`
    while it may use the sshd, and the last one to leave stops an sshd that `ensure` started (one that
    `make sshd-localhost` started runs until `make sshd-localhost-stop`). Raises SSHDUnavailable."""
    import fcntl

    if not connection.identity_file:
        raise SSHDUnavailable("connection.local_sshd needs connection.identity_file: the sshd's folder is its folder")
    directory = Path(expand_repo(connection.identity_file)).expanduser().resolve().parent
    directory.mkdir(parents=True, exist_ok=True)
    if any(d == directory for d, _ in _started):
        return None
    start_lock = _flock(directory / "start.lock", fcntl.LOCK_EX)
    try:
        server = None
        if running(directory, connection.port) is None:
            server = start(directory, connection.port)
            (directory / "started-by-command").touch()
        user = _flock(directory / "users.lock", fcntl.LOCK_SH)
    finally:
        os.close(start_lock)
    if not _started:
        atexit.register(stop_started)
    _started.append((directory, user))
    return server


def stop_started():
    """Leave every sshd that `ensure` found or started in this process; stop it if this process is its last
    user and a command (not `make sshd-localhost`) started it."""
    import fcntl

    while _started:
        directory, user = _started.pop()
        os.close(user)
        start_lock = _flock(directory / "start.lock", fcntl.LOCK_EX)
        try:
            last = _flock(directory / "users.lock", fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            last = None          # another command still uses it: the last one stops it
        try:
            if last is not None and (directory / "started-by-command").exists():
                stop(directory)
        finally:
            for fd in (last, start_lock):
                if fd is not None:
                    os.close(fd)


def _sshd_pids(directory):
    """The pids of every sshd running with this folder's config, PidFile or not (a start that raced
    another could lose its PidFile): read from /proc, where there is one."""
    config = b"-f " + str(Path(directory).resolve() / "sshd_config").encode() + b" "
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:   # sshd rewrites its title as one string: "sshd: /usr/sbin/sshd -f CONFIG -E LOG [listener] ..."
            text = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if text.startswith(b"sshd") or b"/sshd " in text.split(b" -f ")[0] + b" ":
            if config in text:
                pids.append(int(entry.name))
    return pids


def stop(directory=None):
    """Stop the sshd started from `directory`: the pid in its PidFile, and any other sshd running with
    its config (a stale one)."""
    directory = Path(directory or default_dir())
    pidfile = directory / "sshd.pid"
    pids = {p for p in [_pid(pidfile), *_sshd_pids(directory)] if p is not None}
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5.0   # gone before we return: the port is free again
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    pidfile.unlink(missing_ok=True)
    (directory / "started-by-command").unlink(missing_ok=True)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m edgebayes.deploy.localsshd", description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["start", "stop"])
    parser.add_argument("--dir", default=None, help="default: runs/ssh-localhost of the working directory")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    args = parser.parse_args(argv)
    if args.action == "stop":
        stop(args.dir)
        return 0
    try:
        server = start(args.dir, args.port)
    except SSHDUnavailable as e:
        print(f"localsshd: {e}", file=sys.stderr)
        return 1
    (server.dir / "started-by-command").unlink(missing_ok=True)   # started by hand: runs until `stop`
    print(f"localsshd: sshd (pid {server.pid}) on 127.0.0.1:{server.port}, keys in {server.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
