"""The tool-call parsers by name (the CLI's --tool-call-parser choices) and the choice of one from a
model's chat template, so that a model is read in the format its own template teaches it."""
from __future__ import annotations

import functools
import re

import jinja2
import jinja2.ext
import jinja2.meta

from server.tool_calls.calls import ToolCallParser
from server.tool_calls.hermes import HermesParser, OPEN_TAG
from server.tool_calls.llama3_json import Llama3JsonParser, PYTHON_TAG
from server.tool_calls.mistral import MARKER, MistralParser

PARSERS: dict[str, type[ToolCallParser]] = {
    HermesParser.name: HermesParser,
    Llama3JsonParser.name: Llama3JsonParser,
    MistralParser.name: MistralParser,
}
PARSER_NAMES: tuple[str, ...] = tuple(PARSERS)
AUTO_PARSER = "auto"  # --tool-call-parser's default: the template's own format, else Hermes
# Llama 3.2's template has no python tag, but its tool results go in the "ipython" role
LLAMA_TOOL_ROLE = "ipython"
_TOOLS_WORD = re.compile(r"\btools\b")


def create_parser(name: str) -> ToolCallParser:
    """A parser of the format `name`, one of PARSER_NAMES."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSER_NAMES)}")
    return PARSERS[name]()


def detect_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's own tool format calls for, or None when the template does not
    render tools, or renders them in a format none of PARSER_NAMES reads (then the route falls back
    to 'hermes' with tools described in a system message)."""
    if not chat_template or not renders_tools(chat_template):
        return None
    if OPEN_TAG in chat_template:
        return HermesParser.name
    if MARKER in chat_template:
        return MistralParser.name
    if PYTHON_TAG in chat_template or LLAMA_TOOL_ROLE in chat_template:
        return Llama3JsonParser.name
    return None


@functools.lru_cache(maxsize=16)  # parsing a template takes milliseconds; a server has one template
def renders_tools(chat_template: str) -> bool:
    """Whether the template reads the variable `tools`. The word in its prose does not count; a
    template Jinja cannot parse (a tag of an extension we lack) is searched for the word instead."""
    environment = jinja2.Environment(extensions=[jinja2.ext.loopcontrols, jinja2.ext.do])
    try:
        syntax_tree = environment.parse(chat_template)
    except jinja2.TemplateSyntaxError:
        return _TOOLS_WORD.search(chat_template) is not None
    return "tools" in jinja2.meta.find_undeclared_variables(syntax_tree)
