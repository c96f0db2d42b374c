"""Command line: `edgebayes <stage> --config pipeline.yaml --device local`, and for devices:

    edgebayes devices list                 the profiles in devices/
    edgebayes devices check DEVICE         preflight: reachable? python, runtime, free disk and memory there
    edgebayes devices profile DEVICE       time a sweep of models there; store its latency table

Exit codes: 0 done; 1 a stage failed (its message says why; artifacts of finished stages are kept);
2 bad input (config, device profile, data files), reported with one message naming the file and key;
130 interrupted (Ctrl-C): run the same command again to resume.
"""

import argparse
import json
import pickle
import sys
from pathlib import Path

from edgebayes import STAGES
from edgebayes.config import load_device_profile, load_pipeline_config
from edgebayes.errors import InputError, StageError

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 1, 2, 130


def build_parser():
    parser = argparse.ArgumentParser(prog="edgebayes", description="Compressible Bayesian nets, from training to the edge.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in STAGES + ("pipeline",):
        p = sub.add_parser(name, help="run all stages" if name == "pipeline" else f"run the {name} stage")
        p.add_argument("--config", default="pipeline.yaml", help="pipeline config (default: pipeline.yaml)")
        p.add_argument("--device", default="local", help="device profile name in devices/, or a YAML path")
        p.add_argument("--runs-dir", default="runs", help="where artifacts go (default: runs)")
        p.add_argument("--force", action="store_true", help="re-run even if the stage is up to date")
    devices = sub.add_parser("devices", help="list, check or profile device profiles")
    dsub = devices.add_subparsers(dest="action", required=True)
    dsub.add_parser("list", help="the profiles in devices/")
    check = dsub.add_parser("check", help="preflight: reachability, python, runtime, free disk and memory")
    check.add_argument("device", help="device profile name in devices/, or a YAML path")
    prof = dsub.add_parser("profile", help="measure a latency table on the device (for selection's model)")
    prof.add_argument("device", help="device profile name in devices/, or a YAML path")
    prof.add_argument("--config", default="pipeline.yaml", help="input size, widths and M to sweep (default: pipeline.yaml)")
    prof.add_argument("--runs-dir", default="runs", help="the table goes to RUNS_DIR/devices/DEVICE/ (default: runs)")
    return parser


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
              f"  (max in-sample error {100 * fit['max_relative_error']:.1f} %)")
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


def _run(args):
    if args.command == "devices":
        return _devices(args)
    cfg, profile = load_pipeline_config(args.config), load_device_profile(args.device)  # before torch loads
    from edgebayes.stages import Context, run_pipeline, run_stage, splits_for

    ctx = Context(cfg, profile, runs_dir=Path(args.runs_dir), force=args.force, config_path=args.config,
                  device_arg=args.device)
    if args.command not in ("deploy", "report"):
        splits_for(ctx)  # missing data files are bad input too: reported before anything (the lock) is written
    with ctx.lock():
        if args.command == "pipeline":
            run_pipeline(ctx)
        else:
            run_stage(ctx, args.command)
    return 0


def _os_error(e: OSError) -> str:
    """`path: reason` (both paths of a rename or copy) instead of errno's tuple."""
    paths = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
    return f"{paths}: {e.strerror or e}" if paths else str(e)


def main(argv=None) -> int:
    """Every failure ends as one line on stderr and an exit code (module docstring), never a traceback
    (issue 19): the errors the code raises itself, and those of the machine (disk full, a read-only or
    misplaced runs folder, memory) or of a file's content (JSON, a checkpoint torch refuses to unpickle)."""
    args = build_parser().parse_args(argv)
    what = f"devices {args.action}" if args.command == "devices" else args.command
    try:
        return _run(args)
    except InputError as e:
        message, code = f"{e}", EXIT_BAD_INPUT
    except StageError as e:
        message, code = f"{what} failed: {e}", EXIT_FAILED
    except KeyboardInterrupt:
        message, code = "interrupted; run again to resume", EXIT_INTERRUPTED
    except OSError as e:
        message, code = f"{what} failed: {_os_error(e)}", EXIT_FAILED
    except MemoryError as e:
        message, code = f"{what} failed: out of memory{f' ({e})' if str(e) else ''}", EXIT_FAILED
    except (json.JSONDecodeError, pickle.UnpicklingError) as e:  # read_json and load_checkpoint name the file
        message, code = f"{what} failed: unreadable file content ({type(e).__name__}: {e})", EXIT_FAILED
    print(f"edgebayes: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
