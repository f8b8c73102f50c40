"""SFT examples (prompt/response pairs and multi-turn conversations, loss on the assistant's
tokens only) and preference pairs from parquet: layouts, skips and the errors that name the
file, row and field."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hfjax.data import arith, preferences
from hfjax.data import sft as sft_data
from hfjax.data.batching import sft_arrays

# A ChatML-like template over the arithmetic tokenizer's characters: "=" opens a turn,
# "#" closes it, so every rendered conversation is a prefix of the next.
TEMPLATE = ("{% for m in messages %}{{ '=' if m['role'] == 'user' else '+' }}{{ m['content'] }}"
            "#{% endfor %}{% if add_generation_prompt %}+{% endif %}")


@pytest.fixture
def tok():
    return arith.tokenizer()


@pytest.fixture
def chat_tok():
    t = arith.tokenizer()
    t.chat_template = TEMPLATE
    return t


def write(path, columns):
    pq.write_table(pa.table(columns), str(path))
    return str(path)


def test_pairs_from_texts_learn_the_response_and_eos(tok):
    data = sft_data.from_texts(tok, [("12+3=", "#### 15"), ("9-1=", "8")])
    ex = data.examples[0]
    assert tok.decode(ex.prompt_ids) == "12+3="
    assert ex.response_ids[-1] == tok.eos_id and tok.decode(ex.response_ids) == "#### 15"
    assert ex.loss_mask == (1,) * len(ex.response_ids)


def test_parquet_prompt_response_with_and_without_a_chat_template(tmp_path, tok, chat_tok):
    path = write(tmp_path / "sft.parquet", {
        "prompt": ["1+2=", "3+4="], "response": ["3", "7"]})
    plain = sft_data.load_parquet(path, tok, max_prompt_length=8, max_response_length=4)
    assert tok.decode(plain.examples[0].prompt_ids) == "1+2="
    chat = sft_data.load_parquet(path, chat_tok, max_prompt_length=16, max_response_length=4)
    # The template wraps the prompt as a user turn and ends with the generation prompt.
    assert chat_tok.decode(chat.examples[1].prompt_ids) == "=3+4=#+"
    assert chat_tok.decode(chat.examples[1].response_ids) == "7"


def test_multi_turn_conversation_learns_only_the_assistant_turns(tmp_path, chat_tok):
    convo = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
             {"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]
    path = write(tmp_path / "multi.parquet", {"messages": [convo]})
    ex = sft_data.load_parquet(path, chat_tok, max_prompt_length=16,
                               max_response_length=32).examples[0]
    assert chat_tok.decode(ex.prompt_ids) == "=1+1=#+"
    learned = [t for t, m in zip(ex.response_ids, ex.loss_mask) if m]
    ignored = [t for t, m in zip(ex.response_ids, ex.loss_mask) if not m]
    # Each assistant turn with its closing "#"; the user turn and the "+" header are context.
    assert chat_tok.decode(learned) == "2#4#"
    assert chat_tok.decode(ignored) == "=2+2=#+"
    # Laid out for training: the response mask is the loss mask, attention sees every token.
    batch = sft_arrays([list(ex.prompt_ids)], [list(ex.response_ids)], prompt_width=8,
                       response_width=12, pad_id=chat_tok.pad_id, loss_masks=[list(ex.loss_mask)])
    n = len(ex.response_ids)
    np.testing.assert_array_equal(batch["response_mask"][0, :n], ex.loss_mask)
    attended = batch["attention_mask"][0, 8:]
    assert attended[:n].all() and not attended[n:].any()


def test_sft_bad_input(tmp_path, tok, chat_tok):
    path = write(tmp_path / "bad.parquet", {"question": ["1+1="], "answer": ["2"]})
    with pytest.raises(ValueError, match=r"needs columns 'prompt' and 'response', or 'messages'"):
        sft_data.load_parquet(path, tok, max_prompt_length=8, max_response_length=4)
    path = write(tmp_path / "multi.parquet", {"messages": [[{"role": "user", "content": "1"}]]})
    with pytest.raises(ValueError, match=r"needs a tokenizer with a chat template"):
        sft_data.load_parquet(path, tok, max_prompt_length=8, max_response_length=4)
    with pytest.raises(ValueError, match=r"row 0: a conversation needs a user turn before"):
        sft_data.load_parquet(path, chat_tok, max_prompt_length=8, max_response_length=4)
    path = write(tmp_path / "long.parquet", {"prompt": ["1+1=", "12345678+1="],
                                            "response": ["2", "12345679"]})
    data = sft_data.load_parquet(path, tok, max_prompt_length=8, max_response_length=4)
    assert len(data.examples) == 1
    assert data.skipped == {"prompt longer than data.max_prompt_length": 1}


def test_preference_pairs_and_the_cost_target(tmp_path, tok):
    path = write(tmp_path / "prefs.parquet", {
        "prompt": ["1+6=", "2+2="], "chosen": ["#### 7", "#### 4"],
        "rejected": ["7", "#### 5"],
        "chosen_unsafe": [True, False], "rejected_unsafe": [True, False]})
    data = preferences.load_parquet(path, tok, max_prompt_length=8, max_response_length=8)
    assert data.labelled and len(data.pairs) == 2
    reward = data.arrays(prompt_width=8, response_width=8, pad_id=tok.pad_id)
    cost = data.arrays(prompt_width=8, response_width=8, pad_id=tok.pad_id, target="cost")
    # For a cost model the rejected side is the one to score higher: the sides swap.
    np.testing.assert_array_equal(cost["chosen_ids"], reward["rejected_ids"])
    np.testing.assert_array_equal(cost["rejected_mask"], reward["chosen_mask"])
    np.testing.assert_array_equal(reward["chosen_sign"], [1.0, -1.0])
    ids, mask = reward["chosen_ids"][0], reward["chosen_mask"][0]
    assert tok.decode(ids[mask > 0]) == "1+6=#### 7"  # prompt left-padded, response + EOS
    assert ids[8 + 6] == tok.eos_id


@pytest.mark.parametrize("columns, message", [
    ({"prompt": ["1+1="], "chosen": ["2"]}, r"missing column\(s\) rejected; preference data"),
    ({"prompt": ["1+1="], "rejected": ["3"]}, r"missing column\(s\) chosen"),
    ({"prompt": ["1+1="], "chosen": [None], "rejected": ["3"]}, r"row 0: missing field chosen"),
    ({"prompt": ["1+1="], "chosen": ["2"], "rejected": [[{"role": "user", "content": "x"}]]},
     r"row 0: field rejected is a conversation whose last message is not an assistant turn"),
])
def test_preference_data_missing_chosen_or_rejected(tmp_path, tok, columns, message):
    path = write(tmp_path / "bad.parquet", columns)
    with pytest.raises(ValueError, match=message):
        preferences.load_parquet(path, tok, max_prompt_length=8, max_response_length=8)


def test_arith_preference_rows():
    rows = arith.problems(200, seed=0, max_b=9)
    good = arith.preference_rows(rows, seed=1, kind="correctness", pairs_per_prompt=2)
    assert len(good) == 400
    for row, pair in zip(np.repeat(rows, 2), good):
        assert pair["chosen"] == f"#### {row['reward_model']['ground_truth']}"
        assert pair["rejected"] != pair["chosen"]
    cost = arith.preference_rows(rows, seed=1, kind="forbidden_digit")
    for pair in cost:
        assert arith.forbidden_digit_cost(pair["rejected"]) == 1.0 and pair["rejected_unsafe"]
        assert arith.forbidden_digit_cost(pair["chosen"]) == 0.0 and not pair["chosen_unsafe"]
    with pytest.raises(ValueError, match="unknown preference kind"):
        arith.preference_rows(rows, seed=1, kind="helpfulness")


def test_arith_scratchpad_runs_long_and_ends_with_the_answer():
    """A scratchpad of n lines is 14 n characters (tokens of the arith tokenizer): a
    countdown from n - 1 to 0, each line restating the problem and its result; the
    demonstration's answer follows it; a countdown past three digits is refused."""
    rows = arith.problems(40, seed=3)
    pairs = arith.sft_texts(rows, 0.0, seed=0, corruption="none", scratchpad_lines=147)
    tok = arith.tokenizer()
    for row, (prompt, response) in zip(rows, pairs):
        x, answer = row["extra_info"], int(row["reward_model"]["ground_truth"])
        pad, tail = response[: 147 * arith.SCRATCHPAD_LINE], response[147 * arith.SCRATCHPAD_LINE:]
        assert tail == f"#### {answer}" and prompt == f"{x['a']}{x['op']}{x['b']}="
        lines = [pad[i : i + arith.SCRATCHPAD_LINE]
                 for i in range(0, len(pad), arith.SCRATCHPAD_LINE)]
        assert [int(line[:3]) for line in lines] == list(range(146, -1, -1))
        for line in lines:
            lhs, rhs = line[4:].rstrip().split("=")
            assert int(lhs[:2]) == x["a"] and int(lhs[3:]) == x["b"] and lhs[2] == x["op"]
            assert int(rhs) == answer
        assert len(tok.encode(response, add_special_tokens=False)) == len(response) >= 2048
    with pytest.raises(ValueError, match="scratchpad_lines=1001"):
        arith.sft_texts(rows, 0.0, seed=0, scratchpad_lines=1001)
