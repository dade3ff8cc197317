"""Planning activation memory: in-place norms, recomputation and offloading chosen per segment
to fit a budget at the least predicted time (docs/design.md, "Planning memory").

SciPy (``scipy.optimize.milp``) solves the plan; it is imported when a plan is solved.
"""

from .planner import ALLOWED, POLICIES, plan
from .report import DecisionRow, PlanReport
from .wrappers import PlannedSequential, module_plan, traced_plan

__all__ = ["ALLOWED", "POLICIES", "DecisionRow", "PlanReport", "PlannedSequential",
           "module_plan", "plan", "traced_plan"]
