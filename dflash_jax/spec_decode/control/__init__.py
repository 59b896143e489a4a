"""Host-side speculation control (pure Python): how many drafts each sequence verifies per step.

`controller.Controller` is what the engine calls; the other modules are its parts (cost tables, acceptance,
the choice rule, the draft ladder, γ resolution and the rung resolver).
"""

from .acceptance import (
    AcceptanceModel,
    conditional_from_marginals,
    expected_tokens,
    expected_tokens_curve,
)
from .choice import Plan, PlanRow, choose, plan
from .controller import Controller, ControlParams
from .cost import CostModel, CostTable, format_cost_model, parse_cost_model, parse_cost_table
from .gamma import RungResolver, default_gamma, require_drafter, resolve_gamma, validate_against_gamma
from .ladder import DraftLadder, parse_draft_ladder

__all__ = [
    "AcceptanceModel",
    "ControlParams",
    "Controller",
    "CostModel",
    "CostTable",
    "DraftLadder",
    "Plan",
    "PlanRow",
    "RungResolver",
    "choose",
    "conditional_from_marginals",
    "default_gamma",
    "expected_tokens",
    "expected_tokens_curve",
    "format_cost_model",
    "parse_cost_model",
    "parse_cost_table",
    "parse_draft_ladder",
    "plan",
    "require_drafter",
    "resolve_gamma",
    "validate_against_gamma",
]
