"""`bench decode`: plain vs speculative decoding on the same prompts in one run.

Both runs go through the serving engine (`engine.offline.OfflineEngine`): the same admission, stops,
detokenization and draft-count controller as `serve`, with at most `batch_size` sequences decoding at once.
Speed is decode speed: generated tokens after the first (which prefill produces) over the wall time without the
prefills. An untimed pass over the same prompts compiles every shape first (under adaptive-k after `serve`'s
warm-up, which compiles every verify width it may choose), so the timed pass measures steady-state
steps; the controller keeps what it learned in the warm-up pass, as one server would. `compile` reports, per run
and pass, the programs compiled and the seconds spent (`dflash_jax.compilation`; the timed pass compiles none when
the warm-up covered every shape).
Greedy runs with a plain pass also report `ngram`: τ and acceptance by position of prompt-lookup drafts at the
same verify width, replayed on the plain outputs (`bench.ngram`; exact for greedy verification).
Greedy runs report `parity`, the prompts whose two outputs are identical, first differ at a near tie of the
target's logits, or otherwise (`bench.parity`), and each divergence in `parity_divergences`.
"""

from __future__ import annotations

import contextlib
import hashlib
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dflash_jax.bench.ngram import HybridRunner, NgramRunner
from dflash_jax.bench.ngram import simulate as ngram_simulate
from dflash_jax.bench.parity import classify
from dflash_jax.bench.prompts import encode_prompts
from dflash_jax.builder import Models, build_runner, offline_context_len
from dflash_jax.compilation import CompileMeter
from dflash_jax.engine.engine import DEFAULT_MAX_NUM_BATCHED_TOKENS
from dflash_jax.engine.offline import OfflineEngine
from dflash_jax.engine.types import accepted_positions
from dflash_jax.spec_decode.runner import SpecRunner
from dflash_jax.types import SamplingParams


@dataclass
class RunResult:
    outputs: list[list[int]]
    decode_tokens: int = 0
    decode_s: float = 0.0
    steps: int = 0
    max_running: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # per verify step per sequence: accepted + 1
    pos_accepted: np.ndarray | None = None
    pos_observed: np.ndarray | None = None
    device_calls: int = 0  # the runner's device calls for decode steps and catch-ups (prefills not counted)


def run_pass(
    llm: OfflineEngine, prompts: list[list[int]], max_tokens: int, sampling: SamplingParams, *, ignore_eos: bool
) -> RunResult:
    """One pass over `prompts` through the engine; τ and per-position acceptance from its step results."""
    runner = llm.engine.runner
    calls0 = _decode_calls(runner)
    outs = llm.generate(prompts, sampling, max_tokens=max_tokens, ignore_eos=ignore_eos)
    st = llm.stats
    g = max(llm.engine.runner.gamma - 1, 1)
    res = RunResult(
        [list(o.token_ids) for o in outs],
        decode_tokens=sum(len(o.token_ids) - 1 for o in outs),  # prefill produces each request's first token
        decode_s=st.decode_s,
        steps=st.steps,
        max_running=st.max_running,
        pos_accepted=np.zeros(g),
        pos_observed=np.zeros(g),
        device_calls=_decode_calls(runner) - calls0,
    )
    for r in st.spec_results:
        res.accept_lengths.append(r.num_accepted + 1)
        res.pos_observed[: r.num_drafts] += 1
        for i in accepted_positions(r):
            res.pos_accepted[i] += 1
    return res


def _decode_calls(runner) -> int:
    return runner.device_calls["step"] + runner.device_calls["catch_up"]


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


DRAFT_RUNNERS = {"dflash": SpecRunner, "ngram": NgramRunner, "hybrid": HybridRunner}


