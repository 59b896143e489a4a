"""DFlash drafter training (optax + orbax) on cached target data (`dflash_jax.train.data`).

Per step: a batch of sequences; per sequence `num_anchors` random anchors on response positions (resampled every
step); blocks `[token at anchor, MASK × (B-1)]`; the drafter sees context strictly before each anchor and its own
block bidirectionally, never other blocks; CE on slots 1..B-1 weighted by exp(-(k-1)/γ) through the frozen target
LM head, in chunks. AdamW with warm-up + cosine decay and global-norm clipping at 1.0.

Exact resume: the checkpoint holds params, optimizer state and the step; the data order and the anchors are pure
functions of (seed, step), so a resumed run continues exactly where an uninterrupted one would be.

Dtypes: parameters, gradients and the optimizer state are f32; the forward and backward run in
`compute_dtype` (the target's weight dtype, `--dtype`), the LM-head loss GEMM in `ce_dtype` with f32 accumulation.

Taps: cached in the data shards (CPU default), or, for shards built with `--no-store-taps`, recomputed inside the
step by one forward of the frozen target over the batch rows (the accelerator path).

Schedule: the learning rate is computed on the host per step and fed to the optimizer (optax.inject_hyperparams),
so one compiled step serves any schedule. `--steps N`: linear warm-up + cosine to min_lr_ratio. `--time-budget S`:
warm-up-stable-decay (WSD) whose length is fitted to the budget from the measured step time; the last
`decay_frac` of the fitted steps decay linearly to min_lr_ratio (`steps` is then only an upper bound).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dflash_jax.checkpoints.drafter import load_drafter
from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.errors import UserError
from dflash_jax.models.drafter import DrafterModel, block_embeddings, candidate_logits
from dflash_jax.models.drafter2 import drafter_class, identity_init
from dflash_jax.models.layers import (
    DECODER_BLOCK_WEIGHTS,
    RandomBuilder,
    contiguous_pages,
    heads_major,
    unfused_block,
)
from dflash_jax.models.target import init_kv_cache
from dflash_jax.train.losses import (
    block_layout,
    chunked_ce,
    decay_weights,
    sample_anchors,
    selector_topk_loss,
    teacher_forced_tau,
)


@dataclass(frozen=True)
class TrainConfig:
    num_layers: int = 2
    block_size: int = 8
    target_layer_ids: tuple[int, ...] = (1, 10, 18, 27)
    mask_token_id: int = 16
    num_anchors: int = 16
    batch_size: int = 8
    steps: int = 2000
    lr: float = 1e-3
    warmup_frac: float = 0.04
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    clip: float = 1.0
    ce_chunk: int = 1024  # LM-head rows per chunk (bigger GEMMs run faster; ~200 MB of f32 logits at 1024)
    ce_dtype: str = "bfloat16"  # LM-head GEMM inputs in the loss (f32 accumulation); float32 for exact
    compute_dtype: str = "float32"  # the drafter's forward/backward (the target's dtype); params and Adam stay f32
    seed: int = 0
    init_std: float = 0.02
    save_every: int = 100
    log_every: int = 10
    # DFlash2: `--arch dflash2` adds the convs and the candidate selector (identity-initialised)
    arch: str = "dflash"
    init_from_target: bool = False
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    selector_loss_weight: float = 1.0
    time_budget: float = 0.0  # seconds; > 0 fits the number of steps to the budget (WSD schedule)
    warmup_steps: int = 0  # > 0 overrides warmup_frac
    decay_frac: float = 0.2  # WSD: share of the fitted steps spent decaying
    init_from: str = ""  # a drafter directory (z-lab layout) to continue training from


def drafter_config_for(tcfg: TargetConfig, tc: TrainConfig) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=tcfg.hidden_size,
        intermediate_size=tcfg.intermediate_size,
        num_layers=tc.num_layers,
        num_heads=tcfg.num_heads,
        num_kv_heads=tcfg.num_kv_heads,
        head_dim=tcfg.head_dim,
        vocab_size=tcfg.vocab_size,
        block_size=tc.block_size,
        mask_token_id=tc.mask_token_id,
        target_layer_ids=tuple(tc.target_layer_ids),
        rms_norm_eps=tcfg.rms_norm_eps,
        rope_theta=tcfg.rope_theta,
        rope_scaling=tcfg.rope_scaling,
        layer_attn=tuple((0, False) for _ in range(tc.num_layers)),
        num_target_layers=tcfg.num_layers,
        arch=tc.arch,
        conv_group_size=tc.conv_group_size,
        selector_rank=tc.selector_rank,
        selector_top_k=tc.selector_top_k,
    )


def drafter_loss(drafter: DrafterModel, embed, lm_head, batch: dict, tc: TrainConfig):
    """Returns (loss, metrics). batch: tokens [R,L], loss_mask [R,L], lengths [R], taps [R,L,n*H],
    anchors [R,N], keep [R,N]."""
    cfg = drafter.cfg
    taps = batch["taps"].astype(tc.compute_dtype)
    tokens, anchors, keep = batch["tokens"], batch["anchors"], batch["keep"]
    r, seq_len = tokens.shape
    n, bsz = anchors.shape[1], tc.block_size
    block_id, slot = (jnp.asarray(a) for a in block_layout(n, bsz))
    # context K/V for every position of every row
    ctx_pos = jnp.arange(seq_len, dtype=jnp.int32)
    kvs = drafter.context_kv(taps, jnp.broadcast_to(ctx_pos, (r, seq_len)))
    # blocks
    anchor_tok = jnp.take_along_axis(tokens, anchors, axis=1)  # [R,N]
    blk = jnp.where(slot[None, :] == 0, anchor_tok[:, block_id], cfg.mask_token_id)  # [R,N*B]
    positions = anchors[:, block_id] + slot[None, :]
    h = drafter.block_hidden(
        block_embeddings(cfg, embed, blk),
        positions,
        [heads_major(k) for k, _ in kvs],
        [heads_major(v) for _, v in kvs],
        ctx_pos,
        anchors[:, block_id],
        block_id,
        slot,
    )
    # labels: slot k predicts token at anchor + k
    lab_pos = jnp.minimum(positions, seq_len - 1)
    labels = jnp.take_along_axis(tokens, lab_pos, axis=1)
    in_seq = positions < batch["lengths"][:, None]
    lmask = jnp.take_along_axis(batch["loss_mask"], lab_pos, axis=1) > 0
    valid = keep[:, block_id] & in_seq & lmask  # [R,N*B]
    w = jnp.asarray(decay_weights(bsz))[slot][None, :] * valid

    def drafted(a):  # [R,N*B,...] -> the rows of slots 1..B-1, flat (slot 0 is the anchor: no label, weight 0)
        return a.reshape(r, n, bsz, *a.shape[2:])[:, :, 1:].reshape(r * n * (bsz - 1), *a.shape[2:])

    hs, labels, valid, w = drafted(h), drafted(labels), drafted(valid), drafted(w)
    dflash2 = cfg.arch == "dflash2"
    ce_dtype = None if tc.ce_dtype == "float32" else jnp.dtype(tc.ce_dtype)
    ce = chunked_ce(
        hs,
        jax.lax.stop_gradient(lm_head),
        labels,
        w.astype(hs.dtype),
        tc.ce_chunk,
        cfg.selector_top_k if dflash2 else 0,
        ce_dtype,
    )
    loss_sum, correct = ce[0], ce[1]
    loss = loss_sum / jnp.maximum(jnp.sum(w), 1e-6)
    extra = {}
    if dflash2:  # DFlash2: + λ · the selector's top-K CE, teacher-forced predecessor
        sel = drafter.candidate_selector
        pred = jnp.take_along_axis(tokens, jnp.clip(positions - 1, 0, seq_len - 1), axis=1)
        sel_loss, extra, correct = selector_topk_loss(
            hs,
            jax.lax.stop_gradient(lm_head),
            sel.predecessor_codebook[...],
            sel.successor_codebook[...],
            sel.hidden_projection[...],
            drafted(pred),
            labels,
            w.astype(hs.dtype),
            ce[2],
            u_transform=lambda u: candidate_logits(cfg, u),
        )
        extra["ce_loss"] = loss
        loss = loss + tc.selector_loss_weight * sel_loss
    return loss, (labels, valid, correct, extra)


def warmup_steps(tc: TrainConfig) -> int:
    return tc.warmup_steps if tc.warmup_steps > 0 else max(1, int(tc.steps * tc.warmup_frac))


def lr_schedule(tc: TrainConfig, total: int | None = None) -> optax.Schedule:
    """The learning-rate schedule (step 0-based). Linear warm-up then cosine to `lr * min_lr_ratio` over
    `tc.steps`; or, with `total` (the fitted length of a time-budgeted run), warm-up-stable-decay: linear
    warm-up, constant, and a linear decay to the floor over the last `tc.decay_frac` of `total`."""
    warm, floor = warmup_steps(tc), tc.lr * tc.min_lr_ratio
    if total is None:
        return optax.warmup_cosine_decay_schedule(0.0, tc.lr, warm, max(tc.steps, warm + 1), floor)
    decay_start = max(warm, int(total * (1.0 - tc.decay_frac)))
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, tc.lr, warm),
            optax.constant_schedule(tc.lr),
            optax.linear_schedule(tc.lr, floor, max(total - decay_start, 1)),
        ],
        boundaries=[warm, decay_start],
    )


def lr_at(tc: TrainConfig, step: int, total: int | None = None) -> float:
    """Learning rate of optimizer step `step` (0-based) under `lr_schedule(tc, total)`."""
    return float(lr_schedule(tc, total)(step))


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """AdamW after global-norm clipping; the learning rate is a hyperparameter set per step (`set_lr`)."""
    return optax.chain(
        optax.clip_by_global_norm(tc.clip),
        optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, b1=0.9, b2=0.95, weight_decay=tc.weight_decay),
    )


def set_lr(opt_state, lr: float):
    opt_state[1].hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
    return opt_state


TAPS_PAGE_SIZE = 16  # positions per page of the frozen target's KV pool when it recomputes taps


def target_taps(tcfg: TargetConfig, tgt_graphdef, tgt_state, tokens: jax.Array, taps: tuple[int, ...]) -> jax.Array:
    """The frozen target's hidden states at `taps` for whole rows [R, L] -> [R, L, n*H] (one prefill-style pass)."""
    model = nnx.merge(tgt_graphdef, tgt_state)
    r, seq_len = tokens.shape
    pages, num_pages = contiguous_pages(r, seq_len, TAPS_PAGE_SIZE)
    cache = init_kv_cache(tcfg, num_pages, TAPS_PAGE_SIZE, model.dtype)
    pos = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (r, seq_len))
    _, hidden, _ = model(tokens, pos, cache, pages, capture=taps, kv_len=seq_len)
    return jax.lax.stop_gradient(hidden)


