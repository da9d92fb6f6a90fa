"""The tokenizer and chat template, behind one small interface.

Everything delegates to a Hugging Face fast tokenizer so that token ids and
rendered prompts are exactly what transformers produces for the same model;
this class only adds message validation, content-part flattening and the
model's full set of end-of-sequence ids.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # importing transformers costs seconds; only the loader needs it at run time
    from transformers import PreTrainedTokenizerFast

ALLOWED_ROLES: frozenset[str] = frozenset({"system", "developer", "user", "assistant", "tool"})

GENERIC_TOKENIZER_CLASSES: frozenset[str] = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
"""tokenizer_config.json class names that mean transformers' generic fast
tokenizer, with no model-specific subclass (what saving a GGUF's converted
tokenizer writes)."""


def load_hf_tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    """A folder's Hugging Face tokenizer, as AutoTokenizer loads it.

    AutoTokenizer resolves the class through transformers' model registry,
    whose import costs ~1.3 s of every start (engine and front end alike). A
    folder naming the generic fast tokenizer gets that class directly, which
    is the class AutoTokenizer would pick; any other name goes through
    AutoTokenizer, so model-specific subclasses keep their behaviour.
    """
    config_path = folder / "tokenizer_config.json"
    named = json.loads(config_path.read_text()).get("tokenizer_class") if config_path.exists() else None
    if named in GENERIC_TOKENIZER_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return cast("PreTrainedTokenizerFast", PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True))
    from transformers import AutoTokenizer

    return cast("PreTrainedTokenizerFast", AutoTokenizer.from_pretrained(folder, local_files_only=True))


class Tokenizer:
    """Encode, decode and render chat prompts for one model."""

    def __init__(
        self,
        hf: PreTrainedTokenizerFast,
        eos_token_ids: Sequence[int] | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.hf: PreTrainedTokenizerFast = hf
        if chat_template is not None:
            # Keep hf and this object consistent: callers may use either.
            self.hf.chat_template = chat_template
        ids: list[int] = list(eos_token_ids or [])
        if hf.eos_token_id is not None:
            ids.append(int(hf.eos_token_id))
        # Order-preserving dedupe: the first id is "the" eos for callers that need one.
        self.eos_token_ids: list[int] = list(dict.fromkeys(ids))

    # --- token ids ----------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; special tokens (e.g. BOS) only where the model's tokenizer adds them."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        if isinstance(ids, int):
            return str(self.hf.convert_ids_to_tokens(ids))
        return [str(t) for t in self.hf.convert_ids_to_tokens(list(ids))]

    @property
    def bos_token_id(self) -> int | None:
        bos = self.hf.bos_token_id
        return None if bos is None else int(bos)

    @property
    def eos_token_id(self) -> int | None:
        """The primary eos id; eos_token_ids holds every id that ends generation."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        # len() counts added special tokens too, which the base vocab_size may not.
        return len(self.hf)

    @property
    def all_special_ids(self) -> list[int]:
        return list(self.hf.all_special_ids)

    # --- chat -----------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        template = self.hf.chat_template
        return template if isinstance(template, str) else None

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render messages with the model's Jinja template, as Hugging Face does.

        tokenize=True returns token ids of the rendered prompt without adding
        special tokens again (the template already contains them), which is
        what transformers does too.
        """
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use a plain completion prompt instead")
        normalized = [_normalize_message(m, i) for i, m in enumerate(_check_list(messages))]
        text = self.hf.apply_chat_template(
            normalized,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **template_kwargs,
        )
        assert isinstance(text, str)
        if tokenize:
            return self.encode(text, add_special_tokens=False)
        return text

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
            f"eos={self.eos_token_ids}, chat_template={self.chat_template is not None})"
        )


def _check_list(messages: Any) -> list[Any]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    return messages


def _normalize_message(message: Any, index: int) -> dict[str, Any]:
    """Validate one message and flatten OpenAI-style content parts into a string."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ValueError(f"{where} must be an object with 'role' and 'content'")
    role = message.get("role")
    if role not in ALLOWED_ROLES:
        raise ValueError(f"{where}.role must be one of {sorted(ALLOWED_ROLES)}, got {role!r}")
    content = message.get("content")
    if content is None:
        # An assistant turn that only carries tool calls has no content.
        if role != "assistant":
            raise ValueError(f"{where}.content is required for role {role!r}")
        content = ""
    elif isinstance(content, list):
        content = _flatten_parts(content, where)
    elif not isinstance(content, str):
        raise ValueError(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}")
    # Other keys (name, tool_calls, tool_call_id) pass through for templates that use them.
    return {**message, "content": content}


def _flatten_parts(parts: list[Any], where: str) -> str:
    texts: list[str] = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"{where}.content[{j}]: only text parts are supported, got {kind!r}")
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{where}.content[{j}].text must be a string")
        texts.append(text)
    # Joined by newlines, as the OpenAI API and vLLM treat several text parts.
    return "\n".join(texts)
