"""How many sequences of given lengths fit in a KV memory budget: dense per-slot caches against the paged pool.

Usage: python benchmarks/kv_capacity.py [--kv-memory 70GB] [--max-model-len 32768] [--gamma 16] [--block-size 16]
       [--lengths 2048,8192,32768] [--json]

The shapes are Qwen3-8B's (36 layers, 8 KV heads, head_dim 128) with a DFlash drafter of 5 layers, 8 KV heads,
head_dim 128 (z-lab/Qwen3-8B-DFlash-b16's layout); `--target-layers`, `--drafter-layers`, `--kv-heads`, `--head-dim`
change them. A sequence of L tokens holds L + gamma + 1 positions (its last verify block), as a dense slot of
max_model_len holds max_model_len + gamma + 1.

* dense: every sequence takes a slot of max_model_len positions whatever its length, and the runner keeps one more
  slot for batch padding: sequences = budget // slot bytes - 1.
* paged: pages of `--block-size` tokens by actual length; the pool's null page is not handed out:
  sequences = (pool_pages(budget) - 1) // pages per sequence.
"""

from __future__ import annotations

import argparse
import json
import types

from dflash_jax.kv.sizing import format_bytes, kv_bytes_per_token, pool_pages
from dflash_jax.server.config import parse_bytes


def capacity_rows(
    budget: int,
    *,
    max_model_len: int,
    gamma: int,
    page_size: int,
    lengths: list[int],
    target_layers: int = 36,
    drafter_layers: int = 5,
    kv_heads: int = 8,
    head_dim: int = 128,
) -> list[dict]:
    """One row per layout: its bytes per token and the sequences of each length that fit in `budget` bytes."""
    target = types.SimpleNamespace(num_layers=target_layers, num_kv_heads=kv_heads, head_dim=head_dim)
    drafter = types.SimpleNamespace(num_layers=drafter_layers, num_kv_heads=kv_heads, head_dim=head_dim)
    rows = []
    for dtype in ("float32", "bfloat16"):
        bpt = kv_bytes_per_token(target, drafter, dtype)
        slot = bpt * (max_model_len + gamma + 1)
        n = max(budget // slot - 1, 0)  # one slot is the batch-padding scratch slot
        rows.append(
            {
                "layout": f"dense {dtype}, slots of max_model_len {max_model_len}",
                "bytes_per_token": bpt,
                "unit_bytes": slot,
                "sequences": {length: n for length in lengths},
            }
        )
    bpt = kv_bytes_per_token(target, drafter, "bfloat16")
    usable = max(pool_pages(budget, bpt, page_size) - 1, 0)  # the null page is never handed out
    rows.append(
        {
            "layout": f"paged bfloat16, pages of {page_size}, by actual length",
            "bytes_per_token": bpt,
            "unit_bytes": bpt * page_size,
            "pages": usable,
            "sequences": {length: usable // -(-(length + gamma + 1) // page_size) for length in lengths},
        }
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv-memory", default="70GB", help="KV memory budget (bytes; units as --kv-cache-memory)")
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--gamma", type=int, default=16, help="verify width (the b16 drafter's block size)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--lengths", default="2048,8192,32768", help="sequence lengths (prompt + output), comma-separated")
    ap.add_argument("--target-layers", type=int, default=36)
    ap.add_argument("--drafter-layers", type=int, default=5)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    a = ap.parse_args()
    budget = parse_bytes(a.kv_memory)
    lengths = [int(x) for x in a.lengths.split(",")]
    rows = capacity_rows(
        budget,
        max_model_len=a.max_model_len,
        gamma=a.gamma,
        page_size=a.block_size,
        lengths=lengths,
        target_layers=a.target_layers,
        drafter_layers=a.drafter_layers,
        kv_heads=a.kv_heads,
        head_dim=a.head_dim,
    )
    if a.json:
        print(json.dumps({"budget_bytes": budget, "gamma": a.gamma, "rows": rows}, indent=1))
        return
    print(f"KV budget {budget} bytes ({format_bytes(budget)}), gamma {a.gamma}")
    print("| layout | bytes per token | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
    print("|---|---|" + "---|" * len(lengths))
    for r in rows:
        print(
            f"| {r['layout']} | {r['bytes_per_token']} | " + " | ".join(str(r["sequences"][n]) for n in lengths) + " |"
        )


if __name__ == "__main__":
    main()
