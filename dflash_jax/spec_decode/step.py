"""The jitted, pure steps of the speculative decoding loop (device side): one device call per step.

A runner's steps are built once per model (`programs`) and take flat weight leaves, the whole `DeviceState`
(caches and per-slot state, donated) and a few small host arrays; nothing here syncs with the host.

  prefill — the target over one chunk of each new sequence's prompt (at its offset: chunks and cached prefix pages
            before it are already in the pool), with hidden capture; the drafter's context K/V for the chunk; for
            rows whose prompt ends in the chunk, the first generated token (when asked, its log-probability;
            with `prompt_logprobs`, those of the prompt's tokens) and the slot state (anchor, position, sampling
            parameters, min-tokens bans), set on the device.
  step    — one decoding step of a batch of slots, `speculative` or plain:
              speculative: the drafts (`draft_fn`; the product's is the drafter proposing the block
                         [anchor, MASK...] at each row's position) are verified by the target as [anchor,
                         d_1..d_{W-1}] in the same call, the acceptance rule (greedy or lossless sampling, per-row
                         draft counts) picks the emitted tokens, and the drafter's context K/V are written for the
                         verified rows (rows past the new position are stale and masked);
              plain:     width 1 (or `LOGPROBS_MIN_WIDTH` for log-probabilities), no drafter work; with a drafter,
                         the target's taps of the decoded position go to a per-slot pending buffer.
            The slot state (anchor, position, context frontier) advances on the device.
  catch_up — the drafter alone: writes every row's pending taps into the drafter context in one pass and moves
            its context frontier to its anchor (before the step of a sequence that decoded plainly and speculates
            again, or whose pending buffer is full). A program of its own, shared by the plain and speculative
            steps, so neither has a catch-up variant.
  mixed   — a step and the next prompt chunks of other slots in one call: the drafter proposes for the step's rows,
            ONE target forward runs the verify rows and the chunk rows together (`TargetModel.ragged`: a ragged batch
            of two groups, each with its own width, positions, page tables and `kv_len`; the dense layers read the
            weights once for both), then the prefill's and the step's own ends (first tokens, acceptance, drafter
            context) run on their rows. The engine uses it so decoding sequences do not wait for a prefill call of
            their own (`--step-token-budget`).

Static arguments are the shapes (batch, `width`, `kv_len`) and the choices that change most of the program
(`speculative`, the count of `sampled` rows, `prompt_logprobs`). Choices that touch a small part are
runtime inputs, so one compiled program serves both: min-tokens bans (applied on the device when a row of the call
has an active ban), the emitted tokens' log-probabilities (`want_logprobs`; computed only when true, zeros
otherwise) and grammar token masks (`mask` [B, width, ceil(V/32)] packed int32, applied before sampling and acceptance
when `masked`; rows without a grammar carry all ones).

A constrained speculative step (`runner._grammar_masks`) is two calls: `propose_program` (the drafter alone, reading
the state; with each position's candidates), then the step with `given_proposal` as its draft source, so in between
the host can re-choose the drafts under the grammar and build each verify position's mask
(`spec_decode.draft_choice`).

K/V memory: the target's K/V and the drafter's context K/V are page pools (`[pages, H, P, d]` per layer) addressed
through the rows' page tables (`models.layers.Pages`, one table per sequence for both pools), which the host sends
with every call; a row reads only its own pages, up to the call's `kv_len` bucket.

Slot state per slot (`SlotState`): `start` is the anchor's absolute position (its target K/V are not written yet);
the drafter context holds positions < `ctx_end` <= `start`; the pending buffer holds the taps of positions
[`ctx_end`, `start`) at index `position % PENDING`. Padding rows of a batch point at the scratch slot, whose state
is never updated.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.compilation import program_cache
from dflash_jax.models.drafter import propose_block, write_context
from dflash_jax.models.drafter2 import ARCH as DFLASH2
from dflash_jax.models.drafter2 import propose_block2
from dflash_jax.models.layers import DROP, Pages
from dflash_jax.models.target import Rows
from dflash_jax.parallel.drafter_tp import propose_block2_tp, propose_block_tp
from dflash_jax.rng import DRAFT_SAMPLE, row_keys
from dflash_jax.spec_decode import logprobs as lps
from dflash_jax.spec_decode.sampling import (
    NEG_INF,
    SamplingArrays,
    greedy_accept,
    speculative_accept,
    speculative_accept_q,
)
from dflash_jax.types import MAX_ENDING_TOKENS

PENDING = 64  # taps of plainly decoded positions a slot keeps before they are written into the drafter context
MAX_BANNED = MAX_ENDING_TOKENS  # token ids a request can keep from being sampled before its `min_tokens`


class SlotState(NamedTuple):
    """Per slot (`max_slots` + 1 scratch), on the device."""

    anchor: jax.Array  # i32: the last emitted token, not yet through the target
    start: jax.Array  # i32: the anchor's absolute position
    ctx_end: jax.Array  # i32: the drafter context holds positions < ctx_end
    temperature: jax.Array  # f32
    top_k: jax.Array  # i32
    top_p: jax.Array  # f32
    seed: jax.Array  # u32
    min_pos: jax.Array  # i32: logits at positions p with p + 1 < min_pos never choose a banned id
    banned: jax.Array  # i32 [slots, MAX_BANNED], -1 = none

    def sampling(self, slot_ids: jax.Array) -> SamplingArrays:
        return SamplingArrays(
            self.temperature[slot_ids], self.top_k[slot_ids], self.top_p[slot_ids], self.seed[slot_ids]
        )


def init_slot_state(slots: int) -> SlotState:
    i32 = functools.partial(jnp.zeros, (slots,), jnp.int32)
    return SlotState(
        i32(),
        i32(),
        i32(),
        jnp.zeros((slots,), jnp.float32),
        i32(),
        jnp.ones((slots,), jnp.float32),
        jnp.zeros((slots,), jnp.uint32),
        i32(),
        jnp.full((slots, MAX_BANNED), -1, jnp.int32),
    )


class DeviceState(NamedTuple):
    tcache: Any  # target K/V (models.target.KVCache)
    dcache: Any  # drafter context K/V, or None without a drafter
    pending: jax.Array | None  # [slots, PENDING, taps * hidden] target taps not yet in the drafter context
    slots: SlotState


class Weights(NamedTuple):
    """What the steps read and never write, as flat leaves (split once by the runner)."""

    target: list
    drafter: list | None
    embed: jax.Array
    draft_lm_head: Any  # the drafter's LM head (the target's, or a quantized copy)


@dataclass(frozen=True)
class StepModel:
    """The static structure of a runner's models: the key its compiled steps are cached by."""

    tgraph: Any
    ttree: Any
    dgraph: Any  # None without a drafter
    dtree: Any
    capture: tuple[int, ...]
    scratch: int  # the padding rows' slot
    draft_mesh: Any = None  # the drafter's `shard_map` mesh under drafter tensor parallelism
    attention: str = "xla"  # the paged attention's backend (`kernels.backends`: xla | pallas | interpret)


