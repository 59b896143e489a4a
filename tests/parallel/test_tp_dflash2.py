"""DFlash2 drafters under drafter tensor parallelism (`--draft-tp-size auto|N`), on 8 fake CPU devices.

The conv kernels and the candidate selector are replicated on every rank; the TP propose keeps the DFlash
communication pattern (2·L all-reduces + one all-gather of the per-rank top-16 (value, id) per propose) and its
drafts and walk proposal q equal the one-rank DFlash2 propose (greedy and sampled, declared weights and the
fp8 / fp8-aux / nvfp4 tiers); greedy speculative output is identical across TP settings. `auto` gives DFlash2
the world size like DFlash; only a KV-head count that does not divide is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dflash_jax.errors import UserError
from dflash_jax.models.drafter2 import Drafter2Model, identity_init, propose_block2
from dflash_jax.models.layers import RandomBuilder
from dflash_jax.parallel.drafter_tp import TOPK, place_drafter_tp, propose_block2_tp, resolve_draft_tp
from dflash_jax.parallel.mesh import make_mesh
from dflash_jax.spec_decode.runner import SpecRunner
from dflash_jax.spec_decode.sampling import SamplingArrays
from dflash_jax.types import SamplingParams
from tests.conftest import TINY_LLAMA, make_target, tiny_drafter_config
from tests.parallel.test_parallel_tp import DCFG, TCFG, WIDTH, _count, _drafter_inputs, _generate, _models


@functools.partial(jax.jit, static_argnames=("dgraph", "mesh"))
def propose2_tp(embed, head, dgraph, dstate, dcache, slots, anchor, start, sp: SamplingArrays, *, mesh):
    """The drafter-TP DFlash2 propose as the serving step runs it: (drafts, candidate ids, q)."""
    drafter = nnx.merge(dgraph, dstate)
    kw = dict(width=WIDTH, kv_len=16, temperature=sp.temperature, seed=sp.seed)
    return propose_block2_tp(drafter, embed, head, dcache, anchor, start, slots, mesh=mesh, **kw)


CFG2 = tiny_drafter_config(TINY_LLAMA, arch="dflash2", selector_rank=8, selector_top_k=8)
# the TP drafter of test_parallel_tp (3 layers, 8 heads / 8 KV heads, vocab 128) as DFlash2: hidden 64 = 4 conv
# groups of 16, selector rank 8, top-16 candidates
DCFG2 = dataclasses.replace(DCFG, arch="dflash2", selector_rank=8, selector_top_k=16)


def _drafter2(dcfg=DCFG2) -> Drafter2Model:
    return Drafter2Model(dcfg, TCFG.hidden_size, RandomBuilder(1, std=0.2))


# ---------------------------------------------------------------------------------------------- the flag
def test_resolve_draft_tp_gives_dflash2_the_world_size():
    assert resolve_draft_tp("auto", 2, CFG2) == 2
    assert resolve_draft_tp(None, 2, CFG2) == 2
    assert resolve_draft_tp("2", 2, CFG2) == 2
    assert resolve_draft_tp("1", 2, CFG2) == 1
    with pytest.raises(UserError) as e:  # 2 KV heads do not cover 4 ranks: still refused
        resolve_draft_tp("auto", 4, CFG2)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--draft-tp-size auto: the drafter's 2 KV heads")
    assert "--draft-tp-size 1" in msg and e.value.param == "--draft-tp-size"
    with pytest.raises(UserError, match=r"^--draft-tp-size 4: the drafter's 2 KV heads"):
        resolve_draft_tp("4", 4, CFG2)
    assert resolve_draft_tp("1", 4, CFG2) == 1


# ---------------------------------------------------------------------------------------------- propose
def _sampling(b: int, sampled: bool) -> SamplingArrays:
    temp = np.asarray([0.0, 0.7, 1.3, 1.0][:b] if sampled else [0.0] * b, np.float32)
    return SamplingArrays(
        jnp.asarray(temp),
        jnp.zeros((b,), jnp.int32),
        jnp.ones((b,), jnp.float32),
        jnp.asarray([11, 22, 33, 44][:b], jnp.uint32),
    )


def _one_rank2(drafter: Drafter2Model, lm_head, sp: SamplingArrays):
    target, _ = _models()
    cache, slots, anchor, start = _drafter_inputs(drafter)
    out = jax.jit(
        lambda: propose_block2(
            drafter,
            target.embed[...],
            lm_head,
            cache,
            anchor,
            start,
            slots,
            width=WIDTH,
            kv_len=16,
            temperature=sp.temperature,
            seed=sp.seed,
        )
    )()
    return tuple(np.asarray(x) for x in out)


def _tp2(drafter: Drafter2Model, lm_head, tp: int, sp: SamplingArrays):
    """(drafts, candidate ids, q) from the compiled drafter-TP DFlash2 propose, and its optimized HLO text."""
    target, _ = _models()
    cache, slots, anchor, start = _drafter_inputs(drafter)
    mesh = make_mesh(tp)
    dgraph, dstate = nnx.split(drafter)
    dstate, dcache, head, embed = place_drafter_tp(dstate, cache, lm_head, target.embed[...], mesh)
    assert dcache[0][0].sharding.spec == P(None, "tp")
    layer = dstate["layers"][0]
    qkv = jax.tree.leaves(layer["qkv_proj"])[0]  # dense [in, kv, g + 2, d] or a quantized [out, in]
    assert qkv.sharding.spec in (P(None, "tp"), P("tp"))  # each rank its KV heads with their query heads
    # the conv and the selector are replicated on every rank
    for conv in ("attention_conv", "mlp_conv"):
        for w in jax.tree.leaves(layer[conv]):
            assert w.sharding.spec == P(), conv
    for w in jax.tree.leaves(dstate["candidate_selector"]):
        assert w.sharding.spec == P()
    compiled = propose2_tp.lower(embed, head, dgraph, dstate, dcache, slots, anchor, start, sp, mesh=mesh).compile()
    drafts, ids, q = compiled(embed, head, dstate, dcache, slots, anchor, start, sp)
    return (np.asarray(drafts), np.asarray(ids), np.asarray(q)), compiled.as_text()


def _check_same(got, ref):
    drafts, ids, q = got
    rdrafts, rids, rq = ref
    np.testing.assert_array_equal(drafts, rdrafts)
    np.testing.assert_array_equal(ids, rids)
    np.testing.assert_allclose(q, rq, atol=1e-5)


def _check_comm(hlo: str, tp: int, k: int = TOPK):
    assert _count(hlo, "all-reduce") == 2 * DCFG2.num_layers
    assert _count(hlo, "all-gather") == 1
    for op in ("all-to-all", "collective-permute", "reduce-scatter"):
        assert _count(hlo, op) == 0, op
    gathered = re.search(r"= (\w+)\[([\d,]+)\]\{[^}]*\} all-gather\(", hlo)
    assert gathered and gathered.group(1) == "f32"
    assert [int(x) for x in gathered.group(2).split(",")] == [4, WIDTH - 1, tp * 2 * k]  # never the vocabulary


@pytest.mark.parametrize(("tp", "kv_heads"), [(2, 8), (4, 8), (8, 8), (2, 4)])
def test_dflash2_drafter_tp_matches_one_rank_and_communication(tp, kv_heads):
    target, _ = _models()
    drafter = _drafter2(dataclasses.replace(DCFG2, num_kv_heads=kv_heads))
    head = target.lm_head[...]
    greedy = _sampling(4, sampled=False)
    ref = _one_rank2(drafter, head, greedy)
    assert len(np.unique(ref[0])) > 3  # not degenerate: rows and positions differ
    # the selector moves drafts off the backbone argmax somewhere (the conv and walk are exercised)
    assert (ref[0] != ref[1][..., 0]).any()
    got, hlo = _tp2(drafter, head, tp, greedy)
    _check_same(got, ref)
    np.testing.assert_array_equal(got[2].max(-1), 1.0)  # greedy walk: one-hot q
    _check_comm(hlo, tp)
    sampled = _sampling(4, sampled=True)
    ref_s = _one_rank2(drafter, head, sampled)
    got_s, hlo_s = _tp2(drafter, head, tp, sampled)
    _check_same(got_s, ref_s)
    assert (ref_s[2][1:].max(-1) < 1.0).any()  # T > 0 rows: q is a spread distribution
    _check_comm(hlo_s, tp)


def test_logit_scalars_under_tp_match_one_rank():
    """A checkpoint's output_multiplier / final_logit_softcapping / input_embedding_scale act the same under TP."""
    target, _ = _models()
    drafter = _drafter2(
        dataclasses.replace(DCFG2, output_multiplier=0.3, final_logit_softcapping=2.0, input_embedding_scale=1.3)
    )
    head = target.lm_head[...]
    for sampled in (False, True):
        sp = _sampling(4, sampled=sampled)
        got, _ = _tp2(drafter, head, 2, sp)
        _check_same(got, _one_rank2(drafter, head, sp))


