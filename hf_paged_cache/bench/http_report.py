"""The report of ``scripts/bench/serving/bench_http.py``: each round's metrics, each contender's medians over its
rounds with the spread of tokens/s, the comparisons of every pair of contenders, and the printed tables.

Per round (`round_metrics`): output tokens/s = ``sum of generated tokens / wall seconds``; time to first token
(first chunk that carried text - request sent), inter-token latency (gaps between successive text-carrying chunks
of one request, pooled over requests) and time per request, each as p50 and p95 (nearest rank,
`hf_paged_cache.bench.timing.percentile`); what ended the answers; the prefix hit rate and the draft tokens
accepted where the contender counts them. Per contender (`summarise`): the median of each over the rounds, the
range of tokens/s, and how many texts every round answered alike. Per pair (`compare_pairs`): the texts the
first rounds share and tokens/s of one over the other, round by round.
"""

from __future__ import annotations

import itertools
import json
import statistics
from collections.abc import Sequence
from typing import Any

from .http_jobs import CHAT_WORKLOADS, Job
from .http_load import Round, Stream
from .report import format_table, mib
from .timing import percentile


def acceptance(speculation: dict[str, float] | None) -> dict[str, float] | None:
    """Draft tokens proposed and accepted, and their ratio, from `speculation_counters`' differences."""
    if not speculation:
        return None
    drafted = sum(v for k, v in speculation.items() if k.endswith("draft_tokens_total"))
    accepted = sum(v for k, v in speculation.items() if k.endswith("accepted_tokens_total"))
    return {"draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance": accepted / drafted if drafted else None}


def generated_tokens(stream: Stream, job: Job) -> int:
    """The tokens `stream` generated: the server's ``usage``; without it, `job.max_tokens` when EOS was ignored
    (every answer is that long), else the chunks that carried text (a lower bound: a chunk carries one token or
    more, several where a step accepted draft tokens)."""
    if stream.completion_tokens is not None:
        return stream.completion_tokens
    return job.max_tokens if job.ignore_eos else len(stream.arrivals)


def schema_valid(text: str, job: Job) -> bool:
    """Whether `text` is one JSON value that validates against `job`'s schema."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), job.response_format["json_schema"]["schema"])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def round_metrics(timed: Round, jobs: list[Job]) -> dict[str, Any]:
    """One round's throughput (tokens/s), latencies (seconds), answer checks and counters, as the JSON holds it."""
    tokens = [generated_tokens(s, j) for s, j in zip(timed.streams, jobs, strict=True)]
    ttft = [s.arrivals[0] - s.sent for s in timed.streams if s.arrivals]
    itl = [b - a for s in timed.streams for a, b in itertools.pairwise(s.arrivals)]
    request_seconds = [s.ended - s.sent for s in timed.streams if s.ended is not None]
    reasons = [s.finish_reason for s in timed.streams]
    return {
        "seconds": timed.seconds,
        "output_tokens": sum(tokens),
        "tokens_per_s": sum(tokens) / timed.seconds,
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p95_s": percentile(ttft, 0.95),
        "itl_p50_s": percentile(itl, 0.5), "itl_p95_s": percentile(itl, 0.95),
        "request_p50_s": percentile(request_seconds, 0.5) if request_seconds else None,
        "request_p95_s": percentile(request_seconds, 0.95) if request_seconds else None,
        "request_mean_s": statistics.fmean(request_seconds) if request_seconds else None,
        "finish_reasons": {reason or "none": reasons.count(reason) for reason in dict.fromkeys(reasons)},
        "reference_in_answer": sum(j.expected is not None and j.expected.strip() in s.text
                                   for s, j in zip(timed.streams, jobs, strict=True)),
        "speculation": acceptance(timed.speculation),
        "lengths_as_requested": sum(s.completion_tokens == j.max_tokens
                                    for s, j in zip(timed.streams, jobs, strict=True)),
        "usage_reported": sum(s.completion_tokens is not None for s in timed.streams),
        "prompt_tokens": sum(s.prompt_tokens or 0 for s in timed.streams),
        "startup_seconds": timed.startup_seconds,
        "prefix_hit_rate": (None if timed.prefix_hit_tokens is None
                            else timed.prefix_hit_tokens / sum(len(j.prompt_ids) for j in jobs)),
        "steps": timed.steps,
    }


def summarise(rounds: list[Round], jobs: list[Job]) -> dict[str, Any]:
    """One contender's medians over `rounds` (tokens/s with its range), its rounds' metrics and its first
    round's texts."""
    per_round = [round_metrics(r, jobs) for r in rounds]

    def med(key: str) -> float | None:
        values = [m[key] for m in per_round if m[key] is not None]
        return statistics.median(values) if values else None

    throughput = [m["tokens_per_s"] for m in per_round]
    first = [s.text for s in rounds[0].streams]
    accepted = [m["speculation"]["acceptance"] for m in per_round
                if m["speculation"] and m["speculation"]["acceptance"] is not None]
    return {
        "tokens_per_s": med("tokens_per_s"), "tokens_per_s_range": [min(throughput), max(throughput)],
        "output_tokens": med("output_tokens"),
        "ttft_p50_s": med("ttft_p50_s"), "ttft_p95_s": med("ttft_p95_s"),
        "itl_p50_s": med("itl_p50_s"), "itl_p95_s": med("itl_p95_s"),
        "request_p50_s": med("request_p50_s"), "request_p95_s": med("request_p95_s"),
        "acceptance": statistics.median(accepted) if accepted else None,
        "prefix_hit_rate": (None if per_round[0]["prefix_hit_rate"] is None else med("prefix_hit_rate")),
        "texts_same_every_round": sum(all(r.streams[i].text == t for r in rounds) for i, t in enumerate(first)),
        "rounds": per_round,
        "texts": first,
    }


