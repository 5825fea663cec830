"""Run lm-evaluation-harness' simple_evaluate (in the lm-eval venv, tests/lm_eval_env.py) and write what
test_serve_lm_eval.py checks as JSON: python lm_eval_run.py MODEL_ARGS TASK_DIR OUT.json TASK [TASK ...]."""

from __future__ import annotations

import json
import sys


def main() -> None:
    model_args, task_dir, out, *tasks = sys.argv[1:]
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(model="local-completions", model_args=model_args, tasks=tasks,
                              task_manager=TaskManager(include_path=task_dir), log_samples=True,
                              random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    kept = {"results": {t: results["results"][t] for t in tasks},
            "samples": {t: [{"doc": s["doc"], "resps": s["resps"]} for s in results["samples"][t]] for t in tasks}}
    with open(out, "w", encoding="utf-8") as f:
        json.dump(kept, f, default=str)


if __name__ == "__main__":
    main()
