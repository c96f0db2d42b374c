"""edgebayes installed without -e (`pip install .`): the shipped device profiles are package data, the
command line knows its version, and `{repo}` is the working directory, not the install location.

A wheel is built from a copy of the checkout (so the checkout gets no build/ or egg-info) and installed with
--no-deps into a fresh venv. That venv sees this interpreter's packages (torch, onnxruntime, ...) through a
.pth line, which Python appends to sys.path without reading the .pth files there, so this checkout's own
editable install is not on the path: `edgebayes` can only come from the wheel.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import ROOT


def run(*argv, cwd=None):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "EDGEBAYES_DEVICES")}
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_profiles_version_and_placeholders_after_a_non_editable_install(tmp_path):
    pytest.importorskip("setuptools", reason="--no-build-isolation builds with this interpreter's setuptools")
    source = tmp_path / "checkout"
    shutil.copytree(ROOT / "src", source / "src", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copytree(ROOT / "devices", source / "devices")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    built = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist",
                source)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("edgebayes-*.whl")

    venv = tmp_path / "venv"
    made = run(sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    purelib = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    (purelib / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = run(python, "-m", "pip", "install", "--no-deps", "--no-index", wheel)
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-2000:]

    elsewhere = tmp_path / "somewhere"
    elsewhere.mkdir()
    where = run(python, "-c", "import edgebayes.config as c; print(c.__file__); print(c.DEVICES_DIR)", cwd=elsewhere)
    assert where.returncode == 0, where.stderr
    module, devices = where.stdout.split()
    assert Path(module).is_relative_to(venv) and Path(devices).is_relative_to(venv)   # the wheel's, not ROOT's
    assert (Path(module).parent / "ondevice" / "cli.py").is_file()   # what export zips into runner.pyz
    page = run(python, "-c", "from edgebayes.deploy.report import write_report as w; "
                             "w({'run_name': 'wheel', 'device': {'name': 'pi'}}, 'out')", cwd=elsewhere)
    assert page.returncode == 0, page.stderr[-2000:]   # the templates are package data
    assert "edgebayes report: wheel on pi" in (elsewhere / "out" / "report.html").read_text()

    edgebayes = venv / "bin" / "edgebayes"
    version = run(edgebayes, "--version", cwd=elsewhere)
    assert version.returncode == 0 and version.stdout.strip().startswith("edgebayes ")
    listed = run(edgebayes, "devices", "list", cwd=elsewhere)
    assert listed.returncode == 0, listed.stderr
    for name in ("local", "ssh-localhost", "jetson", "jetson-orin-nano", "raspberry-pi-5", "x86-edge-box"):
        assert any(line.split()[0] == name for line in listed.stdout.splitlines()), (name, listed.stdout)

    key = run(python, "-c", "from edgebayes.config import load_device_profile as load, expand_repo; "
                            "c = load('ssh-localhost').connection; print(expand_repo(c.identity_file)); "
                            "print(expand_repo(c.python))", cwd=elsewhere)
    assert key.returncode == 0, key.stderr
    identity, interpreter = key.stdout.split()
    assert identity == str(elsewhere / "runs" / "ssh-localhost" / "client_key")   # this folder's runs/
    assert Path(interpreter) == python
