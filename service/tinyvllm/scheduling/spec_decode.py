"""Speculative decoding on the scheduling side: the n-gram proposer, per-request k, statistics.

Torch-free like the rest of `engine/`. The n-gram (prompt lookup) proposer needs only token ids,
so it runs at schedule time: the scheduler knows each request's draft before it allocates KV
slots, and a request without a match costs nothing. A draft model needs the model, so the worker
runs it after a step's sampling (`worker/draft_model.py`) for the requests the scheduler gave
lookahead slots, and returns the drafts beside the sampled tokens; the request's next schedule
takes them like an n-gram draft. The verification (target forward over the
k + 1 positions, acceptance sampling) is the model runner's; the rollback of rejected tokens is
`Scheduler.update`'s.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from tinyvllm import _core
from tinyvllm.config import SpeculativeConfig
from tinyvllm.scheduling.request import Request

_MIN_CAPACITY = 256


class NgramProposer:
    """Prompt lookup: find an earlier occurrence of the sequence's last n tokens (n from
    prompt_lookup_max down to prompt_lookup_min, longest first) and propose the tokens that
    followed it.

    The matcher is C++ (`_core.ngram_propose`: one pass over the sequence, about 1 us for 2,000
    tokens; it runs on every decode step of a speculating request, synchronous with the GPU);
    `ngram_propose_ref` states the rule in numpy.
    """

    def __init__(self, min_n: int, max_n: int):
        assert 1 <= min_n <= max_n, (min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: np.ndarray, k: int) -> list[int]:
        """Up to k draft tokens following the longest matched suffix ([] when none matches).

        Args:
            token_ids: [num_tokens] int64, the request's prompt + output.
            k: most tokens to propose.
        """
        return _core.ngram_propose(token_ids, self.min_n, self.max_n, k)


def ngram_propose_ref(token_ids: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The rule `_core.ngram_propose` implements, in numpy: the candidates are the positions
    holding the last token, and each longer suffix filters them further."""
    num_tokens = token_ids.shape[0]
    if k <= 0 or num_tokens <= min_n:
        return []
    # ends: the earlier windows that end with the sequence's last token; window w ends at
    # position w + n - 1 < num_tokens - 1, so at least one token follows it.
    ends = np.flatnonzero(token_ids[:-1] == token_ids[-1])
    n_matched = 1
    best = ends
    while ends.size and n_matched < max_n and n_matched < num_tokens - 1:
        back = ends - n_matched
        back = back[back >= 0]
        ends = back[token_ids[back] == token_ids[num_tokens - 1 - n_matched]] + n_matched
        if ends.size:
            n_matched += 1
            best = ends
        else:
            break
    if n_matched < min_n or best.size == 0:
        return []
    # The latest occurrence with k tokens after it (the continuation seen most recently), else
    # the earliest (the longest continuation: in a periodic sequence the latest match is
    # followed by one period only).
    full = best[best + k < num_tokens]
    start = int(full[-1] if full.size else best[0]) + 1
    return token_ids[start:start + k].tolist()


