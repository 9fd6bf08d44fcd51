"""The long training runs of module 04 shipped in ``llmu/data/training_runs.json``
(``benchmarks/training_runs.py``), replayed live for their first steps.

Notebook 04 says that its live curves lie on the recorded ones because they are the same runs:
the same functions, settings, seed and learning-rate schedule. These tests run the first steps of
the recorded pretraining and SFT runs exactly as the script does and compare every step's numbers
with the file's. (The recorded DPO run starts from the model after all 48 SFT steps, minutes of
training, so it is not replayed here; its first step, always at log 2, is checked by
``test_notebook_04.py``.)

Tolerances: the runs are recorded on one thread, and the replays run on one thread too, but the
same float32 sums can still round differently from one machine, build or moment to the next. A
replay here agreed with the file to 4e-7 of the loss and 3e-5 of the gradient norm after 60
pretraining steps, and to 3e-7 in both after 2 SFT steps. Rounding differences grow as training
goes on, so the bounds below are a hundred times those; a different seed, batch, schedule,
setting or text changes the loss within a few steps by far more (the loss falls from 5.6 to 2.5
over these 50 steps).
"""

from __future__ import annotations

import pytest

from llmu.bench.machine import Threads
from llmu.data import json as shipped_json
from llmu.training.runs import pretrain_small, sft_lora

PRETRAIN_STEPS = 50   # two held-out measurements (steps 25 and 50) besides the one before training
SFT_STEPS = 2         # the second step follows the first update: the optimizer and the schedule


@pytest.fixture(scope="module")
def record():
    return shipped_json("training_runs")


def _compare(live: list[dict], recorded: list[dict], keys: dict[str, float], exact=()):
    assert len(live) <= len(recorded)
    for got, want in zip(live, recorded, strict=False):
        assert got["step"] == want["step"]
        for key in exact:
            assert got[key] == want[key], (got["step"], key)
        for key, rel in keys.items():
            assert got[key] == pytest.approx(want[key], rel=rel), (got["step"], key, got[key], want[key])


def test_pretraining_replays_the_recorded_run(record):
    rec = record["pretrain"]
    with Threads(record["threads"]):  # the recorded runs' count, restored after
        _, live = pretrain_small(PRETRAIN_STEPS, schedule_steps=rec["settings"]["schedule_steps"],
                                 seed=record["seed"], **record["settings"]["pretrain"])
    assert live["settings"]["parameters"] == rec["settings"]["parameters"]
    assert live["settings"]["train_bytes"] == rec["settings"]["train_bytes"]
    _compare(live["train"], rec["train"], {"loss": 1e-4, "grad_norm": 3e-3, "lr": 1e-12})
    recorded_heldout = {row["step"]: row["loss"] for row in rec["heldout"]}
    steps = [row["step"] for row in live["heldout"]]
    assert steps == [0, 25, 50] and all(step in recorded_heldout for step in steps)
    for row in live["heldout"]:
        assert row["loss"] == pytest.approx(recorded_heldout[row["step"]], rel=1e-4), row


@pytest.mark.slow  # loads SmolLM2 (a fresh copy: LoRA changes it)
def test_sft_replays_the_recorded_run(record, smollm2):
    from llmu.models import load_model
    from llmu.training.lora import add_lora
    from llmu.training.sft import sft_examples

    _, tokenizer = smollm2
    rec = record["sft"]
    examples = sft_examples()
    train = examples[:rec["n_train"]]         # the script holds the last examples out
    with Threads(record["threads"]):  # the recorded runs' count, restored after
        model = load_model(fresh=True)
        add_lora(model, seed=record["seed"], **record["settings"]["lora"])
        live = sft_lora(model, tokenizer, train, SFT_STEPS, schedule_steps=len(rec["steps"]), seed=record["seed"],
                        **record["settings"]["sft"])
    _compare(live, rec["steps"], {"loss": 1e-4, "grad_norm": 1e-4, "lr": 1e-12}, exact=("tokens",))
