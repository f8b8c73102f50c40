"""A character-level tokenizer over printable ASCII, so a prompt's length in tokens is its
length in characters (plus the template's tokens), which makes length filtering easy to test."""

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from hfjax.models.tokenizer import Tokenizer

SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def char_tokenizer(chat_template: str | None = None) -> Tokenizer:
    chars = [chr(i) for i in range(32, 127)] + ["\n", "£"]
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIALS)
    return Tokenizer(backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                     chat_template=chat_template)


@pytest.fixture
def tok():
    return char_tokenizer()


@pytest.fixture
def chat_tok():
    return char_tokenizer(TEMPLATE)
