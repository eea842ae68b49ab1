"""support/evaluation/codec.py: what crosses from the candidate's process to the judge is data and nothing else.

Proves: every carried type comes back equal and of its exact builtin type, nested as deep as allowed; encoding refuses
what is not exactly a carried type (an object equal to everything, subclasses of int, str, list and dict, functions);
decoding refuses any message that is not one whole value (a bad length, an unknown tag, a truncated item, trailing
bytes, a pickle), an int that is not plain digits, text that is not UTF-8, unhashable keys, a bad Fraction or
Decimal, and values past the depth, item and size caps, each as a CodecError. Objects of the classes the judge lists
cross as their builtin value and attributes, rebuilt around the judge's class; unlisted, C-written or forged ones do
not.
"""

import math
import pickle
import struct
import typing
from decimal import Decimal
from fractions import Fraction

import pytest

from support.evaluation import codec
from support.evaluation.codec import CodecError, decode, encode

VALUES = [
    None,
    True,
    False,
    0,
    -7,
    10**300,
    -(2**64),
    1.5,
    -0.0,
    math.inf,
    complex(1, -2.5),
    "",
    "héllo \N{SNOWMAN}",
    "\ud800 lone surrogate",
    b"",
    b"\x00\xff",
    [],
    (),
    (1,),
    [1, [2, [3, (4, "x")]]],
    {1, "a", (2, 3)},
    frozenset({b"k", 4.0}),
    {},
    {"a": [1, {2: (3, None)}], (1, 2): frozenset({1}), 3.5: b"v", None: True},
    Fraction(-3, 4),
    Fraction(10**40, 3),
    Decimal("1.10"),
    Decimal("-Infinity"),
]


def message(item: bytes) -> bytes:
    return struct.pack(">I", len(item)) + item


