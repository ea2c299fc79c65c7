"""What an allocation's stack says: its top user frame (memory_events.frame, the site that
``tracekit memory --by frame`` groups by) and its stack as text (memory_events.frames, shown on hover),
for every kind of snapshot stack: a CUDA snapshot's C++ and Python frames, torch's CPU-derived
'file(line): function' frames, and the reference trainer's profiler-span frames
(tracekit.conventions ``OP_FRAME_FILE``, ``ANNOTATION_FRAME_FILE``, ``STATE_FRAME_FILE``).
"""

from __future__ import annotations

import re

from tracekit.conventions import ANNOTATION_FRAME_FILE, OP_FRAME_FILE, TRAINER_SPAN_PREFIXES, annotation_context

_CPU_FRAME = re.compile(r"^(?P<file>.+)\((?P<line>\d+)\): (?P<func>.+)$")  # 'train.py(83): step'
_INTERNAL = ("/torch/", "torch/", "<built-in", "multiprocessing/", "threading.py", "<string>")
# C++ frames of a CUDA snapshot recorded with torch's default stacks="all" (the allocator, ATen's
# dispatch, the Python bindings) come before the Python ones and name their source files.
_NATIVE = (".cpp", ".cc", ".cxx", ".c", ".h", ".hpp", ".cu", ".cuh")
# An allocation made by the autograd engine's thread (backward) has no Python frame in a CUDA
# snapshot; its innermost autograd frame says which backward node or which engine step made it.
_AUTOGRAD = re.compile(r"^torch::autograd::(?:generated::(\w+?)(?:_apply_functional|::apply)\b"
                       r"|((?:Engine|InputBuffer)::\w+))")
# Frames made of profiler spans (the reference trainer's CPU snapshots, tracekit.conventions) are
# not source lines: they name a site by op and annotation (_span_site). A backward op's span is
# 'autograd::engine::evaluate_function: MmBackward0'; its site says MmBackward0.
_SPAN_FILES = (OP_FRAME_FILE, ANNOTATION_FRAME_FILE)
_EVALUATE = re.compile(r"^autograd::engine::evaluate_function: ")

# The stored stack (memory_events.frames): its Python (or span) frames, innermost first, at most STACK_FRAMES
# of them and STACK_LINE characters a line, so that one pathological stack (deep recursion, a
# generated name) cannot make each of a million rows kilobytes long.
STACK_FRAMES, STACK_LINE = 32, 240


def top_user_frame(frames: object) -> str | None:
    """'file:line:function' of the innermost frame outside torch and the interpreter's plumbing;
    for a stack of profiler spans (the reference trainer's CPU snapshots), the op that the code
    called in its annotation ('<profiler op>:0:aten::linear in fwd vstage=0'); for backward work
    with no such frame, '<autograd>:0:<node>' (e.g. MmBackward0)."""
    if not isinstance(frames, list):
        return None
    return _python_frame(frames) or _span_site(frames) or _autograd_frame(frames)


def stack_text(frames: object) -> str | None:
    """The allocation's stack as text: every Python frame (torch's too, as memory_viz shows them)
    and every profiler-span frame ('<profiler op>:0:aten::mm', '<annotation>:0:tk.compute ...') as
    'file:line:function', innermost first, one a line (C++ frames left out); a backward allocation
    without such frames: its autograd node. At most STACK_FRAMES lines (then '... N more frames')."""
    if not isinstance(frames, list):
        return None
    lines = []
    for f in frames:
        if not isinstance(f, dict):
            continue
        file, line, func = str(f.get("filename", "")), f.get("line", 0), str(f.get("name", ""))
        if file in ("none", "??", ""):
            m = _CPU_FRAME.match(func)
            if not m:
                continue
            file, line, func = m["file"], m["line"], m["func"]
        if file.endswith(_NATIVE):
            continue
        lines.append(f"{file}:{line}:{func}"[:STACK_LINE])
    if not lines:
        node = _autograd_frame(frames)
        return node[:STACK_LINE] if node else None
    more = len(lines) - STACK_FRAMES
    return "\n".join(lines[:STACK_FRAMES] + ([f"... {more} more frames"] if more > 0 else []))


