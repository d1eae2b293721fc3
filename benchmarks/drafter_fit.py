"""Does a trained drafter fit the target, or only the texts it trained on? And does training see what decoding sees?

For the first prompts of a training run's response cache (`<run>/data/responses-*.jsonl`), three measurements:
- teacher-forced block accuracy (the training objective's view: every response position an anchor, the block's
  slots scored against the text) on the cached training text, and on the target's live greedy text for the same
  prompt (on this device and dtype: text the drafter never saw);
- live DFlash acceptance (tau, per position) while generating that text;
- parity: the teacher-forced outcome at exactly the anchors where live steps began, step by step, against the live
  acceptance (equal up to numerics when training and decoding compute the same thing);
- the target's own confidence on the cached text: the mean probability of its top token and the mass of its top 32
  at each response position (what `--distill-topk` labels carry beyond the text's token: the rest of that mass).
A large gap between the two teacher-forced rows is memorisation; a parity below ~0.95 is a train/decode mismatch.
Uniform anchors score above live tau even with perfect parity: live steps begin right after a rejection.

    python benchmarks/drafter_fit.py --data runs/smollm2/data --limit 12   # the embedded pair by default
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import torch

from blockdraft.assets import EMBEDDED_TARGET_NAME, resolve_target_path
from blockdraft.decoding.draft import DFlashProposer
from blockdraft.decoding.generate import generate
from blockdraft.models.drafter import DFlashDrafter
from blockdraft.models.loading import load_drafter, load_target, resolve_dtype
from blockdraft.models.target import Target
from blockdraft.pair import EMBEDDED_DRAFTER
from blockdraft.train.data import Sample
from blockdraft.train.features import compute_taps
from blockdraft.train.masks import BlockLayout
from blockdraft.train.objective import BlockObjective, block_targets, slot_weights
from blockdraft.train.regenerate import CACHE_GLOB, read_cache

ANCHOR_CHUNK = 64  # anchors per drafter pass: bounds the dense attention masks of long responses
SOFT_K = 32  # the top-k whose mass the confidence line reports


@torch.no_grad()
def teacher_forced(target: Target, drafter: DFlashDrafter, ids: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per response anchor: slot hits [anchors, B-1] (label inside the text) and scored-slot mask, as training scores them."""
    cfg, objective = drafter.cfg, BlockObjective(drafter, "sdpa")
    seq = torch.tensor([ids], device=target.device)
    lengths = torch.tensor([len(ids)], device=target.device)
    taps = compute_taps(target, seq, lengths, cfg.target_layer_ids)
    hits, scored = [], []
    for first in range(start, len(ids) - 1, ANCHOR_CHUNK):
        anchors = torch.arange(first, min(first + ANCHOR_CHUNK, len(ids) - 1), device=target.device).unsqueeze(0)
        found = block_targets(seq, lengths, anchors, torch.ones_like(anchors, dtype=torch.bool), cfg.mask_token_id,
                              slot_weights(cfg.block_size))
        embeds = target.embed(found.block_ids, cfg.input_embedding_scale)
        hidden = objective.hidden(taps, embeds, BlockLayout(anchors, cfg.block_size, len(ids)))
        hidden = hidden.view(1, anchors.shape[1], cfg.block_size, -1)[:, :, 1:]
        predicted = drafter.logits(hidden, lm_head=target.lm_head).argmax(-1)
        hits.append((predicted == found.labels)[0])
        scored.append((found.weights > 0)[0])
    return torch.cat(hits), torch.cat(scored)


@torch.no_grad()
def target_confidence(target: Target, ids: list[int], start: int) -> torch.Tensor:
    """[response positions, 2]: the target's probability of its top token and the mass of its top SOFT_K there."""
    logits = target.model(input_ids=torch.tensor([ids], device=target.device)).logits[0, start - 1 : -1]
    top = logits.float().softmax(-1).topk(min(SOFT_K, logits.shape[-1]), dim=-1).values
    return torch.stack([top[:, 0], top.sum(-1)], dim=-1)


def _chain(hits: torch.Tensor) -> torch.Tensor:
    """Committed tokens per anchor if it began a step: consecutive hits from slot 1, plus the bonus."""
    return 1 + torch.cumprod(hits.int(), dim=1).sum(1)


