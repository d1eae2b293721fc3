"""The DFlash drafter: Qwen3-style layers conditioned on target features by KV injection.

Weight names follow the published checkpoints exactly (`layers.{i}.self_attn.q_proj.weight`, `fc.weight`,
`hidden_norm.weight`, `norm.weight`), so z-lab drafters load unchanged and what we save loads in vLLM/SGLang.
The drafter owns no embedding and no LM head: callers pass block embeddings made with the target's embedding
and turn hidden states into logits with the target's head.

Every layer reads keys/values from [context ; block]: context entries come from the projected target taps
(cached across steps, one entry per committed position), block entries from the block being drafted. The
visibility rule per layer (causal, sliding window, bidirectional) is `visibility_mask`, shared with training.

A DFlash-2 drafter (config `dflash2` set) adds, per layer, two block convolutions (`GroupedBlockConv`:
`layers.{i}.attention_conv.*`, `layers.{i}.mlp_conv.*`) and a `CandidateSelector` (`candidate_selector.*`), with
vLLM 0.33's and the published checkpoints' names; decoding/dflash2.py turns its states into drafts. A DSpark
drafter (config `dspark` set) adds a Markov head (`markov_head.markov_w1/w2`); decoding/dspark.py drafts with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from blockdraft.config import DraftConfig
from blockdraft.errors import BlockdraftError


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [b, heads, t, d] by per-position cos/sin of shape [b, t, r]: neox style over the first r dims, the
    rest passed through (a partial rotary factor, as vLLM's rotary embedding applies it)."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def rotary_embedding(cfg: DraftConfig, hf_config: object) -> Qwen3RotaryEmbedding:
    """The drafter's RoPE over `partial_rotary_factor` of each head. transformers' scaled rope types honour the
    factor themselves; its default type rotates the whole head, so its frequencies are rebuilt over the rotated part."""
    rotary = Qwen3RotaryEmbedding(hf_config)
    rot = int(cfg.head_dim * cfg.partial_rotary_factor)
    if rotary.inv_freq.shape[0] * 2 != rot:
        base = hf_config.rope_parameters["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))
        rotary.inv_freq = nn.Buffer(inv_freq, persistent=False)
        rotary.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)
    return rotary


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, sinks: torch.Tensor
) -> torch.Tensor:
    """Attention whose softmax denominator also holds exp(sink) per head (vLLM's attention sinks, as gpt-oss): the
    sink takes probability mass and contributes no value. q [b, h, q, d], k/v [b, kv_h, k, d], mask bool or None."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


def visibility_mask(
    query_pos: torch.Tensor, key_pos: torch.Tensor, causal: bool, window: int | None
) -> torch.Tensor | None:
    """Which keys each query may see, by absolute position ([..., q, k] bool); None means all of them.

    Causal: key <= query. Window W: query - key < W (and key - query < W when not causal). A full,
    non-causal layer sees everything it is given: the block is bidirectional.
    """
    if not causal and window is None:
        return None
    q = query_pos.unsqueeze(-1)
    k = key_pos.unsqueeze(-2)
    visible = torch.ones(torch.broadcast_shapes(q.shape, k.shape), dtype=torch.bool, device=query_pos.device)
    if causal:
        visible &= k <= q
    if window is not None:
        visible &= (q - k) < window
        if not causal:
            visible &= (k - q) < window
    return visible


class DrafterAttention(nn.Module):
    """Attention whose queries come from the block and whose keys/values come from context and block."""

    def __init__(self, cfg: DraftConfig, layer: int) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.scaling = cfg.head_dim**-0.5
        self.causal = cfg.layer_is_causal(layer)
        self.window = cfg.layer_window(layer)
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.value_scale = cfg.value_scale
        self.attention_sink_bias = nn.Parameter(torch.zeros(self.num_heads)) if cfg.attention_sinks else None

    def key_values(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values for [b, t, hidden] inputs -> [b, kv_heads, t, head_dim]."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.value_scale is not None:
            v = v * self.value_scale
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_k: torch.Tensor,
        context_v: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """x: block hidden states [b, q, hidden]; mask: [q, ctx + q] or [b, 1, q, ctx + q] bool, or None."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        block_k, block_v = self.key_values(x, cos, sin)
        k = torch.cat([context_k, block_k], dim=2)
        v = torch.cat([context_v, block_v], dim=2)
        if self.attention_sink_bias is not None:
            out = sink_attention(q, k, v, mask, self.scaling, self.attention_sink_bias)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=self.num_heads != self.num_kv_heads
            )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class GroupedBlockConv(nn.Module):
    """DFlash-2's grouped causal convolution along the block (vLLM 0.33 `DFlashGroupedConv`, dflash 0.1.0
    `GroupedDynamicCausalConv`): row j of a block becomes sum over taps t of (base[t] + delta[j, t, group]) * x[j - t],
    taps reaching before the block's first row (the anchor) reading zeros. The kernel is a learned base plus a
    per-row, per-channel-group projection of the layer's input; `prepare` convolves the input with side 0 and keeps
    side 1's coefficients, which `finish` applies to the sublayer's output."""

    def __init__(self, hidden_size: int, taps: int, group_size: int) -> None:
        super().__init__()
        self.taps, self.group_size, self.groups = taps, group_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, q, hidden] (rows 0..q-1 of each block) -> (convolved x, side-1 coefficients [b, q, taps, groups])."""
        delta = self.kernel_projection(x).view(*x.shape[:-1], 2, self.taps, self.groups)
        return self.convolve(x, delta[..., 0, :, :], 0), delta[..., 1, :, :]

    def finish(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return self.convolve(x, delta, 1)

    def convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int) -> torch.Tensor:
        blocks = x.unflatten(-1, (self.groups, self.group_size))  # [b, q, groups, group_size]
        coefficients = self.base_kernel[side].view(self.taps, self.groups, self.group_size) + delta.unsqueeze(-1)
        out = coefficients[:, :, 0] * blocks
        for tap in range(1, self.taps):
            out = out + coefficients[:, :, tap] * F.pad(blocks[:, :-tap], (0, 0, 0, 0, tap, 0))
        return out.flatten(-2)


class DrafterLayer(nn.Module):
    """Pre-norm decoder layer: residual attention, then residual SwiGLU MLP; a DFlash-2 layer wraps each sublayer
    in a block convolution (input convolved before, output after)."""

    def __init__(self, cfg: DraftConfig, layer: int, hf_config: object) -> None:
        super().__init__()
        self.self_attn = DrafterAttention(cfg, layer)
        self.mlp = Qwen3MLP(hf_config)
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.attention_conv: GroupedBlockConv | None = None
        self.mlp_conv: GroupedBlockConv | None = None
        if cfg.dflash2 is not None:
            shape = cfg.dflash2
            self.attention_conv = GroupedBlockConv(cfg.hidden_size, shape.conv_kernel_size, shape.conv_group_size)
            self.mlp_conv = GroupedBlockConv(cfg.hidden_size, shape.conv_kernel_size, shape.conv_group_size)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_k: torch.Tensor,
        context_v: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.attention_conv is None or self.mlp_conv is None:
            x = x + self.self_attn(h, cos, sin, context_k, context_v, mask)
            return x + self.mlp(self.post_attention_layernorm(x))
        h, delta = self.attention_conv.prepare(h)
        x = x + self.attention_conv.finish(self.self_attn(h, cos, sin, context_k, context_v, mask), delta)
        h, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), delta)


