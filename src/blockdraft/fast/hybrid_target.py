"""HybridFastTarget: the fast engine for Qwen3.5 / Qwen3.6 dense text targets, Gated DeltaNet linear attention
interleaved with gated full attention.

The attention layers (an output gate on q_proj, zero-centred q/k norms, partial rotary) run on FastTarget's static
KV cache and attention path; the linear-attention layers (`fast.delta_net`) keep their conv windows and recurrent
states in static buffers (`fast.linear_states`). A verify runs each row along its own path and keeps what the rule
read per row, so the commit after acceptance (a chain's crop, a tree's compact) advances the state over the accepted
path alone, without another target forward, and a DDTree step is one verify forward (one graph on CUDA). Prefills
run the chunked delta rule (flash-linear-attention's in half precision where it is installed and timed faster).
Qwen3.5's zero-centred norms scale by 1 + w: those weights are taken as 1 + w once, so every fused norm unit of the
engine reads them unchanged (exact in float32; in bf16 the scale is rounded once, as the norm's output is).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from blockdraft.fast.delta_net import (DeltaNetWeights, advance_state, advance_state_counted, chunked_delta_rule,
                                       conv_channels, gated_norm, path_delta_rule, path_layout, prefill_heads,
                                       verify_heads)
from blockdraft.fast.gated_attention import batched_gated_attention_heads, gated_attention_heads
from blockdraft.fast.linear_states import LinearStates, slid_window
from blockdraft.fast.ops import ACTIVATIONS, CompiledOrPlain, LayerOps
from blockdraft.kernels.delta_rule import (Walks, advance_state_kernel, delta_rule_runs, leaf_walks,
                                          path_delta_rule_kernel)
from blockdraft.kernels.fla_delta_rule import fla_delta_rule, library_rule
from blockdraft.kernels.kernel_choice import fastest
from blockdraft.fast.static_cache import KVStorage, StaticTargetCache
from blockdraft.fast.target import (FastTarget, LayerWeights, attend, attention_masks, graph_rows, layer_mlp,
                                    pack_linears, run_stack)
from blockdraft.models.target import Target

HYBRID_MODEL_TYPES = ("qwen3_5_text",)
MIXTURE_MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_next")


def hybrid_engine_problem(model: PreTrainedModel) -> str | None:
    """Why HybridFastTarget cannot run this model (one phrase), or None when it can."""
    text = model.config.get_text_config(decoder=True)
    model_type = getattr(text, "model_type", None)
    if model_type in MIXTURE_MODEL_TYPES:
        return f"model_type {model_type!r}: its mixture-of-experts layers run on the HF engine"
    if model_type not in HYBRID_MODEL_TYPES:
        return f"model_type {model_type!r} (hybrid targets supported: {', '.join(HYBRID_MODEL_TYPES)})"
    kinds = set(text.layer_types) - {"linear_attention", "full_attention"}
    if kinds:
        return f"{sorted(kinds)[0]!r} layers (supported: linear_attention and full_attention)"
    if text.hidden_act not in ACTIVATIONS:
        return f"hidden_act {text.hidden_act!r}"
    return None


def _one_plus(weight: torch.Tensor) -> torch.Tensor:
    """A zero-centred norm's scale (HF: x * (1 + w)) as the plain scale the engine's norm units multiply by."""
    return (1.0 + weight.detach().float()).to(weight.dtype)


def pack_gated_attention(layer: nn.Module) -> LayerWeights:
    """A gated attention layer: q_proj's rows (each head's query then its gate) | k | v packed into one matrix."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, qkv_bias = pack_linears([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up, gate_up_bias = pack_linears([mlp.gate_proj, mlp.up_proj])
    return LayerWeights(
        norm_in=_one_plus(layer.input_layernorm.weight), qkv=qkv, qkv_bias=qkv_bias,
        q_norm=_one_plus(attn.q_norm.weight), k_norm=_one_plus(attn.k_norm.weight), o_proj=attn.o_proj,
        norm_post=_one_plus(layer.post_attention_layernorm.weight), gate_up=gate_up, gate_up_bias=gate_up_bias,
        down=mlp.down_proj, scaling=attn.scaling, window=None,
    )


