"""Multi-turn rollouts: turns that keep their KV cache against re-prefilling every turn's context.

Both sides run `hfjax.agents.AgentLoop` on the same forced 3-turn trajectories, one after the
other in one process: a policy scripted into a model's weights (`scripted_policy` and
`tool_call_successors` of tests/support.py) calls its tool after the prompt and after every
result, and a tool answers with `--result_digits` digits (at once: every row's calls finish
together, so each side runs 3 turn programs of fixed shapes); the loop stops it at
`max_turns=3`.
- **kept**: the loop as it is (`hfjax.engine.session`): a later turn prefills its turn's last
  token and the tool's result into the row's kept cache;
- **re-prefill**: the loop with the engine of hfjax before it kept caches, reproduced here
  (`RePrefill`): every later turn is a `Sampler.generate` call over the ready rows, padded to a
  power of two, whose prompts are their whole contexts (prompt, earlier turns, results).
Same seeds, so the same trajectories (the bench checks the tokens and prints the largest
log-prob difference).

Figures: `prefilled_per_trajectory`, real tokens run through a prefill per trajectory (prompt
included; padding excluded), and `step_s`, the median wall time of one rollout of the batch
(`--repeats` after a warm-up that compiles), with their ratios. The model is SmolLM2-135M's
shape with random weights (no download) over the arith_tool tokenizer (its vocabulary
padded to the hidden size); `--layers` and
`--hidden` shrink it. HFJAX_SMOKE=1 (launch/smoke.py) runs a 2-layer model, one repeat.

    python -m bench.agent_prefill
    python -m bench.agent_prefill --prompt_tokens=256 --samples=4

The last line printed is JSON.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))

from support import scripted_policy, tool_call_successors  # noqa: E402

from configs import ppo_arith  # noqa: E402
from hfjax.agents import AgentLoop  # noqa: E402
from hfjax.data import tool_arith  # noqa: E402
from hfjax.data.batching import left_pad  # noqa: E402
from hfjax.engine.buckets import bucket_size  # noqa: E402
from hfjax.engine.sampler import Sampler, SamplingParams  # noqa: E402
from hfjax.engine.spec import MultiTurnSpec  # noqa: E402
from hfjax.models import presets, transformer  # noqa: E402
from hfjax.tools import Tool, ToolRunner  # noqa: E402
from launch import smoke  # noqa: E402

flags.DEFINE_integer("prompts", 4, "prompts per batch")
flags.DEFINE_integer("samples", 2, "trajectories per prompt (rollout.n)")
flags.DEFINE_integer("prompt_tokens", 128, "tokens per prompt")
flags.DEFINE_integer("result_digits", 16, "digits of each tool result")
flags.DEFINE_integer("repeats", 3, "timed rollouts per side, alternating (median reported)")
flags.DEFINE_integer("layers", 0, "decoder layers (0: SmolLM2-135M's 30)")
flags.DEFINE_integer("hidden", 0, "hidden size (0: SmolLM2-135M's 576; heads keep head_dim 64)")
FLAGS = flags.FLAGS

TOK = tool_arith.tokenizer()
TURNS = 3


class Digits(Tool):
    """Answers with a fixed number of digits. Named "calculator": that quoted name is one token
    of the arith_tool tokenizer, so the scripted policy writes its call token by token."""

    name = "calculator"
    description = "Answers with digits."
    parameters = {"type": "object", "properties": {}, "required": []}

    def __init__(self, digits: int = 16):
        self.digits = digits

    def call(self, arguments: dict) -> str:
        return "7" * self.digits


class _RePrefillSession:
    """hfjax's turns before the kept cache: each later turn is one `generate` call whose
    prompts are the ready rows' whole contexts (the session interface of
    `hfjax.engine.session.TurnSession`, so the loop itself is unchanged)."""

    def __init__(self, sampler, state, prompts, params, width):
        self.sampler, self.state, self.params = sampler, state, params
        self.prompts = prompts  # each row's prompt tokens
        rows = len(prompts)
        self.tokens = np.zeros((rows, width), np.int32)
        self.logprobs = np.zeros((rows, width), np.float32)
        self.start = np.zeros((rows,), np.int32)
        self.t = np.zeros((rows,), np.int32)
        self.prefilled = 0

    def _write(self, r, toks, lps, at):
        toks, lps = toks[:self.tokens.shape[1] - at], lps[:self.tokens.shape[1] - at]
        self.tokens[r, at:at + len(toks)], self.logprobs[r, at:at + len(toks)] = toks, lps
        self.start[r], self.t[r] = at, at + len(toks)

    def turns(self):
        return self.tokens, self.logprobs, self.start, self.t

    def resume(self, new, seeds):
        go = list(new)
        for r, (at, toks) in new.items():
            self.tokens[r, at:at + len(toks)] = toks
        ends = {r: at + len(toks) for r, (at, toks) in new.items()}
        width = bucket_size(len(go), min(8, len(self.prompts)))
        picks = go + [go[0]] * (width - len(go))
        contexts = [self.prompts[r] + self.tokens[r, :ends[r]].tolist() for r in picks]
        self.prefilled += sum(len(contexts[k]) for k in range(len(go)))
        ids, mask = left_pad(contexts, max(map(len, contexts)), self.sampler.pad_id)
        room = max(self.params.max_new_tokens - ends[r] for r in go)
        p = dataclasses.replace(self.params, n=1, max_new_tokens=room)
        out = self.sampler.generate(self.state, np.asarray(ids), np.asarray(mask), p,
                                    seed=np.array([seeds[r] for r in picks]))
        toks, m, lps = (np.asarray(x) for x in out[:3])
        for k, r in enumerate(go):
            keep = m[k] > 0
            self._write(r, toks[k][keep], lps[k][keep], ends[r])


class RePrefill:
    """The engine side of the re-prefill loop (`AgentLoop.engine`'s interface)."""

    def __init__(self, sampler):
        self.sampler = sampler

    def open(self, state, ids, mask, params, seed):
        out = self.sampler.generate(state, ids, mask, params, seed=seed)
        toks, m, lps = (np.asarray(x) for x in (out.tokens, out.mask, out.logprobs))
        n = params.n
        prompts = [list(ids[r // n][mask[r // n] > 0]) for r in range(toks.shape[0])]
        session = _RePrefillSession(self.sampler, state, prompts, params,
                                    bucket_size(params.max_new_tokens, 16))
        for r in range(toks.shape[0]):
            keep = m[r] > 0
            session._write(r, toks[r][keep], lps[r][keep], 0)
        return session


class _AtOnce(ToolRunner):
    """A runner whose calls are done when `submit` returns: every row's tools finish together,
    so both sides run the same 3 turn programs per rollout, the same shapes every time
    (with a thread pool, rows whose calls finish a moment apart resume apart, and each new
    grouping can compile a new shape inside a timed rollout)."""

    def submit(self, calls):
        future = cf.Future()
        future.set_result(super().submit(calls).result())
        return future


def _model(layers: int, hidden: int):
    base = presets.PRESETS["smollm2-135m"]
    hidden = hidden or base.hidden_size
    heads = max(1, hidden // base.head_dim)
    # `scripted_policy` reads the hidden state through the head: at least `hidden` ids (the
    # ones past the tokenizer's are never drawn).
    cfg = dataclasses.replace(
        base, vocab_size=max(TOK.vocab_size, hidden), tie_word_embeddings=False,
        num_layers=layers or base.num_layers, hidden_size=hidden, num_heads=heads,
        num_kv_heads=heads if heads % base.num_kv_heads else base.num_kv_heads,
        intermediate_size=base.intermediate_size * hidden // base.hidden_size,
        pad_token_id=TOK.pad_id, eos_token_id=TOK.eos_id)
    model = transformer.build(cfg, "causal_lm", seed=0)
    return scripted_policy(model, tool_call_successors(TOK, "<tool_call>"))


def _prompts(count: int, length: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """`count` prompts of `length` tokens: digits and '*', ending in '=' (where the scripted
    policy starts its call)."""
    texts = ["".join(rng.choice(list("0123456789*"), length - 1)) + "=" for _ in range(count)]
    ids = [TOK.encode(t, add_special_tokens=False) for t in texts]
    padded, mask = left_pad(ids, length, TOK.pad_id)
    return np.asarray(padded), np.asarray(mask)


def main(argv):
    del argv
    from flax import nnx

    if smoke.enabled():
        FLAGS.layers, FLAGS.hidden, FLAGS.repeats = 2, 64, 1
        FLAGS.prompt_tokens = min(FLAGS.prompt_tokens, 32)
    model = _model(FLAGS.layers, FLAGS.hidden)
    state = nnx.state(model)
    ids, mask = _prompts(FLAGS.prompts, FLAGS.prompt_tokens, np.random.default_rng(0))
    # 3 turns of a 7-token call, 2 results of the digits between <tool_response> tags.
    need = TURNS * 7 + (TURNS - 1) * (FLAGS.result_digits + 2)
    params = SamplingParams(max_new_tokens=bucket_size(need, 16), temperature=1.0,
                            n=FLAGS.samples, eos_ids=(TOK.eos_id,))
    spec = dataclasses.replace(MultiTurnSpec.of(ppo_arith.get_config().rollout.multi_turn),
                               enable=True, max_turns=TURNS,
                               max_tool_response_len=FLAGS.result_digits + 8)
    seeds = np.arange(FLAGS.prompts)
    res = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "load_average_start": [round(x, 1) for x in os.getloadavg()],
           "model": {"layers": model.config.num_layers, "hidden": model.config.hidden_size},
           "rows": FLAGS.prompts * FLAGS.samples, "prompt_tokens": FLAGS.prompt_tokens,
           "result_digits": FLAGS.result_digits, "budget": params.max_new_tokens}
    with _AtOnce({"calculator": Digits(FLAGS.result_digits)}, max_workers=1) as runner:
        sampler = Sampler(model, max_prompt_len=FLAGS.prompt_tokens + params.max_new_tokens,
                          pad_id=TOK.pad_id)
        loops = {"kept": AgentLoop(sampler, TOK, runner, spec),
                 "reprefill": AgentLoop(sampler, TOK, runner, spec)}
        loops["reprefill"].engine = RePrefill(sampler)
        times = {k: [] for k in loops}
        outs, prefilled = {}, {}
        for rep in range(FLAGS.repeats + 1):  # the first round compiles
            for name, loop in loops.items():
                t0 = time.perf_counter()
                outs[name] = loop.run(state, ids, mask, params, seed=seeds)
                if rep:
                    times[name].append(time.perf_counter() - t0)
                prefilled[name] = loop.prefilled
    kept, old = outs["kept"], outs["reprefill"]
    turns = [t.num_turns for t in kept.trajectories]
    if min(turns) != TURNS or not np.array_equal(kept.tokens, old.tokens):
        raise SystemExit(f"the two sides' trajectories differ (turns {turns}): nothing to compare")
    rows = len(turns)
    prompt = int(mask.sum()) * FLAGS.samples
    for name in loops:
        res[name] = {"prefilled_per_trajectory": round((prompt + prefilled[name]) / rows, 1),
                     "step_s": round(statistics.median(times[name]), 3),
                     "turn_programs": loops[name].turn_calls}
    res["prefill_ratio"] = round(res["reprefill"]["prefilled_per_trajectory"]
                                 / res["kept"]["prefilled_per_trajectory"], 2)
    res["step_speedup"] = round(res["reprefill"]["step_s"] / res["kept"]["step_s"], 2)
    res["max_logprob_diff"] = float(np.abs(kept.logprobs - old.logprobs).max())
    res["load_average_end"] = [round(x, 1) for x in os.getloadavg()]
    print(f"kept cache: {res['kept']['prefilled_per_trajectory']} prefilled tokens per "
          f"trajectory, {res['kept']['step_s']} s per rollout; re-prefill: "
          f"{res['reprefill']['prefilled_per_trajectory']}, {res['reprefill']['step_s']} s "
          f"({res['prefill_ratio']}x the tokens, {res['step_speedup']}x the time)")
    print(json.dumps(res))


if __name__ == "__main__":
    app.run(main)
