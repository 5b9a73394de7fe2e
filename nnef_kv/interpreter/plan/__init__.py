"""Graph -> Plan, and running a plan (see :mod:`.core` for the passes).

    plan = get_plan(model)            # built once per model, cached on it
    values = bind_inputs(plan, inputs, state_symbols)
    execute(plan, values, states)
"""
from __future__ import annotations

from .compile import get_plan
from .core import PASSES, Plan, build_plan, fingerprint
from .execute import bind_inputs, check_assertions, execute, node_error
from .stepwise import token_carrying

__all__ = ["Plan", "build_plan", "PASSES", "fingerprint", "get_plan", "bind_inputs", "check_assertions", "execute",
           "node_error", "token_carrying"]
