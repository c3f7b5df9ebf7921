"""Every command in the README's ```bash and ```python blocks runs.

- curl lines run verbatim through bash against the shared test server (only the port changes);
- python blocks run in this process, the SDK's against the same server;
- `tandem plan` and `tandem convert` lines run in this process through `server.cli.main`, with
  their /tmp/tandem-* paths moved to a temporary directory; they plan from the session's profile
  cache (tests/conftest.py), where what earlier tests measured is kept;
- `tandem serve` lines, and the systemd unit's ExecStart (docs/deploy.md), start servers that run until stopped:
  they are parsed with the README's YAML files and their own TANDEM_ variables, and their
  EngineConfig is built, which checks every flag and value. Serving in each mode is what the shared
  server and the server suites run (test_offload_server.py, test_moe_server.py, make test-streamed).

```sh blocks hold what needs make, Docker, systemd or minutes: tests/deploy and `make test-integration`
check the images and compose files, and `make test-slow` runs the recipes' `tandem plan` lines (docs/recipes.md)
on the testbed against the output shown there; a ```bash block may hold only curl and tandem commands.
"""
from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from server.cli import engine_config, main, parse_command_line

README = Path(__file__).resolve().parents[2] / "README.md"
DEPLOY_PAGE = README.parent / "docs" / "deploy.md"
RECIPES_PAGE = README.parent / "docs" / "recipes.md"
DEFAULT_URL = "http://127.0.0.1:8000"
SCRATCH_PATH = re.compile(r"/tmp/tandem-[\w.-]+")  # the examples' scratch directories
ASSIGNMENT = re.compile(r"^[A-Z][A-Z0-9_]*=")
SERVE_BINARY = re.compile(r"^\S*/tandem serve\b")  # the systemd unit's ExecStart


def readme_blocks(language: str, page: Path = README) -> list[str]:
    return [m["body"] for m in re.finditer(r"^```(?P<lang>\w*)\n(?P<body>.*?)^```$", page.read_text(), re.M | re.S)
            if m["lang"] == language]