class Programs(NamedTuple):
    prefill: Any
    step: Any
    catch_up: Any
    mixed: Any
    # Programs compiled ahead of their first call (`SpecRunner.warmup`), by runner signature and step plan shape.
    executables: dict


def _models(model: StepModel, w: Weights):
    target = nnx.merge(model.tgraph, jax.tree.unflatten(model.ttree, w.target))
    drafter = None if model.dgraph is None else nnx.merge(model.dgraph, jax.tree.unflatten(model.dtree, w.drafter))
    return target, drafter


def _pages(model: StepModel, page_table) -> Pages:
    """The rows' page tables with the model's attention backend."""
    return Pages(page_table, model.attention)


def ban_tokens(logits: jax.Array, banned: jax.Array, min_pos: jax.Array, positions: jax.Array) -> jax.Array:
    """logits [B,T,V] at absolute `positions` [B,T] (row t predicts position + 1): the `banned` ids [B,N] (-1 =
    none) of row b masked where position + 1 < min_pos[b] (the request's `min_tokens` not yet generated)."""
    b, t, v = logits.shape
    active = (positions + 1 < min_pos[:, None])[:, :, None] & (banned[:, None, :] >= 0)
    ids = jnp.where(active, banned[:, None, :], v)  # v: out of range, dropped
    return logits.at[jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None], ids].set(NEG_INF, mode="drop")


