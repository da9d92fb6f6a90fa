"""Batched sampling for one engine step: penalties, min_tokens, greedy,
temperature / min-p / top-k / top-p, per-request seeds and logprobs.

Order of operations per row (as vLLM v1):
  -  grammar-constrained rows: tokens outside the grammar's bitmask to -inf
  0. logit_bias added to its token ids
  1. repetition penalty (HF/CTRL style, over prompt + output tokens)
  2. presence / frequency penalties (OpenAI style, over output tokens)
  3. min_tokens: stop ids (and eos unless ignore_eos) masked to -inf
  -> logprobs are log_softmax of these *processed* logits: they describe the
     distribution the request actually sampled from before the shape
     controls (temperature, top-k/p, min-p), so masked tokens read -inf.
  4. greedy rows: argmax.  Random rows: / temperature, min-p, top-k, top-p,
     then inverse-CDF sampling with one uniform draw per row.

Cost notes (2-core CPU, 32 x 49152): every full-vocab op is ~0.3-1 ms, a
full sort is ~4 ms per row and exponential noise for a whole batch ~30 ms,
so nothing here sorts or draws noise over the vocabulary:
- penalties touch only the (row, token) pairs concerned (scatter/gather);
- a request's logit_bias and min_tokens ids are tensors built once when it
  is added (prepare()), so no step walks a client's list in Python;
- top-p finds its nucleus among the tokens within a factor of the best one
  and only widens that net for rows whose candidates hold too little mass;
- sampling draws one uniform per row (a seeded row from its own generator,
  so its tokens never depend on the rest of the batch) and inverts the CDF
  in two levels (block sums, then one block) instead of a vocab-long cumsum.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stoker.engine.params import SamplingParams, TokenLogprob
from stoker.engine.structured import banned_tokens

# Temperatures below this are treated as greedy: dividing by them overflows.
_MIN_TEMPERATURE = 1e-5
# Top-p candidate nets, as a fraction of the best token's probability; the
# last (0) is every token, so every row ends up covered.
_TOP_P_FLOORS = (1e-4, 1e-8, 0.0)
# Penalised logits are kept within this bound: divided by the smallest
# temperature (1e-5) it is still finite in float32, so softmax never sees inf.
_LOGIT_BOUND = 1e30
# Tokens per block in the two-level inverse CDF.
_CDF_BLOCK = 256


@dataclass(frozen=True)
class PreparedParams:
    """A request's lists turned into what each step needs, once, when the
    request is added (prepare()): a step's work then grows with the batch,
    never with how long one client made its stop_token_ids or logit_bias.
    Shared by the request's n samples."""

    stop_token_ids: frozenset[int]
    """What check_stop looks a sampled token up in (a set: O(1) per token)."""
    bias_ids: torch.Tensor | None
    """logit_bias's token ids (int64), or None without a bias."""
    bias_values: torch.Tensor | None
    """Its biases (float32, as the logits), in bias_ids' order."""
    suppress_ids: torch.Tensor
    """Masked while output is shorter than min_tokens: the stop ids, and eos
    unless ignore_eos (eos then does not end the sequence, so there is
    nothing to hold back). int64, distinct."""


def prepare(
    params: SamplingParams, eos_token_ids: Iterable[int] = (), device: torch.device | None = None
) -> PreparedParams:
    """The tensors and sets for params, built once per request (on device,
    where the logits will be)."""
    bias_ids = bias_values = None
    if params.logit_bias:
        bias_ids = torch.tensor(list(params.logit_bias.keys()), dtype=torch.long, device=device)
        bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
    stop_ids = frozenset(params.stop_token_ids)
    suppress = stop_ids if params.ignore_eos else stop_ids | frozenset(eos_token_ids)
    return PreparedParams(
        stop_ids, bias_ids, bias_values, torch.tensor(sorted(suppress), dtype=torch.long, device=device)
    )


@dataclass
class SampleRow:
    """One sequence in this step's batch."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Generated so far (for penalties and min_tokens)."""
    generator: torch.Generator | None
    """Per-request, seeded from params.seed; None uses the global RNG."""
    eos_token_ids: list[int]
    """Suppressed with params.stop_token_ids while output is shorter than
    min_tokens, unless params.ignore_eos."""
    token_bitmask: torch.Tensor | None = None
    """For a grammar-constrained sequence: the tokens it may sample, as int32
    words (stoker/engine/structured.py); every other token is set to -inf."""
    prepared: PreparedParams | None = None
    """params (with eos_token_ids) as prepare() turns them; the engine passes
    the request's own, built once when it was added. None: built here, for
    callers that make a row once (tests, one-off rows)."""

    def __post_init__(self) -> None:
        if self.prepared is None:
            self.prepared = prepare(self.params, self.eos_token_ids)

    @property
    def arrays(self) -> PreparedParams:
        assert self.prepared is not None  # set by __post_init__
        return self.prepared


