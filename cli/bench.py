"""`dflash-jax bench decode|plain|kernels|serve`."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from dflash_jax.cli import bench_kernels
from dflash_jax.cli._common import DENSE_LAYOUT_HELP, DETERMINISTIC_HELP, eprint, run_or_exit

app = typer.Typer(help="Benchmarks: decode (spec vs plain), plain, kernels, serve.", no_args_is_help=True)
app.command("kernels")(bench_kernels.kernels)
console = Console()
DTYPE_HELP = "auto|bfloat16|float16|float32: weights, activations, KV caches (auto: bf16 on GPU, f32 on CPU)."


def _write_json(path: Path | None, result: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")


def _print_decode(r: dict) -> None:
    t = Table(title=f"bench decode: {r['model']} + {r.get('draft_model') or 'no drafter'}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k in (
        "dtype",
        "batch_size",
        "gamma",
        "num_prompts",
        "generated_tokens",
        "plain_tokens_per_s",
        "spec_tokens_per_s",
        "speedup",
        "tau_mean",
        "t_decode_ms",
        "t_spec_step_ms",
        "t_plain_step_ms",
        "speculative_steps",
        "device_calls_per_step",
        "outputs_identical",
        "deterministic",
        "parity",
    ):
        if k in r:
            v = r[k]
            t.add_row(k, f"{v:.3f}" if isinstance(v, float) else str(v))
    if r.get("acceptance_by_position"):
        t.add_row(
            "acceptance_by_position",
            " ".join(f"{a:.2f}" if a is not None else "-" for a in r["acceptance_by_position"]),
        )
    console.print(t)


_CATEGORY_KEYS = ("gamma", "tau_mean", "acceptance_by_position", "speedup", "spec_tokens_per_s", "outputs_identical")
# what else the adaptive-k run of a category keeps: its steps, their mean times and its compilations
_ADAPTIVE_KEYS = ("control_mode", "spec_steps", "speculative_steps", "t_spec_step_ms", "t_plain_step_ms", "compile")


def _acc(a: list | None, n: int = 7) -> str:
    return " ".join(f"{x:.2f}" if x is not None else "-" for x in (a or [])[:n])


# What a `bench decode` run's drafts came from, by its --draft-method.
DRAFTS_FROM = {"dflash": "drafter", "ngram": "n-gram (measured)", "hybrid": "n-gram 4..2, else drafter"}


def _print_category(name: str, r: dict) -> None:
    """One category: the drafter at fixed γ, under adaptive-k (when run) and n-gram drafting, side by side."""
    t = Table(title=f"{name}: {r['num_prompts']} prompts, {r['max_tokens']} tokens, batch {r['batch_size']}")
    for c in ("drafts from", "γ", "τ", "acceptance by position", "speedup", "identical"):
        t.add_column(c, justify="left" if c in ("drafts from", "acceptance by position") else "right")

    def row(label: str, gamma: str, d: dict, speedup: str) -> None:
        tau, acc = f"{d['tau_mean']:.2f}", _acc(d.get("acceptance_by_position"))
        t.add_row(label, gamma, tau, acc, speedup, str(d.get("outputs_identical")))

    source = DRAFTS_FROM[r.get("draft_method", "dflash")]
    row(f"{source}, fixed γ", str(r.get("gamma")), r, f"{r['speedup']:.2f}x")
    if "adaptive_k" in r:
        a = r["adaptive_k"]
        row(f"{source}, adaptive-k", f"<= {a.get('gamma')}", a, f"{a['speedup']:.2f}x")
    if "ngram" in r:
        g = r["ngram"]
        row(f"n-gram ({g['min_n']}..{g['max_n']}), replayed", str(g["gamma"]), g, "-")
    console.print(t)


def _print_categories(out: dict) -> None:
    t = Table(title="bench decode by category (τ: tokens per verify step; speedup vs plain in the same run)")
    method = next(iter(out.values()), {}).get("draft_method", "dflash")
    tau = "τ drafter" if method == "dflash" else f"τ {DRAFTS_FROM[method]}"
    for c in ("category", "prompts", tau, "τ n-gram", "speedup fixed γ", "speedup adaptive-k", "plain tok/s"):
        t.add_column(c, justify="left" if c == "category" else "right")
    for name, r in out.items():
        a = r.get("adaptive_k")
        t.add_row(
            name,
            str(r["num_prompts"]),
            f"{r['tau_mean']:.2f}",
            f"{r['ngram']['tau_mean']:.2f}" if "ngram" in r else "-",
            f"{r['speedup']:.2f}x",
            f"{a['speedup']:.2f}x" if a else "-",
            f"{r['plain_tokens_per_s']:.1f}",
        )
    console.print(t)


@app.command("decode")
def decode(
    model: str = typer.Option(
        "default", "--model", help="Target: HF directory, Hub repo id, .gguf file, or 'default'."
    ),
    draft_model: str = typer.Option(
        "default", "--draft-model", help="Drafter dir or Hub repo id, 'default' or 'random[:LAYERS]'."
    ),
    prompts: Path | None = typer.Option(None, "--prompts", help="JSON Lines: {'prompt': ...} or {'messages': [...]}."),
    category: str | None = typer.Option(
        None,
        "--category",
        help="Held-out workload category: chat, code, edit, structured, a comma-separated list, or all. Per "
        "category: plain, fixed γ, adaptive-k (with --dflash-adaptive-k) and n-gram drafting in one table.",
    ),
    max_tokens: int = typer.Option(128, "--max-tokens", min=1),
    batch_size: int = typer.Option(1, "--batch-size", min=1),
    dflash_gamma: int | None = typer.Option(None, "--dflash-gamma", min=2, help="Verify width (drafts + 1)."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0),
    seed: int = typer.Option(0, "--seed"),
    num_prompts: int | None = typer.Option(None, "--num-prompts", min=1, help="Use only the first N prompts."),
    json_out: Path | None = typer.Option(None, "--json-out"),
    plot: Path | None = typer.Option(None, "--plot", help="PNG of acceptance by position."),
    draft_weight_quantization: str = typer.Option(
        "declared", "--draft-weight-quantization", help="Drafter weights: declared|fp8|fp8-aux|nvfp4."
    ),
    kernel_backend: str = typer.Option("auto", "--kernel-backend", help="auto|xla|pallas (quantized drafter)."),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
    tp_size: int = typer.Option(1, "--tp-size", min=1, help="Target tensor-parallel size (devices)."),
    draft_tp_size: str = typer.Option("auto", "--draft-tp-size", help="Drafter TP: 'auto' (world size) or N."),
    dflash_adaptive_k: str | None = typer.Option(
        None, "--dflash-adaptive-k", help="Adaptive draft count from a step-cost table 'drafts:ms,...'."
    ),
    dflash_objective: str | None = typer.Option(
        None,
        "--dflash-objective",
        help="What --dflash-adaptive-k maximises in a batch: latency (default) | throughput (the step's tokens/ms).",
    ),
    dflash_draft_ladder: str | None = typer.Option(
        None, "--dflash-draft-ladder", help="Draft count by active sequences 'min_active:drafts,...'."
    ),
    attention_backend: str = typer.Option(
        "auto",
        "--attention-backend",
        help="Attention over the KV pages: auto (pallas on a GPU, xla elsewhere) | xla | pallas (Triton kernel, GPU).",
    ),
    deterministic: bool = typer.Option(False, "--deterministic", help=DETERMINISTIC_HELP),
    dense_layout: str = typer.Option("auto", "--dense-layout", help=DENSE_LAYOUT_HELP),
    draft_method: str = typer.Option(
        "dflash",
        "--draft-method",
        help="dflash: the drafter proposes; ngram: prompt-lookup drafts (the latest earlier match of the last 4..1 "
        "tokens) verified by the same step (the drafter still keeps its context); hybrid: a row's prompt-lookup "
        "drafts where its last 4..2 tokens recur earlier in its context, the drafter's proposal elsewhere.",
    ),
) -> None:
    """Plain and speculative decoding on the same prompts in one run: speed, τ, acceptance, parity."""

    def body():
        from dflash_jax.bench.decode import DRAFT_RUNNERS, bench_decode, plot_acceptance
        from dflash_jax.bench.prompts import category_names, load_category, load_prompt_file
        from dflash_jax.builder import load_models, make_controller, resolve_dtype
        from dflash_jax.cli._tp import parallel_kwargs
        from dflash_jax.errors import UserError
        from dflash_jax.kernels.backends import attention_backend_for
        from dflash_jax.models.layers import resolve_dense_layout

        par = parallel_kwargs(tp_size, draft_tp_size)
        layout = resolve_dense_layout(dense_layout, tp=tp_size)
        models = load_models(
            model,
            draft_model,
            resolve_dtype(dtype),
            quant=draft_weight_quantization,
            kernel_backend=kernel_backend,
            mesh=par.get("mesh"),
        )
        if models.drafter is None:
            raise UserError("bench decode needs a drafter (--draft-model); use `bench plain` for plain decoding")
        if draft_method not in DRAFT_RUNNERS:
            raise UserError(
                f"--draft-method must be one of {', '.join(DRAFT_RUNNERS)}, got {draft_method!r}",
                param="--draft-method",
            )
        if category is not None:
            if prompts is not None:
                raise UserError("--category and --prompts: give one of them", param="--category")
            names = category_names(category)
            run = partial(
                bench_decode,
                models,
                batch_size=batch_size,
                max_tokens=max_tokens,
                temperature=temperature,
                seed=seed,
                draft_model_id=draft_model,
                log=eprint,
                quant=draft_weight_quantization,
                runner_kwargs={**par, "attention_backend": attention_backend, "dense_layout": layout},
                deterministic=deterministic,
                draft_method=draft_method,
            )
            fixed = partial(make_controller, models.drafter, gamma=dflash_gamma, draft_ladder=dflash_draft_ladder)
            adaptive = (
                partial(
                    make_controller,
                    models.drafter,
                    gamma=dflash_gamma,
                    adaptive_k=dflash_adaptive_k,
                    objective=dflash_objective,
                )
                if dflash_adaptive_k
                else None
            )
            out = {}
            for name in names:
                eprint(f"category {name} ...")
                rows = load_category(name)[:num_prompts]
                r = run(rows, make_controller=fixed)
                if adaptive is not None:
                    a = run(rows, make_controller=adaptive, plain=False)
                    a["speedup"] = a["spec_tokens_per_s"] / r["plain_tokens_per_s"]
                    a["outputs_identical"] = a["outputs_sha256"] == r["plain_outputs_sha256"]
                    r["adaptive_k"] = {k: a[k] for k in _CATEGORY_KEYS + _ADAPTIVE_KEYS if k in a}
                r["dtype"] = models.target.model.dtype.name
                out[name] = r
                _print_category(name, r)
            _print_categories(out)
            _write_json(json_out, {"categories": out})
            return
        make_ctl = partial(
            make_controller,
            models.drafter,
            gamma=dflash_gamma,
            adaptive_k=dflash_adaptive_k,
            draft_ladder=dflash_draft_ladder,
            objective=dflash_objective,
        )
        r = bench_decode(
            models,
            load_prompt_file(prompts)[:num_prompts],
            batch_size=batch_size,
            max_tokens=max_tokens,
            make_controller=make_ctl,
            temperature=temperature,
            seed=seed,
            draft_model_id=draft_model,
            log=eprint,
            quant=draft_weight_quantization,
            runner_kwargs={**par, "attention_backend": attention_backend, "dense_layout": layout},
            deterministic=deterministic,
            draft_method=draft_method,
        )
        r["dtype"] = models.target.model.dtype.name
        r["attention_backend"] = attention_backend_for(attention_backend, tp_size)
        r["dense_layout"] = layout
        if par:
            r["tp_size"], r["draft_tp_size"] = tp_size, draft_tp_size
        _print_decode(r)
        _write_json(json_out, r)
        if plot:
            plot_acceptance(r, plot)

    run_or_exit(body)


@app.command("plain")
def plain(
    model: str = typer.Option("default", "--model"),
    batch_sizes: str = typer.Option("1,4,8", "--batch-sizes", help="Comma-separated batch sizes."),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1),
    prompts: Path | None = typer.Option(None, "--prompts"),
    json_out: Path | None = typer.Option(None, "--json-out"),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
) -> None:
    """Plain greedy decode ms/token at several batch sizes (EOS ignored so every row decodes max-tokens), and the
    decode step as a multiple of its floor: the same weights' math for one token per row in one jitted call, without
    cache writes, sampling or host work (the JSON's `floor` field says exactly what it computes)."""

    def body():
        from dflash_jax.bench.plain import bench_plain
        from dflash_jax.bench.prompts import load_prompt_file
        from dflash_jax.builder import load_models, resolve_dtype

        try:
            sizes = [int(x) for x in batch_sizes.split(",")]
        except ValueError:
            raise typer.BadParameter("expected comma-separated integers", param_hint="--batch-sizes") from None
        models = load_models(model, None, resolve_dtype(dtype))
        r = bench_plain(models, load_prompt_file(prompts), batch_sizes=sizes, max_tokens=max_tokens, log=eprint)
        t = Table(title=f"bench plain: {r['model']}")
        for c in ("batch", "ms/step", "tok/s", "ms/token", "floor ms", "step/floor", "matmuls ms"):
            t.add_column(c, justify="right")
        for x in r["results"]:
            t.add_row(
                str(x["batch_size"]),
                f"{x['ms_per_step']:.2f}",
                f"{x['tokens_per_s']:.1f}",
                f"{x['ms_per_token']:.2f}",
                f"{x['floor_ms']:.2f}",
                f"{x['decode_over_floor']:.3f}",
                f"{x['matmul_floor_ms']:.2f}",
            )
        console.print(t)
        _write_json(json_out, r)

    run_or_exit(body)


@app.command("spec-cost")
def spec_cost(
    model: str = typer.Option("default", "--model"),
    draft_model: str = typer.Option("default", "--draft-model"),
    dflash_gamma: int | None = typer.Option(None, "--dflash-gamma", min=2),
    widths: str = typer.Option("1", "--widths", help="Batch widths to price, e.g. 1,2,4."),
    steps: int = typer.Option(12, "--steps", min=3),
    draft_weight_quantization: str = typer.Option("declared", "--draft-weight-quantization"),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
    dense_layout: str = typer.Option("auto", "--dense-layout", help=DENSE_LAYOUT_HELP),
    json_out: Path | None = typer.Option(None, "--json-out"),
) -> None:
    """Measure the step cost by draft count and print it in the --dflash-adaptive-k format."""

    def body():
        from dflash_jax.bench.spec_cost import measure_costs
        from dflash_jax.builder import load_models, make_controller, resolve_dtype
        from dflash_jax.models.layers import resolve_dense_layout
        from dflash_jax.spec_decode.control import format_cost_model

        layout = resolve_dense_layout(dense_layout)
        lt, drafter, head = load_models(model, draft_model, resolve_dtype(dtype), quant=draft_weight_quantization)
        gamma = make_controller(drafter, gamma=dflash_gamma).gamma
        try:
            ws = tuple(int(x) for x in widths.split(","))
        except ValueError:
            raise typer.BadParameter("expected comma-separated integers", param_hint="--widths") from None
        costs = measure_costs(lt, drafter, head, widths=ws, gamma=gamma, steps=steps, dense_layout=layout, log=eprint)
        table = format_cost_model(costs)
        print(f'--dflash-adaptive-k "{table}"')  # one line, ready to paste
        _write_json(
            json_out,
            {
                "model": lt.model_id,
                "draft_model": draft_model,
                "dense_layout": layout,
                "dtype": lt.model.dtype.name,
                "gamma": gamma,
                "costs_ms": {str(n): t for n, t in costs.items()},
                "adaptive_k": table,
            },
        )

    run_or_exit(body)


@app.command("serve")
def serve(
    url: list[str] = typer.Option(..., "--url", help="Server URL; give two (spec, then baseline) for speedups."),
    concurrency: str = typer.Option("1,2,4,8", "--concurrency"),
    num_prompts: int | None = typer.Option(None, "--num-prompts", min=1),
    prompts: Path | None = typer.Option(None, "--prompts"),
    category: str | None = typer.Option(
        None,
        "--category",
        help="Held-out workload categories instead of --prompts: chat, code, edit, structured, a comma-separated "
        "list (a mixed workload, the categories' prompts taken in turn: edit,chat is half edit, half chat) or all.",
    ),
    max_tokens: int = typer.Option(128, "--max-tokens", min=1),
    json_out: Path | None = typer.Option(None, "--json-out"),
    plot: Path | None = typer.Option(None, "--plot"),
    api_key: str | None = typer.Option(None, "--api-key", envvar="DFLASH_JAX_API_KEY"),
) -> None:
    """Load generator against running servers: TTFT, TPOT, ITL, throughput, acceptance length."""
    from dflash_jax.bench.serve_load import serve_bench

    run_or_exit(
        lambda: serve_bench(
            url,
            concurrency=concurrency,
            num_prompts=num_prompts,
            prompts_file=prompts,
            category=category,
            json_out=json_out,
            plot=plot,
            max_tokens=max_tokens,
            api_key=api_key,
        )
    )
