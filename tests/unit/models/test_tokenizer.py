"""Tokenizer: delegation to the HF tokenizer, chat messages validated and
content parts flattened, eos ids merged. Uses the default model's converted
tokenizer (cached after the first conversion) through a tiny model folder."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import make_tiny_hf_model

from stoker.models.loader import load_tokenizer
from stoker.models.tokenizer import TEMPLATE_ERRORS, TemplateVariableError, Tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(str(make_tiny_hf_model("llama", tmp_path_factory.mktemp("tok"))))


def test_encode_decode_roundtrip(tok: Tokenizer) -> None:
    text = "Hello, wörld! 🦀 日本"
    ids = tok.encode(text)
    assert ids == tok.hf.encode(text)
    assert ids[0] != tok.bos_token_id  # ChatML tokenizer: no BOS added
    assert tok.decode(ids) == text


def test_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user<|im_end|>"
    assert set(tok.all_special_ids) >= {0, 1, 2}
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert tok.convert_ids_to_tokens(2) == "<|im_end|>"
    assert tok.vocab_size == 49152
    assert tok.eos_token_ids == [2] and tok.eos_token_id == 2


def test_chat_template_matches_hf(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    expected = tok.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok.apply_chat_template(messages) == expected
    assert expected.endswith("<|im_start|>assistant\n")
    assert not str(tok.apply_chat_template(messages, add_generation_prompt=False)).endswith("assistant\n")
    ids = tok.apply_chat_template(messages, tokenize=True)
    assert ids == tok.encode(expected, add_special_tokens=False)


def test_content_parts_are_flattened(tok: Tokenizer) -> None:
    parts = [{"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}]
    flat = tok.apply_chat_template([{"role": "user", "content": "line one\nline two"}])
    assert tok.apply_chat_template([{"role": "user", "content": parts}]) == flat


def test_assistant_without_content(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "x"}, {"role": "assistant", "content": None}])
    assert isinstance(text, str)


@pytest.mark.parametrize(
    ("messages", "fragment"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], "messages[0]"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"content": "x"}], "role"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        ([{"role": "user"}], "required"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text parts"),
        ([{"role": "user", "content": [{"type": "text", "text": None}]}], "text must be a string"),
    ],
)
def test_bad_messages(tok: Tokenizer, messages: object, fragment: str) -> None:
    with pytest.raises(ValueError, match=r"(?s).*" + fragment.replace("[", r"\[").replace("]", r"\]")):
        tok.apply_chat_template(messages)  # type: ignore[arg-type]


def test_no_template(tok: Tokenizer) -> None:
    import copy

    bare = Tokenizer(copy.deepcopy(tok.hf))
    bare.hf.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


def test_continue_final_message_leaves_the_answer_open(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "The answer is"}]
    closed = str(tok.apply_chat_template(messages, add_generation_prompt=False))
    assert closed.rstrip().endswith("<|im_end|>")
    text = str(tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True))
    assert text.endswith("The answer is") and closed.startswith(text)
    with pytest.raises(ValueError):  # transformers: both at once is a contradiction
        tok.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)


def test_template_variables_reach_the_template(tok: Tokenizer) -> None:
    import copy

    custom = Tokenizer(copy.deepcopy(tok.hf))
    custom.hf.chat_template = "{% if brief %}[brief]{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    messages = [{"role": "user", "content": "x"}]
    assert custom.apply_chat_template(messages, variables={"brief": True}) == "[brief]x"
    assert custom.apply_chat_template(messages, variables={"brief": False}) == "x"
    for name in ("messages", "tokenize", "add_generation_prompt", "tools", "chat_template"):
        with pytest.raises(TemplateVariableError, match=repr(name)):
            custom.apply_chat_template(messages, variables={name: 1})
    # a variable of the wrong type fails inside the template: one of TEMPLATE_ERRORS
    custom.hf.chat_template = "{{ count + 1 }}"
    with pytest.raises(TEMPLATE_ERRORS):
        custom.apply_chat_template(messages, variables={"count": {"a": 1}})


def test_eos_ids_merge_in_order(tok: Tokenizer) -> None:
    assert Tokenizer(tok.hf, eos_token_ids=[5, 2, 5]).eos_token_ids == [5, 2]
    assert Tokenizer(tok.hf).eos_token_ids == [2]


def test_folder_without_template(tmp_path: Path) -> None:
    folder = make_tiny_hf_model("mistral", tmp_path)
    (folder / "chat_template.jinja").unlink()
    tok = load_tokenizer(str(folder))
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
