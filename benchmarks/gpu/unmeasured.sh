#!/usr/bin/env bash
# What was built since the last GPU run, checked and timed on the GPU machine (no GGUF needed). From the repo root,
# carrying .gpu/p3 and .gpu/p4 (pytest's wheels):
#   source benchmarks/gpu/env.sh && bash benchmarks/gpu/unmeasured.sh kernels       # ~6 min (autotuning every shape)
#   source benchmarks/gpu/env.sh && bash benchmarks/gpu/unmeasured.sh correctness   # ~3 min
#   source benchmarks/gpu/env.sh && bash benchmarks/gpu/unmeasured.sh tree          # ~1 min: the tree kernel's tests
#   source benchmarks/gpu/env.sh && bash benchmarks/gpu/unmeasured.sh fewrows       # the few-row products' tests
#   source benchmarks/gpu/env.sh && bash benchmarks/gpu/unmeasured.sh onerow        # session 27's kernels' tests
#   source benchmarks/gpu/env.sh && bash benchmarks/gpu/unmeasured.sh fewfused      # the fused units at 2-128 rows
#   source benchmarks/gpu/env.sh && bash benchmarks/gpu/unmeasured.sh speed         # ~7 min
#   source benchmarks/gpu/env.sh && bash benchmarks/gpu/unmeasured.sh roofline      # issue 22's 8B table, one invocation
#   source benchmarks/gpu/env.sh && bash benchmarks/gpu/unmeasured.sh blas          # ~1 min: BLAS settings, 8B products
#   (after the GGUF is assembled, as in RESULTS) bash benchmarks/gpu/unmeasured.sh e2e   # ~4 min
#   (same) bash benchmarks/gpu/unmeasured.sh load   # 7.5 min in session 25, over 9.5 in session 26 (a 600 s call cut
#     its last level; --json-out now keeps the levels run): issue 22's table with the engine's own time per level
#   (same) bash benchmarks/gpu/unmeasured.sh steps  # ~5 min: batched DFlash steps at 1/4/16; schedule vs fixed steps
#   source benchmarks/gpu/env.sh && bash benchmarks/gpu/unmeasured.sh admit   # ~1.5 min: prefill and join costs
#   source benchmarks/gpu/env.sh && bash benchmarks/gpu/save_kernels.sh   # after the runs: compiled kernels into $OUT,
#     to carry as .gpu/kernels/ so a fresh machine skips the compiles (env.sh unpacks them)
# Each step writes $OUT/<step>.log as it runs and has its own time limit, so a call cut short still returns every
# step that finished (session 16 lost a 9-minute call whose output only went to stdout).
set -u
OUT=${OUT:-/tmp/bd/out}
mkdir -p "$OUT"
NOISE="warn|softmax|inductor|important use|split the reduction"

step() {
  local name=$1 limit=$2
  shift 2
  echo "## $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "## $name: exit $?"
  grep -v -i -E "$NOISE" "$OUT/$name.log" | tail -n 40
}