@dataclass
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None
    """Set when params.logprobs is not None."""


def _suppressed_ids(row: SampleRow) -> torch.Tensor | None:
    """Token ids to mask this step because min_tokens is not yet reached."""
    if len(row.output_token_ids) >= row.params.min_tokens or row.token_bitmask is not None:
        # A grammar decides when its output may end; min_tokens does not hold it open.
        return None
    ids = row.arrays.suppress_ids
    return ids if ids.numel() else None


def is_greedy(p: SamplingParams) -> bool:
    return p.temperature < _MIN_TEMPERATURE


class Sampler:
    """Stateless: call once per step with that step's logits and rows."""

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[SampledToken]:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}")
        if not rows:
            return []
        x = logits.float()
        suppress = [_suppressed_ids(r) for r in rows]
        penalised = [
            i
            for i, r in enumerate(rows)
            if r.params.repetition_penalty != 1.0
            or r.params.presence_penalty != 0.0
            or r.params.frequency_penalty != 0.0
        ]
        biased = [i for i, r in enumerate(rows) if r.arrays.bias_ids is not None]
        constrained = [i for i, r in enumerate(rows) if r.token_bitmask is not None]
        want_logprobs = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        greedy = [i for i, r in enumerate(rows) if is_greedy(r.params)]
        suppressing = any(ids is not None for ids in suppress)
        if len(greedy) == len(rows) and not (penalised or biased or want_logprobs or suppressing or constrained):
            return [SampledToken(t, None) for t in _argmax(x)]

        if penalised or biased or suppressing or constrained:
            # Never modify the caller's tensor (the runner may reuse it).
            x = x.clone() if x.data_ptr() == logits.data_ptr() else x
            if constrained:
                _apply_grammar(x, rows, constrained)
            if biased:
                _apply_logit_bias(x, rows, biased)
            if penalised:
                _apply_penalties(x, rows, penalised)
            if suppressing:
                _apply_suppression(x, suppress)

        token_ids = [0] * len(rows)
        if greedy:
            picked = _argmax(x if len(greedy) == len(rows) else x[_index(greedy, x)])
            for i, t in zip(greedy, picked):
                token_ids[i] = t
        random_rows = [i for i in range(len(rows)) if not is_greedy(rows[i].params)]
        if random_rows:
            sampled = _sample_random(x, [rows[i] for i in random_rows], random_rows)
            for i, t in zip(random_rows, sampled):
                token_ids[i] = t

        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        if want_logprobs:
            for i, lp in zip(want_logprobs, _logprobs(x, rows, want_logprobs, token_ids)):
                logprobs[i] = lp
        return [SampledToken(t, lp) for t, lp in zip(token_ids, logprobs)]


def _argmax(x: torch.Tensor) -> list[int]:
    """Row-wise argmax, first index on ties, exactly as torch.argmax. On the CPU
    numpy's vectorized argmax, one pass on the calling thread: torch's CPU argmax
    is ~20x slower than amax and wakes the intra-op threads, and block maxima
    cost ~6 torch ops (a greedy decode row over 151,936 logits: 65 us, numpy 11 us)."""
    if x.is_cpu and x.dtype == torch.float32:
        return x.numpy().argmax(axis=-1).tolist()  # type: ignore[no-any-return]
    n, vocab = x.shape
    pad = -vocab % _CDF_BLOCK
    blocks = (F.pad(x, (0, pad), value=-math.inf) if pad else x).view(n, -1, _CDF_BLOCK)
    block_max = blocks.amax(dim=-1)
    b = (block_max == block_max.amax(dim=-1, keepdim=True)).byte().argmax(dim=-1)
    inner = blocks[torch.arange(n, device=x.device), b]
    return (b * _CDF_BLOCK + inner.argmax(dim=-1)).tolist()


def _index(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)


