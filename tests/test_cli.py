"""The command line as a user's first documentation (issue 35): every command's help teaches (a description,
examples, the exit codes), `devices list` says what each profile offers, and make keeps the CLI's verdict."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgebayes.cli import EXIT_CODES, build_parser, exit_code_line, main

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = [["pipeline"], ["train"], ["select"], ["export"], ["deploy"], ["report"], ["devices"], ["devices", "list"],
            ["devices", "check"], ["devices", "profile"], ["config"], ["config", "schema"]]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_has_a_description_examples_and_exit_codes(command, capsys):
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([*command, "--help"])
    text = capsys.readouterr().out
    assert done.value.code == 0
    usage, description = text.split("\n\n")[:2]
    assert usage.startswith(f"usage: edgebayes {' '.join(command)}") and len(description) > 40
    examples = text.split("examples:\n")[1].split("\n\n")[0].splitlines()
    assert len(examples) >= 2 and all(e.strip().startswith("edgebayes ") for e in examples)
    codes = text.split("exit codes:\n")[1].splitlines()
    listed = [int(c.split()[0]) for c in codes]
    assert listed[0] == 0 and len(listed) >= 2 and all(c.split(maxsplit=1)[1] for c in codes)
    verdict = command[0] in ("pipeline", "report")
    assert ("chosen point meets every budget" in codes[0]) == verdict   # 0 means a verdict only where there is one
    assert all(EXIT_CODES[int(c.split()[0])] in c for c in codes if int(c.split()[0]) not in (0, 1))


def test_the_verdict_commands_list_every_exit_code(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["pipeline", "--help"])
    codes = capsys.readouterr().out.split("exit codes:\n")[1].splitlines()
    assert [int(c.split()[0]) for c in codes] == [0, 1, 2, 3, 4, 130, 143]
    with pytest.raises(SystemExit):   # select alone ends with 3 (nothing fits) or 4 (unreachable, no table)
        build_parser().parse_args(["select", "--help"])
    codes = capsys.readouterr().out.split("exit codes:\n")[1].splitlines()
    assert [int(c.split()[0]) for c in codes] == [0, 1, 2, 3, 4, 130, 143]


def test_devices_list_says_runtime_latency_table_and_reachability(capsys, tmp_path):
    board = tmp_path / "board.yaml"
    board.write_text("name: board\nruntime: {name: tflite, precision: [fp32, int8]}\nconnection: {kind: ssh, host: "
                     "127.0.0.1, port: 1, connect_timeout_s: 1}\nlatency_model: {kind: flops, flops_per_second: 1.0e9}\n")
    assert main(["devices", "list", "--devices-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["device", "runtime", "latency"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert "onnxruntime fp32" in rows["local"] and "yes (this machine)" in rows["local"]
    assert "tflite fp32/int8" in rows["board"] and "no (spec sheet)" in rows["board"]
    assert "no (connection refused)" in rows["board"]     # nothing listens on port 1
    assert rows["jetson"].startswith("jetson = jetson-orin-nano")


def test_make_prints_the_clis_exit_code_and_its_meaning(tmp_path):
    """make exits 2 whatever the CLI's code; the recipe prints the code and what it means (and passes --set)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "edgebayes"
    fake.write_text(f"#!/bin/sh\necho \"args: $*\"\nexit 4\n")
    fake.chmod(0o755)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / ".installed").touch()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(["make", "-s", "-C", str(ROOT), "pipeline", f"VENV={venv}", "DEVICE=jetson",
                           "SET=train.epochs=3 select.mc_samples=[1,2]"], capture_output=True, text=True, env=env)
    assert done.returncode == 2
    assert "args: pipeline --config pipeline.yaml --device jetson --set train.epochs=3 --set select.mc_samples=[1,2]" \
        in done.stdout
    assert exit_code_line(4) in done.stdout and "could not be reached" in exit_code_line(4)
    assert exit_code_line(0).startswith("edgebayes exit code 0: done")


def test_hints_repeat_the_command_the_user_ran(monkeypatch):
    from edgebayes import cli

    monkeypatch.setattr(sys, "argv", [".venv/bin/edgebayes", "pipeline"])
    assert cli._program() == ".venv/bin/edgebayes"
    monkeypatch.setattr(sys, "argv", [cli.__file__, "pipeline"])
    assert cli._program().endswith("-m edgebayes.cli") and sys.executable in cli._program()
    from edgebayes.config import load_device_profile, load_pipeline_config
    from edgebayes.stages import Context

    ctx = Context(load_pipeline_config(ROOT / "pipeline.yaml"), load_device_profile("local"), program=".venv/bin/edgebayes")
    assert ctx.command("report").startswith(".venv/bin/edgebayes report --config")



