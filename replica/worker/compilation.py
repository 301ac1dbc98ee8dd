"""Fast paths for the model's dense part: prepacked linear layers on CPU, and torch.compile of the
decoder.

* **Prepacked float32 linears (CPU).** Where Carpool's CPU kernels are built on a CPU with AVX2
  and FMA, float32 layers go to Carpool's own kernel (``replica/kernels/csrc/cpu_linear_f32.cpp``):
  batch-invariant, where torch's (MKL's) is not, and faster than it where measured
  (``docs/bench/cpu-speed.md``, "One float32 kernel for AVX2 CPUs"); its rounding differs from
  MKL's in the last bits.
  bfloat16 layers go there too on such CPUs without AVX512-BF16 (float32 sums of bf16 weights).
* **Prepacked 16-bit linears (CPU).** torch's eager ``linear`` hands oneDNN a plain weight,
  which oneDNN reorders into its blocked layout on every call, a cost of the order of the matmul
  itself at decode batch sizes (measured: ``docs/bench/cpu-speed.md``, "Figures behind rules in
  the code"). :func:`prepack_linears` reorders each weight once
  (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's freezing does) and routes the
  layer through an opaque op around ``torch.ops.mkldnn._linear_pointwise``: Carpool's C++
  ``carpool_cpu::packed_linear`` when its CPU kernels are built (no Python between the compiled
  graph and oneDNN), else the Python custom op ``carpool::packed_linear``. oneDNN's results are
  bit-identical to ``F.linear``. On CPUs with AVX512-BF16, bf16 weights are packed for Carpool's
  own bf16 kernel instead (``replica/kernels/csrc/cpu_linear_bf16.cpp``), which serves every row
  count (against oneDNN: ``docs/bench/cpu-speed.md``, "One bf16 kernel for every step"), and a
  row's result never depends on the other rows of its step.
* **Compiled decoder.** :func:`compile_decoder` compiles the model's decoder (embedding, every
  layer, final norm) with ``torch.compile`` (inductor) as one graph: norms, rotary, activations
  and residual adds fuse into a few kernels, and the per-op Python dispatch disappears. Attention is
  the opaque ``carpool::paged_attention`` op, except in decode-like steps, whose attention is
  Carpool's C++ kernel traced into the graph (``replica.attention.backend.DecodeStep``). The step's sizes
  (tokens, block-table width) are marked dynamic (:func:`mark_step_dynamic`) and kept at 2 or more
  (dynamo gives size 1 a graph of its own), so two graphs serve every step: one for decode-like
  steps (decodes, and prefill chunks as one decode query per token: on CPU with Carpool's kernel,
  every step), one for the rest.
  One graph for the whole decoder, not one per layer called once per layer: each call pays
  dynamo's guard checks and wrapper code (measured: ``docs/bench/cpu-speed.md``, "Figures behind
  rules in the code"). Compiled code is cached on disk (:func:`use_compile_cache`), so a restart
  loads it instead of compiling again (``docs/bench/cpu-speed.md``, "Compile time").
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import os
import types
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


@torch.library.custom_op("carpool::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x @ W.T + bias`` with a weight prepacked by ``torch.ops.mkldnn._reorder_linear_weight``.

    ``x`` ``[..., in_features]`` → ``[..., out_features]`` (same dtype); no rows give no rows."""
    if x.numel() == 0:
        return x.new_empty(*x.shape[:-1], out_features)
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


