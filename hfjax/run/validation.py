"""Held-out scoring of a policy by generation: the responses to a set of prompt rows, scored by
the rule reward of each row's data_source (accuracy for 0/1 rewards), and by the run's
reward and cost models when it has them. Used by RL validation, `launch.sft` and
`launch.evaluate` (`evaluate_policy`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from hfjax.parallel.transfer import to_host
from hfjax.workers import vision


def generation_metrics(actor, reward, rows: Sequence[dict], *, pad_id: int,
                       max_prompt_length: int, n: int = 1, temperature: float = 0.0,
                       models: Sequence = (), judge=None,
                       text_metrics: Mapping[str, Callable[[str], float]] | None = None,
                       records: list | None = None, tokenizer=None,
                       blank_images: bool = False) -> dict[str, float]:
    """Mean rule score per data_source of `n` responses per prompt at `temperature` (0:
    greedy): `val-core/<source>/acc/mean@n`, and for n > 1 `val-aux/<source>/acc/best@n` (each
    prompt's best sample). Each worker group in `models` (a reward or cost model) adds the
    mean of its scores on the same responses, `val-aux/<its output>/mean`, and the share above
    0; a generative `judge` adds its mean score, `val-aux/judge_scores/mean`, and the share of
    responses it scores exactly as the rule reward does, `val-aux/judge_agreement/mean`
    (for a judge of the rule's 0/1 verdicts: how often it agrees); each `text_metrics` entry
    name -> fn(response text) adds `val-aux/<name>/mean` (e.g. the
    rule a cost model was trained to measure, to check it against). With a `records` list, one
    dict per response is appended to it: prompt index, sample, data_source, ground truth,
    response text, its token count, whether it ended before the length cap, and its score
    (and the judge's).
    """
    # Fixed per-prompt seeds: sampled validation is reproducible and the same at every step.
    # (A vision-language actor's prompts carry their pictures: `vision.prompts`.)
    batch = vision.prompts(rows, np.arange(len(rows), dtype=np.int32), pad_id,
                           max_prompt_length, tokenizer, actor.vl, blank_images)
    out = actor.generate(batch, greedy=temperature == 0.0, n=n, temperature=temperature)
    scored = reward.compute_reward(out)
    scores = to_host(jnp.sum(scored["token_level_scores"], axis=1)).reshape(-1, n)
    sources = np.asarray(out.meta["data_source"]).reshape(-1, n)[:, 0]
    metrics = {}
    for ds in sorted(set(sources.tolist())):
        mine = scores[sources == ds]
        metrics[f"val-core/{ds}/acc/mean@{n}"] = float(mine.mean())
        if n > 1:
            metrics[f"val-aux/{ds}/acc/best@{n}"] = float(mine.max(axis=1).mean())
    for model in models:
        s = model.compute_score(out.select(["input_ids", "attention_mask"]))
        metrics[f"val-aux/{model.output}/mean"] = float(to_host(jnp.mean(s[model.output])))
        metrics[f"val-aux/{model.output}/positive_frac"] = float(
            to_host(jnp.mean((s[model.output] > 0).astype(jnp.float32))))
    said = None
    if judge is not None:
        said = to_host(judge.compute_judge_scores(out)["judge_scores"])
        metrics["val-aux/judge_scores/mean"] = float(said.mean())
        metrics["val-aux/judge_agreement/mean"] = float(np.mean(said == scores.reshape(-1)))
    texts = list(scored.meta["response_text"])
    trajs = out.meta.get("trajectory")
    if records is not None:
        lengths = to_host(jnp.sum(out["response_mask"], axis=1)).reshape(-1, n)
        cap = out["responses"].shape[1]
        truths = np.asarray(out.meta["ground_truth"]).reshape(-1, n)[:, 0]
        for i in range(scores.shape[0]):
            for j in range(n):
                records.append({
                    "prompt": i, "sample": j, "data_source": str(sources[i]),
                    "ground_truth": str(truths[i]), "response": texts[i * n + j],
                    "response_tokens": int(lengths[i, j]),
                    "finished": bool(lengths[i, j] < cap), "score": float(scores[i, j])})
                if said is not None:
                    records[-1]["judge_score"] = float(said[i * n + j])
                if trajs is not None:  # multi-turn: the trajectory, turn by turn
                    records[-1] |= trajs[i * n + j]
    for name, fn in (text_metrics or {}).items():
        metrics[f"val-aux/{name}/mean"] = float(np.mean([float(fn(t)) for t in texts]))
    return metrics


def evaluate_policy(cfg, tokenizer, rows, samples: int = 1, temperature: float = 1.0,
                    records: dict[str, list] | None = None) -> dict[str, float]:
    """`generation_metrics` of the config's policy (`policy_alone`) on prompt
    `rows`: greedy, and with samples > 1 also `samples` samples per prompt at `temperature`.
    What `launch.evaluate` prints. With `records` (a dict), its "greedy" and "sampled" lists
    receive the per-response records."""
    from hfjax.workers import groups

    _, actor = policy_alone(cfg, tokenizer)
    reward = groups.build_reward(cfg, tokenizer, home=actor.mesh)
    kw = dict(pad_id=tokenizer.pad_id, max_prompt_length=cfg.data.max_prompt_length)
    keep = (lambda name: records.setdefault(name, [])) if records is not None else (
        lambda name: None)
    out = generation_metrics(actor, reward, rows, records=keep("greedy"), **kw)
    if samples > 1:
        out |= generation_metrics(actor, reward, rows, n=samples, temperature=temperature,
                                  records=keep("sampled"), **kw)
    return out


def policy_alone(cfg, tokenizer):
    """The policy alone, as SFT and evaluation run it: `initial_model` in the run's compute
    dtype, as the actor of a colocated pool over every device, on `actor.mesh`. Returns
    (pools, actor)."""
    import jax

    from hfjax.config import model_source
    from hfjax.controller.placement import resolve_placement
    from hfjax.workers import groups

    pools = resolve_placement("colocate", ("actor",), jax.devices())
    compute = model_source.compute_dtype(cfg, jax.devices()[0].platform)
    model = model_source.initial_model(cfg, tokenizer, compute, pools)
    return pools, groups.build_actor(cfg, model, pools, tokenizer.pad_id, tokenizer.eos_id,
                                     tokenizer=tokenizer)
