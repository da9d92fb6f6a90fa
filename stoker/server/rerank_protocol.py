"""Request bodies of /v1/rerank (Jina's and Cohere's shape, as vLLM serves it)
and /v1/score (vLLM's), with their bounds (docs/rerank.md)."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from stoker.json_types import Boolean, Integer
from stoker.server.protocol import INT32, Name, RequestBody

MAX_RERANK_DOCUMENTS = 1000
"""Documents in one /v1/rerank request, and texts on either side of one /v1/score
request (Cohere's recommended most): each is a forward pass of the pair."""


def unicode_text(value: str) -> str:
    """value, unless it holds lone surrogates (JSON's "\\ud800"), which no tokenizer encodes."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("strings must be valid Unicode text (no lone surrogates)") from None
    return value


Text = Annotated[str, AfterValidator(unicode_text)]


class TextDocument(BaseModel):
    """A document as an object (Cohere's v1 and Jina's form): its text; other fields ignored."""

    model_config = ConfigDict(extra="ignore")

    text: Text


Document = Text | TextDocument
Texts = Annotated[list[Text], Field(min_length=1, max_length=MAX_RERANK_DOCUMENTS)]


class RerankRequest(RequestBody):
    model: Name | None = None
    """A reranker's name; None: the first reranker served."""
    query: Text
    documents: Annotated[list[Document], Field(min_length=1, max_length=MAX_RERANK_DOCUMENTS)]
    top_n: Annotated[Integer, Field(ge=0, le=INT32)] | None = None
    """The best top_n results only; None or 0: all of them."""
    return_documents: Boolean = True
    """Each result carries its document as {"text": ...}."""
    truncate: Boolean = False
    """A (query, document) pair over the model's length: false answers 400, true cuts the document's end to fit."""

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(RequestBody):
    model: Name | None = None
    """A reranker's or the embedding model's name; None: the first reranker served, else the embedding model."""
    text_1: Text | Texts
    text_2: Text | Texts
    truncate: Boolean = False
    """As RerankRequest.truncate (the embedding model cuts each text to its length)."""

    @model_validator(mode="after")
    def _pairs_line_up(self) -> ScoreRequest:
        if isinstance(self.text_1, list) and len(self.text_1) > 1:
            count = len(self.text_2) if isinstance(self.text_2, list) else 1
            if count != len(self.text_1):
                raise ValueError(
                    f"text_1 has {len(self.text_1)} texts and text_2 {count}: give one text_1 for many text_2, "
                    "or lists of the same length (paired)"
                )
        return self

    def pairs(self) -> list[tuple[str, str]]:
        """(text_1, text_2) per score: one text_1 against each text_2, or pairwise."""
        firsts = self.text_1 if isinstance(self.text_1, list) else [self.text_1]
        seconds = self.text_2 if isinstance(self.text_2, list) else [self.text_2]
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        return list(zip(firsts, seconds, strict=True))
