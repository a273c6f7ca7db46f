#!/usr/bin/env bash
# The GPU checks in one run (docs/performance.md, "On a GPU"): the CUDA test suite, the
# paper-size JSB model beside it, then `relpos bench` on the GPU alone.
#
#   benchmarks/gpu_check.sh OUT            # PYTHON=python3 by default; relpos from ./src
#
# OUT gets the logs and results.tgz (tables, JSON, plots, the run's metrics; no checkpoints);
# the folders themselves are written under WORK (default: a temporary folder).
#
# Phase 1 (in parallel): the CUDA tests (pytest-xdist workers: FlexAttention and Triton compiles
# are CPU work; the fused Triton kernel's suite, tests/fused, beside the rest); the cold compiles:
# one bench process per backend (flex, fused) × scheme × mask and one fused_tiles.py process per
# TILE_SCHEMES scheme, each compiling its shapes once (their "first call s" is the cold compile,
# measured under that load;
# Inductor's and Triton's on-disk caches then serve phase 2); and `relpos train` of
# configs/jsb-music-paper.json for TRAIN_S seconds (0: no training), then `relpos eval`. Phase 2,
# with nothing else on the GPU: benchmarks/fused_tiles.py (the fused kernel's TILE_CONFIGS against
# flash SDPA at L=4096), then `relpos bench --device cuda` of BENCH_IMPLS, then
# benchmarks/compiled_step.py (COMPILED_IMPLS' steps under torch.compile) of COMPILED_SCHEMES.
# Budgets (seconds): TEST_S (0: no tests, no cold compiles), TRAIN_S, TILES_S (0: no tiles),
# BENCH_S (0: no bench), COMPILED_S (0, the default: no compiled steps). LAYOUT: the bench's positions (plain, padded, packed); MASK: causal, bidirectional or both. DATA: the JSB JSON where the config's
# ../shared path does not exist (a GPU machine gets only the checkout: carry a copy in it).
set -u
OUT=${1:?usage: benchmarks/gpu_check.sh OUT}
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$OUT" "$WORK"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Within the device tool's 600 s a command: phase 1 takes max(TEST_S, TRAIN_S + eval).
TEST_S=${TEST_S:-240} TRAIN_S=${TRAIN_S:-210} TILES_S=${TILES_S:-90} BENCH_S=${BENCH_S:-230}
COMPILED_S=${COMPILED_S:-0}  # benchmarks/compiled_step.py (0: not run)
COMPILED_SCHEMES=${COMPILED_SCHEMES:-alibi,t5,music}
COMPILED_IMPLS=${COMPILED_IMPLS:-fused,flex}
TILE_CONFIGS=${TILE_CONFIGS:-}  # benchmarks/fused_tiles.py --configs (empty: its default candidates)
TILE_SCHEMES=${TILE_SCHEMES:-alibi t5 shaw music kerple}  # fused_tiles.py --schemes
WORKERS=${WORKERS:-8}  # 0: no pytest-xdist
LENGTHS=${LENGTHS:-1024,4096,16384}  # ascending: each L estimates the next one's time
TOKENS=${TOKENS:-16384}
FLEX_SCHEMES=${FLEX_SCHEMES:-alibi t5 music kerple}
FUSED_SCHEMES=${FUSED_SCHEMES:-alibi t5 shaw music}
BENCH_SCHEMES=${BENCH_SCHEMES:-alibi,t5,shaw,music,kerple}
BENCH_IMPLS=${BENCH_IMPLS:-sdpa,chunked,flex,fused,sdpa-bias}
DEVICE=${DEVICE:-cuda}
LAYOUT=${LAYOUT:-plain}
TESTS_K=${TESTS_K:-cuda}  # pytest -k of the CUDA suite (tests/fused runs whole)
MASK=${MASK:-both}  # the bench's and the cold compiles' masks: causal, bidirectional or both
MASKS=$([ "$MASK" = both ] && echo "causal bidirectional" || echo "$MASK")

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
  torch.cuda.get_device_name() if torch.cuda.is_available() else 'no cuda')" 2>&1
  # FlexAttention's FLASH backend (kernel_options={"BACKEND": "FLASH"}) calls FlashAttention-4's
  # CuTe kernels: whether this machine has them decides whether flex can take it.
  $PY -c "import flash_attn.cute; print('flash_attn.cute (FlexAttention FLASH backend): yes')" \
    2>/dev/null || echo "flash_attn.cute (FlexAttention FLASH backend): no"; } \
  | tee "$OUT/env.txt"

# ---- phase 1: tests (two pytest runs of WORKERS each), cold compiles and training side by side
# (one thread and one compile worker each)
export OMP_NUM_THREADS=1 TORCHINDUCTOR_COMPILE_THREADS=1
[ "$TRAIN_S" -gt 0 ] && ( timeout "$TRAIN_S" $PY -m relpos.cli train --config configs/jsb-music-paper.json \
    ${DATA:+--data "$DATA"} --run-dir "$WORK/jsb" --device "$DEVICE" --no-progress
  $PY -m relpos.cli eval --run-dir "$WORK/jsb" --device "$DEVICE" --no-progress ||
    $PY -m relpos.cli eval --run-dir "$WORK/jsb" --device "$DEVICE" --no-progress --checkpoint last
) > "$OUT/train.log" 2>&1 &
TRAIN=$!

