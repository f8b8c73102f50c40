"""The rollout engine: a jitted KV-cache sampler for the actor's generation stage.

Two compiled programs per shape bucket:

- **prefill** runs the left-padded prompts through one forward pass that fills a KV cache of
  `prompt_bucket` slots, repeats that cache (and the last-position logits) n times for n samples
  per prompt, appends `new_tokens_bucket` empty slots, and samples the first response token;
- **decode** runs a `lax.while_loop` that feeds one token per step into the cache and samples
  the next (`hfjax.engine.token_select.select_tokens`), until every row has hit a stop token or
  `max_new_tokens` is reached. The loop state (cache included) is donated, so the cache is
  updated in place. The step itself is `hfjax.engine.decode.decode_step` (per-layer cache,
  layers unrolled over weights sliced once per call; that module says why), which holds one
  extra copy of the layer weights while the program runs.

Both work on the functional form of the model (`nnx.split` -> graphdef + params state), so the
caller passes fresh parameters on every call (the RL actor's weights change every step) and
nothing is baked into the programs as a constant.

Conventions:

- **Rows.** Output row `b * n + j` is sample j of prompt b.
- **Seeds.** Each prompt gets a PRNG key: with an int `seed`, `fold_in(key(seed), b)`; with a
  per-prompt seed array, `key(seeds[b])`. Sample j of a prompt uses `fold_in(prompt_key, j)` and
  step t folds in t. A row's samples therefore depend only on its own seed, never on which
  other prompts share the batch.
- **Stops.** The stop token (EOS or any id in `eos_ids`) is part of the response (mask 1, like
  HF); every later position holds `pad_id` with mask 0 and log-prob 0.
- **Buckets.** Prompts are trimmed to their longest real length and left-padded to the next of
  16, 24, 32, 48, 64, 96, 128, 192, ... (`prompt_bucket`: powers of two and 3/4 of them,
  >= `min_prompt_bucket`); the new-token budget is rounded up to a power of two >=
  `min_new_tokens_bucket` (16). `max_new_tokens` itself is a traced loop bound, so a request for
  20 tokens runs the 32-token program and returns exactly what a 20-token program would. The
  batch size is not bucketed (a training run keeps it fixed).
- **Routing.** A mixture of experts' programs record every fed token's expert ids per sparse
  layer (`GenerateOutput.routing`, for routing replay: `hfjax.workers.routing`).
- **Sharding.** With a decode mesh, parameters go to `Layout(mesh, DECODE_RULES)` (tensor
  parallel only), rows are split over the mesh's (data, fsdp) axes, and the cache's kv-heads over
  `tensor` when it divides them (otherwise they stay replicated, as the decode layout does for
  the KV projections). A prompt batch that does not divide the data-parallel size is padded
  with copies of its first prompt, and the padded rows are dropped from the output.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hfjax.engine.buckets import (
    DEFAULT_MAX_PROMPT_LEN,
    MIN_NEW_TOKENS_BUCKET,
    MIN_PROMPT_BUCKET,
    bucket_size,
    prompt_bucket,
)
from hfjax.engine.decode import (
    DecodeOptions,
    LayerCache,
    cache_and_row_shardings,
    cache_from_prefill,
    decode_options,
    decode_step,
    split_layers,
)
from hfjax.engine.images import ImagePrompts, VisionPrompts, place_images
from hfjax.engine.token_select import (
    GenerateOutput,
    Knobs,
    SamplingParams,
    Static,
    select_tokens,
)
from hfjax.models import moe
from hfjax.models.config import ModelConfig
from hfjax.models.transformer import KVCache, positions_from_mask
from hfjax.parallel import mesh as mesh_lib
from hfjax.parallel import sharding as sharding_lib

# --------------------------------------------------------------------------------------------
# The two programs
# --------------------------------------------------------------------------------------------


class _Carry(NamedTuple):
    """Decode-loop state; `t` is the index of the next response token to produce."""

    t: jax.Array  # int32 []
    cache: tuple[LayerCache, ...]  # per layer: prompt and response parts
    last: jax.Array  # int32 [rows]: the token fed at the next step
    done: jax.Array  # bool [rows]: a stop token has been emitted
    lengths: jax.Array  # int32 [rows]: position of response token 0 (the real prompt length,
    # plus M-RoPE's offset for a prompt with images)
    keys: jax.Array  # PRNG keys [rows]
    attn: jax.Array  # int32 [rows, slots]: prompt mask, then ones for the response slots
    tokens: jax.Array  # int32 [rows, new_bucket]
    mask: jax.Array  # int32 [rows, new_bucket]
    logprobs: jax.Array  # float32 [rows, new_bucket]
    # A mixture of experts' expert ids [rows, prompt_bucket + new_bucket, sparse layers, k]
    # (`GenerateOutput.routing`); None for a dense model.
    routing: jax.Array | None


def _step_keys(keys: jax.Array, t: jax.Array) -> jax.Array:
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, t)


def _record(c: _Carry, tok: jax.Array, lp: jax.Array, stops: jax.Array, knobs: Knobs) -> _Carry:
    """Writes response token t of every row (pad after a stop) and advances t."""
    live = ~c.done
    tok = jnp.where(live, tok, knobs.pad_id)
    lp = jnp.where(live, lp, 0.0)
    col = (jnp.int32(0), c.t)
    hit = jnp.any(tok[:, None] == stops[None, :], axis=-1)
    return c._replace(
        t=c.t + 1,
        last=tok,
        done=c.done | (live & hit),
        tokens=jax.lax.dynamic_update_slice(c.tokens, tok[:, None], col),
        mask=jax.lax.dynamic_update_slice(c.mask, live.astype(jnp.int32)[:, None], col),
        logprobs=jax.lax.dynamic_update_slice(c.logprobs, lp[:, None], col),
    )


def _carry_shardings(mesh: Mesh, cfg: ModelConfig, layout: str = "cpu") -> _Carry:
    """NamedShardings of the loop state: rows over (data, fsdp), kv-heads over tensor."""
    layer, row = cache_and_row_shardings(mesh, cfg, layout)
    return _Carry(
        t=NamedSharding(mesh, P()),
        cache=tuple(LayerCache(layer, layer, layer, layer) for _ in range(cfg.num_layers)),
        last=row,
        done=row,
        lengths=row,
        keys=row,
        attn=row,
        tokens=row,
        mask=row,
        logprobs=row,
        routing=row if cfg.is_moe else None,
    )


def _constrain(c: _Carry, shardings: _Carry | None) -> _Carry:
    return c if shardings is None else jax.lax.with_sharding_constraint(c, shardings)


def _prefill(
    graphdef: nnx.GraphDef,
    static: Static,
    opts: DecodeOptions,
    shardings: _Carry | None,
    state: nnx.State,
    ids: jax.Array,
    mask: jax.Array,
    seeds: jax.Array,
    salts: jax.Array,
    knobs: Knobs,
    stops: jax.Array,
    images: ImagePrompts | None = None,
) -> _Carry:
    """Prompt forward pass, cache fan-out to n samples and the first response token. With
    `images`, the placeholders' embeddings are the prompts' image features and positions are
    M-RoPE's: the images enter the cache here, once per prompt, shared by its n samples."""
    model = nnx.merge(graphdef, state)
    cfg = model.config
    n, new = static.n, static.new_bucket
    batch = ids.shape[0]
    rep = (lambda x: jnp.repeat(x, n, axis=0)) if n > 1 else (lambda x: x)

    cache = KVCache.zeros(cfg, batch, static.prompt_bucket)
    positions, embeds, offsets = positions_from_mask(mask), None, 0
    if images is not None:
        positions, offsets = images.positions, images.offsets
        embeds = place_images(model.model.embed(ids), images.is_image, images.features)
    with moe.collecting() as routed:
        hidden, cache = model.model(ids, mask, positions=positions, cache=cache, cache_index=0,
                                    embeds=embeds)
    # Left padding puts every row's last prompt token in the last column; only that position's
    # logits are needed, which avoids a [B, T, vocab] tensor.
    logits = rep(model.logits(hidden[:, -1]))

    # Sample j of prompt b becomes row b * n + j; the cache is repeated, never recomputed.
    layer_cache = cache_from_prefill(cache, n, new, opts.layout)
    prompt_keys = jax.vmap(lambda s, salt: jax.random.fold_in(jax.random.key(s), salt))(
        seeds, salts
    )
    sample_idx = jnp.tile(jnp.arange(n, dtype=jnp.int32), batch)
    row_keys = jax.vmap(jax.random.fold_in)(rep(prompt_keys), sample_idx)
    rows = batch * n
    mask = mask.astype(jnp.int32)
    carry = _Carry(
        t=jnp.int32(0),
        cache=layer_cache,
        last=jnp.zeros((rows,), jnp.int32),
        done=jnp.zeros((rows,), bool),
        lengths=rep(jnp.sum(mask, axis=-1, dtype=jnp.int32) + offsets),
        keys=row_keys,
        attn=jnp.concatenate([rep(mask), jnp.ones((rows, new), jnp.int32)], axis=1),
        tokens=jnp.full((rows, new), knobs.pad_id, jnp.int32),
        mask=jnp.zeros((rows, new), jnp.int32),
        logprobs=jnp.zeros((rows, new), jnp.float32),
        routing=None,
    )
    if routed:  # the prompt's experts; the response's columns are written as it is decoded
        prompt = moe.storage_ids(cfg, jnp.moveaxis(routed[0].ids, 0, 2))  # [B, P, layers, k]
        carry = carry._replace(routing=jnp.pad(rep(prompt), [(0, 0), (0, new), (0, 0), (0, 0)]))
    carry = _constrain(carry, shardings)
    tok, lp = select_tokens(logits, _step_keys(row_keys, carry.t), static, knobs)
    return _constrain(_record(carry, tok, lp, stops, knobs), shardings)