@pytest.mark.parametrize("tier", ["fp8", "fp8-aux", "nvfp4"])
def test_quantized_dflash2_drafter_tp_matches_one_rank(tier):
    """fp8: the GEMMs and LM head quantized; fp8-aux / nvfp4 also the (replicated) conv and selector projections."""
    from dflash_jax.checkpoints.export import apply_weight_tier

    target, _ = _models()
    drafter = _drafter2()
    head = apply_weight_tier(drafter, target.lm_head[...], tier)
    name = "Nvfp4Weight" if tier == "nvfp4" else "Fp8RowWeight"
    aux = name if tier != "fp8" else "ArrayImpl"
    assert type(drafter.layers[0].down_proj.get_value()).__name__ == name
    assert type(drafter.layers[0].attention_conv.kernel_projection.get_value()).__name__ == aux
    assert type(drafter.candidate_selector.hidden_projection.get_value()).__name__ == aux
    for sampled in (False, True):
        sp = _sampling(4, sampled)
        ref = _one_rank2(drafter, head, sp)
        got, hlo = _tp2(drafter, head, 4, sp)
        _check_same(got, ref)
        _check_comm(hlo, 4)


def test_selector_top_k_above_16_gathers_k_per_rank():
    """K = 24 > 16: each rank contributes its top 24 (the global top-24 lie in their union); still one gather."""
    target, _ = _models()
    drafter = _drafter2(dataclasses.replace(DCFG2, selector_top_k=24))
    sp = _sampling(4, sampled=True)
    ref = _one_rank2(drafter, target.lm_head[...], sp)
    got, hlo = _tp2(drafter, target.lm_head[...], 2, sp)
    _check_same(got, ref)
    _check_comm(hlo, 2, k=24)


