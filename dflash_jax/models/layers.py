"""Building blocks shared by the target and the drafter: parameter builders, RMSNorm, RoPE, GQA attention.

Dense weights are stored `[in, out]` (y = x @ W): on this CPU that layout is ~1.5x faster for decode GEMVs than
HF's `[out, in]`. Loaders send each tensor to the device as stored and transpose and cast it there. Every parameter
carries *logical* axis names (`out_sharding` metadata); `dflash_jax.parallel` maps them to mesh axes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.compilation import program_cache
from dflash_jax.config import DrafterConfig, RopeScaling, TargetConfig
from dflash_jax.errors import CheckpointError, UserError
from dflash_jax.kernels.paged_attention import causal_bounds, gather_pages, paged_attention
from dflash_jax.kv.pages import contiguous_tables
from dflash_jax.kv.sizing import dense_pool_pages
from dflash_jax.quant.formats import DenseRows, is_quantized
from dflash_jax.quant.fuse import gate_up_row_order, qkv_row_order, row_block_slice
from dflash_jax.quant.linear import linear, rows_dot

Axes = tuple[str | None, ...]


# ----------------------------------------------------------------------------------------------- parameters
class ParamBuilder:
    """Makes `nnx.Param`s by name. Subclasses decide where values come from (random init or a checkpoint)."""

    def __init__(self, dtype=jnp.float32):
        self.dtype = dtype

    def value(self, name: str, shape: tuple[int, ...], init: str, axes: Axes = ()) -> jax.Array:
        raise NotImplementedError

    def __call__(self, name: str, shape: tuple[int, ...], axes: Axes, init: str = "normal") -> nnx.Param:
        v = self.value(name, tuple(int(s) for s in shape), init, axes)
        return nnx.Param(v, out_sharding=axes, eager_sharding=False)

    def derived(self, value: jax.Array, axes: Axes) -> nnx.Param:
        """A parameter computed from others (`declare_fused_block`), with logical `axes`; here it stays where
        its inputs were computed."""
        return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class RandomBuilder(ParamBuilder):
    """Random init: normal(0, std) for matrices, ones for norms, zeros for `init="zeros"`."""

    def __init__(self, seed: int = 0, std: float = 0.02, dtype=jnp.float32):
        super().__init__(dtype)
        self.rng = np.random.default_rng(seed)
        self.std = std

    def value(self, name, shape, init, axes=()):
        if init == "ones":
            return jnp.ones(shape, self.dtype)
        if init == "zeros":
            return jnp.zeros(shape, self.dtype)
        return jnp.asarray(self.rng.normal(0.0, self.std, size=shape).astype(np.float32), self.dtype)


@dataclass(frozen=True)
class StoredTensor:
    """A checkpoint tensor read on demand: its shape and dtype name as stored, and `read()` -> a host array in the
    stored dtype (from a memory-mapped file, so only the tensor being placed is held on the host)."""

    shape: tuple[int, ...]
    dtype: str
    read: Callable[[], np.ndarray]


class Placement:
    """Where a parameter lives: `sharding(axes, shape)` for its logical axes, `put(host, sharding)` to place a host
    array there. This one places everything on the default device; `parallel.rules.MeshPlacement` splits
    parameters over a mesh by the sharding rules."""

    def sharding(self, axes: Axes, shape: tuple[int, ...]) -> jax.sharding.Sharding:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def put(self, x: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
        return jax.device_put(x, sharding)


@program_cache(maxsize=64)
def _converter(dtype: np.dtype, transpose: bool, sharding: jax.sharding.Sharding):
    """A jitted `x -> (x.T if transpose else x).astype(dtype)` with its output on `sharding`."""
    return jax.jit(lambda x: (x.T if transpose else x).astype(dtype), out_shardings=sharding)


def place_tensor(host: np.ndarray, dtype, axes: Axes, placement: Placement, *, transpose: bool = False) -> jax.Array:
    """One host array -> a device array in `dtype` (our layout, with the sharding of `axes`). The host array goes
    to the device as stored (no host-side cast or transpose); a `[out, in]` matrix is transposed (`transpose`)
    and cast there."""
    dtype = jnp.dtype(dtype)
    shape = tuple(host.shape[::-1]) if transpose else tuple(host.shape)
    out = placement.sharding(tuple(axes), shape)
    if not transpose and host.dtype == dtype:
        return placement.put(host, out)
    stored_axes = tuple(axes)[::-1] if transpose else tuple(axes)
    x = placement.put(host, placement.sharding(stored_axes, tuple(host.shape)))
    return _converter(dtype, transpose, out)(x)


class DictBuilder(ParamBuilder):
    """Takes values from a `{name: array or StoredTensor}` dict; checks shapes and leftovers.

    `file_layout=False`: the values are in our layout. `file_layout=True`: matrices for which `transposed(name)`
    holds are in the files' `[out, in]` layout and are transposed on the device. Every value goes to the device
    in its stored dtype and is cast to `dtype` there, placed per `placement` (default: the default device)."""

    def __init__(
        self,
        weights: Mapping[str, np.ndarray | StoredTensor],
        source: str,
        dtype=jnp.float32,
        file_names: dict[str, str] | None = None,
        transposed: Callable[[str], bool] = lambda n: False,
        *,
        file_layout: bool = False,
        placement: Placement | None = None,
    ):
        """`file_names` maps our names to the checkpoint's own; `transposed(name)` says whether a matrix is
        transposed from the file's [out, in] layout, so errors name the tensor and its shapes as in the file."""
        super().__init__(dtype)
        self.weights = weights
        self.source = source
        self.file_names = file_names or {}
        self.transposed = transposed
        self.file_layout = file_layout
        self.placement = placement or Placement()
        self.used: set[str] = set()

    def _flip(self, name: str, shape) -> bool:
        return len(shape) == 2 and self.transposed(name)

    def _describe(self, name: str, shape) -> tuple[str, list[int]]:
        """Our-layout `shape` as the file stores it."""
        fixed = list(shape)[::-1] if self._flip(name, shape) else list(shape)
        return self.file_names.get(name, name), fixed

    def value(self, name, shape, init, axes=()):
        fname, want = self._describe(name, shape)
        if name not in self.weights:
            raise CheckpointError(f"{self.source}: missing tensor {fname!r} (expected shape {want})")
        w = self.weights[name]
        got = list(w.shape) if self.file_layout else self._describe(name, w.shape)[1]
        if got != want:
            raise CheckpointError(f"{self.source}: tensor {fname!r} has shape {got}, expected {want}")
        self.used.add(name)
        host = w.read() if isinstance(w, StoredTensor) else np.asarray(w)
        axes = tuple(axes) if axes else (None,) * len(shape)
        flip = self.file_layout and self._flip(name, shape)
        return place_tensor(host, self.dtype, axes, self.placement, transpose=flip)

    def derived(self, value: jax.Array, axes: Axes) -> nnx.Param:
        """A parameter computed from loaded ones, placed per `placement` by its logical `axes`."""
        value = jax.device_put(value, self.placement.sharding(tuple(axes), tuple(value.shape)))
        return nnx.Param(value, out_sharding=axes, eager_sharding=False)

    def check_all_used(self, ignore: Callable[[str], bool] = lambda n: False) -> None:
        extra = sorted(n for n in self.weights if n not in self.used and not ignore(n))
        if extra:
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            raise CheckpointError(f"{self.source}: unexpected tensor {self.file_names.get(extra[0], extra[0])!r}{more}")


