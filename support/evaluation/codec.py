"""How does a value cross from code a model wrote to the code that judges it, without carrying code along?

When the answer runs in one process and its test in another, what the answer's process sends must be data only:
pickle and marshal can name any class or function, and a reply could rebuild an object whose __eq__ says yes to
everything. Here a reply is a tree of tagged items, each decoded into a fresh object of an exact builtin type: None,
bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset, Fraction and Decimal. No name is ever looked
up from the bytes, a reply is refused whole past MAX_BYTES, MAX_ITEMS or MAX_DEPTH, and any malformed byte is a
CodecError. Encoding takes the exact types only (a subclass of int is refused, not converted); it runs beside the
answer, so decode, on the judge's side, checks everything again.

Wire format: a message is a 4-byte big-endian length, then one item; an item is a tag byte and its payload:
    N, T, F        None, True, False
    i, s, b, d     int (decimal digits), str (UTF-8), bytes, Decimal (its text): a 4-byte length, then the bytes
    f, c           float (8 bytes, IEEE 754 big-endian), complex (two of them)
    q              Fraction: its numerator and denominator, each as an i payload
    l, t, S, z, m  list, tuple, set, frozenset, dict: a 4-byte count, then the items (a dict's: key, value, ...)
"""

import struct
from decimal import Decimal, InvalidOperation
from fractions import Fraction

MAX_BYTES = 16 * 2**20  # the most a message may hold
MAX_ITEMS = 1_000_000  # items in one message, all levels together
MAX_DEPTH = 64  # nesting of containers
MAX_DIGITS = 5_000  # of an int: int() of a longer decimal string is slow by design


class CodecError(ValueError):
    """A value the codec does not carry, or bytes that are not one message."""


def encode(value) -> bytes:
    """`value` as one message: its length, then its items."""
    out = []
    _put(value, out, 0, [0])
    body = b"".join(out)
    if len(body) > MAX_BYTES:
        raise CodecError(f"message of {len(body)} bytes, over {MAX_BYTES}")
    return struct.pack(">I", len(body)) + body


def _put(value, out, depth, count):
    count[0] += 1
    if count[0] > MAX_ITEMS or depth > MAX_DEPTH:
        raise CodecError("value too large or too deep")
    kind = type(value)
    if value is None or kind is bool:
        out.append({None: b"N", True: b"T", False: b"F"}[value])
    elif kind is int:
        out.append(b"i" + _sized(str(value).encode()))
    elif kind is str:
        out.append(b"s" + _sized(value.encode("utf-8", "surrogatepass")))
    elif kind is bytes:
        out.append(b"b" + _sized(value))
    elif kind is float:
        out.append(b"f" + struct.pack(">d", value))
    elif kind is complex:
        out.append(b"c" + struct.pack(">dd", value.real, value.imag))
    elif kind is Fraction:
        out.append(b"q" + _sized(str(value.numerator).encode()) + _sized(str(value.denominator).encode()))
    elif kind is Decimal:
        out.append(b"d" + _sized(str(value).encode()))
    elif kind in CONTAINERS:
        items = [x for pair in value.items() for x in pair] if kind is dict else list(value)
        out.append(CONTAINERS[kind] + struct.pack(">I", len(value)))
        for item in items:
            _put(item, out, depth + 1, count)
    else:
        raise CodecError(f"cannot carry a {kind.__name__}")


def _sized(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


CONTAINERS = {list: b"l", tuple: b"t", set: b"S", frozenset: b"z", dict: b"m"}
BUILD = {b"l": list, b"t": tuple, b"S": set, b"z": frozenset}


def decode(message: bytes):
    """The value of one whole message (its length prefix included), rebuilt from fresh builtin objects."""
    if len(message) < 4 or struct.unpack(">I", message[:4])[0] != len(message) - 4:
        raise CodecError("the length prefix does not match the message")
    if len(message) - 4 > MAX_BYTES:
        raise CodecError(f"message over {MAX_BYTES} bytes")
    reader = Reader(memoryview(message)[4:])
    value = reader.item(0)
    if reader.at != len(reader.data):
        raise CodecError("bytes after the value")
    return value


class Reader:
    """Items read in order from `data`, each checked before it is built."""

    def __init__(self, data):
        self.data = data
        self.at = 0
        self.items = 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.data):
            raise CodecError("message ends inside an item")
        chunk = bytes(self.data[self.at : self.at + n])
        self.at += n
        return chunk

    def size(self) -> int:
        return struct.unpack(">I", self.take(4))[0]

    def text(self) -> str:
        try:
            return self.take(self.size()).decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise CodecError("text that is not UTF-8") from None

    def integer(self) -> int:
        digits = self.take(self.size())
        if not 0 < len(digits) <= MAX_DIGITS or not digits.lstrip(b"-").isdigit() or digits.startswith(b"-0"):
            raise CodecError("an int that is not plain decimal digits")
        return int(digits)

    def item(self, depth: int):
        self.items += 1
        if self.items > MAX_ITEMS or depth > MAX_DEPTH:
            raise CodecError("value too large or too deep")
        tag = self.take(1)
        if tag in b"NTF":
            return {b"N": None, b"T": True, b"F": False}[tag]
        if tag == b"i":
            return self.integer()
        if tag == b"s":
            return self.text()
        if tag == b"b":
            return self.take(self.size())
        if tag == b"f":
            return struct.unpack(">d", self.take(8))[0]
        if tag == b"c":
            return complex(*struct.unpack(">dd", self.take(16)))
        if tag == b"q":
            return self.fraction()
        if tag == b"d":
            return self.decimal()
        if tag in BUILD or tag == b"m":
            return self.container(tag, depth)
        raise CodecError(f"unknown tag {tag!r}")

    def fraction(self) -> Fraction:
        numerator = self.integer()
        denominator = self.integer()
        if denominator <= 0:
            raise CodecError("a Fraction's denominator must be positive")
        return Fraction(numerator, denominator)

    def decimal(self) -> Decimal:
        try:
            return Decimal(self.text())
        except InvalidOperation:
            raise CodecError("a Decimal that does not parse") from None

    def container(self, tag: bytes, depth: int):
        n = self.size()
        if n > MAX_ITEMS:
            raise CodecError("value too large or too deep")
        if tag == b"m":
            pairs = [(self.item(depth + 1), self.item(depth + 1)) for _ in range(n)]
            try:
                return dict(pairs)
            except TypeError:
                raise CodecError("a dict key that cannot be hashed") from None
        items = [self.item(depth + 1) for _ in range(n)]
        try:
            return BUILD[tag](items)
        except TypeError:
            raise CodecError("a set item that cannot be hashed") from None
