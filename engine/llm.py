"""The offline API: `LLM(model=...).generate(prompts, params)`."""
from __future__ import annotations

from typing import Sequence

from engine.config import EngineConfig
from engine.engine import LLMEngine, RequestFailedError
from engine.outputs import RequestOutput
from scheduler.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Batch generation over the engine. Keyword arguments are the engine's knobs by their flags'
    names with underscores (`max_num_seqs`, `cpu_attention`, `kv_cache_gib`: `tandem serve --help`
    lists them, engine/config.py declares them), and the config fields that have no flag by their
    own names (`swap_cooldown_iterations`, ...); `EngineConfig.from_flat` routes them, and refuses
    an unknown one naming it.

    LLM()                                          # the embedded default model (real weights)
    LLM(model="/path/model.gguf") / LLM(model="/path/hf_dir")
    LLM(model="llama-3.1-8b", load_format="dummy") # a preset shape with random weights
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        if model is not None:
            kwargs["model"] = model
        self.engine = LLMEngine(EngineConfig.from_flat(**kwargs))

    def close(self) -> None:
        """Stop the engine's threads (the testbed's GPU thread); the LLM is unusable after."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, sampling_params)]
        return self._run(ids)

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (dummy weights)")
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(c), add_special_tokens=False)
                   for c in conversations]
        return self.generate(prompts, sampling_params)

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        try:
            while len(finished) < len(request_ids):
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                for failure in self.engine.take_failures():
                    raise RequestFailedError(f"request {failure.request_id} failed: {failure.reason}")
        except BaseException:
            for request_id in request_ids:
                if request_id not in finished:
                    self.engine.abort_request(request_id)
            raise
        return [finished[i] for i in request_ids]
