"""What a rollout request asks for and how each next token is picked from the logits.

- `SamplingParams`: one batch's sampling settings, validated on construction; `GenerateOutput`:
  the sampled tokens, their mask and log-probs; `truncated`: which responses were cut off.
- `select_tokens`: greedy, temperature, top-k, top-p and min-p selection with per-row PRNG keys,
  a pure function of arrays used inside the decode loop.

Conventions:

- **Log-probs.** `logprobs[r, t]` is the log-probability of the sampled token under the
  distribution it was actually drawn from: logits / temperature, restricted to the top-k /
  top-p / min-p set, renormalised. Greedy decoding (temperature 0) has no sampling distribution,
  so it reports the log-prob under the untruncated temperature-1 softmax, which is what a
  teacher-forced pass of the policy computes.
- **Truncation order.** temperature, then top-k, then top-p on the renormalised top-k
  distribution, then min-p (a threshold relative to the most likely token, so its place in the
  order does not matter).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hfjax.models import backend
from hfjax.parallel import sharding as shd

# --------------------------------------------------------------------------------------------
# Requests and results
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one batch. Validated on construction (ValueError naming the field).

    temperature 0 means greedy. top_k 0, top_p 1 and min_p 0 each disable their truncation.
    `eos_ids` are the stop tokens (EOS and any others); empty means "always run to
    max_new_tokens".
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    n: int = 1
    eos_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        m = self.max_new_tokens
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m <= 0:
            raise ValueError(f"max_new_tokens={m!r}; it must be a positive int")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"temperature={self.temperature!r}; use 0 for greedy or a positive float"
            )
        if not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}; use 0 (disabled) or a positive int")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} is outside (0, 1]; use 1.0 to disable it")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p={self.min_p!r} is outside [0, 1); use 0.0 to disable it")
        if not isinstance(self.n, (int, np.integer)) or self.n < 1:
            raise ValueError(f"n={self.n!r}; the number of samples per prompt must be >= 1")
        eos = (self.eos_ids,) if isinstance(self.eos_ids, (int, np.integer)) else self.eos_ids
        object.__setattr__(self, "eos_ids", tuple(int(i) for i in eos))
        object.__setattr__(self, "max_new_tokens", int(m))
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "n", int(self.n))

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax (temperature 0)."""
        return self.temperature == 0.0

    def selection_key(self) -> dict:
        """The fields of a compile key that `select_tokens`' program depends on."""
        return dict(greedy=self.greedy, top_k=self.top_k, use_top_p=self.top_p < 1.0,
                    use_min_p=self.min_p > 0.0, num_stops=len(self.eos_ids))


class GenerateOutput(NamedTuple):
    """Responses of a batch; row b * n + j is sample j of prompt b.

    tokens: int32 [rows, max_new_tokens], `pad_id` after a stop token.
    mask: int32 [rows, max_new_tokens], 1 on real response tokens (stop token included).
    logprobs: float32 [rows, max_new_tokens], log-prob of each token under the sampling
      distribution (see the module docstring), 0 where mask is 0.
    routing: a mixture of experts' expert ids (None: a dense model, or a path that does not
      record them), small ints [rows, prompt columns + max_new_tokens, sparse layers, k]:
      column c holds the experts that routed the token at column c of the left-padded
      prompt followed by the response (a response's last token is never fed: zeros).
    """

    tokens: jax.Array
    mask: jax.Array
    logprobs: jax.Array
    routing: jax.Array | None = None

    def head(self, rows: int, cols: int) -> GenerateOutput:
        """The first `rows` rows and `cols` response columns of every array, sliced on
        device."""
        # A static slice with explicit strides: `x[:rows, :cols]`, and even `lax.slice`
        # without strides, run eagerly as a dynamic_slice that uploads its start indices.
        def cut(x, width):
            return jax.lax.slice(x, (0,) * x.ndim, (rows, width, *x.shape[2:]), (1,) * x.ndim)

        r = self.routing
        prompt = 0 if r is None else r.shape[1] - self.tokens.shape[1]
        return GenerateOutput(cut(self.tokens, cols), cut(self.mask, cols),
                              cut(self.logprobs, cols),
                              None if r is None else cut(r, prompt + cols))


