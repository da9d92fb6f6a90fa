"""`stoker bench self-draft`: would a layer subset of the served model pay as
its own draft (self-speculation: early exit or layer skipping, no second
model)?

For each candidate (`first:N` keeps layers 0..N-1, `every:S` every S-th
layer) it writes the subset GGUF (models/gguf_subset.py: the target's own
blocks, embeddings and LM head, copied in their quantization), loads it as
stoker's draft path would, and measures:

- agreement: over token sequences, the share of positions where the draft's
  greedy argmax equals the target's, both teacher-forced on the same tokens.
  Two sources: `own`, the target's own greedy answers to a few chat prompts
  (what a draft must predict when it drafts; grounded copy prompts and plain
  questions), and `text`, docs/architecture.md (human text, as bench quality);
- expected tokens per verify step for k guesses, from the runs of agreement
  on the `own` sequences (a guess counts only if all before it agreed), and
  the i.i.d. formula (1 - a^(k+1)) / (1 - a) beside it;
- cost: a one-sequence decode step of the draft and of the target, and the
  target's step of 1 + k rows (the verify), each the best of --repeats, all
  taking turns in every round (the machine may be shared: a ratio of timings
  taken minutes apart would mean little).

Predicted speedup of k guesses over plain decoding:
tokens(k) x target_step(1 row) / (k x draft_step + target_step(1 + k rows)).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from stoker.engine.outputs import ScheduledRequest, SchedulerOutput
from stoker.engine.params import SamplingParams
from stoker.engine.runner import ModelRunner
from stoker.engine.sampler import SampleRow
from stoker.models.registry import DecoderModel

DEFAULT_DRAFTS = "first:4,first:8,first:12,first:15,every:2"
_BLOCK = 16
_CHUNK = 256
"""Prefill chunk of the teacher-forced passes (bounds the [chunk, vocab] logits)."""
_QUESTIONS = [
    "Explain how a refrigerator keeps food cold.",
    "Write a short story about a lighthouse keeper and a storm.",
    "What are the main differences between Python lists and tuples?",
]
_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


@dataclass
class DraftFigures:
    spec: str
    layers: int
    agreement_own: float
    """Share of positions of the target's own answers where the draft's argmax is the target's."""
    agreement_text: float
    target_step_ms: list[float]
    """The target's decode step of 1 .. max_k + 1 rows, timed in turns with the draft's."""
    step_ms: float
    """A one-row decode step of the draft."""
    cost_ratio: float
    """step_ms / the target's one-row step."""
    bytes_ratio: float
    """Weight bytes of the draft over the target's: what a step costs where it only
    reads weights (the memory-bound limit; fixed per-step costs make it higher)."""
    speedup_bytes: float
    """Best over k, predicted with the draft's step at bytes_ratio of the target's:
    an optimistic bound that timing noise cannot move much."""
    best_k: int
    speedup: float
    """Predicted at best_k, from the measured runs of agreement."""
    speedup_iid: float
    """Predicted at best_k, from agreement_own with independent positions."""
    tokens_per_verify: list[float]
    """Expected tokens per verify step for k = 1 .. max_k (measured runs)."""
    agreement_for_goal: float | None
    """The i.i.d. agreement this draft would need for --goal (None: unreachable at its cost)."""


class _Forward:
    """One model with a KV cache for one sequence of up to `capacity` tokens."""

    def __init__(self, model: DecoderModel, capacity: int) -> None:
        blocks = -(-capacity // _BLOCK) + 1
        self.runner = ModelRunner(model, blocks, _BLOCK, model.dtype)
        self.table = list(range(blocks))
        self.row = SampleRow(_GREEDY, [], [], None, [])

    def _step(self, tokens: list[int], start: int, drafts: int = 0) -> list[int]:
        s = ScheduledRequest(("self-draft", 0), tokens, start, self.table, self.row, num_draft_tokens=drafts)
        return self.runner.execute_model(SchedulerOutput([s])).sampled_token_ids[0]

    @torch.inference_mode()
    def argmax(self, ids: list[int]) -> list[int]:
        """Teacher-forced: the greedy next token after each prefix ids[: i + 1]."""
        out: list[int] = []
        for start in range(0, len(ids), _CHUNK):
            chunk = ids[start : start + _CHUNK]
            s = ScheduledRequest(
                ("self-draft", 0), chunk, start, self.table, None, num_prompt_logprobs=0, prompt_logprob_targets=chunk
            )
            logits = self.runner.execute(SchedulerOutput([s]))
            out.extend(logits.argmax(dim=-1).tolist())
        return out

    def generate(self, prompt: list[int], max_tokens: int, eos: frozenset[int]) -> list[int]:
        """The model's greedy answer, decoded one token a step as the engine does without speculation."""
        answer = self._step(prompt, 0)
        while len(answer) < max_tokens and answer[-1] not in eos:
            answer += self._step(answer[-1:], len(prompt) + len(answer) - 1)
        return answer

    def decode_at(self, context: list[int]) -> Callable[[int], object]:
        """Prefill context[:-1]; the callable runs a decode step of `rows` rows
        (the last context token and rows - 1 guesses) at the same position, as often as asked."""
        self._step(context[:-1], 0)
        at = len(context) - 1
        return lambda rows: self._step(context[-1:] + [0] * (rows - 1), at, rows - 1)


def interleaved_best(runs: list[Callable[[], object]], repeats: int) -> list[float]:
    """Seconds of each run, the best of `repeats`, the runs taking turns in every
    round so that all of them meet the same moments of a shared, noisy machine."""
    for run in runs:
        run()  # unmeasured: first-call costs
    best = [float("inf")] * len(runs)
    for _ in range(repeats):
        for i, run in enumerate(runs):
            started = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - started)
    return best


