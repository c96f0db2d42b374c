"""Does the embedded default pipeline keep its speed when another process is busy on one core (issue 20)?

The target: `make pipeline` (the embedded default, pipeline.yaml on the `local` device) with a CPU-bound
process on another core finishes within 1.5x of its time on a quiet machine. Torch's default is a thread per
core; with one core taken, its threads wait for each other at every operator (10 min 39 s instead of 36 s on
this project's 2-core VM), which `train.threads` (default: the free cores, train/accel.py free_cores)
avoids.

Each repeat runs the command `make pipeline` runs (`edgebayes pipeline --config pipeline.yaml --device local`,
with this interpreter) twice, each time into a fresh temporary --runs-dir so that nothing is cached (not
even the device's latency table, which a fresh machine profiles first): once quiet, once with the load
running. OMP_NUM_THREADS and MKL_NUM_THREADS are removed from the pipeline's environment (a fresh shell has
none, and set_threads leaves torch's default alone when OMP_NUM_THREADS is set). The load is one process per
--load-cores, each a Python busy loop pinned (os.sched_setaffinity, where the OS has it) to one of the last
cores of this process's CPU set, started --settle seconds before the pipeline; it ends when the pipeline
does, when this script ends (try/finally, SIGTERM included), and in any case by itself at the --timeout
deadline or when its parent is gone. The whole benchmark stops at --timeout seconds (a pipeline still
running then is killed with its children, and the results say so).

Recorded per run: wall time, each stage's time (from the time its "running" line was printed), the torch
threads train / select / export chose (their "N torch threads" log lines), and the cores free_cores()
counted from here just before the pipeline started. The ratio is the median loaded time over the median
quiet time. Results: <out>.json (machine, commit, versions) and <out>.md. The committed figures:

    flock /tmp/edgebayes-bench.lock .venv/bin/python benchmarks/pipeline_under_load.py --repeats 2

Run it on an otherwise quiet machine: the quiet runs are the reference (the results report how busy the
other cores were before each one). `--epochs N` trains for N epochs instead of the config's (a smoke test:
its results are not the issue's figure, and it writes elsewhere unless --out says so).
"""

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from edgebayes.provenance import atomic_path, provenance, result_path, write_json
from edgebayes.train.accel import cpu_set, busy_elsewhere, free_cores

ROOT = Path(__file__).resolve().parents[1]
WITHIN = 1.5  # issue 20: loaded time <= 1.5x the quiet time
STAGE_RUNNING = re.compile(r"^(train|select|export|deploy|report): running")
STAGE_THREADS = re.compile(r"^(train|select|export): (\d+) torch threads")
# The load: spin on one core until the deadline or until the benchmark that started it is gone.
LOAD = """import os, sys, time
core, end, parent = int(sys.argv[1]), float(sys.argv[2]), os.getppid()
if core >= 0 and hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {core})
while time.time() < end and os.getppid() == parent:
    for _ in range(100000):
        pass
"""


def start_load(cores, deadline):
    """One busy process per core in `cores` (-1: not pinned), each ending by itself at `deadline` (time.time())."""
    return [subprocess.Popen([sys.executable, "-c", LOAD, str(core), str(deadline)]) for core in cores]


def stop_load(procs):
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def pipeline_command(config, device, runs_dir):
    return [sys.executable, "-m", "edgebayes", "pipeline", "--config", str(config), "--device", device,
            "--runs-dir", str(runs_dir)]