case "${1:-}" in
  kernels)  # session 17: 24 of 59 passed (none failed) in 150 s, Triton autotuning every config for every shape
    step block_attention_tests 150 python3 -m pytest -p no:cacheprovider tests/test_block_attention.py \
      tests/test_qkv_rope.py
    step kernel_tests 330 python3 -m pytest -p no:cacheprovider tests/test_kernels.py
    ;;
  fewrows)  # every config of the weights-first kernel (the whole test file autotunes every shape: session 26 ran 14
    # of its cases in 240 s), the engine's few-row routing and its CUDA kernels decoding, the merging attention
    # (session 27: 8 passed in 99 s)
    step fewrows_tests 300 python3 -m pytest -p no:cacheprovider tests/test_kernels.py tests/test_block_attention.py \
      -k "every_weights_first or few_row or split_max_n or cuda_kernels or gates_in or merging or counters"
    ;;
  onerow)  # session 27's kernels: the GEMVs that norm as they load and add the residual as they store, a layer
    # chaining them, every GEMV config (K whole or split), the tree verify past 64 rows on the attention kernel,
    # options timed as calls in one graph
    step onerow_tests 300 python3 -m pytest -p no:cacheprovider tests/test_kernels.py -k "norming or residual or \
      few_row_layers or every_gemv_config or may_split or past_the_two_matmul or timed_as_calls or cuda_kernels"
    ;;
  fewfused)  # the weights-first kernel with the GEMV's epilogues (gating, norm, residual; every config), the units
    # routing 2-128 rows to it, a layer chaining them against the pending sums, and the engine decoding on them
    step fewfused_tests 240 python3 -m pytest -p no:cacheprovider tests/test_kernels.py -k "epilogues or \
      few_row_units or few_row_layers or gates_in or norming or residual_gemv or cuda_kernels or batched_sequences"
    ;;
  tree)  # the DDTree tree kernel against the host heap and the tensor search, and a fast-engine decode through it
    step tree_tests 200 python3 -m pytest -p no:cacheprovider tests/test_tree_kernel.py
    ;;
  correctness)
    step batch_graphs 200 python3 benchmarks/gpu/check_batch_graphs.py
    step tree_search 150 python3 benchmarks/tree_search_speed.py --device cuda --slots 15 --vocab 49152
    ;;
  speed)
    step gpu_speed 330 python3 benchmarks/gpu_speed.py --engines fast,fast-kernels --budgets 32,64,256 \
      --json "$OUT/speed.json"
    step profile 200 python3 benchmarks/gpu/profile_step.py --rows 1,16 --configs compiled,compiled-kernels
    ;;
  blas)  # the 8B step's weight products per BLAS setting (cuBLAS / cuBLASLt, split-K reductions in bf16 or fp32), and our one-row GEMV
    step blas 150 python3 benchmarks/gpu/blas_speed.py --rows 1,4,16,64 --json "$OUT/blas.json"
    ;;
  roofline)  # session 14: the batched AR step 1.44-1.63x its roofline; the 8B shape, random weights, bf16
    step roofline 550 python3 benchmarks/batch_roofline.py --json "$OUT/roofline.json"
    ;;
  e2e)  # the embedded pair in float32: every engine must give the same ids, kernels on or off
    step e2e 400 python3 benchmarks/gpu_speed.py --skip-synthetic --target smollm2-135m-instruct \
      --drafter src/blockdraft/drafters/smollm2-135m-instruct-dflash --prompts demo --max-new-tokens 256 --budget 32 \
      --e2e-engines hf,fast,fast-kernels --e2e-dtype float32 --json "$OUT/e2e.json"
    ;;
  load)  # session 22's run of this (four methods, four levels, no paired runs) took 429 s; at 64 each client makes
    # 4 requests a level (one a round made that level its ramp and its tail, session 19)
    step load 590 python3 benchmarks/serve_load.py --device cuda --dtype bfloat16 --methods ar,dflash,ddtree,schedule \
      --budget 32 --concurrency 1,4,16,64 --requests 128 --per-client 4 --rounds 2 --paired 0 --max-num-seqs 64 \
      --max-tokens 256 --time-cap 20 --pin 2-5:6-7:8 --json-out "$OUT/load.json"
    ;;
  steps)  # session 18: the server's own DFlash steps ran 1,250 tok/s at batch 1 and 2,646 at batch 3-4 (AR 651 and
    # 2,293); session 19's first profile had graph captures inside its timed steps, now counted and left out (medians)
    for run in "dflash 1" "dflash 4" "dflash 16" "ar 1" "ar 4" "ddtree 1"; do
      set -- $run
      step "steps_$1_$2" 90 python3 benchmarks/batch_step_profile.py --device cuda --dtype bfloat16 --method "$1" \
        --batch "$2" --steps 40
    done
    ;;
  admit)  # session 18: prefill 31.8 -> 1.39 ms once graphed; joins of 1, 4 and 16 requests
    step admit 200 python3 benchmarks/gpu/admit_profile.py --prompt-tokens 32,128 --joins 8
    ;;
  *)
    echo "usage: bash benchmarks/gpu/unmeasured.sh kernels|fewrows|onerow|fewfused|tree|correctness|speed|blas|roofline|e2e|load|steps|admit" >&2
    exit 2
    ;;
esac
