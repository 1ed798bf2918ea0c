"""python -m rft.export RUN_DIR [--step N] [--out DIR]: a checkpoint of a run as an HF model directory.

A finished run leaves its model as an HF directory already (<run>/model, each stage's in
<run>/models/); this converts any checkpoint, of any TP x PP x EP layout and LoRA stages merged, e.g.
of a run that stopped or one whose last stage has not ended.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rft.export", description=__doc__.splitlines()[0].split(": ", 1)[1])
    parser.add_argument("run_dir", help="the run's output directory (run.output_dir)")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest complete one)")
    parser.add_argument("--out", default=None,
                        help="where to write it (default: <run>/checkpoints/hf/v<step>, where mode=bench finds it)")
    args = parser.parse_args(argv)
    import warnings

    # megatron-core and torch's checkpoint readers warn about absent Apex / Transformer Engine (the local
    # layers need neither) and their own deprecations: nothing the user can act on
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.simplefilter("ignore", category)
    from rft.export.convert import ExportError, export_checkpoint

    try:
        export_checkpoint(args.run_dir, args.step, args.out)
    except ExportError as err:
        print(f"rft.export: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