# The weights `declare_decoder_block` declares on every block (plus q_norm/k_norm with `qk_norm`).
DECODER_BLOCK_WEIGHTS = (
    "input_layernorm",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "post_attention_layernorm",
    "gate_proj",
    "up_proj",
    "down_proj",
)


def declare_decoder_block(mod, p: ParamBuilder, pre: str, cfg: TargetConfig | DrafterConfig, *, qk_norm: bool) -> None:
    """The parameters of a pre-norm attention + SwiGLU block shaped by `cfg` (a target or drafter config), named
    as in HF/z-lab checkpoints (`{pre}self_attn.q_proj.weight`, ...), as attributes of `mod`."""
    hidden, q_dim, kv_dim, inter, head_dim = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.intermediate_size, cfg.head_dim
    mod.input_layernorm = p(pre + "input_layernorm.weight", (hidden,), ("embed",), "ones")
    mod.q_proj = p(pre + "self_attn.q_proj.weight", (hidden, q_dim), ("embed", "heads"))
    mod.k_proj = p(pre + "self_attn.k_proj.weight", (hidden, kv_dim), ("embed", "kv_heads"))
    mod.v_proj = p(pre + "self_attn.v_proj.weight", (hidden, kv_dim), ("embed", "kv_heads"))
    mod.o_proj = p(pre + "self_attn.o_proj.weight", (q_dim, hidden), ("heads", "embed"))
    if qk_norm:
        mod.q_norm = p(pre + "self_attn.q_norm.weight", (head_dim,), (None,), "ones")
        mod.k_norm = p(pre + "self_attn.k_norm.weight", (head_dim,), (None,), "ones")
    mod.post_attention_layernorm = p(pre + "post_attention_layernorm.weight", (hidden,), ("embed",), "ones")
    mod.gate_proj = p(pre + "mlp.gate_proj.weight", (hidden, inter), ("embed", "mlp"))
    mod.up_proj = p(pre + "mlp.up_proj.weight", (hidden, inter), ("embed", "mlp"))
    mod.down_proj = p(pre + "mlp.down_proj.weight", (inter, hidden), ("mlp", "embed"))


