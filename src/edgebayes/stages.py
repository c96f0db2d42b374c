"""The pipeline's stages: train -> select -> export (compress inside) -> deploy (+ benchmark) -> report.

Each stage reads the previous stage's artifacts from disk and writes its own under runs/<name>/, so any
stage can be re-run alone. A stage is skipped when its marker, `stage.json`, still tells the truth:

- the fingerprint matches: the hash of the config sections it depends on, the fingerprints of the stages
  it reads and the code it runs (stage_code: its modules and theirs), so a changed config, device or code
  re-runs exactly what depends on it (editing the report's code does not retrain);
- every output it recorded still has the recorded sha256 (an altered checkpoint or bundle re-runs the
  stage, and an altered output is removed first: it is not resumed from);
- every upstream file it read (Context.require, which also checks that file against the upstream
  marker) still has the hash it had when read (the upstream stage ran again: this one must too).

The marker is removed before a stage touches its folder and written last (Context.begin / mark_done), so
an interrupted stage has none and runs again (training resumes from its last epoch). Under one run folder
one edgebayes runs at a time (Context.lock); nothing is written outside --runs-dir (Context.stage_dir).

    runs/<name>/train/{checkpoint.pt, metrics.json}
    runs/<name>/select/<device>/{candidates.json, choice.json}
    runs/<name>/export/<device>/{export.json, bundle/}
    runs/<name>/deploy/<device>/results.json
    runs/<name>/report/<device>/{report.json, report.html, *.png}

Selection depends on the device, so its folder is per device (DESIGN.md puts it at select/; the code wins).
"""

import math
import os
import re
import shutil
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from edgebayes import STAGES
from edgebayes.config import ConfigError, as_dict, fingerprint
from edgebayes.data import data_change, describe as describe_data, inputs_parts, load_data, pixels_as_float
from edgebayes.errors import InputError, StageError
from edgebayes.ondevice.bundle import RUNNER_FILE, sha256_file
from edgebayes.ondevice.cli import command_line
from edgebayes.provenance import (code_hash, code_version, exclusive, load_checkpoint, provenance, read_json,
                                  stat_fingerprint, write_json)
from edgebayes.train import distributed
from edgebayes.train.accel import set_threads
from edgebayes.train.distributed import is_main_process

# The code each stage runs, as the roots of provenance.code_hash (every edgebayes module they import
# counts too), and its own functions here: a stage's fingerprint covers its code, so editing the report's
# code re-runs the report, not training, and an upgrade keeps the training its code would redo unchanged.
STAGE_CODE = {
    "train": ("train/families.py", "train/trainer.py", "train/sqs.py", "train/distributed.py", "data.py"),
    "select": ("deploy/selection.py",),
    "export": ("export/bundle.py", "export/formats.py", "export/onnx_export.py", "compressed/samples.py",
               "compressed/structure.py", "train/families.py"),
    "deploy": ("deploy/transport.py", "deploy/results.py", "ondevice/cli.py"),
    "report": ("deploy/report.py", "deploy/templates", "deploy/results.py"),
}
STAGE_FUNCTIONS = {"train": ("run_train", "splits_for", "load_trained_model"),
                   "select": ("run_select", "splits_for", "load_trained_model"),
                   "export": ("run_export", "splits_for", "load_trained_model"),
                   "deploy": ("run_deploy", "_deploy_on", "runner_args"),
                   "report": ("run_report", "_report_inputs")}


def stage_code(stage):
    """A hash of the code `stage` runs (STAGE_CODE, STAGE_FUNCTIONS)."""
    import hashlib
    import inspect

    own = "".join(inspect.getsource(globals()[name]) for name in STAGE_FUNCTIONS[stage])
    return code_hash(*STAGE_CODE[stage]) + hashlib.sha256(own.encode()).hexdigest()[:12]


MARKER = "stage.json"
DEVICE_STANDIN = "device"   # a local device's disk inside select/ and deploy/ (transport_for): not an output


def _digest(path):
    return sha256_file(path) if path.is_file() else None


# The temporaries edgebayes writes beside their destination (tempfile's 8 random characters: atomic_path's
# `.NAME.XXXXXXXX.tmp`, export's `.artifacts.XXXXXXXX`, the bundle's `.bundle.XXXXXXXX`): an interrupted
# run's are removed; any other dot-named file is the user's and stays.
TEMPORARY = re.compile(r"\..+\.[a-z0-9_]{8}(\.tmp)?")


def _candidate_files(folder):
    """The files of a stage folder that may be outputs: all but the marker, the device stand-in and
    dot-named ones."""
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if rel.parts[0] in (MARKER, DEVICE_STANDIN) or any(p.startswith(".") for p in rel.parts):
            continue
        if path.is_file():
            yield rel.as_posix(), path


def _stat(path):
    st = path.stat()
    return st.st_ino, st.st_mtime_ns, st.st_size


def _files(folder, before=None, recorded=()):
    """{path relative to folder: sha256} of a stage's outputs: every candidate file (`_candidate_files`),
    or with `before` (what the folder held before the stage ran) only those the stage wrote or that its
    last marker recorded: a file the user put there is never recorded, so never removed as an output."""
    return {rel: sha256_file(path) for rel, path in _candidate_files(folder)
            if before is None or rel in recorded or before.get(rel) != _stat(path)}


