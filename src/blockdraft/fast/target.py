"""FastTarget: the Target interface for common dense models, run by our own forward over a static KV cache.

HF execution at batch 1 is launch-bound (8x over the weights-read floor on an H200, benchmarks/RESULTS.md). For
Qwen3, Qwen2, Llama and Mistral (full or sliding-window attention) this forward reads the HF module's own weights
(q|k|v and gate|up re-packed into one matrix each, the HF modules keep working on views of them), writes K/V into a
preallocated cache, and builds every mask on the device from positions. On CUDA each verify shape is captured once
as a CUDA graph and replayed; on CPU the same code runs eagerly, which is how tests check it against HF.
Anything else stays on the HF `Target`, the general fallback.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import get_layer_types_and_kwargs

from blockdraft.fast.ops import ACTIVATIONS, CompactMask, LayerOps, sdpa_attention
from blockdraft.fast.graphs import capture, graph_pool
from blockdraft.kernels.sizes import power_of_two_at_least
from blockdraft.models.host_to_device import long_tensor
from blockdraft.fast.linear_states import LinearStates
from blockdraft.fast.static_cache import SLOT_STEP, KVStorage, StaticTargetCache, round_up
from blockdraft.models.target import Target, TargetOutput

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral")
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
# RoPE variants whose frequencies depend on the sequence length cannot use one precomputed table.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
GRAPH_MAX_TOKENS = 1024  # larger forwards (not prefills: they go in chunks) run eagerly: compute-bound anyway
MAX_GRAPHS = 32
PREFILL_ROWS = 1024  # rows per prefill forward: longer prompts go in chunks, shorter ones can be packed together
PREFILL_GRAPHS = 16  # prefill graphs kept (least recently used dropped): they share one memory pool
# Forwards of up to this many new tokens (decode, chain verify, small trees) attend with two matmuls, which suit
# few query rows; longer ones (prefill, large trees) use the fused SDPA kernels.
DECODE_ATTENTION_MAX_TOKENS = 64
# Forwards of up to this many new tokens give `block_attention` their mask in compact form, where the kernels are on:
# a DDTree@64 verify's 65 rows ran cuDNN's SDPA at 36 us a layer, 21% of that verify on the 8B shape, against
# 22 us for the kernel at 33 rows (H200, benchmarks/RESULTS.md); past 64 rows it is timed against SDPA
BLOCK_ATTENTION_MAX_TOKENS = 512


def fast_engine_problem(model: PreTrainedModel) -> str | None:
    """Why the fast engine cannot run this model (one phrase), or None when it can."""
    text = model.config.get_text_config(decoder=True)
    model_type = getattr(text, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    kinds = set(get_layer_types_and_kwargs(text)[0]) - set(SUPPORTED_LAYER_TYPES)
    if kinds:
        return f"{sorted(kinds)[0]!r} layers (supported: full and sliding-window attention)"
    rope = getattr(text, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") in LENGTH_DEPENDENT_ROPE:
        return f"rope_type {rope['rope_type']!r} (its frequencies depend on the sequence length)"
    if getattr(text, "hidden_act", "silu") not in ACTIVATIONS:
        return f"hidden_act {text.hidden_act!r}"
    return None


def pack_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several projections of the same input; the modules become views of it."""
    weight = torch.cat([m.weight.detach() for m in linears])
    bias = None
    if any(m.bias is not None for m in linears):
        bias = torch.cat([
            m.weight.new_zeros(m.weight.shape[0]) if m.bias is None else m.bias.detach() for m in linears
        ])
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
        if m.bias is not None and bias is not None:
            m.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
        start += rows
    return weight, bias


@dataclass
class LayerWeights:
    """One decoder layer's weights in the form the fast forwards (target and drafter) read them."""

    norm_in: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: nn.Linear
    norm_post: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: nn.Linear
    scaling: float
    window: int | None