def truncated(tokens: jax.Array, mask: jax.Array, max_new_tokens: int,
              eos_ids: tuple[int, ...]) -> jax.Array:
    """int32 [rows]: 1 where a response was cut off (it used all `max_new_tokens` tokens and
    its last one is no stop token), 0 where it stopped by itself. `tokens` and `mask` are
    `GenerateOutput`'s, possibly cut to fewer columns (then nothing reached the limit)."""
    length = jnp.sum(mask > 0, axis=1)
    last = jnp.take_along_axis(tokens, jnp.maximum(length - 1, 0)[:, None], axis=1)[:, 0]
    stopped = jnp.isin(last, jnp.asarray(eos_ids, jnp.int32)) if eos_ids else False
    return ((length >= max_new_tokens) & ~stopped).astype(jnp.int32)


# --------------------------------------------------------------------------------------------
# Token selection (pure functions of arrays)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything that changes a rollout program's shape or structure: its compile-cache key."""

    batch: int  # prompts after padding to the data-parallel size
    prompt_bucket: int
    new_bucket: int
    n: int
    greedy: bool
    top_k: int
    use_top_p: bool
    use_min_p: bool
    num_stops: int


class Knobs(NamedTuple):
    """Traced sampling scalars: changing them never recompiles."""

    temperature: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    max_new: jax.Array
    pad_id: jax.Array


def last_with_mass(probs: jax.Array) -> jax.Array:
    """Per row of probs [R, V], the last index whose probability is above 0 (int32 [R])."""
    return probs.shape[-1] - 1 - jnp.argmax(probs[:, ::-1] > 0, axis=-1).astype(jnp.int32)


def inverse_cdf(probs: jax.Array, u: jax.Array) -> jax.Array:
    """Index drawn from each row of `probs` [R, V] with one uniform u [R] per row.

    One uniform per row (rather than V Gumbel draws) keeps per-step RNG cost independent of the
    vocabulary. Returns int32 [R]; never an index with zero probability.
    """
    cdf = jnp.cumsum(probs, axis=-1)
    target = u * cdf[:, -1]
    choice = jnp.sum(cdf <= target[:, None], axis=-1, dtype=jnp.int32)
    # u * total can round up to total itself; the last index with mass is then the right answer.
    return jnp.minimum(choice, last_with_mass(probs))


CDF_BLOCK = 1024


