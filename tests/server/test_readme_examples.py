"""The README's curl examples run verbatim (only the port is the test server's)."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
DEFAULT_URL = "http://127.0.0.1:8000"


def readme_curl_commands() -> list[str]:
    text = README.read_text()
    # a command is a line starting with `curl`, continued by trailing backslashes
    return [m.group(0).replace("\\\n", " ") for m in re.finditer(r"^curl (?:.*\\\n)*.*$", text, re.M)]


def test_readme_has_curl_examples():
    assert len(readme_curl_commands()) >= 2


def test_readme_curl_examples_run(server):
    for command in readme_curl_commands():
        assert DEFAULT_URL in command
        result = subprocess.run(["bash", "-c", command.replace(DEFAULT_URL, server.url)],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        out = result.stdout
        if '"stream": true' in command:
            events = [line[len("data: "):] for line in out.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert all("choices" in json.loads(e) for e in events[:-1])
        else:
            body = json.loads(out)
            assert "error" not in body and body["choices"][0]["finish_reason"] in ("stop", "length")