@dataclass
class Context:
    cfg: object
    profile: object
    runs_dir: Path = Path("runs")
    force: bool = False
    log: object = print
    config_path: str = "pipeline.yaml"   # named in error messages
    device_arg: str = "local"            # --device as given (a relaunch under torchrun passes it on)
    settings: tuple = ()                 # --set section.key=value over the config file (already in cfg)
    program: str = "edgebayes"           # the command the user ran (.venv/bin/edgebayes): hints repeat it
    stdout_is_json: bool = False         # --json: stdout holds the summary alone (logs go to stderr)
    # upstream files the running stage read (require): {path under run_dir: sha256}, written to its marker
    reads: dict = field(default_factory=dict, repr=False)
    # what the running stage's folder held before it ran: {path: (inode, mtime, size)}, and the outputs its
    # last marker recorded; mark_done records as outputs only those and what the stage wrote (owned)
    found_before: dict = field(default=None, repr=False)
    recorded_before: set = field(default_factory=set, repr=False)
    # the latency table's stat fingerprint as select read it (pin_latency_table), or None: as it is now
    _pinned_table: list = field(default=None, init=False, repr=False)
    # the outside parts as a marker recorded them, while _what_changed recomputes its fingerprint with them
    _as_recorded: dict = field(default_factory=dict, init=False, repr=False)
    # what check_train's pre-flight found for run.json (train_preflight), or None: run_train runs it
    train_preflight: dict = field(default=None, init=False, repr=False)
    # data.inputs_parts as this command found them, computed once (_inputs): every stage's fingerprint chains to
    # train's, and a folder of 50,000 images was walked 21 times a pipeline (probe)
    _inputs_found: dict = field(default=None, init=False, repr=False)

    @property
    def run_dir(self):
        return self.runs_dir / self.cfg.name

    def _inside(self, path):
        """`path`, once it resolves inside --runs-dir: config.py validates the names, and a symlinked folder
        pointing elsewhere is refused here, before anything is written or removed."""
        root = self.runs_dir.resolve()
        if not path.resolve().is_relative_to(root):
            raise StageError(f"{path} resolves to {path.resolve()}, outside --runs-dir {root}; refusing to write there")
        return path

    def stage_dir(self, stage):
        return self._inside(self.run_dir / "train" if stage == "train" else self.run_dir / stage / self.profile.name)

    def fingerprint(self, stage):
        c, p = self.cfg, self.profile
        if stage == "train":
            from edgebayes.train.families import family_of

            # A family's own section counts for it only: other families' fingerprints stay as they were.
            section = family_of(c).section
            own = [getattr(c, section)] if section else []
            # What data.path, the weight files (model.pretrained; SQS's sqs.checkpoint) and the user's own net or
            # loader hold now counts where they are set: a file replaced under the same name is another network
            contents = list(self._inputs().values())
            if c.train.flops_target == "device":   # the target comes from the device's budgets (run_train)
                contents.append(["device", p.name, as_dict(p.budgets), as_dict(p.latency_model), as_dict(p.runtime),
                                 *self._latency_table()])
            return fingerprint("train", stage_code("train"), c.seed, c.data, c.model, c.prior, c.train, *own,
                               *contents)
        if stage == "select":   # its predictions (the verdict on a device out of reach) come from the table
            return fingerprint("select", stage_code("select"), self.fingerprint("train"), c.select, c.export, p,
                               *self._latency_table())
        if stage == "export":
            return fingerprint("export", stage_code("export"), self.fingerprint("select"), c.export)
        if stage == "deploy":
            return fingerprint("deploy", stage_code("deploy"), self.fingerprint("export"), c.benchmark, p)
        return fingerprint("report", stage_code("report"), self.fingerprint("deploy"))

    def _latency_table(self):
        """[what the device's latency table holds] where one is read (deploy/latency_model.table_path: outside
        the run folder, re-written by `edgebayes devices profile`), else []: as select read it once it has
        (pin_latency_table), else as it is now."""
        from edgebayes.deploy.latency_model import table_path

        if "latency_table" in self._as_recorded:
            return self._as_recorded["latency_table"]
        if self._pinned_table is not None:
            return self._pinned_table
        if self.profile.latency_model.kind == "flops":
            return []
        table = table_path(self.profile, self.runs_dir)
        return [stat_fingerprint(table)] if table.is_file() else []

    def pin_latency_table(self):
        """Called by select before it reads the table, and again after it profiled the device itself: the
        fingerprints of this process (select's marker among them) then name that table. A `devices profile`
        writing it meanwhile made the marker name the new table, and select 'up to date' on predictions of
        the old one (probe); pinned, the next run sees the change and selects again."""
        self._pinned_table = None
        self._pinned_table = self._latency_table()

    def _marker(self, stage):
        return _read_marker(self.stage_dir(stage))

    def staleness(self, stage):
        """None when the stage's artifacts can be reused as they are; else why the stage must run."""
        if self.force:
            return "--force"
        folder = self.stage_dir(stage)
        done = self._marker(stage)
        if done is None:
            return f"no valid {MARKER}: never run, interrupted, or from older code" if (folder / MARKER).exists() \
                else "no finished run: never run, interrupted or failed"
        if done.get("fingerprint") != self.fingerprint(stage):
            return self._what_changed(stage, done)
        for rel, digest in done["outputs"].items():
            if _digest(folder / rel) != digest:
                return f"its output {rel} changed since the stage wrote it"
        return self.changed_input(done)

    def changed_input(self, done):
        """Why a finished stage's inputs are no longer what it read (an earlier stage ran again), or None."""
        for rel, digest in (done.get("inputs") or {}).items():
            if _digest(self.run_dir / rel) != digest:
                return f"its input {rel} changed since it was read"
        return None

    def is_fresh(self, stage):
        return self.staleness(stage) is None

    def begin(self, stage):
        """Before a stage touches its folder: remove its marker (so an interruption leaves none), outputs
        that differ from what the marker recorded (never resume from an altered checkpoint) and the
        dot-named temporaries an interrupted run left behind (the run lock makes them nobody's)."""
        folder = self.stage_dir(stage)
        self.reads, self.found_before, self.recorded_before = {}, {}, set()
        if not folder.is_dir():
            return
        done = self._marker(stage)
        for rel, digest in (done["outputs"] if done else {}).items():
            path = folder / rel  # a marker is a file like any other: its names must not lead out of the folder
            if path.resolve().is_relative_to(folder.resolve()) and path.is_file() and _digest(path) != digest:
                path.unlink()
        (folder / MARKER).unlink(missing_ok=True)
        for entry in folder.glob(".*"):
            if TEMPORARY.fullmatch(entry.name):
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        self.found_before = {rel: _stat(path) for rel, path in _candidate_files(folder)}
        self.recorded_before = set(done["outputs"]) if done else set()

    def withdraw_report(self, every_device=False, written=None):
        """A stage before the report runs again for this device (`every_device`: train, whose folder every
        device's stages build on): the report of the earlier run (another budget, profile or bundle) no longer
        describes what the stages hold, and a run that now fails (exit 1) must not leave report.html saying
        `pass`. Its page and marker go, its JSON is renamed report.withdrawn.json (deleted when the next report
        is written: Context.replace_withdrawn). `written`: this device's report outputs, where its marker is gone
        already (a report that ran and failed: run_stage)."""
        mine = self.stage_dir("report")
        reports = self._inside(self.run_dir / "report")
        folders = sorted(self._inside(p) for p in reports.iterdir() if p.is_dir()) if every_device and reports.is_dir() \
            else [mine]
        for folder in folders:
            # the plots it wrote go too (a withdrawn report's PNGs were left beside its JSON); a user's files stay
            outputs = written if written is not None and folder == mine else (_read_marker(folder) or {}).get("outputs", {})
            for name in [*outputs, MARKER, "report.html"]:
                path = folder / name
                if name != "report.json" and path.resolve().is_relative_to(folder.resolve()) and path.is_file():
                    path.unlink()
            # kept apart for `report --devices`, which shows it marked stale (cli._report_extras), not an error
            if (folder / "report.json").is_file():
                (folder / "report.json").replace(folder / "report.withdrawn.json")

    def replace_withdrawn(self):
        """A report was written: the withdrawn one it replaces goes (after, so a failed report keeps it)."""
        (self.stage_dir("report") / "report.withdrawn.json").unlink(missing_ok=True)

    def mark_done(self, stage):
        """Written last: the fingerprint, the code version, the hash of every output and every input read."""
        write_json(self.stage_dir(stage) / MARKER, {
            "stage": stage, "fingerprint": self.fingerprint(stage), "code_version": code_version(),
            "outputs": _files(self.stage_dir(stage), self.found_before, self.recorded_before),
            "inputs": dict(sorted(self.reads.items())),
            # what the fingerprint counts from outside the config and code: staleness names it when it moved
            "outside": self._outside_parts()})

    def _outside_parts(self):
        """What a stage's fingerprint counts that lives outside the config and the code: the files the training
        reads (_inputs) and the device's latency table (written by `devices profile`)."""
        return {"inputs": self._inputs(), "latency_table": self._latency_table()}

    def _inputs(self):
        """{what: its fingerprint} of the files the training reads (data.inputs_parts: data.path, weight files,
        the user's own code); inside _what_changed, as the marker being judged recorded them. Read once per
        command: a stage's marker then names what the files held when the command began, before the stage read
        them (a file replaced during a training makes the next run train again, not call the run current)."""
        if self._inputs_found is None:
            self._inputs_found = inputs_parts(self.cfg, weight_files(self.cfg))
        inputs = dict(self._inputs_found)
        inputs.update(self._as_recorded.get("inputs", {}))
        return {k: v for k, v in inputs.items() if k not in self._as_recorded.get("added", ())}

    def _what_changed(self, stage, done):
        """Why a stage whose fingerprint differs from its marker's must run: the outside files that moved, where
        the fingerprint with them as recorded is the marker's, else the config, profile or code. A changed
        data folder or table read "config, device profile or code changed", which none had (probe)."""
        # a marker is a file like any other: one edited by hand gets the plain reason, not a traceback
        recorded = done.get("outside") if isinstance(done.get("outside"), dict) else {}
        was = recorded.get("inputs") if isinstance(recorded.get("inputs"), dict) else {}
        now = self._outside_parts()
        moved = [k for k, v in was.items() if now["inputs"].get(k) != v]
        added = [k for k in now["inputs"] if k not in was]
        # the table counts for every stage after train, and for train only with its target from the device
        counted = stage != "train" or self.cfg.train.flops_target == "device"
        table = counted and "latency_table" in recorded and recorded["latency_table"] != now["latency_table"]
        if recorded and (moved or added or table):
            self._as_recorded = {"inputs": was, "added": added,
                                 **({"latency_table": recorded["latency_table"]} if table else {})}
            try:
                explained = self.fingerprint(stage) == done.get("fingerprint")
            finally:
                self._as_recorded = {}
            if explained:
                from edgebayes.deploy.latency_model import table_path

                detail = {k: f" ({change})" for k in moved if (change := data_change(was[k], now["inputs"][k]))}
                said = [f"what {k} holds{detail.get(k, '')}" for k in moved + added] + (
                    [f"the device's latency table {table_path(self.profile, self.runs_dir)} (`devices profile` "
                     f"wrote it again, or it was moved)"] if table else [])
                return f"{' and '.join(said)} changed since the stage ran"
        return "config, device profile or code changed"

    def provenance(self, stage):
        return provenance(self.fingerprint(stage))

    def require(self, stage, *files):
        """The folder of an upstream stage, once each file (or folder) in it is what that stage wrote: the
        stage finished (its marker exists) and recorded the same sha256. The hashes become inputs of the
        running stage, so that it runs again when the upstream stage does."""
        folder = self.stage_dir(stage)
        again = f"run `{self.command(stage)}` (or the same with `pipeline`)"
        for f in files:
            path = folder / f
            if not path.exists():
                raise StageError(f"{path} is missing: {again} first")
            done = self._marker(stage)
            if done is None:
                raise StageError(f"{folder / MARKER} is missing or unreadable: the {stage} stage did not finish; "
                                 f"{again}")
            prefix = "" if path.is_file() else f"{Path(f).as_posix()}/"
            names = {f} if path.is_file() else {k for k in done["outputs"] if k.startswith(prefix)} | {
                p.relative_to(folder).as_posix() for p in path.rglob("*") if p.is_file()}
            for rel in sorted(names):
                digest = _digest(folder / rel)
                if digest is None or digest != done["outputs"].get(rel):
                    raise StageError(f"{folder / rel} is not what the {stage} stage wrote (changed since, or "
                                     f"left by an interrupted run); {again}: it notices and runs again")
                self.reads[(folder / rel).relative_to(self.run_dir).as_posix()] = digest
        return folder

    @contextmanager
    def lock(self):
        """Hold the run folder for this process: a second edgebayes on the same run fails at once, naming
        this one's pid (two pipelines interleaving select and export deployed one choice and reported
        another). Processes started by torchrun for the train stage run under their launcher's lock."""
        if distributed.launched():
            yield
            return
        self._inside(self.run_dir).mkdir(parents=True, exist_ok=True)
        with exclusive(self.run_dir / ".lock", self.run_dir):
            yield

    def command(self, stage, *extra):
        """The command line that runs `stage` for this run's config and device; hints print it whole,
        since a stage run without --device runs for `local`."""
        import shlex

        runs = [] if str(self.runs_dir) == "runs" else ["--runs-dir", str(self.runs_dir)]
        return shlex.join([*shlex.split(self.program), stage, "--config", str(self.config_path), "--device", str(self.device_arg),
                           *self.devices_dir_args(), *runs, *self.set_args(), *extra])

    def devices_dir_args(self):
        """--devices-dir of this run, for a command that must find the same device profile (a profile found
        there only would otherwise be 'unknown device' when the printed command is run)."""
        from edgebayes import config

        return ["--devices-dir", str(config.USER_DEVICES_DIR)] if config.USER_DEVICES_DIR else []

    def set_args(self):
        """The --set options of this run, for a command that must run the same config."""
        return [a for s in self.settings for a in ("--set", s)]


