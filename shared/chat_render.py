"""Chat templates rendered in a child process with limits: ``python -m shared.chat_render FILE``.

A model's chat template is a program (Jinja in transformers' sandbox: no files, no private
attributes, but loops and string arithmetic without bound). The trainer renders every problem of a
job once before its first step (shared.prompts.Renderer.failures); the template runs here, so that
a template that loops for ever or builds a huge string fails the job at load with the reason
instead of hanging or OOM-killing the trainer:

- time: each conversation has ``timeout_s`` (SIGALRM in this process; the parent kills it when
  no answer comes a little after that);
- memory: the address space is capped at what this process holds at start plus
  ``memory_bytes`` (a huge string is a MemoryError here);
- output: a rendering longer than ``max_chars`` characters is refused.

Rendering is transformers' own (``render_jinja_template``, what ``apply_chat_template`` calls),
imported without torch. Nothing is unpickled: JSON in, JSON out.

FILE: a first line ``{"template", "kwargs", "timeout_s", "max_chars", "memory_bytes"}``, then one
conversation (a JSON list of ``{"role", "content"}``) per line. Standard output: one JSON line per
conversation, ``{"text": ...}`` or ``{"error": ...}`` (the template raised, e.g. roles that do not
alternate: a bad row); or, once a limit is broken, ``{"limit": ...}`` and the process ends.
"""

from __future__ import annotations

import json
import resource
import signal
import sys
from typing import Any


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout


def _address_space() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _answer(**kw: Any) -> None:
    sys.stdout.write(json.dumps(kw) + "\n")  # ASCII: any text survives the pipe
    sys.stdout.flush()


def main(path: str) -> int:
    from transformers.utils.chat_template_utils import render_jinja_template

    with open(path, encoding="utf-8") as f:
        head = json.loads(f.readline())
        template, kwargs = head["template"], head["kwargs"]
        timeout_s, max_chars = float(head["timeout_s"]), int(head["max_chars"])
        cap = _address_space() + int(head["memory_bytes"])
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        signal.signal(signal.SIGALRM, _alarm)
        for line in f:
            conversation = json.loads(line)
            try:
                signal.setitimer(signal.ITIMER_REAL, timeout_s)
                try:
                    # (renderings, generation indices), though annotated as str
                    out: Any = render_jinja_template(
                        conversations=[conversation], chat_template=template, add_generation_prompt=True, **kwargs
                    )
                    text = str(out[0][0])
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            except _Timeout:
                _answer(limit=f"rendering one conversation took over {timeout_s:g} s")
                return 0
            except (MemoryError, RecursionError) as e:
                _answer(limit=f"rendering one conversation ran out of memory or stack ({type(e).__name__})")
                return 0
            except Exception as e:  # the template raised on this row (raise_exception, a missing key)
                _answer(error=f"{type(e).__name__}: {str(e)[:300]}")
                continue
            if len(text) > max_chars:
                _answer(limit=f"one conversation renders to {len(text)} characters, over the limit of {max_chars}")
                return 0
            _answer(text=text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
