"""benchmarks/gpu/decode_step_gpu.py without a GPU: its rows' blocks, its exit where there is no CUDA, its table."""
import pytest
import torch

from benchmarks.gpu.decode_step_gpu import decode_rows, main, to_markdown


def test_each_row_has_blocks_of_its_own_for_the_new_token():
    rows = decode_rows(batch=3, context_len=32, block_size=16)
    assert rows.positions == [32, 32, 32]
    assert rows.block_tables == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU: the benchmark would run")
def test_without_cuda_it_says_so_and_succeeds(capsys):
    assert main([]) == 0
    assert "needs a CUDA device" in capsys.readouterr().err


def test_table_gives_the_speedup_and_host_over_gpu():
    setup = {"device": "GPU", "model": "m", "dtype": "bfloat16", "context_len": 512, "host": "x86_64 16 CPUs",
             "steps": 20}
    row = {"batch": 4, "eager_host_ms": 60.0, "eager_step_ms": 62.0, "graph_host_ms": 0.5, "graph_step_ms": 10.5,
           "gpu_ms": 10.0}
    assert "| 4 | 60.00 | 62.00 | 0.50 | 10.50 | 10.00 | **5.90x** | 0.05 |" in to_markdown({"setup": setup,
                                                                                        "rows": [row]})
