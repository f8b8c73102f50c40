"""One Flax NNX decoder for the Llama / Mistral / Qwen2 / Qwen3 family.

Layer parameters are always stored stacked, with a leading `layers` axis. The forward pass runs
them either under `lax.scan` (compile time flat in depth) or as an unrolled Python loop over
slices of the same arrays; the storage, loaders and shardings do not change between the two.

Every parameter carries `logical_axes` metadata (vocab, embed, heads, kv_heads, head_dim, mlp,
norm, layers); `hfjax.parallel.sharding` turns those names into `NamedSharding`s for a layout.

The same backbone serves three heads: `CausalLM` (logits), `ValueModel` (a per-token scalar, the
critic) and `ScoreModel` (one scalar per sequence, a reward or cost model).

The matmul lives in `hfjax.models.low_precision` and the rotary embedding in
`hfjax.models.rope`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from hfjax.models import expert_parallel, image_inputs, lora_dropout, moe
from hfjax.models import sequence_parallel as sp
from hfjax.models.attention import ResponseBlocks, SharedPrompt, attention_fn
from hfjax.models.backend import storage_dtype
from hfjax.models.config import ModelConfig
from hfjax.models.low_precision import matmul
from hfjax.models.rope import apply_rope, rope_inv_freq, rope_tables
from hfjax.parallel import sharding as shd


class KVCache(NamedTuple):
    """Preallocated keys and values of every layer: [layers, batch, slots, kv_heads, head_dim]."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, slots: int) -> KVCache:
        shape = (cfg.num_layers, batch, slots, cfg.num_kv_heads, cfg.head_dim)
        dt = storage_dtype(cfg.jnp_dtype)
        return cls(jnp.zeros(shape, dt), jnp.zeros(shape, dt))


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """Position ids of a left-padded batch: 0 at each row's first real token, 0 on padding."""
    mask = attention_mask.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, scaled after casting back to x's dtype.

    The scale and the normalised x are both rounded to x's dtype and multiplied in float32,
    then rounded once: the same values as a product in x's dtype, but the scale's gradient
    (a sum over every token) is then a float32 reduction; in bfloat16, XLA:CPU sums it by
    windows, several times slower."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    f32 = jnp.float32
    return (weight.astype(x.dtype).astype(f32) * y.astype(x.dtype).astype(f32)).astype(x.dtype)


_CP = jax.checkpoint_policies
# The policies that keep matmul outputs also keep sequence parallelism's exchanged q, k, v and
# attention output (`sequence_parallel.EXCHANGED`: Ulysses' all-to-all results, ring's
# zig-zag-placed blocks): the same bytes as the projections they come from, and recomputing
# them would repeat the layer's exchanges in the backward pass.
_KEEP_EXCHANGE = _CP.save_only_these_names(sp.EXCHANGED)
_REMAT = {
    "full": _CP.nothing_saveable,
    "dots": _CP.save_from_both_policies(_CP.checkpoint_dots, _KEEP_EXCHANGE),
    "dots_no_batch": _CP.save_from_both_policies(_CP.dots_with_no_batch_dims_saveable,
                                                 _KEEP_EXCHANGE),
}


def _param(rngs: nnx.Rngs, cfg: ModelConfig, shape, axes, init="normal") -> nnx.Param:
    dt = cfg.jnp_param_dtype
    if init == "ones":
        value = jnp.ones(shape, dt)
    elif init == "zeros":
        value = jnp.zeros(shape, dt)
    else:
        value = (0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dt)
    return nnx.Param(value, logical_axes=axes)


