"""`python -m rft.plot RUN_DIR [RUN_DIR ...]`: one run -> its stages' plots (plots/<stage>.png);
several runs, or a sweep directory -> one figure with every run on shared axes."""

from __future__ import annotations

import argparse
import os
import sys

from rft.plot import compare_runs, draw_run, run_dirs_in


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rft.plot", description=__doc__.split("\n")[0].split(": ", 1)[1])
    parser.add_argument("dirs", nargs="+", metavar="RUN_DIR", help="run directories, or a sweep directory")
    parser.add_argument("-o", "--output", help="the comparison figure's path (.png; an .svg goes beside it); "
                        "default: <sweep dir>/plots/compare.png, or ./rft-compare.png")
    args = parser.parse_args(argv)
    runs = []
    for path in args.dirs:
        found = run_dirs_in(path)
        if not found:
            print(f"rft.plot: {path}: not a run directory (no metrics/) and no runs inside", file=sys.stderr)
            return 2
        runs += found
    if len(runs) == 1:
        written = draw_run(runs[0])
    else:
        sweep = args.dirs[0] if len(args.dirs) == 1 else None
        default = os.path.join(sweep, "plots", "compare.png") if sweep else "rft-compare.png"
        written = compare_runs(runs, args.output or default)
    if not written:
        print(f"rft.plot: nothing logged yet in {', '.join(runs)}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
