"""Scheduler output → flat tensors → one forward of a transformers model → sampled tokens.

The only engine module that builds tensors. Per step it packs every scheduled token of every
request into one row (``input_ids`` / ``positions`` / ``slot_mapping``, each ``[num_tokens]``),
builds the attention metadata once, runs the model once with our paged attention, computes
logits only at the positions that sample (``logits_to_keep``), and samples.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from replica.attention import AttentionMetadata, PrefillChunk, register_paged_attention
from replica.kv_cache import PagedKVCache, kv_bytes_per_block
from replica.model_loader import load_model, resolve_dtype
from replica.request import TokenLogprobs
from replica.sampler import Sampler
from replica.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
EXACT_SIZES_UP_TO = 16
BUCKETS_PER_OCTAVE = 8


def padded_size(n: int) -> int:
    """The bucket a step of ``n`` rows is padded to on CPU: ``n`` itself up to 16, then the next of
    8 evenly spaced sizes per power of two (17 → 18, 100 → 104, 500 → 512; at most 12.5 % more).

    Why: oneDNN, which runs torch's bf16 matmuls on CPU, builds (JIT-compiles) and caches one
    primitive per matmul shape, a few hundred KiB each, and its cache holds up to 1,024 of them
    (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``). Unpadded, every new token count is a new shape for each
    linear layer, and a server's memory grew by hundreds of MiB over thousands of requests
    (``make soak``). Buckets bound the shapes to 56 per linear layer shape for a 512-token budget;
    the same idea as the padded batch sizes of vLLM's CUDA graphs and XLA backends.
    """
    if n <= EXACT_SIZES_UP_TO:
        return n
    octave = (n - 1).bit_length() - 1  # 2**octave < n <= 2**(octave + 1)
    step = max(1, (1 << octave) // BUCKETS_PER_OCTAVE)
    return -(-n // step) * step


@dataclass
class ModelShape:
    """What the KV cache must hold per token: ``num_layers`` × K/V of ``num_kv_heads × head_dim``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int | None