def _maybe_ban(logits, banned, min_pos, positions):
    """`ban_tokens` when some row has a ban active at one of its positions, else the logits as they are (the
    ban is a no-op then: the choice saves its scatter at run time and a compiled variant)."""
    active = jnp.any((banned[:, :1] >= 0) & (positions + 1 < min_pos[:, None]))
    return jax.lax.cond(active, ban_tokens, lambda x, *_: x, logits, banned, min_pos, positions)


def apply_token_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """logits [B,T,V] with the tokens a packed mask [B,T,ceil(V/32)] (int32 words, bit t % 32 of word t // 32 set =
    token t allowed: llguidance's layout) does not allow set to NEG_INF."""
    v = logits.shape[-1]
    bits = jnp.right_shift(mask[..., None], jnp.arange(32, dtype=jnp.int32)) & 1  # [B,T,W,32]
    allowed = bits.reshape(*mask.shape[:-1], -1)[..., :v] != 0
    return jnp.where(allowed, logits, jnp.asarray(NEG_INF, logits.dtype))


def _maybe_mask(logits, mask, masked):
    """`apply_token_mask` when `masked` (a runtime bool: some row of the call follows a grammar), else the logits
    as they are (rows without a grammar carry an all-ones mask, so one program serves both)."""
    if mask is None:
        return logits
    return jax.lax.cond(jnp.any(masked), apply_token_mask, lambda x, _: x, logits, mask)


def _maybe_logprobs(want: jax.Array, logits: jax.Array, tokens: jax.Array) -> lps.Logprobs:
    """`token_logprobs` when `want` (a runtime bool), else zeros of the same shapes."""

    def zeros(x, t):
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(lps.token_logprobs, x, t))

    return jax.lax.cond(jnp.any(want), lps.token_logprobs, zeros, logits, tokens)  # any: 0-d or [1] on the wire


def _choose(logits, drafts, num_drafts, sp, positions, sampled: int, draft_q=None):
    """(accepted [B], bonus [B]). Only the first `sampled` rows may sample (temperature > 0): the others take the
    greedy rule, with no random bits drawn and no vocabulary sort for them (the runner puts sampling rows first)."""
    b = logits.shape[0]
    if sampled < b:
        acc, bonus = greedy_accept(
            drafts[sampled:], jnp.argmax(logits[sampled:], axis=-1).astype(jnp.int32), num_drafts[sampled:]
        )
        if sampled == 0:
            return acc, bonus
        head = functools.partial(jax.tree.map, lambda x: x[:sampled])
        q = None if draft_q is None else head(draft_q)
        acc_s, bonus_s = _choose(
            logits[:sampled], drafts[:sampled], num_drafts[:sampled], head(sp), positions[:sampled], sampled, q
        )
        return jnp.concatenate([acc_s, acc]), jnp.concatenate([bonus_s, bonus])
    if draft_q is not None:  # DFlash2: drafts sampled from the selector's q over its top-K
        return speculative_accept_q(drafts, logits, num_drafts, sp, positions, *draft_q)
    return speculative_accept(drafts, logits, num_drafts, sp, positions)


def _set(slots: SlotState, rows: jax.Array, **fields) -> SlotState:
    """Scatter per-row values into the slot state (`rows`: slot ids, out of range = dropped)."""
    return slots._replace(**{k: getattr(slots, k).at[rows].set(v, mode="drop") for k, v in fields.items()})


# A step's draft source: (model, drafter, weights, drafter cache, anchor [B], start [B], pages, sampling, *inputs,
# width=, kv_len=) -> (drafts [B, width-1], the DFlash2 walk's (candidate ids, q) or None). `inputs` are the step's
# extra positional arguments (the product's source, `_propose`, takes none).
DraftFn = Callable[..., tuple[jax.Array, Any]]


