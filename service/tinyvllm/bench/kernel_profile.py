"""Where a decode step's GPU time goes: `tinyvllm bench latency --profile-kernels N`.

After the timed requests, one more request runs through the engine: its prompt and first tokens
unrecorded, then N steps recorded with torch.profiler's CUDA activity (every kernel and copy,
kernels inside CUDA graphs included). With programmatic dependent launch a kernel starts before
its predecessor ends, so durations overlap and do not add up to the step; each kernel is
charged its *marginal* time instead: its end minus the latest end before it (nothing when it ends
inside another's span). Marginal times and idle gaps add up to the recorded span. Per kernel
name (template arguments kept: they tell instantiations apart): launches, marginal and busy
microseconds per step.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Sequence

SKIPPED_TOKENS = 8
"""Output tokens of the profiled request before recording starts (its prefill and the first
decode steps, whose graphs and caches warm up)."""

_ids = itertools.count()  # profiled requests' ids


@dataclass
class KernelTime:
    name: str
    calls_per_step: float
    marginal_us: float  # per step
    busy_us: float      # per step: the kernel's own duration


@dataclass
class KernelProfile:
    num_steps: int
    span_us: float      # per step: first start to last end of the recording, over num_steps
    idle_us: float      # per step: time no recorded kernel or copy ran
    kernels: list[KernelTime]  # by marginal time, largest first

    def as_record(self) -> dict[str, Any]:
        return asdict(self)


def short_name(name: str) -> str:
    """A kernel signature without its `void` and its parameter list: `void ns::k<T, 1>(T*, int)`
    -> `ns::k<T, 1>`. Other activity names (copies, memsets) are kept."""
    if not name.startswith("void ") or not name.endswith(")"):
        return name
    depth = 0
    for i in range(len(name) - 1, -1, -1):  # the parameter list: the parenthesis closing last
        depth += {")": 1, "(": -1}.get(name[i], 0)
        if depth == 0:
            return name[len("void "):i]
    return name


def marginal_times(events: Iterable[tuple[float, float, str]], num_steps: int) -> KernelProfile:
    """(start_us, end_us, name) of a recording of num_steps steps -> per-name times per step."""
    ordered = sorted(events)
    if not ordered or num_steps <= 0:
        return KernelProfile(max(num_steps, 0), 0.0, 0.0, [])
    calls: collections.Counter = collections.Counter()
    marginal: collections.Counter = collections.Counter()
    busy: collections.Counter = collections.Counter()
    first, last_end, idle = ordered[0][0], ordered[0][0], 0.0
    for start, end, name in ordered:
        name = short_name(name)
        calls[name] += 1
        busy[name] += end - start
        if start > last_end:
            idle += start - last_end
        if end > last_end:
            marginal[name] += end - max(start, last_end)
            last_end = end
    kernels = [KernelTime(n, calls[n] / num_steps, marginal[n] / num_steps, busy[n] / num_steps)
               for n in sorted(calls, key=lambda n: (-marginal[n], n))]
    return KernelProfile(num_steps, (last_end - first) / num_steps, idle / num_steps, kernels)


def profile_decode(engine, prompt: Sequence[int], num_steps: int, sync: Callable[[], None],
                   activity=None) -> KernelProfile:
    """One request of `prompt` through `engine` (a CUDA engine), SKIPPED_TOKENS output tokens
    unrecorded, then num_steps steps recorded; the request then runs to its end. `activity`: what
    torch.profiler records (default CUDA; only CUDA events are counted, so the tests drive it on
    the CPU with CPU activity, recording no kernel)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from tinyvllm.bench.engine_runs import greedy
    from tinyvllm.scheduling.request import EngineCoreRequest

    request_id = f"kernel-profile-{next(_ids)}"
    engine.add_request(EngineCoreRequest(
        request_id=request_id, prompt_token_ids=list(prompt),
        sampling_params=greedy(SKIPPED_TOKENS + num_steps + 4), arrival_time=0.0))
    produced = 0
    while produced < SKIPPED_TOKENS and engine.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    sync()
    recorded = 0
    with profile(activities=[activity or ProfilerActivity.CUDA]) as prof:
        while recorded < num_steps and engine.has_unfinished_requests():
            engine.step()
            recorded += 1
        sync()
    while engine.has_unfinished_requests():
        engine.step()
    events = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
              if e.device_type == DeviceType.CUDA]
    return marginal_times(events, recorded)



def table_rows(p: KernelProfile, limit: int = 30) -> list[list[Any]]:
    return [[k.name if len(k.name) <= 110 else k.name[:107] + "...", k.calls_per_step,
             k.marginal_us, k.busy_us] for k in p.kernels[:limit]]
