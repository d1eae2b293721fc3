# The embedded drafter's training run (issue 4) on one H200, inside one 10-minute call:
# convert SmolLM2 from its GGUF, regenerate ShareGPT responses with SmolLM2 itself, train, export.
# Needs /tmp/bd/gguf.part.aa from an earlier call (.gpu/p1) and .gpu/p2 carried now.
set -u
source benchmarks/gpu/env.sh
bash benchmarks/gpu/assemble_gguf.sh || exit 1
zcat .gpu/p2/sharegpt.jsonl.gz > /tmp/bd/sharegpt.jsonl
T0=$(date +%s)
python3 -c "from blockdraft.assets import ensure_embedded_target as e; print(e())" 2>&1 | tail -1
echo "convert: $(( $(date +%s) - T0 )) s"
timeout "${TRAIN_TIMEOUT:-520}" python3 -m blockdraft train --target smollm2-135m-instruct \
  --prompts /tmp/bd/sharegpt.jsonl --out /tmp/bd/run --num-prompts "${NUM_PROMPTS:-5000}" \
  --gen-batch-size 384 --response-tokens 320 --max-length 768 --layers 3 --block-size 16 \
  --anchors-per-seq 256 --steps "${STEPS:-1800}" --batch-size 8 --save-every 300 --eval-every 0 \
  --eval-prompts 8 --eval-tokens 128 2> /tmp/bd/train.err
echo "train rc $? after $(( $(date +%s) - T0 )) s"
grep -v "Loading\|Writing" /tmp/bd/train.err | tail -c 2500
mkdir -p "$OUT/d"
cp -r /tmp/bd/run/drafter/. "$OUT/d/" 2>/dev/null
cp /tmp/bd/run/train_summary.json /tmp/bd/run/*.jsonl "$OUT/" 2>/dev/null
tar czf "$OUT/data.tgz" -C /tmp/bd/run data 2>/dev/null
ls -la "$OUT" "$OUT/d"