def _unique_pairs(rows: list[int], toks: list[int], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct (row, token) pairs as two index tensors."""
    vocab = like.shape[1]
    keys = torch.unique(_index(rows, like) * vocab + _index(toks, like))
    return keys // vocab, keys % vocab


def _apply_penalties(x: torch.Tensor, rows: list[SampleRow], which: list[int]) -> None:
    """Repetition then presence/frequency penalties, in place, touching only
    the (row, token) pairs that occurred."""
    rep_rows: list[int] = []
    rep_toks: list[int] = []
    out_rows: list[int] = []
    out_toks: list[int] = []
    for i in which:
        r = rows[i]
        if r.params.repetition_penalty != 1.0:
            seen = r.prompt_token_ids + r.output_token_ids
            rep_rows.extend([i] * len(seen))
            rep_toks.extend(seen)
        if r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0:
            out_rows.extend([i] * len(r.output_token_ids))
            out_toks.extend(r.output_token_ids)
    if rep_rows:
        ri, ti = _unique_pairs(rep_rows, rep_toks, x)
        # float64: a penalty such as 5e-324 is 0 in float32 (and -inf * 0 is NaN).
        pen = torch.tensor([r.params.repetition_penalty for r in rows], device=x.device, dtype=torch.float64)[ri]
        v = x[ri, ti].double()
        # CTRL/HF: push a seen token towards "less likely" whatever its sign;
        # bounded so an extreme penalty saturates instead of reaching inf.
        x[ri, ti] = torch.where(v > 0, v / pen, v * pen).clamp_(-_LOGIT_BOUND, _LOGIT_BOUND).float()
    if out_rows:
        freq = torch.tensor([r.params.frequency_penalty for r in rows], device=x.device)
        pres = torch.tensor([r.params.presence_penalty for r in rows], device=x.device)
        ri, ti = _index(out_rows, x), _index(out_toks, x)
        x.index_put_((ri, ti), -freq[ri], accumulate=True)  # once per occurrence
        ri, ti = _unique_pairs(out_rows, out_toks, x)
        x.index_put_((ri, ti), -pres[ri], accumulate=True)  # once per distinct token


def _apply_logit_bias(x: torch.Tensor, rows: list[SampleRow], which: list[int]) -> None:
    """Each biased row's prepared (ids, values) added at once: tensors built
    when the request was added, only concatenated here."""
    ids = [rows[i].arrays.bias_ids for i in which]
    values = [rows[i].arrays.bias_values for i in which]
    ti = torch.cat([t for t in ids if t is not None]).to(x.device)
    ri = torch.repeat_interleave(_index(which, x), _index([t.numel() for t in ids if t is not None], x))
    x.index_put_((ri, ti), torch.cat([v for v in values if v is not None]).to(x.device), accumulate=True)


def _apply_grammar(x: torch.Tensor, rows: list[SampleRow], which: list[int]) -> None:
    """Tokens outside each constrained row's bitmask to -inf (only those rows)."""
    masks = torch.stack([m for i in which if (m := rows[i].token_bitmask) is not None])
    vocab = x.shape[1]
    banned = banned_tokens(masks.cpu(), min(vocab, masks.shape[1] * 32)).to(x.device)
    if banned.shape[1] < vocab:  # logits wider than the grammar's vocabulary
        banned = torch.nn.functional.pad(banned, (0, vocab - banned.shape[1]), value=True)
    if len(which) == x.shape[0]:  # every row constrained: in place, no gather and scatter
        x.masked_fill_(banned, -math.inf)
        return
    idx = _index(which, x)
    x[idx] = x[idx].masked_fill_(banned, -math.inf)


def _apply_suppression(x: torch.Tensor, suppress: list[torch.Tensor | None]) -> None:
    rows = [i for i, ids in enumerate(suppress) if ids is not None]
    ids = [t for t in suppress if t is not None]
    ri = torch.repeat_interleave(_index(rows, x), _index([t.numel() for t in ids], x))
    x[ri, torch.cat(ids).to(x.device)] = -math.inf


def _sample_random(x: torch.Tensor, rows: list[SampleRow], which: list[int]) -> list[int]:
    probs = _shaped_probs(x, rows, which, apply_top_p=False)
    dev = probs.device
    u = torch.empty(len(rows), device=dev)
    unseeded = [j for j, r in enumerate(rows) if r.generator is None]
    if unseeded:
        u[_index(unseeded, u)] = torch.rand(len(unseeded), device=dev)
    for j, sample in enumerate(rows):
        if sample.generator is not None:
            u[j] = torch.rand(1, generator=sample.generator, device=sample.generator.device).to(dev)[0]
    # Top-p rows are sampled straight from their sorted nucleus (no full-vocab
    # masking pass); the others by inverting their full CDF.
    p_rows = [j for j, r in enumerate(rows) if r.params.top_p < 1.0]
    out = [0] * len(rows)
    rest = [j for j, r in enumerate(rows) if r.params.top_p >= 1.0]
    if rest:
        whole = len(rest) == len(rows)
        for j, t in zip(rest, _invert_cdf(probs if whole else probs[_index(rest, probs)], u[_index(rest, u)])):
            out[j] = t
    if p_rows:
        whole = len(p_rows) == len(rows)
        sub = probs if whole else probs[_index(p_rows, probs)]
        top_p = torch.tensor([rows[j].params.top_p for j in p_rows], device=dev, dtype=torch.float64)
        r, c, v, before, keep = _nucleus(sub, top_p)
        kept_mass = torch.zeros(len(p_rows), dtype=torch.float64, device=dev).index_add_(0, r[keep], v[keep])
        # Kept tokens are a prefix of each row's sorted order: the first whose
        # cumulative mass passes u * kept mass is the inverse-CDF draw.
        hit = keep & (before + v > u[_index(p_rows, u)].double()[r] * kept_mass[r])
        pos = torch.arange(r.numel(), device=dev)
        first = torch.full((len(p_rows),), r.numel(), device=dev).scatter_reduce_(0, r[hit], pos[hit], "amin")
        last = torch.full((len(p_rows),), 0, device=dev).scatter_reduce_(0, r[keep], pos[keep], "amax")
        first = torch.where(first == r.numel(), last, first)  # rounding at the very end
        for j, t in zip(p_rows, c[first].tolist()):
            out[j] = t
    return out


def _shaped_probs(x: torch.Tensor, rows: list[SampleRow], which: list[int], apply_top_p: bool = True) -> torch.Tensor:
    """Rows `which` of x (rows[j] describes which[j]) as probabilities after
    temperature, min-p, top-k and (if apply_top_p) top-p; removed tokens are
    exactly 0 and rows are not renormalised after top-p."""
    dev = x.device
    temps = torch.tensor([r.params.temperature for r in rows], device=dev).unsqueeze(1)
    z = x / temps if len(which) == x.shape[0] else x[_index(which, x)].div_(temps)

    min_ps = [r.params.min_p for r in rows]
    if any(m > 0.0 for m in min_ps):
        # p < min_p * p_max  <=>  z < z_max + log(min_p); log(0) = -inf keeps all.
        log_mp = torch.tensor(min_ps, device=dev).log().unsqueeze(1)
        z.masked_fill_(z < z.amax(dim=-1, keepdim=True) + log_mp, -math.inf)

    vocab = z.shape[1]
    k_rows = [j for j, r in enumerate(rows) if 0 < r.params.top_k < vocab]
    if k_rows:
        ks = _index([rows[j].params.top_k for j in k_rows], z)
        whole = len(k_rows) == len(rows)
        sub = z if whole else z[_index(k_rows, z)]
        kth = sub.topk(int(ks.max()), dim=-1).values.gather(1, (ks - 1).unsqueeze(1))
        sub.masked_fill_(sub < kth, -math.inf)  # ties with the k-th stay, as in HF
        if not whole:
            z[_index(k_rows, z)] = sub

    probs = torch.softmax(z, dim=-1)
    p_rows = [j for j, r in enumerate(rows) if r.params.top_p < 1.0]
    if apply_top_p and p_rows:
        idx = _index(p_rows, probs)
        top_p = torch.tensor([rows[j].params.top_p for j in p_rows], device=dev, dtype=torch.float64)
        r, c, v, _, keep = _nucleus(probs[idx], top_p)
        probs[idx] = 0.0
        probs[idx[r[keep]], c[keep]] = v[keep].float()
    return probs


_Nucleus = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> _Nucleus:
    """Each row's candidates sorted by probability, flattened: (row, token,
    prob (float64), mass before it in its row, kept by top-p). A candidate net
    {p >= floor * p_max} holding top_p of the mass contains the nucleus (both
    are prefixes of the sorted order), so only the net is sorted; the net is
    widened only for rows whose net holds too little."""
    n = probs.shape[0]
    # top_p is a fraction of the row's float32 mass, which may miss 1 by ~1e-6
    # over a large vocabulary: enough to move the cut by a token in a flat tail.
    top_p = top_p * probs.sum(dim=-1, dtype=torch.float64)
    todo = torch.arange(n, device=probs.device)
    p_max = probs.amax(dim=-1, keepdim=True)
    parts: list[_Nucleus] = []
    for floor in _TOP_P_FLOORS:
        whole = todo.numel() == n  # skip row copies in the common one-pass case
        sub = probs if whole else probs[todo]
        net = sub >= (p_max if whole else p_max[todo]) * floor if floor > 0 else sub > 0
        want = top_p if whole else top_p[todo]
        covered = torch.where(net, sub, 0.0).sum(dim=-1).double() >= want
        if floor == 0.0:  # the whole row: only float rounding could fall short
            covered[:] = True
        if bool(covered.all()):  # the usual case: no boolean row copies
            r, c, v, before, keep = _sorted_net(sub, net, want)
            parts.append((todo[r], c, v, before, keep))
        elif bool(covered.any()):
            r, c, v, before, keep = _sorted_net(sub[covered], net[covered], want[covered])
            parts.append((todo[covered][r], c, v, before, keep))
        todo = todo[~covered]
        if todo.numel() == 0:
            break
    return tuple(torch.cat([p[i] for p in parts]) for i in range(5))  # type: ignore[return-value]


def _sorted_net(probs: torch.Tensor, net: torch.Tensor, top_p: torch.Tensor) -> _Nucleus:
    """Segmented sort + cumsum over each row's net at once (no per-row loop)."""
    r, c = net.nonzero(as_tuple=True)
    v = probs[r, c].double()
    order = torch.argsort(v, descending=True, stable=True)
    order = order[torch.argsort(r[order], stable=True)]  # rows ascending, values descending within
    r, c, v = r[order], c[order], v[order]
    excl = v.cumsum(0) - v
    counts = torch.bincount(r, minlength=probs.shape[0])
    starts = counts.cumsum(0) - counts
    before = excl - excl[starts][r]  # minus the mass of earlier rows
    # A token stays while the mass strictly before it is below top_p; the first always stays.
    return r, c, v, before, before < top_p[r]


def _invert_cdf(probs: torch.Tensor, u: torch.Tensor) -> list[int]:
    """Token whose cumulative mass first exceeds u * row total, found with
    block sums first and then a cumsum inside one block per row."""
    n, vocab = probs.shape
    pad = -vocab % _CDF_BLOCK
    blocks = (F.pad(probs, (0, pad)) if pad else probs).view(n, -1, _CDF_BLOCK)
    block_cdf = blocks.sum(dim=-1).double().cumsum_(dim=-1)
    target = (u.double() * block_cdf[:, -1]).unsqueeze(1)
    # right=True: the first block (then token) whose cumulative mass exceeds
    # the target, so a zero-mass block or token is never chosen.
    b = torch.searchsorted(block_cdf, target, right=True).clamp_(max=blocks.shape[1] - 1)
    prev = torch.where(b > 0, block_cdf.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(target))
    frac = ((target - prev) / (block_cdf.gather(1, b) - prev)).clamp_(0.0, 1.0)
    inner = blocks[torch.arange(n, device=probs.device), b.squeeze(1)]
    inner_cdf = inner.double().cumsum(dim=-1)
    t = torch.searchsorted(inner_cdf, frac * inner_cdf[:, -1:], right=True).clamp_(max=_CDF_BLOCK - 1)
    chosen = inner.gather(1, t).squeeze(1)
    out = (b.squeeze(1) * _CDF_BLOCK + t.squeeze(1)).tolist()
    if bool((chosen <= 0).any()):  # float rounding at a block's end: last possible token there
        for j in torch.nonzero(chosen <= 0).flatten().tolist():
            base = out[j] - out[j] % _CDF_BLOCK
            out[j] = base + int(torch.nonzero(inner[j] > 0)[-1])
    return out


def _logprobs(x: torch.Tensor, rows: list[SampleRow], which: list[int], token_ids: list[int]) -> list[TokenLogprob]:
    lp = torch.log_softmax(x if len(which) == x.shape[0] else x[_index(which, x)], dim=-1)
    chosen = lp.gather(1, _index([token_ids[i] for i in which], x).unsqueeze(1)).squeeze(1).tolist()
    k_max = max(rows[i].params.logprobs or 0 for i in which)
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if k_max > 0:
        top_v, top_i = lp.topk(k_max, dim=-1)
        top_vals, top_ids = top_v.tolist(), top_i.tolist()
    out: list[TokenLogprob] = []
    for j, i in enumerate(which):
        k = rows[i].params.logprobs or 0
        top = list(zip(top_ids[j][:k], top_vals[j][:k])) if k > 0 else []
        out.append(TokenLogprob(token_id=token_ids[i], logprob=chosen[j], top=top))
    return out