# The fused projections' logical axes: q|k|v grouped by KV head `[in, kv_heads, g + 2, head_dim]` (per KV head
# its g query heads, then its key, then its value), gate|up `[in, 2, intermediate]`. Split on the KV heads and on
# the intermediate, every rank holds its own heads' q, k and v and its own slice of gate and of up.
QKV_AXES: Axes = ("embed", "kv_heads", None, None)
GATE_UP_AXES: Axes = ("embed", None, "mlp")
# The checkpoint tensors each fused parameter is made of, and a quantized fused weight's logical axes (of its
# dense `[in, out]` layout, as for any quantized weight): its rows are ordered so that a plain split of the
# output axis gives each rank its KV heads with their query heads, or its intermediate slice of gate and up.
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
FUSED_MODULE: dict[str, str] = {"qkv_proj": "self_attn", "gate_up_proj": "mlp"}  # its parts' checkpoint module
QUANTIZED_FUSED_AXES: dict[str, Axes] = {"qkv_proj": ("embed", "kv_heads"), "gate_up_proj": ("embed", "mlp")}


def fused_row_order(name: str, cfg: TargetConfig | DrafterConfig) -> np.ndarray:
    """The fused parameter `name`'s rows (`[out, in]`) as rows of its parts' concatenation (`FUSED_PARTS`)."""
    if name == "qkv_proj":
        return qkv_row_order(cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim)
    return gate_up_row_order(cfg.intermediate_size)


def fused_matrix(name: str, w: jax.Array) -> jax.Array:
    """A dense fused parameter (`[in, kv, g + 2, d]` or `[in, 2, intermediate]`) as one `[out, in]` matrix with
    its rows in `fused_row_order`: the form a quantized fused weight takes."""
    n = w.shape[0]
    if name == "gate_up_proj":
        w = w.transpose(0, 2, 1)
    return w.reshape(n, -1).T


def fused_part_rows(name: str, cfg: TargetConfig | DrafterConfig) -> dict[str, np.ndarray]:
    """Per part of the fused parameter `name`, its rows within the fused `[out, in]` weight, in the part's order."""
    order = fused_row_order(name, cfg)
    where = np.argsort(order)  # row r of the concatenation sits at fused row where[r]
    sizes = {"q_proj": cfg.q_dim, "k_proj": cfg.kv_dim, "v_proj": cfg.kv_dim}
    out, start = {}, 0
    for part in FUSED_PARTS[name]:
        size = sizes.get(part, cfg.intermediate_size)
        out[part] = where[start : start + size]
        start += size
    return out


def fuse_qkv(q: jax.Array, k: jax.Array, v: jax.Array, num_kv_heads: int, head_dim: int) -> jax.Array:
    """q [in, q_dim], k/v [in, kv_dim] (our `[in, out]` layout, query head h of KV head h // g) -> the fused
    `[in, kv_heads, g + 2, head_dim]` (`QKV_AXES`)."""
    n = q.shape[0]
    g = q.shape[1] // (num_kv_heads * head_dim)
    parts = (q.reshape(n, num_kv_heads, g, head_dim), k.reshape(n, num_kv_heads, 1, head_dim))
    return jnp.concatenate([*parts, v.reshape(n, num_kv_heads, 1, head_dim)], axis=2)


