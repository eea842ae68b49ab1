"""How does a test call an answer that runs in another process, and get back only data?

sandbox.py judges an answer with two processes. The server runs the problem's prompt and the model's completion, and
answers calls to the entry point; the judge runs the dataset's own prompt and test, with the entry point bound to
`proxy`, and alone reports the verdict. A call goes over two pipes:

    judge -> server   (args, kwargs, classes), pickled: the server, the untrusted side, is the one that unpickles
    server -> judge   one codec.py message, data only:
                      ("returned", value, changes)     changes: each argument the call could have changed (a list,
                                                       dict or set, an object of `classes`) as it left it, else None
                      ("raised", k, args, text)        an exception: k indexes classes + EXCEPTIONS (-1: neither)
                      ("ended", text)                  the answer cannot answer: its program failed, or it exited
                      ("uncrossable", text)            the arguments or the value cannot cross as data

`classes` are the problem's own classes, which the judge lists (the prompt's, and those a test adds to
`candidate.classes`); a reply names a class only by its position there. The proxy raises Ended or Uncrossable,
BaseExceptions, so that `except Exception` in a test cannot take them for the answer's own errors, and a test that
swallows them anyway still fails: the judge's verdict checks `proxy.ended` and `proxy.uncrossable`. Both processes
load this file and codec.py from their folder (sandbox.py); nothing else of the project.
"""

import builtins
import importlib
import io
import os
import pickle
import struct
import sys

import codec

# builtin exception classes, in an order both processes compute alike: a reply names one by its position
LOOP_ENDS = (StopIteration, StopAsyncIteration)  # raised by the proxy in a test's map() they would end it, not fail
BUILTIN = [
    c for c in vars(builtins).values() if isinstance(c, type) and issubclass(c, Exception) and c not in LOOP_ENDS
]
EXCEPTIONS = tuple(sorted(BUILTIN, key=lambda c: c.__name__))
GONE = "the answer's process ended without a reply"


class Ended(BaseException):
    """The answer's process cannot answer: its program failed or exited, or it ended, or its reply was malformed."""


class Uncrossable(BaseException):
    """A call's arguments or its value cannot cross between the processes as data."""