def readme_commands() -> list[str]:
    """The ```bash blocks' commands, one per line once backslash continuations are joined."""
    lines = "\n".join(readme_blocks("bash")).replace("\\\n", " ").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def split_command(command: str) -> tuple[dict[str, str], list[str]]:
    """`A=1 B=2 prog args  # comment` -> ({A: 1, B: 2}, [prog, args])."""
    words = shlex.split(command, comments=True)
    env = {}
    while words and ASSIGNMENT.match(words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return env, words


def tandem_commands(*subcommands: str, rewrite=lambda command: command) -> list[tuple[dict[str, str], list[str]]]:
    """(variables, argv after `tandem`) of each ```bash command running one of `subcommands`, in order."""
    split = [split_command(rewrite(c)) for c in readme_commands()]
    return [(env, words[1:]) for env, words in split if words[0] == "tandem" and words[1] in subcommands]


def test_readme_bash_blocks_hold_only_commands_this_test_runs():
    for command in readme_commands():
        _, words = split_command(command)
        assert words[0] in ("curl", "tandem"), f"{command!r}: a ```bash block holds curl and tandem commands; " \
                                               "put what needs other tools in a ```sh block"
        assert words[0] == "curl" or words[1] in ("serve", "plan", "convert"), \
            f"{command!r}: this test runs tandem serve, plan and convert"
    assert len([c for c in readme_commands() if c.startswith("curl ")]) >= 2
    assert len(readme_blocks("python")) >= 2


def test_readme_curl_examples_run(server):
    for command in (c for c in readme_commands() if c.startswith("curl ")):
        assert DEFAULT_URL in command
        result = subprocess.run(["bash", "-o", "pipefail", "-c", command.replace(DEFAULT_URL, server.url)],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, (command, result.stderr)
        out = result.stdout
        if '"stream": true' in command:
            events = [line[len("data: "):] for line in out.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert all("choices" in json.loads(e) for e in events[:-1])
        elif "/v1/" in command:
            body = json.loads(out)
            assert "error" not in body and body["choices"][0]["finish_reason"] in ("stop", "length")
        else:
            assert out.strip(), command


def test_readme_python_examples_run(server):
    for block in readme_blocks("python"):
        namespace: dict = {}
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                exec(compile(block.replace(DEFAULT_URL, server.url), str(README), "exec"), namespace)
        finally:
            for value in namespace.values():  # an offline LLM's engine threads
                if type(value).__name__ == "LLM":
                    value.close()
        assert printed.getvalue().strip(), block


def test_readme_plan_and_convert_commands_run(tmp_path, monkeypatch, capsys):
    commands = tandem_commands("plan", "convert",
                               rewrite=lambda c: SCRATCH_PATH.sub(lambda m: str(tmp_path / Path(m[0]).name), c))
    assert commands
    for env, argv in commands:  # in the README's order: convert writes what plan reads
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert main(argv) == 0, (argv, capsys.readouterr().err[-2000:])
        out, err = capsys.readouterr()
        expected = ("tandem plan:" in out if argv[0] == "plan" else "layer files intact" in err
                    if "--verify" in argv else "layer files written" in err)
        assert expected, argv


# The lines of a plan that are decisions (the rest are this machine's measured speeds)
DECISION_PREFIXES = ("fit: weights", "as flags:", "model plan:", "hot experts:", "kv cache:")


def recipe_plans() -> list[tuple[list[str], str]]:
    """(argv after `tandem`, the ```text block right after it) of each ```sh recipe's `tandem plan` line."""
    blocks = [(m["lang"], m["body"]) for m in re.finditer(r"^```(?P<lang>\w*)\n(?P<body>.*?)^```$",
                                                           RECIPES_PAGE.read_text(), re.M | re.S)]
    recipes = []
    for (lang, body), (next_lang, shown) in zip(blocks, blocks[1:]):
        if lang == "sh" and next_lang == "text":
            recipes += [(shlex.split(line)[1:], shown) for line in body.splitlines() if line.startswith("tandem plan")]
    return recipes


def decision_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(DECISION_PREFIXES)]


@pytest.mark.slow
@pytest.mark.parametrize("argv, shown", recipe_plans(), ids=lambda v: v[2] if isinstance(v, list) else "")
def test_readme_recipes_plan_what_the_readme_shows(argv, shown, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    assert main([*argv, "--log-level", "warning"]) == 0
    assert decision_lines(capsys.readouterr().out) == decision_lines(shown)


def test_the_recipes_page_has_its_recipes():
    assert len(recipe_plans()) == 2


def test_readme_serve_commands_take_their_flags(tmp_path, monkeypatch):
    for block in readme_blocks("yaml"):  # files a command names, written where it runs
        first_line = block.splitlines()[0]
        if re.fullmatch(r"# [\w.-]+\.yaml", first_line):
            (tmp_path / first_line[2:]).write_text(block)
    monkeypatch.chdir(tmp_path)
    serve = tandem_commands("serve")
    for block in readme_blocks("ini", DEPLOY_PAGE):  # the systemd unit
        for line in block.splitlines():
            if line.startswith("ExecStart="):
                serve.append(({}, shlex.split(SERVE_BINARY.sub("tandem serve", line[len("ExecStart="):]))[1:]))
    assert len(serve) >= 5
    for env, args in serve:
        parsed = parse_command_line(args, env)
        assert parsed.command == "serve"
        engine_config(parsed)  # raises, naming the field, on a value the engine refuses


@pytest.mark.parametrize("bad", ["tandem serve --max-num-seqs 0", "tandem serve --no-such-flag"])
def test_a_serve_line_that_cannot_work_fails_here(bad):
    env, words = split_command(bad)
    with pytest.raises((SystemExit, ValueError)):
        engine_config(parse_command_line(words[1:], env))
