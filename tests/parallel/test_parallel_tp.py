"""Tensor parallelism on 8 fake CPU devices (conftest sets XLA_FLAGS before jax is imported).

Target TP (GSPMD over the rules table) vs one device; drafter TP (`shard_map`) vs the one-rank drafter, with its
communication pattern counted in the compiled HLO; greedy speculative output across TP settings; refusals.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import typer
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from dflash_jax.cli._common import run_or_exit
from dflash_jax.cli._tp import parallel_kwargs
from dflash_jax.compilation import CompileMeter
from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.errors import UserError
from dflash_jax.models.drafter import DrafterModel, contiguous_drafter_cache, propose_block, write_context
from dflash_jax.models.layers import Pages, RandomBuilder
from dflash_jax.models.target import TargetModel, contiguous_kv_cache, target_forward
from dflash_jax.parallel.distributed import check_distributed_args
from dflash_jax.parallel.drafter_tp import TOPK, place_drafter_tp, propose_block_tp, resolve_draft_tp
from dflash_jax.parallel.mesh import make_mesh
from dflash_jax.parallel.rules import (
    ShardingError,
    kv_cache_spec,
    logical_to_spec,
    shard_kv_cache,
    shard_state,
    state_specs,
    value_spec,
)
from dflash_jax.quant import quantize_fp8_row, quantize_nvfp4
from dflash_jax.spec_decode.runner import SpecRunner
from dflash_jax.types import SamplingParams

# 8 query heads / 8 KV heads so TP 2, 4 and 8 all divide; vocab 128 (16 rows per rank at TP 8).
TCFG = TargetConfig(
    arch="llama",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_layers=3,
    num_heads=8,
    num_kv_heads=8,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    max_position_embeddings=256,
    name="tp-llama",
)
# 3 drafter layers (so 2·L = 6 all-reduces), one causal sliding-window layer; intermediate 128 and q_dim 64 split
# into whole 16-blocks for NVFP4 row-parallel weights at TP 4.
DCFG = DrafterConfig(
    hidden_size=64,
    intermediate_size=128,
    num_layers=3,
    num_heads=8,
    num_kv_heads=8,
    head_dim=8,
    vocab_size=128,
    block_size=4,
    mask_token_id=127,
    target_layer_ids=(0, 1),
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    layer_attn=((0, False), (3, True), (0, False)),
    num_target_layers=3,
)
WIDTH = 4


@functools.partial(jax.jit, static_argnames=("dgraph", "mesh"))
def propose_tp(embed, head, dgraph, dstate, dcache, slots, anchor, start, *, mesh):
    """The drafter-TP DFlash propose as the serving step runs it (drafts [B, WIDTH-1])."""
    drafter = nnx.merge(dgraph, dstate)
    return propose_block_tp(drafter, embed, head, dcache, anchor, start, slots, width=WIDTH, kv_len=16, mesh=mesh)[0]


@functools.cache
def _models(dcfg: DrafterConfig = DCFG):
    target = TargetModel(TCFG, RandomBuilder(0, std=0.2))
    drafter = DrafterModel(dcfg, TCFG.hidden_size, RandomBuilder(1, std=0.2))
    return target, drafter


def _count(hlo: str, op: str) -> int:
    return len(re.findall(rf"\b{op}(?:-start)?\(", hlo))


# ---------------------------------------------------------------------------------------------- mesh and rules
def test_mesh_is_auto_and_rules_place_megatron_layout():
    mesh = make_mesh(4, num_heads=8, num_kv_heads=8)
    assert mesh.shape == {"tp": 4} and mesh.axis_types == (AxisType.Auto,)
    target, _ = _models()
    _, state = nnx.split(target)
    placed = shard_state(state, mesh)
    layer = placed["layers"][0]
    assert layer["qkv_proj"][...].sharding.spec == P(None, "tp")  # column-parallel: each rank its KV heads' q, k, v
    assert layer["gate_up_proj"][...].sharding.spec == P(None, None, "tp")  # and its slice of gate and of up
    assert layer["o_proj"][...].sharding.spec == P("tp")  # row-parallel
    assert layer["down_proj"][...].sharding.spec == P("tp")
    assert placed["embed"][...].sharding.spec == P("tp")  # vocab-parallel
    assert placed["lm_head"][...].sharding.spec == P(None, "tp")
    assert placed["norm"][...].sharding.spec == P()
    g = TCFG.num_heads // TCFG.num_kv_heads
    assert layer["qkv_proj"][...].addressable_shards[0].data.shape == (64, TCFG.num_kv_heads // 4, g + 2, TCFG.head_dim)
    cache = shard_kv_cache(contiguous_kv_cache(TCFG, 3, 16)[0], mesh)
    assert cache[0][0].sharding.spec == P(None, "tp") == kv_cache_spec()


def test_rules_fallback_strict_and_quantized_specs():
    mesh = make_mesh(4)
    assert logical_to_spec(("embed", "mlp"), (64, 96), mesh) == P(None, "tp")
    assert logical_to_spec(("embed", "mlp"), (64, 90), mesh) == P()  # 90 does not split in 4: replicated
    with pytest.raises(ShardingError):
        logical_to_spec(("embed", "mlp"), (64, 90), mesh, strict=True)
    with pytest.raises(KeyError, match="no sharding rule"):
        logical_to_spec(("embed", "nonsense"))
    w = jnp.ones((64, 128), jnp.float32)  # dense [in, out]; quantized formats hold [out, in]
    col = value_spec(("embed", "mlp"), quantize_fp8_row(w.T), mesh)
    assert (col.q, col.scale) == (P("tp"), P("tp"))  # scales shard with their rows
    row = value_spec(("mlp", "embed"), quantize_fp8_row(w), mesh)
    assert (row.q, row.scale) == (P(None, "tp"), P())
    nv = value_spec(("mlp", "embed"), quantize_nvfp4(w), mesh)  # K=128 = 4 ranks x 2 whole 16-blocks
    assert (nv.packed, nv.block_scale, nv.global_scale) == (P(None, "tp"), P(None, "tp"), P())
    odd = quantize_nvfp4(jnp.ones((64, 96), jnp.float32))  # K=96: 24 per rank, not whole blocks
    assert value_spec(("mlp", "embed"), odd, mesh).packed == P()
    with pytest.raises(ShardingError):
        value_spec(("mlp", "embed"), odd, mesh, strict=True)


# ---------------------------------------------------------------------------------------------- target TP
@pytest.mark.parametrize(("tp", "kv_heads"), [(2, 8), (4, 8), (8, 8), (4, 4)])
def test_target_logits_match_one_device(tp, kv_heads):
    cfg = dataclasses.replace(TCFG, num_kv_heads=kv_heads)  # kv 4: query groups of 2
    target = TargetModel(cfg, RandomBuilder(0, std=0.2))
    graphdef, state = nnx.split(target)
    rng = np.random.default_rng(tp + kv_heads)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 6)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
    cache, pages = contiguous_kv_cache(cfg, 3, 16, page_size=8)
    pages = Pages(pages.table[jnp.asarray([0, 2])])  # rows 0 and 2 of three sequences' pages
    ref = target_forward(graphdef, state, tokens, positions, cache, pages, capture=(1,), kv_len=8)
    mesh = make_mesh(tp, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads)
    out = target_forward(
        graphdef,
        shard_state(state, mesh),
        tokens,
        positions,
        shard_kv_cache(contiguous_kv_cache(cfg, 3, 16, page_size=8)[0], mesh),
        pages,
        capture=(1,),
        kv_len=8,
    )
    scale = max(1.0, float(jnp.abs(ref.logits).max()))
    assert float(jnp.abs(out.logits - ref.logits).max()) <= 1e-5 * scale
    np.testing.assert_allclose(np.asarray(out.hidden), np.asarray(ref.hidden), atol=1e-5 * scale)
    k_tp, k_ref = out.cache[1][0], ref.cache[1][0]
    assert k_tp.sharding.spec == P(None, "tp")  # the donated cache keeps its KV-head split
    np.testing.assert_allclose(np.asarray(k_tp), np.asarray(k_ref), atol=1e-5)


# ---------------------------------------------------------------------------------------------- drafter TP
def _drafter_inputs(drafter: DrafterModel):
    rng = np.random.default_rng(7)
    b, t = 4, 12
    hidden = jnp.asarray(rng.normal(size=(b, t, 2 * TCFG.hidden_size)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cache, pages = contiguous_drafter_cache(drafter.cfg, b + 1, 24, page_size=8)
    pages = Pages(pages.table[jnp.asarray([2, 0, 4, 1])])  # four of five sequences' pages, out of order
    cache = write_context(drafter, cache, hidden, positions, pages)
    anchor = jnp.asarray(rng.integers(0, 120, b), jnp.int32)
    start = jnp.asarray([12, 7, 9, 1], jnp.int32)
    return cache, pages, anchor, start


def _tp_drafts(drafter: DrafterModel, lm_head, tp: int):
    """Drafts from the compiled drafter-TP propose and its optimized HLO text."""
    target, _ = _models()
    cache, slots, anchor, start = _drafter_inputs(drafter)
    mesh = make_mesh(tp)
    dgraph, dstate = nnx.split(drafter)
    dstate, dcache, head, embed = place_drafter_tp(dstate, cache, lm_head, target.embed[...], mesh)
    assert dcache[0][0].sharding.spec == P(None, "tp")
    compiled = propose_tp.lower(embed, head, dgraph, dstate, dcache, slots, anchor, start, mesh=mesh).compile()
    out = compiled(embed, head, dstate, dcache, slots, anchor, start)  # static args are baked in
    return np.asarray(out), compiled.as_text()


def _one_rank(drafter: DrafterModel, lm_head):
    target, _ = _models()
    cache, slots, anchor, start = _drafter_inputs(drafter)
    drafts, logits = jax.jit(
        lambda: propose_block(drafter, target.embed[...], lm_head, cache, anchor, start, slots, width=WIDTH, kv_len=16)
    )()
    return np.asarray(drafts), np.asarray(logits)


@pytest.mark.parametrize(("tp", "kv_heads"), [(2, 8), (4, 8), (8, 8), (2, 4)])
def test_drafter_tp_drafts_and_communication(tp, kv_heads):
    target, drafter = _models(dataclasses.replace(DCFG, num_kv_heads=kv_heads))  # kv 4: query groups of 2
    ref, logits = _one_rank(drafter, target.lm_head[...])
    # the drafts are not degenerate: rows and positions differ
    assert len(np.unique(ref)) > 3
    drafts, hlo = _tp_drafts(drafter, target.lm_head[...], tp)
    np.testing.assert_array_equal(drafts, ref)
    # exactly two all-reduces per drafter layer and one all-gather (the top-16 candidates) per propose
    assert _count(hlo, "all-reduce") == 2 * DCFG.num_layers
    assert _count(hlo, "all-gather") == 1
    for op in ("all-to-all", "collective-permute", "reduce-scatter"):
        assert _count(hlo, op) == 0, op
    gathered = re.search(r"= (\w+)\[([\d,]+)\]\{[^}]*\} all-gather\(", hlo)
    assert gathered and gathered.group(1) == "f32"
    # what is gathered is [B, W-1, tp * 2 * 16] (value + bit-cast id per candidate), never the vocabulary
    assert [int(x) for x in gathered.group(2).split(",")] == [4, WIDTH - 1, tp * 2 * TOPK]
    del logits


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_quantized_drafter_tp_matches_one_rank(fmt):
    from dflash_jax.checkpoints.export import apply_weight_tier

    target, _ = _models()
    drafter = DrafterModel(DCFG, TCFG.hidden_size, RandomBuilder(1, std=0.2))
    head = apply_weight_tier(drafter, target.lm_head[...], fmt)
    assert type(drafter.layers[0].down_proj.get_value()).__name__ == ("Fp8RowWeight" if fmt == "fp8" else "Nvfp4Weight")
    ref, _ = _one_rank(drafter, head)
    drafts, hlo = _tp_drafts(drafter, head, 4)
    np.testing.assert_array_equal(drafts, ref)
    assert _count(hlo, "all-reduce") == 2 * DCFG.num_layers and _count(hlo, "all-gather") == 1


def test_context_kv_shards_by_heads_without_communication():
    _, drafter = _models()
    mesh = make_mesh(4)
    dgraph, dstate = nnx.split(drafter)
    rng = np.random.default_rng(3)
    hidden = jnp.asarray(rng.normal(size=(2, 5, 2 * TCFG.hidden_size)), jnp.float32)
    positions = jnp.asarray([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]], jnp.int32)
    fresh, pages = contiguous_drafter_cache(DCFG, 3, 16, page_size=8)
    pages = Pages(pages.table[jnp.asarray([1, 0])])

    @jax.jit
    def step(dstate, cache):
        return write_context(nnx.merge(dgraph, dstate), cache, hidden, positions, pages)

    ref = step(dstate, fresh)
    dstate_tp, cache_tp, _, _ = place_drafter_tp(
        dstate, contiguous_drafter_cache(DCFG, 3, 16, page_size=8)[0], jnp.zeros((64, 128)), jnp.zeros((128, 64)), mesh
    )
    lowered = step.lower(dstate_tp, cache_tp).compile()
    hlo = lowered.as_text()
    for op in ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter"):
        assert _count(hlo, op) == 0, op
    out = lowered(dstate_tp, cache_tp)
    for (k, v), (rk, rv) in zip(out, ref, strict=True):
        assert k.sharding.spec == P(None, "tp") and v.sharding.spec == P(None, "tp")
        np.testing.assert_allclose(np.asarray(k), np.asarray(rk), atol=1e-5)
        np.testing.assert_allclose(np.asarray(v), np.asarray(rv), atol=1e-5)


# ---------------------------------------------------------------------------------------------- end to end
PROMPTS = ([7, 7, 2], [5, 9, 17, 3, 44], [100, 1, 2, 3, 4, 5, 6], [61])
STEPS = 5


@functools.cache
def _leaning_target() -> TargetModel:
    """The TP target nudged towards token 0 (embedding dim 0 and its LM-head entry raised), so that the random
    drafter's drafts (which lean the same way through the shared LM head) are sometimes accepted, sometimes not."""
    t = TargetModel(TCFG, RandomBuilder(0, std=0.2))
    t.embed[...] = t.embed[...].at[:, 0].add(2.0)
    t.lm_head[...] = t.lm_head[...].at[0, 0].add(3.0)
    return t


