"""The tokenizer and chat template, behind one small interface.

Everything delegates to a Hugging Face fast tokenizer so that token ids and
rendered prompts are exactly what transformers produces for the same model, or,
where that is the same thing, to the `tokenizers` backend it wraps
(backend_serves); this class only adds message validation, content-part
flattening and the model's full set of end-of-sequence ids.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import jinja2

if TYPE_CHECKING:  # importing transformers costs seconds; only the loader needs it at run time
    import tokenizers
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


_REWRITING_KEYS = ("add_bos_token", "add_eos_token", "add_prefix_space")
"""tokenizer_config.json settings from which transformers rewrites the backend's post-processor or pre-tokenizer."""


def backend_serves(folder: Path) -> bool:
    """Whether `tokenizers` alone encodes and decodes as transformers would for
    this folder: the generic fast class (no subclass adjusting its
    post-processor or decoding), a tokenizer.json, and no clean-up of
    decoded text (transformers applies none to BPE whatever the setting)."""
    config_path, model_path = folder / "tokenizer_config.json", folder / "tokenizer.json"
    if not config_path.exists() or not model_path.exists():
        return False
    config = json.loads(config_path.read_text())
    if config.get("tokenizer_class") not in GENERIC_TOKENIZER_CLASSES:
        return False
    if any(key in config for key in _REWRITING_KEYS):
        return False  # transformers rewrites the post-processor or pre-tokenizer from these
    if config.get("clean_up_tokenization_spaces"):
        if config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"):
            return False
        return bool(json.loads(model_path.read_text()).get("model", {}).get("type") == "BPE")
    return True


_preloaded: dict[Path, PreTrainedTokenizerFast] = {}
"""Transformers tokenizers loaded ahead of the Tokenizer that will ask for them, by resolved folder."""

_preloaded_backends: dict[Path, tokenizers.Tokenizer] = {}
"""`tokenizers` backends loaded ahead of the Tokenizer that will arrive without one, by resolved folder."""


def preload_backend(folder: Path) -> None:
    """Load the `tokenizers` backend of a folder whose Tokenizer will arrive
    pickled without it (backend_serves), for that Tokenizer to take: the front
    end calls this while its engine loads (the folder is there from an earlier
    start), so it does not parse tokenizer.json (~0.1 s) once the engine is
    ready. Nothing for a folder that is missing or not of that kind."""
    if backend_serves(folder):
        _preloaded_backends[folder.resolve()] = backend_from_file(folder / "tokenizer.json")


def preload_hf_tokenizer(folder: Path) -> None:
    """Load the transformers half of a folder whose Tokenizer will arrive
    without it (backend_serves), for that Tokenizer's first use of hf. The
    front end calls this while its engine loads (the folder is there from an
    earlier start), so the chat template is ready when the engine is instead
    of ~0.3 s after. Nothing for a folder that is missing or not of that kind."""
    if backend_serves(folder):
        _preloaded[folder.resolve()] = load_hf_tokenizer(folder)


def backend_from_file(path: Path | str) -> tokenizers.Tokenizer:
    """A tokenizer.json as a `tokenizers` backend, set as transformers sets it
    before encoding: no truncation or padding unless asked for."""
    import tokenizers

    backend = tokenizers.Tokenizer.from_file(str(path))
    backend.no_truncation()
    backend.no_padding()
    return backend


def tokenizer_from_folder(folder: Path, eos_token_ids: Sequence[int] | None = None) -> Tokenizer:
    """A folder's Tokenizer. Where `tokenizers` alone does what transformers
    would (backend_serves), the transformers tokenizer is loaded only when
    first needed (chat templates, grammars, token strings): the engine
    process, which only encodes and decodes, does not import transformers
    (0.6-0.8 s of every start)."""
    if not backend_serves(folder):
        return Tokenizer(load_hf_tokenizer(folder), eos_token_ids)
    return Tokenizer(None, eos_token_ids, folder=folder, backend=backend_from_file(folder / "tokenizer.json"))


