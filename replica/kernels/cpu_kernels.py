"""Carpool's own CPU kernels (``replica/kernels/csrc/``: :data:`SOURCES`), built
on first use with torch's C++ extension loader and cached: paged decode attention, linear layers
on prepacked weights (``f32_linear``: Carpool's float32-accumulating kernel on CPUs with AVX2
and FMA, for float32 weights and for bf16 ones where the CPU has no AVX512-BF16;
``packed_linear``: Carpool's bf16 kernel on CPUs with AVX512-BF16, oneDNN otherwise, called
without Python in between; ``q4_linear`` and ``q8_linear``: weights in GGUF's
Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K and Q8_0/Q6_K blocks, on AVX512 or AVX2; Carpool's kernels serve
any number of rows and are batch-invariant), and the sampler's draws (``argmax_rows`` for greedy
rows, ``sample_rows`` for random ones).

Why our own: no well-kept package ships a CPU paged-attention kernel that installs here, and
torch's own options (SDPA on gathered contexts, flex attention with a paged block mask, an
inductor-compiled gather-and-reduce formulation) read each sequence's context far below what the
core can do (measured against this kernel: ``docs/engine.md``, "Attention"). It is tested against
the reference backend (SDPA). The sampling kernels' reasons are at the top of their source.

:func:`load` builds (once per CPU flag set, with ``g++`` and ``ninja``; then cached) and registers the
``torch.ops.carpool_cpu`` ops (``decode_attention``, ``packed_linear``, ``pack_bf16_weight``,
``has_bf16_gemv``, ``q4_linear``, ``has_q4_gemv``, ``q8_linear``, ``has_q8_gemv``, ``f32_linear``, ``pack_f32_weight``, ``has_f32_gemv``, ``argmax_rows``,
``sample_rows``, ``shm_collective``: a tensor-parallel group's all-reduce and gather through
shared memory, ``replica/worker/shm_all_reduce.py``); it returns False, once with a warning,
where they cannot be built (the engine then uses the compiled formulation and torch's sampling).
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from replica.config.engine_config import cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
# The longest build first: ninja starts them in this order, and cpu_linear_f32.cpp alone takes
# about as long as the others together.
SOURCES = [SOURCE.with_name(name) for name in (
    "cpu_linear_f32.cpp", "cpu_kernels.cpp", "cpu_attention.cpp", "cpu_attention_avx512.cpp", "cpu_linear_bf16.cpp",
    "cpu_linear_q4.cpp", "cpu_linear_q8.cpp", "cpu_sampling.cpp", "cpu_shm_all_reduce.cpp",
)]
NAME = "carpool_cpu_kernels"
_state: dict[str, bool] = {}


def cpu_tag() -> str:
    """A short name for this CPU's instruction sets (a hash of the flags in /proc/cpuinfo, or of
    ``platform.processor()`` elsewhere). The kernels are built with ``-march=native``; keeping
    each CPU's build in its own folder stops a cache shared by machines of different CPUs (a
    volume mounted on every node) from handing one an AVX512 build it cannot run."""
    import hashlib
    import platform

    flags = _cpu_flags()
    text = " ".join(sorted(flags)) if flags is not None else platform.machine() + platform.processor()
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _cpu_flags() -> set[str] | None:
    """The first ``flags`` (x86) or ``Features`` (Arm) line of /proc/cpuinfo, as a set; None
    where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def target_arch() -> str:
    """The ``-march`` the kernels are built for: ``$CARPOOL_CPU_ARCH`` (e.g. ``haswell``, to run the
    AVX2 paths on an AVX512 machine), else ``native``."""
    return os.environ.get("CARPOOL_CPU_ARCH", "").strip() or "native"


def build_tag() -> str:
    """The build folder's name: :func:`cpu_tag` and a short hash of this checkout's source folder,
    and the :func:`target_arch` where it is not ``native``. torch's build file names the sources
    by absolute path, so two checkouts on one machine sharing a folder would rebuild over each
    other's build at every start."""
    import hashlib

    arch = target_arch()
    suffix = "" if arch == "native" else f"-{arch}"
    return f"{cpu_tag()}-{hashlib.sha256(str(SOURCE.parent.resolve()).encode()).hexdigest()[:8]}{suffix}"


def available() -> bool:
    """Whether :func:`load` built and registered the kernels in this process."""
    return _state.get("ok", False)


def has_f32_gemv() -> bool:
    """Whether Carpool's float32-accumulating linear kernel (float32 and bf16 weights) is built
    (the CPU has AVX2 and FMA)."""
    return available() and torch.ops.carpool_cpu.has_f32_gemv()


