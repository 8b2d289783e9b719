"""The OpenAI-compatible server on the engine (needs the ``serve`` extra for `http`, the ``ray`` extra for `ray`).

- `http`: the HTTP layer: OpenAI's wire format (`http.protocol`), one handler per endpoint (`http.app`), and the
  `EngineClient` (`http.engine`) through which the server reaches the engine, knowing nothing of HTTP;
- `ray`: the same app as a Ray Serve application, engine replicas behind one ingress, prefix-aware routing;
- `launch`: the command's options, and the model, batcher and engine they describe (shared by both);
- `cli`: the command, ``python -m hf_paged_cache.serve MODEL`` (``hf-paged-cache serve MODEL``).

Importing this package imports nothing: the HTTP stack is loaded by `http` only.
"""
