"""The engine: many requests on one model and one pool, admitted and retired at every step.

`ContinuousBatcher` is its public face (submit, stats, close). Inside, one step a loop iteration: the
`Scheduler` picks the step's rows (`scheduler`, `admission`, `admission_rules`), `StepRoles` completes them into
the whole `StepPlan` (`roles`, `plan`), the `StepExecutor` runs it (`executor`, `forwards`, `token_choice`,
`recovery`) and reports a `StepResult` (`step_result`), and the scheduler applies it (`outcomes`). Requests, their
checks and their handles are `request`, `validation` and `logprobs`; structured outputs reach the engine only as
`constraints.Constraint`. The engine imports nothing of the HTTP server.
"""

from .batcher import BatcherStats, ContinuousBatcher, GroupUsage, generate_many
from .request import RequestHandle
from .step_result import StepTimes

__all__ = ["BatcherStats", "ContinuousBatcher", "GroupUsage", "RequestHandle", "StepTimes", "generate_many"]
