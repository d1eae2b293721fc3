# Session 9's GPU work on an nvidia-h200-x2 machine as one background chain, so that no GPU waits on a call: start it
# with setsid once the GGUF is assembled and the target converted (it outlives the call), let later calls carry the
# earlier response cache into /tmp/bd/run and then `touch /tmp/bd/cache.ready`, and collect /tmp/bd/out at the end.
#  1. GPU 0: the shipped drafter's DDTree budget sweep (BUDGETS, default 32,64,128,256,512) on Spec-Bench and
#     HumanEval; GPU 1 meanwhile: SELF_PROMPTS (default 16000) new requests under seed SELF_SEED (13), answered
#     greedily and at T=0.7.
#  2. An A/B from the shipped drafter on the never-trained requests (seeds 7, 11 and the new one), one GPU each, same
#     data, steps and sample order (--seed 2): slot-weight decay gamma 7 (the paper's, B=16) vs GAMMA_B (default 3,
#     more weight on the early slots that decide acceptance at this drafter's tau).
#  3. Both arms benched (DDTree@32), one GPU each. /tmp/bd/chain.done marks the end; logs are /tmp/bd/*.log.
set -u
source benchmarks/gpu/env.sh
OUTDIR=/tmp/bd/out
mkdir -p $OUTDIR
SHIPPED=src/blockdraft/drafters/smollm2-135m-instruct-dflash
S=${SELF_SEED:-13}
(CUDA_VISIBLE_DEVICES=0 SINGLE=1 OUT=$OUTDIR TAG=sweep BUDGETS=${BUDGETS:-32,64,128,256,512} DRAFTER=$SHIPPED \
  bash benchmarks/gpu/bench_tau.sh > /tmp/bd/sweep.log 2>&1) &
CUDA_VISIBLE_DEVICES=1 OUT=$OUTDIR GEN_BATCH=2048 SELF_PROMPTS=${SELF_PROMPTS:-16000} SELF_SEED=$S GEN_TEMPS=0,0.7 \
  NUM_PROMPTS=200000 TRAIN_TIMEOUT=0 bash benchmarks/gpu/train_smollm2.sh > /tmp/bd/gen.log 2>&1
wait
echo "sweep and generation done: $(date)" >> /tmp/bd/chain.log
while [ ! -e /tmp/bd/cache.ready ]; do sleep 5; done
cat /tmp/bd/run/data/self-prompts-s7-*.jsonl /tmp/bd/run/data/self-prompts-s11-*.jsonl \
  /tmp/bd/run/data/self-prompts-s$S-*.jsonl > /tmp/bd/new.jsonl
C="PREPARED=1 COMPILE=1 PROMPTS=/tmp/bd/new.jsonl LR=3e-4 WARMUP=0.01 GEN_TEMPS=0,0.7 NUM_PROMPTS=200000 \
  STEPS=${STEPS:-2200} BATCH=16 SAVE_EVERY=200 EVAL_PROMPTS=0 TRAIN_TIMEOUT=480 SEED=2 INIT=$SHIPPED OUT=$OUTDIR"
env $C CUDA_VISIBLE_DEVICES=0 RUN=/tmp/bd/runA TAG=A bash benchmarks/gpu/train_smollm2.sh > /tmp/bd/A.log 2>&1 &
env $C CUDA_VISIBLE_DEVICES=1 RUN=/tmp/bd/runB TAG=B GAMMA=${GAMMA_B:-3} bash benchmarks/gpu/train_smollm2.sh \
  > /tmp/bd/B.log 2>&1
wait
echo "training done: $(date)" >> /tmp/bd/chain.log
(CUDA_VISIBLE_DEVICES=0 SINGLE=1 OUT=$OUTDIR DRAFTER=/tmp/bd/runA/drafter TAG=A bash benchmarks/gpu/bench_tau.sh \
  > /tmp/bd/Abench.log 2>&1) &
CUDA_VISIBLE_DEVICES=1 SINGLE=1 OUT=$OUTDIR DRAFTER=/tmp/bd/runB/drafter TAG=B bash benchmarks/gpu/bench_tau.sh \
  > /tmp/bd/Bbench.log 2>&1
wait
echo "benches done: $(date)" >> /tmp/bd/chain.log
touch /tmp/bd/chain.done
