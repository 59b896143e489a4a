"""`dflash-jax spec ...` commands."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from dflash_jax.errors import UserError
from dflash_jax.spec_decode.control.acceptance import parse_rates
from dflash_jax.spec_decode.control.choice import plan as plan_drafts
from dflash_jax.spec_decode.control.cost import parse_cost_model

app = typer.Typer(help="Speculation planning tools (adaptive-k).", no_args_is_help=True)


def _bad(e: UserError, flag: str) -> typer.BadParameter:
    message = str(e)
    prefix = f"{flag}: "
    if message.startswith(prefix):
        message = message[len(prefix) :]
    return typer.BadParameter(message, param_hint=f"'{flag}'")


@app.callback()
def _spec() -> None:
    """Speculation planning tools."""


@app.command("plan")
def plan(
    cost: str = typer.Option(
        ...,
        "--cost",
        help="Step-cost table in the --dflash-adaptive-k format, e.g. 0:32,1:44,2:50,3:56 (drafts:ms).",
    ),
    acceptance: str = typer.Option(
        ...,
        "--acceptance",
        help="Acceptance by draft position: marginal rates m1,m2,... (m_j = P(at least j drafts accepted)); "
        "past the last position the last conditional rate repeats.",
    ),
    cap: int | None = typer.Option(
        None, "--cap", min=1, help="Most drafts per step (the ladder rung or γ - 1). Default: the table's."
    ),
    width: int = typer.Option(1, "--width", min=1, help="Batch width whose cost table prices the plan."),
    conditional: bool = typer.Option(
        False, "--conditional", help="--acceptance gives conditional rates c_j instead of marginals."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Expected tokens and tokens/ms per draft count for a cost table and acceptance, and the choice."""
    try:
        model = parse_cost_model(cost, param="--cost", alpha=0.0)
    except UserError as e:
        raise _bad(e, "--cost") from None
    try:
        rates = parse_rates(acceptance, param="--acceptance", marginal=not conditional)
    except UserError as e:
        raise _bad(e, "--acceptance") from None
    table = model.table_for(width)
    result = plan_drafts(table, rates, cap=cap)

    if as_json:
        doc = {"cost": table.to_flag(), "width": width, "conditional_rates": rates, "cap": cap}
        doc.update(result.to_dict())
        typer.echo(json.dumps(doc, indent=2))
        return

    out = Table(title=f"DFlash draft plan (cost {table.to_flag()} at width {width})")
    out.add_column("drafts", justify="right")
    out.add_column("E\\[tokens]", justify="right")
    out.add_column("cost ms", justify="right")
    out.add_column("tokens/ms", justify="right")
    out.add_column("")
    for row in result.rows:
        chosen = row.drafts == result.choice
        out.add_row(
            str(row.drafts),
            f"{row.expected_tokens:.3f}",
            f"{row.cost_ms:g}",
            f"{row.tokens_per_ms:.5f}",
            "<- chosen" if chosen else "",
            style="bold" if chosen else None,
        )
    console = Console()
    console.print(out)
    if result.choice == 0:
        console.print("choice: 0 drafts (plain decode beats every draft count by the 3% margin: suspend)")
    else:
        console.print(f"choice: {result.choice} drafts (cap {result.top})")
