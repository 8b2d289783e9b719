"""The OpenAI-compatible server as a Ray Serve application (needs the ``ray`` extra).

Replicas of the engine each own a model, a `ContinuousBatcher` and its pool (`replica`); one ingress serves
the same OpenAI app as the single-process server (`ingress`, through `client`); requests go to the replica
holding the longest cached prefix of their prompt, balanced against load (`router`, from each replica's
bounded `summary`). ``hf-paged-cache serve MODEL --ray --replicas N`` runs it (`app.run_on_ray`), and so does
``serve run hf_paged_cache.server.ray.app:app_builder model=MODEL replicas=N``.
"""

from .app import app_builder, build_application, run_on_ray
from .router import PrefixAwareRouter
from .summary import PrefixSummary

__all__ = ["PrefixAwareRouter", "PrefixSummary", "app_builder", "build_application", "run_on_ray"]
