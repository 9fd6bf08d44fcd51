"""``llmu chat``: talk to the course's model in a terminal, token by token, with the engine's speed.

Each turn appends the user's message to the conversation, formats it with the model's chat
template and hands it to :class:`llmu.engine.LLMEngine` as one request; the reply streams as it
is generated, followed by a line with the numbers: prompt tokens (and how many the prefix cache
supplied — the earlier turns are the same tokens as last time), new tokens, time to first token
and decode tokens/s. Commands: ``/reset`` forgets the conversation, ``/exit`` (or end of input)
quits; Ctrl-C stops a reply that is being generated.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import TextIO

from llmu.engine.engine import LLMEngine
from llmu.engine.sequence import SamplingParams

__all__ = ["chat", "turn"]

HELP = "Type a message and press Enter. /reset starts over, /exit quits."


def turn(engine: LLMEngine, messages: list[dict], params: SamplingParams, out: TextIO) -> tuple[str, dict]:
    """Stream one assistant reply to ``messages`` into ``out``; return its text and its numbers."""
    start = time.perf_counter()
    rid = engine.add_request(messages, params)
    first = None
    pieces = []
    while engine.has_unfinished():
        for event in engine.step():
            if event.request_id != rid:
                continue
            if event.token_ids and first is None:
                first = time.perf_counter()
            if event.text:
                pieces.append(event.text)
                out.write(event.text)
                out.flush()
    end = time.perf_counter()
    result = engine.output(rid)
    comp = result.outputs[0]
    n = len(comp.token_ids)
    numbers = {
        "prompt_tokens": len(result.prompt_token_ids),
        "cached_tokens": result.cached_tokens,
        "new_tokens": n,
        "ttft_s": (first or end) - start,
        "decode_tokens_per_s": (n - 1) / (end - first) if first is not None and n > 1 and end > first else float("nan"),
        "finish_reason": comp.finish_reason,
    }
    return "".join(pieces), numbers


def chat(model, tokenizer, *, system: str | None = None, params: SamplingParams | None = None,
         inp: TextIO | None = None, out: TextIO | None = None, engine: LLMEngine | None = None) -> int:
    """The interactive loop (reads ``inp``, writes ``out``; the terminal by default).

    The arguments are checked before the first prompt: inside the loop a ``ValueError`` means the
    conversation no longer fits the context, and is answered as such.
    """
    if params is None:
        params = SamplingParams(max_tokens=256)
    elif not isinstance(params, SamplingParams):
        raise TypeError(f"params must be an llmu.engine.SamplingParams, got {type(params).__name__}")
    else:
        params = dataclasses.replace(params)  # through the constructor: its checks run again
    if system is not None and not isinstance(system, str):
        raise TypeError(f"system must be a str or None, got {type(system).__name__}")
    if engine is not None and not isinstance(engine, LLMEngine):
        raise TypeError(f"engine must be an llmu.engine.LLMEngine or None, got {type(engine).__name__}")
    inp, out = inp or sys.stdin, out or sys.stdout
    engine = engine or LLMEngine(model, tokenizer, max_num_seqs=1)
    base = [{"role": "system", "content": system}] if system else []
    messages = list(base)
    interactive = hasattr(inp, "isatty") and inp.isatty()
    out.write(f"llmu chat — {HELP}\n")
    while True:
        if interactive:
            out.write("\nyou> ")
            out.flush()
        try:
            line = inp.readline()
        except KeyboardInterrupt:
            break
        if not line:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            messages = list(base)
            out.write("(conversation reset)\n")
            continue
        messages.append({"role": "user", "content": text})
        out.write("assistant> ")
        out.flush()
        try:
            reply, numbers = turn(engine, messages, params, out)
        except ValueError as exc:  # the conversation no longer fits the context: say so, keep going
            messages.pop()
            out.write(f"\n[{exc}; /reset to start a new conversation]\n")
            continue
        except KeyboardInterrupt:  # Ctrl-C stops the reply, not the chat
            for rid in list(engine.unfinished_requests()):
                engine.abort(rid)
            messages.pop()
            out.write("\n[interrupted]\n")
            continue
        messages.append({"role": "assistant", "content": reply})
        out.write(f"\n[{numbers['prompt_tokens']} prompt tokens ({numbers['cached_tokens']} from the prefix cache), "
                  f"{numbers['new_tokens']} new, first token after {numbers['ttft_s'] * 1000:.0f} ms, "
                  f"{numbers['decode_tokens_per_s']:.1f} tokens/s, {numbers['finish_reason']}]\n")
        out.flush()
    return 0