_splits_cache = {}


def splits_for(ctx):
    key = fingerprint(ctx.cfg.data, ctx.cfg.seed)
    if key not in _splits_cache:
        _splits_cache[key] = load_data(ctx.cfg.data, ctx.cfg.seed)
    return _splits_cache[key]


def load_trained_model(ctx):
    from edgebayes.train.families import build

    out = ctx.require("train", "checkpoint.pt")
    model = build(ctx.cfg, splits_for(ctx))
    state = load_checkpoint(out / "checkpoint.pt")
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:   # the net the config builds now is not the one trained (its code was edited)
        lines = str(e).splitlines()   # torch's: a heading, then one line per mismatch
        raise StageError(f"train: {out / 'checkpoint.pt'} holds another network than model.arch builds now "
                         f"({lines[1].strip() if len(lines) > 1 else e}); "
                         f"run `{ctx.program} train --force`") from None
    return model.eval()


# ---------------------------------------------------------------------------------------------
def _has_inclusion(model):
    return any(hasattr(mod, "sample_inclusion") for mod in model.modules())


def _json_or_empty(path):
    """The JSON mapping at `path`, or {} where there is none (absent, unreadable, not a mapping)."""
    try:
        data = read_json(path)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _read_marker(folder):
    """The marker of the stage folder `folder`, or None when it is absent or unreadable (an interrupted write
    cannot leave half a marker, but a user can)."""
    done = _json_or_empty(folder / MARKER)
    return done if isinstance(done.get("outputs"), dict) else None


def resolved_device_target(ctx, cfg, out):
    """cfg with train.flops_target `device` replaced by the share run_train found for this run (run.json)."""
    try:
        target = read_json(out / "run.json")["device_flops_target"]
    except (OSError, ValueError, KeyError, TypeError):
        target = "missing"
    # model_copy does not validate: a run.json edited by hand must not reach the schedule as it is
    if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float))
                               or not 0 < target <= 1):
        raise StageError(f"train: {out / 'run.json'} does not hold the FLOPs target found for train.flops_target "
                         f"device (a share in (0, 1] or null); run `{ctx.program} train --force`")
    # the device's channel block counts in the target's last cut: the network shipped there is within it
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={
        "flops_target": target, "flops_channel_multiple": ctx.profile.runtime.channel_block})})


def check_train(ctx):
    """What train refuses as bad input, checked before run_stage touches the run (a bad model.pretrained, or
    train.device cuda on a machine without one, deleted the finished run of the same name, then exited 2:
    probe): the data, the weight files (model.pretrained; sqs.checkpoint), the training device and, for a run
    that starts (no checkpoint of this config to resume), the pre-flight (the network builds, exports and
    its FLOPs target is reachable: train_preflight). Under torchrun process 0 alone runs the pre-flight."""
    from edgebayes.train import distributed
    from edgebayes.train.bayesianize import read_state_dict
    from edgebayes.train.trainer import resolve_device

    cfg, ctx.train_preflight = ctx.cfg, None
    splits = splits_for(ctx)
    for key, path in weight_files(cfg):
        if key == "sqs.checkpoint":   # every tensor, shapes too: SQS takes it as it is (it reads the file itself)
            from edgebayes.train import sqs

            sqs.load_checkpoint(sqs.build_base(cfg, splits), path, cfg.model.arch)
        else:
            read_state_dict(path, key=key)
    try:
        resolve_device(cfg.train.device)
    except ConfigError as e:
        raise ConfigError(f"{ctx.config_path}: {e}") from None
    # (several processes: the parent checks before it launches torchrun, whose process 0 checks again)
    if distributed.is_main_process() and not _resumes(ctx):
        ctx.train_preflight = train_preflight(ctx)


def weight_files(cfg):
    """[(config key, path)] of the weight files a training starts from: model.pretrained, and the family's own
    checkpoint (SQS's sqs.checkpoint), where set."""
    from edgebayes.train.families import family_of

    section = family_of(cfg).section
    own = getattr(getattr(cfg, section), "checkpoint", None) if section else None
    return [(key, path) for key, path in (("model.pretrained", cfg.model.pretrained), (f"{section}.checkpoint", own))
            if path]


def _earlier_run(ctx):
    """(train/run.json as the last run wrote it, or {}; whether it is of this config: its checkpoint resumes)."""
    earlier = _json_or_empty(ctx.stage_dir("train") / "run.json")
    return earlier, earlier.get("fingerprint") == ctx.fingerprint("train")


def _resumes(ctx):
    """Whether train will resume a checkpoint (one of this config, no --force): no pre-flight then."""
    return (ctx.stage_dir("train") / "checkpoint.pt").exists() and _earlier_run(ctx)[1] and not ctx.force


def train_preflight(ctx):
    """The pre-flight of a training that starts (export/preflight.py: fail in seconds, not after training) and
    the FLOPs target of train.flops_target device: {"device_flops_target": share or None} for run.json where
    that is set, else {}."""
    from edgebayes.deploy.budget_targets import budget_shares, device_flops_target, latency_unjudged, target_advice
    from edgebayes.export.preflight import preflight
    from edgebayes.train.families import build

    cfg, splits = ctx.cfg, splits_for(ctx)
    model = build(cfg, splits)   # untrained: the pre-flight's exports and the target's reach read it
    facts = preflight(cfg, ctx.profile, splits, model, ctx.log)
    shares = None if facts is None else budget_shares(cfg, ctx.profile, facts, ctx.runs_dir)
    if cfg.train.flops_target != "device":   # said; with device, they are the target
        for share, where in (shares or {}).values():
            if advice := target_advice(cfg, where, share):
                ctx.log(f"train: pre-flight: {advice}")
        _check_reachable(ctx, model, cfg.train.flops_target)
        return {}
    target = device_flops_target(shares, ctx.profile)
    _check_reachable(ctx, model, target)
    unjudged = latency_unjudged(cfg, ctx.profile, facts, ctx.runs_dir)
    ctx.log(f"train: flops target from {ctx.profile.name}'s budgets: "
            + (f"{target:g} ({'; '.join(where for _, where in shares.values())})" if target is not None
               else "none (the dense network fits them)" if unjudged is None
               else "none (the dense network fits those judged here)")
            + (f"; {unjudged}" if unjudged else ""))
    return {"device_flops_target": target}


def _check_reachable(ctx, model, target):
    """A spike-and-slab FLOPs target below the smallest network the architecture allows, refused here (bad input,
    exit 2) before run_train sets the last run aside: its schedule found it at the first step, after the finished
    run of the same name had been deleted (probe). Structure only: `model` is the pre-flight's untrained net."""
    import torch

    from edgebayes.config import SPIKE_SLAB_FAMILIES
    from edgebayes.train.flops_target import FlopsTargetSchedule

    if target is None or ctx.cfg.model.family not in SPIKE_SLAB_FAMILIES:
        return
    try:
        with torch.random.fork_rng(devices=[]):   # the training's own draws stay as they were
            FlopsTargetSchedule(model, ctx.cfg.train.model_copy(update={"flops_target": target}), 1,
                                log=lambda *_: None)
    except ConfigError as e:
        raise ConfigError(f"{ctx.config_path}: {e}") from None


