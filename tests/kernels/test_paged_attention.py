"""Paged attention: the Pallas kernel (interpret mode), the XLA paths and the jnp reference against each other,
against `layers.gqa_attention` on a dense cache holding the same keys, and against a float64 numpy oracle.

Every case builds ragged rows in a pool of shuffled physical pages. The null page, the unused tail of each row's
last page and the pool's spare pages hold 1e30: a path that read one of them unmasked would be off by orders of
magnitude (and the lse check would see it).

Tolerances. f32: every path accumulates in f32, so they agree to 1e-5 of max|v|. bf16: the scores are the same
(bf16 products are exact in f32), but the XLA and Pallas paths round the probabilities to bf16 for the second
dot (relative error <= 2^-9 on each, so <= 2^-9 * max|v| on the sum) and round the output to bf16 (<= 2^-9 of
|out| <= max|v|); two paths compared may each carry both, so they must agree to 2^-7 * max|v|. The lse is f32
from identical scores in every path: 1e-5 relative.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.kernels.paged_attention import (
    TARGET_PROGRAMS,
    PagedAttentionConfig,
    causal_bounds,
    kv_splits_for,
    merge_attention,
    paged_attention,
    select_config,
)
from dflash_jax.kernels.paged_attention_bench import SWEEP, _check_one, run_paged_bench
from dflash_jax.models.layers import attention_masks, gqa_attention
from tests.cuda_lowering import TRITON_CALL, export_for_cuda

pytestmark = pytest.mark.usefixtures("highest_matmul_precision")  # f32 results meet f32 references

INTERPRET = jax.default_backend() != "gpu"  # the Pallas kernel compiles on a GPU, runs interpreted elsewhere
GARBAGE = 1e30


@dataclasses.dataclass
class Case:
    q: np.ndarray  # [B, T, Hq, d] f32 (values exactly representable in the case's dtype)
    k_pages: np.ndarray
    v_pages: np.ndarray
    table: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    k: np.ndarray  # dense [B, Hkv, kv_len, d] with the same logical contents
    v: np.ndarray
    kv_len: int
    dtype: object

    def args(self):
        c = lambda a: jnp.asarray(a, self.dtype)  # noqa: E731
        return (
            c(self.q),
            c(self.k_pages),
            c(self.v_pages),
            jnp.asarray(self.table),
            jnp.asarray(self.lo),
            jnp.asarray(self.hi),
        )


def make_case(*, b, t, kv_heads, g, d, page, kv_len, dtype, window=0, empty_rows=(), seed=0) -> Case:
    """Rows of random length in [t, kv_len] (the last row full), queries at the last t positions of each row
    (causal, optionally windowed); `empty_rows` lists (b, t) queries given no visible key."""
    rng = np.random.default_rng(seed)
    n_row = kv_len // page
    n_table = n_row + 1  # one spare table column: always the null page
    lens = rng.integers(t, kv_len + 1, size=b)
    lens[-1] = kv_len
    used = [-(-int(n) // page) for n in lens]
    spare = 3
    n_pages = 1 + sum(used) + spare
    perm = rng.permutation(np.arange(1, n_pages))
    rnd = lambda *s: np.asarray(jnp.asarray(rng.standard_normal(s), dtype).astype(jnp.float32))  # noqa: E731
    k_pages = np.full((n_pages, kv_heads, page, d), GARBAGE, np.float32)
    v_pages = np.full((n_pages, kv_heads, page, d), GARBAGE, np.float32)
    k = np.full((b, kv_heads, kv_len, d), GARBAGE, np.float32)
    v = np.full((b, kv_heads, kv_len, d), GARBAGE, np.float32)
    table = np.zeros((b, n_table), np.int32)
    c = 0
    for row in range(b):
        table[row, : used[row]] = perm[c : c + used[row]]
        c += used[row]
        kr, vr = rnd(kv_heads, lens[row], d), rnd(kv_heads, lens[row], d)
        k[row, :, : lens[row]], v[row, :, : lens[row]] = kr, vr
        for s in range(lens[row]):
            k_pages[table[row, s // page], :, s % page] = kr[:, s]
            v_pages[table[row, s // page], :, s % page] = vr[:, s]
    pos = lens[:, None] - t + np.arange(t)[None, :]
    hi = (pos + 1).astype(np.int32)
    lo = (np.maximum(pos - window + 1, 0) if window else np.zeros_like(pos)).astype(np.int32)
    for row, col in empty_rows:
        lo[row, col] = hi[row, col]
    q = rnd(b, t, kv_heads * g, d)
    return Case(q, k_pages, v_pages, table, lo, hi, k, v, kv_len, dtype)


def numpy_attention(case: Case) -> tuple[np.ndarray, np.ndarray]:
    """float64 oracle on the dense arrays: out [B, T, Hq * d] (0 where nothing is visible), lse [B, T, Hq]."""
    b, t, hq, d = case.q.shape
    hkv = case.k.shape[1]
    g = hq // hkv
    out = np.zeros((b, t, hq, d))
    lse = np.full((b, t, hq), -np.inf)
    for row in range(b):
        for col in range(t):
            vis = np.arange(case.kv_len)
            vis = vis[(vis >= case.lo[row, col]) & (vis < case.hi[row, col])]
            if not len(vis):
                continue
            for h in range(hq):
                kk = case.k[row, h // g, vis].astype(np.float64)
                vv = case.v[row, h // g, vis].astype(np.float64)
                s = kk @ case.q[row, col, h].astype(np.float64) / np.sqrt(d)
                m = s.max()
                e = np.exp(s - m)
                out[row, col, h] = e @ vv / e.sum()
                lse[row, col, h] = m + np.log(e.sum())
    return out.reshape(b, t, hq * d), lse


def dense_gqa(case: Case) -> np.ndarray:
    pos = np.arange(case.kv_len)[None, None, :]
    mask = (pos >= case.lo[:, :, None]) & (pos < case.hi[:, :, None])
    c = lambda a: jnp.asarray(a, case.dtype)  # noqa: E731
    return np.asarray(gqa_attention(c(case.q), c(case.k), c(case.v), jnp.asarray(mask)).astype(jnp.float32))


def tolerance(case: Case) -> float:
    vmax = float(np.abs(case.v[np.abs(case.v) < GARBAGE]).max())
    return (1e-5 if case.dtype == jnp.float32 else 2.0**-7) * vmax


def check_close(got, want, atol, what):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    assert got.shape == want.shape, what
    assert np.isfinite(got).all(), what
    err = float(np.abs(got - want).max())
    assert err <= atol, f"{what}: max abs err {err:.3g} > {atol:.3g}"


def check_lse(got, want, what):
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, what
    assert not np.isnan(got).any(), what
    fin = np.isfinite(want)
    assert (np.isneginf(got) == ~fin).all(), f"{what}: -inf exactly where no key is visible"
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5, atol=1e-5, err_msg=what)


# several key steps and query blocks per program, and the key range split in 3 (uneven shares, some empty)
SMALL_PALLAS = PagedAttentionConfig(kv_block=32, block_q=16, kv_splits=3)
# the automatic split count: more than the key blocks of these small cases, so one split per block
AUTO_SPLITS = PagedAttentionConfig(kv_block=64, block_q=64, kv_splits=0)
EMPTY = ((0, 0), (2, 3))  # (b, t) queries given no visible key
# name: (make_case kwargs, a second Pallas tiling besides the table's)
CASES = {
    "decode-g1-p16-f32": (dict(b=3, t=1, kv_heads=2, g=1, d=16, page=16, kv_len=128, dtype=jnp.float32), AUTO_SPLITS),
    "verify2-g2-p32-bf16-window": (
        dict(b=2, t=2, kv_heads=2, g=2, d=16, page=32, kv_len=128, dtype=jnp.bfloat16, window=40),
        SMALL_PALLAS,
    ),
    "verify5-g4-p16-f32-window-empty": (
        dict(b=3, t=5, kv_heads=1, g=4, d=32, page=16, kv_len=96, dtype=jnp.float32, window=7, empty_rows=EMPTY),
        SMALL_PALLAS,
    ),
    "verify16-g8-p32-f32": (
        dict(b=2, t=16, kv_heads=1, g=8, d=16, page=32, kv_len=128, dtype=jnp.float32),
        AUTO_SPLITS,
    ),
    "verify16-g8-p16-bf16-empty": (
        dict(b=2, t=16, kv_heads=2, g=8, d=16, page=16, kv_len=64, dtype=jnp.bfloat16, empty_rows=((1, 15),)),
        AUTO_SPLITS,
    ),
    "prefill64-g2-p16-f32-window": (
        dict(b=2, t=64, kv_heads=2, g=2, d=16, page=16, kv_len=160, dtype=jnp.float32, window=50),
        SMALL_PALLAS,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_paths_agree_with_reference_dense_and_numpy(name):
    kwargs, tiles = CASES[name]
    case = make_case(**kwargs)
    want, want_lse = numpy_attention(case)
    atol = tolerance(case)
    args = case.args()
    kv = case.kv_len
    p = case.k_pages.shape[2]
    blocked = PagedAttentionConfig(kv_block=2 * p, xla_dense_max=1)  # forces the key-block loop
    runs = {
        "reference": dict(backend="reference"),
        "xla": dict(backend="xla"),
        "xla-blocked": dict(backend="xla", config=blocked),
        "xla-blocked-every-block": dict(backend="xla", config=dataclasses.replace(blocked, xla_skip_blocks=False)),
        "pallas": dict(backend="pallas", interpret=INTERPRET),
        f"pallas {tiles}": dict(backend="pallas", interpret=INTERPRET, config=tiles),
    }
    # the reference in f32 is the oracle at HIGHEST precision: tight against float64
    ref, ref_lse = paged_attention(*args, kv_len=kv, backend="reference", return_lse=True)
    if case.dtype == jnp.float32:
        check_close(ref, want, atol, "reference vs numpy")
    check_lse(ref_lse, want_lse, "reference lse vs numpy")
    ref = np.asarray(ref.astype(jnp.float32), np.float64)
    for what, kw in runs.items():
        out, lse = paged_attention(*args, kv_len=kv, return_lse=True, **kw)
        assert out.dtype == case.dtype and lse.dtype == jnp.float32
        check_close(out, ref, atol, f"{what} vs reference")
        check_close(out, want, atol, f"{what} vs numpy")
        check_lse(lse, want_lse, f"{what} lse vs numpy")
        assert (np.asarray(out.astype(jnp.float32))[~np.isfinite(want_lse).repeat(case.q.shape[-1], -1)] == 0).all()
    # dense gqa_attention on the same data: rows with a visible key (it averages all keys of an empty row)
    seen = np.isfinite(want_lse).repeat(case.q.shape[-1], -1)
    dense = dense_gqa(case)
    check_close(np.where(seen, dense, 0.0), np.where(seen, ref, 0.0), atol, "dense gqa_attention vs reference")


def test_merge_attention_equals_attention_over_the_union():
    case = make_case(b=3, t=4, kv_heads=2, g=2, d=16, page=16, kv_len=64, dtype=jnp.float32, empty_rows=((1, 2),))
    q, kp, vp, table, lo, hi = case.args()
    full, full_lse = paged_attention(q, kp, vp, table, lo, hi, kv_len=64, return_lse=True)
    mid = jnp.asarray(case.hi) - 3  # keys [lo, mid) and [mid, hi); a few rows get an empty first part
    mid = mid.at[0, 0].set(case.lo[0, 0])
    mid = mid.at[2, 1].set(case.hi[2, 1])  # ... or an empty second part
    a, a_lse = paged_attention(q, kp, vp, table, lo, jnp.maximum(mid, lo), kv_len=64, return_lse=True)
    b_, b_lse = paged_attention(q, kp, vp, table, jnp.maximum(mid, lo), hi, kv_len=64, return_lse=True)
    assert np.isneginf(np.asarray(a_lse)[0, 0]).all() and np.isneginf(np.asarray(b_lse)[2, 1]).all()
    out, lse = merge_attention(a, a_lse, b_, b_lse, heads=4)
    check_close(out, np.asarray(full, np.float64), 1e-5 * 4, "merged vs full")
    want_out, want_lse = numpy_attention(case)
    check_lse(lse, want_lse, "merged lse vs numpy")
    check_close(out, want_out, 1e-5 * 4, "merged vs numpy")
    # both sides empty: 0 and -inf, no NaN
    z, z_lse = merge_attention(a[:1], jnp.full_like(a_lse[:1], -jnp.inf), b_[:1], jnp.full_like(b_lse[:1], -jnp.inf), 4)
    assert (np.asarray(z) == 0).all() and np.isneginf(np.asarray(z_lse)).all()
    with pytest.raises(ValueError, match="lse_a"):
        merge_attention(a, a_lse[..., :3], b_, b_lse, heads=4)


def test_no_visible_key_anywhere():
    """A batch whose queries see no key at all (the drafter's context before the first block: hi = 0): every
    path returns 0 and lse -inf, and the Pallas and blocked loops run no step."""
    case = make_case(b=2, t=3, kv_heads=1, g=2, d=16, page=16, kv_len=32, dtype=jnp.float32)
    q, kp, vp, table, _, _ = case.args()
    zero = jnp.zeros((2, 3), jnp.int32)
    blocked = PagedAttentionConfig(kv_block=16, xla_dense_max=1)
    for kw in (
        dict(backend="reference"),
        dict(backend="xla"),
        dict(backend="xla", config=blocked),
        dict(backend="pallas", interpret=INTERPRET, config=SMALL_PALLAS),
    ):
        out, lse = paged_attention(q, kp, vp, table, zero, zero, kv_len=32, return_lse=True, **kw)
        assert (np.asarray(out) == 0).all() and np.isneginf(np.asarray(lse)).all(), kw


def test_blocked_xla_memory_does_not_grow_with_t_times_kv_len():
    """A prefill chunk of 512 queries over 8K keys: no value in the traced program (loop bodies included) has
    T * kv_len elements per head; the key loop's values are T * kv_block."""
    b, t, hkv, g, d, p, kv = 1, 512, 2, 4, 64, 16, 8192
    sd = jax.ShapeDtypeStruct
    args = (
        sd((b, t, hkv * g, d), jnp.bfloat16),
        sd((kv // p + 1, hkv, p, d), jnp.bfloat16),
        sd((kv // p + 1, hkv, p, d), jnp.bfloat16),
        sd((b, kv // p), jnp.int32),
        sd((b, t), jnp.int32),
        sd((b, t), jnp.int32),
    )
    cfg = select_config("xla", t * g, p, jnp.bfloat16)
    assert t * kv > cfg.xla_dense_max

    def sizes(jaxpr):
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                yield int(np.prod(var.aval.shape))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from sizes(sub)

    jaxpr = jax.make_jaxpr(lambda *a: paged_attention(*a, kv_len=kv, backend="xla"))(*args).jaxpr
    biggest = max(sizes(jaxpr))
    assert biggest <= b * hkv * g * t * cfg.kv_block, biggest
    assert biggest < b * hkv * g * t * kv // 4


def test_argument_errors_name_the_problem():
    case = make_case(b=2, t=2, kv_heads=2, g=2, d=16, page=16, kv_len=32, dtype=jnp.float32)
    q, kp, vp, table, lo, hi = case.args()
    with pytest.raises(ValueError, match="multiple of page_size 16"):
        paged_attention(q, kp, vp, table, lo, hi, kv_len=40)
    with pytest.raises(ValueError, match="at most"):
        paged_attention(q, kp, vp, table, lo, hi, kv_len=64)
    with pytest.raises(ValueError, match="backend must be one of"):
        paged_attention(q, kp, vp, table, lo, hi, kv_len=32, backend="cuda")
    with pytest.raises(ValueError, match="k_pages and v_pages"):
        paged_attention(q, kp, vp[:, :1], table, lo, hi, kv_len=32)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(q[..., :8], kp, vp, table, lo, hi, kv_len=32)
    with pytest.raises(ValueError, match="not a multiple of the pool's 2 kv heads"):
        paged_attention(q[:, :, :3], kp, vp, table, lo, hi, kv_len=32)
    with pytest.raises(ValueError, match="lo must be"):
        paged_attention(q, kp, vp, table, lo[:, :1], hi, kv_len=32)
    with pytest.raises(ValueError, match="page_table must be"):
        paged_attention(q, kp, vp, table[:1], lo, hi, kv_len=32)
    with pytest.raises(ValueError, match="kv_block 24 is not a multiple"):
        paged_attention(q, kp, vp, table, lo, hi, kv_len=32, config=PagedAttentionConfig(kv_block=24))
    with pytest.raises(ValueError, match="powers of two"):
        paged_attention(q[..., :12], kp[..., :12], vp[..., :12], table, lo, hi, kv_len=32, backend="pallas")
    with pytest.raises(ValueError, match="power of two"):
        paged_attention(q, kp, vp, table, lo, hi, kv_len=32, backend="pallas", config=PagedAttentionConfig(kv_block=48))
    with pytest.raises(ValueError, match="one dtype"):
        paged_attention(q.astype(jnp.bfloat16), kp, vp, table, lo, hi, kv_len=32, backend="pallas")


def test_config_and_table():
    with pytest.raises(ValueError, match="block_q"):
        PagedAttentionConfig(block_q=24)
    with pytest.raises(ValueError, match="kv_block"):
        PagedAttentionConfig(kv_block=0)
    with pytest.raises(ValueError, match="kv_splits"):
        PagedAttentionConfig(kv_splits=-1)
    assert kv_splits_for(PagedAttentionConfig(kv_splits=0), 8, 64) == TARGET_PROGRAMS // 8  # decode at B=1, Hkv=8
    assert kv_splits_for(PagedAttentionConfig(kv_splits=0), 8, 4) == 4  # at most one split per key block
    assert kv_splits_for(PagedAttentionConfig(kv_splits=0), 4 * TARGET_PROGRAMS, 64) == 1
    assert kv_splits_for(PagedAttentionConfig(kv_splits=5), 8, 64) == 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        SMALL_PALLAS.block_q = 32
    decode, prefill = select_config("pallas", 8, 16), select_config("pallas", 4096, 16)
    assert decode.block_q < prefill.block_q
    for rows in (1, 16, 64, 4096):
        for page in (16, 32, 128):
            cfg = select_config("pallas", rows, page)
            pages = cfg.kv_block // page
            assert cfg.kv_block % page == 0 and pages & (pages - 1) == 0
    assert select_config("xla", 16, 32).kv_block % 32 == 0
    assert select_config("xla", 16, 32).xla_skip_blocks  # CPU: the host runs the loop, data-dependent bounds are free


def test_fixed_trip_key_loop_has_no_data_dependent_bounds():
    """With `xla_skip_blocks=False` (the GPU's XLA config) the key loop has a trip count fixed in the program (a
    scan); with it, a while loop whose bounds come from the data."""
    case = make_case(b=2, t=4, kv_heads=2, g=2, d=16, page=16, kv_len=128, dtype=jnp.float32, window=20)
    blocked = PagedAttentionConfig(kv_block=32, xla_dense_max=1)

    def program(skip: bool) -> str:
        cfg = dataclasses.replace(blocked, xla_skip_blocks=skip)
        return str(jax.make_jaxpr(lambda *a: paged_attention(*a, kv_len=128, config=cfg))(*case.args()))

    assert "while" in program(True)
    fixed = program(False)
    assert "while" not in fixed and "scan" in fixed


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_pallas_kernel_lowers_to_triton_without_a_gpu(dtype):
    """The cross-platform export runs the Pallas->Triton lowering rules on CPU (PTX compilation needs a GPU): a
    decode, a verify and a multi-query-block prefill shape, with f32 asking for HIGHEST-precision dots (the
    jaxpr is traced at the "default" process-wide precision, which a run under JAX_DEFAULT_MATMUL_PRECISION=highest
    would otherwise write into every dot)."""
    for t in (1, 16, 200):
        q = jnp.ones((2, t, 8, 64), dtype)
        pages = jnp.ones((20, 2, 16, 64), dtype)
        idx = jnp.zeros((2, t), jnp.int32)

        def fn(q, kp, vp, table, lo, hi):
            return paged_attention(q, kp, vp, table, lo, hi, kv_len=128, backend="pallas", return_lse=True)

        args = (q, pages, pages, jnp.zeros((2, 8), jnp.int32), idx, idx)
        assert export_for_cuda(fn, *args).count(TRITON_CALL) == 1
        with jax.default_matmul_precision("default"):
            text = str(jax.make_jaxpr(fn)(*args))
        assert ("HIGHEST" in text) == (dtype == jnp.float32)
    # every tiling the GPU sweep tries, on a verify shape over 1024 keys
    q = jnp.ones((2, 16, 8, 128), dtype)
    pages = jnp.ones((130, 2, 16, 128), dtype)
    idx = jnp.zeros((2, 16), jnp.int32)
    for cfg in SWEEP:

        def tiled(q, kp, vp, table, lo, hi, cfg=cfg):
            return paged_attention(q, kp, vp, table, lo, hi, kv_len=1024, backend="pallas", config=cfg)

        args = (q, pages, pages, jnp.zeros((2, 64), jnp.int32), idx, idx)
        assert export_for_cuda(tiled, *args).count(TRITON_CALL) == 1, cfg


def test_micro_benchmark_reports_agreement():
    tiles = PagedAttentionConfig(kv_block=32, block_q=16, kv_splits=2)
    res = run_paged_bench([(2, 3, 64)], heads=4, kv_heads=2, head_dim=16, repeats=1, sweep=(tiles,), device_iters=2)
    assert res["platform"] == jax.default_backend() and len(res["records"]) == 2
    for r in res["records"]:
        tol = 1e-5 if r["dtype"] == "float32" else 2.0**-7
        assert r["xla_rel_err"] <= tol, r
        for name in ("dense", "gathered", "xla"):
            assert r[f"{name}_ms"] > 0 and r[f"{name}_dev_us"] > 0, name
        (entry,) = r["sweep"]
        assert "error" not in entry and entry["rel_err"] <= tol and entry["dev_us"] > 0, entry
        assert entry["config"]["kv_splits"] == 2


def test_gpu_check_flags_a_disagreement():
    """The path check the GPU run relies on: a correct result passes, one off by more than the tolerance (or a
    wrong lse, or a failing call) does not."""
    case = make_case(b=2, t=3, kv_heads=2, g=2, d=16, page=16, kv_len=32, dtype=jnp.float32)
    args = case.args()
    ref, ref_lse = paged_attention(*args, kv_len=32, backend="reference", return_lse=True)
    ok = _check_one(args, ref, ref_lse, 1e-5, 32, "xla", None, False)
    assert ok["ok"] and ok["max_abs_err"] <= 1e-5, ok
    assert not _check_one(args, ref + 1e-3, ref_lse, 1e-5, 32, "xla", None, False)["ok"]
    assert not _check_one(args, ref, ref_lse + 1e-2, 1e-5, 32, "xla", None, False)["ok"]
    failed = _check_one(args, ref, ref_lse, 1e-5, 40, "xla", None, False)
    assert not failed["ok"] and "multiple of page_size" in failed["error"]


def test_causal_bounds_match_the_dense_masks():
    positions = jnp.asarray([[0, 1, 2, 9], [5, 6, 7, 8]], jnp.int32)
    masks = attention_masks(positions, 12, (4,))
    key = np.arange(12)[None, None, :]
    for window in (0, 4):
        lo, hi = causal_bounds(positions, window)
        assert lo.dtype == hi.dtype == jnp.int32
        got = (key >= np.asarray(lo)[..., None]) & (key < np.asarray(hi)[..., None])
        np.testing.assert_array_equal(got, np.asarray(masks[window]))
