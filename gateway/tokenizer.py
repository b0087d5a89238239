"""The gateway's tokenizer, loaded in the background so the HTTP server answers at once.

Prompts are built here, never by the engine: ``prompt_ids`` of a Step are the
chat template of the whole conversation with the generation prompt, exactly as
the engine receives them, so the trainer sees the tokens that were sampled from.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger("trajbus.gateway")


class TokenizerNotReady(RuntimeError):
    pass


class ChatTokenizer:
    def __init__(self, path: str) -> None:
        self.path = path
        self._tokenizer = None
        self.error: str | None = None
        self._loaded = threading.Event()

    def load_in_background(self) -> threading.Thread:
        thread = threading.Thread(target=self._load, name="tokenizer-load", daemon=True)
        thread.start()
        return thread

    def _load(self) -> None:
        started = time.monotonic()
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.path)
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError(f"tokenizer at {self.path} has no chat template")
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

    def chat_prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """Token ids of the conversation's chat template, generation prompt included."""
        tokenizer = self.tokenizer
        text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
