"""How does a value cross from code a model wrote to the code that judges it, without carrying code along?

When the answer runs in one process and its test in another, what the answer's process sends must be data only:
pickle and marshal can name any class or function, and a reply could rebuild an object whose __eq__ says yes to
everything. Here a reply is a tree of tagged items, each decoded into a fresh object of an exact builtin type: None,
bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset, Fraction and Decimal; an object of one of
the problem's own classes, which the judge lists in `classes`, crosses as its position in that list and its attributes
(plain data again), and is rebuilt around the judge's own class without calling its __init__. No name is ever looked
up from the bytes, a reply is refused whole past MAX_BYTES, MAX_ITEMS or MAX_DEPTH, and any malformed byte is a
CodecError. Encoding takes the exact types only (a subclass of int is refused, not converted); it runs beside the
answer, so decode, on the judge's side, checks everything again.

Wire format: a message is a 4-byte big-endian length, then one item; an item is a tag byte and its payload:
    N, T, F        None, True, False
    i, s, b, d     int (decimal digits), str (UTF-8), bytes, Decimal (its text): a 4-byte length, then the bytes
    f, c           float (8 bytes, IEEE 754 big-endian), complex (two of them)
    q              Fraction: its numerator and denominator, each as an i payload
    l, t, S, z, m  list, tuple, set, frozenset, dict: a 4-byte count, then the items (a dict's: key, value, ...)
    o              an object: a 4-byte position in `classes`; the builtin value it extends (N for none: a dict for
                   a dict subclass, a tuple for a named tuple...); its attributes as an m item with str keys
    k              one of `classes` itself: its 4-byte position
"""

import struct
import types
from decimal import Decimal, InvalidOperation
from fractions import Fraction

MAX_BYTES = 16 * 2**20  # the most a message may hold
MAX_ITEMS = 1_000_000  # items in one message, all levels together
MAX_DEPTH = 64  # nesting of containers
MAX_DIGITS = 5_000  # of an int: int() of a longer decimal string is slow by design


class CodecError(ValueError):
    """A value the codec does not carry, or bytes that are not one message."""


def encode(value, classes=()) -> bytes:
    """`value` as one message: its length, then its items; an object whose exact class is classes[k] as k and its
    attributes."""
    out = []
    _put(value, out, 0, [0], tuple(classes))
    body = b"".join(out)
    if len(body) > MAX_BYTES:
        raise CodecError(f"message of {len(body)} bytes, over {MAX_BYTES}")
    return _sized(body)


def _put(value, out, depth, count, classes):
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
            _put(item, out, depth + 1, count, classes)
    elif kind in classes and carried(kind):
        out.append(b"o" + struct.pack(">I", classes.index(kind)))
        base = builtin_base(kind)
        _put(None if base is object else base(value), out, depth + 1, count, classes)
        _put(state_of(value), out, depth + 1, count, classes)
    elif isinstance(value, type) and value in classes:
        out.append(b"k" + struct.pack(">I", classes.index(value)))
    else:
        raise CodecError(f"cannot carry a {kind.__name__}")


BASES = (dict, list, set, frozenset, tuple, int, float, complex, str, bytes)  # what a class may extend
MUTABLE = (dict, list, set)


HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: not one of C's static classes
# What C defines for the instances of a class of its making: slots, methods and fields (a class statement makes
# fields of its __slots__, __dict__ and __weakref__ only); a C classmethod (typing.Generic's) acts on the class alone
DESCRIPTORS = (
    types.WrapperDescriptorType,
    types.MethodDescriptorType,
    types.GetSetDescriptorType,
    types.MemberDescriptorType,
)


def carried(cls) -> bool:
    """Whether an object of `cls` is whole in its builtin value and attributes: every class it derives from is a
    class statement's, a builtin of BASES or object (an itertools.chain keeps its state where no attribute shows it)."""
    return all(c in BASES or c is object or made_by_class_statement(c) for c in cls.__mro__)


