"""Command line: `edgebayes <stage> --config pipeline.yaml --device local`, and for devices:

    edgebayes devices list                 the profiles in devices/
    edgebayes devices check DEVICE         preflight: reachable? python, runtime, free disk and memory there
    edgebayes devices profile DEVICE       time a sweep of models there; store its latency table

    edgebayes report --results FILE        import results.json of the bundle's runner.pyz run by hand on the device
    edgebayes report --devices A B C       one page comparing the chosen points of several devices

    edgebayes config schema [--device] [--out FILE]   the JSON Schema of pipeline.yaml (or of a device
                                                      profile), for an editor's completion and checks

Exit codes: 0 done, and the chosen point meets every budget on the device; 1 a stage failed (its message
says why; artifacts of finished stages are kept); 2 bad input (config, device profile, data files, a
results file of another bundle), reported with one message naming the file and key; 3 the chosen point
fails a budget on the device, or a budget could not be judged there, or no operating point fits (the report
says which);
4 the device could not be reached: the report holds predictions only (`pipeline`), and says how to finish.
130 interrupted (Ctrl-C), 143 terminated (SIGTERM): run the same command again to resume.
`pipeline` and `report` end with a summary block (`--json`: the same as JSON, alone on stdout).
"""

import argparse
import dataclasses
import json
import os
import pickle
import signal
import sys
import warnings
from pathlib import Path

from edgebayes import STAGES
from edgebayes.config import ConfigError, load_device_profile, load_pipeline_config
from edgebayes.errors import InputError, StageError, UnreachableWithoutTable

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_TERMINATED = 1, 2, 130, 143
EXIT_BUDGET, EXIT_PREDICTED = 3, 4
# What each exit code means: every command's help, and the Makefile's line after a run (`make` itself
# exits 2 whatever the CLI's code was, so it prints this one).
EXIT_CODES = {
    0: "done; the chosen point meets every budget on the device (or none is set)",
    EXIT_FAILED: "a stage failed; its message says why, the artifacts of finished stages are kept",
    EXIT_BAD_INPUT: "bad input (config, --set, device profile, data, a results file of another bundle), "
                    "reported before any work with the file and key named",
    EXIT_BUDGET: "the chosen point fails a budget on the device, or a budget could not be judged there, or no "
                 "operating point fits (the summary and the report say which)",
    EXIT_PREDICTED: "the device could not be reached: the report holds predictions and the summary says how to "
                    "finish; without a latency table to predict from, no report, and the message says how to make one",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C): run the same command again to resume",
    EXIT_TERMINATED: "terminated (SIGTERM): unwound as Ctrl-C is; run the same command again to resume",
}
_STAGE_HELP = {
    "pipeline": ("run every stage: train -> select -> export -> deploy -> report",
                 "Runs train, select, export, deploy and report for one config and device, skipping each stage whose "
                 "config sections, device profile, code and inputs are unchanged since it last finished. Ends with "
                 "a summary block (device, chosen point, accuracy, ECE, latency, size, memory, each budget's "
                 "verdict) and the exit code of the verdict.",
                 ["edgebayes pipeline                                   # pipeline.yaml on this machine",
                  "edgebayes pipeline --config configs/mnist-mlp-ssgl.yaml --device raspberry-pi-5",
                  "edgebayes pipeline --set train.epochs=3 --set select.mc_samples=[1,2] --json > summary.json"]),
    "train": ("train the model (train/metrics.json, checkpoint.pt)",
              "Trains the config's model family on its data (resumes an interrupted run from its last epoch).",
              ["edgebayes train --set train.epochs=5", "edgebayes train --config configs/mnist-lenet5-ssgl.yaml --force"]),
    "select": ("score every operating point and pick the one that fits the device's budgets",
               "Exports every knob value x M x precision, scores it on validation data, costs its latency, size and "
               "memory for the device and chooses one (select/<device>/candidates.json, choice.json).",
               ["edgebayes select --device jetson", "edgebayes select --set select.objective=nll --device local"]),
    "export": ("export the chosen point into a bundle for the device",
               "Draws the M posterior samples, removes pruned units, writes the MC-averaged graph in each format "
               "and one bundle (the model files, the runner, their hashes).",
               ["edgebayes export --device raspberry-pi-5", "edgebayes export --set export.formats=[onnx,onnx-fp16w]"]),
    "deploy": ("copy the bundle to the device, time it and measure its accuracy there",
               "Preflight (python, runtime, free disk), copy, then the bundle's runner on the device: cold start, "
               "latency over all timed runs, memory, accuracy, calibration and OOD on the device's outputs.",
               ["edgebayes deploy --device local", "edgebayes deploy --device ssh-localhost"]),
    "report": ("write report.json / report.html from the stages' artifacts",
               "Writes the report and prints the summary; --results imports a results.json run by hand on the "
               "device, --devices compares several devices' reports on one page (its exit code: 3 where any "
               "device's report fails a budget, fits nothing or is stale, else 4 where any holds predictions, "
               "else 0).",
               ["edgebayes report --device local",
                "edgebayes report --device jetson --results results.json   # results run by hand on the board",
                "edgebayes report --devices local ssh-localhost jetson"]),
}


