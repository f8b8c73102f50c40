"""The default job: PPO with a GAE critic on the embedded 2-digit arithmetic task.

A tiny Llama-style model is trained from scratch: a short SFT warm start on deliberately
imperfect data (70% of the demonstrations give the bare answer without the `####` marker the
reward looks for: `sft.corruption=format`), then PPO with an exact-answer reward. Every key
can be overridden from the command line, e.g.
    python -m launch.train --config.placement=split --config.actor.mesh=fsdp=2,tensor=2
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
    c = config_dict.ConfigDict()
    c.algorithm = "ppo"
    c.seed = 0
    # colocate | split | standalone, or a mapping {pool: {size, roles}} (on the command line
    # "pool=size:role+role;..."). Typed `object` so a derived config may assign either form.
    c.placement = config_dict.FieldReference("colocate", field_type=object)

    c.model = config_dict.ConfigDict(
        dict(
            # A path to an HF directory or a .gguf file, or preset:NAME (an architecture from
            # hfjax/models/presets.py with random weights); empty: a tiny model from scratch
            # with the sizes below.
            path="",
            # Tokenizer (HF directory or .gguf); empty: model.path's own, or the embedded
            # task's for a preset or a model from scratch.
            tokenizer="",
            # At most this many of model.path's decoder layers, its first ones (0: all): a
            # shallower copy of a checkpoint, to try a pipeline on a small machine.
            max_layers=0,
            vocab_size=0,  # 0: the task tokenizer's size
            hidden_size=128,
            intermediate_size=384,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            # A vision tower from scratch (a Qwen2.5-VL-shaped policy, docs/vision.md); 0: none.
            vision_depth=0,
            vision_hidden_size=32,
            vision_num_heads=2,
            # Compute dtype: float32 | bfloat16 | auto (bfloat16 on GPUs and TPUs and, for
            # hidden sizes >= 512, on CPUs with AMX or AVX-512 BF16; else float32: see
            # hfjax.models.backend.compute_dtype). Matmuls take
            # operands in it and accumulate in float32; logits, log-probs and values are float32.
            dtype="auto",
            # Master weights, gradients and optimizer state.
            param_dtype="float32",
            scan_layers=True,
            # none | full (checkpoint every layer) | dots | dots_no_batch | auto (the dry run
            # picks none or full from the device memory; none on CPU: docs/scaling.md,
            # hfjax.models.backend.remat_policy)
            remat_policy="none",
            # Attention: auto | dense | xla | cudnn | blockwise | splash; auto picks per
            # platform (dense on CPU, blockwise on GPU, splash on TPU; cudnn is opt-in;
            # hfjax.models.backend.attention_impl).
            attention_impl="auto",
            # A mixture of experts from scratch (hfjax/models/moe.py): num_experts > 0 makes
            # every layer's MLP num_experts gated MLPs of moe_intermediate_size (0:
            # intermediate_size) of which each token takes num_experts_per_tok. moe_impl
            # (also for model.path): auto | ragged (dropless grouped matmul) | capacity
            # (per-expert buffers of capacity_factor x the mean load; overflow dropped).
            num_experts=0,
            num_experts_per_tok=2,
            moe_intermediate_size=0,
            moe_impl="auto",
            capacity_factor=1.25,
        )
    )
    c.data = config_dict.ConfigDict(
        dict(
            task="arith",  # arith (built in) | parquet (verl schema, see docs/data.md)
            train_files="",  # parquet: comma-separated paths
            val_files="",
            n_train=20000,
            n_test=512,  # of the 562 held-out problems with max_b=9 (hfjax.data.holdout)
            train_batch_size=128,  # prompts per step
            max_b=9,  # second operand 1..max_b
            # arith_chain: a+b= answered with a + chain_steps * b, worked one 13-token line
            # per step (hfjax.data.arith.chain; configs/grpo_long_arith.py)
            chain_steps=79,
            max_prompt_length=8,
            # A vision-language run's control: every picture replaced by a white one.
            blank_images=False,
            # A test problem that also occurs in training is refused (hfjax.data.holdout);
            # True lets it through, with a warning in the log.
            allow_overlap=False,
        )
    )
    c.sft = config_dict.ConfigDict(
        dict(
            steps=1000,
            batch_size=128,
            micro_batch_size=128,
            lr=3e-3,
            lr_schedule="constant",  # constant | cosine (to 0 over sft.steps)
            corruption="format",  # format | carry | none: how the demonstrations are imperfect
            corrupt_frac=0.7,
            # python -m launch.sft on your own data: SFT parquet (prompt/response columns, or
            # multi-turn messages; docs/algorithms.md), comma-separated. Empty: the embedded
            # task's demonstrations above.
            train_files="",
            val_files="",
            prompt_key="prompt",
            response_key="response",
            messages_key="messages",
            max_response_length=0,  # 0: rollout.response_length
            # launch.sft: held-out accuracy by greedy generation before and after, when the
            # run has prompt rows (data.val_files or the embedded task)
            heldout_generation=True,
            # arith demonstrations: a worked scratchpad of this many 14-token lines before the
            # answer (hfjax.data.arith.scratchpad; configs/grpo_long_arith.py); 0: none
            scratchpad_lines=0,
        )
    )
    c.actor = config_dict.ConfigDict(
        dict(
            mesh="fsdp=-1",
            # Logical-axis rules of the training layout: auto | train | nested_train | decode
            # (Megatron-style). With the hybrid engine, training shards must nest inside decode
            # shards; auto picks train, or nested_train when only it nests in rollout.mesh
            # (hfjax/engine/layout_choice.py), and says so in the log.
            rules="auto",
            # A mesh with sequence > 1 splits each row's tokens over that axis (activations of
            # the update and of the scoring passes); attention crosses the shards by ulysses
            # (all-to-all between tokens and heads; kv heads divisible by the sequence size)
            # or ring (K/V blocks passed round). Same key for ref, critic and the reward
            # and cost models (hfjax/models/sequence_parallel.py).
            sequence_parallel="ulysses",
            lr=1e-4,
            weight_decay=0.0,
            grad_clip=1.0,
            ppo_mini_batch_size=64,  # prompts; multiplied by rollout.n
            ppo_micro_batch_size=64,  # sequences
            # Packed batches (verl's use_remove_padding + use_dynamic_bsz): the update, the
            # log-prob and the reference pass compute on real tokens only, packed into rows,
            # micro-batches cut by ppo_max_token_len_per_gpu tokens per data-parallel device
            # (0: ppo_micro_batch_size padded rows' worth) instead of ppo_micro_batch_size.
            use_remove_padding=False,
            ppo_max_token_len_per_gpu=0,
            # Length-grouped micro-batches (the padded layout): the rows sorted by length and
            # cut into micro-batches of ppo_micro_batch_size, each only as wide as its own
            # sequences (hfjax/engine/grouping.py), for the update, log-prob and reference
            # passes.
            group_by_length=False,
            # Shared-prompt rows (padded and length-grouped layouts): the rollout.n samples of a
            # prompt are scored and trained in one row that holds the prompt once, its tokens
            # computed once instead of n times (hfjax/engine/shared_prompt.py). Same results;
            # needs ppo_micro_batch_size to hold whole groups of rollout.n, else off.
            share_prompt=True,
            # A vision-language policy's tower stays frozen (out of the optimizer and the
            # hybrid engine's transfers) unless this is False.
            freeze_vision=True,
            # Log-probs and entropy over the vocabulary take the LM head on about this many
            # positions per data-parallel device at a time (an equal share of every row's),
            # recomputed in the backward (hfjax/engine/head_chunks.py): no [rows, T,
            # vocabulary] float32 logits for whole micro-batches. 0: whole rows.
            logprob_chunk=2048,
            ppo_epochs=1,
            shuffle=True,
            policy_loss="vanilla",
            clip_ratio=0.2,
            clip_ratio_low=0.2,
            clip_ratio_high=0.2,
            clip_ratio_c=3.0,
            loss_agg_mode="token-mean",
            entropy_coeff=0.0,
            use_kl_loss=False,
            kl_loss_coef=0.001,
            kl_loss_type="low_var_kl",
            # A mixture-of-experts actor's router losses (hfjax/models/moe.py), in the warm
            # start and the update, averaged over its sparse layers: the load-balancing loss
            # (E * sum_e f_e * P_e, k when the load is even) and the z-loss (mean squared
            # log-sum-exp of the router logits). Logged either way, with the least and most
            # loaded experts' share of the mean load.
            moe_aux_loss_coef=0.0,
            moe_z_loss_coef=0.0,
            # Routing replay (hfjax/workers/routing.py): the sampler records each token's
            # experts; none | r2 (the old-policy log-probs route as the sampler did) | r3 (the
            # update too). actor/router_mismatch is logged either way.
            router_replay="none",
            # LoRA (hfjax/models/lora.py): rank > 0 trains low-rank adapters on the model RL
            # starts from (after the warm start) instead of its full weights; that base stays
            # frozen in model.param_dtype and is the reference (no second copy). targets:
            # all-linear or a comma list of q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,
            # down_proj; adapters scaled by alpha / rank.
            lora=dict(rank=0, alpha=32.0, targets="all-linear", dropout=0.0),
        )
    )
    c.rollout = config_dict.ConfigDict(
        dict(
            # Decode mesh of the 3D-HybridEngine, e.g. "data=4,tensor=2" over the actor's devices;
            # empty: decode on the actor's mesh and layout.
            mesh="",
            hybrid_engine=True,  # False: ignore `mesh` and decode in the training layout
            offload_optimizer=False,  # actor optimizer state in pinned host memory while decoding
            # The rollout engine (same tokens either way): "static" decodes every row until the
            # batch's longest stops; "continuous" decodes `slots` rows at a time and refills a
            # slot with the next waiting sample when its row stops (hfjax/engine/continuous.py).
            mode="static",
            slots=0,  # continuous: decode slots (a multiple of the decode mesh's data size); 0:
            # one per sample, so only the drain (fewer slots as rows stop) cuts the work
            refill_every=8,  # continuous: decode steps between refills / drain checks
            min_slots=0,  # continuous: the drain's floor; 0: the start of the slots' row range,
            # within which XLA:CPU rounds rows alike (bit-identical to the static engine)
            max_cache_len=0,  # continuous: cache columns per slot; 0 = prompt + response buckets
            # How a decode step reads its KV cache: auto | full | chunked (only the response
            # columns some row has written) | pallas (GPU kernel); and its layout: auto | cpu |
            # gpu. auto: full + cpu on CPUs, pallas + gpu on GPUs, full + gpu on TPUs
            # (hfjax.models.backend.decode_choice).
            decode_attention="auto",
            kv_layout="auto",
            n=1,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            min_p=0.0,
            response_length=10,
            # Multi-turn rollouts (docs/agents.md): a policy turn ends at EOS or at the close
            # tag of its max_parallel_calls-th call (verl's name; 1: at </tool_call>); its
            # calls run (tools: names or pkg.mod:Class, comma-separated) and their results are
            # appended in order as context the loss does not see, until a turn without calls,
            # max_turns policy turns or response_length tokens over the whole trajectory.
            multi_turn=config_dict.ConfigDict(
                dict(enable=False, max_turns=4, tools="calculator", max_tool_response_len=64,
                     tool_workers=8, max_parallel_calls=1, python_isolation="jail")
            ),
            # Validation sampling (verl's val_kwargs): n samples per held-out prompt at this
            # temperature (0: greedy), reported as val-core/<source>/acc/mean@n (and best@n).
            val_kwargs=config_dict.ConfigDict(dict(n=1, temperature=0.0)),
        )
    )
    c.ref = config_dict.ConfigDict(dict(mesh="fsdp=-1", sequence_parallel="ulysses"))
    c.critic = config_dict.ConfigDict(
        dict(
            mesh="fsdp=-1",
            sequence_parallel="ulysses",
            lr=1e-3,
            weight_decay=0.0,
            grad_clip=1.0,
            lora=dict(rank=0, alpha=32.0, targets="all-linear", dropout=0.0),  # as actor.lora
            ppo_mini_batch_size=64,
            ppo_micro_batch_size=64,
            use_remove_padding=False,  # as actor.use_remove_padding, for the value passes
            ppo_max_token_len_per_gpu=0,
            group_by_length=False,  # as actor.group_by_length

            ppo_epochs=1,
            shuffle=True,
            cliprange_value=0.5,
            loss_agg_mode="token-mean",
        )
    )
    # Safe-RLHF's cost critic (same keys as the critic).
    c.cost_critic = config_dict.ConfigDict(c.critic.to_dict())
    c.algo = config_dict.ConfigDict(
        dict(
            adv_estimator="gae",
            gamma=1.0,
            lam=1.0,
            norm_adv_by_std_in_grpo=True,
            use_kl_in_reward=True,
            kl_penalty="kl",
            kl_ctrl=config_dict.ConfigDict(
                dict(type="fixed", kl_coef=0.001, target_kl=0.1, horizon=10000)
            ),
            # Safe-RLHF: the Lagrange multiplier of E[cost] <= cost_threshold.
            safe_rlhf=config_dict.ConfigDict(
                dict(cost_threshold=0.0, lambda_init=1.0, lambda_lr=0.1, lambda_max=100.0)
            ),
            # DAPO's dynamic sampling: drop groups whose scores are all equal and generate more
            # until the batch is full, at most max_num_gen_batches times per step (0: no cap);
            # then on_exhausted: error | fill (with dropped groups).
            filter_groups=config_dict.ConfigDict(
                dict(enable=False, max_num_gen_batches=10, on_exhausted="fill")
            ),
            # DAPO's overlong shaping: responses longer than response_length - len lose up to
            # penalty_factor, linearly.
            overlong_buffer=config_dict.ConfigDict(
                dict(enable=False, len=4, penalty_factor=1.0)
            ),
            # Rollout correction (verl's names; docs/algorithms.md): importance weights
            # pi_old / pi_rollout between the trainer's old log-probs and the sampler's,
            # truncated at rollout_is_threshold, per token or sequence ("none": off; "auto":
            # token when async_rollout.max_staleness >= 1 outside bypass mode); rejection
            # of tokens or sequences (token | sequence | geometric) whose ratio leaves
            # [rollout_rs_threshold_lower, rollout_rs_threshold] (0: rollout_is_threshold and
            # its reciprocal); a veto of sequences with a token below
            # rollout_token_veto_threshold (0: off). bypass_mode: the sampler's log-probs are
            # the old policy's (no old-log-prob pass; PPO clips against the sampler; rejection
            # then judges pi_theta / pi_rollout inside the policy loss).
            rollout_correction=config_dict.ConfigDict(
                dict(rollout_is="auto", rollout_is_threshold=2.0, rollout_rs="",
                     rollout_rs_threshold=0.0, rollout_rs_threshold_lower=0.0,
                     rollout_token_veto_threshold=0.0, bypass_mode=False)
            ),
            # On-policy distillation (docs/algorithms.md): coef > 0 adds the teacher's
            # per-token reverse-KL advantage (teacher.path) to any algorithm's, summed over
            # later tokens with `discount` (0: each token's own).
            distill=config_dict.ConfigDict(dict(coef=0.0, discount=0.0)),
        )
    )
    c.reward = config_dict.ConfigDict(
        dict(
            custom_fn="",  # path/to/file.py:fn with (data_source, solution_str, ground_truth,
            # extra_info); replaces the built-in rewards
            num_processes=2,  # reward scorer subprocesses (0: score in the controller thread)
            timeout_s=10.0,  # per-call limit; a reward that hangs or raises scores 0
            # With a reward model or a judge: score = rule_weight * rule + model_weight *
            # model + judge_weight * judge, per data_source; `sources` overrides them for
            # some, "src=rule:W,model:W,judge:W;src2=..." (a weight left out: 0).
            rule_weight=1.0,
            model_weight=1.0,
            judge_weight=1.0,
            sources="",
            # A generative judge (docs/algorithms.md), a model role on its own pool: reads
            # `template` with {prompt} and {response} filled in, writes a verdict greedily (at
            # most max_verdict_tokens), and `parser` (a registered verdict parser's name, or a
            # regex whose one group is the score) reads it; a verdict that does not parse, or
            # whose parsing takes over timeout_s, scores default_score and is counted. It
            # shares the policy's tokenizer. Empty path: no judge.
            judge=config_dict.ConfigDict(
                dict(path="", template="{prompt}{response}", parser="number",
                     max_verdict_tokens=4, default_score=0.0, timeout_s=10.0,
                     mesh="fsdp=-1", dtype="float32")
            ),
        )
    )
    # Learned reward and cost models (HF *ForSequenceClassification directories, e.g. from
    # python -m launch.train_rm), each a worker group on its own mesh; empty path: none.
    # use_remove_padding: score packed rows (real tokens only) in micro-batches of
    # forward_max_token_len_per_gpu tokens per data-parallel device (0: the whole batch's).
    c.reward_model = config_dict.ConfigDict(
        dict(path="", mesh="fsdp=-1", sequence_parallel="ulysses", dtype="float32",
             use_remove_padding=False, forward_max_token_len_per_gpu=0))
    c.cost_model = config_dict.ConfigDict(
        dict(
            path="",
            mesh="fsdp=-1",
            sequence_parallel="ulysses",
            dtype="float32",
            use_remove_padding=False,
            forward_max_token_len_per_gpu=0,
            # module:fn or file.py:fn scoring a response text with the rule the cost model was
            # trained to measure; validation reports it as val-aux/cost_reference/mean.
            reference_fn="",
        )
    )
    # On-policy distillation's teacher (algo.distill.coef > 0, or --config.algorithm=opd): a
    # causal LM with the student's vocabulary, on its own pool's mesh, scoring the samples.
    c.teacher = config_dict.ConfigDict(
        dict(path="", mesh="fsdp=-1", sequence_parallel="ulysses", dtype="float32"))
    # How python -m launch.plan models programs that hfjax's runs do not have yet (the trainer
    # ignores these): score_micro, rows per scoring pass (0: the whole batch in one call, as
    # hfjax scores); gen_rows, rows a decode replica generates at once (0: all of them, as
    # hfjax's sampler does; -1: the planner picks, a paged decode's memory).
    c.plan = config_dict.ConfigDict(dict(score_micro=0, gen_rows=0))
    # python -m launch.train_rm: a reward (or cost) model trained with the Bradley–Terry loss on
    # preference parquet (configs/rm_arith.py and cost_arith.py set the files).
    c.rm = config_dict.ConfigDict(
        dict(
            target="reward",  # reward | cost (the costlier side of each pair scores higher)
            train_files="",  # preference parquet: prompt, chosen, rejected
            val_files="",  # held-out pairs for the pairwise accuracy
            max_response_length=0,  # 0: rollout.response_length
            steps=1500,
            batch_size=64,  # pairs per step
            micro_batch_size=64,
            lr=3e-4,
            weight_decay=0.0,
            grad_clip=1.0,
            sign_coef=0.0,  # Safe-RLHF's cost-sign term (needs unsafe labels)
            center_coef=0.01,  # keeps the scores' offset near 0
            mesh="fsdp=-1",
            eval_every=250,  # held-out accuracy every N steps (0: only before and after)
        )
    )
    # python -m launch.train_dpo: DPO and its offline relatives on the same preference parquet
    # (configs/dpo_arith.py sets the files), from the warm-started policy and its reference.
    c.dpo = config_dict.ConfigDict(
        dict(
            loss_type="sigmoid",  # sigmoid (DPO) | ipo | simpo (reference-free)
            beta=0.1,
            label_smoothing=0.0,  # conservative DPO's eps (sigmoid and simpo)
            simpo_gamma=0.5,  # SimPO's target margin
            train_files="",  # preference parquet: prompt, chosen, rejected
            val_files="",  # held-out pairs for the val/ preference metrics
            max_response_length=0,  # 0: rollout.response_length
            steps=200,
            batch_size=64,  # pairs per step
            micro_batch_size=64,
            lr=1e-4,
            weight_decay=0.0,
            grad_clip=1.0,
            eval_every=50,  # held-out metrics every N steps (0: only before and after)
        )
    )
    # Asynchronous rollout (docs/async.md): the rollout pool generates with its own copy of the
    # actor's weights, at most max_staleness updates behind the trainer. 0: synchronous.
    c.async_rollout = config_dict.ConfigDict(
        dict(
            max_staleness=0,
            push_every=1,  # push the trainer's weights to the rollout pool every N updates
            # A batch whose newer version is pushed while it decodes switches to it halfway
            # through its responses (rows still decoding keep their prefix).
            partial_rollout=False,
        )
    )
    c.trainer = config_dict.ConfigDict(
        dict(
            total_steps=60,
            test_freq=20,  # validate every N steps (and at the last one); 0: never
            val_before_train=True,
            sync_stage_timing=True,
            log_every=10,  # console summary line every N steps (0: validation lines only)
            # Metric sinks, comma-separated: console, jsonl, tensorboard, and the optional
            # trackers wandb and mlflow (hfjax/run/trackers.py; pip install -e ".[wandb]").
            logger="console,jsonl,tensorboard",
            project_name="hfjax",  # W&B project, MLflow experiment
            experiment_name="",  # W&B run name; empty: the out_dir's name
            plot=True,  # <out_dir>/metrics.png: reward and validation accuracy vs step
            jax_smi=False,  # device-memory tracking with jax-smi (GPU/TPU; no-op on CPU)
            out_dir="runs/ppo_arith",  # metrics, tokenizer and checkpoints/ go here
            save_freq=20,  # checkpoint every N steps, after the warm start and at the end
            max_to_keep=2,
            async_save=True,
            # auto: continue from the newest readable checkpoint in out_dir, if any;
            # disable: start fresh; or a path: a run's out_dir, a checkpoint root or step dir.
            resume="auto",
            # An update with a non-finite loss or gradient norm is not applied. stop: end the
            # run naming the stage and step; skip: count it (actor/nonfinite_updates, ...) and
            # go on. An update that overflows a parameter ends the run either way.
            nonfinite="stop",
            # JAX's persistent compilation cache, so a resumed run compiles nothing it compiled
            # before: auto ($JAX_COMPILATION_CACHE_DIR, else ~/.cache/hfjax/xla), off, or a dir.
            compilation_cache_dir="auto",
        )
    )
    return c
