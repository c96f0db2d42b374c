"""A throwaway OpenSSH server on 127.0.0.1: the `ssh-localhost` device, for tests and `make pipeline
DEVICE=ssh-localhost`.

It runs the system `sshd` with a config file of its own in one folder: a fresh host key, a fresh client
key whose public half is the only authorized key, a known_hosts file pinning the host key, listening on
127.0.0.1 only, on an unprivileged port. Nothing of the machine's own ssh setup is read or changed.

    python -m edgebayes.deploy.localsshd start [--dir runs/ssh-localhost] [--port 2222]
    python -m edgebayes.deploy.localsshd stop  [--dir runs/ssh-localhost]
"""

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from edgebayes.config import ROOT

DEFAULT_DIR, DEFAULT_PORT = ROOT / "runs" / "ssh-localhost", 2222


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


def start(directory=DEFAULT_DIR, port=None, timeout_s=10.0) -> LocalSSHD:
    """Start (or reuse, if it already runs from `directory`) sshd on 127.0.0.1:port."""
    directory = Path(directory).resolve()
    sshd = find_sshd()
    if sshd is None:
        raise SSHDUnavailable("sshd is not installed (apt-get install openssh-server)")
    directory.mkdir(parents=True, exist_ok=True)
    pidfile, portfile = directory / "sshd.pid", directory / "port"
    if pidfile.is_file() and portfile.is_file():
        pid, old_port = int(pidfile.read_text().split()[0]), int(portfile.read_text())
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
            if pidfile.is_file():
                portfile.write_text(str(port))
                return LocalSSHD(directory, port, int(pidfile.read_text().split()[0]))
        except OSError:
            pass
        time.sleep(0.1)
    raise SSHDUnavailable(f"sshd did not listen on 127.0.0.1:{port} within {timeout_s} s "
                          f"(log: {directory / 'sshd.log'})")


def stop(directory=DEFAULT_DIR):
    """Stop the sshd started from `directory` (by the pid in its own PidFile)."""
    pidfile = Path(directory) / "sshd.pid"
    if pidfile.is_file():
        pid = int(pidfile.read_text().split()[0])
        if _alive(pid):
            os.kill(pid, signal.SIGTERM)
        pidfile.unlink(missing_ok=True)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m edgebayes.deploy.localsshd", description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["start", "stop"])
    parser.add_argument("--dir", default=str(DEFAULT_DIR))
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
    print(f"localsshd: sshd (pid {server.pid}) on 127.0.0.1:{server.port}, keys in {server.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
