"""The README's perplexity table: SmolLM2-135M in each format, scored by `tinyvllm eval
perplexity` and by the checkpoint's reference implementation over the same windows of one text.

    python -m tests.model.make_tool_checkpoints CKPTS --model smollm2
    python -m tests.model.perplexity_table CKPTS [--topic types] [--window 512] [--rows ...]

The text is `pydoc_data.topics.topics[TOPIC]` of the running CPython: the Language Reference
section that `help(TOPIC)` shows ("types": "The standard type hierarchy"), written to
CKPTS/TOPIC.txt. Each of our rows runs `tinyvllm eval perplexity --device cpu --dtype float32
--window W --model MODEL [FLAGS] TEXT` in a child process; its reference (`reference_model`:
transformers in float32) scores the same token ids here over the same windows (`make_windows`,
no overlap). The rows quantized at load by tinyvllm have no other implementation to compare
with; every row also shows its distance from the float model.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from tests.conftest import hf_prompt_logprobs
from tests.model.make_tool_checkpoints import REPO, reference_model
from tinyvllm.entrypoints.eval_cli import PerplexityResult, make_windows

MAX_DIFFERENCE = 0.005
"""The issue's bar: our perplexity within 0.5% of the reference's."""
GGUF = "gguf"
"""Row.model of the bundled GGUF file (the default model)."""


@dataclass(frozen=True)
class Row:
    label: str
    model: str  # a checkpoint directory under CKPTS, or GGUF
    flags: tuple[str, ...] = ()  # more flags of eval perplexity
    reference: Optional[str] = None  # the checkpoint whose reference_model scores this row
    reference_label: str = ""


TRANSFORMERS = "transformers"
ON_GGUF = "transformers on the GGUF dequantized"
COMPRESSED_TENSORS = "transformers + compressed-tensors"
AUTO_ROUND = "auto-round's dequantization"
ROWS = {
    "float": Row("float32 (the GGUF dequantized)", "float", (), "float", TRANSFORMERS),
    "gguf": Row("GGUF Q4_1, packed", GGUF, (), "float", ON_GGUF),
    "gguf-dequantize": Row("GGUF Q4_1", GGUF, ("--dequantize",), "float", ON_GGUF),
    "llmcompressor-w4a16": Row("llm-compressor W4A16", "llmcompressor-w4a16", (),
                               "llmcompressor-w4a16", COMPRESSED_TENSORS),
    "llmcompressor-w8a8": Row("llm-compressor W8A8", "llmcompressor-w8a8", (),
                              "llmcompressor-w8a8", COMPRESSED_TENSORS),
    "llmcompressor-fp8": Row("llm-compressor FP8 dynamic", "llmcompressor-fp8", (),
                             "llmcompressor-fp8", COMPRESSED_TENSORS),
    "autoround-gptq": Row("auto-round auto_gptq", "autoround-gptq", (), "autoround-gptq",
                          AUTO_ROUND),
    "autoround-awq": Row("auto-round auto_awq", "autoround-awq", (), "autoround-awq", AUTO_ROUND),
    "autoround": Row("auto-round auto_round", "autoround", (), "autoround", AUTO_ROUND),
    "int8": Row("float32", "float", ("--quantization", "int8")),
    "fp8": Row("float32", "float", ("--quantization", "fp8")),
}
"""Rows by name; the first is the float model the last column compares with."""


def write_text(out: Path, topic: str) -> Path:
    import pydoc_data.topics

    path = out / f"{topic}.txt"
    path.write_text(pydoc_data.topics.topics[topic], encoding="utf-8")
    return path


def model_path(ckpts: Path, model: str) -> str:
    if model == GGUF:
        from tinyvllm.model_files import default_model_path

        return str(default_model_path())
    return str(ckpts / model)


def ours(model: str, flags: tuple[str, ...], text: Path, window: int) -> PerplexityResult:
    """`tinyvllm eval perplexity` on the CPU in float32, in a child process."""
    done = subprocess.run(
        [sys.executable, "-m", "tinyvllm", "eval", "perplexity", "--device", "cpu", "--dtype",
         "float32", "--window", str(window), "--model", model, *flags, str(text)],
        cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"eval perplexity --model {model} {flags}:\n{done.stderr[-3000:]}")
    printed = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    return PerplexityResult(int(printed["tokens scored"]), float(printed["mean NLL"]))


def reference_perplexity(model, token_ids: list[int], window: int,
                         stride: Optional[int] = None) -> PerplexityResult:
    """The perplexity of `model` (a transformers causal LM) over eval perplexity's windows."""
    nll = []
    for w in make_windows(len(token_ids), window, stride or window):
        logprobs = hf_prompt_logprobs(model, token_ids[w.begin:w.end])  # token k + 1 at k
        nll += (-logprobs[w.first_scored - w.begin - 1:]).tolist()
    return PerplexityResult(len(nll), math.fsum(nll) / len(nll))


