"""Greedy tokens of a GGUF through stoker's fused C decoder against its per-op
torch path (STOKER_FUSED_DECODER=0), same file, same quantized kernels: the
synthetic ladder models are noise, the arithmetic must not be.

The two paths sum in different orders (~1e-7 relative), which can move one
activation across an int8 rounding step and change the logits by up to ~1%
(tests/unit/models/test_fused_decoder.py measures it). A random model's logits
are nearly flat, so where the reference's two best tokens are closer than that,
either answer is right: a divergence counts as a near tie when the token the
fused path chose is within `tie_nats` of the reference's best at that step.
Any other divergence is a failure.

    python -m stoker.bench.greedy_check FILE [--prompts 4] [--tokens 16] [--tie-nats 0.05]

Prints one JSON object; exits 1 on a failure. Each path runs in a process of
its own (the switch is read when the model is built; two 8B models do not fit
side by side)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

PROMPT_LENGTHS = (5, 17, 40, 100, 7, 64, 23, 300)
TOP_ALTERNATIVES = 5
CHILD_TIMEOUT_S = 3600.0

Step = tuple[int, list[tuple[int, float]]]
"""A generated token and the top alternatives (token, logprob) at its step, best first."""


@dataclass
class Divergence:
    prompt: int
    position: int
    fused_token: int
    reference_token: int
    gap_nats: float | None
    """The reference's best logprob less that of the fused path's token (None: not in its top 5)."""


@dataclass
class GreedyReport:
    prompts: int
    tokens: int
    identical: int
    """Prompts whose greedy tokens are the same on both paths."""
    tie_nats: float
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(d.gap_nats is not None and d.gap_nats <= self.tie_nats for d in self.divergences)

    def summary(self) -> str:
        ties = sum(d.gap_nats is not None and d.gap_nats <= self.tie_nats for d in self.divergences)
        failed = len(self.divergences) - ties
        return (
            f"{self.identical}/{self.prompts} prompts identical over {self.tokens} tokens"
            + (f", {ties} near-tie divergence(s) (<= {self.tie_nats:g} nats)" if ties else "")
            + (f", {failed} real divergence(s)" if failed else "")
        )


def prompts_for(vocab: int, count: int) -> list[list[int]]:
    """`count` prompts of random token ids (seeded), avoiding the first 3 (special) ids."""
    import random

    rng = random.Random(7)
    return [[rng.randrange(3, vocab) for _ in range(PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)])] for i in range(count)]


def greedy_steps(path: str, prompts: list[list[int]], tokens: int, fused: bool) -> list[list[Step]]:
    """Greedy generation on one path, in this process (sets STOKER_FUSED_DECODER)."""
    os.environ["STOKER_FUSED_DECODER"] = "1" if fused else "0"
    from stoker import LLM, SamplingParams

    longest = max(len(p) for p in prompts) + tokens
    llm = LLM(
        path,
        dtype="float32",
        quantization="auto",
        max_model_len=longest,
        kv_cache_tokens=len(prompts) * (longest + 16),
        enable_prefix_caching=False,
        speculative_method="none",
    )
    if (getattr(llm.engine.runner.model, "fused", None) is not None) != fused:  # a LlamaModel's
        raise RuntimeError(f"{path}: the fused decoder does not serve this model, nothing to compare")
    params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0, logprobs=TOP_ALTERNATIVES)
    out: list[list[Step]] = []
    for result in llm.generate(prompts, params, use_tqdm=False):
        logprobs = result.outputs[0].logprobs or []
        out.append([(step.token_id, [(t, float(lp)) for t, lp in step.top]) for step in logprobs])
    return out


def compare(fused: list[list[Step]], reference: list[list[Step]], tie_nats: float) -> GreedyReport:
    """The first divergence of each prompt, judged against the reference's alternatives there."""
    report = GreedyReport(len(fused), len(fused[0]) if fused else 0, 0, tie_nats)
    for index, (got, want) in enumerate(zip(fused, reference, strict=True)):
        position = next((i for i, (a, b) in enumerate(zip(got, want)) if a[0] != b[0]), None)
        if position is None and len(got) == len(want):
            report.identical += 1
            continue
        position = position if position is not None else min(len(got), len(want))
        if position >= min(len(got), len(want)):
            report.divergences.append(Divergence(index, position, -1, -1, None))
            continue
        token, top = got[position][0], want[position][1]
        best = top[0][1] if top else None
        chosen = next((lp for t, lp in top if t == token), None)
        gap = None if best is None or chosen is None else best - chosen
        report.divergences.append(Divergence(index, position, token, want[position][0], gap))
    return report


def _child(path: str, prompts: int, tokens: int, fused: bool, vocab: int) -> list[list[Step]]:
    argv = [sys.executable, "-m", "stoker.bench.greedy_check", path, "--prompts", str(prompts)]
    argv += ["--tokens", str(tokens), "--vocab", str(vocab), "--one-path", "fused" if fused else "torch"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise RuntimeError(
            f"the {'fused' if fused else 'torch'} path failed: {lines[-1] if lines else done.returncode}"
        )
    rows = json.loads(done.stdout.strip().splitlines()[-1])  # the last line: anything logged comes before
    steps: list[list[Step]] = [[(int(t), [(int(a), float(b)) for a, b in top]) for t, top in row] for row in rows]
    return steps


def check(path: Path, vocab: int, prompts: int = 4, tokens: int = 16, tie_nats: float = 0.05) -> GreedyReport:
    """Both paths, each in a child process, compared."""
    fused = _child(str(path), prompts, tokens, True, vocab)
    reference = _child(str(path), prompts, tokens, False, vocab)
    return compare(fused, reference, tie_nats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--prompts", type=int, default=4, help="random prompts (5 to 300 tokens)")
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens per prompt")
    parser.add_argument("--tie-nats", type=float, default=0.05, help="a divergence within this of the best is a tie")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: read from the file)")
    parser.add_argument("--one-path", choices=["fused", "torch"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 1 <= args.prompts <= 64 or not 1 <= args.tokens <= 256:
        parser.error("--prompts must be 1-64 and --tokens 1-256")
    vocab = args.vocab or _vocab_of(args.gguf)
    if args.one_path:
        steps = greedy_steps(str(args.gguf), prompts_for(vocab, args.prompts), args.tokens, args.one_path == "fused")
        print(json.dumps(steps))
        return 0
    report = check(args.gguf, vocab, args.prompts, args.tokens, args.tie_nats)
    print(json.dumps({**asdict(report), "ok": report.ok, "summary": report.summary()}))
    return 0 if report.ok else 1


def _vocab_of(path: Path) -> int:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return int(embedding.data.shape[0])


if __name__ == "__main__":
    raise SystemExit(main())