class Layers(nnx.Module):
    """All decoder layers' parameters, stacked on a leading `layers` axis."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        L, D, N, K, H, F = (
            cfg.num_layers,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
        )
        p = lambda shape, axes, init="normal": _param(rngs, cfg, shape, axes, init)
        self.input_norm = p((L, D), ("layers", "norm"), "ones")
        self.q_proj = p((L, D, N, H), ("layers", "embed", "heads", "head_dim"))
        self.k_proj = p((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"))
        self.v_proj = p((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"))
        self.o_proj = p((L, N, H, D), ("layers", "heads", "head_dim", "embed"))
        if cfg.attention_bias:
            self.q_bias = p((L, N, H), ("layers", "heads", "head_dim"), "zeros")
            self.k_bias = p((L, K, H), ("layers", "kv_heads", "head_dim"), "zeros")
            self.v_bias = p((L, K, H), ("layers", "kv_heads", "head_dim"), "zeros")
        if cfg.qk_norm:
            self.q_norm = p((L, H), ("layers", "norm"), "ones")
            self.k_norm = p((L, H), ("layers", "norm"), "ones")
        self.post_attn_norm = p((L, D), ("layers", "norm"), "ones")
        # A mixture of experts stacks the dense MLP over its dense layers only and the router
        # and experts over its sparse ones (`ModelConfig.layer_indices`).
        Ld = len(cfg.layer_indices("dense")) if cfg.is_moe else L
        if Ld:
            self.gate_proj = p((Ld, D, F), ("layers", "embed", "mlp"))
            self.up_proj = p((Ld, D, F), ("layers", "embed", "mlp"))
            self.down_proj = p((Ld, F, D), ("layers", "mlp", "embed"))
        if cfg.is_moe:
            Ls, E, Fe = (len(cfg.layer_indices("sparse")), cfg.num_experts,
                         cfg.moe_intermediate_size)
            # The router stays whole on every device: each token's top-k reads all E logits.
            self.router = p((Ls, D, E), ("layers", "embed", None))
            self.expert_gate = p((Ls, E, D, Fe), ("layers", "expert", "embed", "mlp"))
            self.expert_up = p((Ls, E, D, Fe), ("layers", "expert", "embed", "mlp"))
            self.expert_down = p((Ls, E, Fe, D), ("layers", "expert", "mlp", "embed"))

    def arrays(self) -> dict[str, jax.Array]:
        """{name: stacked array} of every parameter; LoRA adapters (`hfjax.models.lora`) come
        with their `_lora_b` already scaled by alpha / rank."""
        out = {k: v[...] for k, v in vars(self).items() if isinstance(v, nnx.Param)}
        scale = getattr(self, "lora_scale", None)
        if scale is not None:
            out = {k: v * scale if k.endswith("_lora_b") else v for k, v in out.items()}
        return out


# Each adapted projection's dropout mask comes from its layer's key with its index folded in.
_DROPOUT_STREAMS = {n: i for i, n in enumerate(
    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))}


def _proj(cfg: ModelConfig, p, x: jax.Array, name: str, out_shape: tuple[int, ...],
          out_dtype=None) -> jax.Array:
    """x [B, T, in] times parameter `name` as one 2-D [B*T, in] x [in, out] `matmul`, or, for
    rows split over `sequence` (`keeps_rows`), as [B, T, in] x [in, out].

    As [B, T, D] einsums, XLA:CPU forms the weight gradients through strided transposes of
    [B, T, out] activations fused with their producers; with other jobs on the cores those made
    the backward pass ~2x slower (on an idle machine the two forms time the same;
    docs/benchmarks.md, "Peers"). But merging a split T with B into one dimension is a layout
    XLA cannot shard when a device holds more than one row: it gathers whole rows over
    `sequence` before the matmul, and every device computes every token of its rows
    (tests/models/test_sequence_parallel_hlo.py). Split rows therefore keep [B, T].
    """
    B, T = x.shape[:2]
    w = p[name].reshape(-1, math.prod(out_shape))
    x2 = x.reshape(B, T, -1) if keeps_rows() else x.reshape(B * T, -1)
    flat = matmul(x2, w, cfg.jnp_dtype, out_dtype)
    a = p.get(f"{name}_lora_a")
    if a is not None:  # LoRA (`hfjax.models.lora`): + (x @ A) @ (scale * B), A and B float32
        r = a.shape[-1]
        xin = x2
        if lora_dropout.LAYER_KEY in p:  # a training step's adapter dropout (its own mask)
            _, rate = lora_dropout.active()
            key = jax.random.fold_in(p[lora_dropout.LAYER_KEY], _DROPOUT_STREAMS[name])
            xin = lora_dropout.apply(x2, key, rate)
        xa = matmul(xin, a.reshape(-1, r), cfg.jnp_dtype)
        b = p[f"{name}_lora_b"].reshape(r, -1)
        flat = flat + matmul(xa, b, cfg.jnp_dtype, flat.dtype)
    return flat.reshape(B, T, *out_shape)


def keeps_rows() -> bool:
    """Whether activations keep their [B, T, ...] form through the matmuls: under a layout
    that splits rows over `sequence` (`hfjax.models.sequence_parallel`)."""
    return sp.sequence_size(shd.active_layout()) > 1


def attention_inputs(cfg: ModelConfig, rope, p, h):
    """The first half of a decoder layer: input norm, q/k/v projections (with biases and q/k
    norms where the family has them) and RoPE by the `rope_tables` of h's positions. Returns
    q [B, T, N, H] and k, v [B, T, K, H], in the attention's dtype (`storage_dtype`)."""
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    dt = storage_dtype(cfg.jnp_dtype)
    x = rms_norm(h, p["input_norm"], cfg.rms_norm_eps)
    if "qkv_proj" in p:  # fused weights (`hfjax.engine.decode.split_layers`): one matmul
        qkv = _proj(cfg, p, x, "qkv_proj", ((N + 2 * K) * H,), dt)
        q, k, v = jnp.split(qkv, [N * H, (N + K) * H], axis=-1)
        B, T = x.shape[:2]
        q, k, v = q.reshape(B, T, N, H), k.reshape(B, T, K, H), v.reshape(B, T, K, H)
    else:
        q = _proj(cfg, p, x, "q_proj", (N, H), dt)
        k = _proj(cfg, p, x, "k_proj", (K, H), dt)
        v = _proj(cfg, p, x, "v_proj", (K, H), dt)
    if cfg.attention_bias:
        q = q + p["q_bias"].astype(dt)
        k = k + p["k_bias"].astype(dt)
        v = v + p["v_bias"].astype(dt)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    return apply_rope(q, rope), apply_rope(k, rope), v