def _decode(
    graphdef: nnx.GraphDef,
    static: Static,
    opts: DecodeOptions,
    shardings: _Carry | None,
    state: nnx.State,
    carry: _Carry,
    knobs: Knobs,
    stops: jax.Array,
) -> _Carry:
    """One token per loop step until every row stopped or `knobs.max_new` tokens exist."""
    model = nnx.merge(graphdef, state)
    layers = split_layers(model)  # outside the loop: sliced once per call, not per step

    def cond(c: _Carry) -> jax.Array:
        return (c.t < knobs.max_new) & ~jnp.all(c.done)

    def body(c: _Carry) -> _Carry:
        # Token t-1 sits at slot prompt_bucket + t - 1 and position length + t - 1.
        slot = static.prompt_bucket + c.t - 1
        positions = c.lengths + c.t - 1
        with moe.collecting() as routed:
            logits, cache = decode_step(model, layers, c.last, positions, c.attn, c.cache, slot,
                                        opts)
        c = c._replace(cache=cache)
        if routed:  # the fed token's experts, [layers, rows, 1, k], at its column
            ids = moe.storage_ids(model.config, jnp.moveaxis(routed[0].ids, 0, 2))
            c = c._replace(routing=jax.lax.dynamic_update_slice(
                c.routing, ids, (jnp.int32(0), slot, jnp.int32(0), jnp.int32(0))))
        tok, lp = select_tokens(logits, _step_keys(c.keys, c.t), static, knobs)
        return _constrain(_record(c, tok, lp, stops, knobs), shardings)

    return jax.lax.while_loop(cond, body, carry)


