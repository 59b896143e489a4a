"""`dflash-jax train data|drafter`: build target-generated training data, train and export a DFlash drafter."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from dflash_jax.cli._common import run_or_exit

app = typer.Typer(help="Drafter training: data generation and training.", no_args_is_help=True)
console = Console(stderr=True)
DTYPE_HELP = (
    "auto|bfloat16|float16|float32: the target's weights and the compute dtype (auto: bf16 on GPU, f32 on CPU)."
)


def _taps(value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        ids = tuple(int(x) for x in value.split(","))
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated layer ids like 1,10,18,27, got {value!r}") from None
    if not ids or min(ids) < 0:
        raise typer.BadParameter("layer ids must be non-negative")
    return ids


@app.command("data")
def data(
    out: Path = typer.Option(Path("data/smollm2-taps4"), "--out", help="Output directory (resumes if it exists)."),
    model: str = typer.Option("default", "--model", help="Target model: HF dir, Hub repo id, .gguf, or 'default'."),
    target_layer_ids: str = typer.Option("1,10,18,27", "--target-layer-ids", help="Tap layers to capture."),
    num_shards: int = typer.Option(48, "--num-shards", min=1),
    rows_per_shard: int = typer.Option(32, "--rows-per-shard", min=1),
    max_prompt: int = typer.Option(128, "--max-prompt", min=8),
    max_new: int = typer.Option(
        160, "--max-new", min=8, help="Tokens generated per row; --max-prompt + --max-new <= the target's positions."
    ),
    seed: int = typer.Option(0, "--seed"),
    store_taps: bool = typer.Option(
        True,
        "--store-taps/--no-store-taps",
        help="Cache the tap hidden states (CPU), or tokens only and let training "
        "recompute the taps with the target (accelerators; ~600x less disk).",
    ),
    sampled_fraction: float = typer.Option(
        0.25,
        "--sampled-fraction",
        min=0.0,
        max=1.0,
        help="Share of rows decoded with temperature sampling (rest greedy).",
    ),
    temperature: float = typer.Option(0.7, "--temperature", min=0.0, help="Temperature of the sampled rows."),
    self_prompt_fraction: float = typer.Option(
        0.0,
        "--self-prompt-fraction",
        min=0.0,
        max=1.0,
        help="Share of each shard's prompts whose user message the target writes itself (sampled from its chat "
        "template's user turn); the rest come from the built-in prompt families.",
    ),
    copy_fraction: float = typer.Option(
        0.0,
        "--copy-fraction",
        min=0.0,
        max=1.0,
        help="Share of each shard's prompts that ask the target to repeat or transform given text (edits of "
        "standard-library code and docstrings, Shakespeare passages, format conversions).",
    ),
    edit_turn_fraction: float = typer.Option(
        0.0,
        "--edit-turn-fraction",
        min=0.0,
        max=1.0,
        help="Share of the --copy-fraction prompts that are two-turn: the target answers a first prompt, then a "
        "second turn asks it to repeat, reformat or fix that answer.",
    ),
    max_seconds: float | None = typer.Option(
        None, "--max-seconds", min=1.0, help="Start no new shard after this long (run again to continue)."
    ),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
) -> None:
    """Generate responses with the target itself and cache tokens, loss masks and tap hidden states."""
    from dflash_jax.bench.prompts import heldout_user_messages
    from dflash_jax.builder import resolve_dtype
    from dflash_jax.checkpoints.hub import resolve_model_dir
    from dflash_jax.checkpoints.loader import load_target
    from dflash_jax.errors import UserError
    from dflash_jax.train.data import DataConfig, build_dataset, check_seq_len

    def body():
        if self_prompt_fraction + copy_fraction > 1.0:
            raise UserError(
                f"--copy-fraction {copy_fraction} plus --self-prompt-fraction {self_prompt_fraction} exceeds 1; "
                "lower one of them",
                param="--copy-fraction",
            )
        lt = load_target(resolve_model_dir(model, "--model"), resolve_dtype(dtype))
        cfg = DataConfig(
            taps=_taps(target_layer_ids),
            num_shards=num_shards,
            rows_per_shard=rows_per_shard,
            max_prompt=max_prompt,
            max_new=max_new,
            seed=seed,
            store_taps=store_taps,
            sampled_fraction=sampled_fraction,
            temperature=temperature,
            self_prompt_fraction=self_prompt_fraction,
            copy_fraction=copy_fraction,
            edit_turn_fraction=edit_turn_fraction,
        )
        check_seq_len(cfg, lt.cfg.max_position_embeddings)
        with Progress(
            TextColumn("shards"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("{task.fields[tok]} tok"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
        ) as prog:
            task = prog.add_task("gen", total=num_shards, tok=0)
            total = [0]

            def cb(s, n, skipped, tokens=0):
                total[0] += tokens
                prog.update(task, completed=s + 1, tok=total[0])

            build_dataset(lt, cfg, out, cb, max_seconds=max_seconds, exclude=heldout_user_messages())
        console.print(f"data ready in {out}")

    run_or_exit(body)


@app.command("copy-data")
def copy_data(
    out: Path = typer.Option(Path("data/smollm2-copy"), "--out", help="Output directory (resumes if it exists)."),
    model: str = typer.Option("default", "--model", help="Target model: HF dir, Hub repo id, .gguf, or 'default'."),
    target_layer_ids: str = typer.Option("1,10,18,27", "--target-layer-ids", help="Tap layers to capture."),
    num_shards: int = typer.Option(48, "--num-shards", min=1),
    rows_per_shard: int = typer.Option(64, "--rows-per-shard", min=1),
    seq_len: int = typer.Option(
        512, "--seq-len", min=32, help="Row length: prompt + answer (longer answers are cut, longer prompts dropped)."
    ),
    earlier_answers: Path | None = typer.Option(
        None,
        "--earlier-answers",
        help="A `train data` directory whose responses (the target's own answers) become text to edit.",
    ),
    seed: int = typer.Option(0, "--seed"),
    max_seconds: float | None = typer.Option(
        None, "--max-seconds", min=1.0, help="Start no new shard after this long (run again to continue)."
    ),
    dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
) -> None:
    """Copy and edit tasks with exact answers, teacher-forced through the target: taps and loss masks (the answer
    tokens the target's argmax agrees with) from one forward per row, no decoding."""
    from dflash_jax.bench.prompts import heldout_user_messages
    from dflash_jax.builder import resolve_dtype
    from dflash_jax.checkpoints.hub import resolve_model_dir
    from dflash_jax.checkpoints.loader import load_target
    from dflash_jax.errors import UserError
    from dflash_jax.train.known_answers import build_known_dataset
    from dflash_jax.train.known_answers import earlier_answers as read_answers

    def body():
        if earlier_answers is not None and not earlier_answers.is_dir():
            raise UserError(f"--earlier-answers: {earlier_answers} is not a directory", param="--earlier-answers")
        lt = load_target(resolve_model_dir(model, "--model"), resolve_dtype(dtype))
        if seq_len > lt.cfg.max_position_embeddings:
            raise UserError(
                f"--seq-len {seq_len} exceeds the target's {lt.cfg.max_position_embeddings} positions",
                param="--seq-len",
            )
        earlier = []
        if earlier_answers is not None:
            earlier = read_answers(earlier_answers, lt.tokenizer)
            if not earlier:
                raise UserError(
                    f"--earlier-answers: no responses found in {earlier_answers} (expected `train data` shards)",
                    param="--earlier-answers",
                )

        def cb(s, n, stats):
            console.print(
                f"shard {s + 1}/{n}: {stats['rows']} rows, {stats['answer_tokens']} answer tokens, "
                f"{stats['kept']:.1%} kept (the target's own), {stats['seconds']:.1f} s"
            )

        build_known_dataset(
            lt,
            out,
            taps=_taps(target_layer_ids),
            num_shards=num_shards,
            rows_per_shard=rows_per_shard,
            seq_len=seq_len,
            seed=seed,
            earlier=earlier,
            exclude=heldout_user_messages(),
            progress=cb,
            max_seconds=max_seconds,
        )
        console.print(f"data ready in {out}")

    run_or_exit(body)


@app.command("drafter")
def drafter(
    out: Path = typer.Option(..., "--out", help="Run directory: checkpoints, log.jsonl and the exported drafter."),
    data_dirs: list[Path] = typer.Option(
        [Path("data/smollm2-taps4")], "--data", help="Directory from `train data` (repeat to train on several)."
    ),
    target: str = typer.Option("default", "--target", help="Target model: HF dir, Hub repo id, .gguf, or 'default'."),
    layers: int = typer.Option(2, "--layers", min=1, help="Drafter decoder layers."),
    block_size: int = typer.Option(
        8, "--drafter-block-size", min=2, help="The drafter's block size B (anchor + B-1 drafts)."
    ),
    target_layer_ids: str | None = typer.Option(None, "--target-layer-ids", help="Taps (default: the data's)."),
    mask_token_id: int = typer.Option(16, "--mask-token-id", help="Token whose embedding fills masked slots."),
    steps: int = typer.Option(2000, "--steps", min=1),
    batch_size: int = typer.Option(8, "--batch-size", min=1),
    num_anchors: int = typer.Option(16, "--num-anchors", min=1),
    lr: float = typer.Option(1e-3, "--lr"),
    warmup_frac: float = typer.Option(0.04, "--warmup-frac", min=0.0, max=0.5),
    seed: int = typer.Option(0, "--seed"),
    max_shards: int | None = typer.Option(None, "--max-shards", help="Use only the first N data shards."),
    init_from_target: bool = typer.Option(
        False, "--init-from-target", help="Start the drafter's layers as copies of the target's last layers."
    ),
    init_from: Path | None = typer.Option(
        None,
        "--init-from",
        help="Start from a saved drafter directory (ours or z-lab's) and continue training it, e.g. on new data.",
    ),
    resume: bool = typer.Option(False, "--resume", help="Continue from the latest checkpoint in --out."),
    stop_at: int | None = typer.Option(None, "--stop-at", help="Stop after this step (schedule still uses --steps)."),
    export: Path | None = typer.Option(None, "--export", help="Also export the drafter (z-lab layout) here."),
    export_dtype: str = typer.Option("float32", "--export-dtype", help="float32 | float16 (halves the file)."),
    arch: str = typer.Option("dflash", "--arch", help="dflash, or dflash2 (convs + candidate selector)."),
    selector_rank: int = typer.Option(256, "--selector-rank", min=1, help="DFlash2 selector codebook rank r."),
    time_budget: float | None = typer.Option(
        None,
        "--time-budget",
        min=1.0,
        help="Seconds: fit the number of steps to this budget from the measured step time (warm-up, constant, "
        "linear decay over the last 20%); --steps is then an upper bound.",
    ),
    warmup_steps: int = typer.Option(0, "--warmup-steps", min=0, help="Warm-up steps (0: --warmup-frac)."),
    save_every: int = typer.Option(100, "--save-every", min=1, help="Checkpoint every N steps."),
    ce_dtype: str = typer.Option(
        "bfloat16",
        "--ce-dtype",
        help="LM-head GEMM inputs in the loss: bfloat16 (f32 accumulation, faster) or float32.",
    ),
    ce_chunk: int = typer.Option(1024, "--ce-chunk", min=1, help="LM-head rows per chunk of the loss."),
    dtype: str = typer.Option(
        "auto",
        "--dtype",
        help=DTYPE_HELP[:-1] + "; the drafter's parameters and optimizer state stay f32.",
    ),
) -> None:
    """Train a DFlash drafter on cached target data; export it in z-lab's layout."""
    from dflash_jax.builder import resolve_dtype
    from dflash_jax.checkpoints.export import export_drafter
    from dflash_jax.checkpoints.hub import resolve_model_dir
    from dflash_jax.checkpoints.loader import load_target
    from dflash_jax.errors import UserError
    from dflash_jax.train.data import load_shards
    from dflash_jax.train.trainer import ShardData, TrainConfig, train

    def body():
        if init_from is not None and init_from_target:
            raise UserError("--init-from and --init-from-target exclude each other", param="--init-from")
        if arch not in ("dflash", "dflash2"):
            raise UserError(f"--arch must be dflash or dflash2, got {arch!r}", param="--arch")
        if ce_dtype not in ("bfloat16", "float32"):
            raise UserError(f"--ce-dtype must be bfloat16 or float32, got {ce_dtype!r}", param="--ce-dtype")
        all_taps = []
        for data_dir in data_dirs:
            meta = data_dir / "data.json"
            if not meta.exists():
                raise UserError(
                    f"--data: {data_dir} has no data.json; build it with `dflash-jax train data`", param="--data"
                )
            all_taps.append(tuple(json.loads(meta.read_text())["config"]["taps"]))
        if len(set(all_taps)) > 1:
            held = ", ".join(f"{d}: {t}" for d, t in zip(data_dirs, all_taps, strict=True))
            raise UserError(
                f"--data: the directories hold different taps ({held}); train on data captured at the same layers",
                param="--data",
            )
        data_taps = all_taps[0]
        taps = _taps(target_layer_ids) or data_taps
        if taps != data_taps:
            raise UserError(f"--target-layer-ids {taps} differs from the taps stored in --data ({data_taps})")
        dt = resolve_dtype(dtype)
        lt = load_target(resolve_model_dir(target, "--target"), dt)
        data = ShardData([f for d in data_dirs for f in load_shards(d)][:max_shards])
        tc = TrainConfig(
            num_layers=layers,
            block_size=block_size,
            target_layer_ids=taps,
            mask_token_id=mask_token_id,
            num_anchors=num_anchors,
            batch_size=batch_size,
            steps=steps,
            lr=lr,
            seed=seed,
            warmup_frac=warmup_frac,
            arch=arch,
            init_from_target=init_from_target,
            selector_rank=selector_rank,
            time_budget=time_budget or 0.0,
            warmup_steps=warmup_steps,
            save_every=save_every,
            init_from=str(init_from or ""),
            ce_dtype=ce_dtype,
            ce_chunk=ce_chunk,
            compute_dtype=np.dtype(dt).name,
        )
        how = f"a {time_budget:.0f} s budget" if time_budget else f"{steps} steps"
        taps_src = "cached taps" if data.taps is not None else "taps recomputed by the target"
        console.print(f"training on {len(data)} sequences ({len(data.files)} shards, {taps_src}), {how}")
        with Progress(
            TextColumn("step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("loss {task.fields[loss]:.3f} acc {task.fields[acc]:.3f} τ {task.fields[tau]:.2f}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
        ) as prog:
            task = prog.add_task("train", total=min(steps, stop_at or steps), loss=0.0, acc=0.0, tau=1.0)

            def on_log(r):
                prog.update(
                    task,
                    completed=r["step"],
                    loss=r["loss"],
                    acc=r["acc"],
                    tau=r["tau"],
                    total=r.get("fitted_steps", prog.tasks[0].total),
                )

            model, _ = train(
                lt.cfg,
                lt.model.embed[...],
                lt.model.lm_head[...],
                data,
                tc,
                out,
                resume=resume,
                stop_at=stop_at,
                on_log=on_log,
                final_norm=lt.model.norm[...],
                target=lt.model,
            )
        dest = export or (out / "drafter")
        if export_dtype not in ("float32", "float16"):
            raise UserError(f"--export-dtype must be float32 or float16, got {export_dtype!r}", param="--export-dtype")
        export_drafter(model, dest, lt.cfg.num_layers, dtype=np.dtype(export_dtype))
        console.print(f"exported drafter to {dest}")

    run_or_exit(body)


@app.command("export")
def export_cmd(
    run: Path = typer.Option(..., "--run", help="A `train drafter` run directory."),
    out: Path = typer.Option(..., "--out", help="Where to write the drafter (z-lab layout)."),
    step: int | None = typer.Option(None, "--step", help="Checkpoint step (default: the latest)."),
    target: str = typer.Option("default", "--target"),
    export_dtype: str = typer.Option("float32", "--export-dtype", help="float32 | float16."),
) -> None:
    """Export a training checkpoint as a drafter directory that `--draft-model` loads."""
    from dflash_jax.checkpoints.export import export_drafter
    from dflash_jax.checkpoints.hub import resolve_model_dir
    from dflash_jax.checkpoints.loader import load_target
    from dflash_jax.errors import UserError
    from dflash_jax.train.trainer import restore_drafter

    def body():
        if export_dtype not in ("float32", "float16"):
            raise UserError(f"--export-dtype must be float32 or float16, got {export_dtype!r}", param="--export-dtype")
        lt = load_target(resolve_model_dir(target, "--target"))
        model, s = restore_drafter(lt.cfg, run, step)
        export_drafter(model, out, lt.cfg.num_layers, dtype=np.dtype(export_dtype))
        console.print(f"exported step {s} of {run} to {out}")

    run_or_exit(body)