def _generate(
    tp: int | None, draft_tp: str, batch: int, drafter: DrafterModel | None = None
) -> tuple[dict, SpecRunner]:
    """Greedy tokens per slot, the drafts verified at each step and the accepted counts (with the leaning
    target and `drafter`, by default this module's DFlash drafter)."""
    target, drafter = _leaning_target(), drafter or _models()[1]
    mesh = None if tp is None else make_mesh(tp)
    r = SpecRunner(target, drafter, max_slots=4, max_model_len=40, batch_buckets=(1,), mesh=mesh, draft_tp=draft_tp)
    slots = list(range(batch))
    res = r.add_many([(s, list(PROMPTS[s]), SamplingParams()) for s in slots])
    toks = {s: list(res[s].tokens) for s in slots}
    drafts, accepted = [], []
    for _ in range(STEPS):
        out = r.step(slots, {s: r.gamma for s in slots})
        for s in slots:
            toks[s] += out[s].tokens
        drafts.append([r.last_drafts[s].tolist() for s in slots])
        accepted.append([out[s].num_accepted for s in slots])
    return {"tokens": toks, "drafts": drafts, "accepted": accepted}, r


@functools.cache
def _reference(batch: int) -> dict:
    return _generate(None, "auto", batch)[0]


@pytest.mark.parametrize(("tp", "draft_tp"), [(2, "auto"), (4, "1"), (8, "auto")])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_output_identical_across_tp(tp, draft_tp, batch):
    got, runner = _generate(tp, draft_tp, batch)
    assert runner.draft_tp == (1 if draft_tp == "1" else tp)
    assert runner.tcache[0][0].sharding.spec == P(None, "tp")
    want_dcache = P(None, "tp") if runner.draft_tp > 1 else P()
    assert runner.dcache[0][0].sharding.spec == want_dcache
    ref = _reference(batch)
    assert all(len(t) >= 1 + STEPS for t in ref["tokens"].values())
    accepted = np.asarray(ref["accepted"])
    assert accepted.max() > 0 and (accepted < WIDTH - 1).any()  # drafts are accepted and rejected
    assert got["tokens"] == ref["tokens"]
    assert got["drafts"] == ref["drafts"]  # the drafter proposed the same blocks at every step
    assert got["accepted"] == ref["accepted"]


