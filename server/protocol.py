"""Request bodies of the OpenAI API (pydantic v2) and their mapping onto SamplingParams.

Every check of an OpenAI parameter lives here: pydantic checks types and names, and turning a
request into prompts and SamplingParams raises ParamError naming the field, which the app's one
ParamError handler answers with a 400 (through `param_error`).
"""
from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from scheduler.sampling_params import ParamError, SamplingParams
from scheduler.structured_output import StructuredOutput
from server.errors import APIError, bad_request

# Parameters of the OpenAI API that tandem does not implement: refused, never ignored.
UNSUPPORTED_PARAMS = {
    "functions": "the deprecated function calling (send 'tools')",
    "function_call": "the deprecated function calling (send 'tool_choice')",
    "best_of": "best_of", "suffix": "suffix (insertion)",
    "audio": "audio output", "modalities": "output modalities", "prediction": "predicted outputs",
    "web_search_options": "web search", "reasoning_effort": "reasoning effort",
}
# OpenAI's bound on n; also keeps one request from queueing an unbounded number of sequences
MAX_N = 128
# a logit_bias key: a token id in ASCII digits (str.isdigit also takes '²', which int() refuses)
TOKEN_ID_KEY = re.compile(r"-?[0-9]+")


class StrictBody(BaseModel):
    """A request body, or a part of one, as every protocol's are read."""
    # strict: a wrong JSON type is an error, not coerced (true is not n=1, "0.5" is not a temperature)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


def tagged_union(*members: type[BaseModel], default: str | None = None) -> Any:
    """A union of `members` told apart by their `type` literal (`default` for an object without one).
    Each member's tag is bracketed, "[text]", so that an error's location drops it as it drops other
    type tags: a bad field of a text block is 'messages.0.content.1.text', not '...1.text.text'."""
    def tag_of(value: Any) -> str | None:
        kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", None)
        return f"[{kind}]" if isinstance(kind, str) else None

    tagged = tuple(Annotated[member, Tag(f"[{get_args(member.model_fields['type'].annotation)[0]}]")]
                   for member in members)
    return Annotated[Union[tagged], Discriminator(tag_of)]


