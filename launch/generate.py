"""Generate completions from the command line with hfjax's rollout sampler.

    python -m launch.generate --prompt="What is 7 + 5?" --chat --max_new_tokens=64 --temperature=0

The default model is SmolLM2-135M-Instruct from its GGUF file; `--model` takes any HF directory
or `.gguf` file hfjax can load. `--chat` wraps each prompt as a user message and applies the
tokenizer's chat template with the generation prompt. Generation stops at the tokenizer's and the
model config's EOS ids. Compiled programs go to JAX's persistent compilation cache
(`--compilation_cache_dir`, see launch/compile_cache.py), so a second run skips compiling.

Across processes (the process flags of docs/scaling.md, or `launch.local_cluster --module=
launch.generate`), every process runs this same command: the model is loaded onto a decode mesh
over the devices of all processes (`--mesh`, default `data=-1`), the responses are gathered to
every process and process 0 prints them.

With `--tools=calculator` (tool names or pkg.mod:Class, comma-separated) each sample is a
multi-turn trajectory (docs/agents.md): a policy turn that ends in `</tool_call>` has its calls
run and their results appended, then the policy goes on, up to `--max_turns` policy turns and
`--max_new_tokens` response tokens in all; with `--chat` the tools' schemas go to the chat
template. Each trajectory is printed turn by turn. `--responses=FILE.jsonl` writes one JSON line
per sample: prompt index, sample, prompt text, the turns (the assistant's text; each tool
turn's calls and results), why it stopped, and its turn, call and error counts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from absl import flags

from hfjax.parallel import distributed
from launch import cli

flags.DEFINE_string("model", None, "HF directory or .gguf file (default: SmolLM2-135M GGUF)")
flags.DEFINE_multi_string("prompt", ["What is 7 + 5?"], "prompt text; repeat for a batch")
flags.DEFINE_bool("chat", False, "apply the chat template (user turn + generation prompt)")
flags.DEFINE_integer("max_new_tokens", 64, "tokens to generate at most")
flags.DEFINE_float("temperature", 1.0, "sampling temperature; 0 is greedy")
flags.DEFINE_integer("top_k", 0, "keep the k most likely tokens (0: off)")
flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass (1: off)")
flags.DEFINE_float("min_p", 0.0, "drop tokens below min_p x the top probability (0: off)")
flags.DEFINE_integer("n", 1, "samples per prompt")
flags.DEFINE_integer("seed", 0, "sampling seed")
flags.DEFINE_string("mesh", None, "decode mesh over all devices, e.g. 'data=2' (default: none)")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "parameter and compute dtype")
flags.DEFINE_integer("max_layers", 0, "at most the model's first N decoder layers (0: all)")
flags.DEFINE_string("tools", None, "multi-turn with these tools, e.g. 'calculator' (default: "
                    "one turn)")
flags.DEFINE_integer("max_turns", 4, "policy turns per trajectory at most (with --tools)")
flags.DEFINE_string("responses", None, "write every sample, turn by turn, to this JSONL file")
distributed.define_flags()


def _eos_ids(tokenizer, config) -> tuple[int, ...]:
    ids = set()
    if tokenizer.eos_id is not None:
        ids.add(int(tokenizer.eos_id))
    eos = config.eos_token_id
    if eos is not None:
        ids.update(int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return tuple(sorted(ids))


def main(argv: list[str]) -> None:
    del argv
    f = flags.FLAGS
    topo = distributed.initialize_from_flags()
    spec = f.mesh or ("data=-1" if topo.num_processes > 1 else None)
    if spec:
        distributed.check_mesh_fits(spec, "--mesh", topo)
    import numpy as np

    import hfjax.models as M
    from hfjax.engine import generate
    from hfjax.models.smollm2 import smollm2_gguf_path
    from hfjax.parallel.mesh import MeshSpec, sorted_devices
    from hfjax.parallel.transfer import to_host

    say = print if topo.process_id == 0 else (lambda *a, **k: None)
    path = str(f.model or smollm2_gguf_path())
    mesh = MeshSpec.parse(spec).build(sorted_devices()) if spec else None
    # Loaded straight into the decode layout of the mesh: no device holds more than its shard.
    model = M.load(path, dtype=f.dtype, mesh=mesh, rules="decode", max_layers=f.max_layers)
    tokenizer = M.load_tokenizer(path)

    if f.responses is not None:
        folder = os.path.dirname(os.path.abspath(f.responses))
        if not os.path.isdir(folder):
            raise cli.UserError(f"--responses={f.responses}: folder {folder} does not exist; "
                                "create it or pick another path")
    tools = None
    if f.tools is not None:
        from hfjax.tools import resolve_tools

        tools = resolve_tools(f.tools)
    if f.chat:
        extra = {"tools": [t.schema() for t in tools.values()]} if tools else {}
        rows = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                **extra)
            for p in f.prompt
        ]
    else:
        rows = tokenizer.batch_encode(f.prompt)
    width = max(len(r) for r in rows)
    limit = model.config.max_position_embeddings
    if width + f.max_new_tokens > limit:
        raise ValueError(f"the longest prompt has {width} tokens; with --max_new_tokens="
                         f"{f.max_new_tokens} that is {width + f.max_new_tokens} positions, more "
                         f"than the model's max_position_embeddings={limit}: lower "
                         "--max_new_tokens or shorten the prompt")
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    ids = np.full((len(rows), width), pad, np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):  # left padding, as the sampler expects
        ids[i, width - len(r) :] = r
        mask[i, width - len(r) :] = 1

    if tools is not None:
        _generate_turns(f, model, tokenizer, tools, ids, mask, mesh, pad, say)
        return
    start = time.perf_counter()
    out = generate(
        model,
        ids,
        mask,
        max_new_tokens=f.max_new_tokens,
        temperature=f.temperature,
        top_k=f.top_k,
        top_p=f.top_p,
        min_p=f.min_p,
        n=f.n,
        eos_ids=_eos_ids(tokenizer, model.config),
        seed=f.seed,
        mesh=mesh,
        pad_id=pad,
    )
    tokens, resp_mask = to_host(out.tokens), to_host(out.mask)
    seconds = time.perf_counter() - start

    records = []
    for r in range(tokens.shape[0]):
        prompt_idx, sample = divmod(r, f.n)
        text = tokenizer.decode(tokens[r][resp_mask[r] == 1], skip_special_tokens=True)
        if len(f.prompt) > 1 or f.n > 1:
            say(f"--- prompt {prompt_idx} sample {sample}: {f.prompt[prompt_idx]!r}")
        say(text)
        records.append({"prompt": prompt_idx, "sample": sample, "prompt_text":
                        f.prompt[prompt_idx], "turns": [{"role": "assistant", "text": text}]})
    _write(f.responses, records)
    say(
        f"[{int(resp_mask.sum())} tokens in {seconds:.1f}s, compile included]",
        flush=True,
    )


def _write(path: str | None, records: list[dict]) -> None:
    """One JSON line per record (process 0 only), written whole and then renamed."""
    if path is None or not distributed.is_main_process():
        return
    with open(path + ".tmp", "w") as out:
        for rec in records:
            out.write(json.dumps(rec, ensure_ascii=False) + "\n")
    os.replace(path + ".tmp", path)


def _generate_turns(f, model, tokenizer, tools, ids, mask, mesh, pad, say) -> None:
    """Multi-turn trajectories with `tools` (`hfjax.agents`), printed turn by
    turn."""
    from flax import nnx

    from configs.ppo_arith import get_config
    from hfjax.agents import AgentLoop
    from hfjax.engine.sampler import Sampler, SamplingParams
    from hfjax.engine.spec import MultiTurnSpec
    from hfjax.tools import ToolRunner

    sampler = Sampler(model, mesh=mesh, max_prompt_len=ids.shape[1], pad_id=pad)
    params = SamplingParams(max_new_tokens=f.max_new_tokens, temperature=f.temperature,
                            top_k=f.top_k, top_p=f.top_p, min_p=f.min_p, n=f.n,
                            eos_ids=_eos_ids(tokenizer, model.config))
    start = time.perf_counter()
    with ToolRunner(tools) as runner:
        # The base config's multi-turn settings, with this command's turns and tools.
        spec = dataclasses.replace(MultiTurnSpec.of(get_config().rollout.multi_turn),
                                   enable=True, max_turns=f.max_turns, tools=f.tools)
        loop = AgentLoop(sampler, tokenizer, runner, spec)
        out = loop.run(nnx.state(model), ids, mask, params, seed=f.seed)
    seconds = time.perf_counter() - start
    records = []
    for r, traj in enumerate(out.trajectories):
        prompt_idx, sample = divmod(r, f.n)
        say(f"--- prompt {prompt_idx} sample {sample}: {f.prompt[prompt_idx]!r}")
        for turn in traj.turns:
            if turn["role"] == "assistant":
                say(f"[assistant] {turn['text']}")
            else:
                for res in turn["results"]:
                    say(f"[tool{' error' if res['error'] else ''}] {res['text']}")
        say(f"[stop: {traj.stop}]")
        records.append({"prompt": prompt_idx, "sample": sample,
                        "prompt_text": f.prompt[prompt_idx], **traj.to_dict()})
    _write(f.responses, records)
    say(f"[{int(out.gen_mask.sum())} generated and {int((out.attn_mask - out.gen_mask).sum())} "
        f"tool tokens in {seconds:.1f}s over {loop.turn_calls} turn programs, compile "
        "included]", flush=True)


if __name__ == "__main__":
    cli.run(main, "generate", compilation_cache=True)