def test_tp_steps_run_the_warmed_executables():
    """Over a mesh the warm-up's executables take the sharded weights and state as every later step leaves them:
    the steps compile nothing more and emit the one-device tokens."""
    r = SpecRunner(
        _leaning_target(), _models()[1], max_slots=4, max_model_len=40, batch_buckets=(1,), mesh=make_mesh(4)
    )
    assert r.warmup().programs > 0 and r.programs.executables
    slots = list(range(4))
    with CompileMeter() as m:
        res = r.add_many([(s, list(PROMPTS[s]), SamplingParams()) for s in slots])
        toks = {s: list(res[s].tokens) for s in slots}
        for _ in range(STEPS):
            out = r.step(slots, {s: r.gamma for s in slots})
            for s in slots:
                toks[s] += out[s].tokens
    assert m.counts.programs == 0, m.summary()
    assert toks == _reference(4)["tokens"]


# ---------------------------------------------------------------------------------------------- refusals
def test_refusals_are_one_clear_user_error():
    dcfg4 = dataclasses.replace(DCFG, num_heads=4, num_kv_heads=2)
    with pytest.raises(UserError, match=r"--draft-tp-size 3: must be 1 or the world size 4.*8 KV heads"):
        resolve_draft_tp("3", 4, DCFG)
    with pytest.raises(UserError, match=r"--draft-tp-size auto: the drafter's 2 KV heads.*world size 4 ranks"):
        resolve_draft_tp("auto", 4, dcfg4)
    with pytest.raises(UserError, match=r"--draft-tp-size 4: the drafter's 2 KV heads"):
        resolve_draft_tp(4, 4, dcfg4)
    with pytest.raises(UserError, match=r"--draft-tp-size must be 'auto' or an integer"):
        resolve_draft_tp("two", 4, DCFG)
    assert resolve_draft_tp("auto", 4, DCFG) == 4 and resolve_draft_tp("1", 4, dcfg4) == 1
    with pytest.raises(UserError, match=r"--tp-size 16 is larger than the 8 available device"):
        make_mesh(16)
    with pytest.raises(UserError, match=r"--tp-size 8: the target has 4 KV heads"):
        make_mesh(8, num_heads=8, num_kv_heads=4)
    with pytest.raises(UserError, match=r"--tp-size must be an integer >= 1"):
        make_mesh(0)
    # through the runner: a drafter whose KV heads do not divide, refused before any weight moves
    target, _ = _models()
    bad = DrafterModel(dcfg4, TCFG.hidden_size, RandomBuilder(1, std=0.2))
    with pytest.raises(UserError, match=r"--draft-tp-size auto: the drafter's 2 KV heads"):
        SpecRunner(target, bad, max_slots=1, max_model_len=16, mesh=make_mesh(4))
    assert SpecRunner(target, bad, max_slots=1, max_model_len=16, mesh=make_mesh(4), draft_tp="1").draft_tp == 1
    with pytest.raises(UserError, match=r"--draft-tp-size 3: must be 1 or the world size 4"):
        SpecRunner(target, bad, max_slots=1, max_model_len=16, mesh=make_mesh(4), draft_tp=3)


