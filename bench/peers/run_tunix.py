"""The GRPO workload on Tunix's GRPOLearner (JAX, 1 CPU device), timed per global step.

    bench/peers/.venvs/tunix/bin/python bench/peers/run_tunix.py tiny

Set-up notes (each one changes what Tunix does, not how fast it is allowed to be):

- the mesh's axes are `AxisType.Auto`: jax 0.10's default explicit axes break the Qwen2
  embedding lookup;
- sampling needs `top_p=1.0`: `top_p=None` selects greedy decoding;
- batch sizes count prompts; `rollout_micro_batch_size` is set to the whole batch so that the
  64 sequences are generated in one call rather than in chunks;
- fixed lengths: the stop token is an id outside the vocabulary, so every completion has
  exactly 64 tokens (Tunix has no min_new_tokens); natural lengths: the tokenizer's EOS;
- Tunix derives its masks from `ids != pad_id` (the sampler's attention and the training
  batch's prompt and completion masks), so the pad token must not occur in a prompt.
  SmolLM2's pad is its `<|im_end|>`, which every chat prompt holds (end of the system and user
  turns); natural-length workloads therefore pad with `<|endoftext|>` (its unk token) instead;
- actor and rollout share one mesh, hence one model: no weight copy between them;
- num_iterations=1 and beta=0: no old-policy or reference log-prob passes;
- llama3 models (SmolLM2) get the checkpoint's RoPE base: Tunix 0.1.7's llama3 attention
  ignores `ModelConfig.rope_theta` and rotates with 1,000,000 (`build_model`). Results written
  before this fix (2026-12-01 and 12-03 in docs/benchmarks.md) ran SmolLM2 with that base.

Tunix cuts each completion before its stop token (it neither returns nor trains on it); the
recorded response lengths and token counts add the stop token back where a completion stopped
before the cap, so that they count what TRL and hfjax count: every sampled token. Prompt
tokens are counted without Tunix's left padding (prompts of natural lengths differ).

The reward reads the sampled token ids (kept from the rollout output) rather than re-encoding
the decoded text, so it scores exactly the tokens that were generated.

Step time is the wall time between consecutive global-step ends; "gen" is `RLCluster.generate`
and "train" is `RLCluster.update_actor`.
"""

from __future__ import annotations

import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload  # noqa: E402


def build_model(w: workload.Workload, mesh):
    """The workload's HF checkpoint as a Tunix model (qwen2 or llama3 family)."""
    import jax.numpy as jnp

    hf = w.model_config()
    common = dict(
        num_layers=hf["num_hidden_layers"],
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"],
        rope_theta=int((hf.get("rope_parameters") or hf)["rope_theta"]),
        norm_eps=hf["rms_norm_eps"],
    )
    if hf["model_type"] == "qwen2":
        from tunix.models.qwen2 import model as qwen2_model
        from tunix.models.qwen2 import params as qwen2_params

        # bf16: Tunix's Qwen2 layers cast activations and weights to `dtype` before each
        # matmul, over `param_dtype` (float32) parameters.
        cfg = qwen2_model.ModelConfig(
            **common, use_tied_embedding=hf["tie_word_embeddings"],
            dtype=jnp.bfloat16 if w.precision == "bf16" else jnp.float32,
            param_dtype=jnp.float32)
        return qwen2_params.create_model_from_safe_tensors(w.model_dir, cfg, mesh,
                                                           dtype=jnp.float32)
    if hf["model_type"] == "llama":
        if w.precision != "f32":
            raise SystemExit("Tunix 0.1.7's llama3 model has no compute dtype of its own (its "
                             "weights' dtype is the compute dtype): no bf16 compute over f32 "
                             "weights for this workload")
        from tunix.models.llama3 import model as llama_model
        from tunix.models.llama3 import params as llama_params

        # Tunix 0.1.7's llama3 attention calls its module's `apply_rope` without the config's
        # rope_theta, so every llama3 model gets that function's default base (1,000,000)
        # whatever the checkpoint says (SmolLM2's is 100,000): a different model, which on
        # natural lengths samples other (shorter) responses. The model's own base, bound here.
        theta = common["rope_theta"]
        rope = getattr(llama_model.apply_rope, "func", llama_model.apply_rope)
        llama_model.apply_rope = functools.partial(rope, rope_theta=theta)
        cfg = llama_model.ModelConfig(**common, weight_tying=hf["tie_word_embeddings"])
        return llama_params.create_model_from_safe_tensors(w.model_dir, cfg, mesh,
                                                           dtype=jnp.float32)
    raise ValueError(f"no Tunix model for model_type {hf['model_type']!r}")


