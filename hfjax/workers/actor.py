"""The actor (policy) and reference worker groups.

Sequences in a batch are `prompts` [B, P] (left-padded) followed by `responses` [B, R]
(right-padded); `input_ids` / `attention_mask` are their concatenation. The log-prob of response
token t comes from the logits at position P + t - 1.

R is not always `rollout.response_length`: after generation the responses are cut to the
batch's longest one, rounded up to a power of two (at least 16), so that scoring and training
do not spend their matmuls on columns that are padding in every row. Losses therefore take the
configured length as the fixed horizon of "seq-mean-token-sum-norm".

The log-probs both groups score with, per row layout, are `hfjax.workers.logprobs`.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np

from hfjax.agents import AgentLoop, turn_lists
from hfjax.controller.batch import Batch
from hfjax.controller.protocol import DP_COMPUTE, ON_HOST, method
from hfjax.engine import grouping, packing, shared_prompt
from hfjax.engine.hybrid import HybridEngine
from hfjax.engine.sampler import (
    MIN_NEW_TOKENS_BUCKET,
    GenerateOutput,
    Sampler,
    SamplingParams,
    bucket_size,
)
from hfjax.engine.spec import RolloutSpec
from hfjax.engine.update import (
    in_micro_batches,
    ordered_after,
    scoring_micro_batches,
    share_of_normaliser,
)
from hfjax.models import lora, moe
from hfjax.numerics import core, losses
from hfjax.numerics import rollout_correction as rc_numerics
from hfjax.numerics.losses import PolicyLossInputs
from hfjax.parallel import reshard
from hfjax.parallel.mesh import batch_sharding
from hfjax.parallel.transfer import transfer
from hfjax.workers import responses, routing, vision
from hfjax.workers.base import SEQUENCES, Program, StepShape, WorkerGroup
from hfjax.workers.logprobs import compact_logprobs, packed_logprobs, response_logprobs
from hfjax.workers.spec import ActorSpec
from hfjax.workers.warm_start import WarmStart


class Reference(WorkerGroup):
    """A frozen copy of the policy that scores responses (KL anchor), as the actor scores
    them: from the actor's settings (`spec`, an `ActorSpec`) and the rollout's (`rollout`, a
    `RolloutSpec`), as verl's reference takes the actor's micro-batches and packing.

    Scoring options, read from the specs: `budget` (`actor.use_remove_padding`): score packed
    rows, cut into micro-batches by this token budget (`hfjax.engine.packing`); None: padded
    rows, `micro_rows` at a time (`actor.ppo_micro_batch_size`). `grouped`
    (`actor.group_by_length`): padded micro-batches of `micro_rows` rows of similar lengths,
    each only as wide as its rows need (`hfjax.engine.grouping`). `samples` > 1
    (`actor.share_prompt` with `rollout.n` > 1): the batches' rows come in groups of that many
    sharing a prompt, and padded micro-batches of whole groups are computed as shared-prompt
    rows (`hfjax.engine.shared_prompt.samples_per_row`). `chunk` (`actor.logprob_chunk`):
    scored positions per data-parallel device that the LM head takes at a time in padded and
    compact rows (`hfjax.engine.head_chunks.over_tokens`; 0: whole rows). Log-probs are of
    the logits divided by `rollout.temperature`, the distribution the samples came from.
    """

    def __init__(self, *args, spec: ActorSpec, rollout: RolloutSpec, **kw):
        ActorSpec.require(spec, type(self).__name__, "spec")
        RolloutSpec.require(rollout, type(self).__name__, "rollout")
        super().__init__(*args, **kw)
        self._init_scoring(spec, rollout)

    @property
    def resident_params(self) -> tuple[str, ...]:
        """The resident holdings (dry run) a scoring pass takes as its params argument."""
        return (f"{self.name} params",)

    def _init_scoring(self, spec: ActorSpec, rollout: RolloutSpec) -> None:
        self.spec, self.rollout = spec, rollout
        self.temperature = rollout.temperature
        chunk, samples = spec.logprob_chunk, spec.samples_per_row(rollout.n)
        if chunk < 0:
            raise ValueError(f"{self.name}: logprob_chunk must be >= 0 (0: whole rows), "
                             f"not {chunk}")
        self.chunk = chunk
        self.budget = spec.budget
        self.micro_rows = spec.ppo_micro_batch_size
        self.grouped = spec.group_by_length
        if samples < 1 or (samples > 1 and self.micro_rows % samples):
            raise ValueError(f"{self.name}: shared-prompt rows of {samples} samples need "
                             f"micro-batches of whole groups, not {self.micro_rows} rows")
        self.samples = samples
        if self.vl is not None:
            vision.check_rows(self.name, packed=self.budget is not None, grouped=self.grouped,
                              samples=samples, mesh=self.mesh)
        self._logprob = self.jit(self._logprob_fn, static_argnums=(3, 4, 5))
        self._packed_logprob = self.jit(self._packed_logprob_fn, static_argnums=(3, 4))
        self._compact_logprob = self.jit(
            lambda params, mb: compact_logprobs(self.model(params), mb, self.temperature,
                                                self.samples, self.chunk, self.dp_size))

    def _logprob_fn(self, params, input_ids, attention_mask, response_len, n_micro=1, share=1,
                    replay=None, images=None):
        """Log-probs and entropy [B, R] of padded rows in `n_micro` strided micro-batches (of
        whole groups when `self.samples` > 1), each computed as shared-prompt rows of `share`
        samples (1: one row per sequence); `replay`: the rows' recorded routing, replayed;
        `images`: the rows' image arrays (`hfjax.workers.vision`)."""
        model = self.model(params)

        def score(ids, mask, routed, imgs):  # (an update's pass keeps the routing it was given)
            with (moe.given_routing(routed, replay=True) if routed is not None
                  else contextlib.nullcontext()), self.seeing(model, imgs):
                return response_logprobs(model, ids, mask, response_len, self.temperature,
                                         share, self.chunk, self.dp_size)

        return in_micro_batches(score, n_micro, input_ids, attention_mask, replay, images or {},
                                group=self.samples)

    def _sharing(self, rows: int) -> int:
        """The samples per shared-prompt row of a padded micro-batch of `rows` rows (whole
        groups by construction), 1 (padded rows) where its groups don't split over the
        data-parallel devices."""
        return self.samples if shared_prompt.fits(rows, self.samples, self.dp_size) else 1

    def scoring_micro_batches(self, rows: int) -> int:
        """Micro-batches of this group's padded log-prob pass over `rows` sequences."""
        return scoring_micro_batches(rows, self.micro_rows)

    def _packed_fn(self, params):
        """(packed rows, span) -> (log-probs, entropy) [G, W] under `params`."""
        return lambda rows, span: packed_logprobs(self.model(params), rows, span,
                                                  self.temperature)

    def _packed_logprob_fn(self, params, input_ids, attention_mask, response_len, shape):
        return packing.forward(self._packed_fn(params), input_ids, attention_mask,
                               response_len, shape)

    def _log_probs(self, batch: Batch):
        r = batch["responses"].shape[1]
        ids, mask = batch["input_ids"], batch["attention_mask"]
        if self.grouped:
            # Cuts of whole groups unless padding rows (added for the data-parallel split)
            # leave the batch in no whole number of them.
            group = self.samples if len(ids) % self.samples == 0 else 1
            cuts = grouping.plan(grouping.extents(mask, r), self.micro_rows or len(ids),
                                 ids.shape[1] - r, r, self.dp_size, group)
            return grouping.scored(lambda mb: self._cut_logprobs(mb, group),
                                   dict(batch.select(SEQUENCES).arrays), cuts, r, self.on_mesh)
        if self.budget is None:
            # Padding rows for the data-parallel split come last: the real rows' groups stay
            # whole, and a batch of no whole number of groups is not shared (`fits`).
            n_micro = self.scoring_micro_batches(len(ids))
            replay = (batch.arrays.get("routed_experts")  # r2, r3: `hfjax.workers.routing`
                      if self.spec.router_replay != "none" else None)
            return self._logprob(self.params, ids, mask, r, n_micro,
                                 self._sharing(len(ids) // n_micro), replay,
                                 vision.images_of(batch.arrays))
        shape = self.budget.shape(len(batch), ids.shape[1], self.dp_size, self.name)
        return self._packed_logprob(self.params, ids, mask, r, shape)

    def _cut_logprobs(self, mb, group: int):
        """(log-probs, entropy) of a length-grouped micro-batch (`grouping.Cut`) of whole
        groups of `group` rows (1: rows not in groups): compact shared-prompt rows, shared
        ones, or padded ones."""
        if shared_prompt.is_compact(mb):
            return self._compact_logprob(self.params, mb)
        share = self._sharing(len(mb["input_ids"])) if group > 1 else 1
        return self._logprob(self.params, mb["input_ids"], mb["attention_mask"],
                             mb["responses"].shape[1], 1, share)

    def _train_logprobs(self, params, mb):
        """(log-probs, entropy) [B, R] of a training micro-batch: padded, packed, or compact
        shared-prompt rows."""
        if "packed" in mb:
            return packing.response_values(self._packed_fn(params), mb)
        if shared_prompt.is_compact(mb):
            return compact_logprobs(self.model(params), mb, self.temperature, self.samples,
                                    self.chunk, self.dp_size)
        # `train` cuts micro-batches of whole groups.
        rows = len(mb["input_ids"])
        return self._logprob_fn(params, mb["input_ids"], mb["attention_mask"],
                                mb["responses"].shape[1], 1, self._sharing(rows),
                                images=vision.images_of(mb))

    def log_prob_programs(self, what: str, shape: StepShape) -> list[Program]:
        """The log-prob pass over a step's sequences as `_log_probs` runs it: packed rows, a
        full-width length-grouped micro-batch (the widest cut), or padded rows in strided
        micro-batches, shared-prompt where the micro-batches' groups split over the devices."""
        rows = self.padded_rows(shape.sequences)
        seqs = self.abstract_sequences(rows, shape)
        ids, mask, r = seqs["input_ids"], seqs["attention_mask"], shape.response_len
        named = {"params": self.params}
        name, held = f"{self.name}.{what}", self.resident_params
        if self.grouped:
            micro = min(self.micro_rows or rows, rows)
            cut = self.abstract_sequences(micro, shape)
            group = self.samples if rows % self.samples == 0 else 1
            share = self._sharing(micro) if group > 1 else 1
            return [Program(name, self._logprob, (self.params, cut["input_ids"],
                                                  cut["attention_mask"], r, 1, share),
                            held, named)]
        if self.budget is not None:
            pack = self.budget.shape(rows, shape.width, self.dp_size, self.name)
            return [Program(name, self._packed_logprob, (self.params, ids, mask, r, pack),
                            held, named)]
        n_micro = self.scoring_micro_batches(rows)
        return [Program(name, self._logprob, (self.params, ids, mask, r, n_micro,
                                              self._sharing(rows // n_micro)), held, named)]

    def programs(self, shape: StepShape) -> list[Program]:
        """The reference log-prob pass (`compute_ref_log_prob`)."""
        return self.log_prob_programs("log_prob", shape)

    @method(DP_COMPUTE, reads=SEQUENCES, may_read=vision.IMAGES)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """Batch with `ref_log_prob` [B, R]."""
        lp, _ = self._log_probs(batch)
        return Batch({"ref_log_prob": lp})


class BaseReference(Reference):
    """The reference policy of a LoRA actor: the actor's frozen base, adapters off (verl's
    `ref_in_actor`). It holds no weights of its own: every pass reads the actor's current
    base arrays (`ActorRollout.base_params`) under the base model's graphdef, on the actor's
    mesh and layout, so the run keeps one copy of the base. It scores as the actor does (the
    actor's `spec` and `rollout`, as `Reference`)."""

    def __init__(self, name: str, actor: ActorRollout):
        if actor.trainable is None:
            raise ValueError(f"{name}: a reference that shares the actor's base needs an "
                             "actor with LoRA adapters (actor.lora.rank > 0)")
        # No WorkerGroup.__init__: there is nothing to place.
        self.actor = actor
        self.name, self.pool, self.mesh, self.home = name, actor.pool, actor.mesh, actor.home
        self.layout, self.config, self.vl = actor.layout, actor.config, actor.vl
        self.graphdef = self.base_graphdef = actor.base_graphdef
        self.trainable, self.lora, self.dropout = None, None, None
        self.param_shardings = self.train_shardings = self.layout.state_shardings(
            actor.base_params())
        self._train_calls = 0
        self.set_optimizer(None)
        self._init_scoring(actor.spec, actor.rollout)

    # The dry run's accounting: a pass takes the actor's base as its argument, in place of
    # the actor's resident params (their adapters, a fraction of a percent, go uncounted
    # during the pass).
    resident_params = ("actor params",)

    @property
    def params(self):
        """The actor's base arrays (read at each call: the actor's updates donate its state)."""
        return self.actor.base_params()

    @params.setter
    def params(self, value) -> None:
        raise ValueError(f"{self.name} shares the actor's base weights; set the actor's params")


class ActorRollout(WarmStart, Reference):
    """The policy: generates, scores its own samples, and takes PPO-style updates.

    `rollout_params()` is where the hybrid engine plugs in: it returns the parameters in the
    layout used for decoding. Without the engine that is the training layout itself; with one
    (`hybrid`, a `hfjax.engine.hybrid.HybridEngine` over this group's layout), the params move
    to the decode layout for each generate call and back after it, and the sampler must run on
    the engine's decode mesh.
    """

    # Cut response columns that are padding in every row (`responses.trim`, a host read); an
    # asynchronous run's rollout group leaves that to the trainer's side (hfjax.run.async_loop).
    trim = True
    # Bypass mode's rejection, decided in the policy loss (`rc_numerics.bypass_keep`); None:
    # none there (`hfjax.workers.groups.build_actor` sets it).
    bypass_rejection: rc_numerics.RolloutCorrection | None = None

    def __init__(self, *args, sampler: Sampler, spec: ActorSpec, rollout: RolloutSpec,
                 eos_ids: tuple[int, ...] = (), hybrid: HybridEngine | None = None,
                 agent: AgentLoop | None = None, tower=None, **kw):
        super().__init__(*args, spec=spec, rollout=rollout, **kw)
        # The vision tower: `tower` is a frozen one, held beside the params; a model with its
        # own `visual` trains it (`hfjax.workers.vision.Tower`). None: text only.
        self.tower = vision.Tower.of(self, tower)
        routing.check(spec.router_replay, moe=self.config.is_moe, packed=spec.use_remove_padding,
                      grouped=spec.group_by_length, multi_turn=agent is not None,
                      continuous=rollout.mode == "continuous")
        self.sampler = sampler
        self.eos_ids = tuple(eos_ids)
        self.hybrid = hybrid
        # Multi-turn rollouts with tools (`hfjax.agents`); None: one turn.
        self.agent = agent

    # -- generation -------------------------------------------------------------------------

    def rollout_params(self):
        """Returns the params in the decode layout. With the hybrid engine this consumes
        `self.params` until `release_rollout_params` hands them back.

        With LoRA adapters the sampler decodes the base model with merged weights
        (W + scale * A @ B, `hfjax.models.lora.merged_state`), computed on the training mesh
        into a copy that the hybrid engine then moves to the decode layout: the training
        params (base and adapters) stay where they are, and the copy is dropped after
        generation (docs/algorithms.md, "LoRA", for the choice and the bytes it moves)."""
        if self.trainable is not None:
            merged = self.merged_params()
            return merged if self.hybrid is None else self.hybrid.to_decode(merged)
        if self.hybrid is None:
            return self.params
        return self.hybrid.to_decode(self.params)

    def merge_program(self):
        """The jitted program params -> base params with the adapters merged in, in the
        training layout (LoRA only)."""
        if not hasattr(self, "_merge"):
            shardings = self.layout.state_shardings(self.base_params())
            self._merge = self.jit(
                lambda p: lora.merged_state(self.graphdef, self.base_graphdef, p),
                out_shardings=shardings)
        return self._merge

    def merged_params(self):
        """The base params with the adapters merged in, in the training layout (LoRA only)."""
        return self.merge_program()(self.params)

    def release_rollout_params(self, params) -> None:
        """Restores the training params after generation (a local slice with the engine);
        with LoRA the merged decode copy is dropped (the training params never moved)."""
        if self.trainable is not None:
            return
        if self.hybrid is not None:
            self.params = self.hybrid.to_train(params)

    @method(ON_HOST, reads=("prompts", "prompt_mask", "seeds"), may_read=vision.HOST)
    def generate(self, batch: Batch, *, greedy: bool = False, n: int | None = None,
                 temperature: float | None = None) -> Batch:
        """Samples n responses per prompt of a host batch (prompts, prompt_mask, seeds).

        Returns the batch repeated n times (interleaved: rows b*n .. b*n+n-1 share prompt b)
        with responses, response_mask, input_ids, attention_mask, rollout_log_probs and
        truncated (1 where a response reached `rollout.response_length` without a stop token). The
        sampler needs the prompts on the host (it buckets their lengths), hence ON_HOST; the
        responses never leave the devices.
        """
        params = self.sampling_params(greedy=greedy, n=n, temperature=temperature)
        n = params.n
        # Optionally park the optimizer state in host memory while the KV cache needs room.
        offload = self.rollout.offload_optimizer and self.opt_state is not None
        if offload:
            self.opt_state = reshard.offload(self.opt_state)
        if self.agent is not None:
            if "image_grids" in batch:  # its turns would go without the pictures
                raise ValueError(f"{self.name}: multi-turn rollouts of prompts with images are "
                                 "not built; turn off rollout.multi_turn.enable")
            return self._generate_turns(batch, params)
        # The tower runs once per prompt, before the params move to the decode layout.
        images = vision.prompt_features(self, batch)
        state = self.rollout_params()
        try:
            out = self.sampler.generate(
                state, batch["prompts"], batch["prompt_mask"], params, seed=batch["seeds"],
                images=None if images is None else images[0],
            )
        finally:
            self.release_rollout_params(state)
            if offload:
                self.opt_state = reshard.reload(self.opt_state, self.opt_shardings)
        out = self.respond(batch, responses.trim(out) if self.trim else out, n)
        if images is None:
            return out
        return out.union(Batch(vision.rollout_rows(self, batch, images[1], n,
                                                   out["responses"].shape[1])))

    def sampling_params(self, *, greedy: bool = False, n: int | None = None,
                        temperature: float | None = None) -> SamplingParams:
        """The `rollout` section's sampling settings, as `generate` decodes with them."""
        r = self.rollout
        return SamplingParams(
            max_new_tokens=r.response_length,
            temperature=0.0 if greedy else r.temperature if temperature is None else temperature,
            top_k=r.top_k,
            top_p=r.top_p,
            min_p=r.min_p,
            n=r.n if n is None else n,
            eos_ids=self.eos_ids,
        )

    def respond(self, batch: Batch, out: GenerateOutput, n: int) -> Batch:
        """`generate`'s result from the sampler's output `out` for the host prompts `batch`
        (n samples each): the prompts repeated, joined with the responses."""
        r = self.rollout
        if self.hybrid is not None:
            # The decode mesh orders the same devices differently; programs below mix these
            # rows with the actor mesh's prompts, so the rows move over (device to device).
            rows = batch_sharding(self.mesh)
            out = GenerateOutput(*(None if x is None else transfer(x, rows) for x in out))
        rep = batch.select(["prompts", "prompt_mask"]).repeat(n, interleave=True)
        # The prompts' deliberate upload from the host data pipeline (the sampler's own upload
        # is bucketed and padded, so it can't be reused here).
        with jax.transfer_guard("allow"):
            rep = rep.to(self.mesh)
        prompts, pmask = rep["prompts"], rep["prompt_mask"]
        resp, rmask = out.tokens, out.mask.astype(pmask.dtype)
        arrays = responses.join(prompts, pmask, resp, rmask)
        arrays["rollout_log_probs"] = out.logprobs
        arrays |= routing.recorded(out.routing, prompts.shape[1], resp.shape[1],
                                   self.spec.router_replay)
        # Cut off at the length limit without a stop token (verl's response_length/clip_ratio).
        arrays["truncated"] = responses.truncated(resp, rmask, r.response_length, self.eos_ids)
        return rep.union(Batch(arrays))

    def _generate_turns(self, batch: Batch, params: SamplingParams) -> Batch:
        """`generate` for multi-turn trajectories: responses hold the policy's turns and the
        tool turns between them; `response_mask` is 1 on generated tokens only (what log-probs,
        entropy, KL and the loss see), `attention_mask` 1 on every real token (observations
        are context). Adds `num_turns`, `tool_calls`, `tool_errors` [B] and the trajectories
        in meta (`trajectory`: per-row dicts, for rewards and inspection)."""
        offload = self.rollout.offload_optimizer and self.opt_state is not None
        if offload:
            self.opt_state = reshard.offload(self.opt_state)
        state = self.rollout_params()
        try:
            res = self.agent.run(state, batch["prompts"], batch["prompt_mask"], params,
                                 seed=batch["seeds"])
        finally:
            self.release_rollout_params(state)
            if offload:
                self.opt_state = reshard.reload(self.opt_state, self.opt_shardings)
        longest = int(res.attn_mask.sum(axis=1).max())
        keep = bucket_size(max(longest, 1), MIN_NEW_TOKENS_BUCKET, cap=res.tokens.shape[1])
        rep = batch.select(["prompts", "prompt_mask"]).repeat(params.n, interleave=True)
        pdtype = np.asarray(batch["prompt_mask"]).dtype
        host = {"responses": res.tokens[:, :keep], "attn": res.attn_mask[:, :keep].astype(pdtype),
                "response_mask": res.gen_mask[:, :keep].astype(pdtype),
                "rollout_log_probs": res.logprobs[:, :keep],
                **turn_lists(res.trajectories)}
        # The rollout's one deliberate upload: the trajectories were assembled on the host
        # (their tool turns came from there).
        with jax.transfer_guard("allow"):
            rep = rep.to(self.mesh)
            up = Batch(host).to(self.mesh)
        arrays = responses.join(rep["prompts"], rep["prompt_mask"], up["responses"], up["attn"])
        arrays["response_mask"] = up["response_mask"]
        for k in ("rollout_log_probs", "num_turns", "tool_calls", "tool_errors"):
            arrays[k] = up[k]
        meta = {"trajectory": [t.to_dict() for t in res.trajectories]}
        return rep.union(Batch(arrays, meta=meta))

    @method(DP_COMPUTE, reads=SEQUENCES, may_read=("routed_experts", *vision.IMAGES))
    def compute_log_prob(self, batch: Batch) -> Batch:
        """Batch with `old_log_probs` and `entropys` [B, R] under the current policy (with
        `actor.router_replay` r2 or r3, routed as the sampler routed)."""
        lp, ent = self._log_probs(batch)
        return Batch({"old_log_probs": lp, "entropys": ent})

    # -- updates ----------------------------------------------------------------------------

    def _policy_loss(self, params, mb, totals):
        a = self.spec
        recorded = mb.get("routed_experts")
        with moe.collecting() as routed, moe.given_routing(recorded, a.router_replay == "r3"):
            lp, ent = self._train_logprobs(params, mb)
        mask = ordered_after(mb["response_mask"], lp)
        weight = share_of_normaliser(mask, totals, a.loss_agg_mode)
        horizon = float(self.rollout.response_length)  # batches may be trimmed (module docstring)
        # A batch without old log-probs is updated on-policy (see `single_update`): the policy
        # that sampled it is the one being updated, so the ratio's denominator is the detached
        # current log-prob and no separate scoring pass is needed.
        old = mb.get("old_log_probs")
        old = jax.lax.stop_gradient(lp) if old is None else old
        pg_mask, pg_weight, rejected = mask, weight, {}
        if self.bypass_rejection is not None:
            # Bypass mode: old is pi_rollout, and the ratio to reject on, pi_theta / pi_rollout,
            # moves with the update, so it is decided here, micro-batch by micro-batch; the
            # rejected tokens weigh nothing, and the normaliser stays the batch's.
            pg_mask = rc_numerics.bypass_keep(jax.lax.stop_gradient(lp), old, mask,
                                              self.bypass_rejection)
            pg_weight = share_of_normaliser(pg_mask, totals, a.loss_agg_mode)
            rejected = {"rollout_corr/rollout_rs_masked_fraction":
                        core.masked_sum(mask - pg_mask, mask) / totals["tokens"]}
        pg_loss, clipfrac, ppo_kl, clipfrac_lower = core.POLICY_LOSSES.get(a.policy_loss)(
            PolicyLossInputs(
                old_log_prob=old,
                log_prob=lp,
                advantages=mb["advantages"],
                response_mask=pg_mask,
                cliprange=a.clip_ratio,
                cliprange_low=a.clip_ratio_low,
                cliprange_high=a.clip_ratio_high,
                clip_ratio_c=a.clip_ratio_c,
                loss_agg_mode=a.loss_agg_mode,
                loss_scale_factor=horizon,
                rollout_is_weights=mb.get("rollout_is_weights"),
            )
        )
        entropy = core.agg_loss(ent, mask, a.loss_agg_mode, horizon)
        # Without an entropy bonus the entropy is a metric only: keep it out of the backward pass
        # (a zero coefficient would still differentiate it).
        if a.entropy_coeff:
            loss = pg_loss * pg_weight - a.entropy_coeff * entropy * weight
        else:
            loss, entropy = pg_loss * pg_weight, jax.lax.stop_gradient(entropy)
        metrics = {
            "actor/pg_loss": pg_loss * pg_weight,
            "actor/entropy": entropy * weight,
            "actor/pg_clipfrac": clipfrac * pg_weight,
            "actor/ppo_kl": ppo_kl * pg_weight,
            "actor/pg_clipfrac_lower": clipfrac_lower * pg_weight,
            # The mini-batch's mean token entropy, whatever the aggregation mode: how close the
            # policy is to uniform (hfjax.run.health).
            "actor/token_entropy": core.masked_sum(jax.lax.stop_gradient(ent), mask)
            / totals["tokens"],
        }
        if a.use_kl_loss:
            kld = losses.kl_penalty(lp, mb["ref_log_prob"], a.kl_loss_type)
            kl_loss = core.agg_loss(kld, mask, a.loss_agg_mode, horizon)
            loss = loss + a.kl_loss_coef * kl_loss * weight
            metrics["actor/kl_loss"] = kl_loss * weight
        if routed:
            share = self._sharing(len(mb["input_ids"])) if "packed" not in mb else 1
            loss = loss + routing.update_terms(moe.merge(routed), a, mb, share, weight, totals,
                                               metrics) * weight
        return loss, metrics | rejected

    def single_update(self, rows: int) -> bool:
        """True when `update_actor` on `rows` sequences is one optimizer step (one epoch of one
        mini-batch). The samples then come from the very policy being updated, and the step
        may leave out `old_log_probs` (the old-policy scoring pass)."""
        a = self.spec
        return a.ppo_epochs == 1 and a.ppo_mini_batch_size * self.rollout.n == rows

    @method(DP_COMPUTE, reads=("response_mask", "advantages", *SEQUENCES),
            may_read=("old_log_probs", "ref_log_prob", "rollout_is_weights", "rollout_rs_mask",
                      "routed_experts", *vision.IMAGES))
    def update_actor(self, batch: Batch) -> dict[str, jax.Array]:
        """PPO epochs over shuffled mini-batches; returns mean metrics (device scalars).

        A rollout correction's rejected tokens (`rollout_rs_mask` 0) leave the loss mask, and
        its importance weights (`rollout_is_weights`) weigh every token's policy loss."""
        a = self.spec
        if "rollout_rs_mask" in batch:
            keep = responses.keep_tokens(batch["response_mask"], batch["rollout_rs_mask"])
            batch = batch.select([k for k in batch.arrays if k != "response_mask"]).union(
                Batch({"response_mask": keep}))
        keys = ["input_ids", "attention_mask", "responses", "response_mask", "advantages"]
        keys += [k for k in ("rollout_is_weights", "old_log_probs", "routed_experts",
                             *vision.IMAGES) if k in batch]
        if a.use_kl_loss:
            keys.append("ref_log_prob")
        mini = a.ppo_mini_batch_size * self.rollout.n
        m = self.train(self._policy_loss, batch, keys, mini=mini, micro=a.ppo_micro_batch_size,
                       epochs=a.ppo_epochs, shuffle=a.shuffle, budget=self.budget,
                       grouped=self.grouped, group=self.samples)
        m["actor/grad_norm"] = m.pop("grad_norm")
        m["actor/nonfinite_updates"] = m.pop("nonfinite")
        m["actor/nonfinite_params"] = m.pop("nonfinite_params")
        m.pop("loss")
        return m

    def programs(self, shape: StepShape) -> list[Program]:
        """The actor's programs of an RL step besides generation: the old-policy log-prob pass
        (when `shape.old_log_probs`) and the update (`update_actor`) on a mini-batch in the
        layout the config selects. The sampler's and the hybrid engine's programs are the
        rollout's (`hfjax.run.dry_run`)."""
        a = self.spec
        out = self.log_prob_programs("log_prob", shape) if shape.old_log_probs else []
        mini = a.ppo_mini_batch_size * self.rollout.n
        mb = self.abstract_sequences(mini, shape)
        floats = ["advantages"]
        if shape.old_log_probs:
            floats.append("old_log_probs")
        if a.use_kl_loss:
            floats.append("ref_log_prob")
        mb |= {k: self.abstract_rows(mini, shape.response_len, "float32") for k in floats}
        return out + self.update_programs("update", self._policy_loss, mb,
                                          a.ppo_micro_batch_size, budget=self.budget,
                                          grouped=self.grouped, group=self.samples)
