"""`tandem bench` runs the benchmark suite from the installed package; `tandem serve` refuses flags that cannot work with one line naming the field."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from server.cli import main
from session_cache import own_expert_statistics, session_cache_dir


def test_bench_serve_help_comes_from_the_benchmark(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: tandem bench serve")
    assert "--base-url" in out


@pytest.mark.parametrize("flags, message", [
    (["--dtype", "fp8"], "dtype must be auto or one of"),
    (["--max-num-seqs", "0"], "max_num_seqs must be an integer >= 1"),
    (["--model", "/no/such/model.gguf"], "not found"),
    (["-tp", "0"], "tensor_parallel_size must be an integer >= 1"),
    (["-tp", "4"], "has 3 KV heads, and each rank needs at least one; use at most --tensor-parallel-size 3"),
    (["-tp", "2", "--gpu-memory-gib", "1"], "--tensor-parallel-size 2 does not combine with --gpu-memory-gib"),
])
def test_a_flag_that_cannot_work_is_refused_in_one_line(flags, message, capsys):
    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_plan_prints_the_breakdown_and_the_expected_speed_without_loading_weights(capsys):
    assert main(["plan", "--dtype", "float32", "--quantization", "none", "--weights-gpu-gib", "0.25",
                 "--log-level", "warning"]) == 0
    out = capsys.readouterr().out
    assert "weight placement (auto):" in out and "streamed (" in out and "memory (GiB):" in out
    assert "KV pool" in out and "activations" in out and "tokens/s" in out
    assert ("scheduler: gpu-only: 2048 tokens per iteration (longer prompts in chunks), prompt chunks at most a decode "
            "step + 500 ms while streams decode, prefix caching on") in out  # cpu's defaults


def test_plan_prints_the_token_budget_and_whether_prefix_caching_is_on(capsys):
    assert main(["plan", "--dtype", "float32", "--max-num-batched-tokens", "256", "--no-prefix-caching",
                 "--max-prefill-slowdown", "0", "--log-level", "warning", "--json"]) == 0
    out = capsys.readouterr().out
    assert "scheduler: gpu-only: 256 tokens per iteration (longer prompts in chunks), prefix caching off" in out
    report = json.loads(out[out.index("\n{") + 1:])
    assert report["scheduler"] == {"kind": "gpu-only", "max_num_batched_tokens": 256, "enable_prefix_caching": False,
                                   "max_prefill_slowdown": 0.0, "max_prefill_stall_s": 0.0, "cost_tables": None, "profile_key": None,
                                   "layer_costs": []}


def test_plan_accounts_per_tensor_parallel_rank(capsys):
    assert main(["plan", "--dtype", "float32", "-tp", "2", "--log-level", "warning", "--json"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel: 2 ranks" in out and "rank 1: KV heads 2-2 (query heads 6-8)" in out
    report = json.loads(out[out.index("\n{") + 1:])
    assert [rank["kv_heads"] for rank in report["ranks"]] == [[0, 2], [2, 3]]


@pytest.mark.parametrize("slicing, moving, expected", [("auto", "on", "MLP slicing (ScheInfer)"),
                                                       ("0.5,0.5", "on", "CC 0.500  CG 0.500  GG 0.000"),
                                                       ("0.5,0.5", "off", "CC 0.500  CG 0.500  GG 0.000")])
def test_plan_shows_the_mlp_slicing_rates_when_asked(slicing, moving, expected, capsys):
    """In the session's profile cache: the slicing models are measured once, not per plan."""
    assert main(["plan", "--dtype", "float32", "--quantization", "none", "--weights-gpu-gib", "0.25",
                 "--mlp-slicing", slicing,
                 "--mlp-prefill-moving", moving, "--log-level", "warning"]) == 0
    out = capsys.readouterr().out
    assert expected in out and "predicted" in out
    assert ("tokens on CG'" in out) == (moving == "on")  # the prefill's moved tokens, unless switched off
    assert any(session_cache_dir().glob("*.slicing-dense.json"))