def main() -> None:
    w = workload.get(sys.argv[1])
    import jax
    import numpy as np
    import optax
    import transformers
    from jax.sharding import AxisType
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    if jax.device_count() != 1:
        raise SystemExit(f"the workload runs on 1 CPU device; found {jax.device_count()}")
    texts, expected_ids = w.load_prompts()
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(w.model_dir)
    if w.natural:
        tok.pad_token = tok.unk_token  # never in a prompt (module docstring)
    elif tok.pad_token is None:
        tok.pad_token = tok.eos_token
    for t, ids in zip(texts, expected_ids):
        if tok.encode(t) != ids:
            raise AssertionError("Tunix's tokenizer encodes a prompt differently from prompts.json")
        if tok.pad_token_id in ids:
            raise AssertionError(f"the pad token {tok.pad_token!r} occurs in a prompt")
    stop = tok.eos_token_id if w.natural else w.model_config()["vocab_size"]

    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(AxisType.Auto, AxisType.Auto))
    model = build_model(w, mesh)

    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=w.new_tokens,
        max_prompt_length=w.prompt_len,
        kv_cache_size=w.prompt_len + w.new_tokens,
        temperature=w.temperature,
        top_p=1.0,
        top_k=None,
        eos_tokens=[stop],
        seed=w.seed,
    )
    training = rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=optax.adam(w.lr, b1=0.9, b2=0.999, eps=1e-8),
        eval_every_n_steps=10**6,
        max_steps=w.steps,
        mini_batch_size=w.prompts,
        train_micro_batch_size=w.micro_batch // w.samples,
        rollout_micro_batch_size=w.prompts,
        compute_logps_micro_batch_size=w.prompts,
    )
    roles = rl_cluster_lib.Role
    cluster = rl_cluster_lib.RLCluster(
        actor=model,
        reference=None,
        tokenizer=tok,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh},
            rollout_engine="vanilla",
            offload_to_cpu=False,
            training_config=training,
            rollout_config=rollout,
        ),
    )

    gen, train, ends, cpu_ends, tokens, lengths = [], [], [], [], [], []
    sampled: list[np.ndarray] = []

    def timed_generate(*args, _inner=cluster.generate, **kw):
        t0 = time.perf_counter()
        out = _inner(*args, **kw)
        gen.append(time.perf_counter() - t0)
        sampled[:] = [np.asarray(t) for t in out.tokens]
        prompts = np.asarray(out.left_padded_prompt_tokens)
        want = [ids for ids in expected_ids for _ in range(w.samples)]
        if prompts.shape != (len(want), w.prompt_len) or any(
            row[len(row) - len(ids):].tolist() != ids
            or (row[:len(row) - len(ids)] != tok.pad_token_id).any()
            for row, ids in zip(prompts, want)
        ):
            raise AssertionError("Tunix's rollout saw prompt ids other than prompts.json")
        # The stop token, cut by Tunix, counted back where a completion stopped early.
        n = [len(t) + (len(t) < w.new_tokens) for t in sampled]
        tokens.append(sum(map(len, want)) + sum(n))
        lengths.extend(n)
        return out

    pending = [0.0]  # this step's training time: one update_actor call per micro-batch

    def timed_update(*args, _inner=cluster.update_actor, **kw):
        t0 = time.perf_counter()
        _inner(*args, **kw)
        jax.block_until_ready(nnx_params(cluster))
        pending[0] += time.perf_counter() - t0

    cluster.generate = timed_generate
    cluster.update_actor = timed_update

    def even_fraction(prompts, completions, **kw):
        if len(completions) != len(sampled):
            raise AssertionError("reward called on a batch other than the last rollout")
        return [float(np.mean(t % 2 == 0)) if len(t) else 0.0 for t in sampled]

    class Learner(grpo_learner.GRPOLearner):
        def _run_global_step(self, *args, **kw):
            super()._run_global_step(*args, **kw)
            jax.block_until_ready(nnx_params(cluster))
            ends.append(time.perf_counter())
            cpu_ends.append(time.process_time())
            train.append(pending[0])
            pending[0] = 0.0

    learner = Learner(
        rl_cluster=cluster,
        algo_config=grpo_learner.GRPOConfig(
            num_generations=w.samples, num_iterations=1, beta=0.0, epsilon=w.clip
        ),
        reward_fns=[even_fraction],
    )
    # One batch per step; an array, since Tunix tree-maps np.repeat over each batch.
    data = [{"prompts": np.asarray(texts)} for _ in range(w.steps)]
    ends.append(time.perf_counter())
    cpu_ends.append(time.process_time())
    learner.train(data)
    steps = [b - a for a, b in zip(ends, ends[1:])]
    cpu = [b - a for a, b in zip(cpu_ends, cpu_ends[1:])]
    if len(steps) != w.steps:
        raise AssertionError(f"Tunix ran {len(steps)} steps, expected {w.steps}")
    import importlib.metadata as md

    record = workload.summarize(
        "tunix", w, steps, cpu, {"gen": gen, "train": train}, tokens,
        int(cluster.actor_trainer.train_steps), lengths,
        {"versions": {"google-tunix": md.version("google-tunix"), "jax": jax.__version__,
                      "flax": md.version("flax")}},
    )
    workload.write_result(w, "tunix", record)


def nnx_params(cluster):
    from flax import nnx

    return nnx.state(cluster.actor_trainer.model, nnx.Param)


if __name__ == "__main__":
    main()