@partial(
    jax.jit, static_argnames=("graphdef", "tc", "tx", "tgt_graphdef", "tcfg"), donate_argnames=("params", "opt_state")
)
def train_step(
    graphdef,
    params,
    opt_state,
    embed,
    lm_head,
    batch,
    tgt_state=None,
    *,
    tc: TrainConfig,
    tx,
    tgt_graphdef=None,
    tcfg: TargetConfig | None = None,
):
    if "taps" not in batch:  # tokens-only shards: recompute the taps with the frozen target
        batch = {**batch, "taps": target_taps(tcfg, tgt_graphdef, tgt_state, batch["tokens"], tc.target_layer_ids)}

    def lf(p):  # the f32 master weights, cast to the compute dtype for the forward (gradients come back in f32)
        loss, aux = drafter_loss(nnx.merge(graphdef, to_compute_dtype(p, tc.compute_dtype)), embed, lm_head, batch, tc)
        return loss, aux

    (loss, (labels, valid, correct, extra)), grads = jax.value_and_grad(lf, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    # accuracy and teacher-forced τ of the path inference drafts with: the argmax over the full vocab from the
    # loss's own chunked pass, or, for DFlash2, the selector's pick among the top-K (teacher-forced predecessor)
    r = batch["tokens"].shape[0]
    n = batch["anchors"].shape[1]
    c3 = correct.reshape(r, n, tc.block_size - 1)
    v3 = valid.reshape(r, n, tc.block_size - 1)
    acc = jnp.sum(c3 & v3) / jnp.maximum(jnp.sum(v3), 1)
    tau = teacher_forced_tau(c3, v3)
    return params, opt_state, {"loss": loss, "acc": acc, "tau": tau, "grad_norm": optax.global_norm(grads), **extra}


def to_compute_dtype(params, dtype):
    """Every floating array of `params` in `dtype` (the others, e.g. integer buffers, as they are)."""
    dtype = jnp.dtype(dtype)

    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype else x

    return jax.tree.map(cast, params)


def _npz_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The shape of every array in an .npz, read from the .npy headers without loading the data."""
    import zipfile

    out = {}
    with zipfile.ZipFile(path) as zf:
        for name in zf.namelist():
            with zf.open(name) as fh:
                version = np.lib.format.read_magic(fh)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                out[name.removesuffix(".npy")] = read(fh)[0]
    return out


class ShardData:
    """All shards in RAM; batch for step s is a pure function of (seed, s)."""

    def __init__(self, files: list[Path]):
        if not files:
            raise UserError("no training data shards found; build them with `dflash-jax train data`")
        # filled shard by shard into preallocated arrays (peak memory = the data, not twice it); shards of
        # different row lengths (other --max-prompt/--max-new) are zero-padded to the longest
        shapes = []
        for f in files:
            arrays = _npz_shapes(f)  # from the headers: the taps are read once, below
            shapes.append((arrays["tokens"], arrays["taps"][-1] if "taps" in arrays else None))
        if len({t for _, t in shapes}) > 1:
            raise UserError(
                "the data shards mix cached taps and tokens-only shards (or different taps); train on "
                "one kind at a time"
            )
        n, seq_len, tap_dim = sum(s[0][0] for s in shapes), max(s[0][1] for s in shapes), shapes[0][1]
        self.tokens = np.zeros((n, seq_len), np.int32)
        self.loss_mask = np.zeros((n, seq_len), np.uint8)
        self.lengths = np.zeros((n,), np.int32)
        self.taps = None if tap_dim is None else np.zeros((n, seq_len, tap_dim), np.float16)
        row = 0
        for f, ((r, length), _) in zip(files, shapes, strict=True):
            with np.load(f) as z:
                self.tokens[row : row + r, :length] = z["tokens"]
                self.loss_mask[row : row + r, :length] = z["loss_mask"]
                self.lengths[row : row + r] = z["lengths"]
                if self.taps is not None:
                    self.taps[row : row + r, :length] = z["taps"]
            row += r
        self.files = [f.name for f in files]

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def batch(self, step: int, tc: TrainConfig) -> dict[str, np.ndarray]:
        n = len(self)
        per_epoch = max(n // tc.batch_size, 1)
        epoch, i = divmod(step, per_epoch)
        order = np.random.default_rng([tc.seed, epoch]).permutation(n)
        rows = order[i * tc.batch_size : (i + 1) * tc.batch_size]
        rng = np.random.default_rng([tc.seed, 1_000_003, step])
        anchors, keep = sample_anchors(self.loss_mask[rows], self.lengths[rows], tc.num_anchors, tc.block_size, rng)
        out = {
            "tokens": self.tokens[rows],
            "loss_mask": self.loss_mask[rows],
            "lengths": self.lengths[rows],
            "anchors": anchors,
            "keep": keep,
        }
        if self.taps is not None:
            out["taps"] = self.taps[rows]
        return out


@dataclass
class TrainState:
    step: int
    params: nnx.State
    opt_state: optax.OptState
    history: list[dict] = field(default_factory=list)


def init_drafter(tcfg: TargetConfig, tc: TrainConfig, final_norm=None, target=None) -> DrafterModel:
    """Random init; the final norm starts as the target's final norm (if given), so the shared LM head sees
    inputs on the scale it was trained for from step 0. With `tc.init_from_target` and a `target`, the drafter's
    layers start as copies of the target's last layers and `fc` as a selection of the last tap (see
    `init_from_target`)."""
    cfg = drafter_config_for(tcfg, tc)
    if tc.init_from:
        return _load_init(tcfg, cfg, tc.init_from)
    model = drafter_class(cfg)(cfg, tcfg.hidden_size, RandomBuilder(tc.seed, std=tc.init_std))
    if tc.init_from_target and target is not None:
        init_from_target(model, target)
    if cfg.arch == "dflash2":  # a fresh DFlash2 computes exactly what the DFlash backbone computes
        identity_init(model, tc.seed, tc.init_std)
    if final_norm is not None:
        model.norm.set_value(jnp.asarray(final_norm, model.norm[...].dtype))
    return model


def _load_init(tcfg: TargetConfig, want: DrafterConfig, path: str) -> DrafterModel:
    """A saved drafter to continue from; its shape-defining fields must be the ones this run trains."""
    model = load_drafter(path, tcfg)
    fields = ["num_layers", "block_size", "target_layer_ids", "mask_token_id", "arch"]
    if want.arch == "dflash2":
        fields += ["conv_group_size", "selector_rank", "selector_top_k"]
    for f in fields:
        have, need = getattr(model.cfg, f), getattr(want, f)
        if have != need:
            raise UserError(
                f"--init-from {path}: its {f} is {have!r} but this run trains {need!r}; pass the "
                f"matching training flag (e.g. --layers, --drafter-block-size, --arch, --selector-rank)"
            )
    return model


def init_from_target(model: DrafterModel, target) -> None:
    """Start the drafter from the target: layer j copies target layer L-n+j (projections, MLP, norms; q/k norms stay
    ones), `fc` passes the last tap through (identity block), and `hidden_norm` is the input norm of the first
    copied layer, so the context K/V of drafter layer 0 start close to the target's own K/V at that layer."""
    n, nt = len(model.layers), len(target.layers)
    h = target.cfg.hidden_size
    for j, layer in enumerate(model.layers):
        src = unfused_block(target.layers[nt - n + j])  # the target's fused q|k|v and gate|up, split
        for name in DECODER_BLOCK_WEIGHTS:
            dst = getattr(layer, name)  # its own f32 buffer (donated), whatever the target's dtype
            dst.set_value(jnp.array(src[name], dtype=dst[...].dtype, copy=True))
    fc = np.zeros(model.fc[...].shape, np.float32)
    fc[-h:, :] = np.eye(h, dtype=np.float32)  # the last tap (closest to the output) passes through
    model.fc.set_value(jnp.asarray(fc))
    norm = target.layers[nt - n].input_layernorm[...]
    model.hidden_norm.set_value(jnp.array(norm, dtype=model.hidden_norm[...].dtype, copy=True))


