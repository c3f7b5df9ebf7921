"""`tandem serve --config FILE.yaml` and TANDEM_<FLAG> variables: every flag can be set from either
and gives the same settings and EngineConfig as the command line; the command line wins over the
environment, which wins over the file; a key that names no flag is refused with its name."""
from __future__ import annotations

import argparse
import logging
import re

import pytest
import yaml

from server.cli import build_parsers, engine_config, main, parse_command_line
from server.flag_sources import DeprecatedFlag, FlagSourceError, env_name, file_defaults, settable_flags

# One value per flag, each unlike its default, so a file that set nothing could not pass.
EVERY_FLAG = {
    "host": "0.0.0.0", "port": 8123, "served-model-name": "tiny", "api-key": ["k1", "k2"],
    "max-body-bytes": 1024, "cors-origins": "http://a.test,http://b.test", "shutdown-grace": 2.5, "dead-engine-grace": 1.5,
    "tool-call-parser": "mistral",
    "max-waiting-requests": 7, "max-waiting-tokens": 999, "data-parallel-size": 2, "data-parallel-routing": "round-robin",
    "model": "llama-3.1-8b", "load-format": "dummy", "dtype": "bfloat16", "quantization": "int4",
    "int4-prefill": "int8", "batch-invariant": True, "cpu-ops": "torch", "enforce-eager": True, "seed": 3, "gpu-memory-gib": 7.5, "host-memory-gib": 12.0,
    "ttft-target-s": 2.5, "max-model-len": 512, "max-num-seqs": 5, "max-num-batched-tokens": 1024, "max-prefill-slowdown": 2.5, "max-prefill-stall-ms": 400.0,
    "prefix-caching": False, "block-size": 32, "num-gpu-blocks": 40, "kv-cache-gib": 0.5, "memory-gib": 6.0, "num-cpu-blocks": 300,
    "cpu-kv-cache-gib": 2.0, "kv-cache-dtype": "int8",
    "device": "cuda:1", "cpu-attention": "on", "gpu-threads": 3, "cpu-attention-threads": 5,
    "cost-tables": "/tmp/costs.json", "profile-cache-dir": "/tmp/profiles",
    "log-level": "warning",
    "weight-placement": "cpu", "weights-gpu-gib": 0.5, "weights-cpu-gib": 2.0, "offload-dir": "/tmp/offload",
    "weight-pipeline": "memory", "weight-io-threads": 2, "weight-copy-threads": 1, "expected-context-len": 300, "mlp-slicing": "0.25,0.5",
    "mlp-prefill-moving": "off", "hot-experts": "3", "expert-window-tokens": 512,
    "tensor-parallel-size": 2, "pipeline-parallel-size": 2, "ray-address": "ray://head:10001",
    "speculative-config": '{"method": "ngram", "num_speculative_tokens": 3}',
}
# Former flag names -> (the flag now, a value unlike its default); each still works and warns (deprecated)
DEPRECATED_FLAGS = {"offload": ("cpu-attention", "off"), "accelerator-threads": ("gpu-threads", 2),
                    "num-blocks": ("num-gpu-blocks", 40)}
# EngineConfig takes one of kv_cache_memory_gib and memory_gib, no weight streaming with tensor parallelism,
# no Neo or tensor parallelism in pipeline stages, and int8 INT4 prefill and batch invariance on device cpu only
ENGINE_FLAGS = {name: value for name, value in EVERY_FLAG.items()
                if name not in ("kv-cache-gib", "tensor-parallel-size", "pipeline-parallel-size", "int4-prefill",
                                "batch-invariant")}


def as_flags(values: dict) -> list[str]:
    """The command line that sets `values`."""
    argv = []
    for name, value in values.items():
        if isinstance(value, bool):
            argv.append(f"--{name}" if value else f"--no-{name}")
        else:
            for item in value if isinstance(value, list) else [value]:
                argv += [f"--{name}", str(item)]
    return argv


def write_config(tmp_path, values: dict) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


def parse(*argv: str, environ: dict | None = None) -> argparse.Namespace:
    return parse_command_line(["serve", *argv], environ or {})


def serve_parser() -> argparse.ArgumentParser:
    return build_parsers()[1]


def test_the_table_names_every_flag_once():
    actions = [action for action, _ in settable_flags(serve_parser()).values()]
    assert set(EVERY_FLAG) == {a.option_strings[0][2:] for a in actions if not isinstance(a, DeprecatedFlag)}
    assert set(DEPRECATED_FLAGS) == {a.option_strings[0][2:] for a in actions if isinstance(a, DeprecatedFlag)}


