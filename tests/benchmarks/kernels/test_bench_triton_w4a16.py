"""benchmarks/kernels/triton_w4a16.py without a GPU: its flags, its exit where there is no CUDA, its table."""
import pytest
import torch

from benchmarks.kernels.triton_w4a16 import main, to_markdown


def test_help_and_bad_flags_exit_through_argparse(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0 and "--rounds" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["--rounds", "0"])
    assert exit_info.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU: the benchmark would run")
def test_without_cuda_it_says_so_and_succeeds(capsys):
    assert main(["--quick"]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_table_compares_the_path_w4a16_takes_with_dense():
    row = {"n": 4096, "k": 4096, "batch": 1, "copy_bw_gbs": 3000.0, "packed_ms": 0.005, "dequantize_gemm_ms": 0.02,
           "dense_bf16_ms": 0.015, "chosen": "packed", "w4a16_gbs": 2000.0, "w4a16_share_of_copy_bw": 2 / 3}
    result = {"device": "GPU", "torch": "2.13.0", "triton": "3.9.0", "rounds": 3, "max_packed_rows": 16, "rows": [row]}
    table = to_markdown(result)
    assert "| 4096x4096 | 1 | 0.005 | 0.020 | 0.015 | 2000 | 67% | 3.00x |" in table


def test_table_gives_each_peer_its_time_and_error_or_why_it_is_missing():
    row = {"n": 4096, "k": 4096, "batch": 1, "copy_bw_gbs": 3000.0, "packed_ms": 0.005, "dequantize_gemm_ms": 0.02,
           "dense_bf16_ms": 0.015, "chosen": "packed", "w4a16_gbs": 2000.0, "w4a16_share_of_copy_bw": 2 / 3,
           "peers": {"torch_int4pack": {"ms": 0.012, "relative_error": 0.004},
                     "gemlite": {"unavailable": "ModuleNotFoundError: No module named 'gemlite'"}}}
    result = {"device": "GPU", "torch": "2.13.0", "triton": "3.9.0", "rounds": 3, "max_packed_rows": 16, "rows": [row]}
    table = to_markdown(result)
    assert "w4a16 vs dense bf16 | torch_int4pack | gemlite |" in table
    assert "| 0.012 (4.0e-03) | - (ModuleNotFoundError: No module named 'gemlite') |" in table
