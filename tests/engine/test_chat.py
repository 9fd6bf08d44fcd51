"""``llmu chat``: the conversation loop (in process, on StringIO) and the command itself (a subprocess)."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from llmu.engine import LLMEngine, SamplingParams
from llmu.engine.chat import chat


@pytest.mark.slow
def test_chat_streams_replies_and_keeps_the_conversation(smollm2):
    model, tok = smollm2
    engine = LLMEngine(model, tok, num_blocks=64, max_num_seqs=1)
    inp = io.StringIO("What is the capital of France?\n\nAnd of Italy?\n/reset\nHi\n/exit\nnever read\n")
    out = io.StringIO()
    assert chat(model, tok, params=SamplingParams(max_tokens=16), inp=inp, out=out, engine=engine) == 0
    text = out.getvalue()
    assert "Paris" in text and "Rome" in text
    assert text.count("tokens/s") == 3, "every reply ends with its numbers line"
    assert "(conversation reset)" in text
    lines = [l for l in text.splitlines() if "prompt tokens" in l]
    # the second turn repeats the first turn's tokens: the prefix cache supplies them
    assert "(0 from the prefix cache)" in lines[0] and "(0 from the prefix cache)" not in lines[1]


@pytest.mark.slow
def test_chat_reports_a_conversation_that_outgrows_the_context(smollm2):
    model, tok = smollm2
    engine = LLMEngine(model, tok, num_blocks=64, max_num_seqs=1, max_model_len=80)
    out = io.StringIO()
    chat(model, tok, params=SamplingParams(max_tokens=60), inp=io.StringIO("Tell me about the moon.\n"), out=out,
         engine=engine)
    assert "max_model_len=80" in out.getvalue() and "/reset" in out.getvalue()


def test_llmu_chat_command():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "llmu.cli", "chat", "--max-tokens", "12"],
                          input="What is 2+2?\n/exit\n", capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "tokens/s" in proc.stdout and "assistant>" in proc.stdout


def test_llmu_chat_rejects_bad_options():
    proc = subprocess.run([sys.executable, "-m", "llmu.cli", "chat", "--temperature", "-1"],
                          input="", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "temperature" in proc.stderr


@pytest.mark.slow
def test_ctrl_c_stops_the_reply_not_the_chat(smollm2):
    model, tok = smollm2
    engine = LLMEngine(model, tok, num_blocks=64, max_num_seqs=1)
    real_step, calls = engine.step, {"n": 0}

    def step():  # the user presses Ctrl-C during the third step of the first reply
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_step()

    engine.step = step
    out = io.StringIO()
    chat(model, tok, params=SamplingParams(max_tokens=8), inp=io.StringIO("Hi\nWhat is 2+2?\n"), out=out,
         engine=engine)
    text = out.getvalue()
    assert "[interrupted]" in text and text.count("tokens/s") == 1, "the second message should still get a reply"
    assert not engine.has_unfinished() and engine.block_manager.num_used_blocks == 0
