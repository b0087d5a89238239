"""A Hugging Face tokenizer for a process that only tokenizes, loaded without torch.

transformers imports torch to build any tokenizer when torch is installed: about 4 of the 6.5 s of
CPU a gateway or a scripted engine spends starting, for tensors these processes never ask for. With
torch hidden while transformers is first imported, transformers takes it for absent (its own "only
tokenizers, configuration and file/data utilities" mode): the same tokenizer files give the same ids,
chat templates and special tokens (tests/unit/test_tokenizer_loading.py). A process that imported
torch already, or whose own code may run models through transformers (the gateway's in-process
``--reward-function``), loads it as usual.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

_hiding = threading.Lock()
QUIET = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
"""transformers' switch for its advice lines; on while it imports, so "PyTorch was not found" is not printed."""


def load_tokenizer(path: Path | str, without_torch: bool = True) -> Any:
    """``AutoTokenizer.from_pretrained(path)``; without importing torch when ``without_torch`` and neither
    torch nor transformers is imported yet."""
    with _hiding:
        if without_torch and "torch" not in sys.modules and "transformers" not in sys.modules:
            _import_transformers_without_torch()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _import_transformers_without_torch() -> None:
    quiet = os.environ.get(QUIET)
    sys.modules["torch"] = None  # type: ignore[assignment]  # find_spec("torch") is None: torch is absent
    os.environ[QUIET] = "1"
    try:
        from transformers import AutoTokenizer  # noqa: F401  (decides, once, that torch is absent)
    finally:
        del sys.modules["torch"]
        if quiet is None:
            os.environ.pop(QUIET, None)
        else:
            os.environ[QUIET] = quiet