@dataclass
class SpecDecodeStats:
    """Cumulative counters (vLLM's spec_decode metrics): verification steps (drafts), draft
    tokens proposed, draft tokens accepted, and accepted tokens by position in the draft."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.append(0)
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification step yields on average: accepted drafts + the target's own."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class SpecDecodePolicy:
    """Which requests speculate this step and with how many tokens.

    Speculation steps aside while `disable_by_batch_size` requests or more run or wait: the
    batch already keeps the hardware busy and rejected drafts would only add work. Per request, k adapts to
    the recent acceptance (`adaptive`): +1 after a step that accepted every draft, -1 (down to 1)
    after one that accepted none, so a request whose drafts keep failing spends one extra
    position per step instead of k. With prompt lookup, once even one-token drafts fail, the
    request drafts nothing for 1, 2, 4, ... `MAX_SKIP` steps (doubling with each such miss in a
    row, reset by any accepted token): text that does not repeat keeps finding short matches
    that fail, and a verification step costs more than a plain one (on a CPU a two-row step
    about 1.3x). Under async scheduling, lookups that match nothing pause the same way
    (`_looked_up`), so that steps over text that does not repeat are scheduled ahead.
    """

    MAX_SKIP = 16
    MAX_NO_MATCH_SKIP = 8

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.proposer = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
                         if config.method == "ngram" else None)
        self.stats = SpecDecodeStats()
        self.cost = SpecCostMonitor()
        # Set by the engine (async scheduling): prompt lookup drafts behind a token in flight
        # (one process: a verification's result is then taken after the step launched behind
        # it, which tensor-parallel ranks, taking it inside the step, do not allow), else
        # lookups that match nothing pause (`_looked_up`).
        self.drafts_behind = False
        self.pause_without_match = False

    def schedule_ahead(self, async_scheduling: bool, tensor_parallel_size: int) -> None:
        """How drafting meets steps scheduled ahead (see the attributes above)."""
        self.drafts_behind = (async_scheduling and self.proposer is not None
                              and tensor_parallel_size == 1)
        self.pause_without_match = async_scheduling and not self.drafts_behind

    def active(self, num_running: int) -> bool:
        limit = self.config.disable_by_batch_size
        if not self.config.enabled or (limit is not None and num_running >= limit):
            return False
        return self.cost.active()

    def observe_step(self, duration_s: float, num_emitted: int, speculated: bool) -> None:
        """A decode-only step's time and tokens; duration 0: a step that is only counted (one
        with prefill chunks is not comparable)."""
        self.cost.observe(duration_s, num_emitted, speculated)

    def initial_k(self) -> int:
        return self.config.num_speculative_tokens

    def propose(self, request: Request, k: int, behind: int = 0,
                assumed: list[int] = ()) -> list[int]:
        """Up to k draft tokens for the request: the n-gram proposer's, or the draft model's
        that the worker made after the step that sampled the request's last token (taken).

        behind: tokens in flight after the known ones and the `assumed` ones (a verification's
        drafts in flight, taken as accepted) (`drafts_behind`). The lookup then runs over those
        tokens and skips `behind` of the continuation it finds: if the match holds, those are
        the tokens in flight, and the drafts follow them. Whether it holds is for the
        verification to find out: the first draft is checked against what the target makes of
        the real token in flight, so drafts after a wrong guess are rejected, never wrong."""
        if self.proposer is not None:
            tokens = _token_array(request)
            if assumed:
                tokens = np.concatenate([tokens, np.asarray(assumed, dtype=np.int64)])
            found = self.proposer.propose(tokens, k + behind)
            self._looked_up(request, bool(found))
            return found[behind:]
        if behind:
            return []
        drafts, request.draft_token_ids = request.draft_token_ids[:k], []
        return drafts

    def _looked_up(self, request: Request, matched: bool) -> None:
        """With steps scheduled ahead (`pause_without_match`), a request whose suffix matched
        nothing pauses its lookups for 1, 2, 4 ... MAX_NO_MATCH_SKIP steps, doubling while
        nothing matches and reset by a match: a lookup needs the step before it processed, so
        each one makes a synchronous step, and over text that does not repeat the pause lets
        the steps run ahead instead (on an H100 a plain step of the bundled model costs about
        0.6 ms ahead against 0.8 ms synchronous). A match may be found a few steps late.
        Without scheduling ahead (the CPU) a pause would save nothing, and there is none."""
        if not self.pause_without_match or not self.config.adaptive:
            return
        if matched:
            request.spec_no_match = 0
            return
        pause = min(self.MAX_NO_MATCH_SKIP, 1 << request.spec_no_match)
        request.spec_skip = max(request.spec_skip, pause)
        request.spec_no_match += 1

    def next_k(self, k: int, num_draft_tokens: int, num_accepted: int) -> int:
        """A request's k for its next step after a verification of num_draft_tokens."""
        self.stats.observe(num_draft_tokens, num_accepted)
        if not self.config.adaptive:
            return k
        if num_accepted == num_draft_tokens:
            return min(self.config.num_speculative_tokens, k + 1)
        if num_accepted == 0:
            return max(1, k - 1)
        return k


    def back_off(self, request: Request, num_draft_tokens: int, num_accepted: int) -> None:
        """After a verification: the steps the request drafts nothing (see the class)."""
        if not self.config.adaptive or self.proposer is None:
            return
        if num_accepted:
            request.spec_misses = 0
            return
        if num_draft_tokens > 1:  # k is still shrinking
            return
        request.spec_skip = min(self.MAX_SKIP, 1 << request.spec_misses)
        request.spec_misses += 1


