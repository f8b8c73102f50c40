"""Text <-> token ids, and chat templates, on top of HF `tokenizers`.

`Tokenizer` wraps a `tokenizers.Tokenizer` together with what `tokenizers` does not know about:
which tokens are BOS/EOS/PAD and the chat template. It is built either from an HF model
directory (`tokenizer.json` + `tokenizer_config.json`) or from a GGUF file's tokenizer metadata,
and can be saved back as an HF directory that `transformers.AutoTokenizer` loads.

Chat templates are rendered with jinja2 in a sandbox, with the same environment settings and
helpers HF templates expect (`trim_blocks`, `lstrip_blocks`, `raise_exception`, `tojson`), so the
rendered text matches `transformers`' `apply_chat_template` character for character.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from absl import logging
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from hfjax.models import gguf_io

# GGUF `tokenizer.ggml.token_type` codes (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Split patterns for GGUF `tokenizer.ggml.pre` values whose vocabulary was trained on something
# other than GPT-2's pre-tokenization. Any value not listed gets GPT-2's byte-level regex, which
# is also what transformers builds for such files (SmolLM2's "smollm" among them), so ids agree.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}

SUPPORTED_GGUF_TOKENIZER_MODELS: tuple[str, ...] = ("gpt2",)


@functools.cache
def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE."""
    # Bytes that are already printable, non-space Latin-1 stand for themselves; the remaining 68
    # are moved, in byte order, onto code points from 256 up so no token contains whitespace or
    # control characters.
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def _token_text(token: Any) -> str | None:
    """The text of a special token as tokenizer_config.json spells it: a str or AddedToken dict."""
    if token is None or isinstance(token, str):
        return token
    if isinstance(token, dict) and "content" in token:
        return token["content"]
    raise ValueError(
        f"cannot read special token {token!r}: expected a string or {{'content': ...}}"
    )


