"""CUDA graphs for decode-only steps: one launch replays a whole captured step.

Why: on a GPU the compiled decoder still launches a few hundred kernels per step, and on the H200
the host spent about 16 ms of a 26 ms 8B decode step launching them (docs/bench/gpu-h200.md). A
CUDA graph captured once replays all of a step's kernels with one launch. This is what vLLM's and
SGLang's CUDA graph runners do for decode batches; :class:`DecodeGraphs` is Carpool's.

How:

* **Buckets.** A graph is captured per (batch size, block-table width). Batch sizes are 2, 4, 8,
  then every multiple of 8 up to ``max_num_seqs`` (vLLM's capture sizes; at most
  :data:`MAX_GRAPH_BATCH`); widths are powers of two blocks up to the width of ``max_model_len``
  or of :data:`MAX_GRAPH_CONTEXT` tokens, whichever is less. A step of ``n`` decodes whose longest
  block table has ``w`` blocks replays the smallest graph that holds both; a larger step runs
  without a graph. Padding rows are one-token sequences on the spare block (they write and read
  only the padding slot); padding columns point at the spare block and lie past every real
  sequence's length, so attention masks them out. Sizes start at 2 because the compiled decoder
  is compiled for sizes of 2 and more (:mod:`replica.worker.compilation`).
* **Static inputs and output.** A graph reads its inputs from device buffers that live as long as
  the graphs (token ids, positions, slot mapping, sequence lengths, block tables) and writes its
  logits into one static ``[max batch, vocab]`` buffer. A step writes its values into one pinned
  host buffer (after the previous step's copies are done with it) and copies each part into
  place, then replays; the logits are valid until the next replay.
* **Attention inside the graph** is the decode attention traced into the compiled decoder
  (:class:`replica.attention.backend.DecodeStep`, fused by inductor), which reads only those buffers. The
  backend's opaque op plans each step in Python, which a replay would not repeat, so steps with a
  prefill chunk run without a graph.
* **Capture.** Each shape first runs once on the capturing stream, so that nothing is compiled or
  loaded during capture; graphs are captured from the largest down into one memory pool, so that
  the smaller ones reuse the largest one's memory. The KV cache leaves room for that pool
  (:func:`graph_memory_reserve`).

With ``capture=False`` the same padded, static-buffer path runs without capturing anything. That is
how the CPU tests check the bucketing, the padding and the buffers against the plain path; on a
CUDA device the model runner always captures.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from typing import Callable

import numpy as np
import torch

from replica.attention.backend import DecodeStep

MAX_GRAPH_BATCH = 512
MAX_GRAPH_CONTEXT = 2048
"""Tokens: graphs cover block tables up to this length. The traced decode attention scans a graph's
whole width for every row, so past it a step runs without a graph, on the backend's kernels."""

