"""Constrained decoding on the CPU: acceptance with and without a grammar, and tok/s with a JSON schema vs without on
outputs of the same length, all in one run. The default model (SmolLM2-135M + its DFlash drafter) on the JSON
prompts of the `structured` set, greedy.

Usage: python benchmarks/grammar_cpu.py [--prompts 4] [--max-tokens 96] [--gamma 8] [--rounds 2] [--json-out FILE]

Two parts:
  * `acceptance`: speculative, free and under `json_object` (any JSON object), each output ending where the model
    (or the grammar) ends it: τ (tokens per speculative step: 1 + accepted / steps), the draft acceptance rate,
    decode tok/s, how many outputs parse as JSON, and under the grammar the host's grammar time per step (masks and
    drafts chosen under the grammar, `spec_decode.draft_choice`; and the part of it done while the drafter's
    proposal ran on the device). The outputs differ in length, so their tok/s do not compare.
  * `same_length`: plain and speculative decoding, free vs under a JSON schema (`SAME_LENGTH_SCHEMA`: an array of
    at least `max_tokens // 2` objects, which no output finishes within `max_tokens`), every request run to exactly
    `max_tokens` tokens (`ignore_eos`: the free output does not stop at end-of-sequence either). The modes alternate
    for `--rounds` rounds (the median is reported), so a load change on a shared machine hits both; per mode: decode
    tok/s, ms per engine step and per token, τ, and the schema's tok/s as a fraction of the free tok/s (plain: the
    grammar's cost per token; speculative: also its effect on τ).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace

from dflash_jax.bench.prompts import load_category
from dflash_jax.builder import Models, build_offline_engine, load_models
from dflash_jax.engine.grammar import grammar_from
from dflash_jax.types import SamplingParams


def same_length_schema(max_tokens: int) -> dict:
    """A schema no output completes within `max_tokens` tokens: an array of at least max_tokens // 2 objects (each
    at least `{"name":"","age":0}`, several tokens)."""
    person = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 32}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {"people": {"type": "array", "items": person, "minItems": max(max_tokens // 2, 1)}},
        "required": ["people"],
        "additionalProperties": False,
    }


def _json_prompts(n: int) -> list[dict]:
    rows = load_category("structured")
    rows = [r for r in rows if "JSON" in json.dumps(r)]
    return rows[:n]


def _spec_figures(st) -> dict:
    steps = len(st.spec_results)
    drafts = sum(r.num_drafts for r in st.spec_results)
    accepted = sum(r.num_accepted for r in st.spec_results)
    return {
        "tau": round(1 + accepted / steps, 3) if steps else None,
        "acceptance_rate": round(accepted / drafts, 3) if drafts else None,
    }


def _grammar_figures(times) -> dict:
    if not times.grammar_ms:
        return {}
    return {
        "grammar_host_ms_per_step": round(sum(times.grammar_ms) / len(times.grammar_ms), 3),
        "grammar_overlapped_ms_per_step": round(sum(times.grammar_overlapped_ms) / len(times.grammar_overlapped_ms), 3),
    }


def acceptance(llm, prompts, max_tokens: int) -> dict:
    times = llm.engine.runner.times
    greedy = SamplingParams()
    modes = {"free": greedy, "json_object": replace(greedy, grammar=grammar_from("json_object", None))}
    report = {}
    llm.generate(prompts[:1], greedy, max_tokens=8)  # compile the free programs
    llm.generate(prompts[:1], modes["json_object"], max_tokens=8)  # and the constrained ones
    for name, sp in modes.items():
        times.grammar_ms.clear()
        times.grammar_overlapped_ms.clear()
        outs = llm.generate(prompts, sp, max_tokens=max_tokens)
        st = llm.stats
        tokens = sum(len(o.token_ids) for o in outs)
        parsed = 0
        for o in outs:
            try:
                json.loads(o.text)
                parsed += 1
            except ValueError:
                pass
        report[name] = {
            **_spec_figures(st),
            "decode_tok_s": round(tokens / st.decode_s, 2) if st.decode_s else None,
            "tokens": tokens,
            "json_outputs": f"{parsed}/{len(outs)}",
            **_grammar_figures(times),
        }
        print("acceptance", name, report[name], flush=True)
    return report


def same_length(llms: dict, prompts, max_tokens: int, rounds: int) -> dict:
    """(engine name -> mode -> figures): every output exactly `max_tokens` tokens, free vs under the schema."""
    schema = grammar_from("json_schema", same_length_schema(max_tokens))
    modes = {"free": SamplingParams(), "json_schema": SamplingParams(grammar=schema)}
    report: dict = {}
    for engine, llm in llms.items():
        times = llm.engine.runner.times
        longest = max(prompts, key=len)
        for sp in modes.values():  # compile both modes' programs, up to the longest context the rounds reach
            llm.generate([longest], sp, max_tokens=max_tokens, ignore_eos=True)
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for _ in range(rounds):
            for name, sp in modes.items():
                times.grammar_ms.clear()
                times.grammar_overlapped_ms.clear()
                outs = llm.generate(prompts, sp, max_tokens=max_tokens, ignore_eos=True)
                st = llm.stats
                lengths = {len(o.token_ids) for o in outs}
                assert lengths == {max_tokens}, f"{engine} {name}: output lengths {sorted(lengths)}"
                tokens = max_tokens * len(outs)
                runs[name].append(
                    {
                        "decode_tok_s": tokens / st.decode_s,
                        "ms_per_step": 1e3 * st.step_s / st.steps,
                        "ms_per_token": 1e3 * st.decode_s / tokens,
                        "steps": st.steps,
                        **(_spec_figures(st) if engine == "spec" else {}),
                        **_grammar_figures(times),
                    }
                )
                print("same_length", engine, name, {k: round(v, 3) for k, v in runs[name][-1].items()}, flush=True)
        out = {}
        for name, rs in runs.items():
            out[name] = {
                k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0] if isinstance(rs[0][k], (int, float))
            }
            out[name]["decode_tok_s_rounds"] = [round(r["decode_tok_s"], 2) for r in rs]
        out["schema_over_free_tok_s"] = round(out["json_schema"]["decode_tok_s"] / out["free"]["decode_tok_s"], 3)
        report[engine] = out
        print("same_length", engine, out, flush=True)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--gamma", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="same-length rounds (modes alternate; median reported)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    models = load_models("default", "default")
    tok = models.target.tokenizer
    prompts = [tok.encode_chat(r["messages"]) for r in _json_prompts(args.prompts)]
    kw = dict(max_num_seqs=1, max_model_len=1024, timing=True)
    spec = build_offline_engine(models, gamma=args.gamma, **kw)
    plain = build_offline_engine(Models(models.target, None, None), **kw)
    with spec, plain:
        report = {
            "acceptance": acceptance(spec, prompts, args.max_tokens),
            "same_length": same_length({"plain": plain, "spec": spec}, prompts, args.max_tokens, args.rounds),
        }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                {
                    "prompts": len(prompts),
                    "max_tokens": args.max_tokens,
                    "gamma": args.gamma,
                    "rounds": args.rounds,
                    "same_length_schema": same_length_schema(args.max_tokens),
                    **report,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