@packed_linear.register_fake
def _(x, packed_weight, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.carpool.packed_linear(x, self.carpool_packed_weight, self.bias, self.carpool_out_features)


def _packed_forward_cpp(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.carpool_cpu.packed_linear(
        x, self.carpool_packed_weight, self.carpool_gemv_weight, self.bias, self.carpool_out_features
    )


def _f32_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.carpool_cpu.f32_linear(x, self.carpool_f32_weight, self.bias, self.carpool_out_features)


def prepack_linears(model: torch.nn.Module) -> int:
    """Route every ``nn.Linear`` of ``model`` through a prepacked copy of its weight (not a
    subclass with a forward of its own: :func:`_pack_each`).

    * float32, with Carpool's CPU kernels built on a CPU with AVX2 and FMA: Carpool's float32
      kernel (``replica/kernels/csrc/cpu_linear_f32.cpp``, weight from ``pack_f32_weight``),
      batch-invariant where torch's (MKL's) is not.
    * bfloat16 on such a CPU without AVX512-BF16: the same kernel on bf16 weights (widened to
      float32 in registers, each output rounded to bf16 once), batch-invariant where oneDNN's
      bf16 GEMM is not (against it: ``docs/bench/cpu-speed.md``, "bfloat16 weights without
      AVX512-BF16").
    * bfloat16 with AVX512-BF16 and the kernels built: Carpool's bf16 kernel, which serves every
      number of rows and gives each row the same result whatever its batch (see
      ``replica/kernels/csrc/cpu_linear_bf16.cpp``; against oneDNN: ``docs/bench/cpu-speed.md``,
      "One bf16 kernel for every step").
    * other bfloat16 or float16 models where this CPU's oneDNN computes that type (float16 needs
      avx512_fp16 or avx_ne_convert): oneDNN on its own prepacked layout.

    The original weight is released (an empty tensor of its dtype stays as ``weight``). A tied
    output embedding's weight is the input embedding's too: where its packed copy is the bf16
    kernel's, the input embedding reads its rows from that copy (:func:`_embed_from`) and the
    weight is released as well, else it stays. Returns the number of layers packed: 0 where none
    of the above applies (the layers stay torch's own ``F.linear``).
    """
    from replica.kernels import cpu_kernels

    dtype = next(model.parameters()).dtype
    if dtype == torch.float32 or (dtype == torch.bfloat16 and not cpu_kernels.has_bf16_gemv()):
        if cpu_kernels.has_f32_gemv():
            return _pack_each(model, _pack_f32)
        if dtype == torch.float32:
            return 0
    if not torch.backends.mkldnn.is_available():
        return 0
    supported = {
        torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
        torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported,  # needs avx512_fp16 or avx_ne_convert
    }
    if dtype not in supported or not supported[dtype]():
        return 0
    forward = _packed_forward_cpp if cpu_kernels.available() else _packed_forward
    gemv = cpu_kernels.has_bf16_gemv()

    def pack(module: torch.nn.Linear, weight: torch.Tensor) -> None:
        if gemv and weight.dtype == torch.bfloat16:  # Carpool's kernel serves every row count
            module.carpool_gemv_weight = torch.ops.carpool_cpu.pack_bf16_weight(weight)
            module.carpool_packed_weight = weight.new_empty(0)
        else:
            module.carpool_gemv_weight = None
            module.carpool_packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight)
        module.forward = types.MethodType(forward, module)

    return _pack_each(model, pack)


def _pack_f32(module: torch.nn.Linear, weight: torch.Tensor) -> None:
    module.carpool_f32_weight = torch.ops.carpool_cpu.pack_f32_weight(weight)
    module.forward = types.MethodType(_f32_forward, module)


def _pack_each(model: torch.nn.Module, pack) -> int:
    """``pack(module, weight)`` for every CPU ``nn.Linear`` that computes ``nn.Linear``'s
    forward (:func:`_plain_linear`; a subclass that does more, such as a MoE router that also picks
    experts or a head that scales its output, keeps its own); then release the weights, except a
    tied output embedding's where the input embedding cannot read the packed copy. Returns the
    number packed."""
    embedding = model.get_input_embeddings()
    dtype = getattr(getattr(model, "config", None), "dtype", None)  # what it was loaded in
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(dtype, torch.dtype):
        dtype = next(model.parameters()).dtype
    packed: list[tuple[torch.nn.Linear, torch.Tensor]] = []
    for module in model.modules():
        if hasattr(module, "carpool_q_weight") or getattr(module, "carpool_own_forward", False):
            continue  # computed from blocks, or a forward of replica.quant's that is not a plain linear
        if isinstance(module, torch.nn.Linear) and module.weight.device.type == "cpu" and _plain_linear(module, dtype):
            weight = module.weight.detach()
            # The packed forwards compute the weight's rows: under tensor parallelism, this rank's
            # shard of out_features (which keeps the global count, parallel.localize).
            module.carpool_out_features, module.carpool_in_features = weight.shape
            pack(module, weight)
            packed.append((module, weight))
    for module, weight in packed:  # after every pack: two layers may share a weight
        if module.weight is embedding.weight and not _embed_from(embedding, module):
            continue
        module.weight.data = weight.new_empty(0)
    return len(packed)


def _plain_linear(module: torch.nn.Module, dtype: torch.dtype) -> bool:
    """True where ``module`` computes ``nn.Linear``'s forward in a model of ``dtype``: its own, or
    (where its weight is of ``dtype``, the input it will get) a forward of a subclass's or set on
    the instance whose output for three scaled one-hot rows (``[1, 3, in_features]``: 1, 256 and -1
    times a unit row) is exactly ``scale * weight[:, column] + bias``, which every way of computing
    ``x @ W.T + b`` gives bit for bit (one exact product and one rounded add per output).

    Falcon's ``FalconLinear`` (``input @ weight.T``) passes. A MoE router returning a tuple, a
    head that scales, normalises, clamps or upcasts its output, a float32 layer kept in a bf16
    model (Ergo's router, which casts its input), or a forward that raises does not. A forward that
    is linear on such rows only (a per-row quantisation of its input) would pass; no transformers
    model has one. The forward runs once here, under ``no_grad``."""
    if not isinstance(module, torch.nn.Linear):
        return False
    if type(module).forward is torch.nn.Linear.forward and "forward" not in module.__dict__:
        return True
    weight, bias = module.weight.detach(), module.bias
    if weight.dtype != dtype or weight.shape != (module.out_features, module.in_features) or module.in_features < 1:
        return False
    columns = [0, module.in_features - 1, module.in_features // 2]
    scales = torch.tensor([1.0, 256.0, -1.0], dtype=dtype)
    rows = torch.zeros(1, 3, module.in_features, dtype=dtype)
    rows[0, [0, 1, 2], columns] = scales
    expected = (weight[:, columns] * scales).T.unsqueeze(0)
    if bias is not None:
        expected = expected + bias.detach()
    try:
        with torch.no_grad():
            got = module(rows)
    except Exception:  # noqa: BLE001 — any forward that cannot take plain rows keeps its own
        return False
    return isinstance(got, torch.Tensor) and got.dtype == expected.dtype and torch.equal(got, expected)


def _embed_from(embedding: torch.nn.Module, head: torch.nn.Linear) -> bool:
    """Route a plain ``nn.Embedding`` through its tied ``head``'s copy packed for Carpool's bf16
    kernel (:func:`_embed_from_packed`); False (nothing changed) for any other layout or module.

    Only that layout: its k-pairs are read as 32-bit words, and inductor computes that gather
    once a step. On ``pack_f32_weight``'s layout it copied the gather into each fused kernel that
    reads the embedding (the cost of each: ``docs/engine.md``, "Fast paths on CPU"), and float32
    weights are pages of the mapped checkpoint, which stay resident whether or not the copy is
    released.
    """
    rows = getattr(head, "carpool_gemv_weight", None)
    if rows is None or type(embedding) is not torch.nn.Embedding or embedding.max_norm is not None:
        return False
    embedding.carpool_packed_rows = rows.view(torch.int32).squeeze(-1)  # [ceil(V / 16), ceil(K / 2), 16]
    embedding.forward = types.MethodType(_embed_from_packed, embedding)
    return True


def _embed_from_packed(self: torch.nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
    """The input embedding of a tied bf16 model, read from its output embedding's packed weight:
    token ``t``'s row is output ``t`` of the packed linear, lane ``t % 16`` of panel ``t // 16``
    (``carpool_packed_rows``: ``pack_bf16_weight``'s ``[ceil(V / 16), ceil(K / 2), 16, 2]`` viewed
    as ``[ceil(V / 16), ceil(K / 2), 16]`` int32 k-pairs). The same values as
    ``weight[input_ids]``: ``input_ids`` ``[...]`` (ids below V: the engine checks them) ->
    ``[..., K]`` bf16."""
    rows = self.carpool_packed_rows[input_ids // 16, :, input_ids % 16]  # [..., ceil(K / 2)] k-pairs
    return rows.view(torch.bfloat16)[..., : self.embedding_dim]


def use_compile_cache(directory: str) -> None:
    """Keep inductor's compiled code under ``directory``, so that it survives restarts (the
    default, /tmp/torchinductor_<user>, may not), unless the user set ``TORCHINDUCTOR_CACHE_DIR``
    to another folder. Torch's own ``cache_dir()`` writes its default into that variable the first
    time anything asks (an import below ``replica.attention.op`` does), so the default counts as
    unset: a plain ``setdefault`` left the cache in /tmp.

    Also tags every compile cache key with :func:`source_tag` (``torch.compiler.config.cache_key_tag``,
    after any tag of the user's): torch's keys do not cover a custom op's fake implementation, so
    code compiled before a change to one (its output strides) was reused and gave wrong tokens."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = directory
    user_tag = os.environ.get("TORCH_COMPILE_CACHE_KEY_TAG", "")
    torch.compiler.config.cache_key_tag = f"{user_tag}carpool-{source_tag()}"


def source_tag(root: Path | None = None) -> str:
    """16 hex digits of the SHA-256 of the engine's sources (every file under ``replica/``: its
    ``.py`` modules and the kernels' ``csrc``, paths and contents): any change to them changes the
    compile cache's keys."""
    root = root or Path(__file__).parents[1]
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and (p.suffix == ".py" or p.parent.name == "csrc")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def compile_decoder(model: torch.nn.Module) -> None:
    """torch.compile the model's whole decoder (embedding, every layer, final norm) as one graph.

    Callers mark the step's varying sizes dynamic (:func:`mark_step_dynamic`) and keep them at 2 or
    more, so that one graph serves every decode-like step and one every other step.

    On CPU, dynamo's guards on the modules' attributes are dropped
    (``torch.compiler.skip_guard_on_all_nn_modules_unsafe``): checking them before every step
    cost about a quarter of what the linear layers of a one-row 4-bit step cost
    (``docs/bench/quantized-cpu.md``, "Where the step's time goes"). Two things make that safe:

    * dynamo keeps compiled code per code object, and guards are what told one module's graphs
      from another's (``nn.Module.compile`` compiles ``Module._call_impl``, whose code every module
      shares): each decoder is compiled through a function with a code object of its own
      (:func:`_own_code`, called with the decoder as its first argument), as one graph
      (``fullgraph``: a graph break would compile the layers' own code, which every decoder of the
      class shares, without the guards), so another engine's decoder in the same process (a
      speculative draft, the tests' engines) never runs this one's graphs;
    * every attribute the compiled modules read (packed weights, KV caches, LoRA slots, forwards)
      is set before the first step, and afterwards only tensors' contents change, in place (LoRA
      slots: ``replica.lora.slots.repack_linear``). The guards on the step's inputs stay.

    On CUDA the decoder is compiled as before (``nn.Module.compile``, every guard): decode steps
    replay CUDA graphs there, which check no guards, and no GPU has run the decoder as one
    ``fullgraph`` graph yet.
    """
    import torch._inductor.config

    torch._inductor.config.size_asserts = False
    decoder = model.get_decoder()
    if model.device.type != "cpu":  # CUDA: not run with the guards dropped yet (see above)
        decoder.compile()
        return
    compiled = torch.compile(
        _own_code(), fullgraph=True, options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    )
    decoder._compiled_call_impl = functools.partial(compiled, decoder)


def _own_code():
    """``step(module, *args, **kwargs)``, which calls ``module`` as ``nn.Module.__call__`` would
    without compiling, with a code object no other function has. The module is an argument, so
    that dynamo sees it as a module (whose guards the filter drops), not as a closure's value."""

    def step(module, *args, **kwargs):
        return module._call_impl(*args, **kwargs)

    code = step.__code__.replace(co_name=f"carpool_decoder_{next(_decoders)}")
    return types.FunctionType(code, step.__globals__, code.co_name)


_decoders = itertools.count()


def mark_step_dynamic(input_ids: torch.Tensor, position_ids: torch.Tensor, decode) -> None:
    """Tell dynamo which sizes of a step's inputs vary (tokens; block-table width), so that the
    first compile is already the general one."""
    import torch._dynamo

    torch._dynamo.mark_dynamic(input_ids, 1)
    torch._dynamo.mark_dynamic(position_ids, 1)
    if decode is not None:
        torch._dynamo.mark_dynamic(decode.slot_mapping, 0)
        torch._dynamo.mark_dynamic(decode.block_tables, 0)
        torch._dynamo.mark_dynamic(decode.block_tables, 1)
        torch._dynamo.mark_dynamic(decode.seq_lens, 0)
