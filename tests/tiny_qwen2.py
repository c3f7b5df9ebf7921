"""A random tiny Qwen2 (Q/K/V biases) saved as a Hugging Face safetensors checkpoint, for tests."""
import torch
import transformers


def save_tiny_qwen2(path, **config) -> str:
    """Seeded random weights of a Qwen2 with `config` at `path`, its biases made to count (they are
    zero at init); -> str(path)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(**config),
                                                          torch_dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)
