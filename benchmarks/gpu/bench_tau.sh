# Issue 4's quality measurement on the GPU machine (repo root, after the GGUF and prompts are in /tmp/bd): tau at
# T=0, 256 new tokens, float32, fast engine, AR + DFlash + DDTree at BUDGETS nodes (default 32; a list sweeps
# them), Spec-Bench 5 per category on GPU 0 and the first 24 HumanEval problems on GPU 1 (SINGLE=1 runs them one
# after the other on the visible GPU: two drafters benched side by side, one GPU each, under different TAGs).
# DRAFTER defaults to the run's export. Writes $OUT/${TAG}sb.json and $OUT/${TAG}he.json and prints each summary.
source benchmarks/gpu/env.sh
DRAFTER=${DRAFTER:-/tmp/bd/run/drafter}
B="python3 -m blockdraft bench --drafter $DRAFTER --methods ar,dflash,ddtree --budget ${BUDGETS:-32} --max-new-tokens 256 \
  --device cuda --dtype float32 --engine fast"
if [ -n "${SINGLE:-}" ]; then
  $B --prompts /tmp/bd/spec_bench_question.jsonl --per-category 5 --json-out "$OUT/${TAG:-}sb.json" > /tmp/bd/${TAG:-}sb.txt 2>&1
  $B --prompts /tmp/bd/humaneval.jsonl --limit 24 --json-out "$OUT/${TAG:-}he.json" > /tmp/bd/${TAG:-}he.txt 2>&1
else
  CUDA_VISIBLE_DEVICES=0 $B --prompts /tmp/bd/spec_bench_question.jsonl --per-category 5 --json-out "$OUT/${TAG:-}sb.json" \
    > /tmp/bd/${TAG:-}sb.txt 2>&1 &
  CUDA_VISIBLE_DEVICES=1 $B --prompts /tmp/bd/humaneval.jsonl --limit 24 --json-out "$OUT/${TAG:-}he.json" > /tmp/bd/${TAG:-}he.txt 2>&1
  wait
fi
grep -v "Warning\|warn" /tmp/bd/${TAG:-}sb.txt | tail -c 3000
grep -v "Warning\|warn" /tmp/bd/${TAG:-}he.txt | tail -c 1500
