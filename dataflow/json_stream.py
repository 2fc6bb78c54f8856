"""A JSON document decoded value by value, for files too large to hold whole (COCO captions JSON).

The standard library has no streaming decoder and `ijson` is not a dependency; `JsonStream` walks the
document's structure (`{`, `[`, `,`) itself and hands each complete value to `json.JSONDecoder.raw_decode`
on a growing buffer, so only the current value is in memory.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, TextIO

from dhp.errors import ConfigError

_NUMBER_TAIL = re.compile(r"[0-9+\-.eE]*\Z")


class JsonStream:
    """One JSON document decoded value by value (`json.JSONDecoder.raw_decode` on a growing buffer),
    so a large array is never held whole."""

    def __init__(self, src: TextIO, name: str, chunk_chars: int = 1 << 20):
        self.src, self.name, self.chunk = src, name, chunk_chars
        self.buf, self.pos, self.base, self.eof = "", 0, 0, False
        self.decoder = json.JSONDecoder()

    def _more(self, at_least: int = 0) -> bool:
        if self.eof:
            return False
        try:
            data = self.src.read(max(self.chunk, at_least))
        except UnicodeDecodeError as e:
            raise ConfigError(f"{self.name}: not UTF-8: {e}") from None
        if not data:
            self.eof = True
            return False
        self.base += self.pos
        self.buf, self.pos = self.buf[self.pos :] + data, 0
        return True

    def error(self, msg: str) -> ConfigError:
        return ConfigError(f"{self.name}: not valid JSON near character {self.base + self.pos}: {msg}")

    def peek(self) -> str:
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\n\r":
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._more():
                return ""

    def take(self, allowed: str) -> str:
        ch = self.peek()
        if not ch or ch not in allowed:
            raise self.error(f"expected one of {list(allowed)}, found {ch or 'the end of the file'!r}")
        self.pos += 1
        return ch

    def value(self) -> Any:
        self.peek()
        while True:
            try:
                obj, end = self.decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                if self._more(len(self.buf) - self.pos):  # the value may run past the buffer: read on
                    continue
                raise self.error(e.msg) from None
            if type(obj) in (int, float) and _NUMBER_TAIL.match(self.buf, end) and self._more():
                continue  # a number cut at the buffer's end ("12", "3.", "1e") may go on: decode again
            self.pos = end
            return obj

    def array(self) -> Iterator[Any]:
        self.take("[")
        if self.peek() == "]":
            self.pos += 1
            return
        while True:
            yield self.value()
            if self.take(",]") == "]":
                return