def model_shape(hf_config) -> ModelShape:
    """Read the KV-relevant shape from a transformers config (its text config for multimodal ones)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    num_heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    return ModelShape(
        num_layers=text.num_hidden_layers,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        max_position_embeddings=getattr(text, "max_position_embeddings", None),
    )


@dataclass
class StepResult:
    """Per scheduled row of a step: the sampled token (None if the row does not sample) and logprobs.

    ``errors`` maps a row to the exception that sampling that row alone raised (its token is None).
    """

    sampled_token_ids: list[int | None]
    logprobs: list[TokenLogprobs | None]
    errors: dict[int, Exception] = field(default_factory=dict)


class ModelRunner:
    """Owns the model, the paged KV cache and the sampler of one engine.

    Args:
        model_path: local folder of the model (see ``replica.model_loader.resolve_model_path``).
        dtype, device: as in ``EngineConfig``.
        block_size: tokens per block.
        num_blocks / kv_cache_memory: the pool size in blocks, or a byte budget (see
            :meth:`_decide_num_blocks`).
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str,
        device: str,
        block_size: int,
        num_blocks: int | None,
        kv_cache_memory: int | None,
        gpu_memory_utilization: float = 0.9,
    ) -> None:
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, device)
        self.block_size = block_size
        self.model = load_model(
            model_path, dtype=self.dtype, device=device, attn_implementation=register_paged_attention()
        )
        self.shape = model_shape(self.model.config)
        self.hf_config = self.model.config
        self.num_blocks = self._decide_num_blocks(num_blocks, kv_cache_memory, gpu_memory_utilization)
        # On CPU in 16-bit dtypes (oneDNN's matmuls; float32 ones go to BLAS), steps are padded to
        # a few sizes (see padded_size); padding tokens write their K/V into one extra block that
        # no block table holds.
        self.pad_steps = self.device.type == "cpu" and self.dtype != torch.float32
        self.padding_slot = self.num_blocks * block_size
        self.kv_cache = PagedKVCache(
            num_layers=self.shape.num_layers,
            num_blocks=self.num_blocks + 1,
            block_size=block_size,
            num_kv_heads=self.shape.num_kv_heads,
            head_dim=self.shape.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.sampler = Sampler()

    def _decide_num_blocks(
        self, num_blocks: int | None, kv_cache_memory: int | None, gpu_memory_utilization: float
    ) -> int:
        """Blocks in the pool: ``num_blocks`` if given, else ``budget // bytes_per_block``.

        The budget is ``kv_cache_memory`` if given; else 1 GiB on CPU, and on CUDA
        ``gpu_memory_utilization × total − memory in use after loading the model`` (vLLM's rule).
        Raises ``ValueError`` if the budget holds no block.
        """
        if num_blocks is not None:
            return num_blocks
        per_block = kv_bytes_per_block(
            self.shape.num_layers, self.block_size, self.shape.num_kv_heads, self.shape.head_dim, self.dtype
        )
        budget = kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                budget = int(total * gpu_memory_utilization) - (total - free)
            else:
                budget = DEFAULT_CPU_KV_CACHE_BYTES
        blocks = budget // per_block
        if blocks < 1:
            raise ValueError(
                f"kv_cache_memory of {budget} bytes holds no KV block ({per_block} bytes per block)"
            )
        return int(blocks)

    @torch.inference_mode()
    def warm_up_step_shapes(self, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """Run every distinct linear layer once at every padded step size, so that oneDNN builds
        all its matmul primitives now: memory is flat from the first request, and no request
        waits for a JIT compile (about 1 ms per primitive). A no-op unless ``pad_steps``.

        Sizes: every :func:`padded_size` up to ``max_num_batched_tokens`` tokens for the layers
        inside the model, up to ``max_num_seqs`` rows for the output embedding (the logits). Costs
        about as much compute as 16 full steps' worth of one decoder layer's linears. Returns the
        number of matmuls run.
        """
        if not self.pad_steps:
            return 0
        output = self.model.get_output_embeddings()
        layers: dict[tuple, torch.nn.Linear] = {}
        for module in self.model.modules():
            if isinstance(module, torch.nn.Linear) and module is not output:
                key = (module.in_features, module.out_features, module.bias is not None, module.weight.dtype)
                layers.setdefault(key, module)
        token_sizes = sorted({padded_size(n) for n in range(1, max_num_batched_tokens + 1)})
        row_sizes = sorted({padded_size(n) for n in range(1, max_num_seqs + 1)})
        runs = 0
        for layer, sizes in [*((layer, token_sizes) for layer in layers.values()), (output, row_sizes)]:
            for size in sizes:
                layer(torch.zeros(1, size, layer.in_features, dtype=layer.weight.dtype, device=self.device))
                runs += 1
        return runs

    # ---- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one forward for ``out`` and sample the rows that reach their last known token."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tokens: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        logits_rows: list[int] = []
        sample_rows: list[int] = []  # index into out.scheduled of each logits row

        for row, sched in enumerate(out.scheduled):
            request, start, n = sched.request, sched.start, sched.num_new_tokens
            first = len(input_ids)
            if sched.is_padding:
                input_ids.append(request.token_at(request.num_tokens - 1))
            elif n == 1:
                input_ids.append(request.token_at(start))
            else:
                input_ids.extend(request.all_token_ids[start : start + n])
            table = request.block_ids
            positions.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if n == 1:
                decode_tokens.append(first)
                decode_tables.append(table[: (start + bs) // bs])
                decode_lens.append(start + 1)
            else:
                prefills.append(self._prefill_chunk(first, n, start, table))
            if sched.samples:
                logits_rows.append(first + n - 1)
                sample_rows.append(row)

        num_real_rows = len(logits_rows)
        if self.pad_steps:
            # Step padding (not the static policy's padding rows, ``sched.is_padding``).
            num_pad_tokens = padded_size(len(input_ids)) - len(input_ids)
            input_ids.extend([0] * num_pad_tokens)
            positions.extend([0] * num_pad_tokens)
            slots.extend([self.padding_slot] * num_pad_tokens)
            if logits_rows:
                logits_rows.extend([logits_rows[-1]] * (padded_size(num_real_rows) - num_real_rows))

        meta = AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_tokens=len(input_ids),
            prefills=prefills,
        )
        if decode_tokens:
            width = max(len(t) for t in decode_tables)
            meta.decode_token_indices = torch.tensor(decode_tokens, dtype=torch.long, device=self.device)
            meta.decode_block_tables = torch.tensor(
                [t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.long, device=self.device
            )
            lens = torch.tensor(decode_lens, device=self.device)
            meta.decode_mask = (torch.arange(width * bs, device=self.device)[None, :] < lens[:, None])[
                :, None, None, :
            ]

        result = StepResult([None] * len(out.scheduled), [None] * len(out.scheduled))
        logits = self.model(
            input_ids=torch.tensor([input_ids], dtype=torch.long, device=self.device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=self.device),
            use_cache=False,
            logits_to_keep=torch.tensor(logits_rows, dtype=torch.long, device=self.device),
            carpool_metadata=meta,
        ).logits[0, :num_real_rows]  # [num_sampling_rows, vocab]
        if not sample_rows:
            return result

        real = [i for i, row in enumerate(sample_rows) if not out.scheduled[row].is_padding]
        padding = [i for i, row in enumerate(sample_rows) if out.scheduled[row].is_padding]
        if real:
            requests = [out.scheduled[sample_rows[i]].request for i in real]
            for request in requests:
                if request.sampling_params.seed is not None and request.generator is None:
                    request.generator = torch.Generator(device=self.device).manual_seed(
                        request.sampling_params.seed
                    )
            real_logits = logits if not padding else logits[real]
            try:
                sampled = self.sampler(real_logits, requests)
            except Exception:
                # One request's parameters or state may break the batched sampler: sample each
                # row alone, so that only the rows that fail by themselves fail.
                logger.exception("batched sampling failed; sampling the %d rows one by one", len(real))
                for k, (i, request) in enumerate(zip(real, requests)):
                    row = sample_rows[i]
                    try:
                        one = self.sampler(real_logits[k : k + 1], [request])
                    except Exception as exc:
                        result.errors[row] = exc
                        continue
                    result.sampled_token_ids[row] = one.token_ids[0]
                    result.logprobs[row] = one.logprobs[0]
            else:
                for i, token_id, lp in zip(real, sampled.token_ids, sampled.logprobs):
                    result.sampled_token_ids[sample_rows[i]] = token_id
                    result.logprobs[sample_rows[i]] = lp
        if padding:
            # A padded static batch computes these rows too; their tokens are thrown away.
            for i, token_id in zip(padding, logits[padding].argmax(dim=-1).tolist()):
                result.sampled_token_ids[sample_rows[i]] = token_id
        return result

    def _prefill_chunk(self, first: int, n: int, start: int, table: list[int]) -> PrefillChunk:
        chunk = PrefillChunk(token_start=first, token_end=first + n, context_start=start)
        if start > 0:
            bs = self.block_size
            num_blocks = -(-(start + n) // bs)
            chunk.block_table = torch.tensor([table[:num_blocks]], dtype=torch.long, device=self.device)
            key_pos = torch.arange(num_blocks * bs, device=self.device)
            query_pos = torch.arange(start, start + n, device=self.device)
            chunk.mask = (key_pos[None, :] <= query_pos[:, None])[None, None]
        return chunk