def _propose(model: StepModel, drafter, w: Weights, dcache, anchor, start, kv: Pages, sp, *, width, kv_len):
    """The drafter's block at `start`: drafts [B, width-1] and, for DFlash2, the walk's (candidate ids, q)."""
    args = (drafter, w.embed, w.draft_lm_head, dcache, anchor, start, kv)
    mesh = model.draft_mesh
    if drafter.cfg.arch == DFLASH2:
        kw = dict(width=width, kv_len=kv_len, temperature=sp.temperature, seed=sp.seed)
        drafts, ids, q = propose_block2(*args, **kw) if mesh is None else propose_block2_tp(*args, mesh=mesh, **kw)
        return drafts, (ids, q)
    if mesh is None:
        drafts, _ = propose_block(*args, width=width, kv_len=kv_len)
    else:
        drafts, _ = propose_block_tp(*args, width=width, kv_len=kv_len, mesh=mesh)
    return drafts, None


def _catch_up(model: StepModel, w: Weights, state: DeviceState, slot_ids, page_table):
    """Write each row's pending taps (positions [ctx_end, start)) into the drafter context in one pass; the rows'
    context frontier becomes their anchor's position. Returns (None, new state)."""
    _, drafter = _models(model, w)
    sl, pending = state.slots, state.pending
    start, ctx_end = sl.start[slot_ids], sl.ctx_end[slot_ids]
    n = pending.shape[1]
    pos = ctx_end[:, None] + jnp.arange(n, dtype=ctx_end.dtype)[None, :]
    rows = pending[slot_ids[:, None], pos % n]
    pos = jnp.where(pos < start[:, None], pos, DROP)  # not pending: the write is dropped
    dcache = write_context(drafter, state.dcache, rows, pos, _pages(model, page_table))
    slots = _set(sl, jnp.where(slot_ids == model.scratch, sl.anchor.shape[0], slot_ids), ctx_end=start)
    return None, state._replace(dcache=dcache, slots=slots)


def _prefill_rows(model: StepModel, page_table, tokens, offsets, counts, *, kv_len) -> Rows:
    """A prefill chunk's target rows: tokens [B,T] at positions offsets[b] + [0, counts[b]) (the rest of the row
    is padding: position `DROP`, its writes dropped)."""
    t = tokens.shape[1]
    col = jnp.arange(t, dtype=jnp.int32)[None, :]
    positions = jnp.where(col < counts[:, None], offsets[:, None] + col, DROP)
    return Rows(tokens, positions, _pages(model, page_table), kv_len)


def _prefill_finish(
    model, target, drafter, state: DeviceState, f: Rows, h, hidden, slot_ids, offsets, counts, final, sp,
    min_pos, banned, want_logprobs, mask=None, masked=None, *, sampled, prompt_logprobs,
):  # fmt: skip
    """The rest of a prefill chunk after its target forward (`h`, `hidden` of its rows; `state` holds the new
    target cache): first tokens, the drafter context, the slot state of the rows that end their prompt."""
    b = f.tokens.shape[0]
    last = counts - 1
    raw = target.logits(jnp.take_along_axis(h, last[:, None, None], axis=1))
    end = offsets + counts
    logits = _maybe_mask(_maybe_ban(raw, banned, min_pos, (end - 1)[:, None]), mask, masked)
    no_drafts = jnp.zeros((b, 0), jnp.int32)
    _, first = _choose(logits, no_drafts, jnp.zeros((b,), jnp.int32), sp, (end - 1)[:, None], sampled)
    first_lp = _maybe_logprobs(want_logprobs, raw, first[:, None])
    prompt_lp = lps.prompt_logprobs(target.logits, h, f.tokens) if prompt_logprobs else None
    dcache = state.dcache
    if drafter is not None:
        dcache = write_context(drafter, dcache, hidden, f.positions, f.pages)
    rows = jnp.where((slot_ids == model.scratch) | ~final, state.slots.anchor.shape[0], slot_ids)
    slots = _set(
        state.slots,
        rows,
        anchor=first,
        start=end,
        ctx_end=end,
        temperature=sp.temperature,
        top_k=sp.top_k,
        top_p=sp.top_p,
        seed=sp.seed,
        min_pos=min_pos,
        banned=banned,
    )
    return (first, first_lp, prompt_lp), state._replace(dcache=dcache, slots=slots)


