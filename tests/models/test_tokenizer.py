"""Tokenizer parity with transformers on the real SmolLM2 GGUF: ids, decoding, chat templates,
and directories written by `Tokenizer.save` or by transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from tokenizers import pre_tokenizers

from hfjax.models import tokenizer as tok_lib
from hfjax.models.smollm2 import smollm2_gguf_path
from hfjax.models.tokenizer import Tokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!",
    "",
    " leading space and trailing space ",
    "multiple   spaces\tand\ttabs",
    "line one\nline two\n\n\nline five\r\nwindows",
    "Numbers: 0 7 42 1234567890 3.14159 -12e-3 1,000,000",
    "Unicode: café naïve résumé — “quotes” … ß ø",
    "日本語のテキストと中文文本，한국어 텍스트",
    "Emoji 🤗🚀👩‍👩‍👧 and flags 🇫🇷",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }  // C\n\t\t}",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<|im_end|>",
    "<|im_start|><|im_start|> nested <|im_end|>",
    "contractions: don't, it's, we'll, they're, I'd, you've",
    "ALL CAPS AND MixedCase AND snake_case AND camelCase",
    "URL https://huggingface.co/HuggingFaceTB/SmolLM2-135M?x=1&y=2 email a.b@c.org",
    "   \n   \n",
    "Math: ∑_{i=1}^{n} i² = n(n+1)/2, ∫ e^x dx, α β γ",
    "<filename>main.py<jupyter_code>import numpy as np",
]

CONVERSATIONS = [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    [{"role": "user", "content": "Hi there! 👋\nTwo lines."}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "How are you?"},
    ],
]


@pytest.fixture(scope="module")
def gguf_path():
    return smollm2_gguf_path()


@pytest.fixture(scope="module")
def ours(gguf_path):
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf(gguf_path):
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def _hf_chat(hf_tok, conversation, add_generation_prompt, tokenize):
    return hf_tok.apply_chat_template(
        conversation,
        add_generation_prompt=add_generation_prompt,
        tokenize=tokenize,
        return_dict=False,
    )


def test_special_tokens_and_sizes_match(ours, hf):
    assert ours.vocab_size == len(hf) == 49152
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (
        hf.bos_token_id,
        hf.eos_token_id,
        hf.pad_token_id,
    )
    assert (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert ours.chat_template == hf.chat_template


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(ours, hf, add_special_tokens):
    for text in TEXTS:
        expected = hf.encode(text, add_special_tokens=add_special_tokens)
        assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, text
    assert ours.batch_encode(TEXTS, add_special_tokens=add_special_tokens) == [
        hf.encode(t, add_special_tokens=add_special_tokens) for t in TEXTS
    ]


def test_special_tokens_stay_whole(ours):
    ids = ours.encode("a<|im_start|>b<|im_end|>")
    assert ours.bos_id in ids and ours.eos_id in ids
    assert ours.encode("<|im_start|>") == [ours.bos_id]


def test_decode_round_trip_and_matches_transformers(ours, hf):
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(
            ids, skip_special_tokens=False
        )
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
    assert ours.decode(np.array(ours.encode("numpy ids"))) == "numpy ids"
    assert ours.decode(ours.encode("x<|im_end|>y")) == "xy"


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, hf, add_generation_prompt):
    for conversation in CONVERSATIONS:
        text = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
        assert text == _hf_chat(hf, conversation, add_generation_prompt, tokenize=False)
        ids = ours.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        assert ids == _hf_chat(hf, conversation, add_generation_prompt, tokenize=True)
    rendered = ours.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert "named SmolLM" in rendered  # the template's default system prompt


def test_chat_template_raise_exception_helper(ours):
    ours_custom = Tokenizer(
        ours.backend,
        bos_token=ours.bos_token,
        eos_token=ours.eos_token,
        chat_template="{% if messages|length == 0 %}{{ raise_exception('empty chat') }}{% endif %}"
        "{{ messages | tojson }}",
    )
    with pytest.raises(Exception, match="empty chat"):
        ours_custom.apply_chat_template([])
    # tojson writes plain JSON, without jinja2's HTML escaping.
    assert ours_custom.apply_chat_template([{"role": "user", "content": "<b>&'"}]) == json.dumps(
        [{"role": "user", "content": "<b>&'"}], ensure_ascii=False
    )


def test_save_loads_in_transformers_and_back(ours, hf, tmp_path):
    ours.save(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} >= {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
    reloaded_hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    reloaded = Tokenizer.from_dir(tmp_path)
    for text in TEXTS:
        expected = hf.encode(text)
        assert reloaded_hf.encode(text) == expected, text
        assert reloaded.encode(text) == expected, text
    assert (reloaded_hf.bos_token_id, reloaded_hf.eos_token_id, reloaded_hf.pad_token_id) == (
        1,
        2,
        2,
    )
    conversation = CONVERSATIONS[0]
    assert _hf_chat(reloaded_hf, conversation, True, tokenize=True) == _hf_chat(
        hf, conversation, True, tokenize=True
    )
    assert reloaded.apply_chat_template(conversation) == ours.apply_chat_template(conversation)
    assert (reloaded.bos_id, reloaded.eos_id, reloaded.pad_id) == (1, 2, 2)


def test_from_dir_reads_transformers_save(ours, hf, tmp_path):
    # transformers 5 writes the template to chat_template.jinja rather than the config.
    hf.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode(TEXTS[11]) == ours.encode(TEXTS[11])
    assert loaded.apply_chat_template(CONVERSATIONS[2]) == ours.apply_chat_template(
        CONVERSATIONS[2]
    )
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (1, 2, 2)


def test_pad_falls_back_to_eos(ours):
    no_pad = Tokenizer(ours.backend, bos_token="<|im_start|>", eos_token="<|endoftext|>")
    assert no_pad.pad_id == no_pad.eos_id == 0


def test_load_tokenizer_dispatch_and_errors(gguf_path, tmp_path):
    assert load_tokenizer(gguf_path).eos_id == 2
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="pass a .gguf file"):
        load_tokenizer(tmp_path / "weights.bin")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")


# ----------------------------------------------------------------------------------------------
# GGUF variants: the SmolLM2 vocabulary rewritten with other tokenizer metadata


def _copy_tokenizer_gguf(src, dst, overrides):
    """Write a tensor-less GGUF holding `src`'s metadata with `overrides` (key -> value)."""
    reader = GGUFReader(src)
    writer = GGUFWriter(str(dst), "llama")
    skip = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"}
    for key, field in reader.fields.items():
        if key in skip or key in overrides:
            continue
        main = field.types[0]
        if main == GGUFValueType.ARRAY:
            item = field.types[-1]
            if item == GGUFValueType.STRING:
                values = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            else:
                values = [field.parts[i][0].item() for i in field.data]
            writer.add_key_value(key, values, main, sub_type=item)
        elif main == GGUFValueType.STRING:
            writer.add_key_value(key, bytes(field.parts[field.data[0]]).decode("utf-8"), main)
        else:
            writer.add_key_value(key, field.parts[field.data[0]][0].item(), main)
    for key, (value, value_type) in overrides.items():
        writer.add_key_value(key, value, value_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.mark.parametrize(
    "overrides",
    [
        {
            "tokenizer.ggml.add_bos_token": (True, GGUFValueType.BOOL),
            "tokenizer.ggml.pre": ("llama-bpe", GGUFValueType.STRING),
        },
        {"tokenizer.ggml.pre": ("qwen2", GGUFValueType.STRING)},
    ],
    ids=["add_bos+llama-bpe", "qwen2"],
)
def test_gguf_metadata_variants_match_transformers(gguf_path, tmp_path, overrides):
    path = _copy_tokenizer_gguf(gguf_path, tmp_path / "variant.gguf", overrides)
    ours = Tokenizer.from_gguf(path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text), text
    if "tokenizer.ggml.add_bos_token" in overrides:
        assert ours.encode("hi")[0] == ours.bos_id
        assert ours.encode("hi", add_special_tokens=False)[0] != ours.bos_id


def test_non_bpe_gguf_tokenizer_is_refused(tmp_path):
    path = tmp_path / "spm.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", "\u2581a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"tokenizer model 'llama'.*\['gpt2'\]"):
        Tokenizer.from_gguf(path)


def test_byte_alphabet_is_gpt2s():
    table = tok_lib._byte_to_char()
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[ord("A")] == "A"
    # tokenizers' own ByteLevel alphabet is the same 256 characters.
    assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert len(set(table.values())) == 256