def layer_output(cfg: ModelConfig, p, h, attn):
    """The second half of a decoder layer: the attention output attn [B, T, N, H] through
    o_proj into the residual, then the gated MLP (dense, or the layer's mixture of experts).
    Returns the new hidden states [B, T, D]."""
    return routed_layer_output(cfg, p, h, attn)[0]


def routed_layer_output(cfg: ModelConfig, p, h, attn, *, recorded=None, replay=True,
                        valid=None):
    """`layer_output` and the layer's `moe.RouterStats` (None for a dense MLP); `recorded`
    [B, T, k] expert ids are a sparse layer's recorded routing (replayed with `replay`, else
    only compared: `moe.sparse_mlp`), `valid` [B, T] marks the tokens its statistics count."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    h = h + _proj(cfg, p, attn, "o_proj", (D,))
    x = rms_norm(h, p["post_attn_norm"], cfg.rms_norm_eps)
    if "router" in p:
        layout = shd.active_layout()
        if expert_parallel.expert_size(layout) > 1:  # experts split over `expert`: all-to-all
            y, stats = expert_parallel.sparse_mlp(cfg, p, x, layout, recorded=recorded,
                                                  replay=replay, valid=valid)
        else:
            y, stats = moe.sparse_mlp(cfg, p, x, recorded=recorded, replay=replay, valid=valid)
        return h + y, stats
    if "gate_up_proj" in p:  # fused weights, as q/k/v above
        gate, up = jnp.split(_proj(cfg, p, x, "gate_up_proj", (2 * F,)), 2, axis=-1)
    else:
        gate = _proj(cfg, p, x, "gate_proj", (F,))
        up = _proj(cfg, p, x, "up_proj", (F,))
    return h + _proj(cfg, p, jax.nn.silu(gate) * up, "down_proj", (D,)), None


def _block(cfg: ModelConfig, rope, p, h, attention, cache_kv, cache_index, recorded, replay,
           valid):
    """One decoder layer. p holds this layer's arrays; `attention(q, k, v)` is
    `hfjax.models.attention.attention_fn`'s; cache_kv is (k, v) slots or None; recorded,
    replay and valid are `routed_layer_output`'s.

    Returns (new hidden, new (k, v) slots or None, router stats or None).
    """
    q, k, v = attention_inputs(cfg, rope, p, h)
    new_kv = None
    if cache_kv is not None:
        ck, cv = cache_kv
        ck = jax.lax.dynamic_update_slice_in_dim(ck, k.astype(ck.dtype), cache_index, axis=1)
        cv = jax.lax.dynamic_update_slice_in_dim(cv, v.astype(cv.dtype), cache_index, axis=1)
        new_kv = (ck, cv)
        k, v = ck, cv
    h, stats = routed_layer_output(cfg, p, h, attention(q, k, v), recorded=recorded,
                                   replay=replay, valid=valid)
    return h, new_kv, stats


class Backbone(nnx.Module):
    """Token embeddings, the stacked decoder layers and the final norm."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embed_tokens = _param(rngs, cfg, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"))
        self.layers = Layers(cfg, rngs)
        self.norm = _param(rngs, cfg, (cfg.hidden_size,), ("norm",), "ones")

    def embed(self, input_ids: jax.Array, split: bool = False) -> jax.Array:
        """Token embeddings [B, T, D] of input_ids [B, T]; with `split`, T is split over the
        `sequence` mesh axis (sequence parallelism: every later activation follows).

        Under a worker group's layout the table is gathered as FSDP gathers any weight before
        use (`sharding.gathered`): whole along `embed`, and along `vocab` split over `tensor`
        only, never over fsdp or sequence (the nested training rules store it so). The rows
        come out split like the token ids: each device looks up its own tokens, and the lookup
        and its gradient partition without moving token ids or whole rows between devices.
        (With the table split over fsdp x sequence, XLA looked every token of the micro-batch up
        on each device and all-reduced the whole rows' embeddings once the vocab outgrew the
        micro-batch's tokens. Left to move token ids itself, it reorders them with a
        collective-permute that nothing orders against the parameter all-gathers; XLA:CPU can
        then deadlock.)
        """
        table = shd.gathered(self.embed_tokens[...], ("vocab", "embed"))
        h = jnp.take(table, input_ids, axis=0).astype(self.config.jnp_dtype)
        return shd.constrain(h, ("batch", "length" if split else None, None))

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        *,
        positions: jax.Array | None = None,
        cache: KVCache | None = None,
        cache_index: jax.Array | int = 0,
        segment_ids: jax.Array | None = None,
        segment_span: int | None = None,
        shared_prompt: SharedPrompt | None = None,
        response_blocks: ResponseBlocks | None = None,
        keep_width: bool = False,
        routing: jax.Array | None = None,
        embeds: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """Final hidden states [B, T, D] and the updated cache (None without a cache).

        With `keep_width`, rows split over `sequence` come back at their padded width W >= T
        (`sequence_parallel.padded_width`; columns past T are padding): cutting them to T
        would move the last shard's tokens between devices, so a head that reduces each
        position to a few numbers runs on the split [B, W, D] and cuts its own output.

        Without a cache, `attention_mask` [B, T] marks real tokens of a left-padded batch and
        positions default to `positions_from_mask`. With a cache, the T new tokens are written at
        slots [cache_index, cache_index + T); `attention_mask` [B, slots] then marks which slots
        hold real tokens (the new ones included) and `positions` must be given. Positions are
        below the number of key slots (a token's position never exceeds its slot index).

        Packed rows (`hfjax.engine.packing`, no cache): `segment_ids` [B, T] number the
        sequences laid end to end in a row (0 on padding) and `positions` restart at 0 in each;
        a token attends only to earlier tokens of its own segment. With `segment_span`, the
        most tokens a segment has, wide rows are attended by blocks (`banded_attention`).

        Shared-prompt rows (`hfjax.engine.shared_prompt`, no cache): with `shared_prompt`, each
        row holds a prompt and its samples' responses (`SharedPrompt`); `positions` must be
        given (a response's continue from its prompt's, as in its padded row).

        Shared-prompt rows whose responses are laid end to end, each only as long as it is
        (`hfjax.engine.shared_prompt.compact_layout`, no cache): `response_blocks` marks
        each column's block (`ResponseBlocks`); a prompt token sees the prompt's earlier
        tokens, a response token the prompt and its own response's earlier tokens
        (`compact_attention`). `positions` must be given.

        A mixture-of-experts model (`hfjax.models.moe`) replays the expert ids `routing`
        [sparse layers, B, T, k] when given; without them and without a cache, it takes
        those an active `moe.given_routing` holds (replayed or only compared). It hands each
        pass's router statistics to an active `moe.collecting()`.

        A vision-language model (`hfjax.models.qwen2_5_vl`) passes `embeds` [B, T, D], the
        token embeddings with its image features in place, and M-RoPE `positions` [3, B, T];
        without a cache and `embeds`, a pass takes the rows' images an active
        `image_inputs.given` holds (a training batch's).
        """
        cfg = self.config
        B, T = input_ids.shape
        if routing is not None and not cfg.is_moe:
            raise ValueError("routing replay needs a mixture-of-experts model; this one is dense")
        replay, given = True, moe.given()
        if routing is None and cache is None and cfg.is_moe and given is not None:
            rows, cols = given.ids.shape[:2]
            if rows != B or cols > T:  # fewer columns: a pass that pads its rows at the end
                raise ValueError(f"recorded routing of rows {(rows, cols)} for a pass over "
                                 f"rows {(B, T)}: this row layout does not carry it")
            routing = jnp.pad(jnp.moveaxis(given.ids, 2, 0), [(0, 0), (0, 0), (0, T - cols),
                                                              (0, 0)])
            replay = given.replay
        if segment_ids is not None:
            if cache is not None or positions is None:
                raise ValueError("packed rows (segment_ids) take positions and no cache")
            attention_mask = segment_ids > 0
        if attention_mask is None:
            attention_mask = jnp.ones((B, T if cache is None else cache.k.shape[2]), jnp.int32)
        key_valid = attention_mask.astype(bool)
        images = image_inputs.active() if cache is None and embeds is None else None
        if images is not None:
            # A vision-language batch's rows (`hfjax.models.image_inputs`): padded rows only.
            if (segment_ids is not None or shared_prompt is not None
                    or response_blocks is not None or sp.sequence_size(shd.active_layout()) > 1):
                raise ValueError("rows with images are scored as padded rows only: turn off "
                                 "use_remove_padding, group_by_length and share_prompt, and "
                                 "use a mesh with sequence=1")
            embeds, positions = image_inputs.spliced(self.embed(input_ids), input_ids, images)
        if positions is None:
            if cache is not None:
                raise ValueError("positions are required when decoding with a KV cache")
            positions = positions_from_mask(attention_mask)
        if shared_prompt is not None or response_blocks is not None:
            if cache is not None or positions is None or segment_ids is not None:
                raise ValueError("shared-prompt rows take positions, no cache and no segments")
        attention = attention_fn(
            cfg, key_valid, T, storage_dtype(cfg.jnp_dtype),
            cache_index=None if cache is None else cache_index, segment_ids=segment_ids,
            segment_span=segment_span, shared_prompt=shared_prompt,
            response_blocks=response_blocks, attention_mask=attention_mask)

        # Sequence parallelism (`hfjax.models.sequence_parallel`): without a cache, a mesh
        # with `sequence` > 1 splits the row's tokens; the row is padded at the end to a
        # multiple of the split (masked out of every attention) and cut back after the layers.
        width = T
        split = cache is None and sp.sequence_size(shd.active_layout()) > 1
        if split and (embeds is not None or positions.ndim == 3):
            raise ValueError("sequence parallelism does not split image embeddings or M-RoPE "
                             "positions yet; use a mesh with sequence=1 for a vision model")
        if split:
            width = sp.padded_width(T, shd.active_layout())
            pad = [(0, 0), (0, width - T)]
            input_ids, positions = jnp.pad(input_ids, pad), jnp.pad(positions, pad)
        h = self.embed(input_ids, split=split) if embeds is None else embeds.astype(cfg.jnp_dtype)
        rope = rope_tables(positions, rope_inv_freq(cfg), storage_dtype(cfg.jnp_dtype),
                           key_valid.shape[1], cfg.mrope_section)
        params = self.layers.arrays()
        dropout = lora_dropout.active()
        rate = getattr(self.layers, "lora_dropout", 0.0)
        if dropout is not None and cache is None and rate:
            # Inside a training step's loss (`hfjax.models.lora_dropout`): a key per layer.
            if dropout[1] != rate:
                raise ValueError(f"adapter dropout traced at rate {dropout[1]} for a model "
                                 f"whose lora.dropout is {rate}")
            params[lora_dropout.LAYER_KEY] = lora_dropout.layer_keys(dropout[0], cfg.num_layers)

        # A sparse model's routing: `routing` [sparse layers, B, T, k] replays expert ids;
        # `valid` marks the tokens the router statistics count (none while decoding).
        valid = None
        if cfg.is_moe and cache is None:
            valid = key_valid
            if split:
                valid = jnp.pad(valid, pad)
                if routing is not None:
                    routing = jnp.pad(routing, [(0, 0), *pad, (0, 0)])

        def layer(h, p, kv, r):
            return _block(cfg, rope, p, h, attention, kv, cache_index, r, replay, valid)

        if cfg.remat_policy != "none":
            layer = jax.checkpoint(layer, policy=_REMAT[cfg.remat_policy])

        scan = cfg.scan_layers and moe.uniform(cfg)
        per_layer = None if scan else moe.layer_slices(cfg, params)
        sparse_index = {i: j for j, i in enumerate(cfg.layer_indices("sparse"))}

        def replay_of(i):
            return None if routing is None or i not in sparse_index else routing[sparse_index[i]]

        stats = []
        if cache is None:
            if scan:
                def body(h, xs):
                    h, _, st = layer(h, xs[0], None, xs[1])
                    return h, st

                h, st = jax.lax.scan(body, h, (params, routing))
                stats = [] if st is None else [st]
            else:
                for i in range(cfg.num_layers):
                    h, _, st = layer(h, per_layer[i], None, replay_of(i))
                    stats += [] if st is None else [st]
                stats = [moe.stack(stats)] if stats else []
            new_cache = None
        else:
            # The whole cache rides in the carry and each layer updates its slice in place, so a
            # decode step never copies the cache.
            def step(carry, xs):
                h, ck, cv = carry
                i, p, r = xs
                h, (k_i, v_i), st = layer(h, p, (ck[i], cv[i]), r)
                ck = jax.lax.dynamic_update_index_in_dim(ck, k_i, i, axis=0)
                cv = jax.lax.dynamic_update_index_in_dim(cv, v_i, i, axis=0)
                return (h, ck, cv), st

            carry = (h, cache.k, cache.v)
            if scan:
                carry, st = jax.lax.scan(step, carry, (jnp.arange(cfg.num_layers), params,
                                                       routing))
                stats = [] if st is None else [st]
            else:
                for i in range(cfg.num_layers):
                    carry, st = step(carry, (i, per_layer[i], replay_of(i)))
                    stats += [] if st is None else [st]
                stats = [moe.stack(stats)] if stats else []
            h, ck, cv = carry
            new_cache = KVCache(ck, cv)
        for st in stats:
            moe.record(st)
        if width != T and not keep_width:
            h = h[:, :T]
        return rms_norm(h, self.norm[...], cfg.rms_norm_eps), new_cache


