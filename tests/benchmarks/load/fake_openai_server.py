"""A tiny stand-in for an OpenAI-compatible server, for testing the harness's side-by-side mode.

Standard library only; starts in well under a second. Tokens are words: /tokenize counts them,
and a completion streams `max_tokens` words, one every `--token-delay` seconds. `--fail` answers
every generation request with a 500 in OpenAI's error shape.

    python tests/benchmarks/load/fake_openai_server.py --port 8001 --token-delay 0.002
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "fake"
CHAT_TEMPLATE_TOKENS = 3  # what the fake "template" adds around a chat message


class Handler(BaseHTTPRequestHandler):
    token_delay_s = 0.0
    fail = False
    prompt_log: str | None = None
    counters = {"prompt_tokens": 0, "generation_tokens": 0, "request_success": 0}
    lock = threading.Lock()

    def log_message(self, *_args) -> None:  # keep the test log quiet
        pass

    def send_json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self.send_json(200, {})
        elif self.path == "/v1/models":
            self.send_json(200, {"data": [{"id": MODEL, "max_model_len": 4096}]})
        elif self.path == "/metrics":
            text = "".join(f"fake:{k}_total {v}\n" for k, v in self.counters.items()).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)
        else:
            self.send_json(404, {"error": {"message": "no such route"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            self.send_json(200, {"count": count_tokens(body)})
        elif self.path in ("/v1/completions", "/v1/chat/completions"):
            self.generate(body, chat=self.path.endswith("chat/completions"))
        else:
            self.send_json(404, {"error": {"message": "no such route"}})

    def generate(self, body: dict, chat: bool) -> None:
        if self.fail:
            self.send_json(500, {"error": {"message": "fake failure", "type": "internal_error"}})
            return
        num_prompt, num_output = count_tokens(body), body["max_tokens"]
        if self.prompt_log is not None:
            with self.lock, open(self.prompt_log, "a") as log:
                log.write(json.dumps(body.get("prompt") or body.get("messages")) + "\n")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(num_output):
            time.sleep(self.token_delay_s)
            choice = {"index": 0, "finish_reason": "length" if i == num_output - 1 else None}
            choice.update({"delta": {"content": " w"}} if chat else {"text": " w"})
            self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            self.wfile.flush()
        with self.lock:  # counted before the client can see the end, as a real server's engine does
            self.counters["prompt_tokens"] += num_prompt
            self.counters["generation_tokens"] += num_output
            self.counters["request_success"] += 1
        usage = {"prompt_tokens": num_prompt, "completion_tokens": num_output}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())


def count_tokens(body: dict) -> int:
    if "messages" in body:
        return CHAT_TEMPLATE_TOKENS + sum(len(m["content"].split()) for m in body["messages"])
    return len(body["prompt"].split())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--token-delay", type=float, default=0.0)
    ap.add_argument("--fail", action="store_true")
    ap.add_argument("--prompt-log", default=None, help="append every generation request's prompt to this file")
    args = ap.parse_args()
    Handler.token_delay_s, Handler.fail, Handler.prompt_log = args.token_delay, args.fail, args.prompt_log
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