def _prefill(
    model: StepModel,
    w: Weights,
    state: DeviceState,
    slot_ids,
    page_table,
    tokens,
    offsets,
    counts,
    final,
    sp: SamplingArrays,
    min_pos,
    banned,
    want_logprobs,
    mask=None,
    masked=None,
    *,
    kv_len,
    sampled,
    prompt_logprobs,
):
    """One prefill chunk per row: tokens [B,T] at positions offsets[b] + [0, counts[b]) (the rest of the row is
    padding; its writes are dropped), attending to the row's pages [0, kv_len); the drafter's context K/V for the
    chunk. Rows with `final` end their prompt in this chunk: their first generated token is chosen (rows >=
    `sampled` greedily, see `_choose`; under `mask` [B,1,ceil(V/32)] when `masked`, see `apply_token_mask`) and
    their slot state (anchor, position, sampling parameters, bans) is set.
    Returns ((first token [B], first-token `Logprobs` [B,1] (zeros unless `want_logprobs`), prompt `Logprobs`
    [B,T] or None (whole prompts only)), new state)."""
    target, drafter = _models(model, w)
    f = _prefill_rows(model, page_table, tokens, offsets, counts, kv_len=kv_len)
    capture = model.capture if drafter is not None else ()
    h, hidden, tcache = target(f.tokens, f.positions, state.tcache, f.pages, capture=capture, kv_len=kv_len)
    rest = (slot_ids, offsets, counts, final, sp, min_pos, banned, want_logprobs, mask, masked)
    kw = dict(sampled=sampled, prompt_logprobs=prompt_logprobs)
    return _prefill_finish(model, target, drafter, state._replace(tcache=tcache), f, h, hidden, *rest, **kw)


class _StepRows(NamedTuple):
    """A step's rows before its target forward: the verify rows and what the rest of the step reads."""

    f: Rows
    draft_ids: jax.Array
    q: Any  # the DFlash2 walk's (candidate ids, q), or None


def _step_rows(
    model, drafter, w: Weights, state: DeviceState, slot_ids, page_table, *draft_inputs, width, kv_len, speculative,
    draft_fn,
):  # fmt: skip
    """A step's verify rows: [anchor, d_1..d_{W-1}] at the anchor's position on (the drafts from `draft_fn`, or
    none for a plain step)."""
    kv = _pages(model, page_table)
    sl = state.slots
    anchor, start = sl.anchor[slot_ids], sl.start[slot_ids]
    b, k = slot_ids.shape[0], width - 1
    q = None
    if speculative:
        draft_ids, q = draft_fn(
            model, drafter, w, state.dcache, anchor, start, kv, sl.sampling(slot_ids), *draft_inputs, width=width,
            kv_len=kv_len,
        )  # fmt: skip
        draft_ids = draft_ids.astype(jnp.int32)
    else:
        draft_ids = jnp.zeros((b, k), jnp.int32)
    tokens = jnp.concatenate([anchor[:, None], draft_ids], axis=1)
    positions = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    return _StepRows(Rows(tokens, positions, kv, kv_len), draft_ids, q)


def _step_finish(
    model, target, drafter, state: DeviceState, r: _StepRows, h, hidden, slot_ids, num_drafts, want_logprobs,
    mask=None, masked=None, *, sampled, speculative,
):  # fmt: skip
    """The rest of a step after its target forward (`state` holds the new target cache): acceptance, the emitted
    tokens' log-probabilities, the drafter context (or the pending taps) and the slot state."""
    sl = state.slots
    start, ctx_end = sl.start[slot_ids], sl.ctx_end[slot_ids]
    sp = sl.sampling(slot_ids)
    dcache, pending = state.dcache, state.pending
    draft_ids, positions, k = r.draft_ids, r.f.positions, r.draft_ids.shape[1]
    raw = target.logits(h)
    logits = _maybe_mask(_maybe_ban(raw, sl.banned[slot_ids], sl.min_pos[slot_ids], positions), mask, masked)
    counted = jnp.minimum(num_drafts, k) if speculative else jnp.zeros_like(num_drafts)
    accepted, bonus = _choose(logits, draft_ids, counted, sp, positions, sampled, r.q)
    lp = _maybe_logprobs(want_logprobs, raw, lps.emitted_tokens(draft_ids, accepted, bonus))
    new_start = start + accepted + 1
    if drafter is not None and speculative:
        dcache = write_context(drafter, dcache, hidden, positions, r.f.pages)
        ctx_end = new_start
    elif drafter is not None:  # plain: the decoded position's taps wait in the pending buffer
        pending = pending.at[slot_ids, start % pending.shape[1]].set(hidden[:, 0].astype(pending.dtype))
    rows = jnp.where(slot_ids == model.scratch, sl.anchor.shape[0], slot_ids)
    slots = _set(sl, rows, anchor=bonus, start=new_start, ctx_end=ctx_end)
    return (accepted, bonus, draft_ids, lp), DeviceState(state.tcache, dcache, pending, slots)


