"""Transports: how a bundle and the runner reach a device, run there, and how results come back.

A transport has three verbs: `put` (copy a local file or folder to the device), `run` (run an argument
list on the device, never through a shell), `get` (copy a device file back). `LocalTransport` is this
machine, with a work folder standing in for the device's disk. The SSH transport (issue 7) implements the
same three verbs with the system OpenSSH client.
"""

import shutil
import subprocess
import sys
from pathlib import Path

from edgebayes.errors import StageError

RUNNER = Path(__file__).with_name("runner.py")


class TransportError(StageError):
    pass


class LocalTransport:
    def __init__(self, workdir, python=None):
        self.workdir = Path(workdir)
        self.python = python or sys.executable

    def put(self, local, remote_name):
        dest = self.workdir / remote_name
        self.workdir.mkdir(parents=True, exist_ok=True)
        if dest.is_dir():
            shutil.rmtree(dest)
        if Path(local).is_dir():
            shutil.copytree(local, dest)
        else:
            shutil.copyfile(local, dest)
        return dest

    def run(self, args):
        """Run [python, *args] in the work folder. Its stderr is shown live (progress bars) and its last
        line kept, so a failure can be reported in one message. Returns (exit code, last stderr line)."""
        proc = subprocess.Popen([self.python, *map(str, args)], cwd=self.workdir, stderr=subprocess.PIPE)
        tail = b""
        for chunk in iter(lambda: proc.stderr.read1(4096), b""):
            sys.stderr.write(chunk.decode(errors="replace"))
            sys.stderr.flush()
            tail = (tail + chunk)[-4096:]
        code = proc.wait()
        lines = [ln.strip() for ln in tail.decode(errors="replace").replace("\r", "\n").splitlines() if ln.strip()]
        return code, (lines[-1] if lines else "")

    def get(self, remote_name, local):
        src = self.workdir / remote_name
        if not src.is_file():
            raise TransportError(f"the device did not produce {remote_name} in {self.workdir}")
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, local)


def transport_for(profile, default_workdir):
    if profile.connection.kind == "local":
        return LocalTransport(profile.connection.workdir or default_workdir, profile.connection.python)
    raise TransportError(f"device {profile.name}: connection kind {profile.connection.kind!r} is not supported yet")
