#!/usr/bin/env bash
# Fill .whl/ and .gpu/ for tests/gpu/device_check.sh (docs/development.md, "The GPU check"): wheels
# for the GPU machine's Python 3.12 of the packages its image lacks or has in other versions, at
# the versions in .venv, and SmolLM2's tokenizer and config files. Run here, from the repository
# root, after `make test` or `make serve` has built .venv and converted the default model.
set -euo pipefail
PACKAGES="transformers huggingface_hub tokenizers kernels tomlkit pydantic pydantic_core annotated-types
  typing-inspection typing_extensions httpx2 httpcore2 anyio idna sniffio truststore typer click regex
  hf-xet llguidance peft accelerate psutil compressed-tensors loguru"
pins=$(.venv/bin/python - $PACKAGES <<'PY'
import sys
from importlib.metadata import version
print(" ".join(f"{name}=={version(name)}" for name in sys.argv[1:]))
PY
)
platforms=""
for tag in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34; do
  platforms="$platforms --platform ${tag}_x86_64"
done
mkdir -p .whl .gpu/smollm2-tokenizer
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || printf '/.whl/\n/.gpu/\n' >> .git/info/exclude
# shellcheck disable=SC2086
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $platforms -d .whl $pins
model=$(.venv/bin/python -c "from replica.worker.model_loader import DEFAULT_MODEL, resolve_model_path; print(resolve_model_path(DEFAULT_MODEL))")
cp "$model"/*.json "$model"/*.jinja .gpu/smollm2-tokenizer/ 2>/dev/null || cp "$model"/*.json .gpu/smollm2-tokenizer/
rm -f .gpu/smollm2-tokenizer/model.safetensors
du -sh .whl .gpu
