"""`tandem bench` runs the benchmark suite from the installed package; `tandem serve` refuses flags that cannot work with one line naming the field."""
from __future__ import annotations

import pytest

from server.cli import main


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
])
def test_a_flag_that_cannot_work_is_refused_in_one_line(flags, message, capsys):
    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
