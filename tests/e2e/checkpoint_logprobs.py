"""Run as a script (a process of its own: it opens a process group and megatron-core's parallel
state): the logprobs the trainer's own model gives held-out rows, from a run's checkpoint.

    python tests/e2e/checkpoint_logprobs.py RUN_DIR STEP ROWS_JSON

ROWS_JSON: [[prompt ids, response ids], ...]. Prints one JSON line: each row's response logprobs,
from megatron-core's model (rft/trainer/forward.py) loaded as `python -m rft.export` loads it."""

import json
import sys
import warnings

warnings.simplefilter("ignore")

import torch  # noqa: E402

from rft.export.convert import find_checkpoint, load_checkpoint_model  # noqa: E402
from rft.trainer.forward import forward_logprobs, pack_microbatch  # noqa: E402


def main(run_dir: str, step: int, rows_json: str) -> None:
    rows = json.loads(rows_json)
    model, _ = load_checkpoint_model(find_checkpoint(run_dir, step))
    model.eval()
    prompts, responses = [p for p, _ in rows], [r for _, r in rows]
    mb = pack_microbatch(prompts, responses, pad_id=0, device=torch.device("cpu"))
    with torch.no_grad():
        logprobs, _ = forward_logprobs(model, mb, with_entropy=False)
    out = [logprobs[i, len(p) - 1:len(p) - 1 + len(r)].tolist() for i, (p, r) in enumerate(rows)]
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
