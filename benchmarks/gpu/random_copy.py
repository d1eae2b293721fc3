"""A model folder with another folder's config and tokenizer and random weights (seeded), in bf16.

Start-up checks need the target's shapes, config and tokenizer, not its weights: on the GPU machine, which reaches no
hub, the embedded SmolLM2's 98 MB GGUF takes three calls to carry, while its config and tokenizer (3.4 MB) take one.
The folder it writes loads like the real one (`blockdraft serve --target DST`); its outputs are not the model's.

    python3 benchmarks/gpu/random_copy.py SRC DST      # SRC: config.json, tokenizer files, chat template
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

KEPT = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
        "special_tokens_map.json", "merges.txt", "vocab.json")


def random_copy(source: Path, target: Path, seed: int = 0) -> None:
    """Write `target`: `source`'s config and tokenizer files, and weights drawn from the config's initializer."""
    config = AutoConfig.from_pretrained(source)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    for name in KEPT:
        if (source / name).is_file():
            shutil.copy(source / name, target / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    random_copy(args.source, args.target, args.seed)
    print(f"random-weight copy of {args.source} written to {args.target}")


if __name__ == "__main__":
    main()