def _step(
    model: StepModel,
    w: Weights,
    state: DeviceState,
    slot_ids,
    page_table,
    num_drafts,
    want_logprobs,
    *draft_inputs,
    width,
    kv_len,
    sampled,
    speculative,
    draft_fn: DraftFn = _propose,
    mask=None,
    masked=None,
    plain_rows=0,
    plain_sampled=0,
):
    """One step over the rows `slot_ids` [B] with `num_drafts` [B] drafts each (see the module docstring); rows
    >= `sampled` are greedy (see `_choose`); `draft_inputs` go to `draft_fn`. With `masked`, the logits of verify
    position t of row b are masked by `mask[b, t]` ([B, width, ceil(V/32)], see `apply_token_mask`) before the
    acceptance rule: a draft the mask forbids has probability 0 and is never accepted.
    With `plain_rows` (a speculative step only), the batch's last `plain_rows` rows decode plainly at width 1 in
    the same call (`_ragged_step`); `sampled` then counts the leading rows of the first group, `plain_sampled`
    those of the plain group.
    Returns ((accepted [B], bonus [B], drafts [B, width-1], `Logprobs` [B, width] of the token each row emits
    (zeros unless `want_logprobs`)), new state). Row b emits drafts[b, :accepted[b]] followed by bonus[b]."""
    if plain_rows:
        kw = dict(width=width, kv_len=kv_len, sampled=sampled, plain_rows=plain_rows, plain_sampled=plain_sampled)
        args = (slot_ids, page_table, num_drafts, want_logprobs, draft_inputs, mask, masked)
        return _ragged_step(model, w, state, *args, draft_fn=draft_fn, **kw)
    target, drafter = _models(model, w)
    kw = dict(width=width, kv_len=kv_len, speculative=speculative, draft_fn=draft_fn)
    r = _step_rows(model, drafter, w, state, slot_ids, page_table, *draft_inputs, **kw)
    capture = model.capture if drafter is not None else ()
    h, hidden, tcache = target(r.f.tokens, r.f.positions, state.tcache, r.f.pages, capture=capture, kv_len=kv_len)
    rest = (slot_ids, num_drafts, want_logprobs, mask, masked)
    state = state._replace(tcache=tcache)
    return _step_finish(model, target, drafter, state, r, h, hidden, *rest, sampled=sampled, speculative=speculative)


