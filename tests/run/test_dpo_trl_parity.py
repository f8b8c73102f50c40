"""DPO's loss and metrics against TRL's `DPOTrainer` (the reference): on a tiny random HF Llama
policy and a reference with other weights, TRL's own dataset preparation, collator and
`evaluate()` score a handful of preference pairs; hfjax scores the same token ids with both
models loaded by `hfjax.models.load`, laid out as `DPOTrainer.arrays` lays them (prompt
left-padded, response right-padded), through `response_logprobs`, the registered loss and
`preference_metrics`. The loss and TRL's six metrics agree to float32 rounding.

TRL 1.16's `sigmoid` reads no label smoothing (it smooths only its robust, EXO and AOT losses),
so the comparison is at label_smoothing 0, hfjax's default."""

import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
import trl
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from hf_fixtures import make_hf_model  # noqa: E402

import hfjax.models as M  # noqa: E402
from hfjax.data.preferences import Pair, PreferenceData  # noqa: E402
from hfjax.numerics.preference import PREFERENCE_LOSSES, PreferenceInputs  # noqa: E402
from hfjax.run.dpo import SIDES, preference_metrics  # noqa: E402
from hfjax.workers.logprobs import response_logprobs  # noqa: E402

PAD, EOS, BETA = 0, 1, 1.0
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")


def word_tokenizer():
    """A transformers tokenizer whose words are "t2" ... "t127" (ids 2 ... 127), with pad 0 and
    eos 1: any id sequence is written as text that tokenizes back to exactly those ids."""
    vocab = {"<pad>": PAD, "<eos>": EOS} | {f"t{i}": i for i in range(2, 128)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                eos_token="<eos>")


def text(ids):
    return "".join(f" t{i}" for i in ids)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo_trl")
    policy = make_hf_model("llama", str(root / "policy"), seed=0)
    ref = make_hf_model("llama", str(root / "ref"), seed=1)
    rng = np.random.default_rng(0)
    rows = []
    for p, c, r in ((3, 2, 7), (6, 5, 1), (4, 6, 6), (5, 1, 3), (2, 4, 2)):
        prompt, chosen, rejected = (rng.integers(2, 128, n).tolist() for n in (p, c, r))
        rows.append({"prompt": text(prompt)[1:], "chosen": text(chosen),
                     "rejected": text(rejected)})
    return root, policy, ref, Dataset.from_list(rows)


def trl_metrics(setup, loss_type):
    """TRL's evaluate() on the pairs (one batch), and the token ids its preparation produced."""
    root, policy, ref, data = setup
    args = trl.DPOConfig(output_dir=str(root / f"trl_{loss_type}"), beta=BETA,
                         loss_type=[loss_type], per_device_eval_batch_size=len(data),
                         bf16=False, use_cpu=True, report_to="none", disable_tqdm=True)
    trainer = trl.DPOTrainer(policy, ref_model=ref, args=args, train_dataset=data,
                             eval_dataset=data, processing_class=word_tokenizer())
    out = trainer.evaluate()
    return out, trainer.eval_dataset


def hfjax_metrics(setup, prepared, loss_type):
    """hfjax's DPO loss and metrics of TRL's tokenized pairs, as `DPOTrainer._loss` computes
    them: summed response log-probs of each side under the policy and the reference."""
    root = setup[0]
    pairs = [Pair(tuple(r["prompt_ids"]), tuple(r["chosen_ids"]), tuple(r["rejected_ids"]))
             for r in prepared]
    width = (max(len(p.prompt_ids) for p in pairs),
             max(len(s) for p in pairs for s in (p.chosen_ids, p.rejected_ids)))
    batch = PreferenceData(pairs, "test").arrays(prompt_width=width[0], response_width=width[1],
                                                 pad_id=PAD)
    logps, tokens = {}, {}
    for name in ("policy", "ref"):
        model = M.load(str(root / name), dtype="float32")
        for side in SIDES:
            ids, mask = batch[f"{side}_ids"], batch[f"{side}_mask"]
            lp, _ = response_logprobs(model, jnp.asarray(ids), jnp.asarray(mask), width[1], 1.0)
            logps[name, side] = jnp.sum(lp * mask[:, width[0]:], axis=1)
            tokens[side] = jnp.asarray(np.sum(mask[:, width[0]:], axis=1), jnp.float32)
    losses, rc, rr = PREFERENCE_LOSSES.get(loss_type)(PreferenceInputs(
        logps["policy", "chosen"], logps["policy", "rejected"], logps["ref", "chosen"],
        logps["ref", "rejected"], tokens["chosen"], tokens["rejected"], beta=BETA))
    m = preference_metrics(losses, rc, rr, logps["policy", "chosen"],
                           logps["policy", "rejected"], float(len(pairs)))
    return {k: float(v) for k, v in m.items()}, tokens


@pytest.mark.slow  # 13-19 s alone (shared 2-core machine): two TRL trainers are built
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_loss_and_metrics_equal_trl(setup, loss_type):
    trl_out, prepared = trl_metrics(setup, loss_type)
    # TRL appended EOS to each response and split prompt from response where we wrote them.
    lengths = [(len(r["prompt_ids"]), len(r["chosen_ids"]), len(r["rejected_ids"]))
               for r in prepared]
    assert lengths == [(3, 3, 8), (6, 6, 2), (4, 7, 7), (5, 2, 4), (2, 5, 3)]
    assert all(r["chosen_ids"][-1] == EOS and r["rejected_ids"][-1] == EOS for r in prepared)
    ours, tokens = hfjax_metrics(setup, prepared, loss_type)
    np.testing.assert_array_equal(tokens["chosen"], [n[1] for n in lengths])
    assert abs(trl_out["eval_loss"] - ours["dpo/loss"]) < 1e-5
    # The policy is not its reference (the margins are not 0), and pairs fall on both sides.
    assert abs(ours["rewards/margins"]) > 0.1 and 0.0 < ours["rewards/accuracies"] < 1.0
    for key in METRICS:
        want = trl_out[f"eval_{key}"]
        assert ours[key] == pytest.approx(want, rel=1e-5, abs=1e-5), key