def bench_decode(
    models: Models,
    prompts_raw: list[dict],
    *,
    batch_size: int,
    max_tokens: int,
    gamma: int | None = None,
    make_controller: Callable[[], object] | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    ignore_eos: bool = False,
    plain: bool = True,
    draft_model_id: str = "",
    log=print,
    quant: str = "declared",
    runner_kwargs: dict | None = None,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    deterministic: bool = False,
    draft_method: str = "dflash",
) -> dict:
    """Plain (if `plain`) then speculative (if `models` has a drafter) passes; the figures as a dict.

    make_controller: builds the draft-count controller of the speculative run (its γ sets the verify width);
    without it the runner verifies `gamma` (default: the drafter's block) every step. `deterministic`: both runs
    in the runner's deterministic mode, the plain one at the speculative run's verify width. `draft_method`
    "ngram": the speculative run verifies prompt-lookup drafts (`bench.ngram.NgramRunner`) instead of the drafter's;
    "hybrid": prompt-lookup drafts where the context's last tokens recur, the drafter's elsewhere
    (`bench.ngram.HybridRunner`).

    Greedy runs with both passes report `parity`: per prompt, whether the two outputs are identical, differ first
    at a near tie of the target's logits, or otherwise (`bench.parity`), with each divergence in
    `parity_divergences`."""
    lt, drafter = models.target, models.drafter
    tok = lt.tokenizer
    prompts = encode_prompts(tok, prompts_raw)
    max_len = offline_context_len(models, max(len(p) for p in prompts), max_tokens)
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
        "deterministic": deterministic,
        "draft_method": draft_method,
    }
    plain_gamma = gamma  # a deterministic plain run verifies at the speculative run's width
    if deterministic and drafter is not None:
        plain_gamma = (make_controller().gamma if make_controller is not None else gamma) or drafter.cfg.block_size

    def timed_run(speculative: bool):
        ctl = make_controller() if (make_controller is not None and speculative) else None
        m = models if speculative else models._replace(drafter=None, draft_lm_head=None)
        runner = build_runner(
            m,
            runner_cls=DRAFT_RUNNERS[draft_method] if speculative else SpecRunner,
            max_slots=batch_size,
            max_model_len=max_len,
            gamma=ctl.gamma if ctl is not None else (gamma if speculative else plain_gamma),
            deterministic=deterministic,
            **(runner_kwargs or {}),
        )
        if ctl is not None:
            result["control_mode"] = ctl.mode
        name = "spec" if speculative else "plain"
        log(f"warm-up ({name}) ...")
        with contextlib.ExitStack() as stack:
            with CompileMeter() as warm:
                if ctl is not None and ctl.mode == "adaptive-k":  # its choices differ between passes: every verify
                    runner.warmup()  # width it may choose, compiled as `serve` compiles them
                llm = stack.enter_context(
                    OfflineEngine(
                        runner,
                        tok,
                        max_num_seqs=batch_size,
                        max_num_batched_tokens=max_num_batched_tokens,
                        controller=ctl,
                    )
                )
                run_pass(llm, prompts, max_tokens, sp, ignore_eos=ignore_eos)
            runner.timing = True
            log(f"timed pass ... (warm-up: {warm.summary()})")
            with CompileMeter() as timed:
                res = run_pass(llm, prompts, max_tokens, sp, ignore_eos=ignore_eos)
            result.setdefault("compile", {})[name] = {"warmup": warm.as_dict(), "timed": timed.as_dict()}
            return runner, res

    if plain:
        pr, plain_res = timed_run(False)
        result["plain_tokens_per_s"] = plain_res.decode_tokens / plain_res.decode_s
        result["t_decode_ms"] = float(np.mean(pr.times.plain_ms))
        result["plain_steps"] = plain_res.steps
        result["plain_outputs_sha256"] = _sha(plain_res.outputs)
    if drafter is not None:
        sr, spec_res = timed_run(True)
        result["gamma"] = sr.gamma
        result["spec_tokens_per_s"] = spec_res.decode_tokens / spec_res.decode_s
        times = sr.times
        result["t_spec_step_ms"] = float(np.mean(times.spec_ms)) if times.spec_ms else None
        result["t_plain_step_ms"] = float(np.mean(times.plain_ms)) if times.plain_ms else None
        result["spec_steps"] = spec_res.steps
        result["speculative_steps"] = len(times.spec_ms)
        result["device_calls_per_step"] = spec_res.device_calls / max(spec_res.steps, 1)
        result["max_running"] = spec_res.max_running
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
            if temperature == 0:
                result["ngram"] = ngram_simulate(prompts, plain_res.outputs, sr.gamma)
                ends = tuple(sorted(tok.eos_token_ids))
                counts, divs = classify(lt.model, prompts, spec_res.outputs, plain_res.outputs, ends)
                result["parity"] = counts
                result["parity_divergences"] = [d.to_json() for d in divs]
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
