"""Loading glue shared by every front end: names -> (target, tokenizer, drafter), and prompt items -> token ids.

It sits below cli, doctor, bench and serve so none of them imports another to load a model. The embedded pair is
the default pair everywhere: the embedded target with no --drafter gets the drafter that ships with blockdraft.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from blockdraft.synthetic_acceptance import SyntheticAcceptance

EMBEDDED_DRAFTER = Path(__file__).resolve().parent / "drafters" / "smollm2-135m-instruct-dflash"


def default_drafter(target: str, drafter: Optional[str]) -> Optional[str]:
    """The drafter the user named; for the embedded target with none named, the shipped one."""
    from blockdraft.assets import EMBEDDED_TARGET_NAME

    if drafter is None and target.lower() == EMBEDDED_TARGET_NAME:
        return str(EMBEDDED_DRAFTER)
    return drafter


class Loaded:
    """A target (with tokenizer and stop ids) and an optional drafter, loaded once per command."""

    def __init__(
        self, target: str, drafter: Optional[str], device: Optional[str], dtype: Optional[str], engine: str = "hf"
    ) -> None:
        from transformers.utils import logging as hf_logging

        from blockdraft.config import load_draft_config
        from blockdraft.fast.engines import check_engine, make_target
        from blockdraft.models.loading import load_drafter, load_target, resolve_device, resolve_dtype

        hf_logging.disable_progress_bar()
        check_engine(engine)
        if drafter:
            load_draft_config(drafter)  # a bad drafter fails before minutes of target loading
        dev = resolve_device(device)
        hf_target, self.tokenizer = load_target(target, dev, resolve_dtype(dtype, dev))
        self.target = make_target(hf_target.model, engine)
        self.drafter = load_drafter(drafter, self.target) if drafter else None
        generation = getattr(self.target.model, "generation_config", None)
        self.generation_eos = getattr(generation, "eos_token_id", None)

    def stops(self, extra: list[int], ignore_eos: bool) -> tuple[int, ...]:
        from blockdraft.prompting import stop_tokens

        return tuple(extra) if ignore_eos else stop_tokens(self.tokenizer, self.generation_eos, extra)

    def dial(self, spec: Optional[str], instead: str) -> Optional[SyntheticAcceptance]:
        """--synthetic-acceptance: the dialled profile at this drafter's depth, set on the target (benchmarks only;
        None without the flag). Without a drafter there is nothing to dial: the error says to run `instead`."""
        from blockdraft.errors import BlockdraftError
        from blockdraft.synthetic_acceptance import SyntheticAcceptance

        if spec is None:
            return None
        if self.drafter is None:
            raise BlockdraftError(f"--synthetic-acceptance dials a drafter's acceptance: {instead} with a drafter, or "
                                  "leave it out")
        self.target.synthetic = SyntheticAcceptance.parse(spec, self.drafter.cfg.block_size - 1)
        return self.target.synthetic

    def decode(self, ids: list[int]) -> Optional[str]:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)


def encode_item(item: Any, tokenizer: Any, thinking: bool = False) -> list[int]:
    """A PromptItem (ids, chat messages or text) -> prompt token ids."""
    from blockdraft.prompting import encode_messages, encode_text

    if item.prompt_ids is not None:
        return list(item.prompt_ids)
    if item.messages is not None:
        return encode_messages(item.messages, tokenizer, thinking)
    return encode_text(item.prompt, tokenizer)


DEMO_ID_LENGTH = 12  # the counting prompts' length, for a target without a chat template


def demo_prompt_ids(tokenizer: Any, vocab: int) -> list[list[int]]:
    """One chat, one code and one math prompt of `blockdraft demo` as ids (what a server's self-check, its warm-up
    and `tune` decode); without a tokenizer or chat template, three counting sequences."""
    from blockdraft.prompt_sets import load_prompt_set

    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        return [[(start + i) % vocab for i in range(DEMO_ID_LENGTH)] for start in (1, 7, 13)]
    return [encode_item(item, tokenizer) for item in load_prompt_set("demo", per_category=1)]
