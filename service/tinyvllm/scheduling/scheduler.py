"""Token-budget continuous batching with chunked prefill, prefix-cache hits and preemption.

The scheduler speaks tokens, not phases: each step, every request gets `num_new_tokens` so that
`num_computed_tokens` chases `num_tokens`. Running requests go first (decodes and unfinished
prefill chunks), then waiting ones while the budget, `max_num_seqs` and the KV pool allow. When the
pool runs dry, the lowest-priority latest running request is preempted: its blocks are freed and it
is recomputed later from its prompt plus the tokens it already produced, so it finishes with the
same output.

A step is scheduled before the previous one's sampled tokens are known (async scheduling, one
step in flight), so the bookkeeping that the next schedule depends on happens at schedule time:
`num_computed_tokens` advances and the KV slot of every token to be sampled is allocated, which
that token holds as a placeholder (`num_output_placeholders`) until `update` learns its id. A
decode whose input is a placeholder takes the id from the previous step's samples on the device.
`update` drops the work of a request that finished (or was aborted) while a step for it was in
flight; its blocks were freed at the finish, which is safe because later steps' kernels are
ordered after the in-flight one on the stream.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Iterable, Optional, Sequence

from tinyvllm.config import SchedulerConfig, SpeculativeConfig
from tinyvllm.errors import InvalidRequestError
from tinyvllm.scheduling.kv_cache_manager import KVCacheManager
from tinyvllm.scheduling.output import (DraftTokens, NewRequest, PromptLogprobs, SampledTokens,
                                        ScheduledRequest, SchedulerOutput)
from tinyvllm.scheduling.request import EngineCoreOutput, FinishReason, Request, RequestStatus
from tinyvllm.scheduling.spec_decode import SpecDecodePolicy


_may_read_output_tokens = attrgetter("may_read_output_tokens")


@dataclass
class _Step:
    """A scheduled step's requests, in row order, kept by the scheduler until `update` (the
    message itself carries ids only)."""

    out: SchedulerOutput
    requests: list[Request] = field(default_factory=list)
    verifies: bool = False  # some request verifies drafts: its accepted count is unknown
    verifies_sampled: bool = False  # ... and samples (not greedy)


class WaitingQueue:
    """FCFS deque, or a heap ordered by (priority, arrival) under the priority policy."""

    def __init__(self, policy: str):
        self.policy = policy
        self._fcfs: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._fcfs) + len(self._heap)

    def __iter__(self):
        return iter(list(self._fcfs) if self.policy == "fcfs" else [e[3] for e in self._heap])

    def add(self, request: Request, front: bool = False) -> None:
        if self.policy == "fcfs":
            (self._fcfs.appendleft if front else self._fcfs.append)(request)
        else:
            key = (request.priority, request.arrival_time, next(self._counter), request)
            heapq.heappush(self._heap, key)

    def peek(self) -> Request:
        return self._fcfs[0] if self.policy == "fcfs" else self._heap[0][3]

    def pop(self) -> Request:
        return self._fcfs.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[3]

    def remove(self, requests: set[Request]) -> None:
        """Drop several requests at once (aborts): one O(n) pass, not one per request."""
        if self.policy == "fcfs":
            self._fcfs = deque(r for r in self._fcfs if r not in requests)
        else:
            self._heap = [e for e in self._heap if e[3] not in requests]
            heapq.heapify(self._heap)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 speculative: SpeculativeConfig = SpeculativeConfig()):
        if config.max_num_seqs is None or config.max_num_batched_tokens is None:
            config = config.for_device("cpu")  # the engine passes the runner's sizes
        self.config = config
        self.spec = SpecDecodePolicy(speculative)
        self.kv = kv
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self._finished_ids: list[str] = []
        self._steps: dict[int, _Step] = {}  # scheduled, not yet updated
        self._next_step_id = 0
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # computed prompt tokens, cumulative (metrics)

    # --- requests in and out ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already running")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        found = [self.requests[i] for i in request_ids if i in self.requests]
        if not found:
            return
        aborted = set(found)
        self.running = [r for r in self.running if r not in aborted]
        self.waiting.remove(aborted)
        for request in found:
            self._finish(request, FinishReason.ABORT)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _num_enqueued(self) -> int:
        """Requests running or waiting: the batch that speculation's disable_by_batch_size
        compares (vLLM's "enqueued requests"), so a batch that is still filling does not
        speculate, and give up scheduling ahead, for the few steps before it is full."""
        return len(self.running) + len(self.waiting)

    def can_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled before the one in flight is processed.

        With prompt lookup in one process (`SpecDecodePolicy.drafts_behind`), a request whose
        last token is in flight drafts behind it (the lookup's continuation past that token,
        verified after it), and a request whose verification is in flight is scheduled as if
        every draft were accepted: its next input is the verification's last token, taken from
        the device. Where fewer were accepted, `update` drops that step's work for the request
        (its KV lies past the rolled-back tokens), a whole step's GPU time at batch 1, so this
        is assumed only while each verifying request's previous verification accepted every
        draft (`Request.spec_streak`: text it is copying). Only greedy verifications are
        assumed so: a sampled one's seeded noise on the CPU is drawn in order, which a dropped
        step would disturb. Otherwise a verification in flight keeps the next step waiting, as
        does a request that could speculate with a draft model (its drafts come after the
        step), or with prompt lookup where drafting behind is off (tensor parallelism), except
        while every such request pauses its drafts (`Request.spec_skip`); and so does a request
        with a token in flight that needs its output ids on the host to sample. While
        speculation steps aside (a large batch, or drafts that do not pay) only the last
        applies."""
        for step in self._steps.values():
            if step.verifies and (step.verifies_sampled or not self.spec.drafts_behind or not all(
                    r.spec_streak for r, s in zip(step.requests, step.out.scheduled)
                    if s.draft_token_ids)):
                return False
        if (self.spec.active(self._num_enqueued()) and not self.spec.drafts_behind
                and any(r.can_speculate and not r.spec_skip for r in self.running)):
            return False
        # (Most batches: no request may read them, found by `map` over the running requests.)
        return not any(map(_may_read_output_tokens, self.running)) or not any(
            r.may_read_output_tokens and r.num_output_placeholders
            and r.sampling_reads_output_tokens for r in self.running)

    # --- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """The next step, as a message for the workers. The scheduler keeps the step's requests
        until `update(out, ...)` (a step with nothing scheduled needs no update)."""
        out = SchedulerOutput(step_id=self._next_step_id, finished_request_ids=self._finished_ids)
        self._next_step_id += 1
        self._finished_ids = []
        step = _Step(out)
        budget = self.config.max_num_batched_tokens
        budget, preempted = self._schedule_running(step, budget)
        if not preempted:
            self._schedule_waiting(step, budget)
        if out.scheduled:
            self._steps[out.step_id] = step
        return out

    def _add_scheduled(self, step: _Step, request: Request, num_new: int, block_offset: int,
                       new_block_ids: list[int], drafts: list[int] = (),
                       num_lookahead: int = 0) -> None:
        """Put the request in the step, after its allocation, and advance it: its computed
        tokens and, where the step samples, its placeholders (`_drop_scheduled` takes both
        back from a request preempted later in the same schedule)."""
        r = request
        step.requests.append(r)
        if drafts:
            step.verifies = True
            step.verifies_sampled = step.verifies_sampled or not r.sampling_params.greedy
        out = step.out
        r.last_step_id = out.step_id
        r.in_flight_drafts = drafts  # read only, while the step is in flight
        computed = r.num_computed_tokens
        completes = computed + num_new >= (len(r.prompt_token_ids) + len(r.output_token_ids)
                                           + r.num_output_placeholders)
        # ScheduledRequest's fields in order (positional: this runs per request per step).
        out.scheduled.append(ScheduledRequest(
            r.request_id, num_new, computed, completes, block_offset, new_block_ids,
            list(drafts) if drafts else [], num_lookahead))
        r.num_computed_tokens = computed + num_new
        r.num_output_placeholders += completes

    def _drop_scheduled(self, step: _Step, victim: Request) -> int:
        """Take a preempted request out of the step (`_preempt` has reset its computed tokens;
        the placeholder the step gave it goes here); returns the tokens it had there."""
        freed = 0
        keep_requests, keep_scheduled = [], []
        for r, s in zip(step.requests, step.out.scheduled):
            if r is victim:
                freed += s.num_new_tokens
                r.num_output_placeholders -= s.completes_sequence
            else:
                keep_requests.append(r)
                keep_scheduled.append(s)
        # In place: `_schedule_running` appends to these lists after a preemption.
        step.requests[:], step.out.scheduled[:] = keep_requests, keep_scheduled
        return freed

    def _schedule_running(self, step: _Step, budget: int) -> tuple[int, bool]:
        preempted_any = False
        speculate = self.spec.active(self._num_enqueued())
        draft_model = speculate and self.spec.config.uses_draft_model
        block_size = self.kv.block_size
        running, max_model_len = self.running, self.max_model_len
        step_requests, scheduled, step_id = step.requests, step.out.scheduled, step.out.step_id
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            # This runs per request per step: written out inline, _add_scheduled too for a plain
            # decode with room. A token in flight that is the request's last (max_tokens or the
            # context length; a verification in flight counts its drafts as accepted) would be
            # computed for nothing, and a step in flight that will be dropped is waited for.
            num_prompt, num_output = len(request.prompt_token_ids), len(request.output_token_ids)
            placeholders = request.num_output_placeholders
            if placeholders:
                behind = placeholders + len(request.in_flight_drafts)
                if (request.discard_step_id >= 0 or num_output + behind >= request.max_tokens
                        or num_prompt + num_output + behind >= max_model_len):
                    i += 1
                    continue
            num_tokens = num_prompt + num_output + placeholders
            computed = request.num_computed_tokens
            num_new = num_tokens - computed  # at least 1, at most the budget
            if num_new > budget:
                num_new = budget
            elif num_new < 1:
                num_new = 1
            drafts = self._draft(request, budget) if speculate and num_new == 1 else ()
            if drafts:
                num_new += len(drafts)
            lookahead = (self._lookahead(request, computed + num_new, True)
                         if draft_model else 0)
            # A running request has its KV entry: its allocation made it.
            block_offset = len(request.kv_blocks.block_ids)
            end = computed + num_new
            if not lookahead and end <= block_offset * block_size:
                # its blocks have room: most requests
                if drafts:
                    self._add_scheduled(step, request, num_new, block_offset, [], drafts)
                else:  # a plain decode or prompt chunk: _add_scheduled's work, written out
                    step_requests.append(request)
                    request.last_step_id = step_id
                    request.in_flight_drafts = drafts
                    completes = end >= num_tokens
                    scheduled.append(ScheduledRequest(request.request_id, num_new, computed,
                                                      completes, block_offset, [], [], 0))
                    request.num_computed_tokens = end
                    request.num_output_placeholders = placeholders + completes
                budget -= num_new
                i += 1
                continue
            while (allocated := self._allocate(request, num_new, lookahead)) is None:
                victim = self._pick_victim()
                victim_index = self.running.index(victim)
                if victim_index < i:  # scheduled earlier in this step: give its tokens back
                    i -= 1
                self._preempt(victim, step)
                budget += self._drop_scheduled(step, victim)
                preempted_any = True
                if victim is request:
                    break
            else:
                new_blocks, lookahead = allocated
                self._add_scheduled(step, request, num_new, block_offset, new_blocks, drafts,
                                    lookahead)
                budget -= num_new
                i += 1
                continue
            # The request preempted itself; running[i] is now the next one.
        return budget, preempted_any

    def _schedule_waiting(self, step: _Step, budget: int) -> None:
        speculate = self.spec.active(self._num_enqueued())
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if request.num_output_placeholders:
                break  # preempted with a token in flight: resumes once `update` has it
            hits, num_cached = ([], 0)
            # vLLM's rule: a prompt whose logprobs are asked is computed whole, never cached.
            wants_prompt_logprobs = request.sampling_params.prompt_logprobs is not None
            if request.num_computed_tokens == 0 and not wants_prompt_logprobs:
                hits, num_cached = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_cached
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            lookahead = self._lookahead(request, num_cached + num_new, speculate)
            allocated = self._allocate(request, num_new, lookahead, hits)
            if allocated is None:
                break
            new_blocks, lookahead = allocated
            self.waiting.pop()
            if request.num_cached_tokens < 0:  # first scheduled: the workers learn of it
                request.num_cached_tokens = num_cached
                step.out.new_requests.append(NewRequest(
                    request.request_id, request.prompt_token_ids, request.sampling_params,
                    sorted(request.eos_token_ids)))
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_scheduled(step, request, num_new, 0, new_blocks, (), lookahead)
            budget -= num_new

    def _draft(self, request: Request, budget: int) -> list[int]:
        """Draft tokens for a decoding request, capped so that the step fits the budget and the
        accepted tokens plus the bonus one never pass max_tokens or the context length."""
        if not request.can_speculate:
            return []
        if request.spec_skip:  # counted down in steps scheduled ahead too (see above)
            request.spec_skip -= 1
            return []
        # Tokens in flight before the drafts: the last token of each step in flight, and a
        # verification's drafts, assumed accepted.
        assumed = request.in_flight_drafts if request.num_output_placeholders else []
        behind = request.num_output_placeholders
        if behind and not self.spec.drafts_behind:
            return []
        if request.spec_k == 0:
            request.spec_k = self.spec.initial_k()
        room = min(request.max_tokens - request.num_output_tokens,
                   self.max_model_len - request.num_tokens) - behind - len(assumed) - 1
        k = min(request.spec_k, budget - 1, room)
        return self.spec.propose(request, k, behind, assumed) if k > 0 else []

    def _lookahead(self, request: Request, end: int, speculate: bool) -> int:
        """Draft-model speculation: how many tokens the worker should draft after a step that
        computes the request up to position `end` (exclusive). Only for a step that samples
        (end reaches the sequence's end) with nothing else in flight; capped so that the drafts'
        positions stay inside the context and the next step's verification can use them."""
        if (not speculate or not self.spec.config.uses_draft_model or not request.can_speculate
                or request.num_output_placeholders or end < request.num_tokens):
            return 0
        if request.spec_k == 0:
            request.spec_k = self.spec.initial_k()
        # Next step: at least one more output token, then drafts up to max_tokens - 1.
        room = min(request.max_tokens - request.num_output_tokens - 2, self.max_model_len - end)
        return max(0, min(request.spec_k, room))

    def _allocate(self, request: Request, num_new: int, lookahead: int,
                  hits: Sequence[int] = ()) -> Optional[tuple[list[int], int]]:
        """KV slots for the step's num_new tokens and the drafts' lookahead positions, else for
        the step's tokens alone (drafts never cost a preemption). Returns (new block ids, the
        lookahead granted), or None."""
        new_blocks = self.kv.allocate_slots(request, num_new + lookahead, hits)
        if new_blocks is None and lookahead:
            lookahead = 0
            new_blocks = self.kv.allocate_slots(request, num_new, hits)
        return None if new_blocks is None else (new_blocks, lookahead)

    def _pick_victim(self) -> Request:
        """The lowest-priority running request, latest arrival first among equals."""
        if self.config.policy == "fcfs":
            return self.running[-1]
        return max(self.running, key=lambda r: (r.priority, r.arrival_time))

    def _preempt(self, request: Request, step: _Step) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.draft_token_ids = []  # its resumption samples a new last token
        request.num_preemptions += 1
        self.num_preemptions += 1
        step.out.preempted_request_ids.append(request.request_id)
        self.waiting.add(request, front=True)

    # --- after the model ran --------------------------------------------------------------------

    def update(self, out: SchedulerOutput, sampled: SampledTokens,
               prompt_logprobs: Optional[PromptLogprobs] = None,
               draft_token_ids: Optional[DraftTokens] = None) -> list[EngineCoreOutput]:
        """Take in a step's sampled tokens and collect what the frontend must hear.

        `sampled` maps request ids whose sequence was completed this step to the sampled token
        (and its logprobs when asked); `prompt_logprobs` the requests whose prompt logprobs the
        step computed to them: a prefill chunk that samples nothing reports those in an output
        without tokens. The step may have been scheduled before the previous one was processed:
        a request that has finished since gets nothing, and one preempted since still gets its
        token (its KV was computed; it is recomputed with the rest). `draft_token_ids` are the
        draft model's proposals after the step's tokens (draft-model speculation).
        """
        prompt_logprobs = prompt_logprobs or {}
        outputs = []
        done: list[Request] = []  # finished while running: out of the running list at the end
        step = self._steps.pop(out.step_id)
        step_id = out.step_id
        running, finished = RequestStatus.RUNNING, RequestStatus.FINISHED
        publish = self.kv.cache_computed_blocks if self.kv.enable_caching else None
        block_size, max_model_len = self.kv.block_size, self.max_model_len
        for request, s in zip(step.requests, out.scheduled):
            request_id = request.request_id
            num_prompt = len(request.prompt_token_ids)
            if s.num_computed_tokens < num_prompt:  # (a prompt chunk)
                self.num_prompt_tokens += min(s.num_new_tokens,
                                              request.num_prompt_tokens - s.num_computed_tokens)
            if request.status == finished:
                continue  # finished or aborted while this step was in flight: dropped
            if request.last_step_id == step_id:  # nothing of it in flight after this
                request.last_step_id, request.in_flight_drafts = -1, ()
            if request.discard_step_id == step_id:  # behind a verification that fell short
                request.discard_step_id = -1
                request.num_output_placeholders -= s.completes_sequence
                continue
            if s.completes_sequence and (draft_token_ids or request.draft_token_ids):
                # drafts are of its last token: replaced whenever it grows
                request.draft_token_ids = (draft_token_ids or {}).get(request_id, [])
            if s.draft_token_ids:
                outputs.append(self._update_verified(request, s, sampled[request_id][0],
                                                     step_id, done))
                continue
            request.num_output_placeholders -= s.completes_sequence
            output_token_ids = request.output_token_ids
            if publish is not None and request.status == running:
                # Its computed tokens whose ids are known: a block filled since the last publish
                # is published (`cache_computed_blocks`' own test, inline). Before the append, so
                # only blocks of known token ids. Their KV is written by this step or queued in
                # the one in flight: any step that reads a published block is launched later, so
                # its kernels run after those writes.
                num_full = num_prompt + len(output_token_ids)
                if request.num_computed_tokens < num_full:
                    num_full = request.num_computed_tokens
                if num_full // block_size > request.kv_blocks.num_published:
                    publish(request)
            new_prompt_logprobs = prompt_logprobs.get(request_id) if prompt_logprobs else None
            if not s.completes_sequence:  # a prefill chunk short of the end of the sequence
                if new_prompt_logprobs is not None:
                    outputs.append(EngineCoreOutput(
                        request_id=request_id, new_token_ids=[],
                        new_prompt_logprobs=new_prompt_logprobs,
                        num_cached_tokens=request.num_cached_tokens))
                continue
            token_id, logprobs = sampled[request_id]
            output_token_ids.append(token_id)
            num_output = len(output_token_ids)
            # `_check_stop` only where it could stop: a stop token, max_tokens or the context.
            reason = (self._check_stop(request, token_id)
                      if (token_id in request.stop_token_set or num_output >= request.max_tokens
                          or num_prompt + num_output >= max_model_len) else None)
            if reason is not None:
                self._remove(request, done)
                self._finish(request, reason)
            elif s.num_lookahead_tokens:  # the drafts' slots: past the computed tokens
                self.kv.trim(request)
            # EngineCoreOutput's fields in order (positional: this runs per request per step).
            outputs.append(EngineCoreOutput(
                request_id, [token_id], [logprobs] if logprobs is not None else None,
                new_prompt_logprobs, reason, request.stop_reason, request.num_cached_tokens))
        if done:  # one pass, not a list.remove per request (many finish in a step)
            gone = set(done)
            self.running = [r for r in self.running if r not in gone]
        return outputs

    def _update_verified(self, request: Request, s: ScheduledRequest, token_ids: list[int],
                         step_id: int, done: list[Request]) -> EngineCoreOutput:
        """A verification step's outcome: token_ids are the accepted drafts and the target's own
        token. The rejected drafts' KV is rolled back (num_computed_tokens, and the blocks that
        only they used), then the tokens are appended up to a stop, and the full blocks of
        accepted tokens published. A step scheduled behind it (`can_schedule_ahead`) assumed
        every draft accepted: then its positions stand; else its work for the request is
        dropped when it comes (`discard_step_id`) and rolled back with the rejected drafts'.
        A request preempted since keeps only the tokens (it is recomputed)."""
        request.num_output_placeholders -= 1
        num_accepted = len(token_ids) - 1
        if request.status == RequestStatus.RUNNING:
            behind = request.last_step_id not in (-1, step_id)  # a step scheduled after this
            fell_short = behind and num_accepted < len(s.draft_token_ids)
            if fell_short:
                request.discard_step_id = request.last_step_id
                request.last_step_id, request.in_flight_drafts = -1, ()
            if not behind or fell_short:
                request.num_computed_tokens = s.num_computed_tokens + len(token_ids)
                self.kv.trim(request)
        request.spec_k = self.spec.next_k(request.spec_k, len(s.draft_token_ids), num_accepted)
        self.spec.back_off(request, len(s.draft_token_ids), num_accepted)
        full = num_accepted == len(s.draft_token_ids)
        request.spec_streak = request.spec_streak + 1 if full else 0
        new_token_ids, reason = [], None
        for token_id in token_ids:
            request.output_token_ids.append(token_id)
            new_token_ids.append(token_id)
            reason = self._check_stop(request, token_id)
            if reason is not None:
                break
        if reason is not None:
            self._remove(request, done)
            self._finish(request, reason)
        elif request.status == RequestStatus.RUNNING:
            self.kv.cache_computed_blocks(request)
        return EngineCoreOutput(
            request_id=request.request_id, new_token_ids=new_token_ids,
            finish_reason=reason,
            stop_reason=request.stop_reason, num_cached_tokens=request.num_cached_tokens)

    def _check_stop(self, request: Request, token_id: int) -> Optional[FinishReason]:
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return FinishReason.STOP
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return FinishReason.STOP
        if num_output >= request.max_tokens or \
                len(request.prompt_token_ids) + num_output >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _remove(self, request: Request, done: list[Request]) -> None:
        """Take a request out of the waiting queue where it went when it was preempted with a
        token in flight, else put it in `done`, the running requests that `update` takes out of
        the running list once it has processed the step."""
        if request.status == RequestStatus.RUNNING:
            done.append(request)
        else:
            self.waiting.remove({request})

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kv.forget(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