def run_pipeline(config, device, seconds_left):
    """Run the pipeline into a fresh runs folder; {wall_seconds, stage_seconds, threads, returncode, timed_out,
    tail}. Killed (with the processes it started) after `seconds_left`."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    src = str(ROOT / "src")
    env["PYTHONPATH"] = src + os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else src
    lines, started, threads = [], {}, {}
    with tempfile.TemporaryDirectory(prefix="edgebayes-under-load-") as runs_dir:
        start = time.perf_counter()
        proc = subprocess.Popen(pipeline_command(config, device, runs_dir), cwd=ROOT, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        timed_out = threading.Event()

        def kill():
            timed_out.set()
            os.killpg(proc.pid, signal.SIGKILL)

        watchdog = threading.Timer(max(0.0, seconds_left), kill)
        watchdog.start()
        try:
            for line in proc.stdout:
                line = line.rstrip("\n")
                lines.append(line)
                if m := STAGE_RUNNING.match(line):
                    started[m.group(1)] = time.perf_counter() - start
                if m := STAGE_THREADS.match(line):
                    threads[m.group(1)] = int(m.group(2))
            proc.wait()
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        wall = time.perf_counter() - start
    marks = sorted(started.items(), key=lambda kv: kv[1]) + [("end", wall)]
    stage_seconds = {s: round(marks[i + 1][1] - t, 3) for i, (s, t) in enumerate(marks[:-1])}
    return {"wall_seconds": wall, "stage_seconds": stage_seconds, "threads": threads,
            "returncode": proc.returncode, "timed_out": timed_out.is_set(), "tail": lines[-15:]}


def config_for_run(config, epochs, folder):
    """The config as given, or a copy in `folder` that trains for `epochs` epochs (a smoke test)."""
    if epochs is None:
        return config
    cfg = yaml.safe_load(config.read_text())
    cfg.setdefault("train", {})["epochs"] = epochs
    path = Path(folder) / config.name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def summary(runs):
    quiet = [r["wall_seconds"] for r in runs if r["condition"] == "quiet" and r["returncode"] == 0]
    loaded = [r["wall_seconds"] for r in runs if r["condition"] == "loaded" and r["returncode"] == 0]
    if not quiet or not loaded:
        return {"quiet_seconds": None, "loaded_seconds": None, "ratio": None, "within": None}
    ratio = statistics.median(loaded) / statistics.median(quiet)
    return {"quiet_seconds": statistics.median(quiet), "loaded_seconds": statistics.median(loaded),
            "ratio": ratio, "within": ratio <= WITHIN}


def markdown(result):
    s, prov = result["summary"], result["provenance"]
    machine = prov["machine"]
    verdict = ("not measured (a run failed or timed out)" if s["ratio"] is None else
               f"**{s['ratio']:.2f}x**: {'within' if s['within'] else 'NOT within'} {WITHIN}x")
    lines = [f"# The embedded default pipeline under load (issue 20){' - SMOKE (' + str(result['epochs']) + ' epochs)' if result['epochs'] else ''}",
             "",
             f"`{' '.join(result['command'])}` into a fresh runs folder each time, with and without "
             f"{result['load_cores']} busy process(es) pinned to core(s) {result['load_pinned_to']} of the CPU set "
             f"{result['cpu_set']} (started {result['settle_seconds']} s before). Commit {prov['git_commit']}; "
             f"machine: {machine['platform']}, {machine['cpu_count']} cores; "
             f"{', '.join(f'{k} {v}' for k, v in prov['versions'].items())}.", "",
             f"Median loaded / median quiet: {verdict}" + ("" if s["ratio"] is None else
                 f" (quiet {s['quiet_seconds']:.1f} s, loaded {s['loaded_seconds']:.1f} s)") + ".", "",
             "| repeat | condition | busy elsewhere before (cores) | free_cores() | threads train / select / export | "
             "wall (s) | stages (s) | exit |", "|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        t = r["threads"]
        stages = ", ".join(f"{k} {v:.1f}" for k, v in r["stage_seconds"].items())
        lines.append(f"| {r['repeat']} | {r['condition']} | {r['busy_elsewhere']:.2f} | {r['free_cores']} | "
                     f"{t.get('train', '?')} / {t.get('select', '?')} / {t.get('export', '?')} | "
                     f"{r['wall_seconds']:.1f} | {stages} | "
                     f"{'timed out' if r['timed_out'] else r['returncode']} |")
    lines += ["", "'busy elsewhere' and 'free_cores()' are measured from the benchmark just before the pipeline "
              "starts (train/accel.py); a quiet run with other cores busy is not a quiet reference. The threads are "
              "what each stage logged it chose."]
    busy_quiet = [r["busy_elsewhere"] for r in result["runs"] if r["condition"] == "quiet"]
    if busy_quiet and max(busy_quiet) >= 0.5:
        lines += ["", f"**Not a quiet reference**: other processes kept up to {max(busy_quiet):.1f} cores busy before a "
                      "quiet run, so the ratio says little; run it again in a quiet window."]
    if result["stopped_early"]:
        lines += ["", f"Stopped early (bound: {result['timeout_seconds']:.0f} s in all): {result['stopped_early']}."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "pipeline.yaml", help="default: the embedded pipeline.yaml")
    ap.add_argument("--device", default="local", help="device profile (default: local, as `make pipeline`)")
    ap.add_argument("--repeats", type=int, default=1, help="quiet / loaded pairs (interleaved)")
    ap.add_argument("--load-cores", type=int, default=1, help="busy processes, each on its own core (default 1)")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds the load runs before the pipeline starts")
    ap.add_argument("--timeout", type=float, default=900.0, help="bound on the whole benchmark, seconds")
    ap.add_argument("--epochs", type=int, help="train this many epochs instead of the config's (smoke test)")
    ap.add_argument("--out", help="results path without suffix (default: benchmarks/results/pipeline_under_load, "
                                  "or a temporary folder with --epochs)")
    args = ap.parse_args(argv)
    for name in ("repeats", "load_cores", "epochs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.timeout <= 0 or args.settle < 0:
        ap.error("--timeout must be positive and --settle not negative")
    if not args.config.is_file():
        ap.error(f"--config: {args.config} is not a file")
    cpus = sorted(cpu_set())
    if args.load_cores >= len(cpus):
        ap.error(f"--load-cores {args.load_cores}: this process has only {len(cpus)} cores; one must stay free")
    out = Path(args.out) if args.out else (ROOT / "benchmarks/results/pipeline_under_load" if args.epochs is None
                                           else Path(tempfile.mkdtemp(prefix="pipeline_under_load_")) / "smoke")
    pinned = cpus[-args.load_cores:] if hasattr(os, "sched_setaffinity") else [-1] * args.load_cores
    deadline = time.time() + args.timeout
    # SIGTERM (a killed job) unwinds through the finally blocks, so the load is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    runs, stopped, load = [], None, []
    with tempfile.TemporaryDirectory() as folder:
        config = config_for_run(args.config, args.epochs, folder)
        try:
            for repeat in range(args.repeats):
                for condition in ("quiet", "loaded"):
                    if condition == "loaded":
                        load = start_load(pinned, deadline)
                        time.sleep(args.settle)
                    busy = busy_elsewhere()
                    row = {"repeat": repeat, "condition": condition, "busy_elsewhere": busy,
                           "free_cores": free_cores(busy),
                           **run_pipeline(config, args.device, deadline - time.time())}
                    stop_load(load)
                    load = []
                    runs.append(row)
                    print(f"repeat {repeat} {condition}: {row['wall_seconds']:.1f} s, threads {row['threads']}, "
                          f"busy elsewhere before {busy:.2f}, exit {row['returncode']}", flush=True)
                    if row["returncode"] != 0:
                        stopped = (f"the {condition} run of repeat {repeat} "
                                   f"{'hit the time bound' if row['timed_out'] else 'failed'}")
                        print("\n".join(row["tail"]), file=sys.stderr)
                        break
                if stopped:
                    break
        finally:
            stop_load(load)
    result = {"command": ["edgebayes", "pipeline", "--config", args.config.name, "--device", args.device],
              "epochs": args.epochs, "repeats": args.repeats, "load_cores": args.load_cores,
              "load_pinned_to": pinned, "cpu_set": cpus, "settle_seconds": args.settle,
              "timeout_seconds": args.timeout, "stopped_early": stopped, "within_target": WITHIN,
              "summary": summary(runs), "runs": runs, "argv": sys.argv[1:] if argv is None else argv,
              "provenance": provenance(None)}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(result_path(out, ".json"), result)
    md = markdown(result)
    with atomic_path(result_path(out, ".md")) as tmp:
        Path(tmp).write_text(md)
    print(md)
    print(f"results: {result_path(out, '.json')}, {result_path(out, '.md')}")
    return 0 if stopped is None else 1


if __name__ == "__main__":
    sys.exit(main())
