"""Every engine knob, as declared once in engine/config.py, reaches the same EngineConfig field from each
surface made from the declaration: its flag, its key in a --config file, its TANDEM_ variable and its
LLM(...) keyword; so do its former names, with a warning. A value it cannot take is refused on
each surface naming it."""
from __future__ import annotations

import dataclasses
import functools
import logging

import pytest
import yaml

import engine.llm
from engine.config import ENGINE_KNOBS, EngineConfig
from engine.knobs import Knob
from engine.model_config import ConfigError
from server.cli import engine_config, parse_command_line
from server.flag_sources import FlagSourceError

# Values for the knobs that take free text; every other knob's comes from its declaration.
TEXT_VALUES = {"--model": "llama-3.1-8b", "--dtype": "bfloat16", "--device": "cuda:1",
               "--cost-tables": "/tmp/costs.json", "--profile-cache-dir": "/tmp/profiles",
               "--offload-dir": "/tmp/offload", "--ray-address": "ray://head:10001", "--mlp-slicing": "0.25,0.5",
               "--hot-experts": "3", "--speculative-config": '{"method": "ngram", "num_speculative_tokens": 3}'}
# Values each knob with a type, choices or a parse refuses; free text that nothing refuses is absent.
BAD_TEXT = {"--dtype": "float64", "--device": "tpu"}
FREE_TEXT = {"--model", "--cost-tables", "--profile-cache-dir", "--offload-dir", "--ray-address"}


def text_of(knob: Knob) -> str:
    """A value unlike the default, as the command line writes it (a switch: its value's word)."""
    if knob.switch:
        return str(not knob.default).lower()
    if knob.choices:
        return next(choice for choice in knob.choices if choice != knob.default)
    if knob.type is int:
        return str((knob.default or 0) + 3)
    if knob.type is float:
        return "2.5"
    return TEXT_VALUES[knob.flag]


def typed(knob: Knob, text: str):
    """`text` as the field's type: what a Python caller passes as the LLM keyword."""
    if knob.switch:
        return text == "true"
    if knob.parse is not None:
        return knob.parse(text)
    return knob.type(text) if knob.type is not None else text


def field_value(config: EngineConfig, knob: Knob):
    return functools.reduce(getattr, knob.path, config)


def from_command_line(flag: str, knob: Knob, text: str) -> EngineConfig:
    if knob.switch:
        argv = [flag if text == "true" else f"--no-{flag[2:]}"]
    else:
        argv = [flag, text]
    return engine_config(parse_command_line(["serve", *argv], {}))


def from_file(tmp_path, flag: str, knob: Knob, text: str) -> EngineConfig:
    value = typed(knob, text) if knob.switch or knob.type is not None else text  # YAML's own types where it has them
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({flag[2:]: value}))
    return engine_config(parse_command_line(["serve", "--config", str(path)], {}))


def from_environment(flag: str, text: str) -> EngineConfig:
    variable = "TANDEM_" + flag[2:].upper().replace("-", "_")
    return engine_config(parse_command_line(["serve"], {variable: text}))


@pytest.fixture
def llm_config(monkeypatch):
    """LLM(**keywords)'s EngineConfig, the engine itself not built."""
    def build(**keywords) -> EngineConfig:
        built = []
        monkeypatch.setattr(engine.llm, "LLMEngine", built.append)
        engine.llm.LLM(**keywords)
        return built[0]
    return build


def without_progress(config: EngineConfig) -> EngineConfig:
    return dataclasses.replace(config, show_progress=False)  # the CLI's progress bars, not a knob


@pytest.mark.parametrize("knob", ENGINE_KNOBS, ids=lambda knob: knob.flag)
def test_every_surface_of_a_knob_reaches_its_field(knob, tmp_path, llm_config):
    text = text_of(knob)
    value = typed(knob, text)
    configs = {"flag": from_command_line(knob.flag, knob, text), "file": from_file(tmp_path, knob.flag, knob, text),
               "environment": from_environment(knob.flag, text), "LLM": llm_config(**{knob.keyword: value})}
    for surface, config in configs.items():
        assert field_value(config, knob) == value != knob.default, surface
        assert without_progress(config) == configs["LLM"], surface
    assert dataclasses.replace(configs["LLM"], **{knob.path[0]: getattr(EngineConfig(), knob.path[0])}) == EngineConfig()


FORMER_NAMES = [(knob, former) for knob in ENGINE_KNOBS for former in knob.deprecated]


def test_the_deprecated_flags_are_declared():
    assert {former for _, former in FORMER_NAMES} == {"--offload", "--accelerator-threads", "--num-blocks"}


@pytest.mark.parametrize("knob, former", FORMER_NAMES, ids=lambda item: getattr(item, "flag", item))
def test_a_former_name_reaches_the_same_field_on_every_surface_and_warns(knob, former, tmp_path, llm_config, caplog):
    text = text_of(knob)
    expected = llm_config(**{knob.keyword: typed(knob, text)})
    caplog.set_level(logging.WARNING)
    configs = [from_command_line(former, knob, text), from_file(tmp_path, former, knob, text),
               from_environment(former, text)]
    assert all(without_progress(config) == expected for config in configs)
    assert llm_config(**{former[2:].replace("-", "_"): typed(knob, text)}) == expected
    assert caplog.text.count("is deprecated: use") == 4


def bad_text(knob: Knob) -> str:
    return BAD_TEXT.get(knob.flag, "zzz")


def test_every_knob_but_free_text_has_a_value_it_refuses():
    refusing = {knob.flag for knob in ENGINE_KNOBS if knob.type or knob.choices or knob.parse or knob.switch}
    assert {knob.flag for knob in ENGINE_KNOBS} - refusing - set(BAD_TEXT) == FREE_TEXT


def refusal(build) -> str:
    """The message building a config gave, or argparse printed; '' when it built."""
    try:
        build()
    except (ConfigError, FlagSourceError) as exc:
        return str(exc)
    except SystemExit:
        return "argparse"
    return ""


@pytest.mark.parametrize("knob", [knob for knob in ENGINE_KNOBS if knob.flag not in FREE_TEXT and not knob.switch],
                         ids=lambda knob: knob.flag)
def test_a_bad_value_is_refused_naming_the_knob(knob, tmp_path, llm_config, capsys):
    bad = bad_text(knob)
    variable = "TANDEM_" + knob.flag[2:].upper().replace("-", "_")
    messages = {
        "flag": refusal(lambda: from_command_line(knob.flag, knob, bad)),
        "file": refusal(lambda: from_file(tmp_path, knob.flag, dataclasses.replace(knob, type=None), bad)),
        "environment": refusal(lambda: from_environment(knob.flag, bad)),
        "LLM": refusal(lambda: llm_config(**{knob.keyword: bad})),
    }
    if messages["flag"] == "argparse":  # argparse names the flag on stderr
        messages["flag"] = capsys.readouterr().err
    for surface, message in messages.items():
        named = message.replace("-", "_")
        assert knob.keyword in named or variable in message, f"{surface}: {message!r}"
        assert repr(bad) in message or f"'{bad}'" in message, f"{surface}: {message!r}"
