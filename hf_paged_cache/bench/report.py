"""Command-line options, model loading and JSON / markdown output shared by the benchmark scripts."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..kernels import cpu_capability, mkl_takes_fast_path
from ..kernels.cpu_capability import cpu_model_name
from ..models import add_model_arguments, load_model_and_tokenizer


def add_common_args(parser: argparse.ArgumentParser, *, out: str | None, out_help: str | None = None) -> None:
    """``--model --device --dtype --threads --seed --out``, shared by every script.

    `out` is the default JSON path; a script whose default depends on its mode passes None and says so in
    `out_help`, then picks the path itself.
    """
    add_model_arguments(parser)
    parser.add_argument(
        "--threads", type=int, default=None,
        help="torch.set_num_threads (default: torch's choice); on a shared CPU 1 thread is far less noisy",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument("--out", default=out, help=out_help or f"JSON output path (default: {out})")


def add_workload_args(parser: argparse.ArgumentParser, *, num_requests: int) -> None:
    """``--num-requests --max-prompt --max-new --output-scale``: the ShareGPT-shaped workload (`sharegpt_workload`
    and its `scaled_output_lens`) of the scripts that serve it, with `num_requests` as the default count."""
    parser.add_argument("--num-requests", type=int, default=num_requests, help=f"requests (default: {num_requests})")
    parser.add_argument("--max-prompt", type=int, default=256, help="cap on prompt tokens (default: 256)")
    parser.add_argument("--max-new", type=int, default=128, help="cap on output tokens (default: 128)")
    parser.add_argument("--output-scale", type=float, default=0.25,
                        help="multiplies the drawn output lengths before the cap (default: 0.25)")


def load(args: argparse.Namespace) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Apply ``--threads`` and load ``--model`` on ``--device`` / ``--dtype`` (left padding, pad token set)."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(args.model, device=args.device, dtype=args.dtype)
    return model, tokenizer


def pad_token_id(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> int:
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = model.generation_config.pad_token_id
    return int(pad) if pad is not None else 0


def machine_info(device: torch.device | str) -> dict[str, Any]:
    """CPU model and capability level (`cpu_capability`), cores, library versions, whether MKL runs its own kernels here (`mkl_takes_fast_path`), device
    name, date: what a reader needs to weigh the numbers."""
    device = torch.device(device)
    cpu = cpu_model_name()
    info: dict[str, Any] = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_capability": cpu_capability().describe(),
        "mkl_fast_path": mkl_takes_fast_path(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if hasattr(os, "getloadavg"):
        info["load_average_1m"] = os.getloadavg()[0]
    return info


def write_json(path: str | os.PathLike[str], payload: dict[str, Any], device: torch.device | str) -> Path:
    """Write `payload` plus ``machine`` (see `machine_info`) to `path`, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = dict(payload)
    data["machine"] = machine_info(device)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A markdown table of `rows` (floats to 3 significant decimals)."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 1000 else f"{value:,.0f}"
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
            return f"{value:,}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(" --- " for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def mib(num_bytes: float) -> float:
    return num_bytes / 2**20
