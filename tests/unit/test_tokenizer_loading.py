"""A process that only tokenizes loads its tokenizer without torch, and gets the same tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trajbus.infra import tiny_model

CONVERSATION = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "What is the weather in Paris?"}]
TEXT = "Checked the file; the failing assertion compares the parsed header."

PROBE = """
import json, sys
from trajbus.infra.tokenizer_loading import load_tokenizer
from tests.unit.test_tokenizer_loading import CONVERSATION, TEXT, what_it_gives
from trajbus.infra.tiny_model import WEATHER_TOOL
tokenizer = load_tokenizer(sys.argv[1])
print(json.dumps({"torch": "torch" in sys.modules, **what_it_gives(tokenizer, [WEATHER_TOOL])}))
"""


def what_it_gives(tokenizer, tools: list) -> dict:
    """What the gateway asks of a tokenizer: ids, decoding, the chat template with tools, the EOS id."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    return {"ids": ids, "text": tokenizer.decode(ids), "eos": tokenizer.eos_token_id,
            "prompt": tokenizer.apply_chat_template(CONVERSATION, tools=tools, tokenize=False,
                                                    add_generation_prompt=True)}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    tiny_model.build_tokenizer().save_pretrained(path)
    return path


def test_a_tokenizer_loaded_without_torch_gives_what_the_usual_load_gives(tokenizer_dir):
    from transformers import AutoTokenizer

    done = subprocess.run([sys.executable, "-c", PROBE, str(tokenizer_dir)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert loaded.pop("torch") is False
    assert loaded == what_it_gives(AutoTokenizer.from_pretrained(tokenizer_dir), [tiny_model.WEATHER_TOOL])
    assert "PyTorch was not found" not in done.stderr  # transformers' advice is not our process's output


FROZEN_PROBE = """
import gc, json, sys
from trajbus.gateway.prompts.tokenizer import ChatTokenizer
from trajbus.infra.collector import tune_for_serving
tune_for_serving()
before = gc.get_freeze_count()
tokenizer = ChatTokenizer(sys.argv[1])
tokenizer.load_in_background().join(60)
gc.collect()
print(json.dumps({"ready": tokenizer.ready, "frozen": gc.get_freeze_count() - before,
                  "tracked": len(gc.get_objects())}))
"""


def test_the_gateway_tokenizer_is_frozen_once_loaded_so_full_collections_skip_it(tokenizer_dir):
    """It loads after the server froze its startup objects: without a freeze of its own, every full collection
    walks its tens of thousands of objects again (36-47 ms a collection at 256 agents)."""
    done = subprocess.run([sys.executable, "-c", FROZEN_PROBE, str(tokenizer_dir)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert loaded["ready"] and loaded["frozen"] > 10 * loaded["tracked"], loaded
