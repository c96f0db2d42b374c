"""Command line: `edgebayes <stage> --config pipeline.yaml --device local`.

Exit codes: 0 done; 1 a stage failed (its message says why; artifacts of finished stages are kept);
2 bad input (config, device profile, data files), reported with one message naming the file and key.
"""

import argparse
import sys
from pathlib import Path

from edgebayes.config import load_device_profile, load_pipeline_config
from edgebayes.errors import InputError, StageError
from edgebayes.stages import STAGES

EXIT_FAILED, EXIT_BAD_INPUT = 1, 2


def build_parser():
    parser = argparse.ArgumentParser(prog="edgebayes", description="Compressible Bayesian nets, from training to the edge.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in STAGES + ("pipeline",):
        p = sub.add_parser(name, help="run all stages" if name == "pipeline" else f"run the {name} stage")
        p.add_argument("--config", default="pipeline.yaml", help="pipeline config (default: pipeline.yaml)")
        p.add_argument("--device", default="local", help="device profile name in devices/, or a YAML path")
        p.add_argument("--runs-dir", default="runs", help="where artifacts go (default: runs)")
        p.add_argument("--force", action="store_true", help="re-run even if the stage is up to date")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from edgebayes.stages import Context, run_pipeline, run_stage

    try:
        ctx = Context(load_pipeline_config(args.config), load_device_profile(args.device),
                      runs_dir=Path(args.runs_dir), force=args.force, config_path=args.config)
        if args.command == "pipeline":
            run_pipeline(ctx)
        else:
            run_stage(ctx, args.command)
    except InputError as e:
        print(f"edgebayes: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except StageError as e:
        print(f"edgebayes: {args.command} failed: {e}", file=sys.stderr)
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
