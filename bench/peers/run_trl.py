"""The GRPO workload on TRL's GRPOTrainer (PyTorch, CPU), timed per optimizer step.

    bench/peers/.venvs/trl/bin/python bench/peers/run_trl.py tiny

TRL's GRPO defaults that differ from the workload are overridden: bf16 -> the workload's
precision (f32, or bf16 autocast over f32 weights with PEERS_PRECISION=bf16), gradient
checkpointing off, loss_type "dapo" -> "grpo" (per-sequence token mean), max_grad_norm 1.0 ->
0 (no clipping), linear LR decay -> constant, and, on fixed lengths, min_new_tokens =
max_new_tokens so that no completion stops early. On natural lengths completions stop at the
tokenizer's EOS (TRL's default stop; SmolLM2's pad is the same `<|im_end|>`, harmless here, as
TRL builds its masks from lengths, not from pad ids). With one generation per optimizer step
and num_iterations=1 TRL skips the old-policy log-prob pass (the ratio's denominator is the
detached current log-prob).

A completion's length counts its tokens up to and including the stop token (TRL's
completion_mask), the prompt's its real tokens (prompt_mask): no padding.

Step time is the wall time between consecutive optimizer-step ends (generation, reward,
advantage, forward/backward, Adam); "gen" is `GRPOTrainer._generate` (tokenize + sample).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload  # noqa: E402


def even_fraction(completions, completion_ids, **kwargs) -> list[float]:
    """The reward: the fraction of even token ids in each completion."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def main() -> None:
    w = workload.get(sys.argv[1])
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback

    torch.manual_seed(w.seed)
    texts, expected_ids = w.load_prompts()
    # AutoTokenizer would pick the architecture's own tokenizer class (Qwen2Tokenizer) and ignore
    # the word-level tokenizer.json; the generic fast tokenizer reads tokenizer.json as it is.
    tok = PreTrainedTokenizerFast.from_pretrained(w.model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(w.model_dir, dtype=torch.float32)
    data = datasets.Dataset.from_dict({"prompt": texts})

    out_dir = tempfile.mkdtemp(prefix="peers_trl_")
    args = trl.GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        bf16=w.precision == "bf16",
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=w.micro_batch,
        gradient_accumulation_steps=w.rows // w.micro_batch,
        num_generations=w.samples,
        num_iterations=1,
        max_completion_length=w.new_tokens,
        generation_kwargs=None if w.natural else {"min_new_tokens": w.new_tokens},
        temperature=w.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=w.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=0.0,
        beta=0.0,
        epsilon=w.clip,
        loss_type="grpo",
        scale_rewards="group",
        max_steps=w.steps,
        logging_steps=10**6,
        save_strategy="no",
        report_to="none",
        disable_dropout=True,
        shuffle_dataset=False,
        dataloader_num_workers=0,
        seed=w.seed,
    )

    ends: list[float] = []
    cpu_ends: list[float] = []
    gen: list[float] = []
    tokens: list[int] = []
    lengths: list[int] = []
    updates = [0]

    class Trainer(trl.GRPOTrainer):
        def _generate(self, prompts):
            t0 = time.perf_counter()
            out = super()._generate(prompts)
            gen.append(time.perf_counter() - t0)
            return out

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            pm, cm = out["prompt_mask"], out["completion_mask"]
            got = [row[m.bool()].tolist() for row, m in zip(out["prompt_ids"], pm)]
            want = [ids for ids in expected_ids for _ in range(w.samples)]
            if got != want:
                raise AssertionError("TRL tokenized the prompts differently from prompts.json")
            tokens.append(int(pm.sum() + cm.sum()))
            lengths.extend(cm.sum(dim=1).tolist())
            return out

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, optimizer=None, **kw):
            inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
            inner.register_step_post_hook(lambda *a: updates.__setitem__(0, updates[0] + 1))

        def on_step_begin(self, args, state, control, **kw):
            if not ends:
                ends.append(time.perf_counter())
                cpu_ends.append(time.process_time())

        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter())
            cpu_ends.append(time.process_time())

    trainer = Trainer(model=model, reward_funcs=even_fraction, args=args, train_dataset=data,
                      processing_class=tok, callbacks=[Clock()])
    try:
        trainer.train()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    if trainer.model.is_gradient_checkpointing or args.bf16 != (w.precision == "bf16"):
        raise AssertionError(f"TRL ran with gradient checkpointing or bf16={args.bf16}; the "
                             f"workload is {w.precision}")
    if next(trainer.model.parameters()).dtype != torch.float32:
        raise AssertionError("TRL's master weights are not float32")
    steps = [b - a for a, b in zip(ends, ends[1:])]
    cpu = [b - a for a, b in zip(cpu_ends, cpu_ends[1:])]
    if len(steps) != w.steps:
        raise AssertionError(f"TRL ran {len(steps)} steps, expected {w.steps}")
    record = workload.summarize(
        "trl", w, steps, cpu, {"gen": gen, "train": [s - g for s, g in zip(steps, gen)]},
        tokens, updates[0], lengths,
        {"versions": {"trl": trl.__version__, "torch": torch.__version__,
                      "transformers": transformers.__version__},
         "threads": torch.get_num_threads()},
    )
    workload.write_result(w, "trl", record)


if __name__ == "__main__":
    main()
