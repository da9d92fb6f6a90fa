"""One request's whole cost, computed once: what admission, rate limits and
budgets see, and what the server's per-request caps are checked against.

A request carries `prompts` prompts (a /v1/completions list; 1 elsewhere),
each sampled `n` times (best_of is n on this server), each sample up to
`max_tokens` new tokens. Usage is billed as every prompt once plus every
generated token (a prompt's n samples share it: one prompt_tokens in the
usage object, and the prefix cache computes it once where it can), so the
estimate, the most the request can settle at, is

    tokens = prompt_tokens + prompts × n × max_tokens

(prompt_tokens: the sum over its prompts; embeddings: the sum over the
inputs, no new tokens). Settlement charges what was used, never more than
this, so a key's tpm and budget can be checked against it before the request
starts and cannot be overshot by it.

The engine's own work is larger: each sample holds its prompt in the KV
cache and prefills it unless the prefix cache has it, so

    queued_tokens = prompt_tokens × n           (prefill work waiting: the admission queue's unit)
    kv_tokens     = n × prompt_tokens + prompts × n × max_tokens   (KV cache at its peak, no sharing)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestCost:
    prompt_tokens: int
    """Sum over the request's prompts (embeddings: over its inputs)."""
    max_tokens: int = 0
    """Most new tokens per sample (0: nothing is generated)."""
    n: int = 1
    """Samples per prompt."""
    prompts: int = 1
    """Prompts in the request."""

    @property
    def samples(self) -> int:
        """Sequences the engine runs for it."""
        return self.prompts * max(1, self.n)

    @property
    def tokens(self) -> int:
        """The estimate: the most usage it can settle at (tpm, budgets)."""
        return self.prompt_tokens + self.samples * self.max_tokens

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens it puts in the engine's waiting queue (each sample prefills its prompt)."""
        return self.prompt_tokens * max(1, self.n)

    @property
    def kv_tokens(self) -> int:
        """KV cache tokens its samples hold when each has run to max_tokens."""
        return self.queued_tokens + self.samples * self.max_tokens