def split_qkv(qkv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The inverse of `fuse_qkv`: (q [in, q_dim], k [in, kv_dim], v [in, kv_dim])."""
    n, kv, g2, d = qkv.shape
    return (
        qkv[:, :, : g2 - 2].reshape(n, kv * (g2 - 2) * d),
        qkv[:, :, g2 - 2].reshape(n, kv * d),
        qkv[:, :, g2 - 1].reshape(n, kv * d),
    )


def qkv_heads(
    x: jax.Array, qkv: Any, group: int | None = None, head_dim: int | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [..., in] through the fused q|k|v (one matmul) -> q [..., heads, d], k and v [..., kv_heads, d]. A dense
    `qkv` is `[in, kv_heads, g + 2, d]` (`fuse_qkv`); a quantized one is `[out, in]` with its rows in the same
    order (`quant.fuse.qkv_row_order`), and needs `group` (query heads per KV head) and `head_dim`. The head
    counts come from the weight's shape (a rank's heads under tensor parallelism)."""
    if isinstance(qkv, DenseRows):
        y = linear(x, qkv).reshape(*x.shape[:-1], *qkv.out_shape)
    elif is_quantized(qkv):
        y = linear(x, qkv)
        y = y.reshape(*y.shape[:-1], -1, group + 2, head_dim)
    else:
        y = jnp.einsum("...i,ikgd->...kgd", x, qkv)
    g = y.shape[-2] - 2
    q = y[..., :g, :].reshape(*y.shape[:-3], y.shape[-3] * g, y.shape[-1])
    return q, y[..., g, :], y[..., g + 1, :]


def kv_heads(x: jax.Array, qkv: Any, group: int, head_dim: int) -> tuple[jax.Array, jax.Array]:
    """Only the k and v of `qkv_heads` (one matmul over the fused weight's key and value rows): the drafter's
    context path, which needs no queries."""
    if isinstance(qkv, DenseRows):
        kv, g2, d = qkv.out_shape
        rows = qkv.w.reshape(kv, g2, d, -1)[:, group:].reshape(kv * 2 * d, -1)
        y = linear(x, DenseRows(rows, (kv, 2, d)))
        y = y.reshape(*x.shape[:-1], kv, 2, d)
    elif is_quantized(qkv):
        kv_rows = row_block_slice(qkv, (group + 2) * head_dim, group * head_dim, (group + 2) * head_dim)
        y = linear(x, kv_rows)
        y = y.reshape(*y.shape[:-1], -1, 2, head_dim)
    else:
        y = jnp.einsum("...i,ikcd->...kcd", x, qkv[:, :, group:])
    return y[..., 0, :], y[..., 1, :]


def declare_fused_block(
    mod, p: ParamBuilder, pre: str, cfg: TargetConfig | DrafterConfig, *, qk_norm: bool | None = None
) -> None:
    """`declare_decoder_block`'s parameters, read under the same checkpoint names, with q|k|v fused into
    `mod.qkv_proj` and gate|up into `mod.gate_up_proj` (`QKV_AXES`, `GATE_UP_AXES`) as the block is built.
    `qk_norm` defaults to the config's (a target's)."""
    hidden, q_dim, kv_dim, inter, head_dim = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.intermediate_size, cfg.head_dim
    qk_norm = cfg.qk_norm if qk_norm is None else qk_norm
    mod.input_layernorm = p(pre + "input_layernorm.weight", (hidden,), ("embed",), "ones")
    q = p(pre + "self_attn.q_proj.weight", (hidden, q_dim), ("embed", "heads"))[...]
    k = p(pre + "self_attn.k_proj.weight", (hidden, kv_dim), ("embed", "kv_heads"))[...]
    v = p(pre + "self_attn.v_proj.weight", (hidden, kv_dim), ("embed", "kv_heads"))[...]
    mod.qkv_proj = p.derived(fuse_qkv(q, k, v, cfg.num_kv_heads, head_dim), QKV_AXES)
    del q, k, v
    mod.o_proj = p(pre + "self_attn.o_proj.weight", (q_dim, hidden), ("heads", "embed"))
    if qk_norm:
        mod.q_norm = p(pre + "self_attn.q_norm.weight", (head_dim,), (None,), "ones")
        mod.k_norm = p(pre + "self_attn.k_norm.weight", (head_dim,), (None,), "ones")
    mod.post_attention_layernorm = p(pre + "post_attention_layernorm.weight", (hidden,), ("embed",), "ones")
    gate = p(pre + "mlp.gate_proj.weight", (hidden, inter), ("embed", "mlp"))[...]
    up = p(pre + "mlp.up_proj.weight", (hidden, inter), ("embed", "mlp"))[...]
    mod.gate_up_proj = p.derived(jnp.stack([gate, up], axis=1), GATE_UP_AXES)
    del gate, up
    mod.down_proj = p(pre + "mlp.down_proj.weight", (inter, hidden), ("mlp", "embed"))


def unfused_block(mod) -> dict[str, jax.Array]:
    """A fused block's weights under `DECODER_BLOCK_WEIGHTS`' names, each `[in, out]` as declared."""
    q, k, v = split_qkv(mod.qkv_proj[...])
    gate_up = mod.gate_up_proj[...]
    fused = {"q_proj": q, "k_proj": k, "v_proj": v, "gate_proj": gate_up[:, 0], "up_proj": gate_up[:, 1]}
    return {n: fused[n] if n in fused else getattr(mod, n)[...] for n in DECODER_BLOCK_WEIGHTS}


# ----------------------------------------------------------------------------------------------- math
def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv
    if scaling.rope_type == "linear":
        return inv / scaling.factor
    if scaling.rope_type == "freq_factors":  # GGUF `rope_freqs.weight` (llama3-style scaling baked per frequency)
        return inv / np.asarray(scaling.freq_factors, np.float64)
    if scaling.rope_type == "llama3":
        old = scaling.original_max_position_embeddings
        low_wl = old / scaling.low_freq_factor
        high_wl = old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wl, inv / scaling.factor, inv)
        smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        return np.where(medium, smoothed, scaled)
    if scaling.rope_type == "yarn":  # transformers' `_compute_yarn_parameters`

        def correction_dim(rotations: float) -> float:
            orig = scaling.original_max_position_embeddings
            return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
        if scaling.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)  # 1 = interpolated
        return inv / scaling.factor * ramp + inv * (1 - ramp)
    raise CheckpointError(f"rope_scaling type {scaling.rope_type!r} is not supported")


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """The factor cos and sin are multiplied by (yarn's `attention_factor`; 1 otherwise)."""
    return 1.0 if scaling is None else scaling.attention_factor


