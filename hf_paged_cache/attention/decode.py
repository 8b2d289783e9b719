"""A decode forward's attention from the pool: one new token per row, all real, every row at once.

For a decode forward a loop over rows (`prefill`) costs more than it saves (two gathers and one SDPA call per row
and layer), and one padded call over all rows attends over the padding of the short rows. So the rows are
grouped by length (`KeyGroup`, built once per forward in the `DecodeReads`): each group's keys are gathered padded
to its longest row (all groups' in one gather, which several threads share: `gathers_rows`) and attended in one
masked call, the grouping chosen to minimize the keys read plus a fixed cost per call
(`reading.length_groups`): an SDPA call, or, with ``decode="products"`` (``paged_bmm``), in float32, two
batched matrix products and a softmax (`softmax.product_attention`), faster on CPUs at two threads but equal to
SDPA only up to float32 rounding. With ``decode="flex"`` (``paged_flex``), a float32 decode forward on a CPU whose
rows fall in two groups or more copies nothing: a compiled `flex_attention` reads each row's blocks in place
(`flex_decode`). When every row's keys fill consecutive slots (a row alone, whose blocks follow each other, or a
fresh batch), each row attends instead from a strided view of the pool, with no copy at all. When the rows share
their first keys in consecutive slots (beams, or samples of one prompt, reading the prompt's blocks), the shared
keys are attended once for all rows from a view and only each row's own tail is gathered; the two partial
softmaxes merge by their log-sum-exp (`SharedPrefix`, cascade attention). At more than one thread, float32
decode forwards hand SDPA each query head as a row of its own rather than folded into its key/value head's rows,
which gives the threads more work to share (`splits_query_heads`).

Each way is a strategy of its own (`DECODE_STRATEGIES`), picked for the forward by `decode_strategies`; groups of
rows attend by SDPA, by the explicit softmax (soft-capping, sinks) or by batched products (`DecodeCall`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .flex_decode import attend_flex, flex_decode_applies
from .reads import DecodeReads, PagedAttentionInputs, SharedPrefix, by_row
from .softmax import attention_with_lse, explicit_attention, merge_attention, product_attention

DECODE_KERNELS = ("sdpa", "products", "flex")
"""How a decode forward's rows attend: SDPA over gathered keys (``paged_sdpa``), batched products over them in
float32 (``paged_bmm``, `product_attention`), or a compiled `flex_attention` reading the blocks in place
(``paged_flex``, `flex_decode`)."""


@dataclass
class DecodeCall:
    """What every strategy of one layer's decode forward shares: the attention's settings and how the query heads
    meet their key/value heads."""

    heads: int  # H: key/value heads
    groups: int  # g: query heads per key/value head
    scale: float
    softcap: float | None
    sink_logits: torch.Tensor | None  # [1, H, g, 1]
    dropout: float
    kernel: str  # one of DECODE_KERNELS
    explicit: bool  # soft-capping or sinks: the explicit softmax, not SDPA
    plain: bool  # no soft-capping, sinks or dropout: the views, the cascade, products and flex may serve
    split_heads: bool  # SDPA takes the query heads one by one (`splits_query_heads`), not as rows of their head

    @classmethod
    def of(
        cls,
        query: torch.Tensor,
        heads: int,
        scaling: float | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
        dropout: float,
        kernel: str,
    ) -> DecodeCall:
        """The settings for `query` ``[B, Hq, 1, D]`` over `heads` key/value heads."""
        query_heads, key_dim = query.shape[1], query.shape[-1]
        groups = query_heads // heads
        explicit = softcap is not None or sinks is not None
        split_heads = groups > 1 and not explicit and query.dtype == torch.float32 and splits_query_heads()
        return cls(
            heads, groups, scaling if scaling is not None else key_dim**-0.5, softcap,
            None if sinks is None else sinks.view(1, heads, groups, 1), dropout, kernel, explicit,
            softcap is None and sinks is None and dropout == 0.0, split_heads,
        )

    def attend(
        self, row_query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """One call over rows of queries, ``[n, Hq, 1, D]`` with `split_heads` else ``[n, H, g, D]``, and their
        ``[n, H, kv, D]`` keys (a mask: ``[n, 1, 1, kv]``); returns the queries' layout with ``Dv``."""
        if self.explicit:
            return explicit_attention(
                row_query, keys, values, mask, self.scale, self.softcap, self.sink_logits, self.dropout
            )
        return F.scaled_dot_product_attention(
            row_query, keys, values, attn_mask=mask, dropout_p=self.dropout, scale=self.scale,
            enable_gqa=self.split_heads,
        )