def run_train(ctx):
    from edgebayes.compressed.samples import EmptyLayerError
    from edgebayes.compressed.structure import structure_report
    from edgebayes.train.metrics import ood_scores, reliability_bins
    from edgebayes.train import distributed
    from edgebayes.train.families import family_of
    from edgebayes.train.trainer import evaluate, posterior_mean_metrics

    cfg, splits = ctx.cfg, splits_for(ctx)  # first: bad data must fail before anything is touched
    if stray := distributed.stray_launch_variables():
        ctx.log(f"train: {', '.join(stray)} set in the environment, but torchrun did not start this process: "
                f"ignored (train.processes says how many processes train)")
    if cfg.train.processes > 1 and not distributed.launched():
        # Several processes: this stage runs again under torchrun (train/distributed.py); process 0 there
        # writes everything this stage writes.
        ctx.log(f"train: {cfg.train.processes} processes (DDP) under torchrun")
        args = ["train", "--config", str(ctx.config_path), "--device", ctx.device_arg, *ctx.devices_dir_args(),
                "--runs-dir", str(ctx.runs_dir), *ctx.set_args()] + (["--force"] if ctx.force else [])
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if cfg.train.device == "cpu" and cfg.train.processes > cores:
            ctx.log(f"train: {cfg.train.processes} processes on {cores} CPU cores: each waits for the cores the "
                    f"others hold, slower than one process (8 on 2 cores took 9x the time per epoch: probe)")
        code = distributed.launch(args, cfg.train.processes, stdout=2 if ctx.stdout_is_json else None)   # fd 2: stderr
        if code == 2:   # the CLI's bad input: the processes said what they refused; the same exit as one process's
            raise InputError(f"train: the {cfg.train.processes} training processes refused their input (their "
                             f"messages are above)")
        if code != 0:
            raise StageError(f"train: the {cfg.train.processes} training processes failed (exit code {code}); "
                             f"their messages are above")
        return
    out = ctx.stage_dir("train")
    checkpoint = out / "checkpoint.pt"
    if distributed.is_main_process():  # the other processes wait for this in train()
        # A checkpoint of another config must not be resumed: start over.
        marker = out / "run.json"
        earlier, same_run = _earlier_run(ctx)
        if checkpoint.exists() and (ctx.force or not same_run):
            ctx.log(f"train: starting over: {checkpoint} is " + ("not resumed with --force" if ctx.force else
                    "of another config, data or code (its run.json differs), so it is not resumed"))
            checkpoint.unlink()
        # a resumed run keeps the FLOPs target its pre-flight found (train.flops_target device)
        kept = {"device_flops_target": earlier["device_flops_target"]} if (
            checkpoint.exists() and "device_flops_target" in earlier) else {}
        write_json(marker, {"fingerprint": ctx.fingerprint("train"), **kept})

    if distributed.is_main_process() and not checkpoint.exists():   # run_stage's check_train ran its pre-flight
        found = ctx.train_preflight if ctx.train_preflight is not None else train_preflight(ctx)
        write_json(out / "run.json", {"fingerprint": ctx.fingerprint("train"), **found})
    if cfg.train.flops_target == "device":   # the target run.json recorded for this run (a resumed one too)
        cfg = resolved_device_target(ctx, cfg, out)
    family = family_of(cfg)
    try:
        model, history = family.fit(cfg, splits, checkpoint, ctx.log)
    except ConfigError as e:   # what only the network tells (a FLOPs target out of its reach): name the file
        if str(e).startswith(str(ctx.config_path)):
            raise
        raise ConfigError(f"{ctx.config_path}: {e}") from None
    if ctx.cfg.train.flops_target == "device" and history and history[-1].get("flops_target_verdict"):
        ctx.log(f"train: {ctx.profile.name}'s budgets need {cfg.train.flops_target:g} of the FLOPs and "
                f"train.max_accuracy_drop allows less: the budgets and the floor are not both met by this "
                f"fine-tuning; more epochs, looser budgets or a larger drop")
    if not distributed.is_main_process():
        return
    # Done means the checkpoint on disk holds every configured epoch: it is what select and export load.
    epochs = load_checkpoint(checkpoint)["epoch"]
    if epochs != cfg.train.epochs:
        raise StageError(f"train: {checkpoint} holds {epochs} epochs, train.epochs is {cfg.train.epochs}; "
                         f"run `edgebayes train --force`")
    knob_value, m = model.default_knob, cfg.train.mc_samples_eval
    ctx.log(f"train: scoring the trained network on {len(splits.test_x)} test inputs x {m} posterior samples"
            + (f" (and {len(splits.ood_x)} OOD inputs)" if splits.ood_x is not None else ""))
    # Paper 000's accuracy: z ~ q(z) in each of the m samples (export deploys the thresholded net instead).
    posterior_mean = (posterior_mean_metrics(model, splits.test_x, splits.test_y, m, cfg.seed)
                      if _has_inclusion(model) else None)
    try:
        test, compressed, probs = evaluate(model, splits.test_x, splits.test_y, knob_value, m, cfg.seed)
    except EmptyLayerError as e:
        if posterior_mean is None:   # SQS at a rate that takes a whole layer's weights: no network at its target
            own = f"{family.section}.{model.knob}" if family.section else model.knob
            raise StageError(f"train: {e} ({own}, the rate this training pruned to: its checkpoint is kept, but no "
                             f"network at this rate can be deployed)") from None
        # The inclusion probabilities of a layer fall together and may all sit below 0.5 (trainer docstring,
        # issue 20); the training is kept and reported, there is just no median model to deploy.
        write_json(out / "metrics.json", {
            "family": cfg.model.family, "epochs": cfg.train.epochs, "median_model_empty": str(e),
            "test_posterior_mean": {**posterior_mean, "mc_samples": m}, "history": history,
            "provenance": ctx.provenance("train")})
        inclusion = history[-1].get("mean_inclusion") if history else None
        ctx.log(f"train: WARNING {e}: the median model is empty (mean inclusion per layer {inclusion}); "
                f"with z ~ q(z) the net has test accuracy {posterior_mean['accuracy']:.4f}. Training longer did not "
                f"split the layer in the runs measured so far; set train.kl_warmup_ordered: true with "
                f"train.kl_warmup_epochs and train.inclusion_lr (as configs/mnist-lenet5-ss*.yaml do; README, "
                f"issue 20)")
        return
    structure = structure_report(compressed.dense_sample, compressed.samples[0], compressed.kept,
                                 splits.input_shape)
    metrics = {
        "family": cfg.model.family,
        "model": {"arch": cfg.model.arch, "in_features": int(np.prod(splits.input_shape)),
                  "hidden": cfg.model.hidden if cfg.model.arch == "mlp" else [], "classes": len(splits.classes)},
        "data": {"dataset": cfg.data.dataset, "train": len(splits.train_x), "val": len(splits.val_x),
                 "test": len(splits.test_x), **describe_data(cfg.data, splits.input_shape)},
        "epochs": cfg.train.epochs,
        # the FLOPs target trained to (train.flops_target device: the share the device's budgets allowed)
        "flops_target": cfg.train.flops_target,
        "flops_target_from": "device" if ctx.cfg.train.flops_target == "device" else "config",
        "test": {**test, "mc_samples": m, "knob": model.knob, "knob_value": knob_value},
        "test_posterior_mean": None if posterior_mean is None else {**posterior_mean, "mc_samples": m},
        "reliability": reliability_bins(probs, splits.test_y.numpy()),
        "sparsity": {"layers": structure["layers"]},
        **{k: structure[k] for k in ("compression_ratio", "flops_ratio", "physical_compression_ratio",
                                     "physical_flops_ratio", "dense_weights", "kept_weights",
                                     "dense_flops", "pruned_flops")},
        "history": history,
        "provenance": ctx.provenance("train"),
    }
    if family.summary is not None:  # the family's own figures (SQS: against full precision, file bytes)
        metrics[family.name] = family.summary(model, splits, out, knob_value, test, ctx.log)
    if splits.ood_x is not None:
        from edgebayes.compressed.samples import predict
        ood_probs = predict(compressed.mc_model(), splits.ood_x).numpy()
        metrics["ood"] = {"set": cfg.data.ood, **ood_scores(probs, ood_probs)}
    write_json(out / "metrics.json", metrics)
    ctx.log(f"train: test accuracy {test['accuracy']:.4f}, NLL {test['nll']:.4f}, ECE {test['ece']:.4f}; "
            f"kept nodes {[l['kept'] for l in structure['layers']]}; compression {structure['compression_ratio']:.3f}, "
            f"FLOPs ratio {structure['flops_ratio']:.3f} (after surgery {structure['physical_flops_ratio']:.3f})")


def run_select(ctx):
    from edgebayes.deploy.selection import choose, score_candidates
    from edgebayes.deploy.transport import transport_for

    model, splits = load_trained_model(ctx), splits_for(ctx)
    out = ctx.stage_dir("select")
    transport = transport_for(ctx.profile, out / "device")
    calib_x = pixels_as_float(splits.train_x[: ctx.cfg.export.calibration_size])
    ctx.pin_latency_table()   # before the table is read: the marker must name the table select used
    candidates, measured_on, evidence = score_candidates(model, ctx.cfg, ctx.profile, splits.val_x, splits.val_y,
                                                         calib_x, transport, ctx.runs_dir, log=ctx.log,
                                                         table_read=ctx.pin_latency_table)
    s = ctx.cfg.select
    common = {"device": ctx.profile.name, "budgets": as_dict(ctx.profile.budgets), "objective": s.objective,
              "max_ece": s.max_ece, "latency_measured_on": measured_on, "provenance": ctx.provenance("select")}
    choice = choose(candidates, s.objective, ctx.profile.budgets, s.max_ece, evidence, ctx.cfg.seed)
    write_json(out / "candidates.json", {**common, "candidates": candidates,
                                         "pareto": [c["id"] for c in candidates if c["pareto"]]})
    write_json(out / "choice.json", {**common, **choice})
    c = choice["candidate"]
    if not choice["fits"]:
        ctx.log(f"select: {choice['reason']}")
        return
    predicted = c["cost"]["predicted_latency_ms"]
    from edgebayes.deploy.report import fmt_ms
    from edgebayes.deploy.summary import latency_basis, point_label

    measured = c["cost"]["measured_latency_ms"] is not None
    ctx.log(f"select: {point_label(choice['knob'], choice['knob_value'])}, M={choice['mc_samples']}, {choice['precision']} "
            f"(val accuracy {c['val']['accuracy']:.4f}, p{ctx.profile.budgets.percentile} latency "
            + (f"{fmt_ms(c['cost']['latency_ms'], True)} measured" if measured else "")
            + (", " if measured and predicted is not None else "")
            + (f"{fmt_ms(predicted, True)} {latency_basis(c['cost'])}".replace("µs", "us") if predicted is not None else "")
            + f", memory {'>= ' if c['cost']['memory_estimate_lower_bound'] else ''}"
              f"{c['cost']['memory_estimate_mb']:.2f} MB of its own estimated); {choice['reason']}")