def rope_cos_sin(
    positions: jax.Array, inv_freq: np.ndarray, attention_factor: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """cos/sin of shape positions.shape + [head_dim] (HF layout: the frequencies repeated twice), times
    `attention_factor` (`rope_attention_factor`)."""
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    ang = jnp.concatenate([ang, ang], axis=-1)
    if attention_factor == 1.0:
        return jnp.cos(ang), jnp.sin(ang)
    return jnp.cos(ang) * attention_factor, jnp.sin(ang) * attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [..., T, heads, hd]; cos/sin: [..., T, hd] (f32). HF `rotate_half` convention. The rotation is computed
    in f32 and returned in x's dtype."""
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c, s = cos[..., None, :], sin[..., None, :]
    return (x * c + rot * s).astype(x.dtype)


_SCORES = "btkgd,bksd->bkgts"


@jax.custom_vjp
def _scores_f32(qg: jax.Array, k: jax.Array) -> jax.Array:
    """q·k scores [b,k,g,t,s] accumulated and returned in f32 from operands in their own dtype. The gradient
    dots run in the operands' dtype (the f32 cotangent is rounded to it), as an autodiff of the f32-output dot
    would mix an f32 cotangent with bf16 operands."""
    return jnp.einsum(_SCORES, qg, k, preferred_element_type=jnp.float32)


def _scores_fwd(qg, k):
    return _scores_f32(qg, k), (qg, k)


def _scores_bwd(res, ct):
    qg, k = res
    ct = ct.astype(qg.dtype)
    dq = jnp.einsum("bkgts,bksd->btkgd", ct, k).astype(qg.dtype)
    dk = jnp.einsum("bkgts,btkgd->bksd", ct, qg).astype(k.dtype)
    return dq, dk


_scores_f32.defvjp(_scores_fwd, _scores_bwd)


def gqa_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """q [B,T,Hq,d], k/v head-major [B,Hkv,S,d] (the KV-cache layout), mask [B,T,S] bool (True = visible)
    -> [B,T,Hq*d]."""
    b, t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qg = q.reshape(b, t, hkv, g, d)
    # the scores accumulate and the softmax runs in f32 whatever the operands' dtype; the probabilities go back
    # to the values' dtype for the second dot
    scores = _scores_f32(qg, k) * (1.0 / math.sqrt(d))
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    # contract into the dot's natural [b,k,g,t,d] order and transpose the small result afterwards: asking the
    # einsum for [b,t,k,g,d] directly made XLA:CPU pick a ~17x slower dot at batch 64
    out = jnp.einsum("bkgts,bksd->bkgtd", p, v).transpose(0, 3, 1, 2, 4)
    return out.reshape(b, t, hq * d)


def heads_major(x: jax.Array) -> jax.Array:
    """Token-major K/V rows [B,T,H,d] -> the head-major attention/cache layout [B,H,T,d]."""
    return x.swapaxes(1, 2)


# A write at this position (or past the end of a row's page table) lands in the null page, so it is dropped.
DROP = 1 << 30


@functools.partial(jax.tree_util.register_dataclass, data_fields=["table"], meta_fields=["backend", "interpret"])
@dataclass(frozen=True)
class Pages:
    """How every cache is addressed: row b's logical position s lives in page `table[b, s // P]` at offset `s % P`
    of a page pool `[num_pages, H, P, d]`. Page 0 is the null page: tables pad with it, dropped writes land in it,
    and no live position is ever read from it. `backend`: the attention over the pages (`paged_attention`'s "xla"
    or "pallas"; `interpret` runs the Pallas kernel in interpret mode)."""

    table: jax.Array  # [B, n] int32
    backend: str = "xla"
    interpret: bool = False

    @property
    def in_place(self) -> bool:
        """Does the attention read the pages where they lie (the Pallas kernel), rather than gather them first?"""
        return self.backend in ("pallas", "interpret") or self.interpret


def contiguous_pages(rows: int, positions: int, page_size: int, backend: str = "xla") -> tuple[Pages, int]:
    """Page tables for `rows` sequences of up to `positions` positions laid end to end in one pool of
    `page_size`-token pages (`kv.pages.contiguous_tables`: row r owns pages 1 + r * n .. (r + 1) * n, page 0 stays
    the null page), as batch jobs use them (training, data generation, benchmarks). Returns (the rows' `Pages`,
    the pool's page count to allocate)."""
    table = contiguous_tables(rows, positions, page_size)
    return Pages(jnp.asarray(table), backend), dense_pool_pages(rows, positions, page_size)


def _pages_for(kv_len: int, page_size: int, pages: Pages) -> int:
    """Pages covering positions [0, kv_len) (the last one possibly in part); the table must hold that many."""
    n = -(-kv_len // page_size)
    if n > pages.table.shape[1]:
        raise ValueError(
            f"kv_len {kv_len} needs {n} pages of {page_size} positions, but the page table has {pages.table.shape[1]}"
        )
    return n


def write_rows(cache: jax.Array, rows: jax.Array, pages: Pages, positions: jax.Array) -> jax.Array:
    """Store token rows [B,T,H,d] at absolute `positions` [B,T] of the rows' pages in the pool [N,H,P,d].
    Positions past the page table (or negative) go to the null page. Pools are head-major so attention reads them
    without a transpose (on CPU the token-major layout cost one full copy of every layer's K and V per step)."""
    rows = rows.astype(cache.dtype)
    p, n = cache.shape[2], pages.table.shape[1]
    idx = positions // p
    page = jnp.take_along_axis(pages.table, jnp.clip(idx, 0, n - 1), axis=1)
    page = jnp.where((positions >= 0) & (idx < n), page, 0)
    return cache.at[page, :, positions % p].set(rows)


def read_rows(cache: jax.Array, pages: Pages, kv_len: int) -> jax.Array:
    """Positions [0, kv_len) of the rows' pages, gathered in logical order: [B, H, kv_len, d]."""
    p = cache.shape[2]
    rows = gather_pages(cache, pages.table[:, : _pages_for(kv_len, p, pages)])
    return rows if kv_len % p == 0 else rows[:, :, :kv_len]


def _gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


def _gelu_erf(x):
    return jax.nn.gelu(x, approximate=False)


# transformers' ACT2FN by name (`hidden_act`), the formulas of its activation classes
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": _gelu_erf,
    "gelu_python": _gelu_erf,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_python_tanh": _gelu_tanh,
    "gelu_accurate": _gelu_tanh,
    "gelu_fast": lambda x: 0.5 * x * (1.0 + jnp.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x))),
    "gelu_10": lambda x: jnp.clip(_gelu_erf(x), -10.0, 10.0),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "relu": jax.nn.relu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),
    "relu6": jax.nn.relu6,
    "leaky_relu": lambda x: jax.nn.leaky_relu(x, 0.01),
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
    "linear": lambda x: x,
    "mish": lambda x: x * jnp.tanh(jax.nn.softplus(x)),
    "hardswish": jax.nn.hard_swish,
    "laplace": lambda x: 0.5 * (1.0 + jax.lax.erf((x - 0.707107) / (0.282095 * math.sqrt(2.0)))),
    "sqrtsoftplus": lambda x: jnp.sqrt(jax.nn.softplus(x)),
}


