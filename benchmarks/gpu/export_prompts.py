"""Write a built-in prompt set as gzipped JSONL ({"id", "category", "messages"|"prompt"|"prompt_ids"} per line),
for a machine that lacks the data package (the GPU machine reaches no registry), e.g.

    python benchmarks/gpu/export_prompts.py sharegpt-turns --max-chars 3000 --out .gpu/p1/sharegpt_turns.jsonl.gz

`--max-chars` drops prompts whose text (history included) is longer: they would not fit a short `--max-length`
anyway, and the file must travel in a 64 MiB call. The ids are kept, so response caches keyed by them carry over.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

from blockdraft.prompt_sets import load_prompt_set
from blockdraft.errors import BlockdraftError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", help="built-in set or prompts file")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-chars", type=int, default=None, help="skip prompts with more characters than this")
    args = parser.parse_args()
    try:
        items = load_prompt_set(args.name)
    except BlockdraftError as exc:
        sys.exit(f"error: {exc}")
    kept = dropped = 0
    with gzip.open(args.out, "wt", encoding="utf-8") as out:
        for item in items:
            record = {"id": item.id, "category": item.category}
            if item.messages is not None:
                record["messages"] = item.messages
                size = sum(len(m["content"]) for m in item.messages)
            elif item.prompt is not None:
                record["prompt"], size = item.prompt, len(item.prompt)
            else:
                record["prompt_ids"], size = item.prompt_ids, 0
            if args.max_chars is not None and size > args.max_chars:
                dropped += 1
                continue
            out.write(json.dumps(record) + "\n")
            kept += 1
    print(f"{args.out}: {kept} prompts ({dropped} longer than --max-chars dropped)")


if __name__ == "__main__":
    main()
