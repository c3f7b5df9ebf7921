"""Tokenization and chat templates, from Hugging Face transformers/tokenizers (built from a
GGUF file's metadata or from an HF model directory), plus what serving needs beside them: the
ids that end a generation and the bytes of single tokens (engine/text/detokenizer.py turns
sampled ids back into text)."""
from __future__ import annotations

import functools
import json
import mmap
import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from jinja2 import TemplateError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Files whose presence makes a directory an HF tokenizer directory.
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# GGUF keys of the tokens that end a generation: end of sequence, of turn, of message.
_GGUF_END_TOKEN_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                        "tokenizer.ggml.eom_token_id")
_SENTENCEPIECE_SPACE = "\u2581"
_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or used as asked."""


class ChatTemplateError(TokenizerError):
    """The model has no chat template, or its template rejected the messages."""


class Tokenizer:
    """A Hugging Face fast tokenizer plus what serving needs from it: the ids that end a
    generation, the chat template, and the display text of single tokens for logprobs."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, extra_eos_token_ids: Sequence[int] = ()) -> None:
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TokenizerError(f"{type(hf_tokenizer).__name__} is not a fast tokenizer (no tokenizer.json)")
        self._hf = hf_tokenizer
        self._backend = backend
        eos = [hf_tokenizer.eos_token_id] if hf_tokenizer.eos_token_id is not None else []
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(t) for t in [*eos, *extra_eos_token_ids]))
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.vocab_size: int = len(hf_tokenizer)  # base vocabulary plus added tokens
        self._byte_level = _is_byte_level(backend.decoder)
        self._added_token_ids = frozenset(hf_tokenizer.added_tokens_decoder)
        self._token_bytes: dict[int, bytes] = {}

    @classmethod
    def from_source(cls, path: str | Path) -> "Tokenizer":
        """Load from a `.gguf` file, an HF model directory, or a directory holding one `.gguf` file."""
        source = Path(path)
        if source.is_dir():
            if any((source / name).is_file() for name in _HF_TOKENIZER_FILES):
                return cls._from_hf_dir(source)
            ggufs = sorted(source.glob("*.gguf"))
            if len(ggufs) != 1:
                raise TokenizerError(f"{source}: no tokenizer.json / tokenizer_config.json and "
                                     f"{len(ggufs)} .gguf files (need exactly one)")
            source = ggufs[0]
        if source.is_file() and source.suffix == ".gguf":
            stat = source.stat()
            return _gguf_tokenizer(source.resolve(), stat.st_mtime_ns, stat.st_size)
        raise TokenizerError(f"{source}: expected a .gguf file or a directory with tokenizer.json")

    @classmethod
    def _from_hf_dir(cls, directory: Path) -> "Tokenizer":
        from transformers import AutoTokenizer  # deferred: importing transformers takes seconds

        try:
            hf_tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except (OSError, ValueError, KeyError) as e:
            raise TokenizerError(f"{directory}: cannot load the tokenizer ({e})") from e
        return cls(hf_tokenizer, _generation_config_eos_ids(directory))

    @classmethod
    def _from_gguf(cls, path: Path) -> "Tokenizer":
        from transformers import PreTrainedTokenizerFast  # deferred: importing transformers takes seconds

        metadata = _read_gguf_scalars(path)  # first: it rejects a file that is not GGUF quickly
        # Not AutoTokenizer: it first builds a model config by parsing the whole file with the
        # gguf package (~3 s more for SmolLM2); the tokenizer class reads only what it needs.
        try:
            hf_tokenizer = PreTrainedTokenizerFast.from_pretrained(
                str(path.parent), gguf_file=path.name, local_files_only=True)
        except (OSError, ValueError, KeyError) as e:
            raise TokenizerError(f"{path}: cannot build a tokenizer from the GGUF metadata ({e})") from e
        return cls(hf_tokenizer, [int(metadata[key]) for key in _GGUF_END_TOKEN_KEYS if key in metadata])

    @property
    def hf_tokenizer(self) -> PreTrainedTokenizerBase:
        """The underlying transformers tokenizer, for what this class does not wrap."""
        return self._hf

    @property
    def chat_template(self) -> str | None:
        template = self._hf.chat_template
        if isinstance(template, dict):  # several named templates: the default one is for chat
            template = template.get("default")
        return template or None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds BOS/EOS where the tokenizer asks for them.
        Encode a rendered chat template with `add_special_tokens=False`: templates write their own BOS."""
        return self._hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `token_ids`. Never cleans up tokenization spaces, so that it agrees with
        what `IncrementalDetokenizer` streams."""
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> str:
        """Render `messages` with the model's Jinja chat template; `template_kwargs` (tools, ...)
        are passed to the template."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt to /v1/completions")
        try:
            return self._hf.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=add_generation_prompt, **template_kwargs)
        # TemplateError includes the template's own raise_exception("..."); TypeError is a message
        # shape the template cannot combine (content parts where it concatenates strings)
        except (TemplateError, TypeError) as e:
            raise ChatTemplateError(f"the chat template rejected the messages: {e}") from e

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        """The raw vocabulary strings (byte-level BPE spells a space as 'Ġ')."""
        return [self._backend.id_to_token(int(t)) or "" for t in token_ids]

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one token contributes to the text (possibly part of a character)."""
        cached = self._token_bytes.get(token_id)
        if cached is None:
            cached = self._token_bytes[token_id] = self._compute_token_bytes(token_id)
        return cached

    def token_text(self, token_id: int) -> str:
        """A token's text for logprobs display; a token that is only part of a character is shown
        as its bytes, `bytes:\\xe4\\xb8`, as OpenAI does."""
        data = self.token_bytes(token_id)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    def _compute_token_bytes(self, token_id: int) -> bytes:
        raw = self._backend.id_to_token(token_id)
        if raw is None:
            return b""
        if token_id in self._added_token_ids:  # added tokens are stored as their literal text
            return raw.encode("utf-8")
        if self._byte_level:
            if all(ch in _BYTE_LEVEL_DECODING for ch in raw):
                return bytes(_BYTE_LEVEL_DECODING[ch] for ch in raw)
            return raw.encode("utf-8")
        fallback = _BYTE_FALLBACK_TOKEN.fullmatch(raw)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        return raw.replace(_SENTENCEPIECE_SPACE, " ").encode("utf-8")


