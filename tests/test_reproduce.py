"""The paper-table commands (benchmarks/reproduce/): a missing data set ends them with one message, exit 2."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_paper001_without_cifar10_exits_2_naming_the_folder(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "reproduce" / "paper001_table1.py"),
                           "--data-root", str(tmp_path), "--epochs", "1", "--out", str(tmp_path / "t")],
                          capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "paper 001 Table 1 needs CIFAR-10" in proc.stderr and str(tmp_path) in proc.stderr
    assert not list(tmp_path.glob("t.*"))  # nothing half-written
