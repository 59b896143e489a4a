"""`dflash-jax generate`: one prompt, streamed to the terminal (plain or DFlash speculative decoding)."""

from __future__ import annotations

import sys

import typer

from dflash_jax.cli._common import eprint, run_or_exit


def generate(
    model: str = typer.Option("default", "--model", help="Target: HF directory, .gguf file, or 'default'."),
    prompt: str | None = typer.Option(None, "--prompt", help="Raw text prompt."),
    chat: str | None = typer.Option(None, "--chat", help="A user message, rendered with the chat template."),
    draft_model: str | None = typer.Option(
        None, "--draft-model", help="DFlash drafter dir, 'default', or 'random[:LAYERS]'. Unset: plain decoding."
    ),
    max_tokens: int = typer.Option(128, "--max-tokens", min=1),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0),
    top_k: int = typer.Option(0, "--top-k", min=0),
    seed: int = typer.Option(0, "--seed"),
    dflash_gamma: int | None = typer.Option(None, "--dflash-gamma", min=2, help="Verify width (drafts + 1)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto|float32|bfloat16 (auto: f32 on CPU, bf16 on GPU)."),
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
) -> None:
    """Generate a completion for one prompt and stream it to stdout."""
    if (prompt is None) == (chat is None):
        raise typer.BadParameter("give exactly one of --prompt or --chat", param_hint="--prompt/--chat")
    if top_p <= 0.0:
        raise typer.BadParameter("must be in (0, 1]", param_hint="--top-p")

    def body():
        from dflash_jax.builder import build_runner, load_models, make_controller, resolve_dtype
        from dflash_jax.generate import IncrementalDetokenizer, generate_one
        from dflash_jax.types import SamplingParams

        models = load_models(model, draft_model, resolve_dtype(dtype), draft_weight_quantization)
        lt, drafter = models.target, models.drafter
        tok = lt.tokenizer
        ids = tok.encode_chat([{"role": "user", "content": chat}]) if chat is not None else tok.encode(prompt)
        ctl = make_controller(
            drafter, gamma=dflash_gamma, adaptive_k=dflash_adaptive_k, draft_ladder=dflash_draft_ladder
        )
        runner = build_runner(
            models,
            max_slots=1,
            max_model_len=min(len(ids) + max_tokens + 8, 8192),
            gamma=ctl.gamma if ctl else None,
            controller=ctl,
        )
        detok = IncrementalDetokenizer(tok.decode)
        stop = set() if ignore_eos else tok.eos_token_ids

        def show(new):
            sys.stdout.write(detok.push([t for t in new if t not in stop]))
            sys.stdout.flush()

        st = generate_one(runner, ids, SamplingParams(temperature, top_p, top_k, seed), max_tokens, stop, show)
        sys.stdout.write("\n")
        rate = (len(st.tokens) - 1) / max(st.seconds - st.ttft_s, 1e-9)
        msg = f"[{len(st.tokens)} tokens, {rate:.1f} tok/s after the first, TTFT {st.ttft_s * 1e3:.0f} ms"
        if drafter is not None:
            msg += f", τ {st.tau:.2f} (accepted {st.accepted}/{st.drafts} drafts)"
        eprint(msg + "]")

    run_or_exit(body)
