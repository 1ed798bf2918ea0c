#!/usr/bin/env bash
# The GPU paths CI cannot run, on one lent GPU (or any CUDA node with rft installed):
#   bash tools/gpu_truth.sh            # results under $OUT (default /tmp/gpu_truth)
# 1. tools/bench_trainer.py on Qwen2.5-0.5B and -1.5B shapes in bf16: packed vs padded
#    microbatches, activation recompute; tokens/s, MFU and peak memory, one JSON line each in
#    $OUT/bench.jsonl; the trainer's layers are Transformer Engine's where it imports
#    (trainer.transformer_impl=auto; each JSON line names them);
# 2. the GPU tests: megatron-core's DDP and optimizer with fp32 masters (bf16, fp16; CI runs it on
#    CPU ranks), flash attention for padded and packed rows, and Transformer Engine's layers
#    against the local ones (skipped where TE does not import) (full output in $OUT/tests.log).
# Wheels in .whl/ (megatron-core and the config stack, for a machine with torch but not our stack)
# are installed first. vLLM and Transformer Engine are not among them: their wheels are built for
# one torch and CUDA each, and too big to carry, so generation and sync into a GPU vLLM are not
# measured here.
set -u
OUT=${OUT:-/tmp/gpu_truth}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)"
python3 -c "import transformer_engine" 2>&1 | tail -1

bench() {  # name model args...
  local name=$1 model=$2; shift 2
  echo "== $name"
  timeout "${BENCH_TIMEOUT:-150}" python3 tools/bench_trainer.py --model "$model" --dtype bfloat16 "$@" 2>&1 \
    | grep -v -i "warn" | tee "$OUT/$name.log" | tail -8
  tail -1 "$OUT/$name.log" | grep '^{' | python3 -c "import json,sys; r=json.load(sys.stdin); r['name']='$name'; print(json.dumps(r))" >> "$OUT/bench.jsonl"
}
python3 - <<'PY'  # random weights of each shape, written once
import sys; sys.path.insert(0, "tools")
from bench_weight_sync import resolve_model
for size in ("0.5b", "1.5b"):
    print(resolve_model(f"tools/configs/qwen2_{size}.json", f"/tmp/qwen2_{size}"))
PY
bench padded_0.5b /tmp/qwen2_0.5b/random --rows 64 --budget 0 --micro-batch 8
bench packed_0.5b /tmp/qwen2_0.5b/random --rows 64 --budget 8192
bench packed_0.5b_16k /tmp/qwen2_0.5b/random --rows 64 --budget 16384
bench packed_0.5b_selective /tmp/qwen2_0.5b/random --rows 64 --budget 16384 --recompute selective --steps 3
bench packed_1.5b /tmp/qwen2_1.5b/random --rows 64 --budget 16384
bench packed_1.5b_full /tmp/qwen2_1.5b/random --rows 64 --budget 16384 --recompute full --steps 3
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -s -p no:cacheprovider -W ignore::UserWarning \
  tests/dist/test_megatron_optimizer.py tests/dist/test_transformer_engine.py tests/unit/test_attention.py > "$OUT/tests.log" 2>&1
tail -30 "$OUT/tests.log"

cat "$OUT/bench.jsonl"