# forward(input_ids [1, B], positions [1, B], decode) -> logits [B, vocab]
GraphForward = Callable[[torch.Tensor, torch.Tensor, DecodeStep], torch.Tensor]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes graphs are captured for: 2, 4, 8, then multiples of 8, up to
    ``min(max_num_seqs, MAX_GRAPH_BATCH)`` (always included; at least 2)."""
    cap = max(2, min(max_num_seqs, MAX_GRAPH_BATCH))
    return sorted({s for s in (2, 4, 8, *range(16, cap + 1, 8)) if s <= cap} | {cap})


def graph_widths(max_blocks: int) -> list[int]:
    """The block-table widths (blocks) graphs are captured for: powers of two from 2, up to
    ``max_blocks`` (always included; at least 2)."""
    cap = max(2, max_blocks)
    widths = {cap}
    w = 2
    while w < cap:
        widths.add(w)
        w *= 2
    return sorted(widths)


def graph_memory_reserve(max_num_seqs: int, max_model_len: int, num_heads: int, vocab_size: int) -> int:
    """Bytes to keep free of the KV cache for the graphs' memory pool (an estimate): the static
    logits ``[B, vocab]`` in float32, and the largest graph's float32 attention scores and
    probabilities ``[B, context, heads]`` (inductor materializes them), plus 64 MiB for the rest
    of its activations. ``B`` is the largest graph batch."""
    batch = graph_batch_sizes(max_num_seqs)[-1]
    context = min(max_model_len, MAX_GRAPH_CONTEXT)
    return batch * (vocab_size * 4 + 2 * context * num_heads * 4) + (64 << 20)


class DecodeGraphs:
    """Captured decode steps, one per (batch size, width) bucket (see the module docstring).

    Args:
        forward: runs the model's decode step on the given inputs and returns logits
            ``[B, vocab]`` (no host synchronization inside).
        max_num_seqs: the engine's seats; larger batches run without a graph.
        max_blocks: blocks of the longest request (``ceil(max_model_len / block_size)``).
        block_size: tokens per KV block.
        spare_block: the block that padding uses (no block table holds it).
        device: the model's device.
        capture: capture CUDA graphs (CUDA only); False runs the same path eagerly.
    """

    def __init__(
        self,
        forward: GraphForward,
        *,
        max_num_seqs: int,
        max_blocks: int,
        block_size: int,
        spare_block: int,
        device: torch.device,
        capture: bool,
    ) -> None:
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.forward = forward
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.widths = graph_widths(min(max_blocks, -(-MAX_GRAPH_CONTEXT // block_size)))
        self.block_size = block_size
        self.spare_block = spare_block
        self.padding_slot = spare_block * block_size
        self.device = device
        self.capture_graphs = capture
        max_bs, max_w = self.sizes[-1], self.widths[-1]
        with torch.inference_mode():  # as the forwards' tensors, so the compiled decoder's guards hold
            self._ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
            self._positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
            self._slots = torch.full((max_bs,), self.padding_slot, dtype=torch.int64, device=device)
            self._lens = torch.ones(max_bs, dtype=torch.int64, device=device)
            self._tables = torch.full((max_bs * max_w,), spare_block, dtype=torch.int64, device=device)
        self._host = torch.empty(4 * max_bs + max_bs * max_w, dtype=torch.int64, pin_memory=capture)
        self._host_np = self._host.numpy()  # the same memory, written with numpy
        self._logits: torch.Tensor | None = None  # [max_bs, vocab], every graph's output (with capture)
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._stream = torch.cuda.Stream(device) if capture else None
        self._copied = torch.cuda.Event() if capture else None  # the pinned buffer's last copies
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph | None] = {}
        self.steps_run = 0  # decode steps this object ran (replayed, with capture)

    @property
    def num_captured(self) -> int:
        return sum(graph is not None for graph in self._graphs.values())

    def bucket(self, num_seqs: int, width: int) -> tuple[int, int] | None:
        """The (batch size, width) graph for ``num_seqs`` decodes over ``width`` blocks, or None if
        the step is larger than every graph."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        j = bisect.bisect_left(self.widths, width)
        if i == len(self.sizes) or j == len(self.widths):
            return None
        return self.sizes[i], self.widths[j]

    def _inputs(self, bs: int, w: int) -> tuple[torch.Tensor, torch.Tensor, DecodeStep]:
        """Views of the static buffers for the (bs, w) graph: contiguous, at offset 0."""
        decode = DecodeStep(self._slots[:bs], self._tables[: bs * w].view(bs, w), self._lens[:bs], self.block_size)
        return self._ids[:bs].view(1, bs), self._positions[:bs].view(1, bs), decode

    def _load(self, bs: int, w: int, ids, positions, slots, tables, lens) -> None:
        """Write one step's inputs (``n`` real rows, padded to ``bs`` rows and ``w`` columns) into
        the static buffers: one pinned host buffer, one copy per buffer."""
        n, width = tables.shape
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the pinned buffer
        host, offset = self._host_np, 0
        for buffer, values, pad in ((self._ids, ids, 0), (self._positions, positions, 0),
                                    (self._slots, slots, self.padding_slot), (self._lens, lens, 1)):
            host[offset : offset + n] = values[:n]
            host[offset + n : offset + bs] = pad
            buffer[:bs].copy_(self._host[offset : offset + bs], non_blocking=True)
            offset += bs
        grid = host[offset : offset + bs * w].reshape(bs, w)
        grid.fill(self.spare_block)
        grid[:n, :width] = tables
        self._tables[: bs * w].copy_(self._host[offset : offset + bs * w], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _on_device(self):
        """With capture, make the graphs' device current (streams, events and copies are issued on
        the current device's); else nothing."""
        return torch.cuda.device(self.device) if self.capture_graphs else contextlib.nullcontext()

    def _capture(self, bs: int, w: int) -> None:
        """Warm the (bs, w) graph's shape up (compiling or loading its kernels), then capture it on
        this object's stream into the shared pool; without capture, only the warm-up. Called
        inside :meth:`_on_device`."""
        from replica.worker.compilation import mark_step_dynamic

        ids, positions, decode = self._inputs(bs, w)
        mark_step_dynamic(ids, positions, decode)
        if not self.capture_graphs:
            self.forward(ids, positions, decode)
            self._graphs[(bs, w)] = None
            return
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up on the stream that captures (torch's advice)
            logits = self.forward(ids, positions, decode)
            if self._logits is None:
                self._logits = logits.new_empty(self.sizes[-1], logits.shape[-1])
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
            # Into one static buffer: the graphs' logits share its memory instead of each
            # keeping its own [bs, vocab] alive in the pool.
            self._logits[:bs].copy_(self.forward(ids, positions, decode))
        self._graphs[(bs, w)] = graph

    @torch.inference_mode()
    def capture_all(self) -> dict[str, float]:
        """Capture every bucket, largest first (at engine start); returns the count and seconds.

        Padding values fill the buffers, so the warm-up forwards touch only the spare block."""
        started = time.perf_counter()
        none = np.zeros(0, dtype=np.int64)
        with self._on_device():
            for bs in reversed(self.sizes):
                for w in reversed(self.widths):
                    self._load(bs, w, none, none, none, none.reshape(0, 0), none)
                    self._capture(bs, w)
            if self.capture_graphs:
                torch.cuda.synchronize(self.device)
        return {"cuda_graphs": self.num_captured, "cuda_graphs_s": time.perf_counter() - started}

    @torch.inference_mode()
    def run(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, tables: np.ndarray,
            lens: np.ndarray, patch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
        """One decode step of ``n`` sequences: ``ids``, ``positions``, ``slots``, ``lens`` ``[n]``
        (int64), ``tables`` ``[n, width]``; ``patch`` = (rows, token ids) on the device overrides
        those rows' ids (async scheduling: tokens of the step in flight). Returns logits
        ``[n, vocab]``, valid until the next call, or None (nothing run) if no graph holds the step
        (:meth:`bucket`)."""
        n, width = tables.shape
        key = self.bucket(n, width)
        if key is None:
            return None
        bs, w = key
        self.steps_run += 1
        with self._on_device():
            self._load(bs, w, ids, positions, slots, tables, lens)
            if patch is not None:
                self._ids.index_copy_(0, *patch)
            if key not in self._graphs:  # not captured at start (capture_all was not called)
                self._capture(bs, w)  # its warm-up forward writes the same K/V that the replay writes
            graph = self._graphs[key]
            if graph is None:
                return self.forward(*self._inputs(bs, w))[:n]
            graph.replay()
        return self._logits[:n]