def attend_decode(
    query: torch.Tensor,
    inputs: PagedAttentionInputs,
    reads: DecodeReads,
    scaling: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    dropout: float,
    decode: str,
) -> torch.Tensor:
    """One new token per row: each group of rows at once over its padded keys (or views, or the cascade, or in
    place by `flex_decode`); returns ``[B, 1, Hq, Dv]``. `decode`: one of `DECODE_KERNELS` (``products``: float32
    groups by `product_attention`; ``flex``: float32 rows read in place; both on plain storage only)."""
    call = DecodeCall.of(query, inputs.num_kv_heads, scaling, softcap, sinks, dropout, decode)
    for name in decode_strategies(query, inputs, reads, call):
        out = DECODE_STRATEGIES[name](query, inputs, reads, call)
        if out is not None:
            return out
    raise AssertionError("only `in_place` declines, and never last")


def decode_strategies(
    query: torch.Tensor, inputs: PagedAttentionInputs, reads: DecodeReads, call: DecodeCall
) -> tuple[str, ...]:
    """The `DECODE_STRATEGIES` a decode forward tries, in order: the first that attends it (returns a tensor) serves.

    ``in_place`` (``paged_flex``) first where it may serve (it declines where the kernel cannot run): rows alike
    (one group) are attended as fast by one SDPA call over their gathered keys. Then views of each row's run of
    consecutive slots, else the cascade over the keys all rows share, else the gathered groups (by batched
    products with ``paged_bmm``, in float32 on plain storage)."""
    if reads.runs is not None:
        chosen = "views"
    elif reads.shared is not None and call.plain:
        chosen = "cascade"
    elif (
        call.kernel == "products" and call.plain and query.dtype == torch.float32
        and inputs.keys.plain is not None and inputs.values.plain is not None
    ):
        chosen = "products"
    else:
        chosen = "gathered"
    if call.kernel == "flex" and call.plain and reads.blocks is not None and len(reads.groups) > 1:
        return "in_place", chosen
    return (chosen,)


def attend_in_place(
    query: torch.Tensor, inputs: PagedAttentionInputs, reads: DecodeReads, call: DecodeCall
) -> torch.Tensor | None:
    """``[B, 1, Hq, Dv]`` by the compiled `flex_attention` reading each row's blocks in place (`flex_decode`), or
    None where it cannot run (storage not plain float32 on a CPU, a failed compile)."""
    keys, values = inputs.keys.plain, inputs.values.plain  # [H, slots, D] or None
    if values is None or not flex_decode_applies(query, keys):
        return None
    with inputs.lock.shared():  # the storage is read in place
        flex_reads = reads.flex_reads(call.groups, keys.shape[1], query.device)
        return attend_flex(query, keys, values, flex_reads, call.scale)


def attend_views(
    query: torch.Tensor, inputs: PagedAttentionInputs, reads: DecodeReads, call: DecodeCall
) -> torch.Tensor:
    """``[B, 1, Hq, Dv]``: a decode forward whose rows each hold their keys in one run of consecutive slots
    (`DecodeReads.runs`), each row attending from views of the storage (no copy, one call per row)."""
    batch_size, query_heads, _, key_dim = query.shape
    # [B, Hq, 1, D] as given when the query heads go one by one, else [B, H, g, D]: query head kv * g + j reads
    # key/value head kv, its g heads as g query rows
    rows = query if call.split_heads else query.view(batch_size, call.heads, call.groups, key_dim)
    with inputs.lock.shared():  # views of the storage: read them before letting the lock go
        outs = [
            call.attend(
                rows if batch_size == 1 else rows[b : b + 1], inputs.keys.run(*run), inputs.values.run(*run), None
            )
            for b, run in enumerate(reads.runs)
        ]  # per row, read from [1, H, n, D] views of its keys and values
        out = outs[0] if batch_size == 1 else torch.cat(outs)  # [B, Hq, 1, Dv] or [B, H, g, Dv]
        return out.reshape(batch_size, 1, query_heads, -1)  # one query per row: both order its heads alike


def attend_cascade(
    query: torch.Tensor, inputs: PagedAttentionInputs, reads: DecodeReads, call: DecodeCall
) -> torch.Tensor:
    """``[B, 1, Hq, Dv]``: the keys all rows share (`DecodeReads.shared`) attended once for all, merged with each
    row's own tail (`_cascade`)."""
    batch_size, query_heads, _, key_dim = query.shape
    # [B, H, g, D]: query head kv * g + j reads key/value head kv, its g heads as g query rows
    grouped = query.view(batch_size, call.heads, call.groups, key_dim)
    with inputs.lock.shared():
        out = _cascade(grouped, inputs, reads.shared, call.scale)  # [B, H, g, Dv]
        return out.reshape(batch_size, 1, query_heads, -1)


