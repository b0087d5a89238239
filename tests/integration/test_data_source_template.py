"""slime's data source with the chat template of the project's tiny model (built once, cached)."""

from __future__ import annotations

import pandas

from trajbus.pipelines.data_source import DataSourceArgs, RolloutDataSource


def test_parquet_chat_template_and_prompt_length_limit(tmp_path, tiny_model_dir):
    path = tmp_path / "prompts.parquet"
    pandas.DataFrame({"question": ["What is 1 + 2?", "What is 3 + 4? " * 40], "answer": ["3", "7"]}).to_parquet(path)
    source = RolloutDataSource(DataSourceArgs(prompt_data=str(path), input_key="question", label_key="answer",
                                              apply_chat_template=True, tokenizer_path=str(tiny_model_dir),
                                              rollout_max_prompt_len=64))
    assert source.dataset.dropped_too_long == 1
    [[sample]] = source.get_samples(1)
    assert sample.prompt == "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert sample.label == "3"