def dense(x: jax.Array, w: Any) -> jax.Array:
    """x @ W for a dense `[in, out]` weight, or `quant.linear` for an `[out, in]` weight (quantized, on its own
    kernel backend, or `DenseRows`)."""
    if isinstance(w, jax.Array | np.ndarray):
        return x @ w
    return linear(x, w)


def logits_f32(h: jax.Array, lm_head: Any) -> jax.Array:
    """f32 logits h @ lm_head for a dense `[hidden, vocab]` head (accumulated in f32), or an `[vocab, hidden]` one
    (quantized or `DenseRows`; `quant.linear` accumulates in f32)."""
    if isinstance(lm_head, jax.Array | np.ndarray):
        return jnp.matmul(h, lm_head, preferred_element_type=jnp.float32)
    if isinstance(lm_head, DenseRows):
        return rows_dot(h, lm_head.w.astype(h.dtype))
    return linear(h, lm_head).astype(jnp.float32)


DENSE_LAYOUTS = ("auto", "in-out", "out-in")


def resolve_dense_layout(flag: str, *, tp: int = 1, platform: str | None = None) -> str:
    """`--dense-layout` -> `in-out` (the weights as loaded, `x @ W`) or `out-in` (`dense_rows_state`): `auto` is
    `out-in` on CPU with one device and `in-out` elsewhere. `out-in` needs `--tp-size 1` (its copies carry no
    mesh layout)."""
    if flag not in DENSE_LAYOUTS:
        raise UserError(
            f"--dense-layout must be one of {', '.join(DENSE_LAYOUTS)}, got {flag!r}", param="--dense-layout"
        )
    if flag == "auto":
        return "out-in" if tp == 1 and (platform or jax.default_backend()) == "cpu" else "in-out"
    if flag == "out-in" and tp > 1:
        raise UserError(
            "--dense-layout out-in runs on one device: give --tp-size 1 or --dense-layout auto", param="--dense-layout"
        )
    return flag


