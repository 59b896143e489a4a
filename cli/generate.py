"""`dflash-jax generate`: one prompt, streamed to the terminal (plain or DFlash speculative decoding)."""

from __future__ import annotations

import sys

import typer

from dflash_jax.cli._common import DETERMINISTIC_HELP, eprint, run_or_exit


def generate(
    model: str = typer.Option(
        "default", "--model", help="Target: HF directory, Hub repo id, .gguf file, or 'default'."
    ),
    prompt: str | None = typer.Option(None, "--prompt", help="Raw text prompt."),
    chat: str | None = typer.Option(None, "--chat", help="A user message, rendered with the chat template."),
    draft_model: str | None = typer.Option(
        None,
        "--draft-model",
        help="DFlash drafter dir or Hub repo id, 'default', or 'random[:LAYERS]'. Unset: plain decoding.",
    ),
    max_tokens: int = typer.Option(128, "--max-tokens", min=1),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0),
    top_k: int = typer.Option(0, "--top-k", min=0),
    seed: int = typer.Option(0, "--seed"),
    dflash_gamma: int | None = typer.Option(None, "--dflash-gamma", min=2, help="Verify width (drafts + 1)."),
    dtype: str = typer.Option(
        "auto",
        "--dtype",
        help="auto|bfloat16|float16|float32: weights, activations, KV caches (auto: bf16 on GPU, f32 on CPU).",
    ),
    ignore_eos: bool = typer.Option(False, "--ignore-eos"),
    dflash_adaptive_k: str | None = typer.Option(
        None, "--dflash-adaptive-k", help="Adaptive draft count from a step-cost table 'drafts:ms,...'."
    ),
    dflash_draft_ladder: str | None = typer.Option(
        None, "--dflash-draft-ladder", help="Draft count by active sequences 'min_active:drafts,...'."
    ),
    draft_weight_quantization: str = typer.Option(
        "declared", "--draft-weight-quantization", help="Drafter weights: declared|fp8|fp8-aux|nvfp4."
    ),
    deterministic: bool = typer.Option(False, "--deterministic", help=DETERMINISTIC_HELP),
) -> None:
    """Generate a completion for one prompt and stream it to stdout."""
    if (prompt is None) == (chat is None):
        raise typer.BadParameter("give exactly one of --prompt or --chat", param_hint="--prompt/--chat")
    if top_p <= 0.0:
        raise typer.BadParameter("must be in (0, 1]", param_hint="--top-p")

    def body():
        from dflash_jax.builder import build_offline_engine, load_models, offline_context_len, resolve_dtype
        from dflash_jax.types import SamplingParams

        models = load_models(model, draft_model, resolve_dtype(dtype), draft_weight_quantization)
        tok = models.target.tokenizer
        ids = tok.encode_chat([{"role": "user", "content": chat}]) if chat is not None else tok.encode(prompt)
        llm = build_offline_engine(
            models,
            max_num_seqs=1,
            max_model_len=offline_context_len(models, len(ids), max_tokens),
            gamma=dflash_gamma,
            adaptive_k=dflash_adaptive_k,
            draft_ladder=dflash_draft_ladder,
            deterministic=deterministic,
        )

        def show(_: int, out) -> None:
            sys.stdout.write(out.text)
            sys.stdout.flush()

        with llm:
            llm.generate(
                [ids],
                SamplingParams(temperature, top_p, top_k, seed),
                max_tokens=max_tokens,
                ignore_eos=ignore_eos,
                on_output=show,
            )
        sys.stdout.write("\n")
        eprint(_summary(llm.stats.records[0], speculative=models.drafter is not None))

    run_or_exit(body)


def _summary(rec, *, speculative: bool) -> str:
    """One line of figures for a finished request (`engine.types.RequestRecord`)."""
    n = rec.num_completion_tokens
    ttft = rec.ttft or 0.0
    rate = 1.0 / rec.tpot if rec.tpot else 0.0
    msg = f"[{n} tokens, {rate:.1f} tok/s after the first, TTFT {ttft * 1e3:.0f} ms"
    if speculative:
        spec = rec.spec
        tau = spec.mean_acceptance_length or 1.0
        msg += f", τ {tau:.2f} (accepted {spec.num_accepted_tokens}/{spec.num_draft_tokens} drafts)"
    return msg + "]"
