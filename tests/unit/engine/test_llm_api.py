"""The in-process LLM front: chat with the template options vLLM's LLM.chat takes, and the context it serves."""

from __future__ import annotations

import logging

import pytest
from tiny_models import make_tiny_hf_model

from stoker import LLM, SamplingParams


def test_chat_template_options_reach_the_prompt(tmp_path) -> None:
    llm = LLM(str(make_tiny_hf_model("llama", tmp_path)), dtype="float32", num_kv_blocks=32)
    tok = llm.tokenizer
    answer = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "The answer is"}]
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    def prompt(**options) -> list[int]:
        (out,) = llm.chat(answer, params, **options)
        return out.prompt_token_ids

    assert prompt() == tok.apply_chat_template(answer, tokenize=True)
    continued = prompt(add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(continued, skip_special_tokens=False).endswith("The answer is")
    assert prompt(chat_template_kwargs={"unused_by_this_template": 1}) == prompt()
    with pytest.raises(ValueError, match="'messages'"):
        llm.chat(answer, params, chat_template_kwargs={"messages": []})


def test_max_model_len_beyond_the_model_is_served_at_its_own_with_a_warning(tmp_path, caplog) -> None:
    folder = make_tiny_hf_model("llama", tmp_path)
    with caplog.at_level(logging.WARNING, logger="stoker.engine"):
        llm = LLM(str(folder), dtype="float32", num_kv_blocks=32, max_model_len=10**6)
    trained = llm.engine.model_config.max_position_embeddings
    assert llm.engine.max_model_len == trained < 10**6
    assert f"max_model_len 1000000 is beyond the {trained} positions" in caplog.text
