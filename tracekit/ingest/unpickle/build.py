"""Pass 2 of tracekit.ingest.unpickle.stream: the plain-data pickle machine with watched lists.

Semantics follow CPython's pickle.py ``_Unpickler`` for the opcodes it accepts (the scan has
already refused every other one). ``stack`` is the current MARK frame, ``frames`` the outer ones.
``path`` says what the current frame's owner is (the object below its MARK, which APPENDS or
SETITEMS fill): its path from the top object while that can still lead to a watched pattern,
else None; ``paths`` keeps it for the outer frames. Hot opcodes come first in the dispatch.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from tracekit.ingest.unpickle import stream
from tracekit.ingest.unpickle.stream import (
    _LEN,
    _REFS_APPENDS,
    _RELEASE_BYTES,
    OnItems,
    _Reader,
    decode_line_string,
    refs,
)

_TOP = ("top",)  # owner of the base frame (below every MARK): its first item is the top object


def _child_path(path: tuple, owner: Any, slots: list) -> tuple | None:
    """The path of slots[-1] in a frame whose items go into ``owner`` (at ``path``).

    Picklers write a container, then its contents; a container of one item gets it with APPEND or
    SETITEM and no MARK, so that item sits in its parent's frame right after it. Such a pending
    item can only follow the frame's last value: a dict's frame is key/value pairs, then maybe
    one item of the last value (a list). Deeper MARK-less nesting is read as pairs."""
    n = len(slots)
    if type(owner) is list:
        return path + ("*",)
    if type(owner) is not dict:
        return None
    if n % 2 == 0:
        key = slots[-2]
        return path + (key,) if type(key) is str else None
    if n >= 3 and type(slots[-2]) is list and type(slots[-3]) is str:
        return path + (slots[-3], "*")
    return None


class _FromCallback(Exception):
    """An error raised by a watch callback: passed through as is, not taken for a corrupt pickle."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _emit(on_items: OnItems, target: list, items: list) -> None:
    try:
        on_items(target, items)
    except Exception as e:  # noqa: BLE001 - re-raised unchanged by build
        raise _FromCallback(e) from None


def _purge(memo: dict, last: np.ndarray, reader: _Reader, pos: int) -> int:
    """Drop memo slots past their last fetch and the pages already read; returns ``pos``."""
    for i in [i for i in memo if last[i] < pos]:
        del memo[i]
    reader.release(pos)
    return pos


