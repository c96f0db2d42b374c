"""Shared fixtures: one trained pipeline run and one throwaway sshd per test session.

Training the embedded default takes most of the suite's time, so it happens once (`pipeline_run`), and the
tests that need a trained model copy its train folder. The SSH tests all talk to one real sshd on
127.0.0.1 (`sshd`), started from a temporary folder with its own host and client keys; they are skipped
only when no sshd binary exists at all (.ci/run installs openssh-server).
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from edgebayes.cli import main
from edgebayes.deploy import localsshd

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def inductor_cache(tmp_path_factory):
    """torch.compile's cache inside the session's temporary folder (pytest keeps the last three): in the shared
    /tmp it grew by every run of the suite, 2.3 GB on a developer's machine, and filled a disk."""
    import os

    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor"))
    yield
    if previous is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def pipeline_run(tmp_path_factory):
    """`edgebayes pipeline` on pipeline.yaml and the local device, run once; returns runs/digits-ssgl."""
    runs = tmp_path_factory.mktemp("runs")
    assert main(["pipeline", "--config", str(ROOT / "pipeline.yaml"), "--runs-dir", str(runs)]) == 0
    return runs / "digits-ssgl"


@pytest.fixture
def trained_runs(pipeline_run, tmp_path):
    """A fresh runs folder holding the session's trained model (train stage up to date) and the latency
    table its pipeline measured for the local device."""
    runs = tmp_path / "runs"
    shutil.copytree(pipeline_run / "train", runs / pipeline_run.name / "train")
    shutil.copytree(pipeline_run.parent / "devices", runs / "devices")
    return runs


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    if localsshd.find_sshd() is None:
        pytest.skip("no sshd binary on this machine (apt-get install openssh-server; .ci/run does)")
    server = localsshd.start(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()


@pytest.fixture
def tiny_disk(tmp_path):
    """A folder on a real 64 KiB tmpfs, for full-disk tests (mounting needs root, as CI runs); unmounted after."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root; CI runs as root): {mounted.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def cli(capsys, *args):
    """Run the command line in-process: (exit code, stdout, stderr) of this call alone."""
    capsys.readouterr()
    code = main(list(map(str, args)))
    out = capsys.readouterr()
    return code, out.out, out.err


def write_profile(path, base="ssh-localhost", **changes):
    """A device profile YAML derived from devices/<base>.yaml; changes are `section.key=value`-style dicts."""
    profile = yaml.safe_load((ROOT / "devices" / f"{base}.yaml").read_text())
    profile["name"] = Path(path).stem
    for section, values in changes.items():
        profile.setdefault(section, {}).update(values)
    Path(path).write_text(yaml.safe_dump(profile))
    return Path(path)


@pytest.fixture
def ssh_device(sshd, tmp_path):
    """make(name, **connection changes) -> a profile path for the session's sshd, workdir in tmp_path."""
    def make(name="ssh-test", **connection):
        # local_sshd off: these profiles use the session's sshd, and some point at a port nothing serves
        conn = {"local_sshd": False, "port": sshd.port, "identity_file": str(sshd.client_key), "python": sys.executable,
                "workdir": str(tmp_path / "device" / name),
                "options": [f"UserKnownHostsFile={sshd.known_hosts}", "StrictHostKeyChecking=yes",
                            "IdentitiesOnly=yes"]}
        conn.update(connection)
        return write_profile(tmp_path / f"{name}.yaml", connection=conn)
    return make