def _ragged_step(
    model: StepModel, w: Weights, state: DeviceState, slot_ids, page_table, num_drafts, want_logprobs, draft_inputs,
    mask, masked, *, width, kv_len, sampled, plain_rows, plain_sampled, draft_fn,
):  # fmt: skip
    """A speculative step whose last `plain_rows` rows decode plainly: the first rows verify their drafts at
    `width`, the plain rows at width 1 with no drafter work, in ONE target forward (`TargetModel.ragged`: two groups,
    the weights read once), so a row that does not speculate does not pay the others' verify width. Each group then
    ends as its own step would (`_step_finish`); the outputs are laid out as `_step`'s for the whole batch (a plain
    row's drafts are zeros, its `Logprobs` past position 0 zeros)."""
    target, drafter = _models(model, w)
    n = slot_ids.shape[0] - plain_rows
    head = functools.partial(jax.tree.map, lambda x: x[:n])
    tail = functools.partial(jax.tree.map, lambda x: x[n:])
    kw = dict(kv_len=kv_len, draft_fn=draft_fn)
    rs = _step_rows(model, drafter, w, state, head(slot_ids), head(page_table), *head(draft_inputs), width=width,
                    speculative=True, **kw)  # fmt: skip
    rp = _step_rows(model, drafter, w, state, tail(slot_ids), tail(page_table), width=1, speculative=False, **kw)
    capture = model.capture if drafter is not None else ()
    (hs, hp), (ds, dp), tcache = target.ragged([rs.f, rp.f], state.tcache, capture=capture)
    state = state._replace(tcache=tcache)
    ms, mp = (None, None) if mask is None else (mask[:n], mask[n:, :1])
    out_s, state = _step_finish(
        model, target, drafter, state, rs, hs, ds, head(slot_ids), head(num_drafts), want_logprobs, ms, masked,
        sampled=sampled, speculative=True,
    )  # fmt: skip
    out_p, state = _step_finish(
        model, target, drafter, state, rp, hp, dp, tail(slot_ids), tail(num_drafts), want_logprobs, mp, masked,
        sampled=plain_sampled, speculative=False,
    )  # fmt: skip
    (acc_s, bonus_s, drafts_s, lp_s), (acc_p, bonus_p, _, lp_p) = out_s, out_p
    drafts = jnp.concatenate([drafts_s, jnp.zeros((plain_rows, width - 1), drafts_s.dtype)])

    def widen(a):  # a plain row's [Bp, 1, ...] to the step's [Bp, width, ...]
        return jnp.pad(a, [(0, 0), (0, width - 1)] + [(0, 0)] * (a.ndim - 2))

    lp = jax.tree.map(lambda s, p: jnp.concatenate([s, widen(p)]), lp_s, lp_p)
    return (jnp.concatenate([acc_s, acc_p]), jnp.concatenate([bonus_s, bonus_p]), drafts, lp), state


def _mixed(model: StepModel, w: Weights, state: DeviceState, step_args, prefill_args, *, step_static, prefill_static):
    """A step and the next prompt chunks of other slots in one call, as `_step(*step_args, **step_static)` and
    `_prefill(*prefill_args, **prefill_static)` would run them (the static arguments are sorted (name, value)
    pairs), with ONE target forward over both sets of rows (`TargetModel.ragged`: the verify rows and the chunk
    rows keep their own widths, positions, page tables and `kv_len`; the weights are read once). The slots are
    disjoint, so each row's result is its own call's. Returns ((step outputs, prefill outputs), new state)."""
    target, drafter = _models(model, w)
    sst, pst = dict(step_static), dict(prefill_static)
    slot_ids, page_table, num_drafts, want_logprobs, *draft_inputs = step_args
    kw = dict(width=sst["width"], kv_len=sst["kv_len"], speculative=sst["speculative"], draft_fn=_propose)
    r = _step_rows(model, drafter, w, state, slot_ids, page_table, *draft_inputs, **kw)
    p_slots, p_table, tokens, offsets, counts, final, sp, min_pos, banned, p_lp = prefill_args
    f = _prefill_rows(model, p_table, tokens, offsets, counts, kv_len=pst["kv_len"])
    capture = model.capture if drafter is not None else ()
    (hs, hp), (ds, dp), tcache = target.ragged([r.f, f], state.tcache, capture=capture)
    state = state._replace(tcache=tcache)
    rest = (p_slots, offsets, counts, final, sp, min_pos, banned, p_lp)
    pkw = dict(sampled=pst["sampled"], prompt_logprobs=pst["prompt_logprobs"])
    pre, state = _prefill_finish(model, target, drafter, state, f, hp, dp, *rest, **pkw)
    skw = dict(sampled=sst["sampled"], speculative=sst["speculative"])
    out, state = _step_finish(model, target, drafter, state, r, hs, ds, slot_ids, num_drafts, want_logprobs, **skw)
    return (out, pre), state


def given_proposal(model, drafter, w, dcache, anchor, start, kv, sp, drafts, q, *, width, kv_len):
    """A draft source: a proposal made before the step (`propose_program`): drafts [B, width-1] and the DFlash2
    walk's (candidate ids, q) or None."""
    return drafts.astype(jnp.int32), q