def _summary(hits: list[torch.Tensor], scored: list[torch.Tensor]) -> dict[str, Any]:
    h, s = torch.cat(hits), torch.cat(scored)
    whole = s.all(1)
    return {"slot_accuracy": ((h & s).sum(0) / s.sum(0).clamp_min(1)).tolist(),
            "chain_tau": _chain(h[whole]).float().mean().item()}


def measure(target: Target, drafter: DFlashDrafter, samples: list[Sample], max_new_tokens: int) -> dict[str, Any]:
    """The three measurements over the samples (see the module docstring)."""
    proposer = DFlashProposer(drafter, target)
    slots = drafter.cfg.block_size - 1
    cached: tuple[list, list] = ([], [])
    live: tuple[list, list] = ([], [])
    lengths: list[int] = []
    confidence = []
    agree = steps = shared = 0
    for sample in samples:
        confidence.append(target_confidence(target, sample.ids, sample.start))
        prompt = sample.ids[: sample.start]
        result = generate(target, prompt, proposer, max_new_tokens=max_new_tokens)
        text = sample.ids[sample.start:]
        shared += next((i for i, (a, b) in enumerate(zip(result.token_ids, text)) if a != b), min(len(text), len(result.token_ids)))
        for kind, ids in ((cached, sample.ids), (live, prompt + result.token_ids)):
            h, s = teacher_forced(target, drafter, ids, sample.start)
            kind[0].append(h)
            kind[1].append(s)
        begun = list(itertools.accumulate([0] + result.acceptance_lengths[:-1]))[:-1]  # the last step may be cut
        forced = _chain(live[0][-1][begun] & live[1][-1][begun]).tolist()
        agree += sum(f == a for f, a in zip(forced, result.acceptance_lengths))
        steps += len(begun)
        lengths += result.acceptance_lengths
    per_position = [sum(a > k for a in lengths) / len(lengths) for k in range(1, slots + 1)]
    return {"samples": len(samples), "shared_prefix_tokens": shared / len(samples),
            "teacher_forced_cached": _summary(*cached), "teacher_forced_live": _summary(*live),
            "live": {"tau": sum(lengths) / len(lengths), "per_position": per_position},
            "parity": agree / max(steps, 1), "parity_steps": steps,
            "target_top1_prob": torch.cat(confidence)[:, 0].mean().item(),
            f"target_top{SOFT_K}_mass": torch.cat(confidence)[:, 1].mean().item()}


def _samples(data: Path, limit: int, min_response: int) -> list[Sample]:
    picked = [s for s in read_cache(data).values() if len(s.ids) - s.start >= min_response][:limit]
    if not picked:
        sys.exit(f"--data {data}: no cached response of >= {min_response} tokens; pass a training run's data folder "
                 f"(its {CACHE_GLOB} files)")
    return picked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="A training run's data folder (its response cache).")
    parser.add_argument("--target", default=EMBEDDED_TARGET_NAME)
    parser.add_argument("--drafter", default=str(EMBEDDED_DRAFTER))
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument("--min-response", type=int, default=120, help="Skip cached responses shorter than this.")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    target, _ = load_target(str(resolve_target_path(args.target)), device, resolve_dtype(args.dtype, device))
    drafter = load_drafter(args.drafter, target).to(device=device, dtype=target.dtype).eval()
    report = measure(target, drafter, _samples(args.data, args.limit, args.min_response), args.max_new_tokens)
    acc = lambda row: " / ".join(f"{x:.2f}" for x in row[:4])  # noqa: E731
    print(f"{report['samples']} prompts; live text follows the cached one for {report['shared_prefix_tokens']:.1f} tokens")
    print("| text | slot 1..4 accuracy (teacher-forced) | chain tau, all anchors |\n|---|---|---|")
    for name in ("cached", "live"):
        row = report[f"teacher_forced_{name}"]
        print(f"| {name} | {acc(row['slot_accuracy'])} | {row['chain_tau']:.2f} |")
    print(f"live decoding: tau {report['live']['tau']:.2f}, positions 1..4 {acc(report['live']['per_position'])}")
    print(f"parity at the live step anchors: {report['parity']:.3f} of {report['parity_steps']} steps")
    print(f"the target on the cached text: its top token has probability {report['target_top1_prob']:.3f} on average, "
          f"its top {SOFT_K} {report[f'target_top{SOFT_K}_mass']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
