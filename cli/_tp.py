"""`--tp-size`, `--draft-tp-size` and the multi-host flags -> keyword arguments for `SpecRunner` / `build_runner`.

    kw = parallel_kwargs(tp_size, draft_tp_size, target_cfg=lt.cfg,
                         coordinator_address=..., num_processes=..., process_id=...)
    runner = build_runner(models, max_slots=..., max_model_len=..., **kw)

Call it before anything touches a device (multi-host initializes the JAX runtime). `--draft-tp-size` is resolved
against the drafter by the runner (`auto` = the world size; 1 or the world size; KV heads must divide).
"""

from __future__ import annotations

from typing import Any

from dflash_jax.errors import UserError


def parallel_kwargs(
    tp_size: int = 1,
    draft_tp_size: str | int | None = "auto",
    *,
    target_cfg: Any = None,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> dict[str, Any]:
    """`{}` for a single-device run, else `{"mesh": Mesh, "draft_tp": value}`. UserError for a bad flag."""
    import jax

    from dflash_jax.parallel.distributed import init_distributed
    from dflash_jax.parallel.drafter_tp import resolve_draft_tp
    from dflash_jax.parallel.mesh import make_mesh

    multi = init_distributed(coordinator_address, num_processes, process_id)
    if multi and tp_size != jax.device_count():
        raise UserError(
            f"--tp-size {tp_size}: with --num-processes {num_processes} the mesh must span all "
            f"{jax.device_count()} devices of all processes; use --tp-size {jax.device_count()}",
            param="--tp-size",
        )
    heads = {} if target_cfg is None else {"num_heads": target_cfg.num_heads, "num_kv_heads": target_cfg.num_kv_heads}
    mesh = make_mesh(tp_size, **heads)
    if tp_size == 1 and not multi:
        resolve_draft_tp(draft_tp_size, 1, None)  # refuses e.g. --draft-tp-size 2 on a one-device run
        return {}
    return {"mesh": mesh, "draft_tp": draft_tp_size}