@functools.lru_cache(maxsize=4)
def _gguf_tokenizer(path: Path, mtime_ns: int, size_bytes: int) -> Tokenizer:
    """One tokenizer per unchanged GGUF file and process, shared by its engines: building it
    re-parses the file's vocabulary (half a second for SmolLM2), and a Tokenizer is only read."""
    return Tokenizer._from_gguf(path)


def _is_byte_level(decoder: Any) -> bool:
    """Whether the backend decoder maps vocabulary characters back to bytes (GPT-2 style BPE)."""
    if decoder is None:
        return False
    state = json.loads(decoder.__getstate__())
    parts = state.get("decoders", [state])
    return any(part.get("type") == "ByteLevel" for part in parts)


def _byte_level_decoding_table() -> dict[str, int]:
    """GPT-2 byte-level BPE's character -> byte map: printable Latin-1 bytes stand for
    themselves, the other bytes are spelled with code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    others = sorted(set(range(256)) - set(printable))
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_LEVEL_DECODING = _byte_level_decoding_table()


def _generation_config_eos_ids(directory: Path) -> list[int]:
    """The end ids in `generation_config.json`: chat models often stop on more than the
    tokenizer's eos (Llama 3: <|eot_id|>, <|eom_id|>; Qwen2: <|endoftext|>)."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError) as e:
        raise TokenizerError(f"{path}: not a JSON object ({e})") from e
    if eos is None:
        return []
    return [int(t) for t in eos] if isinstance(eos, list) else [int(eos)]


# GGUF metadata value types (gguf spec): fixed-size scalars, plus string (8) and array (9).
_GGUF_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                        10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata count


def _read_gguf_scalars(path: Path) -> dict[str, Any]:
    """A GGUF file's scalar and string metadata, arrays skipped. The vocabulary arrays are what
    makes a general reader slow (seconds for 49k tokens); the special token ids are scalars."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if len(data) < _GGUF_HEADER.size:
            raise TokenizerError(f"{path}: too short to be a GGUF file")
        magic, version, _, num_metadata = _GGUF_HEADER.unpack_from(data, 0)
        if magic != b"GGUF" or version < 2:
            raise TokenizerError(f"{path}: not a GGUF v2/v3 file")
        metadata: dict[str, Any] = {}
        offset = _GGUF_HEADER.size
        for _ in range(num_metadata):
            key, offset = _read_gguf_string(data, offset)
            (value_type,) = struct.unpack_from("<I", data, offset)
            offset += 4
            if value_type == _GGUF_ARRAY:
                offset = _skip_gguf_array(data, offset)
            else:
                metadata[key], offset = _read_gguf_value(data, offset, value_type)
        return metadata


def _read_gguf_string(data: mmap.mmap, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", data, offset)
    start = offset + 8
    return data[start:start + length].decode("utf-8", errors="replace"), start + length


def _read_gguf_value(data: mmap.mmap, offset: int, value_type: int) -> tuple[Any, int]:
    if value_type == _GGUF_STRING:
        return _read_gguf_string(data, offset)
    fmt = _GGUF_SCALAR_FORMATS.get(value_type)
    if fmt is None:
        raise TokenizerError(f"unknown GGUF metadata type {value_type}")
    return struct.unpack_from(fmt, data, offset)[0], offset + struct.calcsize(fmt)


def _skip_gguf_array(data: mmap.mmap, offset: int) -> int:
    element_type, count = struct.unpack_from("<IQ", data, offset)
    offset += 12
    if element_type == _GGUF_STRING:
        for _ in range(count):
            offset += 8 + struct.unpack_from("<Q", data, offset)[0]
        return offset
    if element_type == _GGUF_ARRAY:
        for _ in range(count):
            offset = _skip_gguf_array(data, offset)
        return offset
    fmt = _GGUF_SCALAR_FORMATS.get(element_type)
    if fmt is None:
        raise TokenizerError(f"unknown GGUF metadata type {element_type}")
    return offset + count * struct.calcsize(fmt)