def blocked_inverse_cdf(probs: jax.Array, u: jax.Array, block: int = CDF_BLOCK) -> jax.Array:
    """`inverse_cdf` in two levels: the row's mass per block of `block` tokens, the block that
    holds the draw, then the token inside that block. The same draw up to the rounding of the
    partial sums, in about a third of the passes over [R, V] that a vocabulary-wide cumulative
    sum takes on GPUs (0.37 ms of an 8.4 ms decode step at 512 rows x 151,936 tokens on an
    H200). Returns int32 [R]; never an index with zero probability."""
    R, V = probs.shape
    nb = -(-V // block)
    blocks = jnp.pad(probs, ((0, 0), (0, nb * block - V))).reshape(R, nb, block)
    per_block = jnp.sum(blocks, axis=-1)  # [R, nb]
    mass = jnp.cumsum(per_block, axis=-1)
    target = u * mass[:, -1]
    # The block holding the draw; rounding can put `target` at the total, past the last block
    # with mass, which then holds it.
    j = jnp.sum(mass <= target[:, None], axis=-1, dtype=jnp.int32)
    j = jnp.minimum(j, last_with_mass(per_block))
    inside = jnp.take_along_axis(blocks, j[:, None, None], axis=1)[:, 0]  # [R, block]
    before = jnp.where(j > 0, jnp.take_along_axis(mass, jnp.maximum(j - 1, 0)[:, None],
                                                  axis=-1)[:, 0], 0.0)
    cdf = before[:, None] + jnp.cumsum(inside, axis=-1)
    k = jnp.sum(cdf <= target[:, None], axis=-1, dtype=jnp.int32)
    return j * block + jnp.minimum(k, last_with_mass(inside))


def top_p_threshold(probs: jax.Array, top_p: jax.Array) -> jax.Array:
    """Per-row probability threshold of nucleus (top-p) sampling; returns float32 [R].

    A token is kept when the mass of the tokens strictly more likely than it is < top_p: the
    smallest most-likely prefix whose mass reaches top_p (tokens tied at the boundary are all
    kept). Instead of sorting the vocabulary (~130 ms for 16 x 49k on CPU) this bisects over the
    float32 bit patterns of the threshold (positive floats order like their bits), 31 masked
    sums: exact, and ~25x cheaper.
    """
    bits = jax.lax.bitcast_convert_type(probs, jnp.int32)
    rows = probs.shape[0]
    # Invariant: mass above `lo` is >= top_p, mass above `hi` is < top_p (nothing is above 1.0).
    lo = jnp.zeros((rows,), jnp.int32)
    hi = jnp.full((rows,), jax.lax.bitcast_convert_type(jnp.float32(1.0), jnp.int32) + 1)

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        above = jnp.sum(jnp.where(bits > mid[:, None], probs, 0.0), axis=-1)
        ok = above < top_p
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    _, hi = jax.lax.fori_loop(0, 31, halve, (lo, hi))
    return jax.lax.bitcast_convert_type(hi, jnp.float32)


def select_tokens(
    logits: jax.Array, keys: jax.Array, static: Static, knobs: Knobs
) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row from float32 logits [R, V] with per-row PRNG keys [R].

    Returns (tokens int32 [R], log-probs float32 [R]) under the distribution actually used.
    """
    # Whole rows: selection then runs locally, with no collectives over a vocab split.
    logits = shd.constrain(logits, ("batch", None))
    if static.greedy:
        # argmax as two plain reductions (the first index holding the row's maximum) and the
        # chosen token's log-prob as -log(sum(exp(logits - max))). XLA:CPU runs jnp.argmax as
        # one variadic (value, index) reduction at a fraction of the speed of these.
        top = jnp.max(logits, axis=-1, keepdims=True)
        vocab = jnp.arange(logits.shape[-1], dtype=jnp.int32)
        # (NaN logits match nothing; the clamp keeps the id in range.)
        tok = jnp.min(jnp.where(logits == top, vocab, logits.shape[-1] - 1), axis=-1)
        lp = -jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1))
        return tok, lp
    vals = logits / knobs.temperature
    idx = None
    if static.top_k:
        # Candidates first: everything after works on [R, k] instead of the full vocabulary.
        vals, idx = jax.lax.top_k(vals, min(static.top_k, vals.shape[-1]))
    if static.use_top_p or static.use_min_p:
        probs = jax.nn.softmax(vals, axis=-1)
        keep = jnp.ones(vals.shape, bool)
        if static.use_top_p:
            keep &= probs >= top_p_threshold(probs, knobs.top_p)[:, None]
        if static.use_min_p:
            keep &= probs >= knobs.min_p * jnp.max(probs, axis=-1, keepdims=True)
        vals = jnp.where(keep, vals, -jnp.inf)
    logp = jax.nn.log_softmax(vals, axis=-1)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    draw = blocked_inverse_cdf if backend.blocked_token_draw() else inverse_cdf
    choice = draw(jnp.exp(logp), u)
    lp = jnp.take_along_axis(logp, choice[:, None], axis=-1)[:, 0]
    tok = choice if idx is None else jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0]
    return tok.astype(jnp.int32), lp
