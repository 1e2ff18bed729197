"""Where a decode step's GPU time goes: `tinyvllm bench latency --profile-kernels N`.

After the timed requests, one more request runs through the engine: its prompt and first tokens
unrecorded, then N steps recorded with torch.profiler's CUDA activity (every kernel and copy,
kernels inside CUDA graphs included). With programmatic dependent launch a kernel starts before
its predecessor ends, so durations overlap and do not add up to the step; each kernel is
charged its *marginal* time instead: its end minus the latest end before it (nothing when it ends
inside another's span). Marginal times and idle gaps add up to the recorded span. Per kernel
name (template arguments kept: they tell instantiations apart): launches, marginal and busy
microseconds per step. Where every step launches the same sequence, the longest run of a
repeated block of launches in it (a model's decoder layers) is reported too, launch by launch
in order, so that one instantiation serving two places of a layer (o_proj and down_proj) is
seen at each.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

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
class BlockSlot:
    name: str
    marginal_us: float  # per occurrence
    busy_us: float      # per occurrence


@dataclass
class RepeatedBlock:
    repeats: int            # per step
    slots: list[BlockSlot]  # in launch order

    @property
    def marginal_us(self) -> float:
        """One occurrence of the block."""
        return sum(s.marginal_us for s in self.slots)


@dataclass
class KernelProfile:
    num_steps: int
    span_us: float      # per step: first start to last end of the recording, over num_steps
    idle_us: float      # per step: time no recorded kernel or copy ran
    kernels: list[KernelTime]  # by marginal time, largest first
    block: Optional[RepeatedBlock] = None  # where the steps launch alike

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
    charged = _charged(events)
    if not charged or num_steps <= 0:
        return KernelProfile(max(num_steps, 0), 0.0, 0.0, [])
    calls: collections.Counter = collections.Counter()
    marginal: collections.Counter = collections.Counter()
    busy: collections.Counter = collections.Counter()
    first, last_end, idle = charged[0][0], charged[0][0], 0.0
    for start, end, name, charge in charged:
        calls[name] += 1
        busy[name] += end - start
        marginal[name] += charge
        idle += max(0.0, start - last_end)
        last_end = max(last_end, end)
    kernels = [KernelTime(n, calls[n] / num_steps, marginal[n] / num_steps, busy[n] / num_steps)
               for n in sorted(calls, key=lambda n: (-marginal[n], n))]
    return KernelProfile(num_steps, (last_end - first) / num_steps, idle / num_steps, kernels,
                         repeated_block(charged, num_steps))


def _charged(events: Iterable[tuple[float, float, str]]) -> list[tuple[float, float, str, float]]:
    """The events in start order with their short names and marginal times."""
    out = []
    last_end = None
    for start, end, name in sorted(events):
        charge = 0.0
        if last_end is None or end > last_end:
            charge = end - (start if last_end is None else max(start, last_end))
            last_end = end
        out.append((start, end, short_name(name), charge))
    return out


def repeated_block(charged: Sequence[tuple[float, float, str, float]],
                   num_steps: int) -> Optional[RepeatedBlock]:
    """The longest run of a block of launches repeated back to back within a step (the most
    launches covered; the shortest block among equals), averaged over its occurrences in every
    step; None unless the steps launch the same names in the same order, or nothing repeats."""
    if num_steps <= 0 or not charged or len(charged) % num_steps:
        return None
    per_step = len(charged) // num_steps
    steps = [charged[i * per_step:(i + 1) * per_step] for i in range(num_steps)]
    names = [e[2] for e in steps[0]]
    if any([e[2] for e in step] != names for step in steps[1:]):
        return None
    best = (0, 0, 0)  # (launches covered, -period, start)
    for period in range(1, per_step // 2 + 1):
        for start in range(per_step - 2 * period + 1):
            if names[start] != names[start + period]:
                continue
            block = names[start:start + period]
            repeats = 1
            while names[start + repeats * period:start + (repeats + 1) * period] == block:
                repeats += 1
            if repeats > 1 and (repeats * period, -period) > best[:2]:
                best = (repeats * period, -period, start)
    covered, period, start = best[0], -best[1], best[2]
    if not covered:
        return None
    repeats = covered // period
    occurrences = repeats * num_steps
    slots = []
    for j in range(period):
        at = [step[start + r * period + j] for step in steps for r in range(repeats)]
        slots.append(BlockSlot(names[start + j], sum(e[3] for e in at) / occurrences,
                               sum(e[1] - e[0] for e in at) / occurrences))
    return RepeatedBlock(repeats, slots)


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


def _cut(name: str) -> str:
    return name if len(name) <= 110 else name[:107] + "..."


def table_rows(p: KernelProfile, limit: int = 30) -> list[list[Any]]:
    return [[_cut(k.name), k.calls_per_step, k.marginal_us, k.busy_us] for k in p.kernels[:limit]]


def block_rows(block: RepeatedBlock) -> list[list[Any]]:
    """The repeated block's launches in order, then its total."""
    return ([[i, _cut(s.name), s.marginal_us, s.busy_us] for i, s in enumerate(block.slots)]
            + [["", "the block", block.marginal_us, ""]])
