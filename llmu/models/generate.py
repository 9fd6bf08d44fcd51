"""Autoregressive generation: prefill the prompt once, then decode one token at a time with a KV cache.

::

    cache = model.new_cache(max_len=len(prompt) + max_new_tokens)
    logits = model(prompt, cache=cache, last_only=True).logits      # prefill: T tokens at once
    repeat:
        token = pick(logits)                                         # llmu.models.sampling
        stop on EOS, on a stop string, or after max_new_tokens
        logits = model([token], cache=cache, last_only=True).logits  # decode: one token

Prefill is a few large matrix products (compute-bound); every decode step reads all the weights
to produce one token (memory-bound). Module 05 measures both; :class:`GenerationStats` reports them.
The decode steps of the stock model run through :class:`llmu.models.decode_step.DecodeStep`, the
same arithmetic in a few PyTorch calls per layer rather than about sixty (``stats.decode_path``
says ``"decode_step"``); any model it cannot reproduce exactly (another attention backend, a hook,
replaced projections) decodes through its modules (``"modules"``).
"""

from __future__ import annotations

import dataclasses
import numbers
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from llmu.checks import require_token_ids
from llmu.models import decode_step
from llmu.models.cache import KVCache
from llmu.models.sampling import SamplingParams, next_token


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0  # time of the decode steps: new_tokens - 1 forward passes plus sampling
    #: how the decode steps ran: ``"decode_step"`` (llmu.models.decode_step) or ``"modules"``
    decode_path: str = ""

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.new_tokens - 1  # the first new token comes out of the prefill
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else float("nan")


class Generation(str):
    """The generated text (a ``str``), with ``ids`` (new token ids), ``prompt_ids``,
    ``finish_reason`` (``"eos"``, ``"stop"`` or ``"length"``) and ``stats``."""

    ids: list[int]
    prompt_ids: list[int]
    finish_reason: str
    stats: GenerationStats

    def __new__(cls, text: str, *, ids, prompt_ids, finish_reason, stats):
        obj = super().__new__(cls, text)
        obj.ids, obj.prompt_ids, obj.finish_reason, obj.stats = list(ids), list(prompt_ids), finish_reason, stats
        return obj

    @property
    def text(self) -> str:
        return str(self)


def prompt_to_ids(tokenizer, prompt, vocab_size: int | None = None) -> list[int]:
    """Token ids of a prompt given as text, as chat messages (ChatML + the assistant's turn), or as ids.

    At least one token; with ``vocab_size`` (the model's), every id in ``[0, vocab_size)``."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a tokenizer is needed to encode a text prompt")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, torch.Tensor):
        ids = require_token_ids("prompt", prompt)
    elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
        if tokenizer is None:
            raise ValueError("a tokenizer is needed to format chat messages")
        ids = tokenizer.encode(tokenizer.apply_chat_template(prompt, add_generation_prompt=True))
    elif isinstance(prompt, Sequence) and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        ids = list(prompt)
    else:
        raise TypeError("prompt must be a str, a list of chat messages, or a list/tensor of token ids")
    if not ids:
        raise ValueError("prompt is empty: give at least one token")
    return require_token_ids("prompt", ids, vocab_size)


def _check_params(params: SamplingParams | None) -> SamplingParams:
    """``params`` (default: greedy) as a fresh copy made through the constructor, so its checks run
    again whatever was assigned to its fields since; TypeError for anything but a SamplingParams."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a llmu.models.SamplingParams, got {type(params).__name__}")
    return dataclasses.replace(params)