def test_plan_places_a_moe_models_experts_by_whole_experts(capsys, tmp_path):
    with own_expert_statistics(tmp_path / "profiles") as profiles:
        assert main(["plan", "--model", "qwen3-moe-tiny", "--load-format", "dummy", "--dtype", "float32",
                     "--weights-gpu-gib", "0.004", "--mlp-slicing", "auto", "--profile-cache-dir", str(profiles),
                     "--log-level", "warning", "--json"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("\n{") + 1:])
    slicing = report["slicing"]
    assert "placement" not in report and len(slicing["rates"]) == 2
    assert slicing["gpu_weight_bytes"] <= 0.004 * 2**30
    for rates in slicing["rates"]:  # 8 experts: rates in eighths
        assert all(abs(rate * 8 - round(rate * 8)) < 1e-9 for rate in rates)


def test_a_bad_mlp_slicing_value_is_refused_naming_the_flag(capsys):
    assert main(["plan", "--mlp-slicing", "0.7,0.5"]) == 2  # refused with the config's other bad values
    assert "--mlp-slicing must be" in capsys.readouterr().err


def test_a_bad_mlp_prefill_moving_value_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--mlp-prefill-moving", "maybe"])
    assert exit_info.value.code == 2
    assert "--mlp-prefill-moving: invalid choice: 'maybe'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["plan", "serve"])
def test_weights_that_fit_nowhere_are_refused_before_loading(command, capsys):
    assert main([command, "--dtype", "float32", "--weights-gpu-gib", "0.05", "--log-level", "warning"]) == 2
    err = capsys.readouterr().err
    assert "the model's weights do not fit" in err and "--weights-gpu-gib gives 0.05 GiB" in err
    assert "Traceback" not in err


def tiny_convert_flags(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    """A tiny Q4_0 GGUF and the `tandem convert` flags that write its layer files: (model, offload dir, flags)."""
    from gguf import GGMLQuantizationType as QType

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine" / "weights"))
    from tiny_gguf import write_tiny_gguf

    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model, qtype=QType.Q4_0)
    offload_dir = tmp_path / "offload"
    return model, offload_dir, ["convert", "--model", str(model), "--offload-dir", str(offload_dir),
                                "--dtype", "float32", "--quantization", "int4", "--log-level", "warning"]


def test_convert_writes_one_aligned_file_per_layer(tmp_path, capsys):
    import json

    model, offload_dir, flags = tiny_convert_flags(tmp_path)
    assert main(flags) == 0
    assert "2 layer files written, 0 already there" in capsys.readouterr().err
    manifest = json.loads((offload_dir / "manifest.json").read_text())
    assert manifest["key"]["quantization"] == "int4" and set(manifest["layers"]) == {"0", "1"}
    for entry in manifest["layers"].values():
        file_bytes = (offload_dir / entry["file"]).stat().st_size
        assert file_bytes == entry["payload_offset"] + entry["image"]["nbytes"]
        assert entry["payload_offset"] % 4096 == 0 and entry["image"]["nbytes"] % 4096 == 0
    assert main(flags) == 0
    assert "0 layer files written, 2 already there" in capsys.readouterr().err
    assert main(["convert", "--model", str(model), "--log-level", "warning"]) == 2


def test_convert_verify_names_a_damaged_file_which_convert_writes_again(tmp_path, capsys):
    """--verify has no source weights to write a file again: it names the file and says what to
    do; convert then rewrites that file alone."""
    _, offload_dir, flags = tiny_convert_flags(tmp_path)
    assert main(flags) == 0
    damaged = offload_dir / "layer-0001.bin"
    with open(damaged, "r+b") as file:  # one bit of the payload, past the 4 KiB header
        file.seek(4096 + 100)
        byte = file.read(1)[0]
        file.seek(4096 + 100)
        file.write(bytes([byte ^ 1]))
    capsys.readouterr()
    assert main([*flags, "--verify"]) == 2
    err = capsys.readouterr().err
    assert f"{damaged}: payload damaged" in err and "run `tandem convert` without --verify" in err
    assert "layer-0000.bin" not in err
    assert main(flags) == 0
    err = capsys.readouterr().err
    assert "1 layer files written, 1 already there" in err
    assert main([*flags, "--verify"]) == 0
    assert "all 2 layer files intact" in capsys.readouterr().err
