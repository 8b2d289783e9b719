"""The tiny local lm-evaluation-harness tasks of `tests/data/lm_eval_task`, and one harness run over them.

Imported only by modules that have already skipped themselves where lm-eval is not installed.
"""

from __future__ import annotations

from pathlib import Path

import lm_eval
import yaml
from lm_eval.tasks import TaskManager
from repo_paths import DATA

TASK_DIR = DATA / "lm_eval_task"
TASKS = ("paged_tiny_mc", "paged_tiny_gen")


def task_configs() -> list[dict]:
    """The shipped task YAMLs, with their data file made absolute (datasets resolves it against the cwd)."""
    configs = []
    for name in TASKS:
        config = yaml.safe_load((TASK_DIR / f"{name}.yaml").read_text(encoding="utf-8"))
        config["dataset_kwargs"]["data_files"]["test"] = str(TASK_DIR / "paged_tiny.jsonl")
        configs.append(config)
    return configs


def evaluate(model: str, model_dir: Path, extra_args: str = "") -> dict:
    return lm_eval.simple_evaluate(
        model=model,
        model_args=f"pretrained={model_dir},dtype=float32,device=cpu{extra_args}",
        tasks=task_configs(),
        batch_size=3,
        log_samples=True,
        bootstrap_iters=0,
        task_manager=TaskManager(include_defaults=False),  # skip indexing the harness's built-in tasks
    )
