"""`tinyvllm bench host`: the host's work per decode step, with the model's forward replaced.

Every step of a running batch costs host time outside the model: the scheduler's schedule and
update, the worker's records (`apply_scheduler_output`), input preparation and sampling. On a GPU
that time hides behind the step in flight until it grows past the GPU's step time (at large
batches: cuda/NOTES.md, "the host side of a step"). This benchmark times it alone, on the CPU:
a tiny random model whose forward is replaced by fixed logits (all zeros, so every greedy row
samples token 0), B requests of --input-len tokens decoding --output-len tokens each, through
`EngineCore.step()` as the other engine benchmarks drive it. Per batch size: host microseconds
per step (the best of --rounds runs) and each phase's share. Compare trees by running it on each,
one after the other on the same machine; the figures depend on the CPU.

    tinyvllm bench host --batch-sizes 64 256 1024 [--async-scheduling]
"""

from __future__ import annotations

import argparse
import collections
import time
from typing import Any, Optional, Sequence

import torch

PHASES = ("schedule", "apply", "prepare", "sample", "update")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256, 1024],
                        help="Requests decoding together (default: 64 256 1024).")
    parser.add_argument("--input-len", type=int, default=64, help="Prompt tokens.")
    parser.add_argument("--output-len", type=int, default=64,
                        help="Output tokens per request (steps per run).")
    parser.add_argument("--rounds", type=int, default=5,
                        help="Runs per batch size; the fastest is reported (default 5).")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="Schedule each step while the previous one is in flight, as on a "
                        "GPU (default on): decodes then take their input from the step before.")
    parser.add_argument("--out", default=None,
                        help="JSON record path (default: bench-results/host-<timestamp>.json).")


def _timed(obj: Any, name: str, phase: str, acc: collections.Counter) -> None:
    """Wrap obj.name so that its time is added to acc[phase]."""
    fn = getattr(obj, name)

    def wrapped(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[phase] += time.perf_counter() - start
    setattr(obj, name, wrapped)


def build(max_num_seqs: int, max_len: int, async_scheduling: bool):
    """An engine over a tiny random Llama on the CPU whose forward returns fixed logits, and the
    per-phase time counter its wrapped methods add to."""
    from tinyvllm.bench.engine_runs import build_engine
    from tinyvllm.config import EngineConfig
    from tinyvllm.model.loader import LoadedModel
    from tinyvllm.model.synthetic import make_random_model, tiny_arch
    from tinyvllm.tokenization.synthetic import synthetic_tokenizer
    from tinyvllm.worker import model_runner
    from tinyvllm.worker.model_runner import ModelRunner

    arch = tiny_arch(vocab_size=512, max_position_embeddings=max(512, max_len))
    model = make_random_model(arch, seed=0, dtype=torch.float32, device=torch.device("cpu"))
    loaded = LoadedModel(model=model, arch=arch, tokenizer=synthetic_tokenizer(512, "tiny"),
                         name="tiny", path=None, max_model_len=max_len)
    blocks_per_seq = -(-max_len // 16)
    config = EngineConfig.from_kwargs(
        model="tiny", device="cpu", max_model_len=max_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(max_num_seqs, 2048),
        num_kv_blocks=max_num_seqs * blocks_per_seq + 1, async_scheduling=async_scheduling)
    runner = ModelRunner(config, loaded)
    logits = torch.zeros(max(max_num_seqs, 2048), arch.vocab_size)

    def forward(inputs):  # the sampled rows' logits; nothing runs for the prompt rows
        return logits[:len(inputs.sampled_requests)], None
    runner._forward = forward
    engine = build_engine(config, runner)
    acc: collections.Counter = collections.Counter()
    _timed(engine.scheduler, "schedule", "schedule", acc)
    _timed(engine.scheduler, "update", "update", acc)
    _timed(runner, "_prepare_inputs", "prepare", acc)
    _timed(runner.sampler, "sample", "sample", acc)
    apply = model_runner.apply_scheduler_output  # a module function: put back after the runs
    _timed(model_runner, "apply_scheduler_output", "apply", acc)
    return engine, acc, (model_runner, apply)


def measure(batch: int, input_len: int, output_len: int, rounds: int,
            async_scheduling: bool) -> dict[str, Any]:
    """The fastest of `rounds` runs: host us per decode step, in all and by phase."""
    from tinyvllm.bench.engine_runs import run_batch

    engine, acc, (module, apply) = build(batch, input_len + output_len + 1, async_scheduling)
    try:
        prompts = [[(i * 7 + j) % 400 + 10 for j in range(input_len)] for i in range(batch)]
        run_batch(engine, prompts, [4] * batch, lambda: None)  # warm-up
        best: Optional[dict[str, Any]] = None
        for _ in range(rounds):
            acc.clear()
            run = run_batch(engine, prompts, [output_len] * batch, lambda: None)
            per_step = {p: 1e6 * acc[p] / run.num_steps for p in PHASES}
            result = {"batch_size": batch, "us_per_step": 1e6 * run.elapsed_s / run.num_steps,
                      "num_steps": run.num_steps, "phases_us": per_step}
            if best is None or result["us_per_step"] < best["us_per_step"]:
                best = result
        return best
    finally:
        module.apply_scheduler_output = apply


def main(argv: Optional[Sequence[str]] = None) -> int:
    from tinyvllm.bench.common import device_name, git_rev, print_table, write_record

    parser = argparse.ArgumentParser(prog="tinyvllm bench host", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = [measure(b, args.input_len, args.output_len, args.rounds, args.async_scheduling)
               for b in args.batch_sizes]
    record = {"git_rev": git_rev(), "device": device_name(torch.device("cpu")),
              "torch": torch.__version__, "async_scheduling": args.async_scheduling,
              "input_len": args.input_len, "output_len": args.output_len,
              "rounds": args.rounds, "results": results}
    path = write_record("host", record, args.out)
    print(f"wrote {path}")
    mode = "async scheduling" if args.async_scheduling else "synchronous steps"
    print_table(f"host: us per decode step, forward replaced by fixed logits, {mode} "
                f"(the fastest of {args.rounds} runs)",
                ["batch", "step", *PHASES, "per request"],
                [[r["batch_size"], r["us_per_step"], *(r["phases_us"][p] for p in PHASES),
                  r["us_per_step"] / r["batch_size"]] for r in results])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