class CandidateSelector(nn.Module):
    """DFlash-2's selector: scores edges between consecutive positions' candidates. Edge (p -> c) at position l
    scores unary[l, c] + <predecessor_codebook[p] * hidden_projection(h_l), successor_codebook[c]>, where p is the
    anchor at l = 0 and a candidate of position l - 1 after (vLLM 0.33 `_score_edges`, dflash 0.1.0 `select`)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def edge_scores(self, candidates: torch.Tensor, unary: torch.Tensor, hidden: torch.Tensor,
                    anchor: int) -> torch.Tensor:
        """Scores [L, K, K] (position, predecessor index, candidate index) for candidates and unary logits [L, K]
        at hidden states [L, hidden]; at position 0 every predecessor row is the anchor."""
        positions, k = candidates.shape
        predecessors = torch.cat([candidates.new_full((1, k), anchor), candidates[:-1]])
        pred = self.predecessor_codebook[predecessors] * self.hidden_projection(hidden)[:, None]  # [L, K, r]
        pairwise = torch.einsum("lpr,lcr->lpc", pred, self.successor_codebook[candidates])
        return unary[:, None, :] + pairwise  # fp32 unary + model-dtype pairwise -> fp32, as vLLM adds them


class DrafterContextCache:
    """Per-layer context K/V of committed positions 0..length-1, appended once per committed token.

    Sliding-window layers keep only the last `window - 1` entries: no later block can see older ones, so
    dropping them changes nothing while bounding memory on long contexts.
    """

    def __init__(self, drafter: "DFlashDrafter") -> None:
        self.windows = [layer.self_attn.window for layer in drafter.layers]
        self.keys: list[torch.Tensor | None] = [None] * len(self.windows)
        self.values: list[torch.Tensor | None] = [None] * len(self.windows)
        self.length = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        old_k, old_v = self.keys[layer], self.values[layer]
        if old_k is not None:
            k = torch.cat([old_k, k], dim=2)
            v = torch.cat([old_v, v], dim=2)
        window = self.windows[layer]
        if window is not None and k.shape[2] > window - 1:
            k, v = k[:, :, k.shape[2] - (window - 1) :], v[:, :, v.shape[2] - (window - 1) :]
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer], self.values[layer]  # type: ignore[return-value]

    def key_positions(self, layer: int, device: torch.device) -> torch.Tensor:
        kept = 0 if self.keys[layer] is None else self.keys[layer].shape[2]  # type: ignore[union-attr]
        return torch.arange(self.length - kept, self.length, device=device)


class DSparkMarkovHead(nn.Module):
    """DSpark's Markov head (vLLM 0.33 `DSparkMarkovHead`): `markov_w1` embeds the token drafted before a position,
    `markov_w2` turns that into a bias on the position's logits."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def bias(self, previous: torch.Tensor) -> torch.Tensor:
        """[V] logit bias after token `previous` (a 1-element tensor)."""
        return self.markov_w2(self.markov_w1(previous))[0]