def test_cli_helper_flags(capsys):
    with pytest.raises(typer.Exit) as e:
        run_or_exit(lambda: parallel_kwargs(16, "auto", target_cfg=TCFG))
    assert e.value.exit_code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --tp-size 16 is larger than the 8 available device(s) (cpu); use --tp-size 8 or less"]
    assert parallel_kwargs(1, "auto", target_cfg=TCFG) == {}
    with pytest.raises(UserError, match=r"--draft-tp-size 2: must be 1 or the world size 1"):
        parallel_kwargs(1, "2")
    kw = parallel_kwargs(4, "auto", target_cfg=TCFG)
    assert kw["mesh"].shape == {"tp": 4} and kw["draft_tp"] == "auto"
    assert check_distributed_args(None, None, None) is False
    with pytest.raises(UserError, match=r"missing --num-processes, --process-id"):
        check_distributed_args("127.0.0.1:1234", None, None)
    with pytest.raises(UserError, match=r"--process-id must be in 0..1"):
        check_distributed_args("127.0.0.1:1234", 2, 2)
    with pytest.raises(UserError, match=r"--coordinator-address must be HOST:PORT"):
        check_distributed_args("localhost", 2, 0)


def test_state_specs_cover_every_leaf():
    _, drafter = _models()
    _, dstate = nnx.split(drafter)
    mesh = make_mesh(2)
    specs = state_specs(dstate, mesh)
    assert len(specs) == len(jax.tree.leaves(dstate))
    fused_gate_up = specs.count(P(None, None, "tp"))  # [in, 2, intermediate]: each rank its slice of gate and up
    assert fused_gate_up == drafter.cfg.num_layers
    assert specs.count(P()) + specs.count(P(None, "tp")) + specs.count(P("tp")) + fused_gate_up == len(specs)
    assert state_specs(dstate, mesh, replicate=True) == [P()] * len(specs)