# ---------------------------------------------------------------------------------------------- end to end
@functools.cache
def _e2e_drafter() -> Drafter2Model:
    """The DFlash drafter of test_parallel_tp (whose drafts the leaning target sometimes accepts) as DFlash2: its
    backbone weights, convs at identity plus small dynamic corrections and a previous-token tap, a random selector.
    Its drafts differ from the plain DFlash ones in most steps, and some are still accepted."""
    d = _drafter2()
    backbone = dict(nnx.to_flat_state(nnx.state(_models()[1], nnx.Param)))
    state = nnx.state(d, nnx.Param)
    for path, var in nnx.to_flat_state(state):
        if path in backbone:
            var.set_value(backbone[path][...])
    nnx.update(d, state)
    identity_init(d, seed=3)
    rng = np.random.default_rng(5)
    for layer in d.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            kp = conv.kernel_projection[...]
            conv.kernel_projection.set_value(jnp.asarray(rng.normal(0, 0.02, kp.shape), jnp.float32))
            conv.base_kernel.set_value(conv.base_kernel[...].at[:, 1].set(0.05))
    sel = d.candidate_selector
    shape = sel.successor_codebook[...].shape
    sel.successor_codebook.set_value(jnp.asarray(rng.normal(0, 0.2, shape), jnp.float32))
    sel.predecessor_codebook.set_value(jnp.asarray(rng.normal(0, 1.0, shape), jnp.float32))
    return d


@functools.cache
def _reference2(batch: int) -> dict:
    return _generate(None, "auto", batch, _e2e_drafter())[0]


@pytest.mark.parametrize(("tp", "draft_tp"), [(2, "auto"), (4, "1"), (8, "auto")])
@pytest.mark.parametrize("batch", [1, 4])
def test_dflash2_greedy_output_identical_across_tp(tp, draft_tp, batch):
    got, runner = _generate(tp, draft_tp, batch, _e2e_drafter())
    assert runner.draft_tp == (1 if draft_tp == "1" else tp)
    assert runner.dcache[0][0].sharding.spec == (P(None, "tp") if runner.draft_tp > 1 else P())
    ref = _reference2(batch)
    accepted = np.asarray(ref["accepted"])
    assert accepted.max() > 0 and (accepted < WIDTH - 1).any()  # drafts are accepted and rejected
    assert got["tokens"] == ref["tokens"]
    assert got["drafts"] == ref["drafts"]  # the selector walk proposed the same blocks at every step
    assert got["accepted"] == ref["accepted"]


def test_dflash2_draft_tp_on_the_tiny_runner():
    """The tiny DFlash2 config (4 heads / 2 KV heads, K = 8) at world 2: auto = 2 ranks (the refusal of
    `--draft-tp-size 2` is gone), same greedy output as the one-device runner."""
    target = make_target(TINY_LLAMA)
    drafter = Drafter2Model(CFG2, TINY_LLAMA.hidden_size, RandomBuilder(1, std=0.2))
    prompts = [[5, 17, 99, 3], [42, 7, 8, 9, 10]]

    def greedy(runner: SpecRunner) -> list[list[int]]:
        first = runner.add_many([(s, p, SamplingParams()) for s, p in enumerate(prompts)])
        toks = [list(first[s].tokens) for s in range(2)]
        for _ in range(4):
            out = runner.step([0, 1], {0: runner.gamma, 1: runner.gamma})
            for s in range(2):
                toks[s] += out[s].tokens
        return toks

    ref = greedy(SpecRunner(target, drafter, max_slots=2, max_model_len=48, batch_buckets=(2,)))
    tp = SpecRunner(target, drafter, max_slots=2, max_model_len=48, batch_buckets=(2,), mesh=make_mesh(2), draft_tp="2")
    assert tp.draft_tp == 2 and tp.draft_mesh is tp.mesh
    assert greedy(tp) == ref
