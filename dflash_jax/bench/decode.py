"""`bench decode` / `bench plain`: plain vs speculative decoding on the same prompts in one run.

Speed is decode speed: generated tokens after the first (which prefill produces) over the decode wall time.
Every shape is compiled by a warm-up pass first, so the timed pass measures steady-state steps.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dflash_jax.spec_decode.runner import SpecRunner
from dflash_jax.types import SamplingParams

BUILTIN_PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts" / "heldout.jsonl"
FALLBACK_PROMPTS = [
    {"messages": [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]},
    {"messages": [{"role": "user", "content": "Describe how a refrigerator keeps food cold."}]},
    {"messages": [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}]},
    {"messages": [{"role": "user", "content": "What are the benefits of learning a second language?"}]},
]


def load_prompt_file(path: Path | None) -> list[dict]:
    from dflash_jax.errors import UserError

    if path is None:
        if BUILTIN_PROMPTS.exists():
            path = BUILTIN_PROMPTS
        else:
            return FALLBACK_PROMPTS
    if not Path(path).exists():
        raise UserError(f"--prompts: file {str(path)!r} does not exist", param="--prompts")
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"--prompts: line {i} is not valid JSON ({e.msg})", param="--prompts") from None
        if not isinstance(obj, dict) or ("prompt" in obj) == ("messages" in obj):
            raise UserError(f'--prompts: line {i} needs exactly one of "prompt" or "messages"', param="--prompts")
        out.append(obj)
    if not out:
        raise UserError(f"--prompts: {path} has no prompts", param="--prompts")
    return out


def encode_prompts(tok, prompts: list[dict]) -> list[list[int]]:
    return [tok.encode_chat(p["messages"]) if "messages" in p else tok.encode(p["prompt"]) for p in prompts]


@dataclass
class RunResult:
    outputs: list[list[int]]
    decode_tokens: int = 0
    decode_s: float = 0.0
    steps: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # per verify step per sequence: accepted + 1
    pos_accepted: np.ndarray | None = None
    pos_observed: np.ndarray | None = None


def run_batches(
    runner: SpecRunner,
    prompts: list[list[int]],
    batch_size: int,
    max_tokens: int,
    stop_ids: set[int],
    sampling: SamplingParams,
) -> RunResult:
    g = max(runner.gamma - 1, 1)
    res = RunResult([[] for _ in prompts], pos_accepted=np.zeros(g), pos_observed=np.zeros(g))
    for b0 in range(0, len(prompts), batch_size):
        idx = list(range(b0, min(b0 + batch_size, len(prompts))))
        first = runner.add_many([(j, prompts[i], sampling) for j, i in enumerate(idx)])
        live = {}
        for j, i in enumerate(idx):
            res.outputs[i].extend(first[j].tokens)
            if not (first[j].tokens[-1] in stop_ids or len(res.outputs[i]) >= max_tokens):
                live[j] = i
            else:
                runner.release(j)
        t0 = time.perf_counter()
        while live:
            out = runner.step(list(live), {j: max_tokens - len(res.outputs[i]) for j, i in live.items()})
            res.steps += 1
            for j, r in out.items():
                i = live[j]
                before = len(res.outputs[i])
                for t in r.tokens:
                    res.outputs[i].append(t)
                    if t in stop_ids or len(res.outputs[i]) >= max_tokens:
                        break
                res.decode_tokens += len(res.outputs[i]) - before
                if r.num_drafts:
                    res.accept_lengths.append(r.num_accepted + 1)
                    res.pos_observed[: r.num_drafts] += 1
                    res.pos_accepted[: r.num_accepted] += 1
                if res.outputs[i][-1] in stop_ids or len(res.outputs[i]) >= max_tokens:
                    runner.release(j)
                    del live[j]
        res.decode_s += time.perf_counter() - t0
    return res


def machine_info() -> dict:
    import os

    import jax

    return {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()][:8],
    }


def bench_decode(
    lt,
    drafter,
    prompts_raw: list[dict],
    *,
    batch_size: int,
    max_tokens: int,
    gamma: int | None = None,
    make_controller=None,
    temperature: float = 0.0,
    seed: int = 0,
    ignore_eos: bool = False,
    plain: bool = True,
    draft_model_id: str = "",
    log=print,
    draft_lm_head=None,
    quant: str = "declared",
    runner_kwargs: dict | None = None,
) -> dict:
    tok = lt.tokenizer
    prompts = encode_prompts(tok, prompts_raw)
    max_len = max(len(p) for p in prompts) + max_tokens + 8
    stop = set() if ignore_eos else set(tok.eos_token_ids)
    sp = SamplingParams(temperature=temperature, seed=seed)
    result: dict = {
        "model": lt.model_id,
        "draft_model": draft_model_id,
        "draft_weight_quantization": quant,
        "batch_size": batch_size,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "num_prompts": len(prompts),
        "machine": machine_info(),
    }

    def timed_run(dm):
        ctl = make_controller() if (make_controller is not None and dm is not None) else None
        r = SpecRunner(
            lt.model,
            dm,
            max_slots=batch_size,
            max_model_len=max_len,
            gamma=ctl.gamma if ctl is not None else gamma,
            draft_lm_head=draft_lm_head if dm is not None else None,
            controller=ctl,
            **(runner_kwargs or {}),
        )
        if ctl is not None:
            result["control_mode"] = ctl.mode
        log(f"warm-up ({'spec' if dm is not None else 'plain'}) ...")
        # an untimed pass over the same prompts compiles every (batch, width, length-bucket) shape the timed pass
        # meets (a first-batch-only warm-up left first-use compiles of 1-3 s inside the timed steps)
        run_batches(r, prompts, batch_size, max_tokens, stop, sp)
        r.timing = True
        log("timed pass ...")
        rr = run_batches(r, prompts, batch_size, max_tokens, stop, sp)
        return r, rr

    if plain:
        pr, plain_res = timed_run(None)
        result["plain_tokens_per_s"] = plain_res.decode_tokens / plain_res.decode_s
        result["t_decode_ms"] = float(np.mean(pr.times.verify_ms))
        result["plain_outputs_sha256"] = _sha(plain_res.outputs)
    if drafter is not None:
        sr, spec_res = timed_run(drafter)
        result["gamma"] = sr.gamma
        result["spec_tokens_per_s"] = spec_res.decode_tokens / spec_res.decode_s
        result["t_verify_ms"] = float(np.mean(sr.times.verify_ms))
        result["t_draft_ms"] = float(np.mean(sr.times.draft_ms))
        al = np.array(spec_res.accept_lengths)
        result["tau_mean"] = float(al.mean()) if al.size else 1.0
        result["tau_histogram"] = {str(k): int((al == k).sum()) for k in range(1, sr.gamma + 1)}
        obs = spec_res.pos_observed
        pairs = zip(spec_res.pos_accepted, obs, strict=True)
        result["acceptance_by_position"] = [float(a / o) if o else None for a, o in pairs]
        result["outputs_sha256"] = _sha(spec_res.outputs)
        if plain:
            result["speedup"] = result["spec_tokens_per_s"] / result["plain_tokens_per_s"]
            result["outputs_identical"] = spec_res.outputs == plain_res.outputs
            if not result["outputs_identical"] and temperature == 0:
                for i, (a, b) in enumerate(zip(spec_res.outputs, plain_res.outputs, strict=True)):
                    if a != b:
                        result["first_mismatch"] = {"prompt": i, "spec": a[:64], "plain": b[:64]}
                        break
        result["generated_tokens"] = sum(len(o) for o in spec_res.outputs)
    else:
        result["outputs_sha256"] = result.get("plain_outputs_sha256")
        result["generated_tokens"] = sum(len(o) for o in plain_res.outputs)
    return result


def _sha(outputs: list[list[int]]) -> str:
    h = hashlib.sha256()
    for o in outputs:
        h.update(np.asarray(o, np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()


def plot_acceptance(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = [a if a is not None else 0 for a in result.get("acceptance_by_position", [])]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(range(1, len(acc) + 1), acc, color="#4477aa")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_title(
        f"τ = {result.get('tau_mean', 0):.2f}, speedup {result.get('speedup', 0):.2f}x "
        f"(γ={result.get('gamma')}, batch {result['batch_size']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