def run_export(ctx):
    import tempfile

    from edgebayes.compressed.samples import NOT_FITTED, compress, fp32_agreement, predict
    from edgebayes.compressed.structure import count_weights, structure_report
    from edgebayes.export.bundle import write_bundle
    from edgebayes.export.formats import FORMATS, artifact_predict, check_fidelity, export_artifact, fidelity
    from edgebayes.export.onnx_export import onnx_parameter_count
    from edgebayes.train.families import family_of
    from edgebayes.train.metrics import classification_metrics, ood_scores

    choice = read_json(ctx.require("select", "choice.json") / "choice.json")
    model, splits = load_trained_model(ctx), splits_for(ctx)
    e = ctx.cfg.export
    knob_value, m = choice["knob_value"], choice["mc_samples"]
    compressed = compress(model, knob_value, m, ctx.cfg.seed, ctx.profile.runtime.channel_block)
    if compressed.not_pruned:
        ctx.log(f"export: WARNING {compressed.not_pruned}")
    if ctx.cfg.select.temperature_scaling:   # as select fitted it for this candidate: the same data, the same T
        t = compressed.calibrate(splits.val_x, splits.val_y)
        ctx.log(f"export: temperature {t:.3f} (fitted on {len(splits.val_x)} validation examples; "
                f"select.temperature_scaling)" if t != 1.0 else f"export: temperature 1, not fitted: {NOT_FITTED}")
    mc_model = compressed.mc_model()
    x, y = splits.test_x, splits.test_y.numpy()
    reference_probs = predict(mc_model, x).numpy()
    reference_metrics = classification_metrics(reference_probs, y)
    before_temperature = None
    if compressed.temperature != 1.0:
        # What the fitted T changed, both sides in PyTorch fp32 (the same M samples at T = 1 and at T): the
        # shipped artifact's own figures also carry its precision's change (an int8 graph's), not T's alone.
        untempered = replace(compressed, temperature=1.0).mc_model()
        probs_t1 = predict(untempered, x).numpy()
        before_temperature = classification_metrics(probs_t1, y)
        before_temperature["at_fitted_t"] = dict(reference_metrics)
        if splits.ood_x is not None:
            before_temperature["ood"] = ood_scores(probs_t1, predict(untempered, splits.ood_x).numpy())
            before_temperature["at_fitted_t"]["ood"] = ood_scores(reference_probs, predict(mc_model, splits.ood_x).numpy())
    calib_x = pixels_as_float(splits.train_x[: e.calibration_size])  # the first rows of the (seeded) training split
    # The chosen format is the primary artifact (the one deploy must run); export.formats adds others
    # beside it, for the report's fidelity and latency comparison.
    formats = [choice["format"], *(f for f in e.formats if f != choice["format"])]
    out = ctx.stage_dir("export")
    out.mkdir(parents=True, exist_ok=True)
    artifacts, failed = {}, []
    with tempfile.TemporaryDirectory(dir=out, prefix=".artifacts.") as tmp:
        for fmt in formats:
            f = FORMATS[fmt]
            path = Path(tmp) / f"{fmt}{f.suffix}"
            facts = {}
            export_artifact(mc_model, fmt, path, x[:16], calib_x, e.opset, layout=e.layout, details=facts)
            if "packed_refused" in facts:
                ctx.log(f"export: {fmt}: {facts['packed_refused']}")
            if facts.get("float_layers"):
                ctx.log(f"export: {fmt}: {len(facts['float_layers'])} packed Linear layer(s) on tokens stay fp32 "
                        f"(onnxruntime's int8 MatMul takes 2-D weights); export.layout: unrolled quantizes them, at "
                        f"M passes per layer")
            # TensorRT engines are built on the target: here the shipped ONNX is checked with onnxruntime.
            probs = artifact_predict(path, "onnx" if f.runtime == "tensorrt" else fmt, x.numpy())
            line = fidelity(probs, reference_probs, y)
            precision = "fp32" if fmt == "tensorrt-fp16" else f.precision
            if precision == "fp32" and line["max_abs_prob_diff"] > e.fidelity_tolerance:
                line["float64"] = fp32_agreement(probs, reference_probs, mc_model, x, e.fidelity_tolerance)
            line["check"] = check_fidelity(line, precision, e.fidelity_tolerance, e.max_accuracy_drop)
            if f.runtime == "tensorrt":
                line["measured_with"] = "onnxruntime on the shipped ONNX; the engine's own figures come from the device"
            artifacts[fmt] = {"path": path, **facts, "format": f.bundle_format, "bytes": path.stat().st_size,
                              "fidelity": line}
            ctx.log(f"export: {fmt} ({facts['layout']}{'; ' + line['measured_with'] if 'measured_with' in line else ''}): accuracy {line['accuracy']:.4f} (PyTorch {line['reference']['accuracy']:.4f}), "
                    f"NLL {line['nll']:.4f}, ECE {line['ece']:.4f}, max |p - p_torch| {line['max_abs_prob_diff']:.2e}: "
                    f"{'ok' if line['check']['passed'] else 'FAILED'} ({line['check']['rule']})")
            if not line["check"]["passed"]:
                failed.append(f"{fmt} ({line['check']['rule']}: accuracy {line['accuracy']:.4f}, "
                              f"max |p - p_torch| {line['max_abs_prob_diff']:.2e})")
        if failed:
            raise StageError(f"export: artifact fidelity out of tolerance: {'; '.join(failed)}; "
                             f"the bundle was not written")
        primary = artifacts[formats[0]]
        onnx_params = onnx_parameter_count(artifacts["onnx"]["path"]) if "onnx" in artifacts else None
        manifest = write_bundle(
            out / "bundle", primary["path"], x.numpy(), y, reference_probs, classes=splits.classes, mc_samples=m,
            knob_name=model.knob, knob_value=knob_value,
            reference_metrics=reference_metrics, provenance=ctx.provenance("export"),
            data=describe_data(ctx.cfg.data, splits.input_shape), artifacts=artifacts,
            ood_x=None if splits.ood_x is None else splits.ood_x.numpy())
    kept_per_sample = count_weights(compressed.samples[0], fold_batch_norm=True)
    structure = structure_report(compressed.dense_sample, compressed.samples[0], compressed.kept,
                                 splits.input_shape)
    shipped = _shipped_structure(primary, onnx_params, structure, m)
    summary = {
        "format": formats[0], "precision": primary["precision"], "layout": primary["layout"],
        "mc_samples": m, "knob": model.knob, "knob_value": knob_value, "temperature": compressed.temperature,
        "distinct_samples": compressed.distinct_samples,   # < m: the graph repeats one network
        "before_temperature": before_temperature,   # the shipped samples' test figures at T = 1 and at T (PyTorch)
        "sparsity": {"layers": structure["layers"]},
        **{k: structure[k] for k in ("compression_ratio", "flops_ratio", "physical_compression_ratio",
                                     "physical_flops_ratio")},
        "kept_units": shipped_units(compressed),
        "surgery": {"not_pruned": compressed.not_pruned, "layers": compressed.surgery},
        "onnx_params": onnx_params, "kept_weights_per_sample": kept_per_sample,
        "kept_weights_total": kept_per_sample * m,
        "params_match": None if onnx_params is None else onnx_params == kept_per_sample * m,
        **shipped,
        "fidelity_max_abs_prob_diff": primary["fidelity"]["max_abs_prob_diff"],
        "fidelity_tolerance": e.fidelity_tolerance,
        "model_bytes": manifest["files"][manifest["model_file"]]["bytes"], "reference": manifest["reference"],
        # the bundle's classes and evaluation labels per class: the report names them, and its majority baseline
        "classes": list(splits.classes),
        "test_class_counts": np.bincount(np.asarray(y), minlength=len(splits.classes)).tolist(),
        "artifacts": {name: {k: v for k, v in art.items() if k != "model_file"}
                      for name, art in manifest["artifacts"].items()},
        "provenance": ctx.provenance("export"),
    }
    if above := _above_flops_target(ctx, structure["physical_flops_ratio"], structure["flops_ratio"]):
        ctx.log(f"export: WARNING {above}")
        summary["flops_target_exceeded"] = above
    write_compressed = family_of(ctx.cfg).write_compressed
    if write_compressed is not None:  # SQS: the real compressed form of the M exported samples
        summary["compressed_form"] = write_compressed(model, out, knob_value, m, ctx.cfg.seed)
    write_json(out / "export.json", summary)
    ctx.log(f"export: {out / 'bundle'} with {', '.join(artifacts)}; ONNX parameters {onnx_params} = {m} x "
            f"{kept_per_sample} kept weights: {summary['params_match']}")


def shipped_units(compressed):
    """{layer: units the shipped graph has}: the kept units and the dead ones surgery left in place (to round a
    width up to the runtime's channel block, or where it could not cut), as the exported graph has them."""
    surgery = compressed.surgery or {}
    return {name: int(k.sum()) + sum(((surgery.get(name) or {}).get("kept") or {}).values())
            for name, k in compressed.kept.items()}


