"""advise's per-rank ZeRO model states against what DeepSpeed 0.19.8 holds on each of two CPU processes (gloo),
running copt train's engine with the config copt train writes (zero_states_worker.py): 16-bit weights (full at
ZeRO-1/2, a half at ZeRO-3), fp32 master partition + Adam moments (a half). Gradients are not compared here (they
live only inside a step). DeepSpeed's CPU communication op compiles on first use: marked jit like the other
multi-process ZeRO tests. One torchrun launch measures every selected stage in turn (module fixture): a launch's two
ranks spend most of their time importing torch, transformers and DeepSpeed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

WORKER = Path(__file__).with_name("zero_states_worker.py")


@pytest.fixture(scope="module")
def measured(request, tmp_path_factory) -> Path:
    """Run the worker once for the stages of this module's selected tests; returns its output directory
    (stage{N}/rank{R}.json)."""
    test = "test_zero_model_states_per_rank_match_advise"
    stages = sorted({item.callspec.params["stage"] for item in request.session.items
                     if item.module is request.module and item.originalname == test})
    out = tmp_path_factory.mktemp("zero-states")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(WORKER), ",".join(map(str, stages)), str(out)], capture_output=True, text=True,
                          env=env, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.jit
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_model_states_per_rank_match_advise(stage: int, measured: Path) -> None:
    from clusteropt_cli.core.advise import api
    from clusteropt_cli.core.advise.memory import ds_settings
    from clusteropt_cli.core.advise.plan import TrainPlan
    from clusteropt_cli.modelspec import load_model_spec
    from tests.integration.zero_states_worker import CONFIG

    ranks = [json.loads((measured / f"stage{stage}" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["stage"] == stage for r in ranks)

    spec = load_model_spec(dict(CONFIG))
    assert spec.num_params == ranks[0]["num_params"]
    target = api.resolve_target("h200", gpus=2)[0]
    plan = TrainPlan(micro_batch=2, seq_len=32, zero=stage)
    result = api.advise(spec, target, plan, model_arg="llama")
    predicted = result["memory"]["breakdown"]
    for rank in ranks:
        assert rank["weights"] == pytest.approx(predicted["weights"], rel=0.01), rank
        assert rank["optimizer"] == pytest.approx(predicted["optimizer"], rel=0.01), rank
    # the buffers advise sizes come from the config DeepSpeed ran with
    assert ranks[0]["engine_reduce_bucket_size"] == ds_settings(plan, 2)["reduce_bucket_size"] == 5e7
