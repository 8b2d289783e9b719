"""The OpenAI-compatible HTTP server on a `ContinuousBatcher` (needs the ``serve`` extra).

The wire format (`protocol`) is kept apart from the handlers (`app`, one per endpoint), which run requests
through an `EngineClient` (`engine`, `generation`) that knows nothing of HTTP. `python -m hf_paged_cache.serve`
is the command line.
"""

from .app import build_app
from .engine import EngineClient, GenerationOptions
from .generation import ChoiceUpdate, Generation
from .settings import ServerSettings

__all__ = ["ChoiceUpdate", "EngineClient", "Generation", "GenerationOptions", "ServerSettings", "build_app"]
