"""What the server's text costs a token: `serve.output.OutputText.push` one id at a time on the embedded target's
tokenizer, streamed (`DecodeStream`, the path a fast tokenizer takes) and windowed (two decodes of a few ids of
context a commit). At batch 64 every sequence commits every step, so this runs 64 times a step on the decoding
thread (the tuned "host work a step", benchmarks/RESULTS.md).

    python benchmarks/detokenize_speed.py --tokens 256 --repeats 40
"""

from __future__ import annotations

import argparse
import time

from transformers import AutoTokenizer

from blockdraft.assets import ensure_embedded_target
from blockdraft.serve.output import OutputText, StopRules

TEXT = ("Speculative decoding drafts several tokens and verifies them in one forward of the target; "
        "héllo wörld 日本語のテキスト 🙂🚀 naïve café — “quotes” ½. ") * 20


def microseconds_a_token(tokenizer: object, ids: list[int], repeats: int, stepped: bool) -> float:
    """Mean microseconds of one `push` of one id over `repeats` outputs of all of `ids`."""
    began = time.perf_counter()
    for _ in range(repeats):
        output = OutputText(tokenizer, StopRules())
        if not stepped:
            output._stream = None
        for token in ids:
            output.push([token])
    return (time.perf_counter() - began) / repeats / len(ids) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(ensure_embedded_target(progress=False))
    ids = tokenizer(TEXT)["input_ids"][: args.tokens]
    for stepped in (True, False):
        label = "streamed (DecodeStream)" if stepped else "windowed (two decodes)"
        print(f"{label}: {microseconds_a_token(tokenizer, ids, args.repeats, stepped):.1f} us a token")


if __name__ == "__main__":
    main()
