"""The sim's prompt cache: the tokens a provider's prompt cache would read and write (pure).

A request's cacheable prefix is every message but the last: the system prompt and the
conversation so far (the last message is the new turn). It is cached when it is at
least :data:`MIN_TOKENS` long (Anthropic's minimum for a cache breakpoint on most
models), as if the client had put ``cache_control`` on the message before the new turn
(which is where Claude Code puts it); ``cache_control`` markers themselves are not read.

For such a request the sim reports, per model:

- **cache read**: the tokens of the longest run of leading messages, ending at a
  message boundary, that an earlier request had as its whole cacheable prefix;
- **cache write**: the rest of the cacheable prefix (the first time it is seen, all
  of it), which is then remembered for the next request.

So a second request with the same long system prompt and a new question reads the
system prompt from the cache; a conversation's next turn reads what the turn before
wrote and writes the new messages. The dialects report the counts in their
provider's shape (Anthropic: ``cache_read_input_tokens`` and
``cache_creation_input_tokens``, both left out of ``input_tokens``; OpenAI:
``prompt_tokens_details.cached_tokens``, part of ``prompt_tokens``). At most
:data:`MAX_PREFIXES` prefixes are remembered, the least recently used forgotten
first. No I/O here.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

#: The shortest prefix (in tokens) that is cached.
MIN_TOKENS = 1024
#: Prefixes remembered (across models), least recently used dropped first.
MAX_PREFIXES = 4096


class PromptCache:
    """The prefixes seen (by model and content) and their lengths in tokens."""

    def __init__(self, max_prefixes: int = MAX_PREFIXES) -> None:
        self._max = max_prefixes
        self._seen: OrderedDict[bytes, int] = OrderedDict()

    def account(self, model: str, messages: Sequence[tuple[bytes, int]]) -> tuple[int, int]:
        """(tokens read from the cache, tokens written to it) for a request of ``model``
        whose messages are ``messages``: each its content (any bytes that tell messages
        apart) and its tokens. Remembers the request's cacheable prefix."""
        prefix = messages[:-1]
        total = sum(tokens for _, tokens in prefix)
        if total < MIN_TOKENS:
            return 0, 0
        chain = hashlib.sha256(model.encode())
        read = tokens_so_far = 0
        key = b""
        for content, tokens in prefix:
            chain.update(hashlib.sha256(content).digest())
            key = chain.copy().digest()
            tokens_so_far += tokens
            if key in self._seen:
                read = tokens_so_far
        if key in self._seen:
            self._seen.move_to_end(key)
        else:
            self._seen[key] = total
            while len(self._seen) > self._max:
                self._seen.popitem(last=False)
        return read, total - read