def load(path: str) -> DecoderModel:
    """The model at `path` as the engine's draft path builds it (weights in their GGUF blocks, float32 activations)."""
    from stoker.engine.spec.draft import load_draft_model

    return load_draft_model(path, "auto", torch.device("cpu"))


def agreement_runs(draft: list[int], target: list[int]) -> list[int]:
    """Per position, how many consecutive positions from it on the draft agrees with the target."""
    runs = [0] * (len(target) + 1)
    for i in range(len(target) - 1, -1, -1):
        runs[i] = runs[i + 1] + 1 if draft[i] == target[i] else 0
    return runs[:-1]


def tokens_per_verify(runs: list[int], k: int) -> float:
    """Expected tokens a verify step of k guesses yields: the accepted guesses plus the target's own."""
    return 1.0 + statistics.fmean(min(r, k) for r in runs)


def iid_tokens_per_verify(a: float, k: int) -> float:
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def speedup(tokens: float, k: int, draft_step: float, verify: list[float]) -> float:
    """Tokens per second with k guesses over plain decoding's (verify[r - 1]: a step of r rows)."""
    return tokens * verify[0] / (k * draft_step + verify[k])


def agreement_needed(goal: float, draft_step: float, verify: list[float], max_k: int) -> float | None:
    """The least i.i.d. agreement at which some k in 1 .. max_k reaches `goal`
    (e.g. 1.1x) with this draft's step cost; None if even agreement 1 does not."""
    best: float | None = None
    for k in range(1, min(max_k, len(verify) - 1) + 1):
        if speedup(k + 1.0, k, draft_step, verify) < goal:
            continue
        lo, hi = 0.0, 1.0
        for _ in range(40):  # speedup grows with agreement: bisect
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if speedup(iid_tokens_per_verify(mid, k), k, draft_step, verify) >= goal else (mid, hi)
        best = hi if best is None else min(best, hi)
    return best


def weight_bytes(path: Path) -> int:
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)


def own_sequences(target: _Forward, target_path: str, num_tokens: int) -> list[tuple[list[int], int]]:
    """(prompt + the target's greedy answer, prompt length) for grounded copy prompts and plain questions."""
    from stoker.bench.workload import LengthDist, grounded
    from stoker.models.loader import load_tokenizer

    tok = load_tokenizer(target_path)
    asks = [s.prompt for s in grounded(tok, 3, LengthDist.parse("300"), None, seed=0)] + _QUESTIONS
    eos = frozenset(i for i in (tok.eos_token_id,) if i is not None)
    out = []
    for ask in asks:
        prompt = tok.apply_chat_template([{"role": "user", "content": ask}], tokenize=True)
        assert isinstance(prompt, list)
        out.append((prompt + target.generate(prompt, num_tokens, eos), len(prompt)))
    return out


def text_sequences(target_path: str, text_path: Path, window: int) -> list[list[int]]:
    from stoker.bench.quality import windows
    from stoker.models.loader import load_tokenizer

    ids = load_tokenizer(target_path).encode(text_path.read_text(encoding="utf-8"))
    return windows(ids, window)