def pack_layer(layer: nn.Module, window: int | None) -> LayerWeights:
    """A pre-norm attention + gated-MLP layer (HF names: self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, the
    two layernorms) with q|k|v and gate|up packed, so each is one matrix read per step."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, qkv_bias = pack_linears([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up, gate_up_bias = pack_linears([mlp.gate_proj, mlp.up_proj])
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return LayerWeights(
        norm_in=layer.input_layernorm.weight, qkv=qkv, qkv_bias=qkv_bias,
        q_norm=None if q_norm is None else q_norm.weight, k_norm=None if k_norm is None else k_norm.weight,
        o_proj=attn.o_proj, norm_post=layer.post_attention_layernorm.weight, gate_up=gate_up,
        gate_up_bias=gate_up_bias, down=mlp.down_proj, scaling=attn.scaling, window=window,
    )


@dataclass
class _Graph:
    """A captured forward for one (rows, key capacity, taps) shape and its static inputs and outputs."""

    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor
    positions: torch.Tensor
    own: torch.Tensor
    out: torch.Tensor  # logits (a verify graph) or final-normed states (a prefill graph)
    taps: torch.Tensor | None


def layer_step(
    ops: LayerOps,
    layer: LayerWeights,
    x: torch.Tensor,
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: torch.Tensor,
    slots: torch.Tensor,
    cap: int,
    bias: torch.Tensor | None,
    heads: int,
    kv_heads: int,
    eps: float,
    act: str,
    mask: CompactMask | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decoder layer on a static cache (target and drafter alike) from its residual input `x` and q|k|v product
    (`run_stack` makes both): K/V of the t new rows written at `slots` of `kv` ([2, kv_heads, slots, d]), attention
    over its first `cap` slots under `bias`, or `mask` (the mask in compact form, for the kernels; `bias` None);
    returns the layer's output as a pending sum (`layer_mlp`)."""
    t = qkv.shape[1]
    q = ops.qkv_heads(qkv, layer.q_norm, layer.k_norm, cos, sin, heads, kv_heads, eps, kv[0], kv[1], slots)
    out = attend(ops, layer, q, kv[0, :, :cap].unsqueeze(0), kv[1, :, :cap].unsqueeze(0), bias, t, heads, mask)
    return layer_mlp(ops, layer, x, out, eps, act)


def attention_masks(ops: LayerOps, slots: torch.Tensor, lengths: torch.Tensor, own: torch.Tensor,
                    positions: torch.Tensor, dense: Callable[[int | None], torch.Tensor], windows: set[int | None]
                    ) -> tuple[CompactMask | None, dict[int | None, torch.Tensor]]:
    """A target forward's masks for `attend`: in compact form (`CompactMask.of`, `dense(window)` its additive bias,
    built only if the library attends) where `attend` may give it to `block_attention` (the attention kernel on,
    `LayerOps.compact_masks`, and few enough rows per sequence), and then no dense bias; else None and the dense
    bias of each of `windows`."""
    if ops.compact_masks and own.shape[-1] <= BLOCK_ATTENTION_MAX_TOKENS:
        return CompactMask.of(slots, lengths, own, positions, dense), {}
    return None, {window: dense(window) for window in windows}


def attend(ops: LayerOps, layer: LayerWeights, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           bias: torch.Tensor | None, t: int, heads: int, mask: CompactMask | None = None) -> torch.Tensor:
    """Attention of `t` new rows per sequence, the `heads` query heads merged ([B, t, heads * d], as o_proj reads
    them): two matmuls for a few rows, the fused SDPA kernels for many; with the mask given in compact form
    (`attention_masks`), `block_attention` where it was timed faster than either (it stores the heads merged: no
    transpose kernel after it; `bias` None: the mask's own dense form where the library runs)."""
    few = t <= DECODE_ATTENTION_MAX_TOKENS
    if mask is not None:
        kernel = ops.block_attention if few else ops.many_row_block_attention
        return kernel(q, keys, values, layer.scaling, mask, layer.window)
    if bias is None:
        raise ValueError("attend needs a dense bias or a compact mask")
    out = (ops.decode_attention(q, keys, values, bias, layer.scaling) if few
           else sdpa_attention(q, keys, values, bias, layer.scaling))
    return ops.merge_heads(out, heads, t)