def _shipped_structure(primary, onnx_params, structure, m):
    """What the primary artifact itself holds where it is smaller than the network after surgery: an
    onnx-codebook file drops the input features no weight of a Gemm / MatMul reads (export/lowbit.py), so it
    holds fewer parameters than the fp32 ONNX and runs fewer multiplies. {} for every other format. FLOPs by
    appendix A.1, (I_pr + 1) O_pr per sample: each dropped input of a layer saves its O_pr multiplies, the
    dropped weights of the M samples over M (a MatMul over tokens saves them once per token: counted once,
    so the ratio errs high)."""
    tensors = primary.get("tensors")   # lowbit_onnx's per-tensor facts (weight_storage's is a count)
    dropped = sum(math.prod(t["shape"]) - math.prod(t["stored_shape"]) for t in tensors.values()) \
        if isinstance(tensors, dict) else 0
    if not dropped:
        return {}
    flops = structure["pruned_flops"] - dropped / m
    return {"weights_dropped_with_inputs": dropped,
            "shipped_params": None if onnx_params is None else onnx_params - dropped,
            "physical_flops_ratio": flops / structure["dense_flops"],
            "physical_flops_ratio_before_input_removal": structure["physical_flops_ratio"]}


def _above_flops_target(ctx, physical, masked):
    """The message when the shipped network's FLOPs exceed train.flops_target, else None: the chosen point keeps
    more by its masks (select chose a wider point the training also serves: a nested net's widths above the
    target's), or the runtime's channel block (the training counts without it, since one training serves every
    device: surgery then rounds each pruned width up to a multiple of it, faster in that runtime despite the
    FLOPs). The block was blamed for a bn3 width select chose above the target (probe)."""
    from edgebayes.train.flops_target import TOLERANCE

    train = ctx.cfg.train
    if train.flops_target == "device":
        train = resolved_device_target(ctx, ctx.cfg, ctx.stage_dir("train")).train
    target, counted = train.flops_target, train.flops_channel_multiple
    if target is None or physical <= target * (1 + TOLERANCE):
        return None
    block = ctx.profile.runtime.channel_block
    # select's choice, and the point the training made within the target (a nested net's width)
    choice = _json_or_empty(ctx.stage_dir("select") / "choice.json")
    trained = _json_or_empty(ctx.stage_dir("train") / "metrics.json").get("test") or {}
    wider = (choice.get("knob") == trained.get("knob") == "width" and isinstance(trained.get("knob_value"), (int, float))
             and choice.get("knob_value", 0) > trained["knob_value"])   # a width above the target's: select's (probe)
    if masked > target * (1 + TOLERANCE) or wider:
        from edgebayes.deploy.summary import point_label

        return (f"the shipped network has {physical:.3f} of the dense FLOPs, above train.flops_target {target:g}: "
                f"select chose {point_label(choice['knob'], choice['knob_value'])}, which keeps {masked:.3f} by its "
                f"masks"
                + (f" (the training's point within the target is {point_label(trained['knob'], trained['knob_value'])})"
                   if wider else "")
                + " (the training serves the points above the target too, and select takes the best within the "
                f"device's budgets); give select.knob_values only within the target to ship no more than it")
    if block > 1 and counted == block:   # the training counted the blocks already: the schedule got no closer
        return (f"the shipped network has {physical:.3f} of the dense FLOPs, above train.flops_target {target:g}, "
                f"counted in {ctx.profile.name}'s channel blocks of {block}: no cut of the schedule reached it in them "
                f"(the training log names the closest); runtime.channel_multiple: 1 in the device profile ships "
                f"narrower widths")
    why = (f"{ctx.profile.name}'s runtime ({ctx.profile.runtime.name}) runs convolutions in blocks of {block} "
           f"channels and each pruned width is rounded up to a multiple of it (faster there despite the FLOPs: "
           f"benchmarks/results/channel_multiple.md); train.flops_channel_multiple: {block} counts the target in "
           f"those blocks, runtime.channel_multiple: 1 in the device profile ships the target's widths"
           if block > 1 else "surgery kept more than the training counted")
    return (f"the shipped network has {physical:.3f} of the dense FLOPs, above train.flops_target {target:g}: {why}; "
            f"or aim the target lower (about {target * target / physical:.2f})")


def run_deploy(ctx):
    """Copy the bundle (the runner, runner.pyz, is in it) to the device, benchmark there, fetch the results.

    A preflight first checks the device (reachable, python, runtime, free disk) so a problem is reported
    before anything is copied; on any failure the local artifacts stay and the stage is not marked done,
    so `edgebayes deploy` simply runs again.
    """
    from edgebayes.deploy.transport import transport_for

    (ctx.stage_dir("deploy") / "imported.json").unlink(missing_ok=True)   # these results are deploy's own
    if no_fit(ctx):
        raise StageError(f"no operating point fits the budgets of {ctx.profile.name}: nothing to deploy; "
                         f"`{ctx.command('report')}` reports every candidate against them")
    bundle = ctx.require("export", "bundle") / "bundle"
    manifest = read_json(bundle / "manifest.json")
    if manifest.get("runner") != RUNNER_FILE:
        raise StageError(f"{bundle}: the bundle has no {RUNNER_FILE} (exported by an older edgebayes); "
                         f"run `edgebayes export --force`, then `edgebayes deploy`")
    out = ctx.stage_dir("deploy")
    r = ctx.profile
    # A folder of the device's own for this run and bundle (removed after): two runs deploying to one
    # device at once never run or fetch each other's bundle or results; TensorRT's engines stay shared.
    tag = f"{ctx.cfg.name}-{manifest['files'][manifest['model_file']]['sha256'][:12]}"
    with transport_for(r, out / "device").own_folder(tag) as transport:
        results_by_artifact, skipped = _deploy_on(ctx, transport, bundle, manifest, out)
    write_json(out / "artifacts.json", {
        **{name: {k: res.get(k) for k in ("bundle", "runtime", "metrics", "latency_ms", "runs", "max_abs_prob_diff",
                                          "peak_rss_mb", "memory", "cold_start")} for name, res in results_by_artifact.items()},
        **{name: {"skipped": why} for name, why in skipped.items()}})


def _deploy_on(ctx, transport, bundle, manifest, out):
    """run_deploy in the run's own folder of the device: copy, run each artifact, fetch and check results."""
    from edgebayes.deploy.report import fmt_ms
    from edgebayes.deploy.results import ResultsError, check_results
    from edgebayes.deploy.transport import runner_failure

    r = ctx.profile
    size = sum(f.stat().st_size for f in bundle.iterdir())
    transport.preflight(r.runtime.name, size, r.connection.min_free_mb)
    transport.put(bundle, "bundle")
    # Every artifact of the bundle is run and timed with its own runtime: the primary one (the chosen
    # format, the manifest's model_file) must run; another whose runtime the device lacks is skipped.
    artifacts = manifest.get("artifacts") or {manifest["format"]: {"model_file": manifest["model_file"],
                                                                   "runtime": r.runtime.name}}
    results_by_artifact, skipped = {}, {}
    for name, art in artifacts.items():
        primary = art["model_file"] == manifest["model_file"]
        runtime = art["runtime"]
        if not primary and runtime != r.runtime.name and transport.probe(runtime)["runtime"]["module"] is None:
            skipped[name] = f"{runtime} is not installed on {r.name}"
            ctx.log(f"deploy: {name} skipped: {skipped[name]}")
            continue
        result_file = "results.json" if primary else f"results-{name}.json"
        code, err = transport.run(runner_args(ctx, out=result_file, runtime=runtime,
                                              artifact=name if "artifacts" in manifest else None,
                                              progress=sys.stderr.isatty(),   # engines: the work folder's
                                              engine_cache="../../trt-engines" if runtime == "tensorrt" else None))
        if code != 0:
            # Exit code 2 is the runner's "invalid bundle": deploying again would copy the same bundle.
            again = "`edgebayes export --force`, then `edgebayes deploy`" if code == 2 else "`edgebayes deploy`"
            raise StageError(transport.disk_full(err) or runner_failure(
                r.name, code, err, f" (artifact {name}); local artifacts are kept, re-run {again}"))
        transport.get(result_file, out / result_file)
        try:   # of this bundle's artifact on this device: a shared work folder must not swap results
            res = check_results(out / result_file, manifest, bundle, r, name if "artifacts" in manifest else None)
        except ResultsError as e:
            (out / result_file).unlink(missing_ok=True)
            raise StageError(f"device {r.name} returned results that are not this run's: {e}") from None
        results_by_artifact[name] = res
        if primary:
            device_fidelity(ctx, res, manifest, name)
        lat, ms = res["latency_ms"], lambda v: fmt_ms(v, ascii_only=True)
        ctx.log(f"deploy: {name} on {r.name} ({transport.where()}): accuracy {res['metrics']['accuracy']:.4f}, "
                f"ECE {res['metrics']['ece']:.4f}, max |p - p_ref| {res['max_abs_prob_diff']:.2e}; latency p50 "
                f"{ms(lat['p50'])} / p90 {ms(lat['p90'])} / p99 {ms(lat['p99'])} / max {ms(lat['max'])} over all "
                f"{res['runs']} runs")
    return results_by_artifact, skipped