class DFlashDrafter(nn.Module):
    """A DFlash drafter with the published parameter names."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hf_config = cfg.hf_config()
        self.layers = nn.ModuleList(DrafterLayer(cfg, i, hf_config) for i in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary_emb = rotary_embedding(cfg, hf_config)
        self.candidate_selector: CandidateSelector | None = None
        if cfg.dflash2 is not None:
            if cfg.vocab_size is None:
                raise BlockdraftError("a DFlash-2 drafter's config.json needs `vocab_size` (its selector codebooks "
                                      "have one row per token)")
            self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size, cfg.dflash2.selector_rank,
                                                        cfg.dflash2.selector_top_k)
        self.markov_head: DSparkMarkovHead | None = None
        if cfg.dspark is not None:
            if cfg.vocab_size is None:
                raise BlockdraftError("a DSpark drafter's config.json needs `vocab_size` (its Markov head has one row "
                                      "per token)")
            self.markov_head = DSparkMarkovHead(cfg.vocab_size, cfg.dspark.markov_rank)

    @property
    def plain(self) -> bool:
        """Drafts with the DFlash head alone (no DFlash-2 selector, no DSpark Markov head): the chain and trees the
        speculation schedule switches between are its own drafting."""
        return self.candidate_selector is None and self.markov_head is None

    def rope(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions [b, t] (or [t]) in the dtype of `like`."""
        if positions.dim() == 1:
            positions = positions.unsqueeze(0)
        return self.rotary_emb(like, positions)

    def project_context(self, taps: torch.Tensor) -> torch.Tensor:
        """Context features C = hidden_norm(fc(concat(taps))) for [b, t, k * hidden] taps."""
        return self.hidden_norm(self.fc(taps))

    def extend_context(self, cache: DrafterContextCache, taps: torch.Tensor) -> None:
        """Append K/V for newly committed positions cache.length .. cache.length + t - 1."""
        t = taps.shape[1]
        if t == 0:
            return
        ctx = self.project_context(taps)
        positions = torch.arange(cache.length, cache.length + t, device=taps.device)
        cos, sin = self.rope(ctx, positions)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.key_values(ctx, cos, sin)
            cache.append(i, k, v)
        cache.length += t

    def forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor, cache: DrafterContextCache) -> torch.Tensor:
        """Final-normed hidden states [b, q, hidden] for a block at absolute positions [q]."""
        cos, sin = self.rope(block_embeds, block_positions)
        x = block_embeds
        for i, layer in enumerate(self.layers):
            ctx_k, ctx_v = cache.get(i)
            attn = layer.self_attn
            keys = torch.cat([cache.key_positions(i, x.device), block_positions])
            mask = visibility_mask(block_positions, keys, attn.causal, attn.window)
            x = layer(x, cos, sin, ctx_k, ctx_v, mask)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Draft logits through the target's head, with the config's multiplier and soft-capping."""
        logits = lm_head(hidden)
        if self.cfg.output_multiplier != 1.0:
            logits = logits * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