def test_the_finishing_steps_find_the_profile_and_reach_the_board_as_deploy_does(tmp_path, monkeypatch):
    """A profile found through --devices-dir was 'unknown device' in the printed import command, and the ssh /
    scp steps dropped the profile's key, jump host and options; a board with tflite-runtime only failed the
    check of ai-edge-litert (probe)."""
    import yaml

    from edgebayes import config
    from edgebayes.config import load_device_profile, load_pipeline_config
    from edgebayes.stages import Context, finish_steps

    profile = yaml.safe_load((ROOT / "devices/raspberry-pi-5.yaml").read_text())
    profile["name"] = "my-pi"
    profile["connection"].update(port=2200, identity_file="/keys/pi", proxy_jump="gate@jump",
                                 options=["StrictHostKeyChecking=no"])
    profile["runtime"]["name"] = "tflite"
    (tmp_path / "my-pi.yaml").write_text(yaml.safe_dump(profile))
    monkeypatch.setattr(config, "USER_DEVICES_DIR", str(tmp_path))
    ctx = Context(load_pipeline_config(ROOT / "pipeline.yaml"), load_device_profile("my-pi"), device_arg="my-pi")
    steps = finish_steps(ctx)
    assert f"--device my-pi --devices-dir {tmp_path}" in steps[-1]
    ssh = [s for s in steps if s.startswith("ssh ")]
    scp = [s for s in steps if s.startswith("scp ")]
    assert ssh and scp and all("-i /keys/pi -J gate@jump -o StrictHostKeyChecking=no" in s for s in ssh + scp)
    assert all("-p 2200" in s for s in ssh) and all("-P 2200" in s for s in scp)
    assert not any("BatchMode" in s for s in ssh + scp)   # a person types these
    assert "import numpy, tflite_runtime.interpreter" in steps[0]


def test_a_logged_loop_says_its_pace_and_eta(capsys):
    """Off a terminal each epoch is one line, with the time per step and the time left (issue 35)."""
    from edgebayes.progress import LineProgress

    bar = LineProgress(range(3), "train", unit="epoch", initial=0, file=sys.stdout)
    for _ in bar:
        bar.set_postfix(loss=1.0)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("train: epoch 1/3: loss=1.0 (") and "s/epoch, ETA " in lines[0]
    assert "ETA" not in lines[-1] and lines[-1].startswith("train: epoch 3/3: loss=1.0 (")
    # A loop of thousands of short steps (an image folder's decoding) says where it is every `interval` seconds
    # and at its end, not once per step
    bar = LineProgress(range(5000), "data: decoding", unit="image", file=sys.stdout, interval=3600)
    assert sum(1 for _ in bar) == 5000
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("data: decoding: image 5000/5000 (")


def test_a_second_interrupt_while_the_program_ends_is_ignored():
    """Two Ctrl-C 10 ms apart: the second landed in the interpreter's exit handlers as a traceback, or killed
    the process by the signal (-2) instead of 130 (probe). Once main has caught one, the program ignores more;
    main called with arguments (as here in tests, or from a user's script) leaves the handlers alone."""
    import subprocess
    import sys

    code = ("import signal, sys, edgebayes.cli as c\n"
            "def interrupted(args): raise KeyboardInterrupt\n"
            "c._run = interrupted\n"
            "sys.argv = ['edgebayes', 'devices', 'list']\n"
            "code = c.main()\n"
            "assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN, 'SIGINT still handled'\n"
            "assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN, 'SIGTERM still handled'\n"
            "import os; os.kill(os.getpid(), signal.SIGINT)\n"
            "assert c.main(['devices', 'list']) == 130 and signal.getsignal(signal.SIGINT) is signal.SIG_IGN\n"
            "sys.exit(code)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("edgebayes: interrupted; run again to resume") == 2


def test_edgebayes_warnings_read_as_one_line_of_edgebayes_in_the_terminal():
    """Python's format put the source path and line before each of edgebayes' warnings ('.../bayesianize.py:262:
    UserWarning: ...' and the calling line), which read as a crash (probe); other packages' keep theirs."""
    import torch

    import edgebayes.train.bayesianize as own
    from edgebayes import cli

    assert cli._format_warning("3 of 8 parameters", UserWarning, own.__file__, 262) == \
        "edgebayes: warning: 3 of 8 parameters\n"
    assert "DeprecationWarning: old" in cli._format_warning("old", DeprecationWarning, torch.__file__, 1)
    assert "UserWarning: theirs" in cli._format_warning("theirs", UserWarning, torch.__file__, 1)
