"""Bounded rendering of caller-supplied chat templates (ApplyChatTemplate's `chat_template`).

A chat template is Jinja code. transformers renders it in jinja2's ImmutableSandboxedEnvironment,
which stops attribute escapes but not work: two nested `range(100000)` loops run for hours, and
`{% set s = s ~ s %}` in a loop asks for terabytes. Neither can be interrupted inside the process
(a C-level string copy never returns to the interpreter), so a template someone sent renders in a
child process that this module kills past its deadline, whose address space is capped, and whose
output is capped. The model's own template (trusted, it came with the model) keeps the in-process
path; only a template that differs from it comes here.

The child renders with transformers' own `render_jinja_template` (the function
`tokenizer.apply_chat_template` calls), so the text is the same as an in-process render. One child
(by default) is started on first use and kept; a killed child is replaced at once, in the
background. Run as `python -m specdec.runtime.chat_template` it is that child: it reads framed JSON
requests on stdin and answers on stdout; EOF on stdin (its parent is gone) ends it.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import select
import struct
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.errors import InvalidRequest, Overloaded

KIB = 1024
MIB = 1024 * KIB
DEFAULT_MAX_TEMPLATE_BYTES = 64 * KIB
DEFAULT_RENDER_TIMEOUT_S = 2.0
DEFAULT_MAX_OUTPUT_BYTES = 4 * MIB
DEFAULT_MAX_MEMORY_MB = 512
# How long a fresh child may take to import transformers (not counted against a render's deadline).
START_TIMEOUT_S = 120.0
_HEADER = struct.Struct(">I")


@dataclass(frozen=True)
class TemplateLimits:
    """What a caller-supplied template may cost. Each limit is named in the error it causes."""

    max_template_bytes: int = DEFAULT_MAX_TEMPLATE_BYTES  # the template's UTF-8 size
    timeout_s: float = DEFAULT_RENDER_TIMEOUT_S  # wall time of one render; the child is killed past it
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES  # the rendered prompt's UTF-8 size
    max_memory_mb: int = DEFAULT_MAX_MEMORY_MB  # the child's address space beyond what it starts with
    workers: int = 1  # child processes (renders at a time)

    def __post_init__(self) -> None:
        if self.max_template_bytes < 1 or self.max_output_bytes < 1 or self.max_memory_mb < 16:
            raise ValueError("template limits must be positive (memory at least 16 MB)")
        if not self.timeout_s > 0 or self.workers < 1:
            raise ValueError("the render timeout must be > 0 s and workers at least 1")


def utf8_size_over(text: str, limit: int) -> int | None:
    """The UTF-8 size of `text` when it is over `limit`, else None (no copy for short texts)."""
    if len(text) > limit:
        return len(text.encode("utf-8", "surrogatepass")) if not text.isascii() else len(text)
    if len(text) * 4 <= limit or text.isascii():
        return None
    size = len(text.encode("utf-8", "surrogatepass"))
    return size if size > limit else None


# ------------------------------------------------------------------------------------- parent side


class _Child:
    """One render process and its pipes; `ready` once it has imported transformers."""

    def __init__(self, limits: TemplateLimits) -> None:
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", PYTHONDONTWRITEBYTECODE="1",
                   PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specdec.runtime.chat_template", str(limits.max_memory_mb)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
            close_fds=True, start_new_session=True)
        self.ready = False

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()

    def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message, ensure_ascii=False).encode("utf-8", "surrogatepass")
        assert self.proc.stdin is not None
        self.proc.stdin.write(_HEADER.pack(len(data)) + data)
        self.proc.stdin.flush()

    def receive(self, deadline: float) -> dict[str, Any] | None:
        """The next framed answer, or None when the deadline passed first. EOFError if the child died."""
        header = self._read(_HEADER.size, deadline)
        if header is None:
            return None
        body = self._read(_HEADER.unpack(header)[0], deadline)
        return None if body is None else json.loads(body.decode("utf-8", "surrogatepass"))

    def _read(self, size: int, deadline: float) -> bytes | None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        chunks: list[bytes] = []
        while size > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            readable, _, _ = select.select([fd], [], [], left)
            if not readable:
                return None
            chunk = os.read(fd, min(size, MIB))
            if not chunk:
                raise EOFError("the chat template renderer exited")
            chunks.append(chunk)
            size -= len(chunk)
        return b"".join(chunks)


class ChatTemplateRenderer:
    """Renders untrusted chat templates under TemplateLimits in killable child processes.

    Thread-safe: each render takes one child from a pool (Overloaded when none frees up within
    the render timeout twice over plus a child's start-up), so a template that hangs holds one
    child for at most `timeout_s` and nothing else in the process waits for it."""

    def __init__(self, limits: TemplateLimits | None = None) -> None:
        self.limits = limits or TemplateLimits()
        self._idle: queue.Queue[_Child | None] = queue.Queue()
        for _ in range(self.limits.workers):
            self._idle.put(None)  # a slot; its child starts on first use
        self._lock = threading.Lock()
        self._children: weakref.WeakSet[_Child] = weakref.WeakSet()
        self._closed = False
        self.renders = 0  # counters, for tests and metrics
        self.timeouts = 0
        atexit.register(self.close)

    def render(self, template: str, messages: list[dict[str, str]], variables: dict[str, Any]) -> str:
        """`template` rendered for `messages` with the assistant's turn opened, as transformers'
        apply_chat_template(tokenize=False, add_generation_prompt=True) would, with `variables`
        (the tokenizer's special tokens) in scope. InvalidRequest names the limit a template broke."""
        limits = self.limits
        size = utf8_size_over(template, limits.max_template_bytes)
        if size is not None:
            raise InvalidRequest(f"chat_template: {size} UTF-8 bytes; at most {limits.max_template_bytes} "
                                 "are allowed (the verifier's --max-chat-template-kb)")
        wait = 2 * limits.timeout_s + START_TIMEOUT_S
        try:
            child = self._idle.get(timeout=wait)
        except queue.Empty:
            raise Overloaded(f"chat template renderer: every one of its {limits.workers} processes stayed "
                             f"busy for {wait:.0f} s") from None
        try:
            child = self._ready_child(child)
            child.send({"template": template, "messages": messages, "variables": variables,
                        "max_output_bytes": limits.max_output_bytes})
            try:
                answer = child.receive(time.monotonic() + limits.timeout_s)
            except (EOFError, OSError, ValueError):
                child = self._replace(child)
                raise InvalidRequest("chat_template: the render process died (it ran out of its "
                                     f"{limits.max_memory_mb} MB of memory or crashed)") from None
            if answer is None:
                self.timeouts += 1
                child = self._replace(child)
                raise InvalidRequest(f"chat_template: rendering took longer than {limits.timeout_s:g} s "
                                     "(the verifier's --chat-template-timeout) and was stopped")
            self.renders += 1
            if answer.get("restart"):
                child = self._replace(child)
            if "error" in answer:
                raise InvalidRequest(f"chat_template: {answer['error']}")
            return str(answer["text"])
        finally:
            self._idle.put(child)

    def _ready_child(self, child: _Child | None) -> _Child:
        """A started child whose imports are done (starting one when the slot is empty)."""
        if child is None or child.proc.poll() is not None:
            if child is not None:
                child.kill()
            child = self._start()
        if not child.ready:
            try:
                hello = child.receive(time.monotonic() + START_TIMEOUT_S)
            except (EOFError, OSError, ValueError):
                hello = None
            if not hello or not hello.get("ready"):
                child.kill()
                raise Overloaded("chat template renderer: its process did not start "
                                 f"within {START_TIMEOUT_S:g} s")
            child.ready = True
        return child

    def _start(self) -> _Child:
        with self._lock:
            if self._closed:
                raise Overloaded("chat template renderer: shutting down")
            child = _Child(self.limits)
            self._children.add(child)
            return child

    def _replace(self, child: _Child) -> _Child | None:
        """Kill `child` and start its successor now, so its imports run while nobody waits."""
        child.kill()
        try:
            return self._start()
        except Overloaded:
            return None

    def close(self) -> None:
        """Kill every child (idempotent; also at interpreter exit)."""
        with self._lock:
            self._closed = True
            children = list(self._children)
        for child in children:
            child.kill()


# -------------------------------------------------------------------------------------- child side


def _write(message: dict[str, Any]) -> None:
    data = json.dumps(message, ensure_ascii=False).encode("utf-8", "surrogatepass")
    sys.stdout.buffer.write(_HEADER.pack(len(data)) + data)
    sys.stdout.buffer.flush()


def _read_exact(size: int) -> bytes | None:
    data = sys.stdin.buffer.read(size)
    return data if len(data) == size else None


def _child_main(max_memory_mb: int) -> None:
    """Serve render requests until stdin closes."""
    import resource

    from transformers.utils.chat_template_utils import render_jinja_template

    with open("/proc/self/statm") as statm:  # pages of address space in use now
        in_use = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = in_use + max_memory_mb * MIB
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    _write({"ready": True})
    while True:
        header = _read_exact(_HEADER.size)
        if header is None:
            return
        body = _read_exact(_HEADER.unpack(header)[0])
        if body is None:
            return
        request = json.loads(body.decode("utf-8", "surrogatepass"))
        try:
            rendered, _ = render_jinja_template(
                conversations=[request["messages"]], chat_template=request["template"],
                add_generation_prompt=True, **request["variables"])
            text = rendered[0]
            limit = int(request["max_output_bytes"])
            size = utf8_size_over(text, limit)
            if size is not None:
                _write({"error": f"the rendered prompt has {size} UTF-8 bytes; at most {limit} are allowed"})
            else:
                _write({"text": text})
        except MemoryError:
            _write({"error": f"rendering needed more than {max_memory_mb} MB of memory", "restart": True})
            return
        except RecursionError:
            _write({"error": "the template recursed too deeply", "restart": True})
            return
        except Exception as exc:  # noqa: BLE001 - any Jinja error of the template on these messages
            _write({"error": f"the chat template failed: {type(exc).__name__}: {exc}"[:2000]})


if __name__ == "__main__":
    _child_main(int(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_MAX_MEMORY_MB)