class StreamOptions(StrictBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JSONSchemaFormat(StrictBody):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")  # `schema` would shadow a BaseModel method
    strict: bool | None = None


class ResponseFormat(StrictBody):
    """OpenAI's response_format: free text, any JSON object, or JSON matching a schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(StrictBody):
    """vLLM's structured_outputs: exactly one of a JSON schema, any JSON object, a regular
    expression, a list of choices or an EBNF grammar (xgrammar's dialect of GBNF)."""
    json_schema: dict[str, Any] | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def structured_output(self) -> StructuredOutput:
        given = {name: value for name, value in self.model_dump(by_alias=True).items() if value not in (None, False)}
        if len(given) != 1:
            raise ParamError("structured_outputs", "structured_outputs takes exactly one of json, json_object, "
                                                   f"regex, choice, grammar; got {sorted(given) or 'none'}")
        (name, value), = given.items()
        if name == "choice" and not value:
            raise ParamError("structured_outputs.choice", "choice must list at least one string")
        kind = {"json": "json_schema"}.get(name, name)
        spec = json.dumps(value) if name in ("json", "choice") else ("" if name == "json_object" else value)
        return StructuredOutput(kind, spec, param="structured_outputs")


class _SamplingFields(StrictBody):
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    def structured_output(self) -> StructuredOutput | None:
        """What the output must match: response_format or structured_outputs, not both."""
        response_format = self.response_format
        if response_format is not None and response_format.type != "text":
            if self.structured_outputs is not None:
                raise ParamError("structured_outputs", "send response_format or structured_outputs, not both")
            if response_format.type == "json_object":
                return StructuredOutput("json_object")
            if response_format.json_schema is None:
                raise ParamError("response_format.json_schema", "response_format of type json_schema needs "
                                                                "a json_schema object with the schema")
            return StructuredOutput("json_schema", json.dumps(response_format.json_schema.json_schema))
        return self.structured_outputs.structured_output() if self.structured_outputs is not None else None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None,
                         structured: StructuredOutput | None = None) -> SamplingParams:
        """Map the fields both endpoints share onto SamplingParams; a ParamError names the field.
        `structured`: what the output must match (default: what response_format asks)."""
        if self.n > MAX_N:
            raise ParamError("n", f"n must be at most {MAX_N}, got {self.n}")
        bias = None
        if self.logit_bias:
            bias = {}
            for key, value in self.logit_bias.items():
                if not TOKEN_ID_KEY.fullmatch(key):
                    raise ParamError("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
                bias[int(key)] = value
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed when stream is true")
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, logit_bias=bias,
            stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            structured=structured or self.structured_output(),
        )


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt as a list of prompts: str | list[str] | list[int] | list[list[int]] -> a list."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if not self.prompt:
            raise ParamError("prompt", "prompt must not be empty")
        if all(isinstance(p, int) for p in self.prompt):
            return [self.prompt]
        if any(isinstance(p, list) and not p for p in self.prompt):
            raise ParamError("prompt", "prompt token lists must not be empty")
        return list(self.prompt)

    def sampling_params(self) -> SamplingParams:
        """The request as SamplingParams; a ParamError names the request field. `echo` with
        `logprobs` also asks for the prompt's logprobs (OpenAI's legacy scoring: with
        max_tokens 0 nothing is generated)."""
        prompt_logprobs = self.logprobs if self.echo else None
        return self._sampling_params(self.max_tokens, self.logprobs, prompt_logprobs)


class TextPart(StrictBody):
    type: Literal["text"]
    text: str


class ToolCallFunction(StrictBody):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(StrictBody):
    """A call an assistant message made, sent back in the history."""
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages only
    tool_call_id: str | None = None  # tool messages: the call this result answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionDefinition(StrictBody):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class Tool(StrictBody):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictBody):
    name: str


class NamedToolChoice(StrictBody):
    """tool_choice naming the one function the model must call."""
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True

    def sampling_params(self, structured: StructuredOutput | None = None) -> SamplingParams:
        """The request as SamplingParams; a ParamError may name the engine's field (see `param_renames`).
        `structured`: what a forced tool call must match, in place of response_format."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs requires logprobs to be true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None,
                                     structured=structured)

    def param_renames(self) -> dict[str, str]:
        """The engine's field names -> this request's: chat sends messages, not a prompt, and
        top_logprobs is the count the engine calls logprobs."""
        renames = {"prompt": "messages", "logprobs": "top_logprobs"}
        if self.max_completion_tokens is not None:
            renames["max_tokens"] = "max_completion_tokens"
        return renames


class TokenizeRequest(StrictBody):
    model: str | None = None
    prompt: str | None = None
    # the chat template raises on an empty conversation: refused here, it is a 400 naming the field
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(StrictBody):
    model: str | None = None
    tokens: list[int]


def parse(model_cls: type[BaseModel], body: object, unsupported: dict[str, str] = UNSUPPORTED_PARAMS) -> BaseModel:
    """Validate a decoded JSON body; the first problem becomes a 400 naming its field. `unsupported`:
    the protocol's parameters tandem refuses, each with what it is."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for key in body:
        if key in unsupported:
            raise bad_request(f"'{key}' ({unsupported[key]}) is not supported by this server", param=key,
                              code="unsupported_parameter")
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        error = _most_telling(exc.errors())
        path = _field_path(error)
        param = ".".join(path) or None
        if error["type"] == "extra_forbidden":
            raise bad_request(f"unknown parameter '{param}'", param=param, code="unknown_parameter") from None
        if error["type"] == "missing":
            raise bad_request(f"'{param}' is required", param=param) from None
        if error["type"] == "union_tag_invalid":  # a block, item or tool of a type tandem does not serve
            tag, expected = (error["ctx"][key].replace("[", "").replace("]", "") for key in ("tag", "expected_tags"))
            raise bad_request(f"'{param}' of type '{tag}' is not supported by this server; it takes {expected}",
                              param=param, code="unsupported_parameter") from None
        if error["type"] == "union_tag_not_found":
            raise bad_request(f"'{param}' needs a 'type'", param=param) from None
        raise bad_request(f"invalid '{param}': {error['msg']}", param=param) from None


def _most_telling(errors: list[dict]) -> dict:
    """The error to answer with. A value that fails a union fails each member: a list of blocks sent
    as content also fails `str`. A block of a type tandem does not serve, or a fault inside the value
    (a missing or unknown field), says more than the wrong-type error of a member it was never meant for."""
    tag = next((e for e in errors if e["type"] == "union_tag_invalid"), None)
    if tag is not None:
        return tag
    first = errors[0]
    if first["type"].endswith("_type"):
        prefix = _field_path(first)
        inside = (e for e in errors if not e["type"].endswith("_type") and len(_field_path(e)) > len(prefix)
                  and _field_path(e)[:len(prefix)] == prefix)
        return next(inside, first)
    return first


def _field_path(error: dict) -> list[str]:
    """The error's location as the user's field path: union members add their type names to it."""
    return [str(p) for p in error["loc"] if not _is_type_tag(p)]


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "list", "none"})


def param_error(exc: ParamError, renames: dict[str, str] | None = None) -> APIError:
    """The 400 for `exc`, naming the field as the client spelled it (`renames`: engine -> request)."""
    param = (renames or {}).get(exc.param, exc.param)
    return bad_request(exc.message, param=param)