def measure(args: argparse.Namespace) -> list[DraftFigures]:
    """Every candidate's figures."""
    from gguf import GGUFReader

    from stoker.bench.quality import DEFAULT_TEXT
    from stoker.config import default_model_path
    from stoker.models.gguf_subset import block_count, parse_layers, write_layer_subset

    target_path = args.model or default_model_path()
    _, num_layers = block_count(GGUFReader(target_path))
    candidates = [(spec, parse_layers(spec, num_layers)) for spec in args.drafts.split(",")]  # bad specs fail first
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="stoker-self-draft-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    capacity = max(args.window, 2048)

    target = _Forward(load(target_path), capacity)
    own = own_sequences(target, target_path, args.answer_tokens)
    text = text_sequences(target_path, Path(args.text) if args.text else DEFAULT_TEXT, args.window)
    context = text[0][: args.context]
    target_own = [target.argmax(ids)[start - 1 : -1] for ids, start in own]
    target_text = [target.argmax(ids) for ids in text]
    target_rows = target.decode_at(context)

    figures = []
    for spec, layers in candidates:
        path = write_layer_subset(target_path, out_dir / f"self-draft-{spec.replace(':', '')}.gguf", layers)
        draft = _Forward(load(str(path)), capacity)
        runs: list[int] = []
        agree_own = []
        for (ids, start), ref in zip(own, target_own):
            guess = draft.argmax(ids)[start - 1 : -1]
            runs += agreement_runs(guess, ref)
            agree_own += [g == r for g, r in zip(guess, ref)]
        agree_text = [g == r for ids, ref in zip(text, target_text) for g, r in zip(draft.argmax(ids), ref)]
        draft_row = draft.decode_at(context)
        timed = [functools.partial(target_rows, r) for r in range(1, args.max_k + 2)]
        *verify, step = interleaved_best([*timed, functools.partial(draft_row, 1)], args.repeats)
        a = statistics.fmean(agree_own)
        bytes_ratio = weight_bytes(path) / weight_bytes(Path(target_path))
        per_k = [tokens_per_verify(runs, k) for k in range(1, args.max_k + 1)]
        rates = [speedup(per_k[k - 1], k, step, verify) for k in range(1, args.max_k + 1)]
        best = max(range(1, args.max_k + 1), key=lambda k: rates[k - 1])
        figures.append(
            DraftFigures(
                spec=spec,
                layers=len(layers),
                target_step_ms=[c * 1000 for c in verify],
                agreement_own=a,
                agreement_text=statistics.fmean(agree_text),
                step_ms=step * 1000,
                cost_ratio=step / verify[0],
                bytes_ratio=bytes_ratio,
                speedup_bytes=max(
                    speedup(per_k[k - 1], k, bytes_ratio * verify[0], verify) for k in range(1, args.max_k + 1)
                ),
                best_k=best,
                speedup=rates[best - 1],
                speedup_iid=speedup(iid_tokens_per_verify(a, best), best, step, verify),
                tokens_per_verify=per_k,
                agreement_for_goal=agreement_needed(args.goal, step, verify, args.max_k),
            )
        )
        print(render(figures[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
        del draft
    return figures


def render(figures: list[DraftFigures]) -> str:
    lines = [
        "| draft | layers | agreement (own answers) | agreement (text) | step ms | target ms | cost ratio | bytes ratio "
        "| best k | tokens/verify at best k | predicted speedup | i.i.d. formula | at bytes ratio "
        "| agreement needed for the goal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in figures:
        needed = "unreachable" if f.agreement_for_goal is None else f"{f.agreement_for_goal:.2f}"
        lines.append(
            f"| {f.spec} | {f.layers} | {f.agreement_own:.3f} | {f.agreement_text:.3f} | {f.step_ms:.2f} "
            f"| {f.target_step_ms[0]:.2f} "
            f"| {f.cost_ratio:.2f} | {f.bytes_ratio:.2f} | {f.best_k} | {f.tokens_per_verify[f.best_k - 1]:.2f} "
            f"| {f.speedup:.2f}x | {f.speedup_iid:.2f}x | {f.speedup_bytes:.2f}x | {needed} |"
        )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="target GGUF; default: stoker's default model")
    p.add_argument(
        "--drafts",
        default=DEFAULT_DRAFTS,
        help="comma-separated layer subsets: first:N, every:S, drop:S, or indices 0;1;5",
    )
    p.add_argument("--out-dir", default=None, help="where the subset GGUFs are written (default: a temp folder)")
    p.add_argument("--answer-tokens", type=int, default=128, help="tokens of each greedy answer (own sequences)")
    p.add_argument("--text", default=None, help="text file for the text agreement (default: docs/architecture.md)")
    p.add_argument("--window", type=int, default=512, help="tokens per text window")
    p.add_argument("--context", type=int, default=256, help="context length the decode steps are timed at")
    p.add_argument("--max-k", type=int, default=8, help="most guesses per verify considered")
    p.add_argument("--repeats", type=int, default=20, help="timed repetitions per step (best kept)")
    p.add_argument("--goal", type=float, default=1.1, help="speedup whose needed agreement is reported")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        figures = measure(args)
    except (ValueError, OSError) as exc:
        print(f"stoker bench self-draft: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([asdict(f) for f in figures]))
    else:
        print(render(figures))
    return 0
