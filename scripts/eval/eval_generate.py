"""Greedy generation with DynamicCache vs PagedCache on ragged prompts: exact match and memory.

The prompts (scripts/eval/data/eval_prompts.jsonl by default: one JSON object per line with "id" and "prompt")
are chat-templated when the tokenizer has a chat template, left-padded into batches and generated greedily
twice per batch, once with a DynamicCache and once with a PagedCache (hf_paged_cache.eval.generation).
With --batcher, every prompt also goes through a ContinuousBatcher, timed against the DynamicCache runs. The
comparison and the batcher each run on a thread of their own (`in_fresh_thread`), so that the batcher's loop
does not inherit the OpenMP worker pool the comparison leaves behind.

Example:
    python scripts/eval/eval_generate.py --json results/eval_generate.json
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import transformers

import hf_paged_cache
from hf_paged_cache.bench import in_fresh_thread
from hf_paged_cache.eval.generation import batcher_generation, compare_generation, encode_prompts, until_eos
from hf_paged_cache.models import add_model_arguments, load_model_and_tokenizer

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "data" / "eval_prompts.jsonl"


def read_prompts(path: Path) -> list[dict[str, str]]:
    """The ``{"id", "prompt"}`` records of a JSONL file (blank lines skipped)."""
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        record = json.loads(line)
        if not isinstance(record.get("prompt"), str):
            raise ValueError(f"{path}:{number}: each line needs a string 'prompt'")
        record.setdefault("id", str(number))
        records.append(record)
    if not records:
        raise ValueError(f"{path} holds no prompts")
    return records


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument(
        "--prompts", type=Path, default=DEFAULT_PROMPTS,
        help="JSONL file of prompts (default: scripts/eval/data/eval_prompts.jsonl)",
    )
    parser.add_argument("--batch-size", type=int, default=4, help="prompts per ragged batch (default: 4)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per prompt (default: 32)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per PagedCache block (default: 16)")
    parser.add_argument("--no-chat-template", action="store_true", help="feed the raw prompts")
    parser.add_argument("--json", type=Path, default=None, help="write the results to this JSON file (default: none)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument(
        "--batcher", action="store_true",
        help="also generate every prompt through the ContinuousBatcher and compare it and its time with generate",
    )
    return parser


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the comparison described by `argv` (default: ``sys.argv``); print tables and return the results."""
    args = build_parser().parse_args(argv)
    records = read_prompts(args.prompts)
    model, tokenizer = load_model_and_tokenizer(args.model, device=args.device, dtype=args.dtype)
    use_template = False if args.no_chat_template else None
    prompt_ids = encode_prompts(tokenizer, [r["prompt"] for r in records], use_chat_template=use_template)
    comparison = in_fresh_thread(
        compare_generation,
        model,
        prompt_ids,
        pad_token_id=tokenizer.pad_token_id,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        block_size=args.block_size,
        progress=not args.no_progress,
    )

    per_prompt = []
    print(f"{'#':>2} {'id':<22} {'prompt tok':>10} {'match':>5}  paged output")
    for index, record in enumerate(records):
        generated = comparison.paged_tokens[index]
        text = str(tokenizer.decode(generated, skip_special_tokens=True))
        match = generated == comparison.dynamic_tokens[index]
        per_prompt.append(
            {"id": record["id"], "prompt_tokens": len(prompt_ids[index]), "exact_match": match, "paged_text": text}
        )
        preview = text.replace("\n", " ")[:60]
        print(f"{index:>2} {record['id'][:22]:<22} {len(prompt_ids[index]):>10} {'yes' if match else 'NO':>5}  {preview}")

    print()
    print(f"{'batch':>5} {'prompts':<14} {'padded len':>10} {'dynamic MiB':>12} {'paged reserved MiB':>19} {'paged used MiB':>15}")
    for number, batch in enumerate(comparison.batches):
        print(
            f"{number:>5} {batch.prompt_indices!s:<14} {batch.padded_length:>10} {_mib(batch.dynamic_bytes):>12} "
            f"{_mib(batch.paged_bytes_reserved):>19} {_mib(batch.paged_bytes_used):>15}"
        )
    print(
        f"{'total':>5} {'':<14} {'':>10} {_mib(comparison.dynamic_bytes):>12} "
        f"{_mib(comparison.paged_bytes_reserved):>19} {_mib(comparison.paged_bytes_used):>15}"
    )
    print()
    print(
        f"exact match: {comparison.exact_matches}/{comparison.prompts} prompts "
        f"({comparison.exact_match_rate:.1%}), {comparison.tokens_matching}/{comparison.tokens_compared} tokens; "
        f"max |logit diff| before divergence: {comparison.max_abs_logit_diff:.3g}"
    )
    if comparison.first_divergence is not None:
        d = comparison.first_divergence
        print(
            f"first divergence: prompt {d.prompt_index} ({records[d.prompt_index]['id']}), generated token {d.position}: "
            f"dynamic {d.dynamic_token} vs paged {d.paged_token}"
        )
    else:
        print("first divergence: none")
    print(
        f"seconds (wall / CPU): dynamic {comparison.dynamic_seconds:.1f} / {comparison.dynamic_cpu_seconds:.1f}, "
        f"paged {comparison.paged_seconds:.1f} / {comparison.paged_cpu_seconds:.1f}"
    )

    batched = None
    if args.batcher:
        run = in_fresh_thread(
            batcher_generation, model, prompt_ids, max_new_tokens=args.max_new_tokens, block_size=args.block_size
        )
        eos = model.generation_config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        same = sum(until_eos(d, eos_ids) == b for d, b in zip(comparison.dynamic_tokens, run.tokens, strict=True))
        batched = {"exact_matches": same, "seconds": run.seconds, "cpu_seconds": run.cpu_seconds,
                   "seconds_saved_vs_dynamic": comparison.dynamic_seconds - run.seconds}
        print(
            f"batcher: {same}/{len(prompt_ids)} prompts identical to dynamic generate; {run.seconds:.1f} s wall "
            f"({run.cpu_seconds:.1f} CPU) against dynamic {comparison.dynamic_seconds:.1f} s: "
            f"{comparison.dynamic_seconds - run.seconds:.1f} s saved"
        )

    results: dict[str, Any] = {
        "model": args.model or "HuggingFaceTB/SmolLM2-135M-Instruct",
        "model_path": getattr(model, "name_or_path", None),
        "prompts_file": str(args.prompts),
        "settings": {
            "batch_size": args.batch_size,
            "max_new_tokens": args.max_new_tokens,
            "block_size": args.block_size,
            "dtype": str(model.dtype).removeprefix("torch."),
            "device": args.device,
            "chat_template": bool(getattr(tokenizer, "chat_template", None)) and not args.no_chat_template,
        },
        "versions": {
            "hf_paged_cache": hf_paged_cache.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "summary": {
            key: value
            for key, value in comparison.to_dict().items()
            if key not in ("batches", "dynamic_tokens", "paged_tokens")
        },
        "batches": [asdict(b) for b in comparison.batches],
        "per_prompt": per_prompt,
        "batcher": batched,
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
