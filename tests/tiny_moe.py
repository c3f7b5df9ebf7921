"""Tiny random mixture-of-experts models of each family, built by Hugging Face transformers from a
config and saved as safetensors, and the check of an engine's logits against them: the factory
the MoE tests of several packages share (tests/ is on their import path, by its conftest.py)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB_SIZE = 256
BLOCK_SIZE = 4  # small, so short prompts span several KV blocks
NUM_BLOCKS = 64
MAX_MODEL_LEN = 128
TOLERANCE = 1e-4
COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1,
              tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
# Router weights this large make each token's top-k clear (no near-ties an fp32 rounding could flip).
ROUTER_STD = 0.5
NORM_AND_BIAS_NOISE = 0.1  # norms are ones and biases zeros at init: make them count


def family_cases():
    """case name -> (config class, the config's own fields). Between them: Mixtral; Qwen3-MoE with
    renormalized top-k, a head_dim unlike hidden / heads and a dense layer (`mlp_only_layers`);
    Qwen3-MoE with raw top-3 probabilities; Qwen2-MoE's gated shared expert and QKV bias."""
    import transformers
    return {
        "mixtral": (transformers.MixtralConfig, dict(
            intermediate_size=96, num_local_experts=8, num_experts_per_tok=2, sliding_window=None)),
        "qwen3-moe-dense-layer": (transformers.Qwen3MoeConfig, dict(
            intermediate_size=96, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, mlp_only_layers=[1], head_dim=32)),
        "qwen3-moe-raw-top3": (transformers.Qwen3MoeConfig, dict(
            intermediate_size=96, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=3,
            norm_topk_prob=False, head_dim=16)),
        "qwen2-moe-shared-expert": (transformers.Qwen2MoeConfig, dict(
            intermediate_size=96, moe_intermediate_size=48, shared_expert_intermediate_size=80, num_experts=6,
            num_experts_per_tok=2, norm_topk_prob=False)),
    }


def build_tiny_moe(case: str, path: Path, seed: int = 0):
    """The HF model of `case` (fp32, eval, eager attention), saved as safetensors under `path`."""
    import transformers
    config_cls, fields = family_cases()[case]
    torch.manual_seed(seed)
    hf_model = transformers.AutoModelForCausalLM.from_config(
        config_cls(**COMMON, **fields), torch_dtype=torch.float32, attn_implementation="eager").eval()
    randomize_routers_norms_and_biases(hf_model)
    hf_model.save_pretrained(path, safe_serialization=True)
    return hf_model


@torch.no_grad()
def randomize_routers_norms_and_biases(hf_model) -> None:
    """Routers drawn large enough for clear top-k choices; norms and biases moved off their
    initial ones and zeros, so that they count."""
    for name, param in hf_model.named_parameters():
        if name.endswith(".gate.weight"):  # the routers (not Qwen2-MoE's shared_expert_gate)
            param.copy_(torch.randn_like(param) * ROUTER_STD)
        elif name.endswith("bias") or "norm" in name:
            param.add_(torch.randn_like(param) * NORM_AND_BIAS_NOISE)


@torch.no_grad()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([token_ids])).logits[0].float()  # [tokens, vocab]


def check_logits_against_hf(runner, hf_model, prompt_lengths: list[int], num_steps: int, seed: int,
                            late_prompt_length: int = 0) -> None:
    """Prefills of `prompt_lengths` packed in one batch, then decodes from the runner's paged KV
    cache (a late prefill of `late_prompt_length` joining halfway, if not 0): at every step each
    sequence's last logits equal HF's over its whole sequence. Random next tokens (teacher
    forcing) keep the check independent of sampling."""
    from scheduler.sampling_params import SamplingParams
    from scheduler.scheduler import Scheduler, SchedulerConfig
    from scheduler.sequence import Sequence

    sched = Scheduler(SchedulerConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN))
    gen = torch.Generator().manual_seed(seed)

    def add(name: str, length: int) -> None:
        prompt = torch.randint(0, VOCAB_SIZE, (length,), generator=gen).tolist()
        sched.add_sequence(Sequence(name, prompt, SamplingParams(max_tokens=num_steps + 1)))

    for i, length in enumerate(prompt_lengths):
        add(str(i), length)
    for step in range(num_steps):
        if late_prompt_length and step == num_steps // 2:
            add("late", late_prompt_length)
        plan = sched.schedule()
        logits = runner.compute_logits(plan)
        for row, seq in enumerate(plan.scheduled):
            expected = hf_logits(hf_model, seq.sequence.all_token_ids)[-1]
            torch.testing.assert_close(logits[row], expected, atol=TOLERANCE, rtol=TOLERANCE,
                                       msg=lambda m: f"step {step}, sequence {seq.sequence.seq_id}: {m}")
        sched.update(plan, torch.randint(0, VOCAB_SIZE, (len(plan.scheduled),), generator=gen).tolist())
