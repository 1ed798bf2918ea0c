"""`python -m rft.review RUN_DIR`: score the rollouts a run queued for human review.

    python -m rft.review RUN_DIR                      # the terminal UI
    python -m rft.review RUN_DIR --list               # counts and pending ids, no UI
    python -m rft.review RUN_DIR --export sft --out reviewed.jsonl [--min-score 0.5]

Mistakes a person makes at the command line (a wrong path, a run without a review operator) get a
one-line message and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from rft.review import queue


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rft.review", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's output directory (run.output_dir)")
    p.add_argument("--list", action="store_true", help="print pending/labelled counts and pending ids, no UI")
    p.add_argument("--export", choices=("sft", "dpo"),
                   help="write the labelled items as a jsonl taskset: sft rows (question, answer) or dpo pairs")
    p.add_argument("--out", metavar="PATH", help="where --export writes")
    p.add_argument("--min-score", type=float, default=0.5, metavar="X",
                   help="--export sft keeps responses scored at least X (default 0.5)")
    return p


def _fail(message: str) -> int:
    print(f"rft.review: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.export and not args.out:
        parser.error("--export needs --out PATH")
    if args.out and not args.export:
        parser.error("--out is only used with --export {sft,dpo}")
    qdir = queue.queue_dir(args.run_dir)
    if not os.path.isdir(qdir):
        return _fail(f"no review queue at {qdir}: a `review` experience operator in buffer.operators "
                     "fills it during the run; add one, or check RUN_DIR")

    if args.list:
        every, done = queue.items(args.run_dir), queue.labels(args.run_dir)
        waiting = [i["id"] for i in every if i["id"] not in done]
        print(f"{len(waiting)} pending, {len(every) - len(waiting)} labelled, {len(every)} queued")
        for item_id in waiting:
            print(item_id)
        return 0

    if args.export:
        try:
            rows = queue.export(args.run_dir, args.export, args.out, min_score=args.min_score)
        except (OSError, ValueError) as e:
            return _fail(f"export to {args.out} failed: {e}")
        print(f"wrote {rows} {args.export} rows to {args.out}")
        return 0

    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        return _fail("the review UI needs an interactive terminal; use --list or --export from scripts")
    from rft.review.app import ReviewApp  # textual only for the UI: --list and --export work without it

    ReviewApp(args.run_dir).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