def test_every_flag_from_a_file_equals_the_flags(tmp_path):
    from_file = parse("--config", write_config(tmp_path, EVERY_FLAG))
    from_flags = parse(*as_flags(EVERY_FLAG))
    defaults = parse()
    assert vars(from_file) == {**vars(from_flags), "config": from_file.config}
    changed = {name for name in vars(defaults) if getattr(from_file, name) != getattr(defaults, name)}
    assert changed == set(vars(defaults)) - {"command"}


def test_every_engine_flag_from_a_file_gives_the_flags_engine_config(tmp_path):
    from_file = engine_config(parse("--config", write_config(tmp_path, ENGINE_FLAGS)))
    assert from_file == engine_config(parse(*as_flags(ENGINE_FLAGS)))
    assert from_file != engine_config(parse())
    assert (from_file.cache.memory_gib, from_file.cpu_attention.mode, from_file.cpu_ops) == (6.0, "on", "torch")


def test_every_flag_from_the_environment_equals_the_flags():
    values = {name: value for name, value in EVERY_FLAG.items() if name != "api-key"}  # TANDEM_API_KEY: below
    environ = {"TANDEM_" + name.upper().replace("-", "_"): str(value).lower() if isinstance(value, bool) else str(value)
               for name, value in values.items()}
    assert vars(parse(environ=environ)) == vars(parse(*as_flags(values)))


def test_keys_with_underscores_and_aliases_name_the_same_flags(tmp_path):
    values = {"max_num_seqs": 5, "num-blocks": 40, "cpu_ops": "fused", "api_key": "k1"}
    args = parse("--config", write_config(tmp_path, values))
    assert (args.max_num_seqs, args.num_gpu_blocks, args.cpu_ops, args.api_key) == (5, 40, "fused", ["k1"])


def test_the_command_line_wins_over_the_environment_over_the_file(tmp_path):
    config = write_config(tmp_path, {"max-num-seqs": 5, "port": 9001, "api-key": ["from-file"],
                                     "cpu-ops": "torch"})
    environ = {"TANDEM_MAX_NUM_SEQS": "6"}
    assert parse("--config", config).max_num_seqs == 5
    assert parse("--config", config, environ=environ).max_num_seqs == 6
    args = parse("--config", config, "--max-num-seqs", "7", "--api-key", "k2", "--cpu-ops", "fused", environ=environ)
    assert (args.max_num_seqs, args.port, args.api_key, args.cpu_ops) == (7, 9001, ["k2"], "fused")


def test_tandem_config_names_the_file(tmp_path):
    config = write_config(tmp_path, {"max-num-seqs": 5})
    assert parse(environ={"TANDEM_CONFIG": config}).max_num_seqs == 5