def _token_array(request: Request) -> np.ndarray:
    """The request's prompt + output as int64, [num_tokens]: a buffer kept on the request and
    extended by the tokens appended since the last call (tokens are only ever appended), so a
    step converts a few Python ints instead of the whole sequence."""
    buf, n = request.spec_token_buffer, request.spec_token_buffer_len
    total = request.num_tokens
    if buf is None or buf.shape[0] < total:
        grown = np.empty(max(_MIN_CAPACITY, 2 * total), dtype=np.int64)
        if buf is not None:
            grown[:n] = buf[:n]
        buf = request.spec_token_buffer = grown
    if n < total:
        p = request.num_prompt_tokens
        if n < p:
            buf[n:p] = request.prompt_token_ids[n:]
            n = p
        buf[n:total] = request.output_token_ids[n - p:]
        request.spec_token_buffer_len = total
    return buf[:total]


class SpecCostMonitor:
    """Whether speculation pays: tokens per second of the last `WINDOW` decode steps that
    verified drafts against the last `WINDOW` that did not (total tokens over total time, so a
    few rejections in a row do not swing it). Plain steps scheduled ahead count as they run
    (async scheduling while speculation steps aside), which is what turning speculation off
    gives. When verifying is slower (drafts mostly rejected, or hardware on which a step of k + 1
    tokens costs much more than a step of one), speculation steps aside for `OFF_STEPS` steps,
    then tries again, so it comes back when it pays again; each loss in a row doubles the pause
    (up to `OFF_STEPS << MAX_BACKOFF`), so on text where it never pays the trials cost a few
    steps in hundreds, and a win resets it. A batch in which every step
    speculates has no plain steps to compare with: after `WINDOW` such steps speculation steps
    aside for `MEASURE_STEPS` steps, only to measure them (a short pause: at batch 1 with drafts
    that pay, a long one would cost more than speculation gains over a few hundred tokens); the
    speculative steps already measured stay in their window, so the next one decides."""

    WINDOW = 16  # steps of each kind compared
    MIN_SAMPLES = 4  # of each kind before deciding
    OFF_STEPS = 32  # the pause after speculation lost
    MAX_BACKOFF = 4  # doublings of that pause after losses in a row (at most 512 steps)
    MEASURE_STEPS = 2 * MIN_SAMPLES  # the pause that measures plain steps
    MARGIN = 0.97  # speculative steps must reach 97% of plain steps' rate to stay on

    def __init__(self) -> None:
        # speculated -> (duration_s, tokens) of its last WINDOW steps
        self.steps: dict[bool, deque[tuple[float, int]]] = {
            True: deque(maxlen=self.WINDOW), False: deque(maxlen=self.WINDOW)}
        self.off_steps_left = 0
        self.losses = 0  # decisions lost in a row

    def active(self) -> bool:
        return self.off_steps_left == 0

    def rate(self, speculated: bool) -> float:
        """Tokens per second over the kind's window (0 before any step)."""
        steps = self.steps[speculated]
        seconds = sum(d for d, _ in steps)
        return sum(n for _, n in steps) / seconds if seconds > 0 else 0.0

    def observe(self, duration_s: float, num_emitted: int, speculated: bool) -> None:
        if self.off_steps_left:
            self.off_steps_left -= 1
        if duration_s <= 0 or num_emitted == 0:
            return
        self.steps[speculated].append((duration_s, num_emitted))
        spec, plain = self.steps[True], self.steps[False]
        if not speculated or len(spec) < self.MIN_SAMPLES:
            return
        if len(plain) < self.MIN_SAMPLES:
            if len(spec) == self.WINDOW:  # plain steps never measured here: measure them
                self.off_steps_left = self.MEASURE_STEPS
        elif self.rate(True) < self.MARGIN * self.rate(False):
            self.off_steps_left = self.OFF_STEPS << min(self.losses, self.MAX_BACKOFF)
            self.losses += 1
            self.steps[True].clear()  # measured afresh when it comes back
        else:
            self.losses = 0