def pack_delta_net(layer: nn.Module) -> DeltaNetWeights:
    """A Gated DeltaNet layer: in_proj_qkv | in_proj_z | in_proj_b | in_proj_a packed into one matrix."""
    net, mlp = layer.linear_attn, layer.mlp
    qkv, qkv_bias = pack_linears([net.in_proj_qkv, net.in_proj_z, net.in_proj_b, net.in_proj_a])
    gate_up, gate_up_bias = pack_linears([mlp.gate_proj, mlp.up_proj])
    with torch.no_grad():
        neg_decay = -net.A_log.float().exp()
    return DeltaNetWeights(
        norm_in=_one_plus(layer.input_layernorm.weight), qkv=qkv, qkv_bias=qkv_bias,
        conv=net.conv1d.weight.detach().squeeze(1), neg_decay=neg_decay, dt_bias=net.dt_bias.detach(),
        gated_norm=net.norm.weight.detach(), o_proj=net.out_proj,
        norm_post=_one_plus(layer.post_attention_layernorm.weight), gate_up=gate_up, gate_up_bias=gate_up_bias,
        down=mlp.down_proj, key_heads=net.num_k_heads, value_heads=net.num_v_heads, key_dim=net.head_k_dim,
        value_dim=net.head_v_dim, act=net.activation,
    )


class PromptRows(NamedTuple):
    """A prefill's rows as its linear layers read them: which are its prompt's [t] bool, and how many (0-d)."""

    mask: torch.Tensor
    count: torch.Tensor


def prompt_rows(own: torch.Tensor) -> PromptRows:
    """A prefill's prompt rows, from its mask own [t, t], computed once a forward: a prompt's row i sees rows 0..i, a
    padding row (a graph's rows past the prompt) only itself. Padding rows then neither decay nor update the linear
    states (decay 0, beta 0), and the conv window slides by the prompt's rows alone."""
    mask = own.sum(-1) == torch.arange(1, own.shape[-1] + 1, device=own.device)
    return PromptRows(mask, mask.sum())


class VerifyRows(NamedTuple):
    """A verify's rows as its linear layers read them: each row's parent [B, t] (-1: the committed sequence), its
    conv columns [B, t, kernel] (`fast.delta_net.path_layout`), and the kernel's `leaf_walks` (None off the kernel)."""

    parents: torch.Tensor
    columns: torch.Tensor
    walks: Walks | None


