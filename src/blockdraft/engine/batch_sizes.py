"""How many sequences a batch decodes: the batch-size buckets its graphs are captured for, and what their K/V
cache needs of the device's memory."""

from __future__ import annotations

import torch

from blockdraft.errors import BlockdraftError
from blockdraft.models.target import Target


def kv_cache_bytes(target: Target, sequences: int, length: int) -> int:
    """K/V bytes of `sequences` sequences of `length` tokens on this target (its attention layers only: a hybrid
    target's linear-attention states do not grow with the length)."""
    config = target.model.config.get_text_config(decoder=True)
    attention = sum(kind in ("full_attention", "sliding_attention") for kind in target.layer_types)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    element = torch.finfo(target.dtype).bits // 8
    return sequences * length * attention * 2 * kv_heads * head_dim * element


def linear_state_bytes(target: Target, rows: int = 17) -> int:
    """A hybrid target's per-sequence linear-attention memory, whatever the length: each linear layer's float32
    recurrent state and conv window, and the row buffers of a `rows`-row verify (what its commit reads,
    `fast.linear_states`); 0 for other targets."""
    config = target.model.config.get_text_config(decoder=True)
    layers = sum(kind == "linear_attention" for kind in target.layer_types)
    if not layers:
        return 0
    heads, key_dim = config.linear_num_value_heads, config.linear_key_head_dim
    value_dim, key_heads = config.linear_value_head_dim, config.linear_num_key_heads
    channels = 2 * key_heads * key_dim + heads * value_dim
    element = torch.finfo(target.dtype).bits // 8
    window = channels * (config.linear_conv_kernel_dim - 1) * element
    row = channels * element + heads * (key_dim + value_dim + 2) * 4
    return layers * (heads * key_dim * value_dim * 4 + window + rows * row)


def sequence_bytes(target: Target, sequences: int, length: int) -> int:
    """The memory `sequences` sequences of `length` tokens hold: their K/V and a hybrid's linear states."""
    return kv_cache_bytes(target, sequences, length) + sequences * linear_state_bytes(target)


def bucket_sizes(most: int) -> list[int]:
    """1, 2, 4, ... up to `most` (which ends the list whether a power of two or not): the batch sizes the batched
    engine's graphs are captured for, and those a schedule is tuned at."""
    sizes = [1]
    while sizes[-1] < most:
        sizes.append(min(2 * sizes[-1], most))
    return sizes


DEFAULT_MAX_NUM_SEQS = 64  # serve's continuous batch when not given, on a GPU with the fast engine


def default_max_num_seqs(target: Target, length: int, free_bytes: int | None = None) -> int:
    """--max-num-seqs when not given: continuous batching where a batch shares one forward (the fast engine on a
    GPU: on the H200 it served 2-3x the tokens/s of one request at a time from 4 concurrent requests on,
    benchmarks/RESULTS.md), up to DEFAULT_MAX_NUM_SEQS sequences and as many as 90% of the free memory holds at
    `length` tokens each; one at a time elsewhere (the HF engine interleaves requests without sharing a forward; a
    CPU gains nothing).
    `free_bytes` overrides the device's free memory (tests)."""
    if not target.batch_slots:
        return 1
    if free_bytes is None:
        if target.device.type != "cuda":
            return 1
        free_bytes = torch.cuda.mem_get_info(target.device)[0]
    fits = int(0.9 * free_bytes) // max(sequence_bytes(target, 1, length), 1)
    seqs = min(DEFAULT_MAX_NUM_SEQS, fits)
    return seqs if seqs >= 2 else 1


def check_kv_room(target: Target, sequences: int, length: int, free_bytes: int | None = None) -> None:
    """Refuse a batch whose K/V at full length cannot fit in the device's free memory (vLLM refuses at start-up
    too): one line now rather than an out-of-memory error that fails every running request later. Only on CUDA,
    where the free memory is known; `free_bytes` overrides it (tests)."""
    if free_bytes is None:
        if target.device.type != "cuda":
            return
        free_bytes = torch.cuda.mem_get_info(target.device)[0]
    need = sequence_bytes(target, sequences, length)
    if need > free_bytes:
        raise BlockdraftError(
            f"--max-num-seqs {sequences} x --max-model-len {length} needs {need / 2**30:.2f} GiB of KV cache (and "
            "linear-attention states) and the "
            f"device has {free_bytes / 2**30:.2f} GiB free; lower --max-num-seqs or --max-model-len"
        )