def _report_inputs(ctx, results):
    """What the report is written from: every stage's artifacts up to export, and `results` (the device's
    runner results, or None for a report of predictions)."""
    train_metrics = read_json(ctx.require("train", "metrics.json") / "metrics.json")
    candidates = read_json(ctx.require("select", "candidates.json") / "candidates.json")
    choice = read_json(ctx.require("select", "choice.json") / "choice.json")
    export = read_json(ctx.require("export", "export.json") / "export.json")
    artifact_results = ctx.stage_dir("deploy") / "artifacts.json"
    if results is not None and artifact_results.is_file():   # a report of predictions reads no deploy file
        ctx.require("deploy", "artifacts.json")
    # Structure (kept nodes, compression, FLOPs) of the deployed operating point, not of training's
    # default knob value; the training metrics stay as they are.
    deployed = {k: export[k] for k in ("sparsity", "compression_ratio", "flops_ratio", "physical_compression_ratio",
                                       "physical_flops_ratio")}
    return {
        "run_name": ctx.cfg.name, "device": as_dict(ctx.profile), "train": {**train_metrics, **deployed},
        "candidates": candidates["candidates"], "objective": candidates["objective"],
        "choice": {k: choice.get(k) for k in ("knob", "knob_value", "mc_samples", "format", "precision", "reason")},
        "max_ece": candidates.get("max_ece"),
        "export": export, "results": results, "reliability": (results or {}).get("reliability"),
        "artifact_results": read_json(artifact_results) if results and artifact_results.is_file() else {},
        "imported": read_json(imported) if results and (imported := ctx.stage_dir("deploy") / "imported.json").is_file()
        else None,   # results run by hand on the device (report --results), not by deploy
        "provenance": ctx.provenance("report"),
        # the config the run used: the file, the command line's --set over it, and every key's value
        "config": {"file": str(ctx.config_path), "settings": list(ctx.settings), "values": as_dict(ctx.cfg)},
    }


def _standing_prediction(ctx):
    """Why the device was not reached, where this device's current report is one of predictions (the pipeline
    could not deploy, and no deploy has run since: a later stage run withdraws it); else None."""
    if ctx._marker("deploy") is not None:
        return None
    predicted = _json_or_empty(ctx.stage_dir("report") / "report.json").get("predicted")
    reason = predicted.get("reason") if isinstance(predicted, dict) else None
    return reason if isinstance(reason, str) else None


def no_fit(ctx):
    """Selection found no operating point within the budgets (its choice is the closest, `fits` false)."""
    return read_json(ctx.require("select", "choice.json") / "choice.json").get("fits") is False


def run_report(ctx):
    from edgebayes.deploy.report import fmt_ms, write_report

    if no_fit(ctx):
        return write_predicted_report(ctx, "no operating point fits the device budgets", no_fit=True)
    if not (ctx.stage_dir("deploy") / "results.json").is_file():
        standing = _standing_prediction(ctx)
        if standing is not None:   # the device was not reached since: the report of predictions again, exit 4
            return write_predicted_report(ctx, standing, standing=True)
        raise StageError(f"{ctx.stage_dir('deploy') / 'results.json'} is missing: run `{ctx.command('deploy')}`; "
                         f"for a device this machine cannot reach: {finish_hint(ctx)}")
    from edgebayes.deploy.results import check_results

    bundle = ctx.require("export", "bundle/manifest.json") / "bundle"   # results of this bundle, this device
    results = check_results(ctx.require("deploy", "results.json") / "results.json",
                            read_json(bundle / "manifest.json"), bundle, ctx.profile)
    inputs = _report_inputs(ctx, results)
    report = write_report(inputs, ctx.stage_dir("report"))
    ctx.replace_withdrawn()
    lat = report["summary"]["latency_prediction"]
    if lat["error"] is not None:
        ctx.log(f"report: chosen point's p{lat['percentile']} latency predicted {fmt_ms(lat['predicted_ms'], True)} "
                f"({lat['predicted_by']}), measured {fmt_ms(lat['measured_ms'], True)} over all timed runs: "
                f"error {100 * lat['error']:+.1f} %")
    ctx.log(f"report: {ctx.stage_dir('report') / 'report.html'}")
    return report


def check_select(ctx):
    """select.knob_values against the trained network, before run_stage withdraws the last selection: values out
    of the family's range, or only widths a nested net's training never served (narrower than its FLOPs
    target's width, known once trained; the config's own check covers nested.fixed_groups). That was exit 1
    after the work, for a setting of the config."""
    model = load_trained_model(ctx)
    try:
        knobs = model.operating_points(ctx.cfg.select.knob_values)
    except ValueError as e:
        raise ConfigError(f"{ctx.config_path}: select.knob_values: {e}") from None
    untrained = getattr(model, "untrained_widths", lambda _: [])(knobs)   # nested nets (train/models.py)
    if knobs and len(untrained) == len(knobs):
        raise ConfigError(f"{ctx.config_path}: select.knob_values: every width ({untrained}) is narrower than the "
                          f"narrowest one the training served ({model.fixed_groups + 1} of {model.groups} groups, "
                          f"train.flops_target's); give widths in {model.fixed_groups + 1}..{model.groups}, or "
                          f"leave knob_values out")


def check_deploy(ctx):
    """The bundle is the one export wrote (its marker's hashes) before deploy withdraws the last report: a bundle
    edited by hand withdrew a good report, then failed (probe)."""
    ctx.require("export", "bundle")


# run_stage: before the stage withdraws and begins
CHECKS = {"train": check_train, "select": check_select, "deploy": check_deploy}
RUNNERS = {"train": run_train, "select": run_select, "export": run_export, "deploy": run_deploy, "report": run_report}


def stale_upstream(ctx, stage):
    """The first stage before `stage` whose artifacts no longer match this config, device profile and code,
    with why; None when all are current. A single stage (`edgebayes report`, `make deploy`) must not build on
    artifacts of another config: it would record this config beside figures that config did not produce."""
    upstream = list(STAGES[:STAGES.index(stage)])
    if stage == "report" and "deploy" in upstream and no_fit(ctx):   # no fit: nothing was deployed
        upstream.remove("deploy")
    for before in upstream:   # altered or missing outputs: require() names the file when the stage reads it
        done = ctx._marker(before)
        if done is None:
            # an interrupted or failed re-run left no marker: its folder may hold another config's checkpoint.
            # (deploy aside: an unreachable device's report is predicted, with no deploy marker)
            if before != "deploy":
                return before, "it has not finished: never run, interrupted or failed"
            continue
        if done.get("fingerprint") != ctx.fingerprint(before):   # what moved: a data folder is not "the config"
            return before, ctx._what_changed(before, done)
        if (why := ctx.changed_input(done)) is not None:
            return before, why
    return None


def run_stage(ctx, stage, single=False):
    if single and (stale := stale_upstream(ctx, stage)) is not None:
        before, why = stale
        raise StageError(f"{stage}: the {before} stage is out of date for this config and device ({why}); "
                         f"run `{ctx.command(before)}` and the stages after it first, or the pipeline")
    why = ctx.staleness(stage)
    if why is None:
        ctx.log(f"{stage}: up to date (config, code, outputs and inputs unchanged), skipped")
        return
    ctx.log(f"{stage}: running ({why})")
    if stage in ("train", "select", "export"):   # deploy's runner keeps the device profile's runtime.threads
        ctx.log(f"{stage}: {set_threads(ctx.cfg.train.threads)} torch threads (train.threads)")
    if stage in CHECKS:   # bad input is refused before the last run's artifacts are touched
        CHECKS[stage](ctx)
    # the report's plots as its marker lists them, which begin() removes: withdrawn with it if this run fails
    plots = (_read_marker(ctx.stage_dir("report")) or {}).get("outputs", {}) if stage == "report" else None
    if is_main_process():
        if stage in ("train", "select", "export", "deploy"):
            ctx.withdraw_report(every_device=stage == "train")
        ctx.begin(stage)
    try:
        try:
            done = RUNNERS[stage](ctx)
        except MemoryError as e:  # the stack is unwound: the memory it held is free again for the message
            raise StageError(f"{stage}: out of memory{f' ({e})' if str(e) else ''}; its marker is not written, "
                             f"so the stage runs again next time") from None
        except OSError as e:
            if e.filename is not None:  # the command line names the file
                raise
            # e.g. a full disk under matplotlib's savefig: at least the folder the stage was writing to
            raise StageError(f"{stage}: {e.strerror or e} (writing in {ctx.stage_dir(stage)})") from None
    except BaseException:
        # A report that ran (its inputs changed since the last) and failed: the last one's page no longer
        # describes the stages, and looked current beside no marker (probe); `report --devices` shows it stale
        if stage == "report" and is_main_process():
            ctx.withdraw_report(written=plots)
        raise
    predicted = stage == "report" and isinstance(done, dict) and done["summary"]["mode"] == "predicted" \
        and not done["summary"]["no_fit"]   # not done: the next pipeline deploys (write_predicted_report)
    if is_main_process() and not predicted:  # under torchrun, process 0 alone writes (train/distributed.py)
        ctx.mark_done(stage)


def run_pipeline(ctx, stages=STAGES):
    """Run the stages in order. When deploy finds the device unavailable (unreachable, no python or
    runtime there), the report is written from the predictions instead (write_predicted_report) and the
    pipeline ends there. A throwaway sshd a stage started (connection.local_sshd) is stopped at the end."""
    from edgebayes.deploy import localsshd
    from edgebayes.deploy.transport import DeviceUnavailable

    try:
        for stage in stages:
            if stage == "deploy" and no_fit(ctx):   # a budget verdict: nothing to deploy, every candidate reported
                run_stage(ctx, "report") if "report" in stages else None
                return
            try:
                run_stage(ctx, stage)
            except DeviceUnavailable as e:
                if stage != "deploy" or "report" not in stages:
                    raise
                write_predicted_report(ctx, e)
                return
    finally:
        localsshd.stop_started()