def made_by_class_statement(cls) -> bool:
    """Whether `cls` was made by a class statement (or type()): a heap class with no constructor, method, slot or
    field that C defined for it. The flag alone does not tell: C's classes are heap classes too where their module
    was ported to them (functools.partial, itertools.chain, collections.deque: docs/support.md)."""
    own = {"__dict__", "__weakref__", *slot_names(cls)}
    for name, value in vars(cls).items():
        if isinstance(value, DESCRIPTORS) and getattr(value, "__objclass__", None) is cls and name not in own:
            return False
        if isinstance(value, types.BuiltinFunctionType) and getattr(value, "__self__", None) is cls:  # C's __new__
            return False
    return bool(cls.__flags__ & HEAPTYPE)


def builtin_base(cls) -> type:
    """The builtin type of BASES that `cls` extends, else object."""
    return next((base for base in BASES if issubclass(cls, base)), object)


def slot_names(cls) -> tuple:
    """The names `cls` itself lists in __slots__ (a string is one name)."""
    slots = cls.__dict__.get("__slots__", ())
    return (slots,) if isinstance(slots, str) else tuple(slots)


def state_of(obj) -> dict:
    """An object's attributes: its __dict__ and the __slots__ of its classes that are set."""
    state = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
    for cls in type(obj).__mro__:
        for name in slot_names(cls):
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                state[name] = getattr(obj, name)
    return state


def set_state(obj, state: dict):
    """Each attribute of `state` set on `obj` as object.__setattr__ sets it; a name that is not plain is refused."""
    for name, value in state.items():
        if type(name) is not str or not name.isidentifier() or name.startswith("__"):
            raise CodecError(f"attribute name {name!r} is not a plain name")
        try:
            object.__setattr__(obj, name, value)
        except (AttributeError, TypeError) as e:
            raise CodecError(f"cannot set attribute {name!r}: {e}") from None


def rebuilt(cls, base, value):
    """A fresh `cls` holding `value` (of its builtin base), its own __init__ not called: an immutable base's value
    goes to base.__new__, a mutable one's to the object's update or extend."""
    try:
        if value is not None and base not in MUTABLE:
            return base.__new__(cls, value)
        obj = cls.__new__(cls)
        if base is list:
            obj.extend(value)
        elif base is not object:
            obj.update(value)
        return obj
    except Exception as e:  # the class's own __new__ or update (dataset code) wants otherwise
        raise CodecError(f"cannot rebuild a {cls.__name__}: {type(e).__name__}: {e}") from None


def _sized(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


CONTAINERS = {list: b"l", tuple: b"t", set: b"S", frozenset: b"z", dict: b"m"}
BUILD = {b"l": list, b"t": tuple, b"S": set, b"z": frozenset}


def decode(message: bytes, classes=()):
    """The value of one whole message (its length prefix included), rebuilt from fresh builtin objects and, for an
    o item, a fresh object of classes[k]."""
    if len(message) < 4 or struct.unpack(">I", message[:4])[0] != len(message) - 4:
        raise CodecError("the length prefix does not match the message")
    if len(message) - 4 > MAX_BYTES:
        raise CodecError(f"message over {MAX_BYTES} bytes")
    reader = Reader(memoryview(message)[4:], tuple(classes))
    value = reader.item(0)
    if reader.at != len(reader.data):
        raise CodecError("bytes after the value")
    return value


class Reader:
    """Items read in order from `data`, each checked before it is built."""

    def __init__(self, data, classes):
        self.data = data
        self.classes = classes
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
        if tag == b"o":
            return self.object(depth)
        if tag == b"k":
            k = self.size()
            if k >= len(self.classes):
                raise CodecError("a class the judge did not list")
            return self.classes[k]
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

    def object(self, depth: int):
        k = self.size()
        if k >= len(self.classes):
            raise CodecError("an object of a class the judge did not list")
        cls = self.classes[k]
        if not carried(cls):
            raise CodecError(f"an object of {cls.__name__}, which does not cross as data")
        base = builtin_base(cls)
        value = self.item(depth + 1)
        state = self.item(depth + 1)
        if type(state) is not dict or type(value) is not (type(None) if base is object else base):
            raise CodecError(f"an object of {cls.__name__} that is not its builtin value and attributes")
        obj = rebuilt(cls, base, value)
        set_state(obj, state)
        return obj

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
