"""`tinyvllm eval perplexity`: a model's perplexity on a text file, from prompt logprobs.

The text is tokenized once (no BOS added) and cut into windows of `--window` tokens that start
every `--stride` tokens. Each window runs as a prompt with `prompt_logprobs=0` and `max_tokens=1`;
its first token is conditioned on nothing, and with overlapping windows (stride < window) a
token is scored once, by the first window that scores it with context (as Hugging Face's
sliding-window recipe). Perplexity = exp(mean negative log-likelihood over the scored tokens).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

from tinyvllm.config import add_engine_arguments, engine_config_from_args

DEFAULT_WINDOW = 512


@dataclass(frozen=True)
class Window:
    """Tokens [begin, end) of the text as one prompt; tokens [first_scored, end) count."""

    begin: int
    end: int
    first_scored: int


@dataclass(frozen=True)
class PerplexityResult:
    num_tokens: int  # tokens scored
    mean_nll: float  # nats per token

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)


def make_windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """Windows over num_tokens tokens; each scores the tokens no earlier window scored, from
    its second token on (the first has no context). Windows that would score nothing are left
    out."""
    if window < 2 or not 1 <= stride <= window:
        raise ValueError(f"need window >= 2 and 1 <= stride <= window, got window={window}, "
                         f"stride={stride}")
    windows, scored_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + window, num_tokens)
        first = max(scored_end, begin + 1)
        if first < end:
            windows.append(Window(begin, end, first))
            scored_end = end
        if end == num_tokens:
            break
    return windows


def perplexity(llm, token_ids: list[int], window: int, stride: int) -> PerplexityResult:
    """Run every window through `llm` (an `LLM`) and average the scored tokens' NLL."""
    from tinyvllm.sampling_params import SamplingParams

    windows = make_windows(len(token_ids), window, stride)
    if not windows:
        raise ValueError(f"the text has {len(token_ids)} token(s): at least 2 are needed")
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": token_ids[w.begin:w.end]} for w in windows],
                           params, use_tqdm=False)
    total, count = 0.0, 0
    for w, out in zip(windows, outputs):
        for i in range(w.first_scored, w.end):
            entries = out.prompt_logprobs[i - w.begin]
            total -= entries[token_ids[i]].logprob
            count += 1
    return PerplexityResult(count, total / count)


def register(subparsers) -> None:
    parser = subparsers.add_parser("eval", help="Evaluate a model offline.",
                                   description="Evaluate a model offline.")
    sub = parser.add_subparsers(dest="evaluation", required=True, metavar="EVALUATION")
    p = sub.add_parser(
        "perplexity", help="Perplexity of the model on a text file.",
        description=__doc__.split("\n\n", 1)[1].strip())
    p.add_argument("file", help="UTF-8 text file to score.")
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                   help=f"Tokens per window (prompt); default {DEFAULT_WINDOW}.")
    p.add_argument("--stride", type=int, default=None,
                   help="Tokens between window starts; default: the window (no overlap).")
    add_engine_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tinyvllm.entrypoints.llm import LLM

    try:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        print(f"tinyvllm eval perplexity: {e}", file=sys.stderr)
        return 2
    stride = args.window if args.stride is None else args.stride
    try:
        make_windows(2, args.window, stride)  # checks the sizes before the model loads
        llm = LLM.from_config(engine_config_from_args(args))
        token_ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
        result = perplexity(llm, token_ids, args.window, stride)
    except (FileNotFoundError, ValueError, NotImplementedError) as e:
        print(f"tinyvllm eval perplexity: {e}", file=sys.stderr)
        return 1
    print(f"tokens scored: {result.num_tokens}")
    print(f"mean NLL: {result.mean_nll:.6f}")
    print(f"perplexity: {result.perplexity:.6f}")
    return 0