# ---------------------------------------------------------------------------------------------
# A device this machine cannot reach: a report of predictions, and the device's results imported later
# ---------------------------------------------------------------------------------------------
def runner_args(ctx, out="results.json", **options):
    """The runner's command line for this run's benchmark on this device (deploy, and the hint to run it by
    hand): the bundle's own runner.pyz on the bundle, in the device's work folder. `options`: more of the
    runner's options (runtime, artifact, progress)."""
    b, r = ctx.cfg.benchmark, ctx.profile
    return command_line(f"bundle/{RUNNER_FILE}", out, bundle="bundle", warmup=b.warmup, min_runs=b.min_runs,
                        min_seconds=b.min_seconds, rounds=b.rounds, batch_size=r.budgets.batch_size,
                        threads=r.runtime.threads, workspace_mb=r.runtime.workspace_mb,
                        tags={"device": r.name, "connection": r.connection.kind}, **options)


def finish_steps(ctx):
    """The commands that finish a run by hand on a device this machine cannot reach: copy the bundle (its
    runner inside) there, run the benchmark, bring results.json back and import it (`--results`)."""
    import shlex

    from edgebayes.config import expand_repo, ssh_options

    c, bundle = ctx.profile.connection, ctx.stage_dir("export") / "bundle"
    workdir = expand_repo(c.workdir) or f"edgebayes/{ctx.profile.name}"
    python = expand_repo(c.python) or "python3"
    run = shlex.join([python, *runner_args(ctx)])
    # here, named by the device: finishing two boards in turn in one folder overwrote the first's (probe)
    here = f"results-{ctx.profile.name}.json"
    import_cmd = ctx.command("report", "--results", here)
    from edgebayes.ondevice.tables import RUNTIME_MODULES, RUNTIME_PACKAGES

    runtime = ctx.profile.runtime.name
    # every module the runner takes for the runtime (a board with tflite-runtime only runs a TFLite bundle too)
    checks = " or ".join(shlex.join([python, "-c", f"import numpy, {module}"]) for module in RUNTIME_MODULES[runtime])
    needs = (f"the board needs {python} (python 3) with numpy and the {runtime} runtime "
             f"({RUNTIME_PACKAGES[runtime]}; check: {checks})")
    if c.kind != "ssh":
        return [needs, f"copy {bundle} to the device", f"there: {run}",
                f"copy results.json back here as {here}, then: {import_cmd}"]
    dest = f"{c.user}@{c.host}" if c.user else c.host
    # the profile's own ssh settings, as deploy uses them: a board behind a jump host, or reached with its own
    # key, is not reached by a bare `ssh user@host`
    ssh, scp = ["ssh", *ssh_options(c, by_hand=True)], ["scp", *ssh_options(c, by_hand=True, port_flag="-P")]
    return [needs, shlex.join([*ssh, dest, f"mkdir -p {shlex.quote(workdir)}"]),
            shlex.join([*scp, "-r", str(bundle), f"{dest}:{workdir}/"]),
            shlex.join([*ssh, dest, f"cd {shlex.quote(workdir)} && {run}"]),
            shlex.join([*scp, f"{dest}:{workdir}/results.json", here]),
            import_cmd]


def finish_hint(ctx):
    return ("copy the bundle there, run its runner.pyz, then import its results: "
            + "; ".join(finish_steps(ctx)))


def _results_here(ctx, bundle, manifest):
    """The bundle's accuracy, calibration and OOD figures on this machine: the runner run here with the
    primary artifact's runtime (a TensorRT engine's shipped ONNX with onnxruntime), timing cut to one run
    (this machine's latency says nothing about the device). None, with the reason, if it cannot run here."""
    import tempfile

    from edgebayes.deploy.transport import LocalTransport
    from edgebayes.ondevice.bundle import select_artifact

    artifact = select_artifact(bundle, manifest)
    runtime = "onnxruntime" if artifact["runtime"] == "tensorrt" else artifact["runtime"]
    with tempfile.TemporaryDirectory() as tmp:
        here = LocalTransport("this machine", tmp)
        here.put(bundle, "bundle")
        code, err = here.run(command_line(f"bundle/{RUNNER_FILE}", "results.json", bundle="bundle", runtime=runtime,
                                          warmup=0, min_runs=1, min_seconds=0, rounds=1, quiet=True))
        if code != 0:
            return None, f"the runner failed here with {runtime} ({err[-1] if err else code})"
        res = read_json(Path(tmp) / "results.json")
    keep = ("bundle", "runtime", "metrics", "reliability", "ood", "selective", "reference", "max_abs_prob_diff")
    return {**{k: res.get(k) for k in keep}, "measured_on": "this machine", "runtime_used": runtime}, None


def write_predicted_report(ctx, error, no_fit=False, standing=False):
    """deploy found the device unavailable: write the report from what exists, marked predicted.

    Selection's figures (latency by the device's latency model, memory estimate) and the exported file's
    size stand where the device's measurements would; the bundle's accuracy, ECE and OOD figures come from
    running it on this machine. The report says how to finish on the device (finish_steps); the stage is
    not marked done, so the next `pipeline` deploys when the device is back. `edgebayes` exits with its
    own code (cli.EXIT_PREDICTED).
    """
    from edgebayes.deploy.report import write_report

    if not no_fit:
        ctx.begin("report")   # no marker: the next `pipeline` deploys and reports when the device is back
    bundle = ctx.require("export", "bundle/manifest.json") / "bundle"
    # standing: `report` alone, the device not reached since (run_report): nothing was tried now
    ctx.log(f"report: {ctx.profile.name} was not reached since: {error}" if standing else f"deploy: {error}")
    ctx.log(f"report: {'no operating point fits: a report of every candidate against the budgets, the closest' if no_fit else ctx.profile.name + ' is not available: writing a report of predictions'} "
            f"(selection's latency and memory, the bundle's accuracy on this machine)")
    here, why_not = _results_here(ctx, bundle, read_json(bundle / "manifest.json"))
    inputs = _report_inputs(ctx, None)
    inputs["predicted"] = {"reason": str(error), "here": here, "here_failed": why_not, "no_fit": no_fit,
                           "finish": [] if no_fit else finish_steps(ctx)}
    report = write_report(inputs, ctx.stage_dir("report"))
    ctx.replace_withdrawn()
    ctx.log(f"report: {ctx.stage_dir('report') / 'report.html'} (predicted" + ("; no operating point fits)" if no_fit
            else "; the summary lists the steps that finish it on the device)"))
    return report


def device_fidelity(ctx, res, manifest, artifact=None):
    """The shipped artifact's accuracy on the device at or above the floor export held it to (the lower of the
    PyTorch MC accuracy and the artifact's own at export, less export.max_accuracy_drop): a runtime that computes
    something else (a broken kernel, another model under the hashed name) read 'verdict pass' with the accuracy
    of a random guess (probe). The floor, not export's fp32 tolerance: another CPU's or runtime version's kernels
    legitimately move probabilities by more than 1e-4."""
    artifact = artifact or res["bundle"].get("artifact") or manifest["format"]
    at_export = (manifest.get("artifacts") or {}).get(artifact, {}).get("fidelity", {}).get("accuracy")
    base = min(manifest["reference"]["accuracy"], *([] if at_export is None else [at_export]))
    drop = ctx.cfg.export.max_accuracy_drop
    got = res["metrics"]["accuracy"]
    if got < base - drop:
        raise StageError(f"device {ctx.profile.name}: {artifact} reaches accuracy {got:.4f} on the bundle's test set "
                         f"there, below {base - drop:.4f} (accuracy at export {base:.4f} - export.max_accuracy_drop "
                         f"{drop}; max |p - p_ref| {res['max_abs_prob_diff']:.2e}): its runtime does not compute what "
                         f"was exported; no report is written from these results")


def import_results(ctx, path):
    """`edgebayes report --results FILE`: the results.json of the runner run by hand on the device become
    this run's deploy results, and the report is written from them as after a deploy. The file is checked
    before anything changes (deploy/results.py: a regular file of a few MB, the runner's strict schema, the
    model, artifact, format, precision, runtime and device of this run's choice for this profile):
    ResultsError (exit 2) otherwise, with every marker and report as they were."""
    from edgebayes.deploy.results import check_results, identity

    bundle = ctx.require("export", "bundle/manifest.json") / "bundle"
    manifest = read_json(bundle / "manifest.json")
    choice = read_json(ctx.require("select", "choice.json") / "choice.json")
    res = check_results(path, manifest, bundle, ctx.profile)
    identity(res, {"bundle.artifact": choice["format"], "bundle.precision": choice["precision"],
                   "bundle.mc_samples": choice["mc_samples"],
                   "runtime.name": choice["candidate"]["runtime"]},
             path, ctx.profile.name)
    device_fidelity(ctx, res, manifest)
    ctx.begin("deploy")
    ctx.require("export", "bundle/manifest.json")
    out = ctx.stage_dir("deploy")
    write_json(out / "results.json", res)
    # edgebayes did not run these: the report says so (its figures are the file's, checked as far as they can be)
    write_json(out / "imported.json", {"from": str(Path(path).resolve()), "sha256": sha256_file(path)})
    write_json(out / "artifacts.json", {res["bundle"]["artifact"]: {
        k: res.get(k) for k in ("bundle", "runtime", "metrics", "latency_ms", "runs", "max_abs_prob_diff",
                                "peak_rss_mb", "memory", "cold_start")}})
    ctx.mark_done("deploy")
    host = str(res["device"].get("hostname", "?"))   # the file's text: no escape sequence reaches the terminal
    ctx.log(f"deploy: results of {res['bundle']['artifact']} on {host if host.isprintable() else ascii(host)} "
            f"imported from {path}")
    ctx.begin("report")
    run_report(ctx)
    ctx.mark_done("report")
