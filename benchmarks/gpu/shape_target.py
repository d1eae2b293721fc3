"""A target folder and a drafter folder at a published shape (`gpu_speed.SHAPES`), random weights in bf16, with a
tokenizer that covers the shape's vocabulary: what `blockdraft serve` and `serve_load.py` need to serve a model's
shape where no hub is reachable.

The tokenizer is another folder's (e.g. the embedded SmolLM2's config-and-tokenizer copy) with entries added until
every id of the vocabulary decodes (`qx<id>`, ids past the source's own), so random outputs detokenize and prompts
tokenize as the source's. Pair it with `--synthetic-acceptance` for serving figures at a trained drafter's
acceptance (docs/serving.md).

    python3 benchmarks/gpu/shape_target.py 8b .gpu/smol /tmp/bd/q8 --device cuda     # /tmp/bd/q8/{target,drafter}
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_speed import SHAPES, build_synthetic  # noqa: E402

from blockdraft.models.loading import save_drafter  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")


def widen_tokenizer(source: Path, target: Path, vocab: int) -> int:
    """Copy `source`'s tokenizer into `target` with its BPE vocabulary filled up to `vocab` ids; the ids added."""
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, target / name)
    path = target / "tokenizer.json"
    data = json.loads(path.read_text())
    words = data["model"]["vocab"]
    taken = set(words.values()) | {token["id"] for token in data.get("added_tokens", [])}
    added = 0
    for token_id in range(vocab):
        if token_id not in taken:
            words[f"qx{token_id}"] = token_id
            added += 1
    path.write_text(json.dumps(data))
    return added


def write_pair(shape: str, tokenizer: Path, out: Path, device: str) -> tuple[Path, Path]:
    """`out`/target and `out`/drafter at `shape`: random weights, the target's tokenizer widened to its vocabulary."""
    model, drafter = build_synthetic(shape, torch.device(device), torch.bfloat16)
    target_dir, drafter_dir = out / "target", out / "drafter"
    model.save_pretrained(target_dir)
    widen_tokenizer(tokenizer, target_dir, SHAPES[shape]["target"]["vocab_size"])
    save_drafter(drafter, drafter_dir, dtype=torch.bfloat16)
    return target_dir, drafter_dir


def temporary_pair(shape: str, tokenizer_from: str, device: str | None) -> tuple[Path, Path]:
    """`write_pair` into a temporary folder removed at exit (an 8B shape's weights are 16 GB), the tokenizer from a
    folder or the embedded target's name, the weights drawn on `device` (default: cuda where there is one): what a
    benchmark's `--shape` serves. An unknown shape is a ValueError naming the known ones, before anything is written."""
    from blockdraft.assets import resolve_target_path

    if shape not in SHAPES:
        raise ValueError(f"--shape {shape}: not one of {', '.join(sorted(SHAPES))}")
    folder = Path(tempfile.mkdtemp(prefix=f"bd-{shape}-"))
    atexit.register(shutil.rmtree, folder, True)
    return write_pair(shape, resolve_target_path(tokenizer_from), folder,
                      device or ("cuda" if torch.cuda.is_available() else "cpu"))


def serve_shape(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A benchmark's `--shape`: `args.target` and `args.drafter` become a `temporary_pair` of `args.shape` (tokenizer
    from `args.shape_tokenizer`, weights on `args.device`); an unknown shape is the parser's usage error."""
    print(f"# --shape {args.shape}: writing a random-weight target and drafter ...", file=sys.stderr, flush=True)
    try:
        args.target, args.drafter = map(str, temporary_pair(args.shape, args.shape_tokenizer, args.device))
    except ValueError as exc:
        parser.error(str(exc))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("tokenizer", type=Path, help="a folder with tokenizer.json (and its chat template)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cpu", help="where the random weights are drawn (cuda: seconds)")
    args = parser.parse_args()
    target, drafter = write_pair(args.shape, args.tokenizer, args.out, args.device)
    print(f"{args.shape}: target {target}, drafter {drafter} (random weights, bf16)")


if __name__ == "__main__":
    main()
