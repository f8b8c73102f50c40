"""A generative judge as a worker group: a causal LM on its own pool that reads each prompt and
response through a template, writes a verdict, and has it parsed into a score.

The judge shares the policy's tokenizer: the run's tokenizer writes the judge's prompts (the
template's text as one user message, `hfjax.data.dataset.render_prompt`) and reads its
verdicts, so a judge whose vocabulary is another size is refused in one line
(`check_vocabulary`) before anything loads.

Per step the judge generates once for the whole batch: every row's verdict is one request of
one call of the continuous-batching engine (`hfjax.engine.continuous`), greedy, at most
`max_verdict_tokens` tokens each. The verdicts come to the host, where the verdict parser
(`hfjax.rewards.judge`) scores each in the reward's scorer processes, each call bounded by
`timeout_s`: a verdict that does not parse, and a row whose parsing runs past the timeout,
score `default_score` and are counted (`reward/judge_unparsed`, `reward/judge_timeouts`);
neither ends the step. Generation itself is bounded per row by `max_verdict_tokens`: the
rows of one call finish together, so the time a row can overrun is its parsing.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from hfjax.controller.batch import Batch
from hfjax.controller.protocol import ON_HOST, method
from hfjax.data.batching import left_pad
from hfjax.data.dataset import render_prompt
from hfjax.engine.buckets import prompt_bucket
from hfjax.engine.continuous import ContinuousSampler
from hfjax.engine.token_select import SamplingParams
from hfjax.parallel.transfer import to_host
from hfjax.rewards import judge as verdicts
from hfjax.rewards.pool import ERROR, OK, TIMEOUT, shared_pool
from hfjax.workers.base import Program, StepShape, WorkerGroup

JUDGE_READS = ("prompts", "prompt_mask", "responses", "response_mask")


class Judge(WorkerGroup):
    """The judge's worker group: its parameters in the decode layout of its pool's mesh and a
    continuous-batching sampler over them.

    `template` holds `{prompt}` and `{response}`; `parser` is a registered verdict parser's
    name or a regex with one group (`hfjax.rewards.judge.parser_call`); `prompt_len` is the
    longest judge prompt the step's caps give in tokens (the template's, a prompt's and a
    response's), what the dry run prices; the sampler admits twice as many, room for a prompt
    or response that re-encodes from its text into more tokens. `num_processes` and
    `timeout_s` are the scorer pool's that parses the verdicts.
    """

    def __init__(self, name: str, pool, mesh_spec, model: nnx.Module, *, tokenizer,
                 template: str, parser: str, max_verdict_tokens: int, default_score: float,
                 timeout_s: float, num_processes: int, prompt_len: int, **kw):
        problem = verdicts.template_problem(template)
        if problem:
            raise ValueError(f"reward.judge.template {problem}")
        self.parse, self.parse_args = verdicts.parser_call(parser)
        super().__init__(name, pool, mesh_spec, model, rules="decode", **kw)
        self.tokenizer = tokenizer
        self.template = template
        self.default_score = float(default_score)
        self.params_for_verdicts = SamplingParams(
            max_new_tokens=int(max_verdict_tokens), temperature=0.0,
            eos_ids=(tokenizer.eos_id,) if tokenizer.eos_id is not None else ())
        # Parameters are already in the sampler's layout (rules="decode"): nothing moves per call.
        self.prompt_len = int(prompt_len)
        self.sampler = ContinuousSampler(model, mesh=self.mesh, rules="decode",
                                         max_prompt_len=2 * self.prompt_len,
                                         pad_id=tokenizer.pad_id)
        self.pool_of_parsers = shared_pool(num_processes, timeout_s)
        self._since_pop = {"reward/judge_unparsed": 0, "reward/judge_timeouts": 0}

    def judge_prompts(self, batch: Batch) -> list[list[int]]:
        """Each row's judge prompt as token ids (host arrays `JUDGE_READS`)."""
        tok = self.tokenizer

        def text(ids, mask, i):
            return tok.decode(ids[i][mask[i] > 0].tolist())

        p, pm, r, rm = (np.asarray(batch[k]) for k in JUDGE_READS)
        return [render_prompt(tok, [{"role": "user", "content": verdicts.render(
            self.template, text(p, pm, i), text(r, rm, i))}]) for i in range(len(p))]

    @method(ON_HOST, reads=JUDGE_READS)
    def compute_judge_scores(self, batch: Batch) -> Batch:
        """Batch with `judge_scores` [B] (float32), the verdicts' texts in meta
        (`judge_verdict`), and this batch's unparsed and timed-out counts in info."""
        ids = self.judge_prompts(batch)
        width = max(len(x) for x in ids)
        prompt_ids, prompt_mask = left_pad(ids, width, self.tokenizer.pad_id)
        out = self.sampler.generate(self.params, prompt_ids, prompt_mask,
                                    self.params_for_verdicts, seed=0)
        tokens, mask = to_host(out.tokens), to_host(out.mask)
        texts = [self.tokenizer.decode(tokens[i][mask[i] > 0].tolist())
                 for i in range(len(tokens))]
        outcomes = self.pool_of_parsers.map([self.parse] * len(texts),
                                            [(t, *self.parse_args) for t in texts])
        scores = np.array([o.score if o.status == OK else self.default_score
                           for o in outcomes], np.float32)
        counts = {"reward/judge_unparsed": sum(o.status == ERROR for o in outcomes),
                  "reward/judge_timeouts": sum(o.status == TIMEOUT for o in outcomes)}
        for k, v in counts.items():
            self._since_pop[k] += v
        return Batch({"judge_scores": scores}, meta={"judge_verdict": texts}, info=counts)

    def programs(self, shape: StepShape) -> list[Program]:
        """The verdicts' generation for a step of `shape` at the widest judge prompt, priced as
        the dry run prices the actor's rollout: the engine's prefill and decode programs for
        the step's rows (`hfjax.run.dry_run`), the judge's weights their argument."""
        s, params = self.sampler, self.params_for_verdicts
        static = s.static_for(s.padded_batch(shape.sequences), prompt_bucket(self.prompt_len),
                              params)
        prefill, decode = s.programs(static)
        request = s.abstract_request(static, params)
        carry = prefill.eval_shape(self.params, *request)
        held = (f"{self.name} params",)
        return [Program(f"{self.name}.prefill", prefill, (self.params, *request), held,
                        {"params": self.params}),
                Program(f"{self.name}.decode", decode, (self.params, carry, *request[4:]), held,
                        {"params": self.params, "cache and loop state": carry})]

    def pop_metrics(self) -> dict[str, float]:
        """`reward/judge_unparsed` and `reward/judge_timeouts` since the previous call."""
        out = {k: float(v) for k, v in self._since_pop.items()}
        self._since_pop = dict.fromkeys(self._since_pop, 0)
        return out


def check_vocabulary(path: str, judge_vocab: int, policy_vocab: int) -> None:
    """ValueError (one line) unless the judge's vocabulary is the policy's."""
    if judge_vocab != policy_vocab:
        raise ValueError(
            f"reward.judge.path={path!r} has a vocabulary of {judge_vocab} tokens, the policy's "
            f"has {policy_vocab}; the judge reads prompts written and verdicts read with the "
            "policy's tokenizer, so it must share it: give a judge of the policy's family")