if [ "$TEST_S" -gt 0 ]; then
cold() {  # cold IMPL SCHEMES: one bench process per scheme and mask
  for scheme in $2; do
    for mask in $MASKS; do
      timeout "$TEST_S" $PY -m relpos.cli.bench --device "$DEVICE" --impls "$1" --schemes "$scheme" \
        --mask "$mask" --lengths "$LENGTHS" --tokens "$TOKENS" --repeats 5 --warmup 1 --no-memory \
        --no-plot --out "$WORK/cold/$1-$scheme-$mask" > "$WORK/cold-$1-$scheme-$mask.log" 2>&1 &
    done
  done
}
cold flex "$FLEX_SCHEMES"
cold fused "$FUSED_SCHEMES"
for scheme in $TILE_SCHEMES; do  # one process a scheme: each candidate's compiles (~10 s) in parallel
  timeout "$TEST_S" $PY benchmarks/fused_tiles.py --out "$WORK/tiles-cold-$scheme" --lengths 4096 \
    --tokens "$TOKENS" --schemes "$scheme" ${TILE_CONFIGS:+--configs "$TILE_CONFIGS"} --repeats 1 \
    --warmup 0 > "$WORK/cold-tiles-$scheme.log" 2>&1 &
done

XDIST=(); [ "$WORKERS" -gt 0 ] && XDIST=(-n "$WORKERS")
# The fused kernel's own suite (compiled on the GPU: no TRITON_INTERPRET, every case: -m slow
# too) beside the rest; not its ahead-of-time compiles (CPU work, checked without a GPU).
( timeout "$TEST_S" env -u TRITON_INTERPRET $PY -m pytest -v -rfE "${XDIST[@]}" \
    -p no:cacheprovider --ignore tests/fused/test_compile.py tests/fused \
    > "$OUT/tests-fused.log" 2>&1
  echo "fused tests: exit $?" | tee -a "$OUT/tests-fused.log" ) &
FUSED=$!
timeout "$TEST_S" $PY -m pytest -v -rfE "${XDIST[@]}" -p no:cacheprovider -k "$TESTS_K" \
  tests/test_cuda.py tests/test_conformance.py tests/test_forgetting.py tests/test_autocast.py \
  tests/test_training.py > "$OUT/tests.log" 2>&1
echo "tests: exit $?" | tee -a "$OUT/tests.log"
wait $FUSED
grep -E "FAILED|ERROR" "$OUT/tests-fused.log" | head -n 30
grep -E "FAILED|ERROR" "$OUT/tests.log" | head -n 30
tail -n 3 "$OUT/tests.log"
fi
wait
[ "$TRAIN_S" -gt 0 ] && tail -n 5 "$OUT/train.log"
cat "$WORK"/cold-*.log > "$OUT/cold.log" 2>/dev/null

# ---- phase 2: the fused kernel's tiles and warps, then the bench, alone on the GPU
unset OMP_NUM_THREADS TORCHINDUCTOR_COMPILE_THREADS
[ "$TILES_S" -gt 0 ] && timeout "$TILES_S" $PY benchmarks/fused_tiles.py --out "$WORK/tiles" \
  --lengths 4096 --tokens "$TOKENS" --schemes "$(echo $TILE_SCHEMES | tr ' ' ,)" \
  ${TILE_CONFIGS:+--configs "$TILE_CONFIGS"} 2>&1 | tee "$OUT/tiles.log"
if [ "$BENCH_S" -gt 0 ]; then
timeout "$BENCH_S" $PY -m relpos.cli.bench --device "$DEVICE" --dtype bfloat16 \
  --lengths "$LENGTHS" --tokens "$TOKENS" --mask "$MASK" --layout "$LAYOUT" --schemes "$BENCH_SCHEMES" \
  --impls "$BENCH_IMPLS" --repeats 10 --warmup 3 --max-config-seconds 10 \
  --out "$WORK/bench" 2>&1 | tee "$OUT/bench.log"
echo "bench: exit ${PIPESTATUS[0]}"
fi
# A fused step uncompiled and under torch.compile (Inductor; CUDA graphs), each mode checked
# against the uncompiled step, then timed queued beside flash SDPA run the same way.
# compiled.log has each row as it is timed; compiled.md the table, once all are.
[ "$COMPILED_S" -gt 0 ] && timeout "$COMPILED_S" $PY benchmarks/compiled_step.py --device "$DEVICE" \
  --schemes "$COMPILED_SCHEMES" --impls "$COMPILED_IMPLS" --length 4096 --tokens "$TOKENS" \
  --out "$OUT/compiled.md" > "$OUT/compiled.log" 2>&1
[ "$COMPILED_S" -gt 0 ] && cat "$OUT/compiled.log"

# ---- everything but checkpoints in one archive, beside the logs
tar --exclude='*.pt' -czf "$OUT/results.tgz" -C "$WORK" . 2>/dev/null
ls -la "$OUT"