def attend_gathered(
    query: torch.Tensor, inputs: PagedAttentionInputs, reads: DecodeReads, call: DecodeCall
) -> torch.Tensor:
    """``[B, 1, Hq, Dv]``: each group of rows by one call (SDPA, or the explicit softmax) over its gathered keys."""
    return _attend_groups(query, inputs, reads, call, _group_by_call, always_row_major=False)


def attend_by_products(
    query: torch.Tensor, inputs: PagedAttentionInputs, reads: DecodeReads, call: DecodeCall
) -> torch.Tensor:
    """``[B, 1, Hq, Dv]``: each group of rows by batched products over its gathered keys (``paged_bmm``, float32,
    plain storage)."""
    return _attend_groups(query, inputs, reads, call, _group_by_products, always_row_major=True)


DECODE_STRATEGIES: dict[str, Callable[..., torch.Tensor | None]] = {
    "in_place": attend_in_place,
    "views": attend_views,
    "cascade": attend_cascade,
    "products": attend_by_products,
    "gathered": attend_gathered,
}
"""A decode forward's ways to attend, by name (`decode_strategies` picks them): each takes ``(query, inputs, reads,
call)`` and returns ``[B, 1, Hq, Dv]`` (``in_place`` may decline: None)."""


def _attend_groups(
    query: torch.Tensor,
    inputs: PagedAttentionInputs,
    reads: DecodeReads,
    call: DecodeCall,
    attend_group: Callable[[DecodeCall, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
    always_row_major: bool,
) -> torch.Tensor:
    """``[B, 1, Hq, Dv]``: every group's keys gathered in one copy, then each group attended by `attend_group`
    (``[n, H, g, Dv]`` from ``[n, H, g, D]`` queries over the group's ``[n, H, kv, D]`` keys). `always_row_major`:
    gather as rows of the storage seen as ``[H * slots, D]`` even at one thread (plain storage only)."""
    batch_size, query_heads, _, key_dim = query.shape
    # [B, H, g, D]: query head kv * g + j reads key/value head kv, its g heads as g query rows
    grouped = query.view(batch_size, call.heads, call.groups, key_dim)
    with inputs.lock.shared():
        key_storage, value_storage = inputs.keys.plain, inputs.values.plain  # [H, slots, D] or None
        plain_storage = key_storage is not None and value_storage is not None
        row_major = plain_storage and (always_row_major or gathers_rows())
        if row_major:
            keys, values = _gather_row_major(key_storage, reads), _gather_row_major(value_storage, reads)
        else:
            keys = inputs.keys.gather(reads.slots)  # [H, N, D]: every group's keys, one copy
            values = inputs.values.gather(reads.slots)  # [H, N, Dv]
    # per group [n, H, kv, D] (contiguous when gathered row-major)
    key_parts, value_parts = _group_parts(keys, reads, row_major), _group_parts(values, reads, row_major)
    if reads.groups[0].rows is None:  # one group of every row
        out = attend_group(call, grouped, key_parts[0], value_parts[0], reads.groups[0].mask)
        return out.reshape(batch_size, 1, query_heads, -1)  # [B, H, g, Dv] -> [B, 1, Hq, Dv]
    out = grouped.new_empty(batch_size, call.heads, call.groups, value_parts[0].shape[-1])  # [B, H, g, Dv]
    for group, group_keys, group_values in zip(reads.groups, key_parts, value_parts):
        out.index_copy_(0, group.rows, attend_group(call, grouped[group.rows], group_keys, group_values, group.mask))
    return out.reshape(batch_size, 1, query_heads, -1)


def _group_by_call(
    call: DecodeCall, row_query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """``[n, H, g, Dv]`` from ``[n, H, g, D]`` queries over ``[n, H, kv, D]`` keys (a mask: ``[n, 1, 1, kv]``) by
    `DecodeCall.attend`, the query heads one by one where it splits them."""
    rows = row_query.shape[0]
    if call.split_heads:
        row_query = row_query.reshape(rows, call.heads * call.groups, 1, row_query.shape[-1])  # [n, Hq, 1, D]
    return call.attend(row_query, keys, values, mask).view(rows, call.heads, call.groups, -1)  # -> [n, H, g, Dv]


def _group_by_products(
    call: DecodeCall, row_query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """``[n, H, g, Dv]`` likewise, by `product_attention`."""
    return product_attention(row_query, keys, values, mask, call.scale)


def gathers_rows() -> bool:
    """Whether a decode forward gathers its keys as rows of the storage seen as ``[H * slots, D]``
    (`_gather_row_major`): one ``index_select`` that several threads share, where a select along the slots of
    ``[H, slots, D]`` runs on one (SmolLM2's gather of 16 rows of 300 keys: 0.24 against 0.35 ms at two
    threads). At one thread the select along the slots is the faster (0.32 against 0.35 ms)."""
    return torch.get_num_threads() > 1


def splits_query_heads() -> bool:
    """Whether float32 decode forwards hand SDPA their query heads one by one (``[n, Hq, 1, D]`` with
    ``enable_gqa``, as transformers' ``sdpa`` does) rather than as the query rows of their key/value head
    (``[n, H, g, D]``): at more than one thread.

    SDPA's CPU kernel shares its work among threads by (row, head) pair: a row of SmolLM2 (3 key/value heads,
    9 query heads) gives two threads 3 pairs grouped and 9 split. Alternated decode forwards at two threads
    (SmolLM2, packed linear layers) ran 1.03x-1.05x faster split at batch 1 (512 keys), 1.02x-1.04x on ragged
    rows and 1.03x on 16 equal rows; with the stock linear kernels, 1.01x at batch 1 and 0.98x-1.01x on
    ragged and equal rows, within noise. At one thread grouped is as fast or faster (0.99x split at batch 1
    and on 11 ragged rows). In bfloat16 the kernel is slow with one query row per head (16 rows of 301 keys, 30
    layers: 115 against 23 ms at two threads), so bfloat16 stays grouped. The same values either way up to
    float32 summation order (SmolLM2 at batch 1: `DynamicCache`'s logits to the last bit).
    """
    return torch.get_num_threads() > 1


def _gather_row_major(storage: torch.Tensor, reads: DecodeReads) -> torch.Tensor:
    """``[N * H, D]``: every group's keys (or values) from ``[H, slots, D]`` storage, group after group, each
    group's ``[n, H, kv, D]`` contiguous (`DecodeReads.row_major_rows`); a copy."""
    heads, capacity, dim = storage.shape
    return storage.view(heads * capacity, dim).index_select(0, reads.row_major_rows(heads, capacity))


def _group_parts(gathered: torch.Tensor, reads: DecodeReads, row_major: bool) -> list[torch.Tensor]:
    """Each group's ``[n, H, kv, D]`` keys (or values) out of a decode forward's one gather: ``[N * H, D]`` from
    `_gather_row_major` (each group's part contiguous), else ``[H, N, D]`` (each a view of a slice along the
    slots)."""
    shapes = reads.group_shapes()
    sizes = [rows * length for rows, length in shapes]  # per group n * kv
    if not row_major:
        return [by_row(part, rows) for part, (rows, _) in zip(gathered.split(sizes, 1), shapes)]
    heads = gathered.shape[0] // sum(sizes)
    parts = gathered.split([heads * size for size in sizes])
    return [part.view(rows, heads, length, gathered.shape[-1]) for part, (rows, length) in zip(parts, shapes)]


def _cascade(grouped: torch.Tensor, inputs: PagedAttentionInputs, shared: SharedPrefix, scale: float) -> torch.Tensor:
    """``[B, H, g, Dv]``: a decode forward's attention, the shared prefix read once for all rows (a view, no
    copy) and each row's own tail gathered, merged by log-sum-exp. Call with the storage lock held."""
    batch_size, heads, groups, key_dim = grouped.shape
    run = (shared.first, shared.count)
    # [1, H, B * g, D]: every row's queries read the same prefix keys, as one batch of query rows
    stacked = grouped.transpose(0, 1).reshape(1, heads, batch_size * groups, key_dim)
    prefix_out, prefix_lse = attention_with_lse(
        stacked, inputs.keys.run(*run), inputs.values.run(*run), None, scale
    )  # [1, H, B * g, Dv], [1, H, B * g]
    prefix_out = prefix_out.view(heads, batch_size, groups, -1).transpose(0, 1)  # [B, H, g, Dv]
    prefix_lse = prefix_lse.view(heads, batch_size, groups).transpose(0, 1)  # [B, H, g]
    keys = by_row(inputs.keys.gather(shared.tail_slots), batch_size)  # [B, H, kv', D]
    values = by_row(inputs.values.gather(shared.tail_slots), batch_size)  # [B, H, kv', Dv]
    # [B, H, g, Dv], [B, H, g]
    tail_out, tail_lse = attention_with_lse(grouped, keys, values, shared.tail_mask, scale)
    return merge_attention(prefix_out, prefix_lse, tail_out, tail_lse)