def exit_code_line(code: int) -> str:
    """The line `make` prints after the CLI (Makefile): the code and its meaning."""
    return (f"edgebayes exit code {code}: {EXIT_CODES.get(code, 'unexpected (killed by a signal?)')}"
            + ("" if code == 0 else "; make exits 2 for any non-zero code: call .venv/bin/edgebayes for the code"))


def _epilog(examples, codes=tuple(EXIT_CODES), meanings=None) -> str:
    """Examples and exit codes; `meanings` words a code where a command means something else by it (a
    command without a verdict is "done" at 0)."""
    meanings = {**EXIT_CODES, **(meanings or {})}
    return ("examples:\n" + "".join(f"  {e}\n" for e in examples) + "\nexit codes:\n"
            + "".join(f"  {c:<4d}{meanings[c]}\n" for c in codes))


def _sub(sub, name, summary, description, examples, codes=tuple(EXIT_CODES), meanings=None):
    return sub.add_parser(name, help=summary, description=description, epilog=_epilog(examples, codes, meanings),
                          formatter_class=argparse.RawDescriptionHelpFormatter)


_DONE = {0: "done", EXIT_FAILED: "failed; the message says why"}


def build_parser():
    from edgebayes import __version__

    parser = argparse.ArgumentParser(
        prog="edgebayes", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Compressible Bayesian nets, from training to the edge: train a spike-and-slab, nested or "
                    "sparse+quantized net, pick the operating point that fits a device's budgets, export it, run "
                    "it on the device and write a report of accuracy, calibration, latency and memory measured "
                    "there. `edgebayes COMMAND --help` says more about each command.",
        epilog=_epilog(["edgebayes pipeline                         # pipeline.yaml (digits, about a minute) on this machine",
                        "edgebayes pipeline --device jetson          # a board this machine cannot reach: a report of predictions",
                        "edgebayes devices list                      # the device profiles, their runtime and latency table",
                        "edgebayes config schema --out edgebayes.schema.json   # every config key, described"]))
    parser.add_argument("--version", action="version", version=f"edgebayes {__version__}")
    _devices_dir_option(parser, default=None)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in ("pipeline",) + STAGES:
        summary, description, examples = _STAGE_HELP[name]
        # stages other than pipeline and report end before the verdict: 0, 1, 2 or 130
        verdict = name in ("pipeline", "report")
        codes, meanings = tuple(EXIT_CODES), None
        if not verdict:
            codes, meanings = (0, 1, 2, 130, 143), {0: f"the {name} stage is done (or was up to date)"}
        if name == "select":   # 3: no operating point fits (_finish); 4: unreachable, no table to predict from
            codes = (0, 1, 2, EXIT_BUDGET, EXIT_PREDICTED, 130, 143)
        p = _sub(sub, name, summary, description, examples, codes, meanings)
        p.add_argument("--config", default="pipeline.yaml", help="pipeline config (default: pipeline.yaml)")
        p.add_argument("--device", default="local", help="device profile name (`edgebayes devices list`), or a YAML path")
        p.add_argument("--runs-dir", default="runs", help="where artifacts go (default: runs)")
        p.add_argument("--force", action="store_true", help="re-run even if the stage is up to date")
        _set_option(p)
        _devices_dir_option(p)
        if name in ("pipeline", "report"):
            p.add_argument("--json", action="store_true",
                           help="print the closing summary as JSON on stdout (the log goes to stderr)")
        if name == "report":
            p.add_argument("--results", metavar="FILE", default=None,
                           help="results.json of the bundle's runner.pyz run by hand on the device: import it, report")
            p.add_argument("--devices", nargs="+", metavar="DEVICE", default=None,
                           help="write one page comparing these devices' reports (each reported already)")
    devices = _sub(sub, "devices", "list, check or profile device profiles",
                   "The device profiles (devices/<name>.yaml): list them, check that one is ready to deploy to, or "
                   "measure its latency table.",
                   ["edgebayes devices list", "edgebayes devices check ssh-localhost",
                    "edgebayes devices profile ssh-localhost"], (0, 1, 2, 130, 143), _DONE)
    dsub = devices.add_subparsers(dest="action", required=True, metavar="ACTION")
    _devices_dir_option(_sub(dsub, "list", "the device profiles: runtime, latency table, reachable or not",
                             "One line per device profile found (--devices-dir, $EDGEBAYES_DEVICES, the shipped "
                             "ones): its runtime and precisions, where its latency predictions come from (a measured "
                             "latency table, or the board's spec sheet), and whether it answers now (ssh, 3 s).",
                             ["edgebayes devices list", "edgebayes devices list --devices-dir my-boards"], (0, 2), _DONE))
    check = _sub(dsub, "check", "preflight: reachability, python, runtime, free disk and memory",
                 "Connects to the device and prints what it offers; exit 1 if deploying to it would fail.",
                 ["edgebayes devices check ssh-localhost", "edgebayes devices check my-board.yaml"], (0, 1, 2),
                 {0: "the device is ready to deploy to", EXIT_FAILED: "it is not: the verdict line says why"})
    _devices_dir_option(check)
    check.add_argument("device", help="device profile name (`edgebayes devices list`), or a YAML path")
    prof = _sub(dsub, "profile", "measure a latency table on the device (for selection's model)",
                "Times a sweep of MC-averaged MLPs (the config's input size, widths and M) on the device and fits "
                "the latency table that predicts candidates there when it cannot be reached.",
                ["edgebayes devices profile ssh-localhost",
                 "edgebayes devices profile my-board --config configs/mnist-mlp-ssgl.yaml"], (0, 1, 2, 130, 143), _DONE)
    _devices_dir_option(prof)
    prof.add_argument("device", help="device profile name (`edgebayes devices list`), or a YAML path")
    prof.add_argument("--config", default="pipeline.yaml", help="input size, widths and M to sweep (default: pipeline.yaml)")
    prof.add_argument("--runs-dir", default="runs", help="the table goes to RUNS_DIR/devices/DEVICE/ (default: runs)")
    _set_option(prof)
    config = _sub(sub, "config", "the config files' JSON Schema",
                  "Every key of pipeline.yaml and of a device profile, with its type, range, default and meaning.",
                  ["edgebayes config schema --out edgebayes.schema.json",
                   "edgebayes config schema --device | python -m json.tool"], (0, 1), _DONE)
    schema = _sub(config.add_subparsers(dest="action", required=True, metavar="ACTION"), "schema",
                  "write the JSON Schema of pipeline.yaml (or, with --device, of a device profile)",
                  "The JSON Schema of the config files (draft 2020-12), every key described: for an editor's "
                  "completion and checks (a `# yaml-language-server: $schema=...` line at the top of a config).",
                  ["edgebayes config schema --out edgebayes.schema.json",
                   "edgebayes config schema --device --out device.schema.json"], (0, 1), _DONE)
    schema.add_argument("--device", action="store_true", help="the schema of devices/<name>.yaml instead")
    schema.add_argument("--out", metavar="FILE", default=None, help="write it to FILE (default: stdout)")
    schema.add_argument("--markdown", action="store_true",
                        help="a Markdown table of every key (meaning, default) instead of the JSON Schema")
    return parser


