"""Serving many requests on one pool: the continuous batcher, its requests and handles, admission, packed steps."""

from .batcher import ContinuousBatcher, generate_many
from .request import RequestHandle

__all__ = ["ContinuousBatcher", "RequestHandle", "generate_many"]
