# The embedded drafter's training run (issue 4) on one H200, in 10-minute calls on one warm machine.
# First call (RESUME unset): needs the GGUF pieces of .gpu/p1 and .gpu/p2 from earlier calls (in /tmp/bd) and .gpu/p3 carried now;
# converts SmolLM2 from its GGUF, regenerates ShareGPT responses with SmolLM2 itself, trains until TRAIN_TIMEOUT.
# Later calls (RESUME=1, same STEPS/BATCH/ATTENTION): continue from the last checkpoint; the run exports the
# drafter when it reaches STEPS. Results (drafter, log, summary) are copied to $OUT.
set -u
source benchmarks/gpu/env.sh
set +e
T0=$(date +%s)
if [ -z "${RESUME:-}" ]; then
  bash benchmarks/gpu/assemble_gguf.sh || exit 1
  zcat .gpu/p3/sharegpt.jsonl.gz > /tmp/bd/sharegpt.jsonl
  python3 -c "from blockdraft.assets import ensure_embedded_target as e; print(e())" 2>&1 | tail -1
  echo "convert: $(( $(date +%s) - T0 )) s"
fi
timeout "${TRAIN_TIMEOUT:-520}" python3 -m blockdraft train --target smollm2-135m-instruct \
  --prompts /tmp/bd/sharegpt.jsonl --out /tmp/bd/run --num-prompts "${NUM_PROMPTS:-5000}" \
  --gen-batch-size "${GEN_BATCH:-1024}" --response-tokens 320 --max-length 768 --layers 3 --block-size 16 \
  --anchors-per-seq 256 --steps "${STEPS:-1800}" --batch-size "${BATCH:-8}" --attention "${ATTENTION:-sdpa}" \
  --save-every "${SAVE_EVERY:-500}" --eval-every 0 --eval-prompts 8 --eval-tokens 128 ${RESUME:+--resume} \
  2> /tmp/bd/train.err
echo "train rc $? after $(( $(date +%s) - T0 )) s"
grep -v "Loading\|Writing" /tmp/bd/train.err | tail -c 2500
python3 - <<'PY'
import json
rows = [json.loads(l) for l in open("/tmp/bd/run/train_log.jsonl") if '"loss"' in l]
for lo in range(0, len(rows), max(1, len(rows) // 12)):
    part = rows[lo:lo + max(1, len(rows) // 12)]
    print(f"steps {part[0]['step']}-{part[-1]['step']}: loss {sum(r['loss'] for r in part) / len(part):.3f}"
          f"  {part[-1]['tokens_per_s'] / 1000:.1f}k tok/s")
PY
mkdir -p "$OUT/d"
cp -r /tmp/bd/run/drafter/. "$OUT/d/" 2>/dev/null
cp /tmp/bd/run/train_summary.json /tmp/bd/run/*.jsonl "$OUT/" 2>/dev/null
ls /tmp/bd/run
