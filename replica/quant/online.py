"""Online weight-only quantization of a full-precision model (``--quantization int8|int4``): each
linear layer's weight is cut into blocks of 32 along K at load and computed by Carpool's block
kernels (:mod:`replica.quant.blocks`), with the model's own activations (bfloat16 or float32).

* ``int8``: every linear layer as Q8_0 blocks (``w = d * q``, ``q`` a signed byte, an fp16 ``d`` per
  32 weights).
* ``int4``: every decoder linear layer as Q4_1 blocks (``w = d * q + m``, ``q`` in 0..15, an fp16 ``d``
  and minimum ``m`` per 32 weights); the output layer as Q8_0, as GGUF's 4-bit files keep theirs at
  6 or 8 bits (the logits are the most sensitive to rounding).

The blocks are llama.cpp's reference quantizers' (:func:`~replica.quant.blocks.quantize_q8_0`,
:func:`~replica.quant.blocks.quantize_q4_1`). A tied input embedding reads its rows from the output
layer's blocks (one copy of the vocabulary's weights). A layer whose ``in_features`` is not a
multiple of 32, or that is not a plain ``nn.Linear`` (a subclass with a forward of its own), stays
as loaded.

Under tensor parallelism each rank quantizes its own shard (a row-wise layer's share of K: the
unsharded layer's blocks where that share is whole blocks), and a tied embedding, a whole copy
beside the head's shard, takes the values the head's blocks stand for. The runner quantizes
before it installs LoRA slots, whose own layers stay dense (adapters on a quantized base, as
QLoRA's users expect); a speculative draft model is not quantized.
"""

from __future__ import annotations

import logging

import torch

from replica.quant.blocks import BLOCK, dequantize, embed_from_blocks, quantize_q4_1, quantize_q8_0, tied_output, use_blocks

logger = logging.getLogger(__name__)

SCHEMES = ("int8", "int4")


def quantize_online(model: torch.nn.Module, scheme: str) -> int:
    """Route each plain ``nn.Linear`` of ``model`` (on CPU, ``in_features`` a multiple of 32) through
    the block kernel for ``scheme`` (see the module's docstring); returns how many.

    Raises:
        ValueError: ``scheme`` is not ``int8`` or ``int4``; a layer's block scale or minimum is not
            finite in fp16 (NaN or infinite weights, or a block wider than fp16 holds: about 8.3e6
            for int8's ``max / 127``), naming the layer.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"online quantization is {' or '.join(SCHEMES)}, not {scheme!r}")
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    dtype = next(model.parameters()).dtype
    shared, tied = tied_output(model)
    count = skipped = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear):
            continue
        # weight.shape, not in_features: under tensor parallelism a rank holds its shard's columns.
        if not _linear_forward(module) or module.weight.shape[1] % BLOCK or module.weight.device.type != "cpu":
            skipped += 1
            continue
        quantize = quantize_q4_1 if scheme == "int4" and module is not head else quantize_q8_0
        blocks = quantize(module.weight)
        for values in (blocks.scales, blocks.mins):
            if values is not None and not bool(torch.isfinite(values).all()):
                raise ValueError(
                    f"quantization {scheme}: layer {name} has a block whose scale or minimum is not finite in fp16 "
                    "(NaN or infinite weights, or values too large for fp16 scales); serve the model without --quantization"
                )
        use_blocks(module, blocks)
        count += 1
    if shared:
        embed_from_blocks(embedding, head, dtype)
    elif tied and hasattr(head, "carpool_q_weight") and type(embedding) is torch.nn.Embedding:
        # The values the whole head's blocks stand for, as embed_from_blocks reads them.
        embedding.weight.data = dequantize(quantize_q8_0(embedding.weight)).to(embedding.weight.dtype)
    logger.info("quantization %s: %d linear layers on block kernels, %d left as loaded (a forward of their own, "
                "or in_features not a multiple of %d)", scheme, count, skipped, BLOCK)
    return count


def _linear_forward(module: torch.nn.Linear) -> bool:
    """Whether ``module`` computes ``nn.Linear``'s own forward (a subclass may, or may add to it)."""
    return type(module).forward is torch.nn.Linear.forward and "forward" not in module.__dict__
