# A session's drafter work on an nvidia-h200-x2 machine as one background chain, so that no GPU waits on a call: start
# it with setsid once the GGUF is assembled and the target converted (it outlives the call); collect /tmp/bd/out at
# the end. Earlier response caches go into /tmp/bd/run before the training starts: extracted by the starting call, or
# carried by later calls that then `touch /tmp/bd/cache.ready` (CACHE_WAIT=1 makes the chain wait for that file).
#  1. New requests SmolLM2 writes itself (SELF_PROMPTS each, default 28,000), answered at NEW_TEMPS (default 0: greedy
#     only, which trained as well as greedy + T=0.7 in session 10 at half the generation time), one seed per GPU
#     (SELF_SEEDS, default "29 31"); with SWEEP_BUDGETS set, GPU 0 instead sweeps the starting drafter's DDTree budgets
#     on Spec-Bench and HumanEval and only the first seed is written.
#  2. Training from the shipped drafter (FROM=<drafter folder> for another) on the cached greedy answers of the
#     requests of TRAIN_SEEDS (default SELF_SEEDS), --seed 2, STEPS (default 2,200) capped at ARM_TIMEOUT seconds
#     (default 540). By default one run (ARM_A's settings, default GAMMA=3) under DDP on both GPUs: twice the samples
#     in the same time. With ARM_B set, an A/B instead: ARM_A and ARM_B (extra settings for train_smollm2.sh), one GPU
#     each, same steps and sample order.
#  3. The bench (bench_tau.sh: DFlash and DDTree at BUDGETS, default 32,256; none: no bench) on Spec-Bench and
#     HumanEval, one GPU each, or each A/B arm on its own GPU. /tmp/bd/chain.done marks the end; logs are /tmp/bd/*.log.
# Copy a finished drafter to $OUT in the very call that sees it done: a lease can end between two calls, and
# /tmp/bd with it (session 11 lost a second round's drafter that way).
# Session 9 ran it as SWEEP_BUDGETS=32,64,128,256,512 SELF_PROMPTS=16000 SELF_SEEDS=13 TRAIN_SEEDS="7 11 13"
# CACHE_WAIT=1 NEW_TEMPS=0,0.7 ARM_A="GAMMA=7 GEN_TEMPS=0,0.7" ARM_B="GAMMA=3 GEN_TEMPS=0,0.7" ARM_TIMEOUT=480
# BUDGETS=32 (then named gamma_ab.sh); session 10 as SELF_PROMPTS=16000 SELF_SEEDS="17 19" TRAIN_SEEDS="13 17 19"
# NEW_TEMPS=0,0.7 ARM_A="GAMMA=3 GEN_TEMPS=0,0.7" ARM_B=GAMMA=3 ARM_TIMEOUT=480 BUDGETS=32; session 11 as
# SELF_SEEDS="25 27" TRAIN_SEEDS="21 23 25 27" (the cache of seeds 21 and 23 extracted by the starting call).
set -u
source benchmarks/gpu/env.sh
OUTDIR=/tmp/bd/out
mkdir -p $OUTDIR
START=${FROM:-src/blockdraft/drafters/smollm2-135m-instruct-dflash}
BUDGETS=${BUDGETS:-32,256}
read -r -a SEEDS <<< "${SELF_SEEDS:-29 31}"
generate() {
  CUDA_VISIBLE_DEVICES=$1 OUT=$OUTDIR GEN_BATCH=2048 SELF_PROMPTS=${SELF_PROMPTS:-28000} SELF_SEED=$2 GEN_TEMPS=${NEW_TEMPS:-0} \
    NUM_PROMPTS=200000 TRAIN_TIMEOUT=0 bash benchmarks/gpu/train_smollm2.sh > /tmp/bd/gen$2.log 2>&1
}
if [ -n "${SWEEP_BUDGETS:-}" ]; then
  (CUDA_VISIBLE_DEVICES=0 SINGLE=1 OUT=$OUTDIR TAG=sweep BUDGETS=$SWEEP_BUDGETS DRAFTER=$START \
    bash benchmarks/gpu/bench_tau.sh > /tmp/bd/sweep.log 2>&1) &
  generate 1 "${SEEDS[0]}"
else
  generate 0 "${SEEDS[0]}" &
  [ ${#SEEDS[@]} -gt 1 ] && { sleep 10; generate 1 "${SEEDS[1]}"; }
fi
wait
echo "generation done: $(date)" >> /tmp/bd/chain.log
[ -n "${CACHE_WAIT:-}" ] && while [ ! -e /tmp/bd/cache.ready ]; do sleep 5; done
for s in ${TRAIN_SEEDS:-${SEEDS[*]}}; do cat /tmp/bd/run/data/self-prompts-s$s-*.jsonl; done > /tmp/bd/new.jsonl
echo "training prompts: $(wc -l < /tmp/bd/new.jsonl)" >> /tmp/bd/chain.log
C="PREPARED=1 COMPILE=1 PROMPTS=/tmp/bd/new.jsonl LR=3e-4 WARMUP=0.01 GEN_TEMPS=0 NUM_PROMPTS=200000 \
  STEPS=${STEPS:-2200} BATCH=16 SAVE_EVERY=200 EVAL_PROMPTS=0 TRAIN_TIMEOUT=${ARM_TIMEOUT:-540} SEED=2 INIT=$START OUT=$OUTDIR"
train_arm() {  # GPU, arm tag, the arm's settings
  env $C $3 CUDA_VISIBLE_DEVICES=$1 RUN=/tmp/bd/run$2 TAG=$2 bash benchmarks/gpu/train_smollm2.sh > /tmp/bd/$2.log 2>&1
}
bench_arm() {  # GPU, arm tag
  CUDA_VISIBLE_DEVICES=$1 SINGLE=1 OUT=$OUTDIR DRAFTER=/tmp/bd/run$2/drafter TAG=$2 BUDGETS=$BUDGETS \
    bash benchmarks/gpu/bench_tau.sh > /tmp/bd/$2bench.log 2>&1
}
if [ -z "${ARM_B:-}" ]; then  # one run on both GPUs: DDP training, then Spec-Bench and HumanEval side by side
  train_arm 0,1 A "NPROC=2 ${ARM_A:-GAMMA=3}"
  echo "training done: $(date)" >> /tmp/bd/chain.log
  [ "$BUDGETS" = none ] || OUT=$OUTDIR DRAFTER=/tmp/bd/runA/drafter TAG=A BUDGETS=$BUDGETS \
    bash benchmarks/gpu/bench_tau.sh > /tmp/bd/Abench.log 2>&1
else
  train_arm 0 A "${ARM_A:-GAMMA=3}" &
  train_arm 1 B "$ARM_B"
  wait
  echo "training done: $(date)" >> /tmp/bd/chain.log
  if [ "$BUDGETS" != none ]; then bench_arm 0 A & bench_arm 1 B; wait; fi
fi
echo "benches done: $(date)" >> /tmp/bd/chain.log
touch /tmp/bd/chain.done
