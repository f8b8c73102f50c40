"""Reward models in HF's sequence-classification format: hfjax's ScoreModel against
transformers' LlamaForSequenceClassification / Qwen2ForSequenceClassification on a left-padded
batch and on a right-padded one whose content holds the pad id, load by architecture, save and
reload, and the checks that refuse a checkpoint without a score head."""

import json
import os

import numpy as np
import pytest
from hf_fixtures import hf_scores, left_padded_batch, make_hf_model, make_hf_score_model

import hfjax.models as M
from hfjax.models.hf_io import check_score_checkpoint, load_score

FAMILIES = ["llama", "qwen2"]
TOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def hf_score(request, tmp_path_factory):
    d = str(tmp_path_factory.mktemp(f"{request.param}_rm"))
    return request.param, make_hf_score_model(request.param, d), d


def test_scores_match_transformers_on_a_left_padded_batch(hf_score):
    kind, ref, path = hf_score
    ids, mask = left_padded_batch(ref.config.vocab_size, lengths=(9, 5, 12, 1, 7))
    want = hf_scores(ref, ids, mask)
    assert np.ptp(want) > 0.05  # rows score differently, so agreement is not vacuous
    model = M.load(path)  # the architecture says it is a score model
    assert isinstance(model, M.ScoreModel)
    got = np.asarray(model(ids, attention_mask=mask))
    assert got.shape == (len(ids),)
    diff = float(np.abs(got - want).max())
    print(f"{kind}: max |hfjax - transformers| score difference {diff:.2e}")
    assert diff <= TOL, (kind, diff)


def test_save_and_reload_in_transformers(hf_score, tmp_path):
    import torch
    import transformers as tf

    kind, ref, path = hf_score
    model = M.load(path)
    out = M.save_hf(model, str(tmp_path / "export"))
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["architectures"] == [f"{type(ref).__name__}"]
    again = tf.AutoModelForSequenceClassification.from_pretrained(
        out, torch_dtype=torch.float32).eval()
    assert type(again) is type(ref)
    ids, mask = left_padded_batch(ref.config.vocab_size, seed=4)
    np.testing.assert_allclose(np.asarray(model(ids, attention_mask=mask)),
                               hf_scores(again, ids, mask), atol=TOL, rtol=0)
    # And back into hfjax, through the reward-model loader that requires the head.
    back = load_score(out, what="reward_model.path")
    np.testing.assert_array_equal(np.asarray(back(ids, mask)), np.asarray(model(ids, mask)))


def test_right_padding_reads_the_last_real_token(hf_score):
    kind, ref, path = hf_score
    ids, mask = left_padded_batch(ref.config.vocab_size, lengths=(6, 3, 8))
    model = M.load(path)
    left = np.asarray(model(ids, mask))
    # The same rows right-padded: the score is read at each row's last token, whichever side
    # the padding is on.
    right_ids, right_mask = np.zeros_like(ids), np.zeros_like(mask)
    for b in range(len(ids)):
        n = int(mask[b].sum())
        right_ids[b, :n], right_mask[b, :n] = ids[b, -n:], 1
    np.testing.assert_allclose(np.asarray(model(right_ids, right_mask)), left, atol=1e-5)


def test_pooling_matches_transformers_when_content_holds_the_pad_id(hf_score):
    """A pad that doubles as EOS: transformers reads the rightmost token that is not the pad,
    so a row ending in it is read before it, and a pad inside the content is passed over."""
    kind, ref, path = hf_score
    pad = ref.config.pad_token_id
    ids, mask = left_padded_batch(ref.config.vocab_size, lengths=(6, 3, 8, 5), seed=7)
    T = ids.shape[1] + 2
    right_ids, right_mask = np.full((len(ids), T), pad, np.int32), np.zeros((len(ids), T), np.int32)
    for b in range(len(ids)):
        row = list(ids[b][mask[b] > 0])
        if b % 2 == 0:
            row.append(pad)  # ends in EOS == pad
        if b == 2:
            row[2] = pad  # the pad id inside the content too
        right_ids[b, :len(row)], right_mask[b, :len(row)] = row, 1
    want = hf_scores(ref, right_ids, right_mask)
    model = M.load(path)
    assert model.config.pad_token_id == pad  # from the HF config
    got = np.asarray(model(right_ids, right_mask))
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    # Not vacuous: on the rows that end in the pad, the last real token scores otherwise.
    per_token = np.asarray(model.token_scores(right_ids, right_mask))
    last_real = per_token[np.arange(len(ids)), right_mask.sum(1) - 1]
    ends_in_pad = np.arange(len(ids)) % 2 == 0
    assert (np.abs(last_real - want)[ends_in_pad] > 1e-3).all()
    np.testing.assert_allclose(last_real[~ends_in_pad], want[~ends_in_pad], atol=TOL, rtol=0)


def test_a_causal_lm_is_not_a_reward_model(tmp_path):
    d = str(tmp_path / "lm")
    make_hf_model("llama", d)
    with pytest.raises(ValueError, match=r"reward_model.path=.* has no score head .*"
                                         r"LlamaForCausalLM.*launch.train_rm"):
        check_score_checkpoint(d, "reward_model.path")
    with pytest.raises(ValueError, match="is not an HF model directory"):
        check_score_checkpoint(str(tmp_path / "missing"), "cost_model.path")
    # As the backbone of a reward model still to be trained, its head starts fresh.
    fresh = M.load(d, head="score")
    assert isinstance(fresh, M.ScoreModel)


def test_multi_label_classifier_is_refused(hf_score, tmp_path):
    import shutil

    _, _, path = hf_score
    d = str(tmp_path / "multi")
    shutil.copytree(path, d)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["id2label"] = {"0": "a", "1": "b"}
    cfg.pop("num_labels", None)
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ValueError, match="with 2 labels: hfjax's score head reads one scalar"):
        M.load(d)
