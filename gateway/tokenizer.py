"""The gateway's tokenizer, loaded in the background so the HTTP server answers at once.

Prompts are built here, never by the engine (see ``gateway.conversation``):
``prompt_ids`` of a Step are exactly what the engine receives, so the trainer
sees the tokens that were sampled from.
"""

from __future__ import annotations

import logging
import threading
import time

from trajbus.gateway.conversation import CUMULATIVE, PromptBuilder
from trajbus.infra.tokenizer_loading import load_tokenizer

log = logging.getLogger("trajbus.gateway")


class TokenizerNotReady(RuntimeError):
    pass


class ChatTokenizer:
    def __init__(self, path: str, multi_turn: str = CUMULATIVE, without_torch: bool = True) -> None:
        """``without_torch``: the process only tokenizes (``infra.tokenizer_loading``)."""
        self.path = path
        self.multi_turn = multi_turn
        self.without_torch = without_torch
        self._tokenizer = None
        self._prompts: PromptBuilder | None = None
        self.error: str | None = None
        self._loaded = threading.Event()

    def load_in_background(self) -> threading.Thread:
        thread = threading.Thread(target=self._load, name="tokenizer-load", daemon=True)
        thread.start()
        return thread

    def _load(self) -> None:
        started = time.monotonic()
        try:
            tokenizer = load_tokenizer(self.path, self.without_torch)
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError(f"tokenizer at {self.path} has no chat template")
            self._prompts = PromptBuilder(tokenizer, self.multi_turn)
            self._tokenizer = tokenizer
            log.info("tokenizer loaded path=%s vocab=%d seconds=%.2f", self.path, len(tokenizer),
                     time.monotonic() - started)
        except Exception as exc:  # reported by /ready; the server keeps answering
            self.error = f"tokenizer failed to load from {self.path}: {exc}"
            log.error(self.error)
        finally:
            self._loaded.set()

    @property
    def ready(self) -> bool:
        return self._tokenizer is not None

    def wait(self, timeout: float | None = None) -> bool:
        return self._loaded.wait(timeout) and self.ready

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            raise TokenizerNotReady(self.error or "tokenizer is still loading")
        return self._tokenizer

    @property
    def prompts(self) -> PromptBuilder:
        if self._prompts is None:
            raise TokenizerNotReady(self.error or "tokenizer is still loading")
        return self._prompts

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end a generation (EOS), once loaded: a cut response ending with one is finished."""
        eos = self._tokenizer.eos_token_id if self._tokenizer is not None else None
        return frozenset() if eos is None else frozenset({eos})
