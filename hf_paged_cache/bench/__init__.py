"""Helpers for the benchmark scripts (``scripts/bench/``) and the demo: not part of the library's API.

- `workload`: the seeded ShareGPT-shaped request stream, or one of uniform lengths;
- `grounded`: chat requests whose answers repeat their prompt (the workload of speculative decoding), from the
  standard library's text (imported as `hf_paged_cache.bench.grounded`);
- `kv_bytes`: KV byte accounting for dense and paged caches;
- `timing`: wall / CPU timers, per-step stamps inside ``generate``, time to first token, a fresh thread per run;
- `variants`: the caches the scripts compare and the attention each runs with;
- `report`: shared command-line options, model loading, JSON and markdown output;
- `narrow`: a model's architecture with its widths cut, to time a step's fixed cost;
- `whisper`: a Whisper model of a real model's dimensions with random weights (the transcription benchmarks);
- `server_process`: a benchmarked server in a process of its own (free port, wait for ``/health``, stop its group);
- the parts of ``scripts/bench/serving/bench_http.py``: `http_contenders` (the contenders, each server's command
  and environment), `http_jobs` (the workloads' requests, the KV budget they need), `http_load` (request bodies,
  the streaming client, closed loops over HTTP or into a batcher), `http_rounds` (one round of a contender,
  counters read around it) and `http_report` (per-round metrics, medians, pair comparisons, the printed table).
  These and `server_process` need ``httpx``: import them by path (``hf_paged_cache.bench.http_load``), as
  `grounded`; this package does not re-export them.

Nothing in the core package imports this subpackage.
"""

from .kv_bytes import (
    cache_tensor_bytes,
    kv_bytes_per_token,
    paged_blocks,
    paged_pool_blocks,
    static_cache_reserved_bytes,
    stored_tokens,
    used_bytes,
)
from .narrow import narrowed
from .report import (
    add_common_args,
    add_workload_args,
    format_table,
    load,
    machine_info,
    mib,
    pad_token_id,
    write_json,
)
from .timing import (
    FirstTokenTimer,
    StepClock,
    Timer,
    in_fresh_thread,
    median,
    peak_memory,
    percentile,
    reset_peak_memory,
    synchronize,
)
from .variants import VARIANTS, variant_attention
from .workload import (
    SHAREGPT_INPUT,
    SHAREGPT_INPUT_MEAN,
    SHAREGPT_OUTPUT,
    SHAREGPT_OUTPUT_MEAN,
    SOURCE,
    LogNormalLengths,
    Request,
    Workload,
    fixed_length_workload,
    left_pad,
    prompt_token_range,
    sharegpt_workload,
    uniform_workload,
)

__all__ = [
    "SHAREGPT_INPUT",
    "SHAREGPT_INPUT_MEAN",
    "SHAREGPT_OUTPUT",
    "SHAREGPT_OUTPUT_MEAN",
    "SOURCE",
    "VARIANTS",
    "FirstTokenTimer",
    "LogNormalLengths",
    "Request",
    "StepClock",
    "Timer",
    "Workload",
    "add_common_args",
    "add_workload_args",
    "cache_tensor_bytes",
    "fixed_length_workload",
    "format_table",
    "in_fresh_thread",
    "kv_bytes_per_token",
    "left_pad",
    "load",
    "machine_info",
    "median",
    "mib",
    "narrowed",
    "pad_token_id",
    "paged_blocks",
    "paged_pool_blocks",
    "peak_memory",
    "percentile",
    "prompt_token_range",
    "reset_peak_memory",
    "sharegpt_workload",
    "static_cache_reserved_bytes",
    "stored_tokens",
    "synchronize",
    "uniform_workload",
    "used_bytes",
    "variant_attention",
    "write_json",
]
