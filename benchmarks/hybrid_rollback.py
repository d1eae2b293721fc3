"""Rollback cost on CPU: verify forward over [anchor] + 15 drafts, then crop; replay runs only on a rejection."""
import sys, time, statistics
sys.path.insert(0, "tests")
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from blockdraft.models.target import Target
from blockdraft.decoding.draft import Draft

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
SIZES = {
    "tiny (4 layers, hidden 32)": dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=64, linear_key_head_dim=8, linear_num_key_heads=2, linear_value_head_dim=8, linear_num_value_heads=4),
    "larger (8 layers, hidden 512)": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
        head_dim=64, intermediate_size=1536, linear_key_head_dim=64, linear_num_key_heads=4, linear_value_head_dim=64, linear_num_value_heads=8),
}
VOCAB, PROMPT, BLOCK = 1024, 256, 16

for name, size in SIZES.items():
    layer_types = (["linear_attention"] * 3 + ["full_attention"]) * (size["num_hidden_layers"] // 4)
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(vocab_size=VOCAB, max_position_embeddings=4096, layer_types=layer_types, **size)).eval()
    target = Target(model)
    prompt = torch.randint(0, VOCAB, (1, PROMPT))
    block = torch.randint(0, VOCAB, (1, BLOCK))
    positions = torch.arange(PROMPT, PROMPT + BLOCK)
    tree = Draft(tokens=block[0, 1:], parents=[-1, -1, 0, 0, 1, 2, 2, 3, 4, 5, 6, 7, 8, 9, 10], depths=[1, 1, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5])

    def step(keep, tree_draft=None):
        def run():
            cache = target.new_cache()
            target.forward(prompt, torch.arange(PROMPT), cache, last_logits_only=True)
            t0 = time.perf_counter()
            if tree_draft is None:
                target.forward(block, positions, cache)
                cache.crop(PROMPT + keep)
            else:
                mask = tree_draft.tree_mask(len(cache), target.device)
                target.forward(block, tree_draft.positions(PROMPT, target.device), cache, attention_mask=mask)
                cache.compact(PROMPT, torch.arange(keep) if keep == 1 else torch.tensor([0, 1, 4, 8, 12][:keep]))
            run.dt = time.perf_counter() - t0
        ts = []
        for _ in range(12):
            run(); ts.append(run.dt)
        return statistics.median(ts[2:]) * 1e3

    with torch.inference_mode():
        full = step(BLOCK)
        print(f"{name}: chain step (verify 16 rows) all accepted, no replay: {full:.2f} ms")
        for keep in (1, 4, 8):
            t = step(keep)
            print(f"  rejection, keep {keep:2d} rows -> verify + restore + replay {keep}: {t:.2f} ms (+{t - full:.2f})")
        print(f"  tree (16 nodes, depth 5) verify + compact keep 5: {step(5, tree):.2f} ms")
