"""RFC 8941 parsing, as much of it as the ``Idempotency-Key`` header needs: one String Item.

The draft defines the header as an sf-string Item, and an Item may carry parameters (§3.1.2,
``;key`` or ``;key=bare-item``). A key's parameters mean nothing here, but a valid header must
not be refused for having them, and an invalid one must be (§4.2: a field that fails to parse is
ignored as a whole, never guessed at), so parameters are parsed to the letter and then dropped.
Hand-written instead of a dependency: the grammar needed is small and fixed by the RFC, and
``http.py`` wants the position where the Item ends to tell "two headers joined by a comma" apart.
"""

from __future__ import annotations

import string

__all__ = ["Malformed", "parse_string_item"]

_DIGITS = frozenset(string.digits)
_KEY_FIRST = frozenset(string.ascii_lowercase + "*")
_KEY_CHARS = _KEY_FIRST | _DIGITS | frozenset("_-.")
_TOKEN_FIRST = frozenset(string.ascii_letters + "*")
_TOKEN_CHARS = frozenset(string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~:/")
_BASE64 = frozenset(string.ascii_letters + string.digits + "+/=")


class Malformed(ValueError):
    """The text is not valid RFC 8941; ``reason`` says where it breaks the grammar."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class _Reader:
    """The input and a position in it: each parser consumes what its rule matches (§4.2)."""

    def __init__(self, text: str, pos: int = 0) -> None:
        self.text = text
        self.pos = pos

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def take(self) -> str:
        char = self.peek()
        self.pos += len(char)
        return char

    def take_while(self, allowed: frozenset[str]) -> str:
        start = self.pos
        while self.peek() and self.peek() in allowed:
            self.pos += 1
        return self.text[start : self.pos]


def parse_string_item(text: str) -> tuple[str, str]:
    """The String of the sf-string Item at the start of ``text`` and the text after the Item.

    ``text`` starts at the opening quote; the Item's parameters are validated and discarded.
    The caller judges what follows (a comma means a second header was joined on).
    """
    reader = _Reader(text)
    value = _string(reader)
    _parameters(reader)
    return value, text[reader.pos :]


def _string(reader: _Reader) -> str:
    """§4.2.5: a quoted string of printable ASCII, where ``\\`` escapes only ``"`` and ``\\``."""
    if reader.take() != '"':
        raise Malformed("a string must start with '\"'")
    chars: list[str] = []
    while reader.peek():
        char = reader.take()
        if char == "\\":
            escaped = reader.take()
            if escaped not in ('"', "\\"):
                raise Malformed("a backslash may only escape '\"' or '\\'")
            chars.append(escaped)
        elif char == '"':
            return "".join(chars)
        elif not " " <= char <= "~":
            raise Malformed("only printable ASCII characters are allowed")
        else:
            chars.append(char)
    raise Malformed("the quoted string is not closed")


def _parameters(reader: _Reader) -> None:
    """§4.2.3.2: ``;`` then optional spaces, a key, and optionally ``=`` and a bare item."""
    while reader.peek() == ";":
        reader.take()
        reader.take_while(frozenset(" "))
        if reader.peek() not in _KEY_FIRST:
            raise Malformed("a parameter name must start with a lowercase letter or '*'")
        reader.take_while(_KEY_CHARS)
        if reader.peek() == "=":
            reader.take()
            _bare_item(reader)


def _bare_item(reader: _Reader) -> None:
    """§4.2.3.1: an integer or decimal, string, token, byte sequence or boolean."""
    first = reader.peek()
    if first == "-" or first in _DIGITS:
        _number(reader)
    elif first == '"':
        _string(reader)
    elif first in _TOKEN_FIRST:
        reader.take_while(_TOKEN_CHARS)
    elif first == ":":
        _byte_sequence(reader)
    elif first == "?":
        reader.take()
        if reader.take() not in ("0", "1"):
            raise Malformed("a boolean parameter must be ?0 or ?1")
    else:
        raise Malformed("a parameter value must be a number, string, token, :bytes: or ?0/?1")


def _number(reader: _Reader) -> None:
    """§4.2.4: at most 15 integer digits, or 12 digits, a dot and 1 to 3 fraction digits."""
    if reader.peek() == "-":
        reader.take()
    whole = reader.take_while(_DIGITS)
    if not whole:
        raise Malformed("a number must have a digit after its sign")
    if reader.peek() != ".":
        if len(whole) > 15:
            raise Malformed("an integer has at most 15 digits")
        return
    reader.take()
    fraction = reader.take_while(_DIGITS)
    if len(whole) > 12 or not 1 <= len(fraction) <= 3:
        raise Malformed("a decimal has at most 12 digits, a dot and 1 to 3 more digits")


def _byte_sequence(reader: _Reader) -> None:
    """§4.2.7: base64 between colons."""
    reader.take()
    reader.take_while(_BASE64)
    if reader.take() != ":":
        raise Malformed("a byte sequence is base64 between two ':'")
