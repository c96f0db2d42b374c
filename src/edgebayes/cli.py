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
import json
import pickle
import signal
import sys
from pathlib import Path

from edgebayes import STAGES
from edgebayes.config import load_device_profile, load_pipeline_config
from edgebayes.errors import InputError, StageError

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_TERMINATED = 1, 2, 130, 143
EXIT_BUDGET, EXIT_PREDICTED = 3, 4


def build_parser():
    from edgebayes import __version__

    parser = argparse.ArgumentParser(prog="edgebayes", description="Compressible Bayesian nets, from training to the edge.")
    parser.add_argument("--version", action="version", version=f"edgebayes {__version__}")
    _devices_dir_option(parser, default=None)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in STAGES + ("pipeline",):
        p = sub.add_parser(name, help="run all stages" if name == "pipeline" else f"run the {name} stage")
        p.add_argument("--config", default="pipeline.yaml", help="pipeline config (default: pipeline.yaml)")
        p.add_argument("--device", default="local", help="device profile name in devices/, or a YAML path")
        p.add_argument("--runs-dir", default="runs", help="where artifacts go (default: runs)")
        p.add_argument("--force", action="store_true", help="re-run even if the stage is up to date")
        _devices_dir_option(p)
        if name in ("pipeline", "report"):
            p.add_argument("--json", action="store_true",
                           help="print the closing summary as JSON on stdout (the log goes to stderr)")
        if name == "report":
            p.add_argument("--results", metavar="FILE", default=None,
                           help="results.json of the bundle's runner.pyz run by hand on the device: import it, report")
            p.add_argument("--devices", nargs="+", metavar="DEVICE", default=None,
                           help="write one page comparing these devices' reports (each reported already)")
    devices = sub.add_parser("devices", help="list, check or profile device profiles")
    dsub = devices.add_subparsers(dest="action", required=True)
    _devices_dir_option(dsub.add_parser("list", help="the device profiles found (--devices-dir, $EDGEBAYES_DEVICES, "
                                                      "the shipped ones)"))
    check = dsub.add_parser("check", help="preflight: reachability, python, runtime, free disk and memory")
    _devices_dir_option(check)
    check.add_argument("device", help="device profile name in devices/, or a YAML path")
    prof = dsub.add_parser("profile", help="measure a latency table on the device (for selection's model)")
    _devices_dir_option(prof)
    prof.add_argument("device", help="device profile name in devices/, or a YAML path")
    prof.add_argument("--config", default="pipeline.yaml", help="input size, widths and M to sweep (default: pipeline.yaml)")
    prof.add_argument("--runs-dir", default="runs", help="the table goes to RUNS_DIR/devices/DEVICE/ (default: runs)")
    config = sub.add_parser("config", help="the config files' JSON Schema")
    schema = config.add_subparsers(dest="action", required=True).add_parser(
        "schema", help="write the JSON Schema of pipeline.yaml (or, with --device, of a device profile)")
    schema.add_argument("--device", action="store_true", help="the schema of devices/<name>.yaml instead")
    schema.add_argument("--out", metavar="FILE", default=None, help="write it to FILE (default: stdout)")
    return parser


def _schema(args):
    from edgebayes.config import json_schema
    from edgebayes.provenance import atomic_path

    text = json.dumps(json_schema("device" if args.device else "pipeline"), indent=2) + "\n"
    if args.out is None:
        print(text, end="")
        return 0
    with atomic_path(args.out) as tmp:
        tmp.write_text(text)
    print(f"config schema: written to {args.out}", file=sys.stderr)
    return 0


def _devices_dir_option(parser, default=argparse.SUPPRESS):
    """--devices-dir before or after the command (a subcommand's default must not override the main one's)."""
    parser.add_argument("--devices-dir", default=default, metavar="DIR",
                        help="a folder of your own device profiles, searched before $EDGEBAYES_DEVICES and the "
                             "profiles shipped with edgebayes")


def _devices(args):
    from edgebayes.config import known_devices
    from edgebayes.deploy.transport import transport_for

    if args.action == "list":
        for name in known_devices():
            p = load_device_profile(name)
            alias = "" if p.name == name else f" (alias of {p.name})"
            print(f"{name:18s} {p.runtime.name:12s} {p.connection.kind:5s} {p.description}{alias}")
        return 0
    profile = load_device_profile(args.device)
    runs_dir = Path(getattr(args, "runs_dir", "runs"))
    transport = transport_for(profile, runs_dir / "devices" / profile.name / "device")
    if args.action == "check":
        return _check(profile, transport)
    from edgebayes.deploy.latency_model import profile_device
    from edgebayes.deploy.selection import select_bench

    cfg = load_pipeline_config(args.config)
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


def _check(profile, transport):
    """Print what the device offers; exit 1 if deploying to it would fail."""
    import time

    print(f"device {profile.name}: {profile.description}")
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


def _log(args):
    """ctx.log: stdout, or stderr when --json keeps stdout for the summary alone."""
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
    reports = []
    for name in args.devices:
        profile = load_device_profile(name)
        path = ctx.run_dir / "report" / profile.name / "report.json"
        if not path.is_file():
            raise StageError(f"{path} is missing: run `edgebayes pipeline --config {ctx.config_path} --device {name}"
                             f"{'' if str(ctx.runs_dir) == 'runs' else f' --runs-dir {ctx.runs_dir}'}` first")
        reports.append((json.loads(path.read_text()), path.with_name("report.html")))
    out = ctx.run_dir / "report"
    write_comparison(reports, out)
    ctx.log(f"report: {out / 'devices.html'} compares {', '.join(args.devices)}")
    if args.json:
        print((out / "devices.json").read_text(), end="")
    return 0


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
    code = (EXIT_BUDGET if summary["no_fit"] else EXIT_PREDICTED if summary["mode"] == "predicted" else
            0 if summary["verdict"] in ("pass", "not set") else EXIT_BUDGET)
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
    cfg, profile = load_pipeline_config(args.config), load_device_profile(args.device)  # before torch loads
    from edgebayes.stages import Context, run_pipeline, run_stage, splits_for

    ctx = Context(cfg, profile, runs_dir=Path(args.runs_dir), force=args.force, config_path=args.config,
                  device_arg=args.device)
    ctx.log = _log(args)
    if args.command not in ("deploy", "report"):
        splits_for(ctx)  # missing data files are bad input too: reported before anything (the lock) is written
    with ctx.lock():
        if args.command == "report" and (args.results or args.devices):
            return _report_extras(ctx, args)
        if args.command == "pipeline":
            run_pipeline(ctx)
        else:
            run_stage(ctx, args.command)
        return _finish(ctx, args)


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


def main(argv=None) -> int:
    """Every failure ends as one line on stderr and an exit code (module docstring), never a traceback
    (issue 19): the errors the code raises itself, and those of the machine (disk full, a read-only or
    misplaced runs folder, memory) or of a file's content (JSON, a checkpoint torch refuses to unpickle)."""
    args = build_parser().parse_args(argv)
    what = f"{args.command} {args.action}" if args.command in ("devices", "config") else args.command
    previous = _terminate_like_ctrl_c()
    try:
        return _run(args)
    except InputError as e:
        message, code = f"{e}", EXIT_BAD_INPUT
    except StageError as e:
        message, code = f"{what} failed: {e}", EXIT_FAILED
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
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print(f"edgebayes: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
