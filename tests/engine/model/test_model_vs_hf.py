"""Logits of tiny random models against Hugging Face models with the same config and weights."""
import pytest
import torch
import transformers

from engine.attention import create_decode_backend
from engine.runtime import ModelRunner
from engine.model import LlamaModel
from engine.weights import create_loader
from scheduler.sampling_params import SamplingParams
from scheduler.sequence import Sequence
from scheduler.scheduler import Scheduler, SchedulerConfig

BLOCK_SIZE = 4
TOLERANCE = 1e-4

TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
            max_position_embeddings=256, rms_norm_eps=1e-5)
CASES = {
    "llama31-rope-scaling-gqa4-untied": (transformers.LlamaConfig, dict(
        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=32))),
    "llama-gqa1-tied": (transformers.LlamaConfig, dict(
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, rope_theta=10000.0)),
    "qwen2-bias-gqa4": (transformers.Qwen2Config, dict(
        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1000000.0)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny_model(request, tmp_path_factory):
    config_cls, extra = CASES[request.param]
    torch.manual_seed(0)
    hf_config = config_cls(**TINY, **extra)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config, torch_dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    with torch.no_grad():  # biases are zero at init: make them count
        for name, param in hf_model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    path = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(path, safe_serialization=True)
    return hf_model, str(path)


@torch.no_grad()
def hf_logits(hf_model, token_ids):
    return hf_model(torch.tensor([token_ids])).logits[0].float()  # [tokens, vocab]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_prefill_and_paged_decode_logits_match_hf(tiny_model, backend):
    hf_model, path = tiny_model
    loader = create_loader(path)
    runner = ModelRunner(loader.config, loader, dtype=torch.float32, device="cpu", num_blocks=64,
                         block_size=BLOCK_SIZE, max_model_len=128, decode_backend=backend)
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=BLOCK_SIZE, max_model_len=128))
    gen = torch.Generator().manual_seed(1)
    requests = [Sequence(str(i), torch.randint(0, 256, (n,), generator=gen).tolist(), SamplingParams(max_tokens=20))
                for i, n in enumerate([7, 1, 16, 13])]  # mixed lengths, one an exact block multiple
    for r in requests:
        sched.add_sequence(r)
    for step in range(6):
        if step == 3:  # a late arrival prefills while the others decode
            late = Sequence("late", torch.randint(0, 256, (9,), generator=gen).tolist(), SamplingParams(max_tokens=20))
            requests.append(late)
            sched.add_sequence(late)
        plan = sched.schedule()
        logits = runner.compute_logits(plan)
        for row, seq in enumerate(plan.scheduled):
            tokens = seq.sequence.all_token_ids
            expected = hf_logits(hf_model, tokens)[-1]
            torch.testing.assert_close(logits[row], expected, atol=TOLERANCE, rtol=TOLERANCE)
        # teacher forcing with random tokens keeps the test independent of sampling
        sched.update(plan, torch.randint(0, 256, (len(plan.scheduled),), generator=gen).tolist())


def test_weight_bytes_count_every_parameter_once(tiny_model):
    """Linear weights as their objects report them, embeddings and norms dense, a tied LM head
    once: the same total as the HF model's parameters (which counts tied ones once too)."""
    hf_model, path = tiny_model
    loader = create_loader(path)
    model = LlamaModel(loader.config, loader, torch.float32, "cpu", 64, create_decode_backend("torch"))
    num_params = sum(p.numel() for p in hf_model.parameters())
    assert model.weight_bytes() == {("float32", "gpu"): 4 * num_params}


@torch.no_grad()
def test_prompt_logprobs_match_hf_beside_plain_prefills(tiny_model):
    """A prefill asking for prompt logprobs packed with one that does not: its entries are HF's
    log-softmax at every position but the last, the first token has none, and the other
    sequence's logits are untouched."""
    hf_model, path = tiny_model
    loader = create_loader(path)
    runner = ModelRunner(loader.config, loader, dtype=torch.float32, device="cpu", num_blocks=64,
                         block_size=BLOCK_SIZE, max_model_len=128)
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=BLOCK_SIZE, max_model_len=128))
    gen = torch.Generator().manual_seed(2)
    plain = Sequence("plain", torch.randint(0, 256, (5,), generator=gen).tolist(),
                     SamplingParams(max_tokens=2, temperature=0.0))
    scored = Sequence("scored", torch.randint(0, 256, (11,), generator=gen).tolist(),
                      SamplingParams(max_tokens=0, prompt_logprobs=3))
    for seq in (plain, scored):
        sched.add_sequence(seq)
    plan = sched.schedule()
    output = runner.execute(plan)
    (row,) = output.prompt_logprobs
    assert plan.scheduled[row].sequence is scored
    entries = output.prompt_logprobs[row]
    expected = torch.log_softmax(hf_logits(hf_model, scored.prompt_token_ids)[:-1], dim=-1)
    assert len(entries) == len(scored.prompt_token_ids) - 1  # every token but the first (nothing predicts it)
    for position, entry in enumerate(entries):
        assert entry.token_id == scored.prompt_token_ids[position + 1]
        assert entry.logprob == pytest.approx(expected[position, entry.token_id].item(), abs=TOLERANCE)
        top_values, top_ids = expected[position].topk(3)
        assert [token for token, _ in entry.top] == top_ids.tolist()
    plain_row = 1 - row
    assert output.sampled.token_ids[plain_row] == int(hf_logits(hf_model, plain.prompt_token_ids)[-1].argmax())
    sched.update(plan, output.sampled.token_ids)
    assert scored.status.value == "length" and scored.output_token_ids == []  # scored, nothing generated
