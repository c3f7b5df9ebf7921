"""The emulated KV variants (benchmarks/kernels/kv_variants.py): each built format's emulated round trip
gives the engine's own row against a float16 cache (accuracy.py's `compare`), on one 64-token window."""
import pytest

from benchmarks.kernels import kv_variants
from benchmarks.kernels.accuracy import KV_REFERENCE, compare

WINDOW_TOKENS = 64
MAX_WINDOWS = 1
# variant name: the built format it emulates
BUILT = {"INT8": "int8", "INT4": "int4", "K8V4: INT8 keys, INT4 values": "k8v4"}
# the emulation runs the engine's own round trip on the same rows, so only float noise may differ
MAX_PERPLEXITY_DIFFERENCE = 1e-4  # relative
MAX_TOP1_DIFFERENCE = 0.0


@pytest.fixture(scope="module")
def emulated():
    return kv_variants.measure([*BUILT, "INT4, sinks and own block 16-bit"], WINDOW_TOKENS, MAX_WINDOWS)


@pytest.mark.parametrize("name", sorted(BUILT))
def test_emulated_built_format_gives_the_engines_row(emulated, name):
    engine_row = compare(kv_variants.MODEL, {"kv_cache_dtype": BUILT[name]}, {"kv_cache_dtype": KV_REFERENCE},
                         WINDOW_TOKENS, MAX_WINDOWS)
    row = emulated[name]
    assert row.num_positions == engine_row.num_positions == WINDOW_TOKENS - 1
    assert abs(row.perplexity / engine_row.perplexity - 1) <= MAX_PERPLEXITY_DIFFERENCE, (row, engine_row)
    assert abs(row.top1_agreement - engine_row.top1_agreement) <= MAX_TOP1_DIFFERENCE, (row, engine_row)


def test_bytes_per_token_are_the_built_formats_and_kivis():
    assert [kv_variants.VARIANTS[name].bytes_per_token for name in BUILT] == [132, 72, 102]
    assert kv_variants.VARIANTS["INT4 KIVI over 32-token blocks"].bytes_per_token == 76


def test_table_has_a_row_per_measured_variant(emulated):
    text = kv_variants.table({WINDOW_TOKENS: emulated, 512: {"INT8": emulated["INT8"]}})
    lines = text.splitlines()
    assert lines[0] == "| variant | bytes | capacity | top-1, 64 | ppl, 64 | top-1, 512 | ppl, 512 |"
    assert len(lines) == 2 + len(emulated)
    assert lines[2].startswith("| INT8 | 132 | 1.94x | ")
    assert all(line.count("|") == lines[0].count("|") for line in lines)