# --------------------------------------------------------------------------------------------
# The sampler object
# --------------------------------------------------------------------------------------------


class Sampler:
    """Compiled rollout programs for one model structure on one decode mesh.

    Build it once from a model (only its structure is kept) and call `generate` with the current
    parameters as often as needed: programs are compiled once per (batch, prompt bucket,
    new-token bucket, static sampling config) and every compile is logged.
    """

    def __init__(
        self,
        model: nnx.Module,
        *,
        mesh: Mesh | None = None,
        max_prompt_len: int = DEFAULT_MAX_PROMPT_LEN,
        min_prompt_bucket: int = MIN_PROMPT_BUCKET,
        min_new_tokens_bucket: int = MIN_NEW_TOKENS_BUCKET,
        pad_id: int | None = None,
        rules: str | dict | None = "decode",
        param_rules: str | dict | None = None,
        decode_attention: str = "auto",
        kv_layout: str = "auto",
        decode: DecodeOptions | None = None,
    ):
        # rules=None keeps parameters in whatever layout the caller passes (an actor decoding
        # in its training layout); otherwise they are moved to this layout of `mesh`.
        # `param_rules` names that caller's layout (with rules=None) so the programs trace
        # under it and the model's activation constraints (sharding.constrain) match it.
        if max_prompt_len < 1:
            raise ValueError(f"max_prompt_len={max_prompt_len}; it must be >= 1")
        self.graphdef, state = nnx.split(model)
        self.config = model.config
        self.mesh = mesh
        self.max_prompt_len = int(max_prompt_len)
        self.min_prompt_bucket = int(min_prompt_bucket)
        self.min_new_tokens_bucket = int(min_new_tokens_bucket)
        cfg_pad = self.config.pad_token_id
        self.pad_id = int(pad_id if pad_id is not None else cfg_pad if cfg_pad is not None else 0)
        traced = rules if rules is not None else param_rules
        self._trace_layout = (
            sharding_lib.layout(mesh, traced) if mesh is not None and traced is not None else None
        )
        self._layout = self._trace_layout if rules is not None else None
        self._dp = mesh_lib.dp_size(mesh) if mesh is not None else 1
        # How decode steps read the cache and lay it out (`hfjax.engine.decode.decode_options`:
        # "auto" resolved once, for the platform programs are compiled for); `decode`, options
        # already resolved, overrides both.
        self.decode = decode or decode_options(decode_attention, kv_layout)
        self._shardings = (_carry_shardings(mesh, self.config, self.decode.layout)
                           if mesh is not None else None)
        self._programs: dict[Static, tuple[Any, Any]] = {}
        self.compile_log: list[Static] = []  # one entry per compiled bucket, in order

    # -- parameters --------------------------------------------------------------------------

    def place(self, state: nnx.State) -> nnx.State:
        """Returns `state` in the decode layout of the sampler's mesh (unchanged without a mesh).

        Arrays already in place are not copied.
        """
        if self._layout is None:
            return state
        return jax.device_put(state, self._layout.state_shardings(state))

    # -- requests ----------------------------------------------------------------------------

    def _prepare(
        self, input_ids: Any, attention_mask: Any, seed: int | Sequence[int] | np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        """Validates and pads a prompt batch on the host, before anything is compiled.

        Returns (ids [B', P], mask [B', P], seeds [B'], salts [B'], B) where B' is B padded to
        the data-parallel size and P the prompt bucket.
        """
        ids = np.asarray(input_ids)
        mask = np.asarray(attention_mask)
        if ids.ndim != 2 or ids.shape != mask.shape:
            raise ValueError(
                f"input_ids {ids.shape} and attention_mask {mask.shape} must both be "
                "[batch, prompt_len]"
            )
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"input_ids must be integer token ids, got dtype {ids.dtype}")
        batch = ids.shape[0]
        if batch == 0:
            raise ValueError("empty batch: input_ids has no rows")
        mask = (mask != 0).astype(np.int32)
        lengths = mask.sum(axis=1)
        if (lengths == 0).any():
            raise ValueError(f"prompt rows {np.flatnonzero(lengths == 0).tolist()} are empty")
        # Left padding: once a row's real tokens start they run to the end.
        if (np.diff(mask, axis=1) < 0).any():
            bad = np.flatnonzero((np.diff(mask, axis=1) < 0).any(axis=1)).tolist()
            raise ValueError(
                f"prompt rows {bad} are not left-padded; the sampler needs padding on the left "
                "(attention_mask of the form 0..0 1..1)"
            )
        longest = int(lengths.max())
        if longest > self.max_prompt_len:
            raise ValueError(
                f"a prompt has {longest} tokens, more than max_prompt_len={self.max_prompt_len};"
                " truncate the prompts or build the Sampler with a larger max_prompt_len"
            )
        vocab = self.config.vocab_size
        real = ids[mask.astype(bool)]
        if real.size and (real.min() < 0 or real.max() >= vocab):
            raise ValueError(f"input_ids hold ids outside [0, {vocab}): the model's vocabulary")

        if np.ndim(seed) == 0:
            seeds = np.full((batch,), int(seed), np.int64)
            salts = np.arange(batch, dtype=np.int64)
        else:
            seeds = np.asarray(seed, np.int64).reshape(-1)
            if seeds.shape != (batch,):
                raise ValueError(
                    f"seed array has shape {np.shape(seed)}; give one seed per prompt ({batch},)"
                    " or a single int"
                )
            salts = np.zeros((batch,), np.int64)
        # PRNG seeds are 32-bit: keep the low bits so any Python int works.
        seeds = (seeds & 0xFFFFFFFF).astype(np.uint32)
        salts = salts.astype(np.uint32)

        # Drop all-padding columns, then left-pad to the bucket.
        ids, mask = ids[:, ids.shape[1] - longest :], mask[:, mask.shape[1] - longest :]
        width = prompt_bucket(longest, self.min_prompt_bucket)
        ids = np.where(mask.astype(bool), ids, self.pad_id).astype(np.int32)
        ids = np.pad(ids, ((0, 0), (width - longest, 0)), constant_values=self.pad_id)
        mask = np.pad(mask, ((0, 0), (width - longest, 0)))
        # Rows are split over the data-parallel axes, which must divide them: pad with copies of
        # the first prompt (real tokens, so no fully-masked rows) and drop them afterwards.
        extra = -batch % self._dp
        if extra:
            take = np.zeros((extra,), np.int64)
            ids = np.concatenate([ids, ids[take]])
            mask = np.concatenate([mask, mask[take]])
            seeds = np.concatenate([seeds, seeds[take]])
            salts = np.concatenate([salts, salts[take]])
        return ids, mask, seeds, salts, batch

    def _get_programs(self, static: Static) -> tuple[Any, Any]:
        programs = self._programs.get(static)
        if programs is None:
            logging.info(
                "hfjax.engine: compiling rollout programs for batch=%d (rows=%d) "
                "prompt_bucket=%d new_tokens_bucket=%d greedy=%s top_k=%d top_p=%s min_p=%s "
                "stops=%d mesh=%s",
                static.batch,
                static.batch * static.n,
                static.prompt_bucket,
                static.new_bucket,
                static.greedy,
                static.top_k,
                static.use_top_p,
                static.use_min_p,
                static.num_stops,
                dict(self.mesh.shape) if self.mesh is not None else None,
            )
            args = (self.graphdef, static, self.decode, self._shardings)
            under = functools.partial(sharding_lib.under_layout, self._trace_layout)
            prefill = jax.jit(under(functools.partial(_prefill, *args)))
            decode = jax.jit(under(functools.partial(_decode, *args)), donate_argnums=(1,))
            programs = self._programs[static] = (prefill, decode)
            self.compile_log.append(static)
        return programs

    def static_for(self, batch: int, prompt_bucket: int, params: SamplingParams) -> Static:
        """The compile key of a request: `batch` prompts (already padded to the data-parallel
        size), left-padded to `prompt_bucket` columns, sampled with `params`."""
        return Static(
            batch=batch,
            prompt_bucket=prompt_bucket,
            new_bucket=bucket_size(params.max_new_tokens, self.min_new_tokens_bucket),
            n=params.n,
            **params.selection_key(),
        )

    def padded_batch(self, batch: int) -> int:
        """The prompt rows a request of `batch` prompts runs with (padded to the data-parallel
        size)."""
        return batch + (-batch % self._dp)

    def _knobs(self, params: SamplingParams) -> Knobs:
        return Knobs(
            temperature=np.float32(params.temperature if not params.greedy else 1.0),
            top_p=np.float32(params.top_p),
            min_p=np.float32(params.min_p),
            max_new=np.int32(params.max_new_tokens),
            pad_id=np.int32(self.pad_id),
        )

    def _request_shardings(self):
        return mesh_lib.batch_sharding(self.mesh), mesh_lib.replicated(self.mesh)

    def programs(self, static: Static) -> tuple[Any, Any]:
        """The jitted (prefill, decode) programs of one compile key (built on first use)."""
        return self._get_programs(static)

    def abstract_request(self, static: Static, params: SamplingParams) -> tuple:
        """The prefill's request arguments (ids, mask, seeds, salts, knobs, stops) as
        ShapeDtypeStructs placed as `generate` places them: what a dry run lowers with."""
        ids = np.zeros((static.batch, static.prompt_bucket), np.int32)
        seeds = np.zeros((static.batch,), np.uint32)
        host = (ids, ids, seeds, seeds, self._knobs(params),
                np.asarray(params.eos_ids, np.int32).reshape(-1))
        rows, everywhere = self._request_shardings() if self.mesh is not None else (None, None)
        shardings = (rows,) * 4 + (everywhere,) * 2
        return tuple(
            jax.tree.map(lambda x, sh=sh: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype,
                                                               sharding=sh), arg)
            for arg, sh in zip(host, shardings))

    def generate(
        self,
        state: nnx.State,
        input_ids: Any,
        attention_mask: Any,
        params: SamplingParams,
        seed: int | Sequence[int] | np.ndarray = 0,
        images: VisionPrompts | None = None,
    ) -> GenerateOutput:
        """Samples `params.n` responses for each left-padded prompt with parameters `state`.

        `state` is the params state of `nnx.split(model)` for a model of this sampler's
        structure; it is moved to the decode layout first when the sampler has a mesh. `seed`
        is an int or one seed per prompt. Returns a GenerateOutput with rows b * n + j and
        `params.max_new_tokens` columns. Raises ValueError on bad input before compiling.

        `images` (a vision-language policy, whose language model this sampler runs): the
        prompts' image features, computed once per prompt (`VisionPrompts`).
        """
        ids, mask, seeds, salts, batch = self._prepare(input_ids, attention_mask, seed)
        knobs = self._knobs(params)
        stops = np.asarray(params.eos_ids, np.int32).reshape(-1)
        extra = {}
        if images is not None:
            if not self.config.mrope_section:
                raise ValueError("images for a text-only model; sample a vision-language "
                                 "model's language model (VisionLM.lm)")
            if type(self)._decode is not Sampler._decode:
                raise ValueError("continuous batching of prompts with images is not built; "
                                 "decode them with a Sampler (rollout.continuous=False)")
            extra["images"] = images.place(ids, mask, batch)
        out = self._decode(self.place(state), ids, mask, seeds, salts, knobs, stops, batch,
                           params, **extra)
        rows_out, cols = batch * params.n, params.max_new_tokens
        if out.tokens.shape != (rows_out, cols):
            out = out.head(rows_out, cols)
        return out

    def _decode(self, state: nnx.State, ids: np.ndarray, mask: np.ndarray, seeds: np.ndarray,
                salts: np.ndarray, knobs: Knobs, stops: np.ndarray, batch: int,
                params: SamplingParams, images: ImagePrompts | None = None) -> GenerateOutput:
        """The engine's part of `generate`: the request's prompts (`_prepare`d, `batch` real
        ones), knobs and stop ids decoded with the placed `state`; at least batch * n rows and
        max_new_tokens columns (`generate` cuts the rest). Here: one prefill and one decode
        program for the request's static shapes."""
        static = self.static_for(ids.shape[0], ids.shape[1], params)
        prefill, decode = self._get_programs(static)
        if self.mesh is not None:
            rows, everywhere = self._request_shardings()
            # The request's one deliberate upload (prompts come from the host data pipeline);
            # allowed even where a caller bans host transfers to catch accidental ones.
            with jax.transfer_guard("allow"):
                ids, mask, seeds, salts = jax.device_put((ids, mask, seeds, salts), rows)
                knobs, stops = jax.device_put((knobs, stops), everywhere)
                images = jax.device_put(images, everywhere)
        carry = prefill(state, ids, mask, seeds, salts, knobs, stops, images)
        carry = decode(state, carry, knobs, stops)
        return GenerateOutput(carry.tokens, carry.mask, carry.logprobs, carry.routing)