@pytest.mark.parametrize("values, message", [
    ({"max-num-seq": 8}, "unknown key 'max-num-seq': no flag --max-num-seq; did you mean 'max-num-seqs'?"),
    ({"max-num-seqs": "many"}, "max-num-seqs: expected an integer, got 'many'"),
    ({"kv-cache-gib": [1, 2]}, "kv-cache-gib: expected one value (a number)"),
    ({"load-format": "onnx"}, "load-format: must be one of auto, gguf, safetensors, dummy, got 'onnx'"),
    ({"cpu-ops": "sometimes"}, "cpu-ops: must be one of layers, fused, torch, got 'sometimes'"),
    ({"mlp-prefill-moving": "maybe"}, "mlp-prefill-moving: must be one of on, off, got 'maybe'"),
    ({"model": True}, "model: expected a string, got true"),
    ({"num-blocks": 4, "num-gpu-blocks": 8}, "'num-blocks' and 'num-gpu-blocks' set the same flag"),
])
def test_a_file_value_that_cannot_set_a_flag_is_refused_naming_it(tmp_path, capsys, values, message):
    assert main(["serve", "--config", write_config(tmp_path, values)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_yaml_on_and_off_mean_the_words_for_on_off_choices(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("cpu-attention: off\nmlp-prefill-moving: off\n")  # YAML 1.1 reads a bare off as false
    args = parse("--config", str(path))
    assert (args.cpu_attention, args.mlp_prefill_moving) == ("off", "off")


@pytest.mark.parametrize("text, message", [
    ("- max-num-seqs\n", "expected a mapping of flag names to values, got list"),
    ("max-num-seqs: [\n", "not valid YAML"),
])
def test_a_file_that_is_not_a_mapping_is_refused(tmp_path, text, message):
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    with pytest.raises(FlagSourceError, match=re.escape(message)):
        parse("--config", str(path))


def test_a_missing_file_is_refused(tmp_path, capsys):
    assert main(["serve", "--config", str(tmp_path / "absent.yaml")]) == 2
    assert "absent.yaml: No such file or directory" in capsys.readouterr().err


def test_an_unknown_tandem_variable_is_refused_and_the_known_others_pass():
    with pytest.raises(FlagSourceError, match="TANDEM_MAX_NUM_SEQ: no flag --max-num-seq; did you mean "
                                              "'TANDEM_MAX_NUM_SEQS'"):
        parse(environ={"TANDEM_MAX_NUM_SEQ": "8"})
    with pytest.raises(FlagSourceError, match="TANDEM_PORT: expected an integer, got 'http'"):
        parse(environ={"TANDEM_PORT": "http"})
    args = parse(environ={"TANDEM_CACHE_DIR": "/tmp/x", "TANDEM_API_KEY": "k"})  # their own meanings
    assert args.api_key is None


def test_each_variable_is_named_after_the_flags_first_long_name():
    names = {env_name(action) for action, _ in settable_flags(serve_parser()).values()}
    assert {"TANDEM_NUM_GPU_BLOCKS", "TANDEM_CPU_OPS", "TANDEM_KV_CACHE_GIB"} <= names


def test_help_groups_every_flag_by_concern(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    sections: dict[str, list[str]] = {}
    for line in capsys.readouterr().out.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = sections.setdefault(line[:-1], [])
        elif line.startswith("  -") and sections:
            current.append(line.split()[0].rstrip(","))
    assert sections["options"] == ["-h"]
    assert {"config", "server", "model", "batching", "KV cache", "device and CPU offloading", "logging"} <= set(sections)
    assert "--block-size" in sections["KV cache"] and "--cpu-attention" in sections["device and CPU offloading"]
    budgets, overrides = list(sections)[1:3]  # the two budgets first, then every other memory knob
    assert budgets.startswith("memory budgets") and sections[budgets] == ["--gpu-memory-gib", "--host-memory-gib",
                                                                           "--ttft-target-s"]  # and the fit's goal
    assert overrides.startswith("memory overrides of the two budgets") and set(sections[overrides]) == {
        "--num-gpu-blocks", "--kv-cache-gib", "--memory-gib", "--num-cpu-blocks", "--cpu-kv-cache-gib",
        "--weights-gpu-gib", "--weights-cpu-gib"}
    assert sum(len(flags) for flags in sections.values()) == len(EVERY_FLAG) + 2  # and --help, --config


def test_a_switch_and_its_negation_from_a_file(tmp_path):
    """--x/--no-x flags (none of serve's today): `x: false` and `no-x: true` both turn it off."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--fast-path", action=argparse.BooleanOptionalAction, default=True)
    for values in ({"fast-path": False}, {"no_fast_path": True}):
        assert file_defaults(parser, write_config(tmp_path, values)) == {"fast_path": False}
    assert file_defaults(parser, write_config(tmp_path, {"no-fast-path": False})) == {"fast_path": True}
    with pytest.raises(FlagSourceError, match="fast-path: expected true or false"):
        file_defaults(parser, write_config(tmp_path, {"fast-path": "sometimes"}))


@pytest.mark.parametrize("source", ["command line", "file", "environment"])
@pytest.mark.parametrize("old_name", list(DEPRECATED_FLAGS))
def test_a_former_flag_name_still_sets_its_flag_and_warns(tmp_path, caplog, source, old_name):
    new_name, value = DEPRECATED_FLAGS[old_name]
    caplog.set_level(logging.WARNING, logger="server.flag_sources")
    if source == "command line":
        args = parse(*as_flags({old_name: value}))
    elif source == "file":
        args = parse("--config", write_config(tmp_path, {old_name: value}))
    else:
        args = parse(environ={"TANDEM_" + old_name.upper().replace("-", "_"): str(value)})
    assert {**vars(args), "config": None} == vars(parse(*as_flags({new_name: value})))
    new_spelling = {"command line": f"--{new_name}", "file": f"'{new_name}'",
                    "environment": "TANDEM_" + new_name.upper().replace("-", "_")}[source]
    assert f"is deprecated: use {new_spelling}" in caplog.text


@pytest.mark.parametrize("old_name", list(DEPRECATED_FLAGS))
def test_a_former_flag_name_is_hidden_and_cannot_set_its_flag_twice(tmp_path, capsys, old_name):
    new_name, value = DEPRECATED_FLAGS[old_name]
    assert main(["serve", "--config", write_config(tmp_path, {old_name: value, new_name: value})]) == 2
    assert "set the same flag" in capsys.readouterr().err
    with pytest.raises(FlagSourceError, match="set the same flag"):
        parse(environ={env: str(value) for env in ("TANDEM_" + name.upper().replace("-", "_")
                                                  for name in (old_name, new_name))})
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = capsys.readouterr().out
    assert f"--{new_name}" in help_text and f"--{old_name} " not in help_text