CANDIDATES = 16  # a DFlash proposal's candidates per draft position for the host's choice under a grammar


def _propose_only(model: StepModel, w: Weights, state: DeviceState, slot_ids, page_table, *, width, kv_len):
    """The drafter's proposal for the rows `slot_ids`, as the step's `_propose` makes it (the drafter context is
    current: a catch-up ran first), with what the host needs to re-choose the drafts under a grammar
    (`spec_decode.draft_choice`): (drafts [B, width-1], the DFlash2 walk's (candidate ids, q) or None, extra).
    `extra` is, for DFlash, the drafter's best `CANDIDATES` tokens per position [B, width-1, C], best first; for
    DFlash2, the Gumbel noise [B, width-1, K] the walk's sample at each position drew with (`jax.random.categorical`
    adds it to the scaled scores: re-choosing with it over the masked q keeps the walk's choice where the grammar
    allows it). Reads the state, writes nothing: the verify (`step_program(model, given_proposal)`) follows with the
    host's drafts and masks."""
    _, drafter = _models(model, w)
    sl = state.slots
    anchor, start, sp = sl.anchor[slot_ids], sl.start[slot_ids], sl.sampling(slot_ids)
    args = (drafter, w.embed, w.draft_lm_head, state.dcache, anchor, start, _pages(model, page_table))
    mesh = model.draft_mesh
    if drafter.cfg.arch == DFLASH2:
        kw = dict(width=width, kv_len=kv_len, temperature=sp.temperature, seed=sp.seed)
        drafts, ids, q = propose_block2(*args, **kw) if mesh is None else propose_block2_tp(*args, mesh=mesh, **kw)
        positions = start[:, None] + jnp.arange(1, width, dtype=start.dtype)[None, :]
        keys = row_keys(sp.seed, positions, purpose=DRAFT_SAMPLE)
        k = ids.shape[-1]
        noise = jax.vmap(jax.vmap(lambda key: jax.random.gumbel(key, (k,), jnp.float32)))(keys)
        return drafts.astype(jnp.int32), (ids, q), noise
    if mesh is None:
        drafts, logits = propose_block(*args, width=width, kv_len=kv_len)
        _, cands = jax.lax.top_k(logits, min(CANDIDATES, logits.shape[-1]))
    else:
        drafts, top = propose_block_tp(*args, width=width, kv_len=kv_len, mesh=mesh)
        cands = top.ids
    return drafts.astype(jnp.int32), None, cands.astype(jnp.int32)


@program_cache(maxsize=32)
def propose_program(model: StepModel):
    """The jitted proposal of `model`'s drafter alone (the first of a constrained speculative step's two calls)."""
    return jax.jit(functools.partial(_propose_only, model), static_argnames=("width", "kv_len"))


PREFILL_STATIC = ("kv_len", "sampled", "prompt_logprobs")
STEP_STATIC = ("width", "kv_len", "sampled", "speculative", "plain_rows", "plain_sampled")
MIXED_STATIC = ("step_static", "prefill_static")


@program_cache(maxsize=32)
def step_program(model: StepModel, draft_fn: DraftFn = _propose):
    """The jitted step of `model` with its drafts from `draft_fn` (built once per model structure and source;
    every runner of the same models shares its compiled variants)."""
    return jax.jit(
        functools.partial(_step, model, draft_fn=draft_fn), static_argnames=STEP_STATIC, donate_argnames=("state",)
    )


@program_cache(maxsize=32)
def programs(model: StepModel) -> Programs:
    """The jitted prefill, step (the drafter proposes) and catch-up of `model`, shared like `step_program`'s."""
    prefill = jax.jit(functools.partial(_prefill, model), static_argnames=PREFILL_STATIC, donate_argnames=("state",))
    catch_up = jax.jit(functools.partial(_catch_up, model), donate_argnames=("state",))
    mixed = jax.jit(functools.partial(_mixed, model), static_argnames=MIXED_STATIC, donate_argnames=("state",))
    return Programs(prefill, step_program(model), catch_up, mixed, {})