class HybridUnits:
    """The hybrid layers' fusion units, compiled on request as `LayerOps`'s are, and the verify's delta rule from
    its Triton kernel where asked and it runs (`kernels.delta_rule`: one launch a layer instead of ten a row)."""

    def __init__(self, compiled: bool, rule_kernel: bool) -> None:
        wrap: Callable[[Callable[..., object]], Callable[..., object]] = CompiledOrPlain if compiled else (lambda f: f)
        self.verify_heads = wrap(verify_heads)
        self.prefill_heads = wrap(prefill_heads)
        self.gated_norm = wrap(gated_norm)
        self.gated_attention_heads = wrap(gated_attention_heads)
        self.batched_gated_attention_heads = wrap(batched_gated_attention_heads)
        self.rule_kernel = rule_kernel

    def verify_rows(self, own: torch.Tensor, kernel: int) -> VerifyRows:
        """What every linear layer of one verify reads about its rows (own [B, t, t]), computed once a forward."""
        parents, columns = path_layout(own, kernel)
        return VerifyRows(parents, columns, leaf_walks(own) if self.rule_kernel else None)

    def path_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, rows: VerifyRows) -> torch.Tensor:
        """`fast.delta_net.path_delta_rule`, from the kernel where it runs (which walks each leaf's path)."""
        if rows.walks is not None and delta_rule_runs(k, state):
            return path_delta_rule_kernel(q, k, v, g, beta, state, rows.walks)
        return path_delta_rule(q, k, v, g, beta, state, rows.parents)

    def prefill_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefill's rule (`fast.delta_net.chunked_delta_rule`), from flash-linear-attention where it is installed,
        the model runs in half precision (`dtype`) and `kernel_choice` timed it faster at this shape; the engine's
        own otherwise (always in float32, whose exactness the tests check)."""
        def ours() -> tuple[torch.Tensor, torch.Tensor]:
            return chunked_delta_rule(q, k, v, g, beta, state)

        if not self.rule_kernel or dtype == torch.float32 or library_rule() is None:
            return ours()
        options = {"fla": lambda: fla_delta_rule(q, k, v, g, beta, state, dtype), "ours": ours}
        key = (*q.shape[1:], v.shape[-1], dtype)
        return options[fastest("prefill_delta_rule", key, q.device, options)]()

    def advance(self, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                count: torch.Tensor | None = None) -> torch.Tensor:
        """`fast.delta_net.advance_state` (over the first `count` rows where given, `advance_state_counted`), from
        the kernel where it runs (in place there)."""
        if self.rule_kernel and delta_rule_runs(k, state):
            return advance_state_kernel(k, v, g, beta, state, count)
        if count is not None:
            return advance_state_counted(k, v, g, beta, state, count)
        return advance_state(k, v, g, beta, state)


class HybridStaticCache(StaticTargetCache):
    """StaticTargetCache whose commits also roll the linear-attention states forward to exactly the kept rows.

    A verify leaves its rows pending: a crop keeps a prefix of its chain, a compact a path of its tree, and the next
    forward keeps a chain whole (a decode step's one row, a fully accepted draft). A prefill updates the states in
    place and leaves nothing pending; a tree left uncommitted is a bug and raises."""

    def __init__(self, storage: KVStorage, states: LinearStates) -> None:
        super().__init__(storage)
        self.states: LinearStates = states
        states.reset()
        self.pending: tuple[int, int, bool] | None = None  # the last verify's (base, rows, chain)

    @contextmanager
    def prefilling(self) -> Iterator[None]:
        """Forwards inside are a prefill's: the states advance in place (`HybridFastTarget` reads the flag)."""
        self._settle_pending()
        self.states.prefilling = True
        try:
            yield
        finally:
            self.states.prefilling = False

    @contextmanager
    def running(self, input_ids: torch.Tensor, tree_mask: torch.Tensor | None) -> Iterator[None]:
        self._settle_pending()
        base = self.length
        with super().running(input_ids, tree_mask):
            yield
        if not self.states.prefilling:
            self.pending = (base, input_ids.shape[1], tree_mask is None)

    def _settle_pending(self) -> None:
        """Keep the last verify's rows whole (it was a chain nobody cropped)."""
        if self.pending is None:
            return
        base, rows, chain = self.pending
        if not chain:
            raise RuntimeError("a tree verify was not compacted before the next forward")
        self._commit(torch.arange(rows, device=self.storage.kv.device))

    def _commit(self, rows: torch.Tensor) -> None:
        self.pending = None
        self.states.commit(rows)

    def _last_verify(self, base: int) -> tuple[int, int, bool]:
        if self.pending is None or base < self.pending[0]:
            raise ValueError(f"cannot roll a hybrid cache back to {base}: only the last verify's rows can be dropped")
        return self.pending

    def crop(self, length: int) -> None:
        """Keep the first `length` positions: a prefix of the last verify's chain (all of it at its length or past),
        or none of a tree's rows."""
        if self.pending is None and length >= self.length:
            return
        base, _, chain = self._last_verify(length)
        kept = min(length, self.length) - base
        if kept and not chain:
            raise ValueError("a tree verify's rows are kept by compact, not crop")
        self._commit(torch.arange(kept, device=self.storage.kv.device))
        super().crop(length)

    def compact(self, base: int, keep: torch.Tensor) -> None:
        """Keep positions [0, base) followed by the last verify's rows `keep`, one path of its tree."""
        self._last_verify(base)
        if self.pending[0] != base:
            raise ValueError(f"a compact at {base} must start where the last verify did ({self.pending[0]})")
        self._commit(keep)
        super().compact(base, keep)


class HybridFastTarget(FastTarget):
    """A FastTarget for Qwen3.5-style hybrid stacks: gated attention on the static KV cache, Gated DeltaNet on static
    linear states; same interface, same results as HF's forward, batched slots and fused greedy steps included (each
    slot its own linear states; a fused step commits them on the device). Its prompts prefill one per forward."""

    packs_prompts = False

    def __init__(self, model: PreTrainedModel, cache_slots: int | None = None, graphs: bool | None = None,
                 compiled: bool | None = None, fused: bool | None = None) -> None:
        problem = hybrid_engine_problem(model)
        if problem is not None:
            raise ValueError(f"the fast engine does not support {problem}")
        Target.__init__(self, model)
        text = model.config.get_text_config(decoder=True)
        decoder = model.get_decoder()
        cuda = self.device.type == "cuda"
        self.use_graphs = cuda if graphs is None else graphs and cuda
        self.fused = cuda if fused is None else fused  # greedy steps as `decoding.fused_steps`
        self.ops = LayerOps(cuda if compiled is None else compiled, few_rows=cuda)
        self.units = HybridUnits(self.ops.compiled, rule_kernel=cuda)
        self.prefill_ops = self.ops.library_products()
        self.eps: float = text.rms_norm_eps
        self.act: str = text.hidden_act
        self.heads: int = text.num_attention_heads
        self.kv_heads: int = text.num_key_value_heads
        self.head_dim: int = text.head_dim
        self.final_norm = _one_plus(decoder.norm.weight)
        rotary = decoder.rotary_emb
        self.rotary = lambda x, positions: rotary(x, positions.expand(3, *positions.shape))  # text: one position
        self.layers: list[LayerWeights | DeltaNetWeights] = [  # type: ignore[assignment]
            pack_delta_net(layer) if kind == "linear_attention" else pack_gated_attention(layer)
            for layer, kind in zip(decoder.layers, self.layer_types)
        ]
        self.kv_index = {i: n for n, i in enumerate(i for i, k in enumerate(self.layer_types)
                                                     if k != "linear_attention")}
        self.linear_index = {i: n for n, i in enumerate(i for i, k in enumerate(self.layer_types)
                                                         if k == "linear_attention")}
        net = next(layer for layer in self.layers if isinstance(layer, DeltaNetWeights))
        self._linear_shape = (len(self.linear_index), conv_channels(net), net.conv.shape[-1], net.value_heads,
                              net.key_dim, net.value_dim)
        self.states = self.batch_states(1)
        slots = cache_slots or min(self.max_positions or 4096, 4096)
        self.storage = KVStorage(len(self.kv_index), self.kv_heads, self.head_dim, slots, self.dtype, self.device)
        self._init_graphs()

    def new_cache(self) -> HybridStaticCache:
        """The target's one static cache and state, emptied."""
        return HybridStaticCache(self.storage, self.states)

    @property
    def kv_layers(self) -> int:
        """Layers with K/V in a cache: the attention layers."""
        return len(self.kv_index)

    def batch_states(self, slots: int) -> LinearStates:
        """Linear states for `slots` sequences (a batch store's; the target's own batch-1 cache has one)."""
        return LinearStates(*self._linear_shape, self.dtype, self.device, self.units.advance, slots)

    def prefill(self, input_ids: torch.Tensor, positions: torch.Tensor, own: torch.Tensor | None,
                cache: StaticTargetCache, tap_layers: tuple[int, ...] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """FastTarget's prefill with the linear states advancing in place; one prompt per forward (linear attention
        would run packed prompts into each other)."""
        if own is not None:
            raise ValueError("a hybrid target prefills one prompt per forward (no packed prompts)")
        assert isinstance(cache, HybridStaticCache)
        with cache.prefilling():
            return super().prefill(input_ids, positions, own, cache, tap_layers)

    def _room_for_rows(self, rows: int) -> None:
        """Row buffers for a verify of `rows` rows (a prefill keeps none); growing them drops the graphs captured on
        the old ones, as a grown KV buffer does."""
        if self.states.prefilling:
            return
        before = self.states.version
        self.states.ensure_rows(rows)
        if self.states.version != before:
            self.storage.version += 1

    def _eager(self, ids: torch.Tensor, positions: torch.Tensor, own: torch.Tensor | None, cache: StaticTargetCache,
               tap_layers: tuple[int, ...] | None, ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._room_for_rows(ids.shape[1])
        return super()._eager(ids, positions, own, cache, tap_layers, ops)

    def _replay(self, input_ids: torch.Tensor, positions: torch.Tensor, own: torch.Tensor | None,
                cache: StaticTargetCache, tap_layers: tuple[int, ...] | None, rows: int, head: bool
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._room_for_rows(rows)
        return super()._replay(input_ids, positions, own, cache, tap_layers, rows, head)

    def verify_pass(self, ids: torch.Tensor, positions: torch.Tensor, own: torch.Tensor, cap: int,
                    tap_layers: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """FastTarget's (a fused step's forward), the row buffers first made room for (in a capture's warm-up, before
        the capture itself)."""
        self._room_for_rows(ids.shape[1])
        return super().verify_pass(ids, positions, own, cap, tap_layers)

    def commit_path(self, path: torch.Tensor, count: torch.Tensor) -> None:
        """A fused step's commit of its verify inside its graph: the linear states advanced over the first `count`
        rows of `path` (the K/V and the length are the step's own work)."""
        self.states.commit_counted(path, count)

    def warm_verify(self, rows: Iterable[int], positions: int, tap_layers: tuple[int, ...] | None) -> None:
        """FastTarget's, with the row buffers sized for the largest verify first (growing them later would drop the
        graphs captured before)."""
        counts = [graph_rows(r) for r in rows]
        if counts:
            self._room_for_rows(max(counts))
        super().warm_verify(counts, positions, tap_layers)

    def committed_buffers(self) -> list[torch.Tensor]:
        """FastTarget's, and the committed linear states: a prefill's forward and a fused step's commit advance
        them in place."""
        return [*super().committed_buffers(), self.states.window, self.states.state]

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, own: torch.Tensor, cap: int,
             tap_layers: tuple[int, ...] | None, ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward up to the final norm, device work only (a CUDA graph captures it): attention layers as
        FastTarget's with the output gate, linear layers from the committed states, a verify's rows along their
        paths (`own`), what their commit needs kept, a prefill's in one causal run."""
        kv = self.storage.kv
        t = ids.shape[1]
        slots = self.storage.length + self.slot_ids[:t]
        cos, sin = self.cos[positions][None, None], self.sin[positions][None, None]
        groups = self.heads // self.kv_heads
        layout = (prompt_rows(own) if self.states.prefilling
                  else self.units.verify_rows(own.unsqueeze(0), self.states.window.shape[-1] + 1))

        def dense(window: int | None) -> torch.Tensor:
            return ops.attention_bias(self.storage.length, self.slot_ids[:cap], positions, own, window, groups,
                                      self.dtype)

        mask, biases = attention_masks(ops, self.slot_ids[:1], self.storage.length.view(1), own.unsqueeze(0),
                                       positions.unsqueeze(0), dense, {None})

        def step(i: int, layer: LayerWeights | DeltaNetWeights, x: torch.Tensor, proj: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
            if isinstance(layer, DeltaNetWeights):
                mixed = self._delta_net(self.states, self.linear_index[i], layer, proj, layout)
            else:
                mixed = self._gated_attention(ops, layer, proj, cos, sin, kv[self.kv_index[i]], slots, cap,
                                              biases.get(None), mask)
            return layer_mlp(ops, layer, x, mixed, self.eps, self.act)  # type: ignore[arg-type]

        return run_stack(ops, self.layers, F.embedding(ids, self.embedding_weight), step,  # type: ignore[arg-type]
                         self.final_norm, self.eps, tap_layers)

    def _gated_attention(self, ops: LayerOps, layer: LayerWeights, proj: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, cap: int, bias: torch.Tensor | None,
                         mask: object) -> torch.Tensor:
        """Attention over the first `cap` slots after `gated_attention_heads` wrote the rows' K/V at `slots`, then the
        output gate: [1, t, heads * d] for o_proj."""
        t = proj.shape[1]
        q, gate = self.units.gated_attention_heads(proj, layer.q_norm, layer.k_norm, cos, sin, self.heads,
                                                   self.kv_heads, self.head_dim, self.eps, kv[0], kv[1], slots)
        out = attend(ops, layer, q, kv[0, :, :cap].unsqueeze(0), kv[1, :, :cap].unsqueeze(0), bias, t, self.heads,
                     mask)  # type: ignore[arg-type]
        return out * torch.sigmoid(gate)

    def run_batch(self, kv: torch.Tensor, linear: LinearStates | None, lengths: torch.Tensor, ids: torch.Tensor,
                  positions: torch.Tensor, own: torch.Tensor, cap: int,
                  tap_layers: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """FastTarget's batched forward (sequences in slots 0..B-1, each with its own length) for the hybrid stack:
        the attention layers' K/V in `kv`, the linear layers' states in slots 0..B-1 of `linear`, every sequence's
        rows along their own paths (`own` [B, t, t])."""
        assert linear is not None, "a hybrid target's batch store holds its linear states"
        batch, t = ids.shape
        ops = self.ops
        seq, cols, cos, sin, mask, biases = self.batch_layout(lengths, positions, own, cap, {None})
        layout = self.units.verify_rows(own, linear.window.shape[-1] + 1)

        def step(i: int, layer: LayerWeights | DeltaNetWeights, x: torch.Tensor, proj: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
            if isinstance(layer, DeltaNetWeights):
                mixed = self._delta_net(linear, self.linear_index[i], layer, proj, layout)
            else:
                layer_kv = kv[self.kv_index[i]]
                q, gate = self.units.batched_gated_attention_heads(
                    proj, layer.q_norm, layer.k_norm, cos, sin, self.heads, self.kv_heads, self.head_dim, self.eps,
                    layer_kv[0], layer_kv[1], seq, cols)
                out = attend(ops, layer, q, layer_kv[0, :batch, :, :cap], layer_kv[1, :batch, :, :cap],
                             biases.get(None), t, self.heads, mask)  # type: ignore[arg-type]
                mixed = out * torch.sigmoid(gate)
            return layer_mlp(ops, layer, x, mixed, self.eps, self.act)  # type: ignore[arg-type]

        return run_stack(ops, self.layers, F.embedding(ids, self.embedding_weight), step,  # type: ignore[arg-type]
                         self.final_norm, self.eps, tap_layers)

    def _delta_net(self, states: LinearStates, n: int, layer: DeltaNetWeights, proj: torch.Tensor,
                   layout: VerifyRows | PromptRows) -> torch.Tensor:
        """Linear layer n's mixer output [B, t, value heads * dv] for out_proj, from slots 0..B-1 of `states`: a
        prefill (`layout` its `prompt_rows`, batch 1) advances its window and state in place over its prompt's
        rows; a verify reads them and keeps what each row's commit needs."""
        units = self.units
        batch = proj.shape[0]
        sizes = (layer.key_heads, layer.value_heads, layer.key_dim, layer.value_dim, layer.act)
        inputs = proj[..., :conv_channels(layer)]
        window, state = states.window[n, :batch], states.state[n, :batch]
        if isinstance(layout, PromptRows):
            q, k, v, g, beta, z = units.prefill_heads(window, proj, layer.conv, layer.neg_decay, layer.dt_bias, *sizes)
            out, final = units.prefill_rule(q, k, v, g.where(layout.mask, 0.0), beta.where(layout.mask, 0.0), state,
                                            proj.dtype)
            window.copy_(slid_window(window, inputs.transpose(1, 2), layout.count))
            state.copy_(final)
        else:
            q, k, v, g, beta, z = units.verify_heads(window, proj, layer.conv, layout.columns, layer.neg_decay,
                                                     layer.dt_bias, *sizes)
            states.keep_rows(n, inputs, k, v, g, beta)
            out = units.path_rule(q, k, v, g, beta, state, layout)
        return units.gated_norm(out.transpose(1, 2).to(proj.dtype), z, layer.gated_norm, self.eps)