def _ckpt_manager(out: Path):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(
        (out / "checkpoints").absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    )


def train(
    tcfg: TargetConfig,
    embed: jax.Array,
    lm_head: jax.Array,
    data: ShardData,
    tc: TrainConfig,
    out: Path,
    *,
    resume: bool = False,
    stop_at: int | None = None,
    on_log: Callable[[dict], None] | None = None,
    final_norm=None,
    target=None,
) -> tuple[DrafterModel, list[dict]]:
    """Train (or resume) up to `tc.steps` (or `stop_at`) steps; checkpoints and a JSON-lines log under `out`."""
    import orbax.checkpoint as ocp

    out.mkdir(parents=True, exist_ok=True)
    (out / "train_config.json").write_text(json.dumps(asdict(tc), indent=1))
    model = init_drafter(tcfg, tc, final_norm, target)
    graphdef, params = nnx.split(model)
    tx = make_optimizer(tc)
    opt_state = tx.init(params)
    start = 0
    mgr = _ckpt_manager(out)
    if resume and mgr.latest_step() is not None:
        start = mgr.latest_step()
        restored = mgr.restore(start, args=ocp.args.StandardRestore({"params": params, "opt_state": opt_state}))
        params, opt_state = restored["params"], restored["opt_state"]
    elif not resume and mgr.latest_step() is not None:
        raise UserError(f"{out} already has checkpoints; pass --resume to continue or choose another --out")
    tgt_kw = {}
    if data.taps is None:
        if target is None:
            raise UserError("tokens-only data (built with --no-store-taps) needs the target to recompute the taps")
        tgt_graphdef, tgt_state = nnx.split(target)
        tgt_kw = {"tgt_state": tgt_state, "tgt_graphdef": tgt_graphdef, "tcfg": tcfg}
    log_f = (out / "log.jsonl").open("a")
    end = min(tc.steps, stop_at if stop_at is not None else tc.steps)
    budget = tc.time_budget > 0
    stop = end  # with a time budget, refitted below from the measured step time
    t0 = t_last = time.perf_counter()
    t_fit, s_fit = None, None  # first logged step after compilation: start of the step-time measurement
    history = []
    step = start
    while step < stop:
        batch = {k: jnp.asarray(v) for k, v in data.batch(step, tc).items()}
        opt_state = set_lr(opt_state, lr_at(tc, step, stop if budget else None))
        params, opt_state, m = train_step(graphdef, params, opt_state, embed, lm_head, batch, tc=tc, tx=tx, **tgt_kw)
        step += 1
        if step % tc.log_every == 0 or step == stop:
            rec = {k: float(v) for k, v in m.items()}
            now = time.perf_counter()
            rec.update(
                step=step, s_per_step=(now - t_last) / tc.log_every, lr=lr_at(tc, step - 1, stop if budget else None)
            )
            t_last = now
            if budget:
                if t_fit is None:
                    t_fit, s_fit = now, step
                elif step - 1 < int(stop * (1.0 - tc.decay_frac)):  # refit until the decay phase starts
                    per_step = (now - t_fit) / (step - s_fit)
                    stop = min(end, step + max(int((tc.time_budget - (now - t0)) / per_step), 1))
                rec["fitted_steps"] = stop
            history.append(rec)
            log_f.write(json.dumps(rec) + "\n")
            log_f.flush()
            if on_log:
                on_log(rec)
        if step % tc.save_every == 0 or step == stop:
            mgr.save(step, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
    mgr.wait_until_finished()
    log_f.close()
    return nnx.merge(graphdef, params), history


def restore_drafter(tcfg: TargetConfig, run_dir: Path, step: int | None = None) -> tuple[DrafterModel, int]:
    """The drafter of a training run's checkpoint (latest unless `step`), without its optimizer state."""
    import orbax.checkpoint as ocp

    tc = TrainConfig(
        **{
            k: tuple(v) if isinstance(v, list) else v
            for k, v in json.loads((run_dir / "train_config.json").read_text()).items()
        }
    )
    model = init_drafter(tcfg, tc)
    graphdef, params = nnx.split(model)
    mgr = _ckpt_manager(run_dir)
    step = step if step is not None else mgr.latest_step()
    if step is None:
        raise UserError(f"{run_dir} has no checkpoints yet")
    opt_state = make_optimizer(tc).init(params)
    restored = mgr.restore(step, args=ocp.args.StandardRestore({"params": params, "opt_state": opt_state}))
    return nnx.merge(graphdef, restored["params"]), step