def _raise_template_error(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson HTML-escapes quotes and angle brackets, which would corrupt tool
    # schemas inside a prompt; templates written for HF expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    # Templates are untrusted input from model repos, hence the immutable sandbox.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus special-token roles and a chat template.

    Build one with `from_dir`, `from_gguf` or `load_tokenizer`; the constructor takes an already
    configured backend (its post-processor decides what `add_special_tokens=True` adds).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        chat_template: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.unk_token = unk_token
        # Batched RL rollouts need some pad id; a model with none pads with EOS, which is masked
        # out anyway, the convention HF generation also falls back to.
        self.pad_token = pad_token if pad_token is not None else eos_token
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        for role, token in (
            ("bos", self.bos_token),
            ("eos", self.eos_token),
            ("pad", self.pad_token),
            ("unk", self.unk_token),
        ):
            if token is not None and backend.token_to_id(token) is None:
                raise ValueError(f"{role} token {token!r} is not in the tokenizer's vocabulary")

    # -- constructors --------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load an HF tokenizer directory; returns a Tokenizer.

        Reads `tokenizer.json` (required), special tokens from `tokenizer_config.json` and then
        `special_tokens_map.json`, and the chat template from `chat_template.jinja` or
        `tokenizer_config.json`.
        """
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {str(path)!r}; hfjax needs a fast (tokenizers) tokenizer "
                "file. Re-save it with transformers' AutoTokenizer(...).save_pretrained()"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as err:  # noqa: BLE001  (the tokenizers library raises plain Exception)
            raise ValueError(f"{tokenizer_file} is damaged or not a tokenizers file ({err}); "
                             "copy it again or re-save the tokenizer") from None
        config = _read_json(path / "tokenizer_config.json")
        special_map = _read_json(path / "special_tokens_map.json")

        def special(name: str) -> str | None:
            if config.get(name) is not None:
                return _token_text(config[name])
            return _token_text(special_map.get(name))

        template = config.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        elif isinstance(template, list):
            # Multi-template configs: [{"name": ..., "template": ...}]; "default" is the chat one.
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        return cls(
            backend,
            bos_token=special("bos_token"),
            eos_token=special("eos_token"),
            pad_token=special("pad_token"),
            unk_token=special("unk_token"),
            chat_template=template,
            add_bos_token=bool(config.get("add_bos_token", False)),
            add_eos_token=bool(config.get("add_eos_token", False)),
        )

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Build the tokenizer a GGUF file describes in its metadata; returns a Tokenizer.

        Supports byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`). Raises
        ValueError for other tokenizer models.
        """
        reader = gguf_io.open_gguf(path)

        def field(key: str, default: Any = None) -> Any:
            return gguf_io.read_gguf_field(reader, f"tokenizer.{key}", default)

        kind = field("ggml.model")
        if kind not in SUPPORTED_GGUF_TOKENIZER_MODELS:
            raise ValueError(
                f"GGUF file {str(path)!r} has tokenizer model {kind!r}; hfjax builds only "
                f"{list(SUPPORTED_GGUF_TOKENIZER_MODELS)} (byte-level BPE) tokenizers from GGUF. "
                "Use the HF tokenizer directory instead."
            )
        tokens: list[str] = field("ggml.tokens")
        merges: list[str] | None = field("ggml.merges")
        if not tokens or not merges:
            raise ValueError(f"GGUF file {str(path)!r} lacks tokenizer.ggml.tokens or .merges")
        token_types: list[int] = field("ggml.token_type") or [1] * len(tokens)

        alphabet = set(_byte_to_char().values())
        byte_to_char = _byte_to_char()
        vocab: dict[str, int] = {}
        for index, token in enumerate(tokens):
            # A token written in raw text rather than the byte alphabet (a few converters do this)
            # is respelled so BPE can reach it.
            if not set(token) <= alphabet:
                token = "".join(byte_to_char[b] for b in token.encode("utf-8"))
            vocab.setdefault(token, index)
        if len(vocab) != len(tokens):
            logging.warning(
                "GGUF vocabulary spells %d tokens the same as an earlier one; the later ids are "
                "unreachable when encoding",
                len(tokens) - len(vocab),
            )
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        backend = tokenizers.Tokenizer(
            models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
        )
        pre = field("ggml.pre")
        split = _PRE_TOKENIZER_SPLITS.get(pre)
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(
                add_prefix_space=False, trim_offsets=True, use_regex=True
            )
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        backend.decoder = decoders.ByteLevel()

        # Control tokens (<|im_start|>, <|endoftext|>) must match whole before BPE splits them.
        # One spelled outside the byte alphabet cannot be a real byte-level token, so it is a
        # mislabel, and adding it would grow the vocabulary past the embedding matrix.
        control = [
            AddedToken(t, special=True, normalized=False)
            for t, kind_ in zip(tokens, token_types)
            if kind_ == _TOKEN_TYPE_CONTROL and set(t) <= alphabet
        ]
        user = [
            AddedToken(t, special=False, normalized=False)
            for t, kind_ in zip(tokens, token_types)
            if kind_ == _TOKEN_TYPE_USER_DEFINED and t in vocab
        ]
        backend.add_special_tokens(control)
        backend.add_tokens(user)

        def token_at(key: str) -> str | None:
            index = field(key)
            return tokens[index] if index is not None and 0 <= index < len(tokens) else None

        bos, eos = token_at("ggml.bos_token_id"), token_at("ggml.eos_token_id")
        add_bos = bool(field("ggml.add_bos_token", False))
        add_eos = bool(field("ggml.add_eos_token", False))
        _set_post_processor(backend, bos if add_bos else None, eos if add_eos else None)
        logging.info(
            "GGUF tokenizer: %d tokens, %d merges, pre=%r, %d control tokens",
            len(tokens),
            len(merges),
            pre,
            len(control),
        )
        return cls(
            backend,
            bos_token=bos,
            eos_token=eos,
            pad_token=token_at("ggml.padding_token_id"),
            unk_token=token_at("ggml.unknown_token_id"),
            chat_template=field("chat_template"),
            add_bos_token=add_bos,
            add_eos_token=add_eos,
        )

    # -- encoding ------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`. Special tokens written in the text are always recognised;
        `add_special_tokens` controls only whether BOS/EOS are added around it."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def batch_encode(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """Token ids for each text, unpadded; returns one list per input."""
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text for token ids, dropping special tokens unless `skip_special_tokens=False`."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # -- special tokens ------------------------------------------------------------------------

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        """Id of the beginning-of-sequence token, or None when the model has none."""
        return self._id(self.bos_token)

    @property
    def eos_id(self) -> int | None:
        """Id of the end-of-sequence token, or None when the model has none."""
        return self._id(self.eos_token)

    @property
    def pad_id(self) -> int | None:
        """Id of the padding token; the EOS id when the model defines no pad token."""
        return self._id(self.pad_token)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    # -- chat ----------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render a conversation with the model's chat template.

        Returns the prompt text, or its token ids when `tokenize=True` (encoded without adding
        BOS/EOS, since the template writes whatever special tokens it wants). Extra keyword
        arguments (e.g. `tools`) are passed to the template.
        """
        if not self.chat_template:
            raise ValueError(
                "this tokenizer has no chat template; set Tokenizer.chat_template or load one "
                "whose tokenizer_config.json or GGUF metadata carries it"
            )
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "",
            "unk_token": self.unk_token or "",
            **template_kwargs,
        }
        text = _compile_template(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **context
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # -- saving --------------------------------------------------------------------------------

    def save(self, out_dir: str | os.PathLike[str]) -> None:
        """Write `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json` to
        `out_dir` (created if needed), a directory `transformers.AutoTokenizer` can load."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(out / "tokenizer.json"))
        special = {
            name: token
            for name, token in (
                ("bos_token", self.bos_token),
                ("eos_token", self.eos_token),
                ("pad_token", self.pad_token),
                ("unk_token", self.unk_token),
            )
            if token is not None
        }
        config: dict[str, Any] = {
            # The generic fast-tokenizer class: it takes everything from tokenizer.json.
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
            "clean_up_tokenization_spaces": False,
            **special,
        }
        if self.chat_template:
            config["chat_template"] = self.chat_template
        _write_json(out / "tokenizer_config.json", config)
        _write_json(out / "special_tokens_map.json", special)


def _set_post_processor(backend: tokenizers.Tokenizer, bos: str | None, eos: str | None) -> None:
    """Make `add_special_tokens=True` add `bos` before and/or `eos` after each sequence."""
    if bos is None and eos is None:
        return
    single = ([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else [])
    pair = single + ([f"{bos}:1"] if bos else []) + ["$B:1"] + ([f"{eos}:1"] if eos else [])
    specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=specials
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON ({err}); copy it again") from None


def _write_json(path: Path, value: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, ensure_ascii=False)
        f.write("\n")


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Load a tokenizer from a `.gguf` file or an HF directory; returns a Tokenizer.

    A directory without `tokenizer.json` but with exactly one `.gguf` file uses that file.
    """
    if str(path).startswith("preset:"):
        raise ValueError(
            f"model path {str(path)!r} is an architecture with random weights and no tokenizer; "
            "take the tokenizer from an HF directory or .gguf file, or from the task")
    path = Path(path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(
                f"cannot load a tokenizer from file {str(path)!r}: pass a .gguf file or an HF "
                "tokenizer directory"
            )
        return Tokenizer.from_gguf(path)
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return Tokenizer.from_gguf(ggufs[0])
        return Tokenizer.from_dir(path)
    raise FileNotFoundError(f"tokenizer path {str(path)!r} does not exist")