# The dense weights `dense_rows_state` converts, by parameter name, with the per-token output shape of each
# (from the dense `[in, ...out]` shape): every matmul weight of a decoder block, the drafter's context projection
# and an `[hidden, vocab]` LM head.
DENSE_ROWS_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "fc", "lm_head")


def to_dense_rows(w: Any) -> Any:
    """A dense `[in, ...out]` weight as `DenseRows` (`[out, in]`, a transposed copy); any other weight as it is."""
    if not isinstance(w, jax.Array | np.ndarray) or w.ndim < 2:
        return w
    n = w.shape[0]
    return DenseRows(jnp.asarray(w).reshape(n, -1).T, tuple(int(d) for d in w.shape[1:]))


def dense_rows_state(state: nnx.State) -> nnx.State:
    """A model state (`nnx.split`) with its dense matmul weights (`DENSE_ROWS_NAMES`) as `DenseRows`, for
    XLA:CPU, where a dot of a few tokens with an `[in, out]` weight runs as a compute-bound GEMM: on the 2-core
    EPYC VM, SmolLM2-135M's 30 blocks at 8 tokens per call took 57 ms as `x @ W` and 29 ms as `DenseRows` (15 ms
    for one token either way), its 49152-row LM head 26 ms and 8 ms. The values are the same; only the
    summation order of each dot may differ in the last bits. The model `state` came from keeps its weights."""
    flat = [
        (path, var.replace(to_dense_rows(var.get_value())) if str(path[-1]) in DENSE_ROWS_NAMES else var)
        for path, var in nnx.to_flat_state(state)
    ]
    return nnx.from_flat_state(flat)


