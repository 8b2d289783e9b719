"""Serving many requests on one pool: the continuous batcher (scheduler, step executor, inbox), its requests and
handles, submit-time checks, admission and packed steps."""

from .batcher import BatcherStats, ContinuousBatcher, GroupUsage, generate_many
from .request import RequestHandle
from .steps import StepTimes

__all__ = ["BatcherStats", "ContinuousBatcher", "GroupUsage", "RequestHandle", "StepTimes", "generate_many"]
