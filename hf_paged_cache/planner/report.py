"""The plan as text: Markdown tables of the layer groups, the caches and the fixed pool, then the assumptions."""

from __future__ import annotations

from ..pool.memory import format_memory
from .estimate import CACHES, MemoryPlan, PoolFit


def format_bytes(num_bytes: float) -> str:
    """``1536 -> '1.5 KiB'``: binary units, 4 significant digits."""
    return format_memory(num_bytes, ".4g")


def format_plan(plan: MemoryPlan) -> str:
    """The plan as Markdown tables (plain text reads fine too), assumptions last."""
    lens = plan.prompt_lens
    shown = ", ".join(map(str, lens[:8])) + (", ..." if len(lens) > 8 else "")
    prompts = f"{lens[0]}-token prompts" if len(set(lens)) == 1 else f"prompts of {shown} tokens (longest {max(lens)})"
    lines = [f"KV memory plan: {plan.model}, {plan.dtype}", "",
             f"{plan.batch_size} rows: {prompts} + {plan.new_tokens} new tokens each; PagedCache blocks of "
             f"{plan.block_size} tokens; StaticCache max_cache_len {plan.max_cache_len}.", "",
             *_layer_table(plan), "",
             f"Weights: {format_bytes(plan.weights.num_bytes)} ({plan.weights.source}).", "", *_state_lines(plan),
             *_cache_table(plan)]
    if plan.free_bytes is not None:
        lines += ["", f"Free for the KV cache: {format_bytes(plan.max_memory)} - "
                  f"{format_bytes(plan.weights.num_bytes)} of weights = {format_bytes(max(plan.free_bytes, 0))}."]
    if plan.paged_pool is not None:
        lines += ["", *_pool_lines(plan, plan.paged_pool)]
    return "\n".join([*lines, "", "Assumptions:", *(f"- {note}" for note in plan.assumptions)])


def _layer_table(plan: MemoryPlan) -> list[str]:
    """Per layer group: its layers, what they cache per token and per block."""
    lines = ["| layers | caching | per layer: KV heads x (key + value dims) | KV per token | KV per block |",
             "|---|---|---|---:|---:|"]
    for g in plan.groups:
        shapes = ", ".join(f"{s.num_heads} x ({s.key_dim} + {s.value_dim})" for s in g.layer_shapes)
        lines.append(f"| {g.num_layers} | {g.name} | {shapes} | {g.bytes_per_token:,} B | "
                     f"{format_bytes(g.bytes_per_block)} |")
    if len(plan.groups) > 1:
        lines.append(f"| {sum(g.num_layers for g in plan.groups)} | all | | {plan.bytes_per_token:,} B | "
                     f"{format_bytes(plan.bytes_per_block)} |")
    return lines


def _state_lines(plan: MemoryPlan) -> list[str]:
    """One sequence's conv / recurrent states, in every cache's bytes below (nothing for a model without)."""
    if not plan.state_bytes:
        return []
    slots = (f"; PagedCache sets aside {plan.max_sequences} slots of them (max_sequences) before it buys blocks"
             if plan.max_sequences else "")
    return [f"Conv / recurrent states: {format_bytes(plan.state_bytes)} per sequence, held per row by every cache "
            f"(included below){slots}.", ""]


def _cache_table(plan: MemoryPlan) -> list[str]:
    """Per cache: the batch's KV (per group too, for several), and the rows that fit where known."""
    fit = plan.rows_that_fit
    columns = ["cache", "KV for the batch", "per row (mean)", *(g.name for g in plan.groups if len(plan.groups) > 1)]
    if fit is not None:
        where = f" in {format_bytes(plan.max_memory)}" if plan.max_memory is not None else ""
        columns += [f"rows that fit{where}", f"batch of {plan.batch_size} fits"]
    lines = ["| " + " | ".join(columns) + " |", "|---|" + "---:|" * (len(columns) - 1)]
    for cache in CACHES:
        cells = [f"{cache} ({plan.paged_blocks:,} blocks)" if cache == "PagedCache" else cache,
                 format_bytes(plan.kv_bytes[cache]), format_bytes(plan.kv_bytes[cache] / plan.batch_size)]
        cells += [format_bytes(g.kv_bytes[cache]) for g in plan.groups if len(plan.groups) > 1]
        if fit is not None:
            cells += ([f"{fit[cache]:,}", "yes" if fit[cache] >= plan.batch_size else "no"] if cache in fit
                      else ["(needs --max-memory)", ""])
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _pool_lines(plan: MemoryPlan, pool: PoolFit) -> list[str]:
    """The fixed PagedCache pool: its blocks, and for several layer groups the rows each group holds."""
    sized = "as num_blocks asks" if pool.sized_by == "num_blocks" else "what the free memory buys"
    head = f"PagedCache pool: {pool.num_blocks:,} blocks of {plan.block_size} tokens"
    slots = plan.max_sequences
    capped = (f" Its {slots} state slots (max_sequences) hold {slots} of them." if slots is not None and slots < pool.rows
              else "")
    if len(plan.groups) == 1:
        return [f"{head} ({sized}; block 0 is the reserved null block): {pool.rows:,} rows of this mix fit.{capped}"]
    lines = [f"{head} in every layer group ({sized}; block 0 is the reserved null block), so the group that "
             "holds the fewest rows binds:", "",
             "| layer group | blocks the batch's rows hold at most | rows that fit |", "|---|---:|---:|"]
    for name, rows in pool.rows_per_group.items():
        binds = " (binds)" if name == pool.binding_group else ""
        lines.append(f"| {name} | {pool.peak_blocks[name]:,} | {rows:,}{binds} |")
    return [*lines, "", capped.strip()] if capped else lines