def settle_generic_class(folder: Path) -> bool:
    """Rewrite a converted tokenizer folder (stoker's cache, never a user's) to
    name the generic fast class when that loads the very tokenizer its own class
    loads; True if the folder now names it.

    A model-specific class (a GGUF's Qwen2Tokenizer) costs every start: loading
    it goes through AutoTokenizer's registry, which imports torch (1.5 s and
    ~150 MB in the front end, which has no torch otherwise), its constructor
    rebuilds the backend from the vocabulary in Python, and the engine cannot
    take the `tokenizers`-only path. When the class adds nothing to
    TokenizersBackend but that constructor, what it builds is all in its backend
    and its settings: those are saved under the generic class, loaded back, and
    kept only if every observable part is the same (backend, vocabulary, special
    and added tokens, chat template, decoding settings, a sample's ids and text).
    """
    import shutil
    import tempfile

    from transformers import PreTrainedTokenizerFast

    reference = load_hf_tokenizer(folder)
    if type(reference) is PreTrainedTokenizerFast:
        return True
    if not _adds_only_a_constructor(type(reference), PreTrainedTokenizerFast):
        return False
    staging = Path(tempfile.mkdtemp(prefix=".generic.", dir=folder.parent))
    try:
        reference.save_pretrained(staging)
        config_path = staging / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["tokenizer_class"] = "TokenizersBackend"
        for key in _REWRITING_KEYS:  # unset (null) is transformers' default; present, it bars the backend path
            if key in config and config[key] is None:
                del config[key]
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
        generic = PreTrainedTokenizerFast.from_pretrained(staging, local_files_only=True)
        if _observable(generic) != _observable(reference):
            return False
        for item in staging.iterdir():
            os.replace(item, folder / item.name)
        return True
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _adds_only_a_constructor(cls: type, generic: type) -> bool:
    """Whether cls, a subclass of generic, defines no method, property or other
    descriptor of its own but __init__ (class attributes holding data are fine)."""
    if not issubclass(cls, generic):
        return False
    for klass in cls.__mro__[: cls.__mro__.index(generic)]:
        for name, value in vars(klass).items():
            behaviour = hasattr(value, "__get__") and not isinstance(value, type)  # functions, properties, ...
            if behaviour and name != "__init__":
                return False
    return True


_SAMPLE_TEXTS = (
    "Hello world, how are you? 123 \u00e9t\u00e9 caf\u00e9 (NFC: cafe\u0301)",
    "  leading spaces\n\ttabs and \u4f60\u597d, emoji \U0001f600 it's we'll I'M",
    "def f(x):\n    return x ** 2  # comment\r\n",
)


def _observable(hf: PreTrainedTokenizerFast) -> dict[str, Any]:
    """What encoding, decoding and chat rendering read from a transformers tokenizer."""
    backend = json.loads(hf.backend_tokenizer.to_str())
    backend.pop("truncation", None)
    backend.pop("padding", None)
    specials = hf.all_special_ids
    return {
        "backend": backend,
        "vocab": hf.get_vocab(),
        "added": {i: repr(t) for i, t in hf.added_tokens_decoder.items()},
        "special_tokens": {k: str(v) for k, v in hf.special_tokens_map.items()},
        "special_ids": list(specials),
        "ids": [hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.unk_token_id, len(hf)],
        "chat_template": hf.chat_template,
        "settings": [
            hf.clean_up_tokenization_spaces,
            hf.split_special_tokens,
            hf.model_max_length,
            hf.padding_side,
            hf.truncation_side,
            bool(getattr(hf, "add_prefix_space", False)),
            bool(getattr(hf, "add_bos_token", False)),
            bool(getattr(hf, "add_eos_token", False)),
        ],
        "samples": [
            (hf.encode(t), hf.encode(t, add_special_tokens=False), hf.decode(hf.encode(t) + specials[:2]))
            for t in _SAMPLE_TEXTS
        ],
    }


def _special_token(folder: Path, name: str) -> str | None:
    """A special token's text from tokenizer_config.json (or special_tokens_map.json), as transformers reads it."""
    for file in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / file
        value = json.loads(path.read_text()).get(name) if path.exists() else None
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            return value
    return None


# What rendering a chat template raises over a request's own input (its
# messages, its template variables, the template's raise_exception): a 400.
# A variable of the wrong type fails inside the template as a TypeError.
TEMPLATE_ERRORS = (ValueError, TypeError, jinja2.TemplateError)


class TemplateVariableError(ValueError):
    """A caller's template variable that would set what apply_chat_template sets itself."""


