"""Acceptance with and without a grammar: the default model (SmolLM2-135M + its DFlash drafter) on the JSON prompts of
the `structured` set, greedy, free and under `json_object` (any JSON object), speculative.

Usage: python benchmarks/grammar_cpu.py [--prompts 4] [--max-tokens 96] [--gamma 8] [--json-out FILE]

Per mode: τ (tokens per speculative step: 1 + accepted / steps), the draft acceptance rate, decode tok/s, how many
outputs parse as JSON, and under the grammar the host's grammar time per step (masks and drafts chosen under the
grammar, `spec_decode.draft_choice`; and the part of it done while the drafter's proposal ran on the device). The
drafts are chosen under the grammar (the drafter's best allowed candidate at each position), so a draft never
spends a verify row on a token the grammar forbids; the output under the grammar is the plain constrained greedy
output either way.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from dflash_jax.bench.prompts import load_category
from dflash_jax.builder import build_offline_engine, load_models
from dflash_jax.engine.grammar import grammar_from
from dflash_jax.types import SamplingParams


def _json_prompts(n: int) -> list[dict]:
    rows = load_category("structured")
    rows = [r for r in rows if "JSON" in json.dumps(r)]
    return rows[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--gamma", type=int, default=8)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    models = load_models("default", "default")
    tok = models.target.tokenizer
    prompts = [tok.encode_chat(r["messages"]) for r in _json_prompts(args.prompts)]
    llm = build_offline_engine(models, max_num_seqs=1, max_model_len=1024, gamma=args.gamma, timing=True)
    times = llm.engine.runner.times
    greedy = SamplingParams()
    modes = {"free": greedy, "json_object": replace(greedy, grammar=grammar_from("json_object", None))}
    report = {}
    with llm:
        llm.generate(prompts[:1], greedy, max_tokens=8)  # compile the free programs
        llm.generate(prompts[:1], modes["json_object"], max_tokens=8)  # and the constrained ones
        for name, sp in modes.items():
            times.grammar_ms.clear()
            times.grammar_overlapped_ms.clear()
            outs = llm.generate(prompts, sp, max_tokens=args.max_tokens)
            st = llm.stats
            steps = len(st.spec_results)
            drafts = sum(r.num_drafts for r in st.spec_results)
            accepted = sum(r.num_accepted for r in st.spec_results)
            tokens = sum(len(o.token_ids) for o in outs)
            parsed = 0
            for o in outs:
                try:
                    json.loads(o.text)
                    parsed += 1
                except ValueError:
                    pass
            report[name] = {
                "tau": round(1 + accepted / steps, 3) if steps else None,
                "acceptance_rate": round(accepted / drafts, 3) if drafts else None,
                "decode_tok_s": round(tokens / st.decode_s, 2) if st.decode_s else None,
                "tokens": tokens,
                "json_outputs": f"{parsed}/{len(outs)}",
            }
            if times.grammar_ms:
                report[name]["grammar_host_ms_per_step"] = round(sum(times.grammar_ms) / len(times.grammar_ms), 3)
                report[name]["grammar_overlapped_ms_per_step"] = round(
                    sum(times.grammar_overlapped_ms) / len(times.grammar_overlapped_ms), 3
                )
            print(name, report[name], flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                {"prompts": len(prompts), "max_tokens": args.max_tokens, "gamma": args.gamma, **report}, f, indent=1
            )


if __name__ == "__main__":
    main()
