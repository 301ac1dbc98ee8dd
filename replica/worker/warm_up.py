"""What an engine does at start so that its first requests are not slow and its memory does not grow
while serving: build oneDNN's matmul primitives, compile the decoder, capture CUDA graphs, and
give the memory freed meanwhile back to the OS."""

from __future__ import annotations

import time

import numpy as np
import torch

from replica.attention.backend import AttentionMetadata, DecodeStep, to_device
from replica.attention.cpu import inline_chunks
from replica.attention.op import running_step
from replica.kernels.shapes import padded_size
from replica.worker.compilation import mark_step_dynamic
from replica.worker.heap import release_freed_heap


def warm_up(runner, max_num_batched_tokens: int, max_num_seqs: int) -> dict[str, float]:
    """Warm ``runner`` (a ``ModelRunner``) up; returns what it did (counts and seconds).

    * With step padding: run every distinct linear layer that oneDNN computes once at every
      padded step size, so that oneDNN builds all its matmul primitives now, not in served steps:
      every :func:`padded_size` up to ``max_num_batched_tokens`` tokens for the layers inside the
      model, up to ``max_num_seqs`` rows for the output embedding. Layers on Carpool's own
      kernels (``carpool_gemv_weight``, ``carpool_f32_weight``, ``carpool_q_weight``) build nothing
      and are skipped; the report counts the layers on GGUF's blocks (``quantized_layers``).
    * With compile: run dummy steps (decode-only and mixed, at two sizes each) so that the graphs
      of the compiled decoder that steps take are compiled (or loaded from the compile cache)
      before the first request: the decode graph, and the graph of steps whose prefill chunks go
      through the opaque attention op where they do (on CPU without Carpool's kernel; on CUDA).
    * With CUDA graphs: capture every decode bucket (``DecodeGraphs.capture_all``).
    * Give the host memory freed so far back to the OS (:func:`replica.worker.heap.release_freed_heap`;
      ``heap_released_mib`` in the report).

    Raises ``RuntimeError`` if a CUDA graph capture fails (the message names ``--no-cuda-graphs``).
    """
    report: dict[str, float] = {}
    if getattr(runner, "num_quantized", 0):
        report["quantized_layers"] = runner.num_quantized
    if runner.pad_steps:
        started = time.perf_counter()
        report["matmuls"] = _warm_up_matmuls(runner, max_num_batched_tokens, max_num_seqs)
        report["matmuls_s"] = time.perf_counter() - started
    if runner.compiled:
        started = time.perf_counter()
        for query_lens in ([1, 1], [2, 1], [1, 1, 1], [2, 1, 1]):
            dummy_step(runner, query_lens, len(query_lens))
        report["compile_s"] = time.perf_counter() - started
    if runner.graphs is not None and runner.graphs.capture_graphs:
        try:
            report.update(runner.graphs.capture_all())
        except Exception as exc:  # a failed capture can leave CUDA's allocator unusable: stop here
            raise RuntimeError(
                f"capturing CUDA graphs failed ({exc!r}); start with --no-cuda-graphs (cuda_graphs=False) "
                "to run without them"
            ) from exc
    # The original weights (freed by prepacking) and the compiler's scratch stay in glibc's heap.
    report["heap_released_mib"] = release_freed_heap()
    return report