class CausalLM(nnx.Module):
    """The policy: backbone plus a language-model head (tied to the embeddings or not)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.model = Backbone(cfg, rngs=rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, cfg, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"))

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Float32 logits [..., V] from final hidden states.

        The head multiplies in the compute dtype but accumulates and returns float32: with
        bfloat16 compute, a bfloat16 result would round every logit to 8 significant bits
        (~0.03 at logit 8) before the log-probs that enter the PPO ratio are taken.
        """
        # A 2-D matmul, for the reason given in `_proj` (which also says why split rows keep
        # their leading dimensions).
        flat = hidden if keeps_rows() else hidden.reshape(-1, hidden.shape[-1])
        tied = self.config.tie_word_embeddings
        w = self.model.embed_tokens[...] if tied else self.lm_head[...]
        out = matmul(flat, w, self.config.jnp_dtype, jnp.float32, transpose_w=tied)
        return out.reshape(*hidden.shape[:-1], -1)

    def __call__(self, input_ids, attention_mask=None, **kw):
        """Logits [B, T, V]; with `cache=` also returns the updated cache."""
        hidden, cache = self.model(input_ids, attention_mask, **kw)
        logits = self.logits(hidden)
        return logits if kw.get("cache") is None else (logits, cache)


class ValueModel(nnx.Module):
    """The critic: backbone plus a per-token scalar head. Returns values [B, T] in float32."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.model = Backbone(cfg, rngs=rngs)
        self.score = _param(rngs, cfg, (cfg.hidden_size, 1), ("embed", None), "zeros")

    def __call__(self, input_ids, attention_mask=None, **kw):
        T = input_ids.shape[1]
        hidden, _ = self.model(input_ids, attention_mask, keep_width=kw.get("cache") is None,
                               **kw)
        w = self.score[...].astype(hidden.dtype)
        # Accumulated and returned in float32, like the logits: values feed GAE directly.
        return jnp.einsum("btd,do->bto", hidden, w,
                          preferred_element_type=jnp.float32)[:, :T, 0]


def pooled_index(input_ids: jax.Array, attention_mask: jax.Array,
                 pad_token_id: int | None) -> jax.Array:
    """The position [B] a sequence-classification head reads, as transformers'
    `*ForSequenceClassification` picks it: the rightmost token that is not `pad_token_id`
    (position 0 when every token is the pad). Here only real tokens (attention mask 1) count,
    which changes nothing when padding holds the pad id, as transformers' tokenizers pad, and
    keeps padding that holds another id out of the read. Content that ends in the pad id (a pad
    that doubles as EOS or `<|im_end|>`) is read before it, as transformers reads it. Without a
    pad id (transformers then scores single rows only, at the last position), the last real
    token."""
    mask = attention_mask.astype(jnp.int32) > 0
    if pad_token_id is not None:
        mask = mask & (input_ids != pad_token_id)
    t = jnp.arange(input_ids.shape[1], dtype=jnp.int32)
    return jnp.argmax(jnp.where(mask, t, -1), axis=1).astype(jnp.int32)


class ScoreModel(nnx.Module):
    """A reward or cost model: backbone plus a scalar head read where transformers'
    `*ForSequenceClassification` reads it (`pooled_index`).

    Returns scores [B] in float32. Right or left padding both work.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.model = Backbone(cfg, rngs=rngs)
        self.score = _param(rngs, cfg, (cfg.hidden_size, 1), ("embed", None))

    def __call__(self, input_ids, attention_mask=None, **kw):
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, jnp.int32)
        last = pooled_index(input_ids, attention_mask, self.config.pad_token_id)
        if keeps_rows():
            # Rows split over `sequence`: the read position's hidden state is on one device;
            # the head at every position, then one number per row moves, not [B, T, D].
            T = input_ids.shape[1]
            hidden, _ = self.model(input_ids, attention_mask, keep_width=True, **kw)
            scores = self._head(hidden)[:, :T]
            return jnp.take_along_axis(scores, last[:, None], axis=1)[:, 0]
        hidden, _ = self.model(input_ids, attention_mask, **kw)
        h_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
        return self._head(h_last)

    def token_scores(self, input_ids, attention_mask=None, **kw):
        """The score head at every position [B, T] (float32): a packed row's sequences are
        each read at their own `pooled_index` (`hfjax.engine.packing.last_tokens`)."""
        T = input_ids.shape[1]
        hidden, _ = self.model(input_ids, attention_mask, keep_width=True, **kw)
        return self._head(hidden)[:, :T]

    def _head(self, hidden):
        w = self.score[...].astype(hidden.dtype)
        return jnp.dot(hidden, w, preferred_element_type=jnp.float32)[..., 0]


HEADS = {"causal_lm": CausalLM, "value": ValueModel, "score": ScoreModel}


def build(cfg: ModelConfig, head: str = "causal_lm", seed: int = 0) -> nnx.Module:
    """A freshly initialised model with the given head ("causal_lm", "value" or "score")."""
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; choose one of {sorted(HEADS)}")
    return HEADS[head](cfg, rngs=nnx.Rngs(seed))


def abstract(cfg: ModelConfig, head: str = "causal_lm") -> nnx.Module:
    """The model's structure with ShapeDtypeStruct leaves: nothing is allocated."""
    return nnx.eval_shape(lambda: HEADS[head](cfg, rngs=nnx.Rngs(0)))