def summarise_contenders(runs: dict[str, list[Round]], jobs: list[Job], *,
                         check_schemas: bool = False) -> dict[str, dict[str, Any]]:
    """`summarise` of every contender's rounds; with `check_schemas` (the json workload), each also counts, round
    by round, the answers that validate against their job's schema (``schema_valid``)."""
    summaries = {name: summarise(rounds, jobs) for name, rounds in runs.items()}
    if check_schemas:
        for name, rounds in runs.items():
            summaries[name]["schema_valid"] = [
                sum(schema_valid(stream.text, job) for stream, job in zip(r.streams, jobs)) for r in rounds]
    return summaries


def per_round_ratio(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """tokens/s of `a` over `b`, round by round (rounds alternate, so round r of each ran minutes apart)."""
    ratios = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(a["rounds"], b["rounds"], strict=True)]
    return {"median": statistics.median(ratios), "per_round": ratios}


def compare_pairs(summaries: dict[str, dict[str, Any]], contenders: Sequence[str]) -> dict[str, dict[str, Any]]:
    """For each pair ``A/B`` of `contenders` (in their order): ``identical_texts``, how many of the first
    rounds' texts are the same, and ``speed_ratios``, `per_round_ratio` of A over B."""
    pairs = list(itertools.combinations(contenders, 2))
    return {
        "identical_texts": {f"{a}/{b}": sum(x == y for x, y in zip(summaries[a]["texts"], summaries[b]["texts"]))
                            for a, b in pairs},
        "speed_ratios": {f"{a}/{b}": per_round_ratio(summaries[a], summaries[b]) for a, b in pairs},
    }


def print_report(results: dict[str, Any]) -> None:
    """Print the workload in one line, a markdown table of the contenders, the batcher's step split per round
    and every pair's identical texts and tokens/s ratio."""
    n = results["num_requests"]
    grounded, chat = results.get("workload") == "grounded", results.get("workload") in CHAT_WORKLOADS
    rows = [contender_row(name, r, n, results["references"] if grounded else None)
            for name, r in results["contenders"].items()]
    if chat:
        print(f"{n} {results['workload']} chat requests ({results['prompt_tokens']} prompt tokens, answers ended by "
              f"EOS or at their caps, {results['output_tokens']} tokens in all), {results['concurrency']} clients, "
              f"KV budget {mib(results['budget_bytes']):.1f} MiB, {results['threads']} threads")
    else:
        print(f"{n} requests ({results['prompt_tokens']} prompt, {results['output_tokens']} output tokens), "
              f"{results['concurrency']} clients, KV budget {mib(results['budget_bytes']):.1f} MiB, "
              f"{results['threads']} threads; prefix hits at most {results['prefix_hit_ceiling']:.1%} "
              "(each shared block computed once)")
    print(format_table(rows, list(rows[0])))
    for name, r in results["contenders"].items():
        for i, m in enumerate(r["rounds"]):
            steps = m["steps"]
            if steps is not None and steps["decode_steps"]:
                print(f"{name} round {i + 1}: decode steps {steps['decode_share']:.0%} of the step time "
                      f"({steps['decode_steps']} steps, {steps['decode_step_ms']:.0f} ms and "
                      f"{steps['decode_rows_mean']:.1f} rows each on average); prompt steps "
                      f"{steps['prompt_ms_per_token']:.2f} ms per prompt token")
    for pair, count in results["identical_texts"].items():
        ratio = results["speed_ratios"][pair]
        rounds = ", ".join(f"{x:.2f}" for x in ratio["per_round"])
        print(f"{pair}: identical texts {count}/{n}; tokens/s ratio {ratio['median']:.2f}x (rounds: {rounds})")


def contender_row(name: str, r: dict[str, Any], n: int, references: int | None) -> dict[str, Any]:
    """One contender's row of the printed table (`r`: its `summarise`); the json workload shows the schema-valid
    answers, the grounded one (`references` given) the answers EOS ended and the references copied, the standard
    one the prefix hits and the answers as long as asked."""
    row = {
        "contender": name,
        "tokens/s": r["tokens_per_s"],
        "range": f"{r['tokens_per_s_range'][0]:.1f}-{r['tokens_per_s_range'][1]:.1f}",
        "TTFT p50 / p95 s": f"{r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f}",
        "ITL p50 / p95 ms": f"{r['itl_p50_s'] * 1e3:.0f} / {r['itl_p95_s'] * 1e3:.0f}",
        "request p50 / p95 s": ("" if r.get("request_p50_s") is None
                                else f"{r['request_p50_s']:.2f} / {r['request_p95_s']:.2f}"),
    }
    if "schema_valid" in r:
        row |= {"output tokens": r["output_tokens"], "schema-valid": f"{min(r['schema_valid'])}/{n}"}
    elif references is not None:
        first = r["rounds"][0]
        row |= {"output tokens": r["output_tokens"],
                "ended by EOS": f"{first['finish_reasons'].get('stop', 0)}/{n}",
                "reference copied": f"{first['reference_in_answer']}/{references}"}
    else:
        row |= {"prefix hits": "" if r.get("prefix_hit_rate") is None else f"{r['prefix_hit_rate']:.1%}",
                "lengths as asked": f"{min(m['lengths_as_requested'] for m in r['rounds'])}/{n}"}
    row |= {"drafts accepted": "" if r.get("acceptance") is None else f"{r['acceptance']:.1%}",
            "same text every round": f"{r['texts_same_every_round']}/{n}"}
    return row
