"""The frontend process never imports torch.

`tinyvllm serve` runs the gRPC and HTTP servers, tokenization, detokenization and metrics in one
process and the model in another; importing torch in the first would cost seconds of start-up
with the event loop blocked, and its memory. Each check runs in a fresh interpreter, since this
test session has torch loaded already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

FRONTEND_MODULES = (
    "tinyvllm.entrypoints.cli", "tinyvllm.entrypoints.serve", "tinyvllm.server.app",
    "tinyvllm.server.http_api", "tinyvllm.frontend.engine_client",
    "tinyvllm.frontend.output_processor", "tinyvllm.frontend.prompts", "tinyvllm.tokenization",
    "tinyvllm.client",
)


def _heavy_modules_after(code: str) -> list[str]:
    """Run `code` in a fresh interpreter; return the torch modules it left loaded."""
    script = "import importlib, json, sys\n" + textwrap.dedent(code) + textwrap.dedent("""
        print(json.dumps(sorted(m for m in sys.modules if m == "torch"
                                or m.startswith(("torch.", "tinyvllm.model.", "tinyvllm.worker")))))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_server_and_frontend_imports_load_no_torch():
    loaded = _heavy_modules_after(f"""
        for name in {FRONTEND_MODULES!r}:
            importlib.import_module(name)
        from tinyvllm.entrypoints.cli import build_parser
        build_parser()  # `tinyvllm serve` imports every subcommand's module
        from tinyvllm.entrypoints.serve import resolve_model
        from tinyvllm.tokenization import load_tokenizer
        assert resolve_model("llama3-8b-shape") is None
        assert load_tokenizer("llama3-8b-shape").encode("hi", add_special_tokens=False) == [104, 105]
    """)
    assert loaded == []


def test_the_bundled_models_tokenizer_and_output_path_load_no_torch(smollm2_path):
    """What the frontend does for the default model: resolve it, load its tokenizer from the
    GGUF, tokenize a chat, and detokenize engine outputs."""
    loaded = _heavy_modules_after("""
        import asyncio
        from tinyvllm.entrypoints.serve import resolve_model
        from tinyvllm.frontend.output_processor import OutputProcessor
        from tinyvllm.frontend.prompts import PromptInput, PromptTokenizer
        from tinyvllm.sampling_params import SamplingParams
        from tinyvllm.scheduling.request import EngineCoreOutput, FinishReason
        from tinyvllm.tokenization import load_tokenizer

        resolve_model(None)
        tokenizer = load_tokenizer(None)
        prompts = PromptTokenizer(tokenizer, max_prompt_bytes=1 << 20)
        chat = PromptInput(messages=[{"role": "user", "content": "Hi"}])
        text, ids = asyncio.run(prompts.tokenize(chat))
        prompts.close()
        processor = OutputProcessor(tokenizer.backend)
        processor.add_request("r", text, ids, SamplingParams(), arrival_time=0.0)
        out = processor.process_outputs([EngineCoreOutput(
            "r", tokenizer.encode("Hello", add_special_tokens=False),
            finish_reason=FinishReason.LENGTH)])
        assert out.request_outputs[0].outputs[0].text == "Hello"
    """)
    assert loaded == []


def test_the_check_sees_torch():
    """The probe itself works: the model loader does import torch."""
    assert "torch" in _heavy_modules_after("import tinyvllm.model.loader")