def _check_fits(prompt_len: int, max_new_tokens: int, room: int, what: str, prompt_name: str) -> None:
    """Raise ``ValueError`` naming the argument at fault when the prompt and the new tokens do not
    fit in ``room`` positions: the prompt when it alone is too long, else ``max_new_tokens``."""
    if prompt_len > room:
        raise ValueError(f"{prompt_name}: the prompt alone holds {prompt_len} tokens, more than {what} of "
                         f"{room} positions; shorten the prompt")
    if prompt_len + max_new_tokens > room:
        raise ValueError(f"max_new_tokens: prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"{what} of {room} positions; at most {room - prompt_len} new tokens fit")


def generate_ids(model, prompt_ids: Sequence[int], max_new_tokens: int, params: SamplingParams | None = None, *,
                 eos_ids: Sequence[int] = (), stats: GenerationStats | None = None,
                 cache: KVCache | None = None) -> Iterator[int]:
    """Yield new token ids one by one, stopping after an EOS token (which is yielded) or
    ``max_new_tokens``. The core loop behind :func:`generate`.

    ``prompt_ids``: a list or a 1-D integer tensor (any device) of ids in ``[0, vocab_size)``.
    The arguments are checked here, when this is called, not when the first token is asked for:
    it returns the generator that does the work. Each check runs once, none in the decode loop.
    """
    ids = require_token_ids("prompt_ids", prompt_ids, model.config.vocab_size)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise TypeError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    _check_fits(len(ids), max_new_tokens, model.config.max_position_embeddings, "the model's context", "prompt_ids")
    params = _check_params(params)
    if isinstance(eos_ids, torch.Tensor):
        eos_ids = eos_ids.reshape(-1).tolist()
    if isinstance(eos_ids, (str, bytes)) or not isinstance(eos_ids, Iterable):
        raise TypeError(f"eos_ids must be a list of int token ids, got {eos_ids!r}")
    eos_ids = list(eos_ids)
    if any(isinstance(e, bool) or not isinstance(e, numbers.Integral) for e in eos_ids):
        raise TypeError(f"eos_ids must be a list of int token ids, got {eos_ids!r}")
    if stats is not None and not isinstance(stats, GenerationStats):
        raise TypeError(f"stats must be a GenerationStats or None, got {type(stats).__name__}")
    if cache is not None:
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a llmu.models.KVCache or None, got {type(cache).__name__}")
        _check_fits(len(ids), max_new_tokens, cache.max_len - cache.length,
                    f"the cache's free positions (max_len={cache.max_len}, {cache.length} used)", "prompt_ids")
    return _generate_ids(model, ids, max_new_tokens, params, {int(e) for e in eos_ids}, stats, cache)


def _generate_ids(model, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams, eos: set[int],
                  stats: GenerationStats | None, cache: KVCache | None) -> Iterator[int]:
    """The loop of :func:`generate_ids`, on arguments it has checked."""
    if max_new_tokens == 0:
        return
    total = len(prompt_ids) + max_new_tokens
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt_ids)
    device = model.device
    generator = None
    if not params.greedy:
        generator = torch.Generator(device=device)
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
    # every token so far, for the repetition penalty (preallocated, filled as we go)
    context = torch.empty(1, total, dtype=torch.long, device=device)
    context[0, : len(prompt_ids)] = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    n = len(prompt_ids)
    if cache is None:
        cache = KVCache.for_model(model, batch_size=1, max_len=total)
    use_context = params.repetition_penalty != 1

    # inference mode only around the model's work: the caller's code between two tokens runs
    # in whatever mode it chose
    start = time.perf_counter()
    with torch.inference_mode():
        logits = model(context[:, :n], cache=cache, last_only=True).logits[:, -1]
    stats.prefill_s = time.perf_counter() - start
    # the decode steps: the stock model through DecodeStep (the same arithmetic in fewer calls),
    # anything else through its modules; decided once, here
    fast = None
    if decode_step.ENABLED and decode_step.unsupported(model, cache) is None:
        fast = decode_step.DecodeStep(model)
    stats.decode_path = "decode_step" if fast is not None else "modules"
    for step in range(max_new_tokens):
        start = time.perf_counter()
        with torch.inference_mode():
            token = next_token(logits, context[:, :n] if use_context else None, params, generator)
            context[0, n] = token[0]
        n += 1
        token_id = int(token[0])
        stats.new_tokens += 1
        stats.decode_s += time.perf_counter() - start
        yield token_id
        if token_id in eos or step == max_new_tokens - 1:
            break
        start = time.perf_counter()
        with torch.inference_mode():
            if fast is not None:
                logits = fast(token_id, cache)  # (1, vocab)
            else:
                logits = model(context[:, n - 1 : n], cache=cache, last_only=True).logits[:, -1]
        stats.decode_s += time.perf_counter() - start


def _held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of ``text`` might still become a stop string (or a whole UTF-8 character)."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    if text.endswith("\ufffd"):  # the last token ended inside a multi-byte character
        hold = max(hold, len(text) - len(text.rstrip("\ufffd")))
    return hold


def stream_generate(model, tokenizer, prompt, max_new_tokens: int = 128, *, params: SamplingParams | None = None,
                    stop: str | Sequence[str] | None = None, stop_on_eos: bool = True,
                    result: dict | None = None, **sampling) -> Iterator[str]:
    """Yield the generated text piece by piece as tokens come (see :func:`generate` for the arguments).

    A piece is held back while it could still be the start of a stop string or of an unfinished
    UTF-8 character, so the concatenated pieces are exactly the final text. Pass a dict as
    ``result`` to receive the :class:`Generation` at the end. As with :func:`generate_ids`, the
    arguments are checked when this is called, before the first piece is asked for.
    """
    if params is None:
        params = SamplingParams(**sampling)
    elif sampling:
        raise ValueError(f"pass either params or sampling arguments, not both (got {sorted(sampling)})")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, Sequence) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise ValueError(f"stop must be a str or a list of str, got {stop!r}")
    if any(not s for s in stops):
        raise ValueError("stop strings must not be empty")
    if stops and tokenizer is None:
        raise ValueError("stop strings need a tokenizer to decode the output")
    if not isinstance(stop_on_eos, bool):
        raise TypeError(f"stop_on_eos must be a bool, got {stop_on_eos!r}")
    if result is not None and not isinstance(result, dict):
        raise TypeError(f"result must be a dict or None, got {type(result).__name__}")

    prompt_ids = prompt_to_ids(tokenizer, prompt, model.config.vocab_size)
    if isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool) and max_new_tokens >= 0:
        # named as the caller of generate() named it (generate_ids would say prompt_ids)
        _check_fits(len(prompt_ids), max_new_tokens, model.config.max_position_embeddings,
                    "the model's context", "prompt")
    eos_ids: list[int] = []
    if stop_on_eos:
        eos_ids = list(model.config.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos_ids.append(tokenizer.eos_token_id)
    stats = GenerationStats()
    tokens = generate_ids(model, prompt_ids, max_new_tokens, params, eos_ids=eos_ids, stats=stats)
    return _stream_text(tokens, tokenizer, prompt_ids, eos_ids, stops, stats, result)


def _stream_text(tokens: Iterator[int], tokenizer, prompt_ids: list[int], eos_ids: list[int], stops: list[str],
                 stats: GenerationStats, result: dict | None) -> Iterator[str]:
    """The loop of :func:`stream_generate`: decode ``tokens`` into text pieces, on checked arguments."""
    ids: list[int] = []
    text, emitted, finish = "", 0, "length"
    for token_id in tokens:
        if token_id in eos_ids:
            finish = "eos"
            break
        ids.append(token_id)
        if tokenizer is None:
            continue
        text = tokenizer.decode(ids)
        hits = [text.find(s, max(0, emitted - len(s))) for s in stops]
        hits = [h for h in hits if h >= 0]
        if hits:
            text = text[: min(hits)]
            finish = "stop"
            break
        ready = len(text) - _held_back(text, stops)
        if ready > emitted:
            yield text[emitted:ready]
            emitted = ready
    if len(text) > emitted:
        yield text[emitted:]
    if result is not None:
        result["generation"] = Generation(text, ids=ids, prompt_ids=prompt_ids, finish_reason=finish, stats=stats)


def generate(model, tokenizer, prompt, max_new_tokens: int = 128, *, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0, seed: int | None = None,
             stop: str | Sequence[str] | None = None, stream: Callable[[str], object] | None = None,
             params: SamplingParams | None = None, stop_on_eos: bool = True) -> Generation:
    """Continue ``prompt`` and return the new text (a :class:`Generation`, which is a ``str``).

    ``prompt``: text, chat messages (``[{"role": "user", "content": ...}]``, formatted with the
    tokenizer's chat template and the assistant's turn opened), or token ids.
    Decoding: greedy by default (``temperature=0``); with ``temperature > 0`` it samples, after
    ``top_k`` / ``top_p`` / ``min_p`` / ``repetition_penalty`` (see ``llmu.models.sampling``), from a
    generator seeded with ``seed`` (same seed, same text). Or pass a ready ``SamplingParams``.
    Stops at EOS, at any of the ``stop`` strings (cut off, not included), or after
    ``max_new_tokens``. ``stream``: called with each new piece of text as soon as it is final.
    """
    if params is None:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repetition_penalty=repetition_penalty, seed=seed)
    if stream is not None and not callable(stream):
        raise ValueError("stream must be a callable taking a str")
    result: dict = {}
    for piece in stream_generate(model, tokenizer, prompt, max_new_tokens, params=params, stop=stop,
                                 stop_on_eos=stop_on_eos, result=result):
        if stream is not None:
            stream(piece)
    return result["generation"]