def sized(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def exact_types(value):
    """(type name, ...) of value and everything inside it, in order: equality alone would accept a subclass."""
    kinds = [type(value).__name__]
    if isinstance(value, dict):
        for k, v in value.items():
            kinds += exact_types(k) + exact_types(v)
    elif isinstance(value, list | tuple | set | frozenset):
        for v in sorted(value, key=repr) if isinstance(value, set | frozenset) else value:
            kinds += exact_types(v)
    return kinds


def value_id(value) -> str:
    """repr, but a set's members sorted: a set's repr follows the hash seed of str and bytes, and every process that
    collects the tests (pytest-xdist's workers) must name them alike."""
    if isinstance(value, set | frozenset):
        return f"{type(value).__name__}({sorted(map(repr, value))})"
    return repr(value)


@pytest.mark.parametrize("value", VALUES, ids=value_id)
def test_every_carried_type_comes_back_equal_and_exact(value):
    back = decode(encode(value))
    assert back == value and exact_types(back) == exact_types(value)
    if isinstance(value, float) and value == 0:
        assert math.copysign(1, back) == math.copysign(1, value)  # -0.0 stays negative


def test_nan_and_decimal_nan_cross():
    back = decode(encode([math.nan, Decimal("NaN")]))
    assert math.isnan(back[0]) and back[1].is_nan() and type(back[1]) is Decimal


def test_decoded_containers_are_fresh_objects():
    """Two decodes of one message share nothing: a judge may mutate what it got."""
    data = encode([[1], {"a": [2]}])
    first, second = decode(data), decode(data)
    first[0].append(9)
    first[1]["a"].append(9)
    assert second == [[1], {"a": [2]}]


class AlwaysEqual:
    def __eq__(self, other):
        return True

    __hash__ = object.__hash__


class Int(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


class Text(str):
    pass


class Items(list):
    pass


class Mapping(dict):
    pass


@pytest.mark.parametrize(
    "value",
    [AlwaysEqual(), Int(3), Text("x"), Items([1]), Mapping(a=1), [1, AlwaysEqual()], {"k": Int(1)}, len, AlwaysEqual],
    ids=[
        "always-equal",
        "int-subclass",
        "str-subclass",
        "list-subclass",
        "dict-subclass",
        "nested",
        "nested-value",
        "function",
        "class",
    ],
)
def test_encoding_refuses_what_is_not_exactly_a_carried_type(value):
    with pytest.raises(CodecError, match="cannot carry"):
        encode(value)


BAD = {
    "empty": b"",
    "short prefix": b"\x00\x00",
    "prefix too long": struct.pack(">I", 9) + b"N",
    "prefix too short": struct.pack(">I", 1) + b"NN",
    "unknown tag": message(b"X"),
    "truncated length": message(b"s\x00\x00"),
    "truncated text": message(b"s" + struct.pack(">I", 5) + b"ab"),
    "truncated float": message(b"f\x00\x00\x00"),
    "empty int": message(b"i" + sized(b"")),
    "int with a sign": message(b"i" + sized(b"+5")),
    "int negative zero": message(b"i" + sized(b"-0")),
    "int with space": message(b"i" + sized(b" 5")),
    "int with underscore": message(b"i" + sized(b"1_000")),
    "int too long": message(b"i" + sized(b"9" * (codec.MAX_DIGITS + 1))),
    "bad utf-8": message(b"s" + sized(b"\xff\xfe")),
    "unhashable key": message(b"m" + struct.pack(">I", 1) + b"l" + struct.pack(">I", 0) + b"N"),
    "unhashable set item": message(b"S" + struct.pack(">I", 1) + b"m" + struct.pack(">I", 0)),
    "fraction zero denominator": message(b"q" + sized(b"1") + sized(b"0")),
    "fraction negative denominator": message(b"q" + sized(b"1") + sized(b"-2")),
    "bad decimal": message(b"d" + sized(b"1.2.3")),
    "count past the items": message(b"l" + struct.pack(">I", 3) + b"NN"),
    "count past the cap": message(b"l" + struct.pack(">I", codec.MAX_ITEMS + 1)),
    "a pickle": pickle.dumps(AlwaysEqual()),
    "a framed pickle": message(pickle.dumps(AlwaysEqual())),
}


@pytest.mark.parametrize("data", BAD.values(), ids=BAD.keys())
def test_decoding_refuses_what_is_not_one_whole_value(data):
    with pytest.raises(CodecError):
        decode(data)


def test_depth_cap_both_ways():
    """A list nested past MAX_DEPTH is refused by encode, and the same bytes made by hand are refused by decode;
    one level less crosses."""
    deep = []
    for _ in range(codec.MAX_DEPTH):
        deep = [deep]
    assert decode(encode(deep)) == deep
    with pytest.raises(CodecError, match="too deep"):
        encode([deep])
    nested = b"l\x00\x00\x00\x01" * (codec.MAX_DEPTH + 1) + b"l\x00\x00\x00\x00"
    with pytest.raises(CodecError, match="too deep"):
        decode(message(nested))


def test_size_cap_both_ways(monkeypatch):
    """Past MAX_BYTES a message is refused by encode and by decode (the cap lowered to keep the test small)."""
    monkeypatch.setattr(codec, "MAX_BYTES", 1000)
    assert decode(encode(b"x" * 900)) == b"x" * 900
    with pytest.raises(CodecError, match="over 1000"):
        encode(b"x" * 1000)
    with pytest.raises(CodecError, match="over 1000"):
        decode(message(b"b" + sized(b"x" * 1000)))


def test_item_cap_both_ways(monkeypatch):
    """Past MAX_ITEMS (all levels together) a value is refused by encode and by decode."""
    monkeypatch.setattr(codec, "MAX_ITEMS", 100)
    assert decode(encode([[0] * 40, [0] * 40])) == [[0] * 40, [0] * 40]
    with pytest.raises(CodecError, match="too large"):
        encode([[0] * 60, [0] * 60])
    items = b"l" + struct.pack(">I", 2) + (b"l" + struct.pack(">I", 60) + b"N" * 60) * 2
    with pytest.raises(CodecError, match="too large"):
        decode(message(items))


class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def __eq__(self, other):
        return type(other) is Point and (self.x, self.y) == (other.x, other.y)


class Tally(dict):
    """A dict subclass with an attribute, as collections.Counter is one."""


class Slotted:
    __slots__ = ("a", "b")

    def __init__(self, a):
        self.a = a


class Pair(tuple):
    def __new__(cls, a, b):  # wants its fields: decoding must not call it
        return super().__new__(cls, (a, b))


class Box(typing.Generic[typing.TypeVar("T")]):
    """Generic's classmethods are C's (since Python 3.12) but act on the class: its objects are their attributes."""

    __str__ = object.__repr__  # C's, made for object: nothing of Box's is written in C

    def __init__(self, item):
        self.item = item


def test_listed_classes_cross_as_their_builtin_value_and_attributes():
    """An object of a class the judge lists comes back as a fresh object of the judge's class, its attributes (in
    __dict__ or __slots__, unset slots left unset) and its builtin value (a dict subclass's items, a tuple subclass's
    fields) equal, without its __init__ or __new__ being called; a listed class itself crosses by position."""
    classes = (Point, Tally, Slotted, Pair, Box)
    tally = Tally(a=1)
    tally.note = "x"
    value = [Point(1, [2]), tally, Slotted(3), Pair(4, 5), Point, {Pair: 1}, Box([6])]
    out = decode(encode(value, classes), classes)
    assert type(out[6]) is Box and out[6].item == [6]
    assert out[0] == Point(1, [2]) and out[0] is not value[0]
    assert type(out[1]) is Tally and out[1] == {"a": 1} and out[1].note == "x"
    assert type(out[2]) is Slotted and out[2].a == 3 and not hasattr(out[2], "b")
    assert type(out[3]) is Pair and out[3] == (4, 5)
    assert out[4] is Point and out[5] == {Pair: 1}


def test_objects_of_unlisted_or_c_classes_and_forged_objects_are_refused():
    """Encoding refuses an object of a class not listed, and of a listed class written in C or derived from one (its
    state is not in attributes: an itertools.chain would come back empty, a random.Random without its generator's
    state), C's heap classes too (functools.partial and _random.Random on every Python; itertools and deque since
    3.12), and one whose __slots__ name is mangled (it is not the attribute's name); decoding refuses the same classes,
    a position past the list, an object whose builtin value is of the wrong type, and attribute names that are not
    plain (a dunder would reach the class's machinery)."""
    import collections
    import functools
    import itertools
    import random

    class Mangled:
        __slots__ = ("__hidden",)

    with pytest.raises(CodecError, match="cannot carry a Point"):
        encode(Point(1, 2))
    c_made = [itertools.chain([1]), functools.partial(int, "7"), random.Random(1), collections.deque([1]), Mangled()]
    forged = b"o" + struct.pack(">I", 0) + encode(None)[4:] + encode({})[4:]  # classes[0], no value, no attributes
    for obj in c_made:
        with pytest.raises(CodecError, match=f"cannot carry a {type(obj).__name__}"):
            encode(obj, (type(obj),))
        with pytest.raises(CodecError, match=f"an object of {type(obj).__name__}, which does not cross"):
            decode(struct.pack(">I", len(forged)) + forged, (type(obj),))
    message = encode(Point(1, 2), (Point,))
    with pytest.raises(CodecError, match="did not list"):
        decode(message, ())
    with pytest.raises(CodecError, match="not its builtin value"):
        decode(encode(Point(1, 2), (Point,)), (Tally,))
    forged = b"o" + struct.pack(">I", 0) + b"N" + encode({"__class__": 1})[4:]
    with pytest.raises(CodecError, match="not a plain name"):
        decode(struct.pack(">I", len(forged)) + forged, (Point,))