def fused_gated_mlp(x: jax.Array, gate_up: Any, down: Any, act: str = "silu") -> jax.Array:
    """`gated_mlp` with gate|up fused (one matmul for both): dense `[in, 2, intermediate]` (`GATE_UP_AXES`), or a
    quantized `[out, in]` weight with gate row i and up row i side by side (`quant.fuse.gate_up_row_order`).
    `down` is a dense `[in, out]` or a quantized `[out, in]` weight. Each may be `DenseRows` (`dense_rows_state`)."""
    if isinstance(gate_up, DenseRows):
        y = linear(x, gate_up).reshape(*x.shape[:-1], *gate_up.out_shape)
        gate, up = y[..., 0, :], y[..., 1, :]
    elif is_quantized(gate_up):
        y = linear(x, gate_up)
        y = y.reshape(*y.shape[:-1], -1, 2)
        gate, up = y[..., 0], y[..., 1]
    else:
        y = jnp.einsum("...i,icf->...cf", x, gate_up)
        gate, up = y[..., 0, :], y[..., 1, :]
    h = ACTIVATIONS[act](gate) * up
    return dense(h, down)


def gated_mlp(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, act: str = "silu") -> jax.Array:
    """The Llama/Qwen3 MLP: down(act(x @ gate) * (x @ up)); `act` a `hidden_act` name (SwiGLU for silu)."""
    return (ACTIVATIONS[act](x @ gate) * (x @ up)) @ down


def cached_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, pages: Pages, visible, kv_len: int):
    """q [B,T,Hq,d] over positions [0, kv_len) of the rows' cached K/V -> [B,T,Hq*d]: `paged_attention` over the
    pages with the visible range `visible = (lo, hi)` [B,T] (`attention_ranges`; hi <= kv_len). A `kv_len` that
    ends inside a page reads that page whole (its positions from kv_len on are past every hi)."""
    lo, hi = visible
    p = k_cache.shape[2]
    read = _pages_for(kv_len, p, pages) * p
    return paged_attention(
        q, k_cache, v_cache, pages.table, lo, hi, kv_len=read, backend=pages.backend, interpret=pages.interpret
    )


def attention_ranges(positions: jax.Array, windows: tuple[int, ...]) -> dict[int, tuple[jax.Array, jax.Array]]:
    """The keys visible to queries at absolute `positions` [B,T] as ranges lo <= s < hi by sliding window (0 = full
    causal), the same visibility as `attention_masks`; a dropped row (position `DROP`) sees nothing."""
    dropped = positions >= DROP
    out = {}
    for w in sorted(set(windows) | {0}):
        lo, hi = causal_bounds(positions, w)
        out[w] = (lo, jnp.where(dropped, 0, hi))
    return out


def attention_masks(positions: jax.Array, kv_len: int, windows: tuple[int, ...]) -> dict[int, jax.Array]:
    """Visibility masks [B,T,kv_len] by sliding window (0 = full causal) for queries at absolute `positions`
    [B,T] over cache rows 0..kv_len-1 (row = absolute position): a query at p sees keys k <= p, and with window
    w only keys k > p - w (transformers' sliding-window mask, the query itself included in its w keys)."""
    key_pos = jnp.arange(kv_len, dtype=positions.dtype)[None, None, :]
    causal = key_pos <= positions[:, :, None]
    masks = {0: causal}
    for w in sorted(set(windows) - {0}):
        masks[w] = causal & (key_pos > positions[:, :, None] - w)
    return masks
