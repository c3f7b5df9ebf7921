"""INT4 accuracy, teacher-forced on the held text through the engine's public path
(benchmarks/kernels/accuracy.py): the embedded GGUF with its Q4_1 weights kept packed against the same
weights dequantized to fp32, and a random-weight preset quantized by round-to-nearest against its
dense original. Windows of 64 tokens, one per forward, so every matmul of the int4 engine goes
through the packed kernel (int16 activations), not the dequantized GEMM of longer prefills."""
import pytest

from benchmarks.kernels.accuracy import compare, held_windows
from engine.quant.int4 import MAX_KERNEL_ROWS
from kernels.cpu import int4 as int4_kernels

WINDOW_TOKENS = 64
INT4 = {"quantization": "int4"}
DENSE = {"quantization": "none"}
# The bars for the embedded model's exact int4 weights.
MAX_PERPLEXITY_CHANGE = 0.005
MIN_TOP1_AGREEMENT = 0.99
# Random weights give near-uniform next-token distributions (perplexity about the vocabulary size),
# so top-1 agreement there means little; round-to-nearest int4 must keep perplexity within 5%
# (measured: -1.7% on SmolLM2-135M's shape).
MAX_RANDOM_PRESET_PERPLEXITY_CHANGE = 0.05


def test_windows_go_through_the_packed_kernel():
    assert WINDOW_TOKENS <= MAX_KERNEL_ROWS


def test_the_held_text_is_a_few_thousand_tokens():
    windows = held_windows(None, 256, 512)  # no tokenizer: the text's bytes
    assert len(windows) >= 30 and all(len(w) == 512 for w in windows)


@pytest.fixture
def packed_kernel_only(monkeypatch):
    """Fails the test if any int4 matmul takes the dequantized path instead of the kernel."""
    def refuse(*args, **kwargs):
        raise AssertionError("an int4 matmul went through the dequantized GEMM")

    monkeypatch.setattr(int4_kernels, "dequantize_into", refuse)


def test_embedded_model_int4_matches_its_dequantized_weights(packed_kernel_only):
    result = compare("smollm2-135m", INT4, DENSE, WINDOW_TOKENS, max_windows=24)
    assert result.num_positions == 24 * (WINDOW_TOKENS - 1)
    assert abs(result.perplexity_change) <= MAX_PERPLEXITY_CHANGE, result
    assert result.top1_agreement >= MIN_TOP1_AGREEMENT, result


@pytest.mark.parametrize("model", ["smollm2-135m"])
def test_random_preset_rtn_int4_keeps_perplexity(model, packed_kernel_only):
    result = compare(model, INT4, DENSE, WINDOW_TOKENS, max_windows=6, load_format="dummy")
    assert abs(result.perplexity_change) <= MAX_RANDOM_PRESET_PERPLEXITY_CHANGE, result
