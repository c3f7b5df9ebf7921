"""`tandem bench` runs the benchmark suite imported as an installed package."""
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