def build(reader: _Reader, last: np.ndarray, watch: dict[tuple, OnItems], batch: int) -> Any:
    buf = reader.buf
    kept = (last >= 0).tobytes()  # one byte per memo slot: fetched later, so kept when set
    prefixes = stream.prefixes(watch)  # paths of lists that can lead to a watch
    memo: dict[int, Any] = {}
    same_refs: dict[bytes, tuple] = {}  # the objects a run of memo references fetches
    count = 0  # memo slots set so far
    stack: list = []
    frames: list[list] = []
    paths: list = []
    path: Any = _TOP
    watched: list | None = None  # the frame whose items go to a callback: where, and to which list
    on_items: OnItems | None = None
    target: list | None = None
    flushed = False  # items of the watched frame already given away
    purged = 0
    unpack_from = struct.unpack_from

    def path_of_top() -> tuple | None:
        """The path of stack[-1] (the owner of a MARK about to open), if it can lead to a watch."""
        if path is _TOP:
            p = () if len(stack) == 1 else _child_path((), stack[0], stack[1:])
        elif path is None:
            return None
        else:
            p = _child_path(path, frames[-1][-1], stack)
        return p if p in prefixes else None

    pos = 0
    try:
        while True:
            op = buf[pos]
            pos += 1
            if op == 106:  # LONG_BINGET
                stack.append(memo[unpack_from("<I", buf, pos)[0]])
                pos += 4
            elif op == 104:  # BINGET
                stack.append(memo[buf[pos]])
                pos += 1
            elif op == 40:  # MARK
                owner = stack[-1] if stack else None
                # (in a watched frame the owner is an item: nothing below it is watched)
                owner_path = path_of_top() if owner is not None and stack is not watched else None
                if stack is watched and len(stack) > batch:
                    _emit(on_items, target, stack[:-1])  # complete: all but the one being filled
                    del stack[:-1]
                    flushed = True
                    if pos - purged > _RELEASE_BYTES:
                        purged = _purge(memo, last, reader, pos)
                if owner_path is None and type(owner) is list:
                    m = _REFS_APPENDS.match(buf, pos)  # MARK, memo references, APPENDS: a frames list
                    if m is not None:
                        end = m.end()
                        run = buf[pos:end - 1]
                        objs = same_refs.get(run)  # a call stack's frames list recurs every step
                        if objs is None:
                            if len(same_refs) > 1 << 14:
                                same_refs.clear()
                            objs = same_refs[run] = tuple([memo[i] for i in refs(run)])
                        owner.extend(objs)
                        pos = end
                        continue
                frames.append(stack)
                paths.append(path)
                path = owner_path
                stack = []
                if owner_path is not None and type(owner) is list:
                    callback = watch.get(owner_path + ("*",))
                    if callback is not None:
                        watched, on_items, target, flushed = stack, callback, owner, False
            elif op == 0x8A:  # LONG1
                n = buf[pos]
                stack.append(int.from_bytes(buf[pos + 1:pos + 1 + n], "little", signed=True))
                pos += 1 + n
            elif op == 0x94:  # MEMOIZE
                if kept[count]:
                    memo[count] = stack[-1]
                count += 1
            elif op == 125:  # EMPTY_DICT
                stack.append({})
            elif op == 117:  # SETITEMS
                items = stack
                if items is watched:  # that MARK was not the list's: nothing to watch
                    if flushed:
                        raise TypeError("a watched list's items closed by SETITEMS")
                    watched = None
                stack = frames.pop()
                path = paths.pop()
                d = stack[-1]
                if type(d) is not dict:
                    raise TypeError(f"SETITEMS on a {type(d).__name__}")
                for j in range(0, len(items), 2):
                    d[items[j]] = items[j + 1]
            elif op == 75:  # BININT1
                stack.append(buf[pos])
                pos += 1
            elif op == 74:  # BININT
                stack.append(unpack_from("<i", buf, pos)[0])
                pos += 4
            elif op == 101:  # APPENDS
                items = stack
                stack = frames.pop()
                path = paths.pop()
                if type(stack[-1]) is not list:
                    raise TypeError(f"APPENDS to a {type(stack[-1]).__name__}")
                if items is watched:
                    _emit(on_items, target, items)
                    watched = None
                    if pos - purged > _RELEASE_BYTES:
                        purged = _purge(memo, last, reader, pos)
                else:
                    stack[-1].extend(items)
            elif op == 93:  # EMPTY_LIST
                stack.append([])
            elif op == 0x8C:  # SHORT_BINUNICODE
                n = buf[pos]
                stack.append(str(buf[pos + 1:pos + 1 + n], "utf-8", "surrogatepass"))
                pos += 1 + n
            elif op == 77:  # BININT2
                stack.append(unpack_from("<H", buf, pos)[0])
                pos += 2
            elif op == 0x95:  # FRAME: the whole file is mapped, so framing changes nothing
                pos += 8
            elif op == 78:  # NONE
                stack.append(None)
            elif op == 0x88 or op == 0x89:  # NEWTRUE, NEWFALSE
                stack.append(op == 0x88)
            elif op == 71:  # BINFLOAT
                stack.append(unpack_from(">d", buf, pos)[0])
                pos += 8
            elif op == 0x85 or op == 0x86 or op == 0x87:  # TUPLE1..3
                n = op - 0x84
                t = tuple(stack[-n:])
                if len(t) != n:
                    raise IndexError("stack underflow")
                del stack[-n:]
                stack.append(t)
            elif op == 41:  # EMPTY_TUPLE
                stack.append(())
            elif op == 0x8F:  # EMPTY_SET
                stack.append(set())
            elif op in (116, 108, 100, 0x90, 0x91, 49):  # TUPLE LIST DICT ADDITEMS FROZENSET POP_MARK
                items = stack
                if items is watched:  # a MARK that builds a new object (protocol 0/1), not the list's
                    if flushed:
                        raise TypeError("a watched list's items closed by something other than APPENDS")
                    watched = None
                stack = frames.pop()
                path = paths.pop()
                if op == 116:
                    stack.append(tuple(items))
                elif op == 108:
                    stack.append(items)
                elif op == 100:
                    stack.append({items[j]: items[j + 1] for j in range(0, len(items), 2)})
                elif op == 0x90:
                    if type(stack[-1]) is not set:
                        raise TypeError(f"ADDITEMS to a {type(stack[-1]).__name__}")
                    stack[-1].update(items)
                elif op == 0x91:
                    stack.append(frozenset(items))
            elif op == 97:  # APPEND
                value = stack.pop()
                lst = stack[-1]
                if type(lst) is not list:
                    raise TypeError(f"APPEND to a {type(lst).__name__}")
                p = path_of_top()
                callback = watch.get(p + ("*",)) if p is not None else None
                if callback is not None:
                    _emit(callback, lst, [value])
                else:
                    lst.append(value)
            elif op == 115:  # SETITEM
                value = stack.pop()
                key = stack.pop()
                if type(stack[-1]) is not dict:
                    raise TypeError(f"SETITEM on a {type(stack[-1]).__name__}")
                stack[-1][key] = value
            elif op == 48:  # POP
                if stack:
                    stack.pop()
                else:
                    if stack is watched:
                        if flushed:
                            raise TypeError("a watched list's items closed by POP")
                        watched = None
                    stack = frames.pop()
                    path = paths.pop()
            elif op == 50:  # DUP
                stack.append(stack[-1])
            elif op in (113, 114, 112, 103):  # BINPUT LONG_BINPUT PUT GET
                if op == 113:
                    i, pos = buf[pos], pos + 1
                elif op == 114:
                    i, pos = unpack_from("<I", buf, pos)[0], pos + 4
                else:
                    text, pos = reader.line(pos)
                    i = int(text)
                if op == 103:
                    stack.append(memo[i])
                else:
                    if kept[i]:
                        memo[i] = stack[-1]
                    if i == count:
                        count += 1
                    else:  # a slot set again: runs of references may now mean other objects
                        same_refs.clear()
            elif op in _LEN:  # the other length-prefixed arguments
                fmt, size = _LEN[op]
                n = unpack_from(fmt, buf, pos)[0]
                data = buf[pos + size:pos + size + n]
                if n < 0 or len(data) != n:
                    raise ValueError(f"argument of {n} bytes runs past the end")
                pos += size + n
                if op == 0x8B:  # LONG4
                    stack.append(int.from_bytes(data, "little", signed=True))
                elif op in (0x58, 0x8D):  # BINUNICODE, BINUNICODE8
                    stack.append(str(data, "utf-8", "surrogatepass"))
                elif op == 0x96:  # BYTEARRAY8
                    stack.append(bytearray(data))
                elif op in (0x54, 0x55):  # BINSTRING, SHORT_BINSTRING (protocol 0/1 str)
                    stack.append(data.decode("ascii"))
                else:  # BINBYTES, SHORT_BINBYTES, BINBYTES8
                    stack.append(data)
            elif op in (73, 76, 70, 83, 86):  # INT LONG FLOAT STRING UNICODE: a text line
                text, pos = reader.line(pos)
                if op == 73:
                    stack.append(False if text == b"00" else True if text == b"01" else int(text, 0))
                elif op == 76:
                    stack.append(int(text[:-1] if text.endswith(b"L") else text, 0))
                elif op == 70:
                    stack.append(float(text))
                else:
                    stack.append(decode_line_string(text, op))
            elif op == 0x80:  # PROTO
                if buf[pos] > 5:
                    raise ValueError(f"unsupported pickle protocol {buf[pos]}")
                pos += 1
            elif op == 46:  # STOP
                if frames:
                    raise IndexError("STOP inside an open MARK")
                return stack.pop()
            else:  # the scan refused everything else; reaching here is a bug in the tables
                raise ValueError(f"unexpected opcode 0x{op:02x}")
    except _FromCallback as e:
        raise e.error from None
    except (IndexError, KeyError, TypeError, ValueError, struct.error, UnicodeDecodeError,
            OverflowError, AttributeError) as e:
        raise reader.fail(f"{type(e).__name__}: {e}", pos - 1) from None