# --------------------------------------------------------------------------------------------
# One-call entry point
# --------------------------------------------------------------------------------------------


_SAMPLERS: dict[tuple, Sampler] = {}
_MAX_SAMPLERS = 8


def _structure_key(graphdef: nnx.GraphDef) -> Any:
    """A hashable stand-in for a graphdef.

    A ModelConfig holding a dict (llama3 `rope_scaling`) makes the graphdef unhashable; its repr
    names every node and attribute, so equal reprs mean equal structure.
    """
    try:
        hash(graphdef)
        return graphdef
    except TypeError:
        return repr(graphdef)


def _sampler_for(
    model: nnx.Module, mesh: Mesh | None, max_prompt_len: int, pad_id: int | None
) -> tuple[Sampler, nnx.State]:
    """The cached Sampler for this model's structure (and the model's params state)."""
    graphdef, state = nnx.split(model)
    key = (_structure_key(graphdef), mesh, max_prompt_len, pad_id)
    sampler = _SAMPLERS.pop(key, None)
    if sampler is None:
        sampler = Sampler(model, mesh=mesh, max_prompt_len=max_prompt_len, pad_id=pad_id)
    _SAMPLERS[key] = sampler  # most recently used last
    while len(_SAMPLERS) > _MAX_SAMPLERS:
        _SAMPLERS.pop(next(iter(_SAMPLERS)))
    return sampler, state


def generate(
    model: nnx.Module,
    input_ids: Any,
    attention_mask: Any,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    n: int = 1,
    eos_ids: Sequence[int] | int = (),
    seed: int | Sequence[int] | np.ndarray = 0,
    mesh: Mesh | None = None,
    max_prompt_len: int = DEFAULT_MAX_PROMPT_LEN,
    pad_id: int | None = None,
) -> GenerateOutput:
    """Samples responses from `model` for left-padded prompts [B, T].

    A convenience over `Sampler`: samplers (and their compiled programs) are cached per model
    structure, mesh and limits, so repeated calls compile once per bucket. Returns a
    GenerateOutput of [B * n, max_new_tokens] arrays (tokens, mask, logprobs).
    """
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        n=n,
        eos_ids=tuple(eos_ids) if not isinstance(eos_ids, (int, np.integer)) else (eos_ids,),
    )
    sampler, state = _sampler_for(model, mesh, int(max_prompt_len), pad_id)
    return sampler.generate(state, input_ids, attention_mask, params, seed=seed)
