"""Talking to an OpenAI-compatible endpoint: preflight checks, one streamed request, /metrics.

A request is timed on the client's monotonic clock from the moment it is sent; every streamed
chunk that carries output is a token event (TTFT is the first, ITLs the gaps between them).
Token counts come from the server's usage (`stream_options.include_usage`); when a server sends
no usage the chunk count stands in and the record says so. Where the usage says how many prompt
tokens the server's cache answered (`prompt_tokens_details.cached_tokens`), the record keeps it.
A chat request sends either one user message (a prompt string) or a whole conversation (a list
of messages), and the record keeps the text the server streamed back, so a multi-turn client can
append the real reply to its history.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field

import httpx

CHECK_TIMEOUT_S = 10.0
COUNTER_SETTLE_S, COUNTER_POLL_S = 2.0, 0.05  # how long /metrics may lag the last response
ERROR_MESSAGE_CHARS = 300  # enough of an error body to read, short enough for a table

# Counters read from /metrics before and after a run, by name suffix, so `tandem:` and `vllm:`
# prefixes both work; each sums over its labels.
_COUNTERS = {"prompt_tokens": "prompt_tokens_total", "generation_tokens": "generation_tokens_total",
             "request_success": "request_success_total"}
# Prefix-cache counters (tokens looked up, tokens found) by their exact name after the namespace:
# a suffix would also catch vLLM's external_prefix_cache_* (a KV connector's cache). Older vLLMs
# name them gpu_prefix_cache_*, and some versions export them without `_total`.
_PREFIX_CACHE_COUNTERS = {
    kind: tuple(f"{prefix}prefix_cache_{kind}{total}" for prefix in ("", "gpu_") for total in ("_total", ""))
    for kind in ("queries", "hits")}
_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_TIER_LABEL = re.compile(r'(?:^|,)\s*tier="(?P<tier>[^"]*)"')

ChatMessages = list[dict[str, str]]  # [{"role": ..., "content": ...}, ...]


class EndpointError(RuntimeError):
    """The endpoint is down or unusable; the message says what to check."""


@dataclass(frozen=True)
class Endpoint:
    base_url: str
    model: str
    kind: str = "completions"  # or "chat"
    api_key: str | None = None
    ignore_eos: bool = True

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, prompt: str | ChatMessages, max_tokens: int) -> dict:
        """The request body; `prompt` is a text, or (chat only) the whole list of messages."""
        if not isinstance(prompt, str) and self.kind != "chat":
            raise ValueError("a list of messages needs the chat endpoint")
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True  # a vLLM extension tandem shares: output lengths are exact
        if self.kind == "chat":
            body["messages"] = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        else:
            body["prompt"] = prompt
        return body


@dataclass
class RequestRecord:
    """What happened to one request; times are seconds from the start of its run."""
    index: int
    num_target_input_tokens: int
    num_target_output_tokens: int
    scheduled_s: float | None = None  # planned arrival (open loop)
    start_s: float | None = None
    end_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    num_prompt_tokens: int | None = None
    num_output_tokens: int | None = None
    num_cached_prompt_tokens: int | None = None  # usage's prompt_tokens_details, where a server sends it
    usage_reported: bool = False
    error: str | None = None  # None on success; else an HTTP status or a failure kind
    error_message: str = ""
    output_text: str = ""  # what the server streamed back, joined

    @property
    def ok(self) -> bool:
        return self.start_s is not None and self.end_s is not None and self.error is None


def _error_text(response_text: str) -> str:
    try:
        return str(json.loads(response_text)["error"]["message"])[:ERROR_MESSAGE_CHARS]
    except (ValueError, KeyError, TypeError):
        return response_text.strip()[:ERROR_MESSAGE_CHARS]


async def send(client: httpx.AsyncClient, endpoint: Endpoint, prompt: str | ChatMessages, record: RequestRecord,
               clock_zero: float) -> None:
    """Stream one request, filling `record` in place (so a cancelled request keeps what it had)."""
    record.start_s = time.perf_counter() - clock_zero
    try:
        record.error, record.error_message = await _stream(client, endpoint, prompt, record, clock_zero)
    except httpx.TimeoutException as exc:
        record.error, record.error_message = "timeout", type(exc).__name__
    except httpx.ConnectError as exc:
        record.error, record.error_message = "connection", str(exc)[:ERROR_MESSAGE_CHARS]
    except httpx.TransportError as exc:
        record.error, record.error_message = "disconnected", f"{type(exc).__name__}: {exc}"[:ERROR_MESSAGE_CHARS]
    except json.JSONDecodeError as exc:
        record.error, record.error_message = "bad_response", f"a chunk is not JSON: {exc}"
    record.end_s = time.perf_counter() - clock_zero
    if record.error is None and not record.usage_reported:
        record.num_output_tokens = len(record.token_times_s)


async def _stream(client: httpx.AsyncClient, endpoint: Endpoint, prompt: str | ChatMessages, record: RequestRecord,
                  clock_zero: float) -> tuple[str | None, str]:
    """Read the SSE stream into `record`; returns (error kind, message), (None, "") on success."""
    body = endpoint.body(prompt, record.num_target_output_tokens)
    async with client.stream("POST", endpoint.path, json=body, headers=endpoint.headers) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            return str(response.status_code), _error_text(text)
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                return None, ""
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"]
                message = error.get("message", error) if isinstance(error, dict) else error
                return "stream_error", str(message)[:ERROR_MESSAGE_CHARS]
            _on_chunk(chunk, record, time.perf_counter() - clock_zero, endpoint.kind)
    return "incomplete", "the stream ended without [DONE]"


def _on_chunk(chunk: dict, record: RequestRecord, now_s: float, kind: str) -> None:
    usage = chunk.get("usage")
    if usage:
        record.usage_reported = True
        record.num_prompt_tokens = usage.get("prompt_tokens")
        record.num_output_tokens = usage.get("completion_tokens")
        record.num_cached_prompt_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    for choice in chunk.get("choices") or ():
        if kind == "chat":
            delta = choice.get("delta") or {}
            if "role" in delta:
                continue  # the opening chunk names the role and carries no token
            text = delta.get("content")
        else:
            text = choice.get("text")
        # an empty text with no finish reason is still a token (its bytes end a later character)
        if isinstance(text, str) and (text or choice.get("finish_reason") is None):
            record.token_times_s.append(now_s)
            record.output_text += text


def check_endpoint(client: httpx.Client, model: str | None) -> str:
    """Fail with a readable message unless the endpoint is up; returns the model name to send."""
    url = str(client.base_url).rstrip("/")
    try:
        health = client.get("/health", timeout=CHECK_TIMEOUT_S)
        if health.status_code not in (200, 404):  # 404: a peer without /health; /v1/models decides
            raise EndpointError(f"{url}/health answered {health.status_code}: {_error_text(health.text)}")
        models = client.get("/v1/models", timeout=CHECK_TIMEOUT_S)
    except httpx.ConnectError as exc:
        raise EndpointError(f"cannot connect to {url} ({exc}); is the server running? "
                            f"(for tandem: tandem serve --port {client.base_url.port or 8000})") from None
    except httpx.TransportError as exc:
        raise EndpointError(f"{url} did not answer ({type(exc).__name__}: {exc})") from None
    if models.status_code in (401, 403):
        raise EndpointError(f"{url} refused the request ({models.status_code}): pass --api-key")
    if models.status_code != 200:
        raise EndpointError(f"{url}/v1/models answered {models.status_code}: {_error_text(models.text)}")
    served = [m.get("id") for m in models.json().get("data", [])]
    if model is None:
        if not served:
            raise EndpointError(f"{url}/v1/models lists no model; pass --model")
        return served[0]
    if served and model not in served:
        raise EndpointError(f"{url} serves {served}, not '{model}'")
    return model


def max_model_len(client: httpx.Client, model: str) -> int | None:
    """The context length the endpoint reports in /v1/models (vLLM and tandem do), else None."""
    try:
        for entry in client.get("/v1/models", timeout=CHECK_TIMEOUT_S).json().get("data", []):
            if entry.get("id") == model and entry.get("max_model_len"):
                return int(entry["max_model_len"])
    except (httpx.HTTPError, ValueError):
        pass
    return None


def server_counters(client: httpx.Client) -> dict[str, float] | None:
    """Token and request counters from /metrics, or None where the endpoint has none.

    Each sums over its labels. The prefix cache's (`prefix_cache_queries`, `prefix_cache_hits`)
    are also kept per `tier` label where a series has one, as `prefix_cache_hits:gpu` and so on.
    """
    try:
        response = client.get("/metrics", timeout=CHECK_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    totals: dict[str, float] = {}
    for line in response.text.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        for key in _counter_keys(match["name"], match["labels"] or ""):
            totals[key] = totals.get(key, 0.0) + float(match["value"])
    return totals or None


def settled_counters(client: httpx.Client, before: dict | None, num_succeeded: int) -> dict | None:
    """/metrics after a run, re-read for a moment if it lags the responses (a server may count a
    request's last tokens just after sending them)."""
    after = server_counters(client)
    deadline = time.monotonic() + COUNTER_SETTLE_S
    while (before is not None and after is not None and "request_success" in after
           and after["request_success"] - before.get("request_success", 0) < num_succeeded
           and time.monotonic() < deadline):
        time.sleep(COUNTER_POLL_S)
        after = server_counters(client)
    return after


def _counter_keys(name: str, labels: str) -> list[str]:
    """The totals one /metrics sample adds to."""
    keys = [key for key, suffix in _COUNTERS.items() if name.endswith(suffix)]
    local_name = name.rpartition(":")[2]
    for kind, names in _PREFIX_CACHE_COUNTERS.items():
        if local_name in names:
            keys.append(f"prefix_cache_{kind}")
            tier = _TIER_LABEL.search(labels)
            if tier:
                keys.append(f"prefix_cache_{kind}:{tier['tier']}")
    return keys