def _schema(args):
    from edgebayes.config import json_schema, keys_table
    from edgebayes.provenance import atomic_path

    kind = "device" if args.device else "pipeline"
    text = keys_table(kind) if args.markdown else json.dumps(json_schema(kind), indent=2) + "\n"
    if args.out is None:
        print(text, end="")
        return 0
    with atomic_path(args.out) as tmp:
        tmp.write_text(text)
    print(f"config schema: written to {args.out}", file=sys.stderr)
    return 0


def _set_option(parser):
    parser.add_argument("--set", action="append", default=[], dest="settings", metavar="SECTION.KEY=VALUE",
                        help="override one key of the config file (repeatable; the value is YAML: "
                             "--set train.epochs=3 --set select.mc_samples=[1,4]); validated like the file, "
                             "recorded in the run's fingerprint and report")


def _devices_dir_option(parser, default=argparse.SUPPRESS):
    """--devices-dir before or after the command (a subcommand's default must not override the main one's)."""
    parser.add_argument("--devices-dir", default=default, metavar="DIR",
                        help="a folder of your own device profiles, searched before $EDGEBAYES_DEVICES and the "
                             "profiles shipped with edgebayes")


def _devices(args):
    from edgebayes.config import known_devices
    from edgebayes.deploy.transport import transport_for

    if args.action == "list":
        return _list_devices(known_devices())
    profile = load_device_profile(args.device)
    runs_dir = Path(getattr(args, "runs_dir", "runs"))
    transport = transport_for(profile, runs_dir / "devices" / profile.name / "device")
    if args.action == "check":
        return _check(profile, transport)
    from edgebayes.deploy.latency_model import profile_device, profiling
    from edgebayes.deploy.selection import select_bench

    cfg = load_pipeline_config(args.config, args.settings)
    with profiling(profile, runs_dir):
        path, table = profile_device(profile, cfg, transport, runs_dir, select_bench(cfg.benchmark))
    print(f"devices profile: {len(table['rows'])} models timed on {profile.name} "
          f"({table['runtime']['name']} {table['runtime']['version']}, threads {table['protocol']['threads']}, "
          f"batch {table['batch_size']})")
    for key, fit in table["fit"].items():
        c = fit["coefficients"]
        print(f"  {key}: latency_ms = {c[0]:.4f} + {c[1]:.4f} x operators + {c[2]:.4f} x MFLOPs + {c[3]:.4f} x param MB"
              f"  (max in-sample error {100 * fit['max_relative_error']:.1f} %"
              + (f"; left out as outliers: {', '.join(fit['outliers'])}" if fit.get("outliers") else "") + ")")
    print(f"devices profile: table written to {path}")
    return 0


