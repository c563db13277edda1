"""``TimedAudio``: the tail of a call's phone audio that something may need again, with the call
second where it starts.

Three places keep such a tail: the streaming STT's replay for a reconnect (``ResilientSttSession``),
a batch STT fallback's next upload (``BatchSttSession``), and the audio heard before the call's STT
session is open (``LiveHearing``). Each keeps at most some seconds, drops what the words or the
gateway have ruled out, and needs to know which second its first byte is.
"""

from __future__ import annotations

BYTES_PER_SECOND = 8000
"""8 kHz mu-law: a byte a sample."""


class TimedAudio:
    """Contiguous 8 kHz mu-law audio starting at call second ``start``, at most ``keep_seconds``
    of it (the oldest goes first)."""

    __slots__ = ("_audio", "_keep_bytes", "start")

    def __init__(self, keep_seconds: float) -> None:
        self._audio = bytearray()
        self._keep_bytes = int(keep_seconds * BYTES_PER_SECOND)
        self.start = 0.0

    def __len__(self) -> int:
        return len(self._audio)

    @property
    def seconds(self) -> float:
        return len(self._audio) / BYTES_PER_SECOND

    @property
    def end(self) -> float:
        return self.start + self.seconds

    def push(self, ulaw: bytes, at: float) -> None:
        """``ulaw`` begins at call second ``at``: where the kept audio ends, or anywhere when
        nothing is kept (the audio between went elsewhere)."""
        if not self._audio:
            self.start = at
        self._audio += ulaw
        excess = len(self._audio) - self._keep_bytes
        if excess > 0:
            self._drop(excess)

    def extend(self, ulaw: bytes) -> None:
        """``ulaw`` follows what was pushed before (``end`` is then where a stream of audio
        pushed from call second 0 has got to, whatever was dropped)."""
        self.push(ulaw, self.end)

    def drop_through(self, second: float) -> None:
        """Forget the audio before call second ``second`` (all of it, if it ends before)."""
        if second > self.start:
            self._drop(min(len(self._audio), int((second - self.start) * BYTES_PER_SECOND)))

    def audio(self) -> bytes:
        """A copy of what is kept."""
        return bytes(self._audio)

    def take(self) -> bytes:
        """What is kept, which is then forgotten (the next push may start anywhere)."""
        taken = bytes(self._audio)
        self._drop(len(self._audio))
        return taken

    def _drop(self, count: int) -> None:
        if count > 0:
            del self._audio[:count]
            self.start += count / BYTES_PER_SECOND
