"""Prompts to token ids (and ids to text) for the servers, without stalling the event loop.

```
PromptInput ─▶ byte-size limit (before any work) ─▶ small: tokenize inline
                                                  └▶ large: tokenize on a worker thread
chat: render the template ─▶ content carries special-token strings?
        no  ─▶ encode the rendering (template tokens parsed)
        yes ─▶ render again with each content fenced by random markers; encode the template's
              parts with special tokens parsed and the content parts as plain text
```

Large inputs go through the `*_batch` calls of `tokenizers`, which release the GIL while they
work (`Tokenizer.encode` / `decode` pick them by size); building the Python result still holds it
briefly (tens of ms per MB), so the byte limit also bounds how long one prompt can hold the loop.
"""

from __future__ import annotations

import asyncio
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, TypeVar

from tokenizers import Tokenizer as BackendTokenizer

from tinyvllm.errors import InvalidRequestError

T = TypeVar("T")

OFFLOAD_MIN_BYTES = 16 * 1024
"""Inputs at least this large are tokenized on a worker thread; smaller ones cost less than the
thread hop."""

OFFLOAD_MIN_TOKENS = 4096
"""Detokenize requests with at least this many ids run on a worker thread."""

DEFAULT_BYTES_PER_TOKEN = 32
"""Without --max-prompt-bytes, a prompt may have up to this many bytes per token of the context
length. Real text averages 3 to 5 bytes per token; a prompt that needs more than 32 could not fit
the context anyway."""

NUM_WORKERS = 2


@dataclass(frozen=True)
class PromptInput:
    """A request's prompt before tokenization: exactly one of the three is set."""

    text: Optional[str] = None
    token_ids: Optional[list[int]] = None
    messages: Optional[list[dict[str, str]]] = None

    def num_bytes(self) -> int:
        """UTF-8 size of the text to tokenize (0 for token ids)."""
        if self.text is not None:
            return _utf8_len(self.text)
        if self.messages is not None:
            return sum(_utf8_len(m["content"]) + _utf8_len(m["role"]) for m in self.messages)
        return 0


def _utf8_len(s: str) -> int:
    # len(s) is a lower bound; encode only when it could matter (non-ASCII text).
    return len(s) if s.isascii() else len(s.encode("utf-8", "surrogatepass"))


class PromptTokenizer:
    """Tokenizes prompts for a server: limits first, large inputs off the event loop.

    Args:
        tokenizer: the model's `tinyvllm.tokenization.Tokenizer`.
        max_prompt_bytes: prompts larger than this are refused before tokenizing.
        parse_special_in_chat_content: parse special-token strings inside chat message content as
            special tokens (off: content is plain text, so a user cannot forge a turn).
    """

    def __init__(self, tokenizer: Any, *, max_prompt_bytes: int,
                 parse_special_in_chat_content: bool = False) -> None:
        self.tokenizer = tokenizer
        self.max_prompt_bytes = max_prompt_bytes
        self.parse_special_in_chat_content = parse_special_in_chat_content
        self._executor = ThreadPoolExecutor(NUM_WORKERS, thread_name_prefix="tinyvllm-tokenize")
        added = tokenizer.backend.get_added_tokens_decoder().values()
        self._special_strings = tuple(t.content for t in added if t.special)
        self._plain_backend: Optional[BackendTokenizer] = None

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def tokenize(self, prompt: PromptInput) -> tuple[Optional[str], list[int]]:
        """(prompt text, prompt token ids).

        Raises:
            InvalidRequestError: the prompt is larger than max_prompt_bytes ("prompt"), or a
                chat the template cannot render ("chat").
        """
        if prompt.token_ids is not None:
            return None, prompt.token_ids
        num_bytes = prompt.num_bytes()
        if num_bytes > self.max_prompt_bytes:
            raise InvalidRequestError(
                "prompt", f"is {num_bytes} bytes; the most this server tokenizes is "
                f"{self.max_prompt_bytes} (--max-prompt-bytes)")
        if prompt.text is not None:
            text = prompt.text
            return text, await self._run(num_bytes, self.tokenizer.encode, text)
        return await self._run(num_bytes, self.encode_chat, prompt.messages)

    async def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str:
        big = len(token_ids) >= OFFLOAD_MIN_TOKENS
        return await self._run(OFFLOAD_MIN_BYTES if big else 0, self.tokenizer.decode,
                               token_ids, skip_special_tokens)

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, on a worker thread when `size` (bytes or similar) is large."""
        return await self._run(size, fn, *args)

    async def _run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        if size < OFFLOAD_MIN_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # --- chat ------------------------------------------------------------------------------------

    def encode_chat(self, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
        """Render `messages` with the chat template (generation prompt appended) and encode it.

        Raises:
            InvalidRequestError: the template rejects the messages, or cannot keep content
                that holds special-token strings apart from its own text.
        """
        text = self._render(messages)
        if self.parse_special_in_chat_content or not self._has_special(messages):
            # A rendered template carries its own special tokens (BOS included).
            return text, self.tokenizer.encode(text, add_special_tokens=False)
        return self._encode_fenced(messages)

    def _render(self, messages: list[dict[str, str]]) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as e:
            raise InvalidRequestError("chat", str(e)) from None

    def _has_special(self, messages: list[dict[str, str]]) -> bool:
        return any(s in m["content"] for m in messages for s in self._special_strings)

    def _encode_fenced(self, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
        # Random markers: a client cannot put them in its content to confuse the split.
        open_, close = f"\x00{secrets.token_hex(8)}\x01", f"\x01{secrets.token_hex(8)}\x00"
        fenced = [{**m, "content": f"{open_}{m['content']}{close}"} for m in messages]
        rendered = self._render(fenced)
        ids: list[int] = []
        parts: list[str] = []
        rest = rendered
        while rest:
            head, found, rest = rest.partition(open_)
            ids += self.tokenizer.encode(head, add_special_tokens=False) if head else []
            parts.append(head)
            if not found:
                break
            content, found, rest = rest.partition(close)
            if not found or open_ in content:
                raise InvalidRequestError(
                    "chat", "message content holds special-token strings that this model's "
                    "chat template does not keep apart from its own text")
            ids += _encode_plain(self._plain(), content) if content else []
            parts.append(content)
        return "".join(parts), ids

    def _plain(self) -> BackendTokenizer:
        """A copy of the backend that encodes special-token strings as ordinary text."""
        if self._plain_backend is None:
            plain = BackendTokenizer.from_str(self.tokenizer.backend.to_str())
            plain.encode_special_tokens = True
            self._plain_backend = plain
        return self._plain_backend


def _encode_plain(backend: BackendTokenizer, text: str) -> list[int]:
    # encode_batch releases the GIL (see the module docstring).
    return backend.encode_batch([text], add_special_tokens=False)[0].ids


def default_max_prompt_bytes(max_model_len: int) -> int:
    return max_model_len * DEFAULT_BYTES_PER_TOKEN