def write_message(fd: int, data: bytes):
    """Write all of `data` to `fd`, its 4-byte length first."""
    view = memoryview(struct.pack(">I", len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def read_exactly(fd: int, n: int) -> bytes | None:
    """n bytes from `fd`, or None when it closes first."""
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 2**20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_message(fd: int, limit: int) -> bytes | None:
    """One message's body from `fd` (None: closed); a length over `limit` is refused before anything is read."""
    head = read_exactly(fd, 4)
    if head is None:
        return None
    size = struct.unpack(">I", head)[0]
    if size > limit:
        raise Ended(f"a reply of {size} bytes, over the {limit} a reply may hold")
    return read_exactly(fd, size)


# ----------------------------------------------------------------------------- the judge's side
def proxy(requests: int, replies: int, classes: list):
    """The function the test calls in place of the entry point: each call goes to the server and returns its value,
    raises its exception, or raises Ended or Uncrossable. A plain function, so that set on a class it binds as a
    method and `self` crosses too."""

    def candidate(*args, **kwargs):
        known = tuple(candidate.classes)
        data = io.BytesIO()
        try:
            Pickler(data, known).dump((args, kwargs, known))
        except Exception as e:  # a lambda, a generator, an open file: no data to send
            raise uncrossable(candidate, f"arguments: {type(e).__name__}: {e}") from None
        try:
            write_message(requests, data.getvalue())
        except OSError:  # a broken pipe: the answer's process has ended
            raise ended(candidate, GONE) from None
        reply = read_reply(candidate, replies, known)
        if reply[0] == "returned":
            apply_changes(candidate, (*args, *kwargs.values()), reply[2], known)
            return reply[1]
        if reply[0] == "raised":
            raise rebuilt_exception(reply, known)
        if reply[0] == "uncrossable":
            raise uncrossable(candidate, reply[1])
        raise ended(candidate, reply[1])

    candidate.classes = list(classes)
    candidate.ended = None
    candidate.uncrossable = None
    return candidate


class Pickler(pickle.Pickler):
    """A pickler that names each class of `classes` by where it is found (home), not by its __module__: the
    stdlib's _pydecimal says its classes are decimal's."""

    def __init__(self, file, classes):
        super().__init__(file, protocol=5)
        self.homes = {cls: home(cls) for cls in classes}

    def reducer_override(self, obj):
        if isinstance(obj, type) and obj in self.homes:
            return home_class, self.homes[obj]
        return NotImplemented


def home(cls) -> tuple[str, str]:
    """(module, name) where `cls` is found: its own __module__ and __qualname__, else a loaded module holding it."""
    if found(cls.__module__, cls.__qualname__) is cls:
        return cls.__module__, cls.__qualname__
    for name, module in list(sys.modules.items()):
        if getattr(module, cls.__name__, None) is cls:
            return name, cls.__name__
    return cls.__module__, cls.__qualname__  # pickling it will say it is not found


def found(module: str, path: str):
    try:
        value = importlib.import_module(module)
        for part in path.split("."):
            value = getattr(value, part)
    except (ImportError, AttributeError):
        return None
    return value


def home_class(module: str, path: str) -> type:
    """The class at module.path, as the server unpickles a class the judge named by its home."""
    cls = found(module, path)
    if not isinstance(cls, type):
        raise pickle.UnpicklingError(f"no class {module}.{path}")
    return cls


def ended(candidate, text: str) -> Ended:
    candidate.ended = candidate.ended or text
    return Ended(text)


def uncrossable(candidate, text: str) -> Uncrossable:
    candidate.uncrossable = candidate.uncrossable or text
    return Uncrossable(text)


def read_reply(candidate, replies: int, classes) -> tuple:
    """The server's reply, checked to be one of the four shapes; anything else ends the answer."""
    try:
        body = read_message(replies, codec.MAX_BYTES)
    except Ended as e:
        raise ended(candidate, str(e)) from None
    if body is None:
        raise ended(candidate, GONE)
    try:
        reply = codec.decode(struct.pack(">I", len(body)) + body, classes)
    except codec.CodecError as e:
        raise ended(candidate, f"a malformed reply: {e}") from None
    shapes = {"returned": (3, list), "raised": (4, int), "ended": (2, str), "uncrossable": (2, str)}
    if type(reply) is not tuple or not reply or reply[0] not in shapes or len(reply) != shapes[reply[0]][0]:
        raise ended(candidate, "a malformed reply")
    if type(reply[-1 if reply[0] != "raised" else 1]) is not shapes[reply[0]][1]:
        raise ended(candidate, "a malformed reply")
    return reply


def apply_changes(candidate, arguments, changes, classes):
    """Each argument's new contents, as the server's call left them, put back into the judge's own argument."""
    if len(changes) != len(arguments):
        raise ended(candidate, "a malformed reply: changes do not match the arguments")
    for argument, new in zip(arguments, changes, strict=True):
        if new is None:
            continue
        if type(new) is not type(argument) or changed(argument, classes) is None:  # not one the call could change
            raise ended(candidate, "a malformed reply: a change of the wrong kind")
        try:
            copy_into(argument, new)
        except codec.CodecError as e:
            raise ended(candidate, f"a malformed reply: {e}") from None


def copy_into(argument, fresh):
    """What the server's call left in a list, dict, set or object of the problem's classes, put into the judge's own:
    its builtin contents (a dict's, a list's, a set's) and its attributes."""
    base = codec.builtin_base(type(argument))
    if base in codec.MUTABLE:
        argument.clear()
    if base is list:
        argument.extend(fresh)
    elif base in codec.MUTABLE:
        argument.update(fresh)
    codec.set_state(argument, codec.state_of(fresh))


def rebuilt_exception(reply, classes) -> BaseException:
    """The judge's own exception for a ("raised", k, args, text) reply: classes[k] or a builtin one, else a
    RuntimeError carrying the text."""
    _, k, args, text = reply
    throwable = [c for c in classes if issubclass(c, Exception)] + list(EXCEPTIONS)
    if not 0 <= k < len(throwable) or type(args) is not tuple:
        return RuntimeError(text)
    try:
        return throwable[k](*args)
    except Exception:  # its __init__ wants other arguments
        return RuntimeError(text)


# ----------------------------------------------------------------------------- the server's side
def serve(requests: int, replies: int, namespace: dict, entry: str, failure: tuple | None):
    """Answer the judge's calls to namespace[entry] until the judge closes its end; `failure`: the ("ended", why)
    reply to every call when the answer's program did not run."""
    while (data := read_message(requests, 2**32)) is not None:
        try:
            args, kwargs, classes = pickle.loads(data)
        except Exception as e:
            write_message(replies, codec.encode(("uncrossable", f"arguments: {type(e).__name__}: {e}"))[4:])
            continue
        reply = failure or call(namespace, entry, args, kwargs, classes)
        write_message(replies, encoded(reply, classes))


def call(namespace, entry, args, kwargs, classes) -> tuple:
    """The reply for one call of the answer's entry point."""
    if entry not in namespace:
        return ("ended", f"NameError: name '{entry}' is not defined")
    try:
        value = namespace[entry](*args, **kwargs)
    except Exception as e:
        throwable = [c for c in classes if issubclass(c, Exception)] + list(EXCEPTIONS)
        k = throwable.index(type(e)) if type(e) in throwable else -1
        return ("raised", k, e.args, described(e))
    except BaseException as e:  # SystemExit, KeyboardInterrupt: the answer stopped, it did not answer
        return ("ended", described(e))
    return ("returned", value, [changed(a, classes) for a in (*args, *kwargs.values())])


def changed(argument, classes):
    """What comes back of an argument after the call: itself when the call could have changed it, else None."""
    return argument if type(argument) in codec.MUTABLE or type(argument) in classes else None


def encoded(reply: tuple, classes) -> bytes:
    """The reply as a message body; a value that is not data, or an exception's arguments that are not, as an
    uncrossable reply (an exception keeps its text)."""
    try:
        return codec.encode(reply, classes)[4:]
    except codec.CodecError as e:
        if reply[0] == "raised":
            return encoded(("raised", reply[1], (reply[3],), reply[3]), classes)
        return codec.encode(("uncrossable", f"the value: {e}"))[4:]


def described(e: BaseException) -> str:
    try:
        return f"{type(e).__name__}: {e}".replace("\n", " ")[:500]
    except Exception:  # a __str__ that raises
        return type(e).__name__