def layer_mlp(ops: LayerOps, layer: LayerWeights, x: torch.Tensor, attended: torch.Tensor, eps: float,
              act: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """After attention (heads merged): o_proj, residual and norm, the gated MLP. Returns the layer's output as the
    pair (x, delta) it is the sum of: the add waits for the next layer's norm and product (`run_stack`), so that
    one unit does all three (one kernel on the kernel engine, where its fused product was timed faster); delta is
    None where the product added itself to x as it stored (1-128 rows: `LayerOps.residual_linear`)."""
    x, delta = ops.residual_linear(x, attended, layer.o_proj.weight, layer.o_proj.bias)
    x, gate_up = ops.norm_linear(x, delta, layer.norm_post, eps, layer.gate_up, layer.gate_up_bias)
    return ops.residual_linear(x, gate_up, layer.down.weight, layer.down.bias, act)


LayerStep = Callable[[int, LayerWeights, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


def run_stack(ops: LayerOps, layers: list[LayerWeights], x: torch.Tensor, step: LayerStep, final_norm: torch.Tensor,
              eps: float, tap_layers: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A decoder stack (targets and drafters, batch 1 and batched) over embeddings `x`: `step(i, layer, x, qkv)`
    runs layer i from its residual input and q|k|v product and returns its output as a pending sum (`layer_mlp`),
    which the next layer's norm and product resolve in one unit (`LayerOps.norm_linear`, as the norm and product
    inside a layer). Returns the final-normed states and the concatenated taps (the OUTPUT of each tapped layer;
    HF's last hidden state is the final-normed one)."""
    wanted = set(tap_layers or ())
    taps: dict[int, torch.Tensor] = {}
    delta: torch.Tensor | None = None
    for i, layer in enumerate(layers):
        x, qkv = ops.norm_linear(x, delta, layer.norm_in, eps, layer.qkv, layer.qkv_bias)
        if i - 1 in wanted:
            taps[i - 1] = x
        x, delta = step(i, layer, x, qkv)
    if delta is None:
        h = ops.rms_norm(x, final_norm, eps)
    else:
        x, h = ops.add_rms_norm(x, delta, final_norm, eps)
    taps[len(layers) - 1] = h
    tapped = torch.cat([taps[i] for i in tap_layers], dim=-1) if tap_layers is not None else None
    return h, tapped


@torch.inference_mode()
def kept_rotary_table(
    tables: dict[int, tuple[torch.Tensor, torch.Tensor]], rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    n: int, dtype: torch.dtype, device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n, rotary dims] of positions 0..n-1 from `rotary` (HF's rotary module), built once and kept in
    `tables`: a CUDA graph replays its gathers from the table it was captured with, so none is ever dropped."""
    if n not in tables:
        cos, sin = rotary(torch.empty(0, dtype=dtype, device=device), torch.arange(n, device=device).unsqueeze(0))
        tables[n] = (cos[0], sin[0])
    return tables[n]


def graph_rows(t: int) -> int:
    """Rows a graph is captured for: short forwards round up to a power of two (they cost the same on a GPU,
    and the chain's shorter last steps then reuse one graph); longer ones (trees) are captured exactly."""
    return power_of_two_at_least(t) if t <= 16 else t


def prefill_rows(t: int) -> int:
    """Rows a prefill graph is captured for: the next power of two from 16, so prompts of every length share a few
    graphs (and `FastTarget.warm_prefill` can capture them all up front)."""
    return max(16, power_of_two_at_least(t))


class FastTarget(Target):
    """A Target whose forward, cache and (on CUDA) graphs are ours; same interface, same results as HF's."""

    engine = "fast"
    static_cache = True
    batch_slots = True
    row_masks = True
    packs_prompts = True  # several prompts prefill as one forward (`pack_prompts`)

    def __init__(
        self,
        model: PreTrainedModel,
        cache_slots: int | None = None,
        graphs: bool | None = None,
        compiled: bool | None = None,
        fused: bool | None = None,
    ) -> None:
        problem = fast_engine_problem(model)
        if problem is not None:
            raise ValueError(f"the fast engine does not support {problem}")
        super().__init__(model)
        text = model.config.get_text_config(decoder=True)
        decoder = model.get_decoder()
        cuda = self.device.type == "cuda"
        self.use_graphs = cuda if graphs is None else graphs and cuda
        self.fused = cuda if fused is None else fused  # greedy steps as `decoding.fused_steps`; a CPU runs them eagerly
        self.ops = LayerOps(cuda if compiled is None else compiled, qkv_kernel=cuda, few_rows=cuda,
                            attention_kernel=cuda)
        self.prefill_ops = self.ops.library_products()
        self.eps: float = text.rms_norm_eps
        self.act: str = getattr(text, "hidden_act", "silu")
        self.heads: int = text.num_attention_heads
        self.kv_heads: int = text.num_key_value_heads
        self.head_dim: int = getattr(text, "head_dim", None) or self.hidden_size // self.heads
        self.final_norm: torch.Tensor = decoder.norm.weight
        self.rotary = decoder.rotary_emb
        windows = get_layer_types_and_kwargs(text)[1].get("sliding_window")
        self.layers = [
            pack_layer(layer, windows if kind == "sliding_attention" else None)
            for layer, kind in zip(decoder.layers, self.layer_types)
        ]
        slots = cache_slots or min(self.max_positions or 4096, 4096)
        self.storage = KVStorage(self.num_layers, self.kv_heads, self.head_dim, slots, self.dtype, self.device)
        self._init_graphs()

    def _init_graphs(self) -> None:
        """No rope tables and no graphs yet, for the storage just made."""
        self._tables_for = -1
        self._rope_tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.graph_limit = MAX_GRAPHS  # verify graphs kept (least recently used dropped); `warm_verify` raises it
        self._prefill_graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._prefill_pool: object = None  # the prefill graphs' shared memory pool, made by their first capture
        self._graphs_version = self.storage.version

    def new_cache(self) -> StaticTargetCache:
        """The target's one static cache, emptied: graphs keep pointing at the same buffers across generations."""
        return StaticTargetCache(self.storage)

    def check_tree_attention(self) -> str:
        """Our attention always takes the tree mask (whatever attn_implementation the HF model was loaded with)."""
        return "sdpa"

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits through the engine's products: a decode step's one row from the GEMV where it was
        timed faster (1.2 GB of an 8B step's 15 GB of weights)."""
        return self.ops.linear(hidden, self.lm_head.weight, getattr(self.lm_head, "bias", None))

    def _tables(self) -> None:
        """cos/sin for every slot position (`rope_table`) and the slot index, taken anew when the cache grows."""
        slots = self.storage.slots
        if self._tables_for == slots:
            return
        (self.cos, self.sin), self.slot_ids = self.rope_table(slots), torch.arange(slots, device=self.device)
        self._tables_for = slots

    def rope_table(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [n, head_dim] of positions 0..n-1 (n: the power of two at least `positions`) for a forward to
        gather its rows from (the batched one: two launches a step where the rotary module takes ~10). Every table
        built stays (their sizes sum to under twice the largest's), since a CUDA graph replays its gathers from
        the table it was captured with."""
        return kept_rotary_table(self._rope_tables, self.rotary, power_of_two_at_least(positions), self.dtype,
                                 self.device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: StaticTargetCache,
        tap_layers: tuple[int, ...] | None = None,
        last_logits_only: bool = False,
        attention_mask: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Run [1, t] ids at absolute positions [t] appending to the cache; taps for all t rows if asked.

        `attention_mask` ([1, 1, t, len(cache) + t] bool, for trees) is read for its last t columns, how the
        new rows see each other; every row sees the whole committed cache, as in every tree the loop builds.
        `last_logits_only` (a prefill) runs in chunks of PREFILL_ROWS (`prefill`).
        """
        t = input_ids.shape[1]
        if last_logits_only and attention_mask is None:
            hidden, taps = self.prefill(input_ids, positions, None, cache, tap_layers)
            return TargetOutput(logits=self.head(hidden[:, -1:]), taps=taps)
        with cache.running(input_ids, attention_mask):
            own = None if attention_mask is None else attention_mask[0, 0, :, -t:]
            if self.use_graphs and t <= GRAPH_MAX_TOKENS and not last_logits_only:
                logits, taps = self._replay(input_ids, positions, own, cache, tap_layers, graph_rows(t), True)
            else:
                hidden, taps = self._eager(input_ids, positions, own, cache, tap_layers, self.ops)
                logits = self.head(hidden[:, -1:] if last_logits_only else hidden)
        return TargetOutput(logits=logits, taps=taps)

    @torch.inference_mode()
    def prefill(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        own: torch.Tensor | None,
        cache: StaticTargetCache,
        tap_layers: tuple[int, ...] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append [1, t] prompt rows to the cache in chunks of up to PREFILL_ROWS, each replayed from a graph of
        `prefill_rows` rows on CUDA; returns the final-normed states [1, t, hidden] (the caller applies the head to
        the rows it needs, so no graph holds logits) and the taps. `own` [t, t] (t <= PREFILL_ROWS) is how the rows
        see each other, causal when None: `pack_prompts` packs several prompts into one forward with it. Run
        eagerly, a prefill was launch-bound: ~30 ms for the embedded 135M target on the H200 whatever the prompt's
        length, 25x its GPU time (benchmarks/RESULTS.md)."""
        t = input_ids.shape[1]
        if own is not None and t > PREFILL_ROWS:
            raise ValueError(f"a prefill with its own mask takes at most {PREFILL_ROWS} rows, not {t}")
        states: list[torch.Tensor] = []
        tapped: list[torch.Tensor] = []
        for begin in range(0, t, PREFILL_ROWS):
            ids, at = input_ids[:, begin : begin + PREFILL_ROWS], positions[begin : begin + PREFILL_ROWS]
            with cache.running(ids, None):
                if self.use_graphs:
                    hidden, taps = self._replay(ids, at, own, cache, tap_layers, prefill_rows(ids.shape[1]), False)
                else:
                    hidden, taps = self._eager(ids, at, own, cache, tap_layers, self.prefill_ops)
            states.append(hidden)
            if taps is not None:
                tapped.append(taps)
        return torch.cat(states, dim=1), torch.cat(tapped, dim=1) if tapped else None

    def _eager(self, ids: torch.Tensor, positions: torch.Tensor, own: torch.Tensor | None, cache: StaticTargetCache,
               tap_layers: tuple[int, ...] | None, ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward run directly with `ops` (a CPU, or rows past what graphs are captured for)."""
        t = ids.shape[1]
        cache.reserve(t)
        self._tables()
        own = fixed_mask("tril", t, self.device) if own is None else own
        return self._run(ids, positions, own, round_up(len(cache) + t), tap_layers, ops)

    def _run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        own: torch.Tensor,
        cap: int,
        tap_layers: tuple[int, ...] | None,
        ops: LayerOps,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward itself up to the final norm (states, taps) with `ops` (a verify's, or a prefill's library
        products): only device work on fixed buffers, so a CUDA graph can capture it."""
        kv = self.storage.kv
        t = ids.shape[1]
        groups = self.heads // self.kv_heads
        slots = self.storage.length + self.slot_ids[:t]
        cos, sin = self.cos[positions][None, None], self.sin[positions][None, None]

        def dense(window: int | None) -> torch.Tensor:
            return ops.attention_bias(self.storage.length, self.slot_ids[:cap], positions, own, window, groups,
                                      self.dtype)

        mask, biases = attention_masks(ops, self.slot_ids[:1], self.storage.length.view(1), own.unsqueeze(0),
                                       positions.unsqueeze(0), dense, {layer.window for layer in self.layers})

        def step(i: int, layer: LayerWeights, x: torch.Tensor, qkv: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
            return layer_step(ops, layer, x, qkv, cos, sin, kv[i], slots, cap, biases.get(layer.window), self.heads,
                              self.kv_heads, self.eps, self.act, mask)

        return self.run_layers(F.embedding(ids, self.embedding_weight), step, tap_layers, ops)

    def verify_pass(self, ids: torch.Tensor, positions: torch.Tensor, own: torch.Tensor, cap: int,
                    tap_layers: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A verify's forward over rows [1, t] after the cache's device length, reading `cap` key slots, up to the
        final norm (states, taps), with no host work: what a fused step's graph captures with its own buffers
        (`decoding.fused_steps`). The caller reserves the rows and moves the length."""
        self._tables()
        return self._run(ids, positions, own, cap, tap_layers, self.ops)

    def commit_path(self, path: torch.Tensor, count: torch.Tensor) -> None:
        """A fused step's commit beyond its K/V and length, inside its graph: nothing here (a hybrid target's
        linear states)."""

    def committed_buffers(self) -> list[torch.Tensor]:
        """The device buffers that hold what the cache has committed and that a forward or a fused step's commit
        writes in place: a capture's warm-up runs execute, so whoever captures keeps these as they were (here the
        device length; a hybrid target's linear states too)."""
        return [self.storage.length]

    @property
    def kv_layers(self) -> int:
        """Layers with K/V in a cache: every one here."""
        return self.num_layers

    def batch_states(self, slots: int) -> LinearStates | None:
        """The per-sequence state a batch store holds beside the K/V: none here (a hybrid target's linear states)."""
        return None

    def run_batch(self, kv: torch.Tensor, linear: LinearStates | None, lengths: torch.Tensor, ids: torch.Tensor,
                  positions: torch.Tensor, own: torch.Tensor, cap: int,
                  tap_layers: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batched forward (`fast.batch`) up to the final norm (states [B, t, hidden], taps) of the sequences in
        slots 0..B-1 of `kv` ([layers, 2, slots, kv_heads, positions, d]), each with its own length: only device work
        on fixed buffers, so a CUDA graph can capture it. Every position is below `cap` (a sequence's rows sit at its
        length plus their depth), so the rotary table of `cap` positions holds them. Only the K/V write and the mask
        are batch-specific: attention, the layer's tail and the stack are the batch-1 forward's."""
        batch, t = ids.shape
        ops = self.ops
        seq, cols, cos, sin, mask, biases = self.batch_layout(lengths, positions, own, cap,
                                                              {layer.window for layer in self.layers})

        def step(i: int, layer: LayerWeights, x: torch.Tensor, qkv: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
            q = ops.batched_qkv_heads(qkv, layer.q_norm, layer.k_norm, cos, sin, self.heads, self.kv_heads, self.eps,
                                      kv[i, 0], kv[i, 1], seq, cols)
            keys, values = kv[i, 0, :batch, :, :cap], kv[i, 1, :batch, :, :cap]
            out = attend(ops, layer, q, keys, values, biases.get(layer.window), t, self.heads, mask)
            return layer_mlp(ops, layer, x, out, self.eps, self.act)

        return self.run_layers(F.embedding(ids, self.embedding_weight), step, tap_layers)

    def batch_layout(self, lengths: torch.Tensor, positions: torch.Tensor, own: torch.Tensor, cap: int,
                     windows: set[int | None]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                        CompactMask | None, dict[int | None, torch.Tensor]]:
        """What every layer of a batched forward shares: each row's slot and cache column [B, t] (where its K/V is
        written), cos/sin [B, 1, t, rotary] of its position, and the attention masks (`attention_masks`) of
        `windows`."""
        batch, t = positions.shape
        seq = torch.arange(batch, device=self.device).unsqueeze(1).expand(batch, t)
        cols = lengths.unsqueeze(1) + torch.arange(t, device=self.device)
        cos_table, sin_table = self.rope_table(cap)
        slot_ids = torch.arange(cap, device=self.device)
        groups = self.heads // self.kv_heads

        def dense(window: int | None) -> torch.Tensor:
            return self.ops.batched_attention_bias(lengths, slot_ids, positions, own, window, groups, self.dtype)

        mask, biases = attention_masks(self.ops, seq[:, 0], lengths, own, positions, dense, windows)
        return (seq, cols, cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1), mask, biases)

    def run_layers(self, x: torch.Tensor, step: LayerStep, tap_layers: tuple[int, ...] | None,
                   ops: LayerOps | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This target's decoder stack over embeddings `x` (batch-1 and batched forwards alike; `run_stack`), with
        its verify units unless `ops` says otherwise."""
        return run_stack(ops or self.ops, self.layers, x, step, self.final_norm, self.eps, tap_layers)

    def _replay(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        own: torch.Tensor | None,
        cache: StaticTargetCache,
        tap_layers: tuple[int, ...] | None,
        rows: int,
        head: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Copy the inputs into the captured graph for this shape (`rows` >= t rows; capturing it on first use),
        replay it and return its logits (`head`: a verify) or final-normed states (a prefill) and taps. Verify
        graphs each keep their own memory; prefill graphs share one pool (only one runs at a time, and their
        outputs are copied out at once)."""
        t = input_ids.shape[1]
        rows = self._captured_rows(rows, len(cache), tap_layers) if head else rows
        cache.reserve(rows)
        entry = self._entry(rows, round_up(len(cache) + rows), tap_layers, head)
        entry.ids[:, :t].copy_(input_ids)
        entry.positions[:t].copy_(positions)
        entry.own.copy_(fixed_mask("eye", rows, self.device))  # padding rows see only themselves
        entry.own[:t, :t].copy_(fixed_mask("tril", t, self.device) if own is None else own)
        entry.graph.replay()
        taps = None if entry.taps is None else entry.taps[:, :t].clone()
        return entry.out[:, :t].clone(), taps

    def _captured_rows(self, rows: int, length: int, tap_layers: tuple[int, ...] | None) -> int:
        """The rows of the verify graph to replay for a forward of `rows` rows after `length` cached positions:
        for a tree (past 16 rows) without its own graph, the smallest captured one of up to twice its rows, rather
        than capture a graph for its size. Trees built on the host (T > 0) vary in size from step to step, and each
        new size would capture mid-decode (timing the kernels' new shapes too), stalling that step and, past the
        graph limit, dropping a warmed graph; padding rows see only themselves and are never read."""
        if rows <= 16 or (rows, round_up(length + rows), tap_layers) in self._graphs:
            return rows
        return min((r for r, cap, taps in self._graphs
                    if rows < r <= 2 * rows and cap == round_up(length + r) and taps == tap_layers), default=rows)

    def _entry(self, rows: int, cap: int, tap_layers: tuple[int, ...] | None, head: bool) -> _Graph:
        """The graph for `rows` rows at key capacity `cap`, captured now if there is none."""
        self._tables()
        if self._graphs_version != self.storage.version:  # the cache grew: old graphs point at freed buffers
            self._graphs.clear()
            self._prefill_graphs.clear()
            self._prefill_pool = None  # a new pool for the graphs to come (`graph_pool`)
            self._graphs_version = self.storage.version
        graphs, limit = (self._graphs, self.graph_limit) if head else (self._prefill_graphs, PREFILL_GRAPHS)
        key = (rows, cap, tap_layers)
        entry = graphs.get(key)
        if entry is None:
            entry = self._capture(rows, cap, tap_layers, head)
            graphs[key] = entry
            if len(graphs) > limit:
                graphs.popitem(last=False)
        graphs.move_to_end(key)
        return entry

    def _capture(self, rows: int, cap: int, tap_layers: tuple[int, ...] | None, head: bool) -> _Graph:
        """Capture the forward for one shape. Warm-up runs write K/V only past the cache length (rows nobody has
        committed yet), which the real replay then overwrites, and `committed_buffers` are restored after them, so
        capturing never disturbs the cache."""
        if not head and self._prefill_pool is None:
            self._prefill_pool = graph_pool(True)
        ids = torch.zeros(1, rows, dtype=torch.long, device=self.device)
        positions = torch.zeros(rows, dtype=torch.long, device=self.device)
        own = torch.eye(rows, dtype=torch.bool, device=self.device)

        def run() -> tuple[torch.Tensor, torch.Tensor | None]:
            hidden, taps = self._run(ids, positions, own, cap, tap_layers, self.ops if head else self.prefill_ops)
            return (self.head(hidden) if head else hidden), taps

        graph, (out, taps) = capture(run, self.device, None if head else self._prefill_pool,
                                     keep=self.committed_buffers())
        return _Graph(graph=graph, ids=ids, positions=positions, own=own, out=out, taps=taps)

    @property
    def prefill_room(self) -> int:
        """The most rows one prefill forward takes (`warm_prefill` captures up to it)."""
        return min(PREFILL_ROWS, self.max_positions or PREFILL_ROWS)

    def warm_prefill(self, tap_layers: tuple[int, ...] | None) -> None:
        """Capture the prefill graph of every size up to PREFILL_ROWS (a server's warm-up), so that no request's
        first token waits for a capture."""
        if not self.use_graphs:
            return
        rows = 16
        while rows <= self.prefill_room:
            self.forward(torch.zeros(1, rows, dtype=torch.long, device=self.device),
                         torch.arange(rows, device=self.device), self.new_cache(), tap_layers, last_logits_only=True)
            rows *= 2

    @torch.inference_mode()
    def warm_verify(self, rows: Iterable[int], positions: int, tap_layers: tuple[int, ...] | None) -> None:
        """Capture the verify graph of each row count in `rows` at every key capacity a context of up to
        `positions` positions meets (a server's warm-up, a benchmark's), so that no step of a decode within them
        captures: a capture mid-decode also times every kernel shape it meets first, and a benchmark's rows
        absorbed those stalls (benchmarks/RESULTS.md). Empties the target's cache; the graph limit
        grows to keep every graph warmed here."""
        counts = sorted({graph_rows(r) for r in rows})
        if not self.use_graphs or not counts:
            return
        self.new_cache().reserve(positions + counts[-1])  # the buffers grow once, before any graph is captured
        caps = range(SLOT_STEP, round_up(positions + counts[-1]) + 1, SLOT_STEP)
        self.graph_limit = max(self.graph_limit, len(self._graphs) + len(caps) * len(counts))
        for cap in caps:
            for count in counts:
                if count <= cap:
                    self._entry(count, cap, tap_layers, True)


_MASKS: dict[tuple[str, int, torch.device], torch.Tensor] = {}


def fixed_mask(kind: str, rows: int, device: torch.device) -> torch.Tensor:
    """The causal ("tril") or self-only ("eye") [rows, rows] mask; verify-sized ones are made once per device (a
    verify step needs one, and making it each step is two launches)."""
    key = (kind, rows, device)
    if key in _MASKS:
        return _MASKS[key]
    eye = torch.eye(rows, dtype=torch.bool, device=device)
    mask = eye if kind == "eye" else torch.ones_like(eye).tril()
    if rows <= GRAPH_MAX_TOKENS:
        _MASKS[key] = mask
    return mask


def pack_prompts(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                            list[int]]:
    """Several prompts as one prefill (`FastTarget.prefill`): ids [1, total], positions (each prompt's from 0),
    the block-causal mask [total, total] (each prompt sees only its own earlier rows) and each prompt's first row.
    Prompts prefilled one per forward queued behind each other (H200, embedded pair: TTFT p50 662 ms at
    concurrency 64); packed, k prompts cost one forward."""
    lengths = [len(prompt) for prompt in prompts]
    firsts = [sum(lengths[:b]) for b in range(len(prompts))]
    host = long_tensor([[token for prompt in prompts for token in prompt], [j for n in lengths for j in range(n)],
                        [b for b, n in enumerate(lengths) for _ in range(n)]], device)
    ids, positions, segment = host[0].unsqueeze(0), host[1], host[2]
    own = (segment.unsqueeze(1) == segment.unsqueeze(0)).tril()
    return ids, positions, own, firsts