def _reachable(profile) -> str:
    """Whether the device answers now, cheaply: ssh with a 3 s connect timeout running `true` (no sshd is
    started for a local_sshd profile: that one is started by the command that needs it)."""
    import subprocess

    from edgebayes.deploy.transport import SSHTransport

    c = profile.connection
    if c.kind == "local":
        return "yes (this machine)"
    if c.local_sshd:
        return "on demand (this machine; its sshd starts with the command)"
    argv = SSHTransport(profile.name, c).ssh
    try:
        done = subprocess.run([argv[0], "-o", "ConnectTimeout=3", *argv[1:], "true"], capture_output=True,
                              text=True, timeout=8, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"no ({type(e).__name__})"
    if done.returncode == 0:
        return "yes"
    why = (done.stderr.strip().splitlines() or [f"ssh exit {done.returncode}"])[-1]
    known = {"could not resolve": "host name not found", "refused": "connection refused", "timed out": "timed out",
             "permission denied": "login refused", "no route": "no route to host", "host key": "host key mismatch"}
    return "no (" + next((v for k, v in known.items() if k in why.lower()), why[:50]) + ")"


def _list_devices(names):
    """`devices list`: one row per profile (reachability probed in parallel: a board that is off costs 3 s once)."""
    from concurrent.futures import ThreadPoolExecutor

    from edgebayes.deploy.latency_model import table_path

    # Every profile that loads is listed; one that does not is said after the table (exit 2), not in place of it
    profiles, bad = {}, []
    for name in names:
        try:
            profiles[name] = load_device_profile(name)
        except ConfigError as e:
            bad.append(str(e))
    with ThreadPoolExecutor(max(1, len(profiles))) as pool:
        reachable = dict(zip(profiles, pool.map(_reachable, profiles.values())))
    rows = [("device", "runtime", "latency table", "reachable now", "description")]
    for name, p in profiles.items():
        table = table_path(p, "runs")
        kind = p.latency_model.kind
        latency = ("yes" if table.is_file() and kind != "flops" else "no (measured at selection)" if kind == "measure"
                   else "no (spec sheet)" if p.latency_model.flops_per_second else "no")
        rows.append((name + ("" if p.name == name else f" = {p.name}"),
                     f"{p.runtime.name} {'/'.join(p.runtime.precision)}", latency, reachable[name],
                     _printable(p.description)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(f"{v:<{w}}" for v, w in zip(r[:4], widths)) + "  " + r[4])
    for message in bad:
        print(f"edgebayes: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT if bad else 0


def _printable(text):
    """A profile's free text for the terminal: as it is, or escaped where it holds control characters (an
    escape sequence in a description retitled or recoloured the terminal: probe)."""
    text = " ".join(text.split())   # one line
    return text if text.isprintable() else ascii(text)


def _check(profile, transport):
    """Print what the device offers; exit 1 if deploying to it would fail."""
    import time

    print(f"device {profile.name}: {_printable(profile.description)}")
    print(f"  connection:  {profile.connection.kind} ({transport.where()})")
    t0 = time.monotonic()
    facts = transport.probe(profile.runtime.name)   # raises TransportError: unreachable, auth, no python
    print(f"  reachable:   yes ({time.monotonic() - t0:.2f} s for the probe)")
    print(f"  python:      {facts['python']} ({facts['executable']}), numpy {facts['numpy'] or 'MISSING'}")
    rt = facts["runtime"]
    found = f"{rt['module']} {rt['version']}" if rt["module"] else f"MISSING ({rt['error']})"
    print(f"  runtime:     {profile.runtime.name}: {found}; threads {profile.runtime.threads or 'default'}")
    print(f"  disk free:   {facts['disk_free_mb']:,.0f} MB of {facts['disk_total_mb']:,.0f} MB at {facts['disk_path']}")
    mem = facts["mem_available_mb"]
    print(f"  memory:      " + (f"{mem:,.0f} MB available of {facts['mem_total_mb']:,.0f} MB" if mem else "n/a"))
    print(f"  machine:     {facts['machine']}, {facts['cpu_count']} CPUs, {facts['board'] or facts['platform']}")
    problems = []
    if not rt["module"]:
        problems.append(f"runtime {profile.runtime.name} missing")
    if not facts["numpy"]:
        problems.append("numpy missing")
    if facts["disk_free_mb"] < profile.connection.min_free_mb:
        problems.append(f"less than connection.min_free_mb {profile.connection.min_free_mb} MB free")
    budget = profile.budgets.memory_mb
    if budget and mem and mem < budget:
        problems.append(f"{mem:,.0f} MB available < budgets.memory_mb {budget}")
    print(f"  verdict:     {'NOT READY: ' + '; '.join(problems) if problems else 'ready to deploy'}")
    return 1 if problems else 0


def _program() -> str:
    """The command the user ran, for the hints to repeat: `.venv/bin/edgebayes` as typed, `python -m
    edgebayes.cli` as such, else `edgebayes`."""
    import shlex

    argv0 = sys.argv[0] if sys.argv else ""
    if Path(argv0).name == "edgebayes":
        return argv0
    if Path(argv0).name == "cli.py" and Path(argv0).resolve() == Path(__file__).resolve():
        return shlex.join([sys.executable, "-m", "edgebayes.cli"])
    return "edgebayes"


def _log(args):
    """ctx.log: stdout, or stderr when --json keeps stdout for the summary alone."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        from edgebayes.train import distributed

        if not distributed.is_main_process():   # process 0 says it; the others repeated every line
            warnings.simplefilter("ignore")       # and every warning
            return lambda message: None
    if getattr(args, "json", False):
        return lambda message: print(message, file=sys.stderr)
    return print


def _report_extras(ctx, args):
    """`report --results FILE` (import, then report and summary) or `report --devices A B C` (comparison)."""
    from edgebayes.deploy.report import write_comparison
    from edgebayes.stages import import_results

    if args.results:
        import_results(ctx, args.results)
        return _finish(ctx, args)
    reports, names, seen = [], [], set()
    for name in args.devices:
        profile = load_device_profile(name)
        if profile.name in seen:   # `local local`, or an alias beside its device: one row for both
            continue
        seen.add(profile.name)
        names.append(name)
        path = ctx.run_dir / "report" / profile.name / "report.json"
        withdrawn = path.with_name("report.withdrawn.json")
        if not path.is_file() and withdrawn.is_file():   # a stage before the report ran again (Context.withdraw_report)
            report = json.loads(withdrawn.read_text())
            report["stale"] = ("withdrawn: a stage before the report ran again, or the report itself ran and failed, "
                               "and no report followed")
            reports.append((report, None))   # its page went: nothing to link to
            continue
        if not path.is_file():   # what was asked for does not exist yet: bad input, no verdict and no page
            raise InputError(f"report --devices: {name} has no report ({path} is missing): run "
                             f"`{dataclasses.replace(ctx, device_arg=name).command('pipeline')}` first")
        report = json.loads(path.read_text())
        report["stale"] = _report_staleness(dataclasses.replace(ctx, profile=profile), report)
        reports.append((report, path.with_name("report.html")))
    out = ctx.run_dir / "report"
    write_comparison(reports, out)
    ctx.log(f"report: {out / 'devices.html'} compares {', '.join(names)}")
    for name, (report, _) in zip(names, reports):
        if report["stale"]:
            ctx.log(f"report: {name}'s report is stale, marked so on the page: {report['stale']}")
    if args.json:
        print((out / "devices.json").read_text(), end="")
    return comparison_exit_code([report for report, _ in reports])


def comparison_exit_code(reports):
    """`report --devices`: the exit code a gate over every device can trust. 3 where a device's report fails a
    budget, found no fitting point, or is stale (its verdict is of an earlier choice: the current one is not
    judged); else 4 where one holds predictions; else 0."""
    codes = [EXIT_BUDGET if report["stale"] else
             verdict_exit_code(bool(s.get("no_fit")), s.get("mode"), s.get("overall_verdict"))
             for report in reports for s in [report.get("summary") or {}]]
    return EXIT_BUDGET if EXIT_BUDGET in codes else EXIT_PREDICTED if EXIT_PREDICTED in codes else 0


def verdict_exit_code(no_fit, mode, verdict):
    """A report's exit code: 3 no point fits or a budget fails (or is not judged), 4 predictions, 0 pass."""
    return (EXIT_BUDGET if no_fit else EXIT_PREDICTED if mode == "predicted" else
            0 if verdict in ("pass", "not set") else EXIT_BUDGET)


def _report_staleness(ctx, report):
    """Why a device's report no longer shows what its stages hold (None when it does), by the check `report`
    itself makes: a stage before it out of date or its outputs changed (stale_upstream), or the report that
    would be written again. A report of predictions has no marker of its own (the next pipeline deploys), so
    only the stages before it count. (It compared file times: a copy without them marked a report stale that no
    run could clear, and an edited bundle passed: probe.)"""
    from edgebayes.stages import stale_upstream

    try:
        stale = stale_upstream(ctx, "report")
    except StageError as e:   # a stage's file gone (its folder deleted): the message names it
        return str(e)
    if stale is not None:
        before, why = stale
        return f"the {before} stage is out of date ({why})"
    summary = report.get("summary") or {}
    if summary.get("mode") == "predicted" and not summary.get("no_fit"):
        return None
    why = ctx.staleness("report")
    return None if why is None else f"the report would be written again ({why})"


def _finish(ctx, args):
    """After `pipeline` or `report`: the summary block (or --json) and the exit code of the verdict: 0 all
    budgets pass, 3 one fails or could not be judged, 4 a report of predictions (the device was not
    reached). Read from report.json, so a run whose stages were all cached ends the same way."""
    from edgebayes.deploy.report import summary_text, terminal_summary

    if args.command == "select":   # no operating point fits: a budget verdict (select's log lists them)
        return EXIT_BUDGET if json.loads((ctx.stage_dir("select") / "choice.json").read_text()).get("fits") is False else 0
    if args.command not in ("pipeline", "report"):
        return 0
    path = ctx.stage_dir("report") / "report.json"
    summary = terminal_summary(json.loads(path.read_text()), path.with_name("report.html"))
    code = verdict_exit_code(summary["no_fit"], summary["mode"], summary["verdict"])
    if args.json:
        print(json.dumps({**summary, "exit_code": code}, indent=2))
    else:
        print("\n".join(summary_text(summary, code)))
    return code


def _run(args):
    from edgebayes import config

    config.USER_DEVICES_DIR = args.devices_dir
    if args.command == "config":
        return _schema(args)
    if args.command == "devices":
        return _devices(args)
    cfg = load_pipeline_config(args.config, args.settings)   # before torch loads
    profile = load_device_profile(args.device)
    if not profile.budgets.allowed_mc_samples(cfg.select.mc_samples):   # no candidate could ever fit: say so before any work, not as "no fit" after selection
        b = profile.budgets
        limit = " and ".join(x for x in (b.mc_samples is not None and f"budgets.mc_samples {b.mc_samples}",
                                         b.mc_samples_max is not None and f"budgets.mc_samples_max {b.mc_samples_max}")
                             if x)
        raise ConfigError(f"{args.device}: {limit} of device {profile.name} allows none of select.mc_samples "
                          f"{list(cfg.select.mc_samples)} of {args.config}: no operating point could fit; give an "
                          f"allowed M in select.mc_samples (--set select.mc_samples=[...]) or widen the budget")
    from edgebayes.stages import Context, run_pipeline, run_stage, splits_for

    ctx = Context(cfg, profile, runs_dir=Path(args.runs_dir), force=args.force, config_path=args.config,
                  device_arg=args.device, settings=tuple(args.settings), program=_program())
    ctx.log = _log(args)
    ctx.stdout_is_json = bool(getattr(args, "json", False))   # the relaunched training's lines then go to stderr
    if args.command not in ("deploy", "report") and not _up_to_date(ctx, args.command):
        splits_for(ctx)  # missing data files are bad input too: reported before anything (the lock) is written
    with ctx.lock():
        if args.command == "report" and (args.results or args.devices):
            return _report_extras(ctx, args)
        if args.command == "pipeline":
            run_pipeline(ctx)
        else:
            run_stage(ctx, args.command, single=True)
        return _finish(ctx, args)


def _up_to_date(ctx, command):
    """Whether every stage `command` runs would be skipped: then the data is not decoded only to be checked (a
    cached pipeline over 50,000 images spent 37 s on it, probe). A change to the data's files makes the train
    stage stale (its fingerprint holds them), so bad data still fails before any work."""
    return all(ctx.is_fresh(stage) for stage in (STAGES if command == "pipeline" else (command,)))


class Terminated(BaseException):
    """SIGTERM (a job scheduler, `kill`, a container stopping): unwinds like Ctrl-C, so what a stage holds
    (the run lock, a throwaway sshd, temporaries) is released, and ends in one line with exit 143."""


def _terminate_like_ctrl_c():
    """SIGTERM raises Terminated in the main thread; returns the handler it replaces (None elsewhere)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        raise Terminated()
    return signal.signal(signal.SIGTERM, handler)


def _os_error(e: OSError) -> str:
    """`path: reason` (both paths of a rename or copy) instead of errno's tuple."""
    paths = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
    return f"{paths}: {e.strerror or e}" if paths else str(e)


def _format_warning(message, category, filename, lineno, line=None):
    """edgebayes' own warnings in the terminal as `edgebayes: warning: ...`: Python's format adds the source
    file and line, which reads as a crash to a user. Other packages' warnings keep their format (their
    origin is what a user searches for)."""
    if issubclass(category, UserWarning) and Path(filename).resolve().is_relative_to(Path(__file__).resolve().parent):
        return f"edgebayes: warning: {message}\n"
    return _PYTHON_FORMAT(message, category, filename, lineno, line)


_PYTHON_FORMAT = warnings.formatwarning


def main(argv=None) -> int:
    """Every failure ends as one line on stderr and an exit code (module docstring), never a traceback
    (issue 19): the errors the code raises itself, and those of the machine (disk full, a read-only or
    misplaced runs folder, memory) or of a file's content (JSON, a checkpoint torch refuses to unpickle)."""
    args = build_parser().parse_args(argv)
    what = f"{args.command} {args.action}" if args.command in ("devices", "config") else args.command
    previous, formatwarning = _terminate_like_ctrl_c(), warnings.formatwarning
    warnings.formatwarning = _format_warning
    try:
        return _run(args)
    except InputError as e:
        message, code = f"{e}", EXIT_BAD_INPUT
    except StageError as e:   # a device that cannot be reached, with nothing to predict from: its own code
        message = f"{what} failed: {e}"
        code = EXIT_PREDICTED if isinstance(e, UnreachableWithoutTable) else EXIT_FAILED
    except KeyboardInterrupt:
        message, code = "interrupted; run again to resume", EXIT_INTERRUPTED
    except Terminated:
        message, code = "terminated (SIGTERM); run again to resume", EXIT_TERMINATED
    except OSError as e:
        message, code = f"{what} failed: {_os_error(e)}", EXIT_FAILED
    except MemoryError as e:
        message, code = f"{what} failed: out of memory{f' ({e})' if str(e) else ''}", EXIT_FAILED
    except (json.JSONDecodeError, pickle.UnpicklingError) as e:  # read_json and load_checkpoint name the file
        message, code = f"{what} failed: unreadable file content ({type(e).__name__}: {e})", EXIT_FAILED
    finally:
        warnings.formatwarning = formatwarning
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if code in (EXIT_INTERRUPTED, EXIT_TERMINATED) and argv is None:
        # the program is ending: a second Ctrl-C (a key held, a scheduler's repeat) landed in the interpreter's
        # exit handlers as a traceback, or killed it by the signal (exit -2) instead of 130
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Under `train.processes` the launching process says an interruption; a training process's failure is said
    # with its number where it is not process 0, in one write: the processes share the stream, and two messages
    # ran into one line (probe)
    rank = int(os.environ.get("RANK", "0")) if os.environ.get("EDGEBAYES_RELAUNCHED") else None
    if rank is None or code not in (EXIT_INTERRUPTED, EXIT_TERMINATED):
        sys.stderr.write(f"edgebayes: {f'process {rank}: ' if rank else ''}{message}\n")
        sys.stderr.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