class Tokenizer:
    """Encode, decode and render chat prompts for one model.

    Built on a transformers tokenizer (hf), or on a `tokenizers` backend with
    the folder it came from (tokenizer_from_folder): then hf loads from the folder on
    first use, in whichever process uses it, and pickling sends neither half: the
    receiving process loads the backend from the folder, or takes a preloaded one.
    """

    def __init__(
        self,
        hf: PreTrainedTokenizerFast | None,
        eos_token_ids: Sequence[int] | None = None,
        chat_template: str | None = None,
        *,
        folder: Path | None = None,
        backend: tokenizers.Tokenizer | None = None,
    ) -> None:
        if hf is None and (folder is None or backend is None):
            raise ValueError("a Tokenizer needs a transformers tokenizer, or a tokenizers backend and its folder")
        self._hf = hf
        self._folder = folder
        self._backend = backend
        self._chat_template = chat_template
        if hf is not None and chat_template is not None:
            # Keep hf and this object consistent: callers may use either.
            hf.chat_template = chat_template
        # The backend's bos and eos, read from the folder's config once.
        self._backend_bos = self._backend_id("bos_token") if hf is None else None
        ids: list[int] = list(eos_token_ids or [])
        primary = hf.eos_token_id if hf is not None else self._backend_id("eos_token")
        if primary is not None:
            ids.append(int(primary))
        # Order-preserving dedupe: the first id is "the" eos for callers that need one.
        self.eos_token_ids: list[int] = list(dict.fromkeys(ids))

    @property
    def hf(self) -> PreTrainedTokenizerFast:
        """The transformers tokenizer (loaded from the folder on first use)."""
        if self._hf is None:
            assert self._folder is not None
            # Popped: a second Tokenizer of the folder (another version) gets its own to set a template on.
            hf = _preloaded.pop(self._folder.resolve(), None) or load_hf_tokenizer(self._folder)
            if self._chat_template is not None:
                hf.chat_template = self._chat_template
            self._hf = hf
        return self._hf

    def _backend_id(self, name: str) -> int | None:
        assert self._folder is not None and self._backend is not None
        token = _special_token(self._folder, name)
        return None if token is None else self._backend.token_to_id(token)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self._backend is not None:
            # The receiving process loads its own from the folder, or takes one it preloaded:
            # parsing the backend's 4 MB of JSON again would hold its start by ~0.1 s.
            state["_hf"] = state["_backend"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._backend is None and self._folder is not None:
            folder = self._folder.resolve()
            self._backend = _preloaded_backends.pop(folder, None) or backend_from_file(folder / "tokenizer.json")

    # --- token ids ----------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; special tokens (e.g. BOS) only where the model's tokenizer adds them."""
        if self._backend is not None:
            # encode_batch releases the GIL while it works, encode does not: a long text
            # tokenized in a worker thread must not stall the server's event loop.
            return list(self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None:
            return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))
        return str(self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        if isinstance(ids, int):
            return str(self.hf.convert_ids_to_tokens(ids))
        return [str(t) for t in self.hf.convert_ids_to_tokens(list(ids))]

    @property
    def bos_token_id(self) -> int | None:
        bos = self.hf.bos_token_id if self._backend is None else self._backend_bos
        return None if bos is None else int(bos)

    @property
    def eos_token_id(self) -> int | None:
        """The primary eos id; eos_token_ids holds every id that ends generation."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        # Added special tokens count too, which the base vocab_size may not.
        if self._backend is not None:
            return int(self._backend.get_vocab_size(with_added_tokens=True))
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
        continue_final_message: bool = False,
        variables: Mapping[str, Any] | None = None,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render messages with the model's Jinja template, as Hugging Face does.

        tokenize=True returns token ids of the rendered prompt without adding
        special tokens again (the template already contains them), which is
        what transformers does too. continue_final_message leaves the last
        message open (a prefilled answer the model continues). variables are
        a caller's extra template variables (a request's chat_template_kwargs):
        ValueError for one that would set what this call sets itself.
        """
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use a plain completion prompt instead")
        normalized = [_normalize_message(m, i) for i, m in enumerate(_check_list(messages))]
        if variables:
            reserved = {"messages", *template_kwargs, *inspect.signature(self.hf.apply_chat_template).parameters}
            taken = sorted(name for name in variables if name in reserved)
            if taken:
                raise TemplateVariableError(
                    f"chat_template_kwargs may not set {', '.join(map(repr, taken))}: "
                    "the server sets it (use the request field of that name where there is one)"
                )
            template_kwargs = {**variables, **template_kwargs}
        text = self.hf.apply_chat_template(
            normalized,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
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
