"""The gateway's tokenizer, loaded in the background so the HTTP server answers at once.

Prompts are built here, never by the engine (see ``gateway.prompts.conversation``):
``prompt_ids`` of a Step are exactly what the engine receives, so the trainer
sees the tokens that were sampled from.

A gateway without its tokenizer can serve nothing, so a ``--tokenizer-path`` that cannot
work ends it with one line naming the path and why: refused before serving when it obviously
cannot (``check_tokenizer_path``: no such folder and no hub id, a file, a folder without
tokenizer files), else once the load failed (``on_failure``; ``gateway.service`` ends the
process). Hugging Face's own words for a local path that is not there ("Repo id must be in
the form ...") would be no clue.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

from trajbus.gateway.prompts.conversation import CUMULATIVE, PromptBuilder
from trajbus.gateway.prompts.encoder_thread import EncoderThread, inline
from trajbus.infra.allocator import mimalloc_active
from trajbus.infra.collector import freeze_loaded
from trajbus.infra.tokenizer_loading import load_tokenizer

log = logging.getLogger("trajbus.gateway")

TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "config.json")
"""A folder a tokenizer loads from holds one of these at least (the tokenizer's class is read from the first or
the last; the second is a fast tokenizer whole)."""


class TokenizerNotReady(RuntimeError):
    pass


def check_tokenizer_path(path: str) -> None:
    """``ValueError`` (one line, naming the path) for a ``--tokenizer-path`` that cannot load: neither a folder
    nor a Hugging Face hub id (``NAME`` or ``ORG/NAME``), a file, or a folder holding no tokenizer files."""
    where = f"--tokenizer-path {path}"
    if os.path.isdir(path):
        if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
            raise ValueError(f"{where}: the folder holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
        return
    if os.path.exists(path):
        raise ValueError(f"{where}: a file, not the folder of a tokenizer (the one holding tokenizer_config.json)")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        raise ValueError(f"{where}: no such folder (nor a Hugging Face hub id, NAME or ORG/NAME)") from None


def load_failure(path: str, exc: Exception) -> str:
    """Why the tokenizer at ``path`` did not load, in one line."""
    where = "" if os.path.isdir(path) else " (no such folder here; tried as a Hugging Face hub id)"
    words = " ".join(str(exc).split())  # Hugging Face's messages span lines
    return f"--tokenizer-path {path}: the tokenizer failed to load{where}: {type(exc).__name__}: {words}"


class ChatTokenizer:
    def __init__(self, path: str, multi_turn: str = CUMULATIVE, without_torch: bool = True,
                 on_failure: Callable[[str], None] | None = None) -> None:
        """``without_torch``: the process only tokenizes (``infra.tokenizer_loading``); ``on_failure``: told why
        the load failed (one line), else it is logged and ``/ready`` says it."""
        self.path = path
        self.multi_turn = multi_turn
        self.without_torch = without_torch
        self.on_failure = on_failure
        self._tokenizer = None
        self._prompts: PromptBuilder | None = None
        self.error: str | None = None
        self._loaded = threading.Event()
        self.encoder = None if mimalloc_active() else EncoderThread()
        """Where the prompts' encodes run under glibc: on a heap apart from the event loop's
        (``gateway.prompts.encoder_thread``); under mimalloc (``infra.allocator``) no heap is slow to share, and
        they run on the caller's thread, without a hand-off."""

    def load_in_background(self) -> threading.Thread:
        thread = threading.Thread(target=self._load, name="tokenizer-load", daemon=True)
        thread.start()
        return thread

    def _load(self) -> None:
        started = time.monotonic()
        try:
            tokenizer = load_tokenizer(self.path, self.without_torch)
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError("it has no chat template (the gateway renders conversations with it)")
            self._prompts = PromptBuilder(tokenizer, self.multi_turn,
                                          inline if self.encoder is None else self.encoder.run)
            freeze_loaded()  # the tokenizer lives as long as the server: no full collection walks it again
            self._tokenizer = tokenizer
            log.info("tokenizer loaded path=%s vocab=%d seconds=%.2f", self.path, len(tokenizer),
                     time.monotonic() - started)
        except Exception as exc:  # the gateway ends (on_failure); /ready says it meanwhile
            self.error = load_failure(self.path, exc)
            if self.on_failure is None:
                log.error(self.error)
            else:
                self.on_failure(self.error)
        finally:
            self._loaded.set()

    def close(self) -> None:
        if self.encoder is not None:
            self.encoder.close()

    @property
    def ready(self) -> bool:
        return self._tokenizer is not None

    @property
    def missing(self) -> str:
        """Why it cannot tokenize yet: what ``/ready`` says."""
        return self.error or f"loading the tokenizer from {self.path}"

    def wait(self, timeout: float | None = None) -> bool:
        return self._loaded.wait(timeout) and self.ready

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            raise TokenizerNotReady(self.missing)
        return self._tokenizer

    @property
    def prompts(self) -> PromptBuilder:
        if self._prompts is None:
            raise TokenizerNotReady(self.missing)
        return self._prompts

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end a generation (EOS), once loaded: a cut response ending with one is finished."""
        eos = self._tokenizer.eos_token_id if self._tokenizer is not None else None
        return frozenset() if eos is None else frozenset({eos})