def token_ids(model: str, text: str) -> list[int]:
    """The ids eval perplexity scores: the model's tokenizer in tinyvllm, no BOS."""
    from tinyvllm.tokenization import load_tokenizer

    return load_tokenizer(model).encode(text, add_special_tokens=False)


def _percent(a: float, b: float) -> str:
    return f"{100 * (a / b - 1):+.2f}%"


def table(ckpts: Path, rows: list[Row], text: Path, window: int) -> list[str]:
    """Markdown lines of the table, each row computed (ours, then its reference) as it comes."""
    content = text.read_text(encoding="utf-8")
    references: dict[tuple[str, tuple[int, ...]], PerplexityResult] = {}
    lines = ["| format | tinyvllm | reference | reference implementation | difference "
             "| vs float32 |", "|---|---:|---:|---|---:|---:|"]
    float_ppl = None
    for row in rows:
        start = time.perf_counter()
        model = model_path(ckpts, row.model)
        mine = ours(model, row.flags, text, window)
        ids = tuple(token_ids(model, content))
        theirs, difference = None, "-"
        if row.reference is not None:
            key = (row.reference, ids)
            if key not in references:
                references[key] = reference_perplexity(
                    reference_model(ckpts / row.reference), list(ids), window)
            theirs = references[key]
            assert theirs.num_tokens == mine.num_tokens, (row.label, theirs, mine)
            within = abs(mine.perplexity / theirs.perplexity - 1) <= MAX_DIFFERENCE
            difference = (f"{_percent(mine.perplexity, theirs.perplexity)} "
                          f"{'(within 0.5%)' if within else '**(misses 0.5%)**'}")
        float_ppl = float_ppl or mine.perplexity  # the first row is the float model
        flags = f" `{' '.join(row.flags)}`" if row.flags else ""
        lines.append(f"| {row.label}{flags} | {mine.perplexity:.3f} | "
                     f"{f'{theirs.perplexity:.3f}' if theirs else '-'} | "
                     f"{row.reference_label or '-'} | {difference} | "
                     f"{_percent(mine.perplexity, float_ppl)} |")
        print(f"{lines[-1]}  ({mine.num_tokens} tokens, {time.perf_counter() - start:.0f} s)",
              file=sys.stderr, flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpts", type=Path, help="the OUT of make_tool_checkpoints --model smollm2")
    parser.add_argument("--topic", default="types", help="a key of pydoc_data.topics.topics")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS),
                        help="rows to compute (default: all; the first is the float model the last "
                        "column compares with)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    text = write_text(args.ckpts, args.topic)
    print(f"text: pydoc_data.topics.topics[{args.topic!r}] of Python "
          f"{sys.version.split()[0]}, window {args.window}", flush=True)
    for line in table(args.ckpts, [ROWS[r] for r in args.rows], text, args.window):
        print(line, flush=True)


if __name__ == "__main__":
    main()
