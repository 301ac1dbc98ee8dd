"""Where inductor keeps Carpool's compiled code (``compilation.use_compile_cache``)."""

from __future__ import annotations

import os
import subprocess
import sys

from replica.worker.compilation import use_compile_cache


def test_the_cache_moves_from_torchs_default_but_not_from_a_users_folder(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    ours = str(tmp_path / "inductor")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    use_compile_cache(ours)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == ours
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what torch writes there
    use_compile_cache(ours)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == ours
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "users-own"))
    use_compile_cache(ours)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "users-own")


def test_the_cache_is_ours_after_the_engines_imports(tmp_path):
    """The engine's imports make torch write its /tmp default into the variable first (found by a
    new user's walkthrough: the compiled code landed in /tmp/torchinductor_<user>)."""
    code = (
        "import os, replica.worker.model_runner; from replica.worker.compilation import use_compile_cache; "
        f"use_compile_cache({str(tmp_path)!r}); print(os.environ['TORCHINDUCTOR_CACHE_DIR'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(tmp_path)


def test_the_cache_keys_change_with_the_engine_s_sources(tmp_path, monkeypatch):
    """Torch's compile cache keys do not cover a custom op's fake implementation: code compiled
    before a change to one was reused (Phi's and StableLM's tokens stayed wrong after the fix of
    their attention op's fake strides). Every key carries a hash of the engine's sources, after a
    user's own tag."""
    import shutil

    import torch

    from replica.worker import compilation
    from replica.worker.compilation import source_tag

    copy = tmp_path / "replica"
    shutil.copytree(os.path.dirname(os.path.dirname(compilation.__file__)), copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = source_tag(copy)
    assert source_tag(copy) == before
    op = copy / "attention" / "op.py"
    op.write_text(op.read_text() + "\n# changed\n")
    changed = source_tag(copy)
    assert changed != before
    (copy / "kernels" / "csrc" / "cpu_attention.h").write_text("// changed\n")
    assert len({before, changed, source_tag(copy)}) == 3

    monkeypatch.setenv("TORCH_COMPILE_CACHE_KEY_TAG", "users-")
    previous = torch.compiler.config.cache_key_tag
    try:
        use_compile_cache(str(tmp_path / "inductor"))
        assert torch.compiler.config.cache_key_tag == f"users-carpool-{source_tag()}"
    finally:
        torch.compiler.config.cache_key_tag = previous
