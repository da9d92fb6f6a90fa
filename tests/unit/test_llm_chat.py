"""LLM.chat renders each conversation with the model's template, vLLM's options included."""

from __future__ import annotations

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