def _warm_up_matmuls(runner, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    output = runner.model.get_output_embeddings()
    layers: dict[tuple, torch.nn.Linear] = {}
    for module in runner.model.modules():
        if _on_carpool_kernel(module):
            continue  # no oneDNN primitive to build
        if isinstance(module, torch.nn.Linear) and module is not output:
            # Packed layers: their weight's shape (under tensor parallelism, this rank's shard).
            key = (_features(module), module.bias is not None, module.weight.dtype)
            layers.setdefault(key, module)
    token_sizes = sorted({padded_size(n) for n in range(1, max_num_batched_tokens + 1)})
    row_sizes = sorted({padded_size(n) for n in range(1, max_num_seqs + 1)})
    runs = 0
    heads = [] if _on_carpool_kernel(output) else [(output, row_sizes)]
    for layer, sizes in [*((layer, token_sizes) for layer in layers.values()), *heads]:
        for size in sizes:
            layer(torch.zeros(1, size, _features(layer)[0], dtype=layer.weight.dtype, device=runner.device))
            runs += 1
    return runs


def _features(module: torch.nn.Linear) -> tuple[int, int]:
    """``(in, out)`` of the weight the layer computes: a packed one's, else its weight's (under
    tensor parallelism, this rank's shard; ``in_features`` stays the global count)."""
    if hasattr(module, "carpool_in_features"):
        return module.carpool_in_features, module.carpool_out_features
    weight = module.weight
    if weight.dim() == 2 and weight.numel():
        return weight.shape[1], weight.shape[0]
    return module.in_features, module.out_features


def _on_carpool_kernel(module: torch.nn.Module) -> bool:
    return (
        getattr(module, "carpool_gemv_weight", None) is not None
        or hasattr(module, "carpool_f32_weight")
        or hasattr(module, "carpool_q_weight")  # GGUF's blocks (replica.quant)
    )


def dummy_step(runner, query_lens: list[int], width: int, *, all_logits: bool = False) -> None:
    """One forward of sequences of ``query_lens`` tokens over ``width``-block tables, all on
    the spare block (written and read only by padding); the logits of the last token, or
    ``all_logits`` of every token."""
    counts = np.array(query_lens, dtype=np.int64)
    n = int(counts.sum())
    seq_lens = counts + (width - 1) * runner.block_size
    width = max(width, int(-(-seq_lens.max() // runner.block_size)))  # blocks smaller than a query span
    step = AttentionMetadata(
        query_start=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        query_lens=counts,
        context_lens=seq_lens - counts,
        seq_lens=seq_lens,
        block_tables=np.full((len(counts), width), runner.num_blocks, dtype=np.int64),
        slot_mapping=np.full(n, runner.padding_slot, dtype=np.int64),
        num_tokens=n,
    )
    extra = {}
    # The graph the runner would take for this step: the decode graph for decodes, and for prefill
    # chunks too where they run as decode queries (on CPU with Carpool's kernel, every chunk).
    if runner.backend.inline_decode and inline_chunks(step, runner.backend.inline_chunk_pairs).all():
        extra["carpool_decode"] = DecodeStep(*to_device(runner.decode_arrays(step), runner.device), block_size=runner.block_size)
    else:
        runner.backend.plan(step)
    ids = torch.zeros(1, n, dtype=torch.long, device=runner.device)
    positions = torch.zeros(1, n, dtype=torch.long, device=runner.device)
    if runner.compiled:
        mark_step_dynamic(ids, positions, extra.get("carpool_decode"))
    with running_step(runner.backend):
        keep = torch.arange(n, device=runner.device) if all_logits else 1  # indices, as a step's logits rows
        runner.model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=keep, **extra)


def time_forwards(runner, num_tokens: list[int], chunk: int) -> list[float]:
    """Seconds of one forward of each of ``num_tokens`` tokens, as sequences of ``chunk`` tokens
    over 8-block tables with every token's logits (the shape of a step that verifies drafts), the
    best of two runs each (:func:`dummy_step`; on CUDA, to the end of the device's work). A size
    below the runner's ``min_step_tokens`` runs at that size, as a step would."""
    seconds = []
    for n in num_tokens:
        n = max(n, runner.min_step_tokens)  # as a step is padded (the compiled decoder's least)
        lens = [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])
        best = float("inf")
        for _ in range(2):
            started = time.perf_counter()
            dummy_step(runner, lens, 8, all_logits=True)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            best = min(best, time.perf_counter() - started)
        seconds.append(best)
    return seconds
