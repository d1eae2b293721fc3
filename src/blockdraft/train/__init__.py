"""`blockdraft train`: train a DFlash drafter for any Hugging Face causal LM.

data -> regenerate (responses by the target) -> batches (random anchors) -> features (target taps) ->
objective (many blocks per sequence, each with its inference-time visibility) -> loop (AdamW, checkpoints,
DDP) -> export (z-lab folder that vLLM, SGLang and `dflash` load).
"""
