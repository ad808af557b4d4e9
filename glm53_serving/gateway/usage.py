"""A tenant's tokens, from the workers' own usage figures at the end of each answer.

/generate puts `meta_info` (prompt, completion and cached tokens) in every answer; OpenAI routes
put `usage` in a non-streamed answer, and in a stream only when the client asked
(`stream_options.include_usage`). So that every stream is counted, the launcher starts the
workers with `--stream-response-default-include-usage` (every OpenAI stream ends with a
usage-only event: `"choices":[]` and `"usage":{...}`), and the gateway takes that event out of
the streams of clients that did not ask for it (`UsageEventFilter`), after reading it: each
client gets the stream the OpenAI API promises it. Pure functions, tested without sockets.
"""

from __future__ import annotations

import re

TAIL_BYTES = 4096  # the answer's last bytes are kept: the usage figures are there
_FIELDS = {kind: re.compile(rf'"{kind}_tokens":\s*(\d+)'.encode()) for kind in ("prompt", "completion", "cached")}
_OPENAI = ("/v1/chat/completions", "/v1/completions")


def usage_of(tail: bytes) -> dict[str, int]:
    """The worker's own token counts from the end of its answer: `usage` (OpenAI) or `meta_info`
    (/generate, every event): the last figure of each kind. Empty when the answer carries none."""
    out = {}
    for kind, pattern in _FIELDS.items():
        found = pattern.findall(tail)
        if found:
            out[kind] = int(found[-1])
    return out


def hides_usage(endpoint: str, body: dict) -> bool:
    """Whether the client's stream must not show the usage event the workers add: an OpenAI
    stream whose client did not ask for `stream_options.include_usage`."""
    if endpoint not in _OPENAI or body.get("stream") is not True:
        return False
    options = body.get("stream_options")
    return not (isinstance(options, dict) and options.get("include_usage") is True)


def _usage_only(event: bytes) -> bool:
    return event.startswith(b"data: {") and b'"choices":[]' in event and b'"usage":{' in event


class UsageEventFilter:
    """Passes a server-sent event stream through, less its usage-only events. Holds back at most
    the one event not yet complete (events end with a blank line)."""

    __slots__ = ("_pending",)

    def __init__(self):
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk if self._pending else chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._pending = data
            return b""
        complete, self._pending = data[: cut + 2], data[cut + 2 :]
        if b'"usage":{' not in complete:
            return complete  # every event but the last: no scan per event
        return b"".join(e + b"\n\n" for e in complete.split(b"\n\n")[:-1] if not _usage_only(e))

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest
