"""Streaming: each round's committed tokens as the round commits them.

Two forms:

- ``streamer=`` on :func:`dflash.generate` (or the drop-in ``target.generate``):
  transformers' protocol. ``put(prompt ids [1, T])`` first, as transformers'
  ``generate`` puts its input ids first, then ``put(ids [k])`` with the k
  tokens each round commits (the first token after the prefill alone), and
  ``end()`` once. ``TextStreamer`` / ``TextIteratorStreamer`` work as they are.
- :func:`stream`: an iterator over the rounds, yielding each round's new token
  ids (a list of ints), or with ``tokenizer=`` the new text; the
  :class:`~dflash.decoding.result.GenerationResult` is ``.result`` once the
  iterator is exhausted.

The streamer is fed from the host values the round already read: streaming
adds no device read.
"""

from __future__ import annotations

import queue
import threading
from typing import Iterator, List, Optional

import torch

from .options import DEFAULTS

_END = object()


class _Cancelled(Exception):
    """Raised inside the generation thread when the consumer stopped iterating."""


class _QueueStreamer:
    """transformers' streamer protocol into a queue; skips the prompt."""

    def __init__(self, cancelled: threading.Event):
        self.queue: "queue.Queue" = queue.Queue()
        self.cancelled = cancelled
        self.seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if self.cancelled.is_set():
            raise _Cancelled()
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.queue.put(value.flatten().tolist())

    def end(self) -> None:
        self.queue.put(_END)


class TokenStream:
    """Iterator over a generation's rounds (see :func:`stream`); ``result`` once exhausted.

    The generation runs in a worker thread; an exception there is raised from
    the iteration. Closing the iterator early (``close()``, ``break`` then
    garbage collection) stops the generation at its next commit.
    """

    def __init__(self, run, tokenizer=None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.result = None
        self.token_ids: List[int] = []
        self._text = ""
        self._error: Optional[BaseException] = None
        self._cancelled = threading.Event()
        self._streamer = _QueueStreamer(self._cancelled)
        self._done = False

        def work():
            try:
                self.result = run(self._streamer)
            except _Cancelled:
                pass
            except BaseException as exc:  # handed to the consumer
                self._error = exc
            finally:
                self._streamer.queue.put(_END)

        self._thread = threading.Thread(target=work, name="dflash-stream", daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator:
        return self

    def _decode_piece(self, final: bool) -> str:
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens) \
            if _accepts_skip(self.tokenizer) else self.tokenizer.decode(self.token_ids)
        if not final and text.endswith("\ufffd"):
            return ""  # an incomplete multi-byte character: wait for the next round
        piece, self._text = text[len(self._text):], text
        return piece

    def __next__(self):
        while not self._done:
            item = self._streamer.queue.get()
            if item is _END:
                self._finish()
                if self.tokenizer is not None:
                    piece = self._decode_piece(final=True)
                    if piece:
                        return piece
                break
            self.token_ids.extend(item)
            if self.tokenizer is None:
                return item
            piece = self._decode_piece(final=False)
            if piece:
                return piece
        raise StopIteration

    def _finish(self) -> None:
        self._done = True
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """Stop the generation (at its next commit) and wait for the worker."""
        if not self._done:
            self._cancelled.set()
            self._done = True
            self._thread.join()

    def __del__(self):
        try:
            self._cancelled.set()
        except Exception:
            pass


def _accepts_skip(tokenizer) -> bool:
    import inspect

    try:
        params = inspect.signature(tokenizer.decode).parameters
    except (TypeError, ValueError):
        return False
    return "skip_special_tokens" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def stream(target, draft=None, input_ids=None, *, method: str = DEFAULTS.method, tokenizer=None,
           skip_special_tokens: bool = True, compile=DEFAULTS.compile, max_cache_len=DEFAULTS.max_cache_len,
           **kwargs) -> TokenStream:
    """Generate like :func:`dflash.generate`, yielding each round's new tokens as the round commits them.

    Yields lists of token ids (one list per round; the first holds the token
    after the prefill), or with ``tokenizer`` the new text (decoding the whole
    continuation each round, holding back an incomplete character). Settings
    are resolved and checked before the iterator is returned (bad keywords
    raise here); ``.result`` holds the :class:`GenerationResult` afterwards.
    ``streamer=`` is not accepted (this is the streamer). ``compile``, ``max_cache_len`` and every default
    (:data:`~dflash.decoding.options.DEFAULTS`): as :func:`dflash.generate` (compiled rounds stream the
    same way).
    """
    from .generate import prepare_generation, run_generation

    if kwargs.get("streamer") is not None:
        raise ValueError("stream() is the streamer: pass no streamer= (use dflash.generate(streamer=...) instead)")
    plan = prepare_generation(target, draft, input_ids, method=method, **kwargs)

    def run(streamer):
        plan.streamer = streamer
        return run_generation(target, draft, input_ids, plan, method=method, compile=compile,
                              max_cache_len=max_cache_len)

    return TokenStream(run, tokenizer=tokenizer, skip_special_tokens=skip_special_tokens)