def has_block_gemv(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether Carpool's kernels for GGUF's blocks (``q4_linear``: Q4_0, Q4_1, Q4_K and the 5-bit
    Q5_0, Q5_1, Q5_K; ``q8_linear``: Q8_0 and Q6_K) are built for activations of ``dtype``:
    bfloat16 and float32 where the CPU has AVX512F, or AVX2 with FMA and F16C (bfloat16 natively with AVX512-BF16 and AVX512BW, elsewhere through
    the float32 kernel)."""
    return available() and torch.ops.carpool_cpu.has_q4_gemv(dtype) and torch.ops.carpool_cpu.has_q8_gemv(dtype)


_DISPATCH_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_bf16")


def dispatch_summary() -> str:
    """One line for logs and benchmark headers: the instruction sets of this CPU that Carpool's
    kernels dispatch on (from /proc/cpuinfo) and the linear kernels built for them, e.g.
    ``avx2 fma avx512f avx512bw avx512_bf16 | linears: bf16 (vdpbf16ps), f32 (fma) | GGUF blocks:
    bf16, f32`` (``none`` where a kind is not built; ``kernels not built`` before or without
    :func:`load`)."""
    flags = _cpu_flags() or set()
    cpu = " ".join(f for f in _DISPATCH_FLAGS if f in flags) or "no x86 flags read"
    if target_arch() != "native":
        cpu += f" (kernels built for {target_arch()})"
    if not available():
        return f"{cpu} | kernels not built"
    linears = [name for name, ok in (("bf16 (vdpbf16ps)", has_bf16_gemv()), ("f32 (fma)", has_f32_gemv())) if ok]
    blocks = [name for name, dtype in (("bf16", torch.bfloat16), ("f32", torch.float32)) if has_block_gemv(dtype)]
    return f"{cpu} | linears: {', '.join(linears) or 'none'} | GGUF blocks: {', '.join(blocks) or 'none'}"


def has_bf16_gemv() -> bool:
    """Whether Carpool's bf16 linear kernel is built (the CPU has AVX512-BF16)."""
    return available() and torch.ops.carpool_cpu.has_bf16_gemv()


@contextmanager
def build_lock(build_directory: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``build_directory/carpool.flock`` while torch builds or
    loads the extension there, and clear the ``lock`` file that a dead builder left behind.

    torch's loader marks a build with a ``lock`` file and waits, without a timeout, for it to go;
    a process killed during the build (a replica killed or OOM-killed on its first start) leaves
    it, and every later start then hangs. The flock is released by the kernel when its holder
    dies, and every Carpool process holds it while torch's ``lock`` exists, so a ``lock`` found
    while holding the flock belongs to a dead process and is removed.
    """
    os.makedirs(build_directory, exist_ok=True)
    with open(os.path.join(build_directory, "carpool.flock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released on close, or by the kernel if we die
        stale = Path(build_directory) / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a build that did not finish", stale)
            stale.unlink(missing_ok=True)
        yield


def load() -> bool:
    """Build (or load from the extension cache) and register the CPU kernel; True if available.

    torch keeps built extensions in ``TORCH_EXTENSIONS_DIR``, set here to
    ``<cache_dir()>/torch_extensions`` unless already set; the build goes to
    ``<it>/carpool_cpu_kernels/<build_tag()>``. Only the first call builds; later ones return its answer.
    """
    if "ok" in _state:
        return _state["ok"]
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(cache_dir() / "torch_extensions"))
    try:
        from torch.utils.cpp_extension import _get_build_directory
        from torch.utils.cpp_extension import load as load_extension

        build_directory = os.path.join(_get_build_directory(NAME, verbose=False), build_tag())
        with build_lock(build_directory):
            load_extension(
                name=NAME,
                build_directory=build_directory,
                sources=[str(path) for path in SOURCES],
                # -fopenmp: at::parallel_for splits the kernels' loops over torch's threads only
                # in code built with OpenMP (ATen/Parallel.h); without it they ran on one thread.
                extra_cflags=["-O3", f"-march={target_arch()}", "-ffast-math", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
    except Exception as exc:  # no compiler, no ninja, ...
        logger.warning(
            "Carpool's CPU kernels could not be built (%s); using the compiled attention and torch's sampling", exc
        )
        _state["ok"] = False
        return False

    @torch.library.register_fake("carpool_cpu::decode_attention")
    def _(query, key, value, key_cache, value_cache, slot_mapping, block_tables, seq_lens, block_size, scale):
        return query.new_empty(query.shape)  # contiguous, as the kernel returns (not the query's strides)

    @torch.library.register_fake("carpool_cpu::packed_linear")
    def _(x, onednn_weight, gemv_weight, bias, out_features):
        return x.new_empty(*x.shape[:-1], out_features)

    @torch.library.register_fake("carpool_cpu::f32_linear")
    def _(x, packed, bias, out_features):
        return x.new_empty(*x.shape[:-1], out_features)

    @torch.library.register_fake("carpool_cpu::q4_linear")
    def _(x, qweight, scales, mins, bias, out_features, offset, super_scales=None, super_mins=None, qhigh=None):
        return x.new_empty(*x.shape[:-1], out_features)

    @torch.library.register_fake("carpool_cpu::q8_linear")
    def _(x, qweight, scales, bias, out_features, super_scales=None):
        return x.new_empty(*x.shape[:-1], out_features)

    _state["ok"] = True
    return True
