"""DPO and its relatives against TRL (the reference): on a tiny random HF Llama policy and a
reference with other weights, TRL's own dataset preparation, collator and `evaluate()` score a
handful of preference pairs, `DPOTrainer` for `sigmoid` and `ipo`, the experimental
`CPOTrainer` (`cpo_alpha=0`) for `simpo`; hfjax scores the same token ids with both models
loaded by `hfjax.models.load`, laid out as `DPOTrainer.arrays` lays them (prompt left-padded,
response right-padded), through `response_logprobs`, the registered loss and
`preference_metrics`. The losses and TRL's metrics agree to float32 rounding.

TRL 1.16's DPO `sigmoid` reads no label smoothing (it smooths only its robust, EXO and AOT
losses), so DPO is compared at label_smoothing 0, hfjax's default; SimPO, whose smoothing TRL's
CPOTrainer applies as hfjax does, is compared with it. CPOTrainer's `logps/*` are per-token
means under SimPO, hfjax's are sums under every loss (DPOTrainer's), so only SimPO's loss and
`rewards/*` are compared."""

import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
import trl
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from trl.experimental.cpo import CPOConfig, CPOTrainer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from hf_fixtures import make_hf_model  # noqa: E402

import hfjax.models as M  # noqa: E402
from hfjax.data.preferences import Pair, PreferenceData  # noqa: E402
from hfjax.numerics.preference import PREFERENCE_LOSSES, PreferenceInputs  # noqa: E402
from hfjax.run.dpo import SIDES, preference_metrics  # noqa: E402
from hfjax.workers.logprobs import response_logprobs  # noqa: E402

PAD, EOS = 0, 1
LENGTHS = ((3, 2, 7), (6, 5, 1), (4, 6, 6), (5, 1, 3), (2, 4, 2))  # prompt, chosen, rejected
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
LOGPS = ("logps/chosen", "logps/rejected")
# loss -> (beta, label smoothing, SimPO's gamma)
SETTINGS = {"sigmoid": (1.0, 0.0, 0.0), "ipo": (1.0, 0.0, 0.0), "simpo": (2.5, 0.1, 0.5)}


def word_tokenizer():
    """A transformers tokenizer whose words are "t2" ... "t127" (ids 2 ... 127), with pad 0 and
    eos 1: any id sequence is written as text that tokenizes back to exactly those ids."""
    vocab = {"<pad>": PAD, "<eos>": EOS} | {f"t{i}": i for i in range(2, 128)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                eos_token="<eos>")


def text(ids):
    return " ".join(f"t{i}" for i in ids)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The two HF models' directory, the models, the pairs as text, and the token ids both
    sides score (TRL appends EOS to each response)."""
    root = tmp_path_factory.mktemp("dpo_trl")
    policy = make_hf_model("llama", str(root / "policy"), seed=0)
    ref = make_hf_model("llama", str(root / "ref"), seed=1)
    rng = np.random.default_rng(0)
    rows, pairs = [], []
    for lengths in LENGTHS:
        prompt, chosen, rejected = (rng.integers(2, 128, n).tolist() for n in lengths)
        rows.append({"prompt": text(prompt), "chosen": " " + text(chosen),
                     "rejected": " " + text(rejected)})
        pairs.append(Pair(tuple(prompt), tuple(chosen) + (EOS,), tuple(rejected) + (EOS,)))
    return root, policy, ref, Dataset.from_list(rows), pairs


@pytest.fixture(scope="module")
def hfjax_logps(setup):
    """Per model and side, hfjax's summed response log-probs [N] of the pairs, and each side's
    response token count, as `DPOTrainer._loss` computes them."""
    root, pairs = setup[0], setup[-1]
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
    return logps, tokens


def hfjax_metrics(hfjax_logps, loss_type):
    logps, tokens = hfjax_logps
    beta, eps, gamma = SETTINGS[loss_type]
    losses, rc, rr = PREFERENCE_LOSSES.get(loss_type)(PreferenceInputs(
        logps["policy", "chosen"], logps["policy", "rejected"], logps["ref", "chosen"],
        logps["ref", "rejected"], tokens["chosen"], tokens["rejected"], beta=beta,
        label_smoothing=eps, gamma=gamma))
    m = preference_metrics(losses, rc, rr, logps["policy", "chosen"],
                           logps["policy", "rejected"], float(len(LENGTHS)))
    return {k: float(v) for k, v in m.items()}


def trl_evaluate(setup, loss_type):
    """TRL's evaluate() of the pairs in one batch, and the token ids its preparation produced
    ([(prompt, chosen, rejected)])."""
    root, policy, ref, data, _ = setup
    beta, eps, gamma = SETTINGS[loss_type]
    common = dict(output_dir=str(root / f"trl_{loss_type}"), beta=beta,
                  per_device_eval_batch_size=len(data), bf16=False, use_cpu=True,
                  report_to="none", disable_tqdm=True)
    if loss_type == "simpo":
        args = CPOConfig(loss_type="simpo", cpo_alpha=0.0, simpo_gamma=gamma,
                         label_smoothing=eps, **common)
        trainer = CPOTrainer(policy, args=args, train_dataset=data, eval_dataset=data,
                             processing_class=word_tokenizer())
        ids = [(r["prompt_input_ids"], r["chosen_input_ids"][len(r["prompt_input_ids"]):],
                r["rejected_input_ids"][len(r["prompt_input_ids"]):])
               for r in trainer.eval_dataset]
    else:
        args = trl.DPOConfig(loss_type=[loss_type], label_smoothing=eps, **common)
        trainer = trl.DPOTrainer(policy, ref_model=ref, args=args, train_dataset=data,
                                 eval_dataset=data, processing_class=word_tokenizer())
        ids = [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"])
               for r in trainer.eval_dataset]
    return trainer.evaluate(), ids


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "simpo"])
def test_preference_loss_and_metrics_equal_trl(setup, hfjax_logps, loss_type):
    want, ids = trl_evaluate(setup, loss_type)
    # TRL scored exactly the token ids hfjax scores.
    assert ids == [(list(p.prompt_ids), list(p.chosen_ids), list(p.rejected_ids))
                   for p in setup[-1]]
    ours = hfjax_metrics(hfjax_logps, loss_type)
    assert abs(want["eval_loss"] - ours["dpo/loss"]) < 1e-5
    # Pairs fall on both sides, and a reference loss's policy is not its reference.
    assert 0.0 < ours["rewards/accuracies"] < 1.0
    assert loss_type == "simpo" or abs(ours["rewards/margins"]) > 0.1
    for key in REWARDS + (LOGPS if loss_type != "simpo" else ()):
        assert ours[key] == pytest.approx(want[f"eval_{key}"], rel=1e-5, abs=1e-5), key
