"""Incremental detokenization with stop strings and stream hold-back.

Text is produced by `tokenizers.decoders.DecodeStream`, one token at a time; it returns None while a
multi-byte character (emoji, CJK split over byte tokens) is incomplete, so a character always comes
out whole.

Stop strings are searched after every token, in the new text plus the (max_stop_len - 1) chars
before it: anything older was already searched. The output ends at the first match.

Hold-back: while unfinished, the last (max_stop_len - 1) chars are not released to the stream,
because they may be the start of a stop string that the next token completes; a stop string must
never reach a client that asked not to see it. Released text therefore always lies before any
later match, and truncating at a match never takes back released text.
"""

from __future__ import annotations

from typing import Optional

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from tinyvllm.sampling_params import SamplingParams

_REPLACEMENT_CHAR = "\ufffd"
MIN_PROMPT_CONTEXT_TOKENS = 4
MAX_PROMPT_CONTEXT_TOKENS = 24
"""The stream is primed with a short prompt suffix (vLLM's numbers) so that decoders that strip a
leading space (SentencePiece) see the first output token in context."""


class IncrementalDetokenizer:
    """One request's output text, built token by token.

    Attributes:
        token_ids: output token ids taken so far; ends with the token that completed a stop
            string, if one did (later tokens are dropped, like vLLM).
        stop_string: the stop string that ended the output, or None.
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams,
                 prompt_token_ids: Optional[list[int]] = None):
        self.tokenizer = tokenizer
        self.stop_strings: list[str] = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop_strings), default=0)
        self.token_ids: list[int] = []
        self.stop_string: Optional[str] = None

        # Text = released parts + pending; pending always holds the last (max_stop_len - 1)
        # chars while unfinished, so the stop-string search window lies inside it.
        self._released_parts: list[str] = []
        self._pending = ""
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        for token_id in _prompt_context(tokenizer, prompt_token_ids or []):
            self._stream.step(tokenizer, token_id)  # prompt text is not output

    @property
    def output_text(self) -> str:
        """The text so far (a matched stop string removed unless include_stop_str_in_output)."""
        return self.released_text + self._pending

    @property
    def released_text(self) -> str:
        """The text handed out by get_next_delta so far (all of output_text once finished)."""
        if len(self._released_parts) > 1:
            self._released_parts = ["".join(self._released_parts)]
        return self._released_parts[0] if self._released_parts else ""

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> Optional[str]:
        """Append tokens; return the stop string if one now ends the output.

        Args:
            new_token_ids: tokens generated since the last update.
            stop_terminated: the engine ended the request on the last of these tokens (EOS or a
                stop token id); that token's text is left out unless include_stop_str_in_output.
        Returns:
            The matched stop string (tokens after the one completing it are dropped), or None.
        """
        if self.stop_string is not None:
            return None  # finished; late tokens from an engine step in flight are ignored
        last = len(new_token_ids) - 1
        for i, token_id in enumerate(new_token_ids):
            self.token_ids.append(token_id)
            if i == last and stop_terminated and not self.include_stop_str_in_output:
                break
            chunk = self._stream.step(self.tokenizer, token_id)
            if not chunk:
                continue
            self._pending += chunk
            if self.stop_strings and self._truncate_at_stop(len(chunk)):
                return self.stop_string
        return None

    def get_next_delta(self, finished: bool) -> str:
        """Text not yet released, less the held-back tail while unfinished."""
        hold = 0 if finished or self.stop_string is not None else self.max_stop_len - 1
        cut = max(0, len(self._pending) - hold)
        delta, self._pending = self._pending[:cut], self._pending[cut:]
        if delta:
            self._released_parts.append(delta)
        return delta

    def _truncate_at_stop(self, chunk_len: int) -> bool:
        """Search the new chunk plus the (max_stop_len - 1) chars before it; cut at a match."""
        window_start = max(0, len(self._pending) - chunk_len - (self.max_stop_len - 1))
        best: Optional[tuple[int, str]] = None
        for stop in self.stop_strings:
            pos = self._pending.find(stop, window_start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return False
        pos, self.stop_string = best
        end = pos + len(self.stop_string) if self.include_stop_str_in_output else pos
        self._pending = self._pending[:end]
        return True


def _prompt_context(tokenizer: Tokenizer, prompt_token_ids: list[int]) -> list[int]:
    """The shortest prompt suffix of at least MIN_PROMPT_CONTEXT_TOKENS that does not start in
    the middle of a character (whose text would begin with a replacement char)."""
    n = len(prompt_token_ids)
    for length in range(min(MIN_PROMPT_CONTEXT_TOKENS, n), min(MAX_PROMPT_CONTEXT_TOKENS, n) + 1):
        suffix = prompt_token_ids[n - length:]
        if not tokenizer.decode(suffix, skip_special_tokens=False).startswith(_REPLACEMENT_CHAR):
            return suffix
    return prompt_token_ids[n - min(MAX_PROMPT_CONTEXT_TOKENS, n):]