def _autograd_frame(frames: list) -> str | None:
    for f in frames:
        if isinstance(f, dict) and (m := _AUTOGRAD.match(str(f.get("name", "")))):
            return f"<autograd>:0:{m[1] or m[2]}"
    return None


def _span_site(frames: list) -> str | None:
    """Where a stack of profiler spans allocated: the outermost op inside the innermost trainer
    annotation (tk.module, tk.comm, tk.compute; else the innermost other one, not ProfilerStep#N), with that
    annotation in its short, step-independent form. The op is the one a line of the trainer called;
    the ops inside it are its implementation."""
    ops: list[str] = []
    site = fallback = None
    for f in frames:
        if not isinstance(f, dict):
            continue
        file, name = f.get("filename"), str(f.get("name", ""))
        if file == OP_FRAME_FILE:
            ops.append(_EVALUATE.sub("", name))
        elif file == ANNOTATION_FRAME_FILE and (context := annotation_context(name)) is not None:
            here = (ops[-1] if ops else None, context)
            if name.startswith(TRAINER_SPAN_PREFIXES):
                site = here
                break
            fallback = fallback or here
    op, context = site or fallback or (ops[-1] if ops else None, None)
    if op is None and context is None:
        return None
    return f"{OP_FRAME_FILE if op else ANNOTATION_FRAME_FILE}:0:" + " in ".join(x for x in (op, context) if x)


def _python_frame(frames: list) -> str | None:
    for f in frames:
        if not isinstance(f, dict):
            continue
        file, line, func = str(f.get("filename", "")), f.get("line", 0), str(f.get("name", ""))
        if file in _SPAN_FILES:
            continue
        if file in ("none", "??", ""):  # CPU-derived frames keep everything in 'name'
            m = _CPU_FRAME.match(func)
            if not m:
                continue
            file, line, func = m["file"], m["line"], m["func"]
        if file.endswith(_NATIVE) or any(s in file or file.startswith(s) for s in _INTERNAL) \
                or func.startswith("<built-in"):
            continue
        return f"{file}:{line}:{func}"
    return None


_NO_STACK: tuple[None, None] = (None, None)


def _described(frames: list) -> tuple[str | None, str | None]:
    return top_user_frame(frames), stack_text(frames)


class TopFrames:
    """top_user_frame and stack_text, once per call stack: an allocation site repeats every step, with the same
    frame dicts (torch symbolizes each frame once).

    A stack is looked up by its length and its first and last frames' identities, then compared
    whole with the stacks known under that key: lists of the same dicts compare by identity, at C
    speed, where a key of all the frames' identities took 3x as long as the rest of an entry. Past
    a few stacks under one key (many stacks can share the allocator's frame and the script's), that
    key's stacks are held by all their identities. A cached stack holds its frames, so the
    identities stay valid."""

    ALIKE = 8

    def __init__(self) -> None:
        self.seen: dict[tuple, list[tuple[list, str | None]] | dict[tuple, tuple[list, str | None]]] = {}

    def __call__(self, frames: object) -> tuple[str | None, str | None]:
        return self.many([frames])[0]

    def many(self, stacks: list) -> list[tuple[str | None, str | None]]:
        """(top user frame, stack text) of each stack."""
        seen, out = self.seen, []
        for frames in stacks:
            if type(frames) is not list or not frames:
                out.append(_NO_STACK)
                continue
            key = (len(frames), id(frames[0]), id(frames[-1]))
            known = seen.get(key)
            if known is None:
                if len(seen) > 1 << 16:
                    seen.clear()
                known = seen[key] = []
            if type(known) is dict:
                ids = tuple(map(id, frames))
                hit = known.get(ids)
                if hit is None:
                    hit = known[ids] = (frames, _described(frames))
                out.append(hit[1])
                continue
            for stack, top in known:
                if stack == frames:
                    break
            else:
                top = _described(frames)
                known.append((frames, top))
                if len(known) > self.ALIKE:
                    seen[key] = {tuple(map(id, s)): (s, t) for s, t in known}
            out.append(top)
        return out
