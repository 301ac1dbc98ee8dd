"""Carpool's float32-accumulating linear kernel (``replica/kernels/csrc/cpu_linear_f32.cpp``) against
float64 and against itself: within the rounding bound of a float32 dot product, bf16 weights
giving exactly the float32 sums of their widened values rounded to bf16, a row's bits the same in
any batch, and the engine's linears routed through it."""

from __future__ import annotations

import pytest
import torch

from replica.kernels import cpu_kernels

BUILT = cpu_kernels.load()
pytestmark = pytest.mark.skipif(
    not (BUILT and cpu_kernels.has_f32_gemv()), reason="Carpool's float32 kernel needs the CPU kernels and AVX2 + FMA"
)
ops = torch.ops.carpool_cpu if BUILT else None


def _case(rows: int, in_features: int, out_features: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g) / 10
    bias = torch.randn(out_features, generator=g)
    x = torch.randn(1, rows, in_features, generator=g)
    return x, weight, bias


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 40, 300])
@pytest.mark.parametrize("shape", [(576, 1536), (1537, 575), (64, 100), (3, 5)])
def test_f32_linear_is_within_the_dot_product_rounding_bound(rows, shape):
    """|got - exact| <= K u sum_k |x_k w_k| + u |b| (u = 2**-24): the error bound of a float32
    dot product summed in any order (Higham, Accuracy and Stability of Numerical Algorithms, 2nd
    ed., eq. 3.5), against the product computed in float64."""
    in_features, out_features = shape
    x, weight, bias = _case(rows, in_features, out_features, seed=rows)
    packed = ops.pack_f32_weight(weight)
    u = 2.0**-24
    for b in (None, bias):
        got = ops.f32_linear(x, packed, b, out_features)
        assert got.shape == (1, rows, out_features) and got.dtype == torch.float32
        exact = x.double() @ weight.double().T + (b.double() if b is not None else 0)
        magnitude = x.double().abs() @ weight.double().abs().T
        bound = in_features * u * magnitude + (u * b.double().abs() if b is not None else 0) + 1e-30
        assert ((got.double() - exact).abs() <= bound).all(), (rows, shape)


@pytest.mark.parametrize("rows", [1, 3, 12, 13, 40])
@pytest.mark.parametrize("shape", [(576, 1536), (1537, 575), (3, 5)])
def test_bf16_weights_give_the_float32_sums_of_their_values_rounded_once(rows, shape):
    """bf16 weights and rows are widened to float32 exactly and summed as float32 ones are, and
    each output is rounded to bf16 once (to nearest even): the result is the float32 kernel's on
    the widened values, rounded, to the bit."""
    in_features, out_features = shape
    x, weight, bias = _case(rows, in_features, out_features, seed=rows)
    x, weight, bias = x.bfloat16(), weight.bfloat16(), bias.bfloat16()
    packed = ops.pack_f32_weight(weight)
    assert packed.dtype == torch.bfloat16
    wide = ops.pack_f32_weight(weight.float())
    for b in (None, bias):
        got = ops.f32_linear(x, packed, b, out_features)
        assert got.shape == (1, rows, out_features) and got.dtype == torch.bfloat16
        expected = ops.f32_linear(x.float(), wide, None if b is None else b.float(), out_features).bfloat16()
        assert torch.equal(got, expected), (rows, shape)


def _sequential_fma(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The sum the kernel documents, one output at a time: acc = fma(x[k], w[k], acc) for k in
    ascending order in float32, then + bias, then rounded to x's dtype. A float32 product is exact
    in float64 and the float64 sum is rounded once to float32 (a double rounding could differ from
    a true FMA in about one case in 2**29; none occurs in these cases)."""
    acc = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32)
    xd, wd = x.double(), weight.double()
    for k in range(x.shape[1]):
        acc = (xd[:, k, None] * wd[None, :, k] + acc.double()).float()
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 13, 16, 25, 36, 37, 61])
@pytest.mark.parametrize("out_features", [49, 81])
def test_each_output_is_one_fma_per_k_in_ascending_order(rows, dtype, out_features):
    """Pins the order of the sum on whichever build runs (AVX2: 6 rows x 2 vectors of 8; AVX512:
    up to 12 rows, 2 or 4 panels at once for 1 to 4 rows, 2 widened panels from 37 rows): every
    path gives the documented sum to the bit, so the builds agree with each other. 49 and 81
    outputs end in a partial group of 16, and 81's 6 groups leave a panel of its own on 2 threads."""
    x, weight, bias = (t.to(dtype) for t in _case(rows, 37, out_features, seed=rows))
    x = x[0]
    packed = ops.pack_f32_weight(weight)
    for b in (None, bias):
        got = ops.f32_linear(x, packed, b, out_features)
        assert torch.equal(got, _sequential_fma(x, weight, b)), (rows, b is None)


def test_bf16_nan_stays_nan():
    """inf + -inf is NaN, and stays NaN when rounded to bf16 (the quiet NaN 0x7FC0 of c10's scalar
    conversion, whatever sign the CPU gave it): the rounding's carry never turns it into inf."""
    x = torch.tensor([[float("inf"), float("-inf")]], dtype=torch.bfloat16)
    weight = torch.ones(3, 2, dtype=torch.bfloat16)
    got = ops.f32_linear(x, ops.pack_f32_weight(weight), None, 3)
    assert torch.isnan(got).all() and (got.view(torch.int16) == 0x7FC0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(576, 1536), (1536, 576), (575, 100)])
def test_a_row_gets_the_same_bits_in_any_batch(shape, dtype):
    """Batch invariance at its root: a row's output is bit-identical whether its step has 1 row or
    300 (a decode alone, batched, or a prefill chunk), so a request's tokens do not depend on its
    batch mates. torch's float32 linear (MKL) gives 1 to 3 rows other bits than 4 or more on AVX2,
    and oneDNN's bf16 one some rows other bits in other batches."""
    in_features, out_features = shape
    x, weight, bias = (t.to(dtype) for t in _case(300, in_features, out_features, seed=1))
    packed = ops.pack_f32_weight(weight)
    alone = torch.cat([ops.f32_linear(x[:, i : i + 1], packed, bias, out_features) for i in range(300)], dim=1)
    for rows in (2, 3, 4, 5, 6, 7, 11, 12, 13, 33, 300):
        assert torch.equal(ops.f32_linear(x[:, :rows], packed, bias, out_features), alone[:, :rows]), rows
    # Any rows of the batch, not only its first ones.
    assert torch.equal(ops.f32_linear(x[:, 100:117], packed, bias, out_features), alone[:, 100:117])


def test_no_rows_give_no_rows():
    """A prefill chunk that samples nothing keeps no logits: the output embedding gets 0 rows."""
    x, weight, _ = _case(0, 64, 100)
    assert ops.f32_linear(x, ops.pack_f32_weight(weight), None, 100).shape == (1, 0, 100)


def test_no_input_features_give_the_bias():
    bias = torch.arange(5, dtype=torch.float32)
    packed = ops.pack_f32_weight(torch.empty(5, 0))
    assert torch.equal(ops.f32_linear(torch.empty(2, 0), packed, bias, 5), bias.expand(2, 5))
    assert torch.equal(ops.f32_linear(torch.empty(2, 0), packed, None, 5), torch.zeros(2, 5))


def test_bad_inputs_are_refused_with_a_reason():
    x, weight, bias = _case(3, 64, 100)
    packed = ops.pack_f32_weight(weight)
    with pytest.raises(RuntimeError, match="x must be Float like the packed weight"):
        ops.f32_linear(x.double(), packed, bias, 100)
    with pytest.raises(RuntimeError, match="x must be BFloat16 like the packed weight"):
        ops.f32_linear(x, ops.pack_f32_weight(weight.bfloat16()), bias, 100)
    with pytest.raises(RuntimeError, match="do not match the packed weight"):
        ops.f32_linear(x[..., :63], packed, bias, 100)
    with pytest.raises(RuntimeError, match="bias must have 100 elements in one dimension"):
        ops.f32_linear(x, packed, bias[:99], 100)
    with pytest.raises(RuntimeError, match="bias must have 100 elements in one dimension"):
        ops.f32_linear(x, packed, bias.view(100, 1), 100)
    with pytest.raises(RuntimeError, match="pack_f32_weight: a 2-D float32 or bfloat16 weight"):
        ops.pack_f32_weight(weight.half())


def test_prepack_linears_routes_a_float32_model_through_the_kernel(tiny_llama):
    """Every linear of a float32 model is packed, its weight released (the tied output embedding
    keeps the input embedding's), and the logits stay those of torch's own linears within float32
    rounding; the greedy token is the same."""
    from transformers import AutoModelForCausalLM

    from replica.worker.compilation import prepack_linears

    reference = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert prepack_linears(model) == len(linears) > 0
    tied = model.get_output_embeddings()
    assert all(m.weight.numel() == 0 for m in linears if m is not tied)
    assert tied.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    ids = torch.tensor([[5, 900, 31, 7000, 12, 40000, 3]])
    with torch.no_grad():
        got, expected = model(ids).logits, reference(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_a_linear_layer_with_a_forward_of_its_own_keeps_it():
    """PhiMoE's router is an ``nn.Linear`` whose forward also picks each token's experts: it is not
    packed (replacing its forward broke every step), the plain linears are, and the logits stay
    those of the unpacked model within float32 rounding."""
    from transformers import AutoModelForCausalLM, PhimoeConfig

    from replica.worker.compilation import prepack_linears

    torch.manual_seed(0)
    config = PhimoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(reference.state_dict())
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    routers = [m for m in linears if type(m).forward is not torch.nn.Linear.forward]
    assert routers and prepack_linears(model) == len(linears) - len(routers) > 0
    assert all(r.weight.numel() > 0 and not hasattr(r, "carpool_f32_weight") for r in routers)
    ids = torch.tensor([[5, 90, 31, 70, 12, 200, 3]])
    with torch.no_grad():
        got, expected = model(ids).logits, reference(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_falcon_s_linear_subclass_is_packed():
    """Falcon's ``FalconLinear`` overrides ``forward`` with ``input @ weight.T`` (+ bias), which is
    ``nn.Linear``'s: every linear of a Falcon model is packed (it lost the kernel when subclasses
    were all kept), and the logits stay those of the unpacked model within float32 rounding."""
    from transformers import AutoModelForCausalLM, FalconConfig
    from transformers.models.falcon.modeling_falcon import FalconLinear

    from replica.worker.compilation import prepack_linears

    torch.manual_seed(0)
    config = FalconConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, bias=True)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(reference.state_dict())
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert sum(isinstance(m, FalconLinear) for m in linears) >= 8
    assert prepack_linears(model) == len(linears)
    assert all(hasattr(m, "carpool_f32_weight") for m in linears)
    ids = torch.tensor([[5, 90, 31, 70, 12, 200, 3]])
    with torch.no_grad():
        got, expected = model(ids).logits, reference(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


class _Scaled(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x) * 1.0078125  # one bf16 ulp above 1


class _Upcast(torch.nn.Linear):
    def forward(self, x):
        return torch.nn.functional.linear(x.float(), self.weight.float(), self.bias.float())


class _Router(torch.nn.Linear):
    def forward(self, x):
        logits = super().forward(x)
        return logits, logits.topk(2, dim=-1).indices


class _Relu(torch.nn.Linear):
    def forward(self, x):
        return torch.relu(super().forward(x))


class _Clamp(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x).clamp(-0.5, 0.5)


class _Cosine(torch.nn.Linear):
    def forward(self, x):
        return super().forward(torch.nn.functional.normalize(x, dim=-1))


class _Matmul(torch.nn.Linear):
    def forward(self, x):
        return x @ self.weight.T + self.bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "cls, packed",
    [
        (torch.nn.Linear, True), (_Matmul, True), (_Scaled, False), (_Router, False), (_Relu, False),
        (_Clamp, False), (_Cosine, False), (_Upcast, None),
    ],
)
def test_a_linear_subclass_is_packed_only_where_its_forward_is_linear_s(cls, packed, dtype):
    """A subclass is packed where its output is ``nn.Linear``'s; one that scales, returns a tuple,
    clamps or normalises keeps its forward. Upcasting to float32 is ``nn.Linear``'s forward only
    for a float32 model."""
    from replica.worker.compilation import _plain_linear

    torch.manual_seed(0)
    module = cls(24, 40).to(dtype)
    torch.nn.init.normal_(module.weight, std=0.02)
    if packed is None:
        packed = dtype == torch.float32
    assert _plain_linear(module, dtype) is packed


def test_a_forward_set_on_the_instance_is_probed_too():
    """A forward replaced on a plain ``nn.Linear`` (as quantisation toolkits do) is checked like
    a subclass's: one that doubles its output keeps it."""
    from replica.worker.compilation import _plain_linear

    module = torch.nn.Linear(24, 40)
    plain = torch.nn.Linear.forward
    module.forward = lambda x: plain(module, x)
    assert _plain_linear(module, torch.float32)
    module.forward = lambda x: 2 * plain(module, x)
    assert not _plain_linear(module, torch.float32)


def test_a_float32_layer_kept_in_a_bf16_model_keeps_its_forward():
    """Ergo keeps its MoE router's linear in float32 in a bf16 model and casts the router's bf16
    input itself: packing it (its rows probed in float32) made every forward fail with
    ``f32_linear: x must be Float``. It keeps its forward, and the prepacked model's logits equal
    the unpacked model's."""
    from transformers import AutoModelForCausalLM, ErgoConfig

    from replica.worker.compilation import prepack_linears

    torch.manual_seed(0)
    config = ErgoConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        first_dense_intermediate_size=128, num_dense_blocks=1, moe_intermediate_size=32, shared_intermediate_size=64,
        num_experts=8, num_experts_per_tok=2, sliding_window=16, global_attention_every_n_layers=2, head_dim=16,
    )
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.load_state_dict(reference.state_dict())
    kept = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float32]
    assert kept and prepack_linears(model) > 0
    assert all(m.weight.numel() > 0 for m in kept)
    ids = torch.tensor([[5, 90, 31, 70, 12, 200, 3, 44, 17]])
    with torch.no_grad():
        got, expected = model(ids).logits, reference(ids).logits
    torch.testing.assert_close(got.float(), expected.float(), rtol=0.02, atol=0.02)


@pytest.mark.skipif(cpu_kernels.has_bf16_gemv(), reason="with AVX512-BF16, Carpool's vdpbf16ps kernel serves bf16")
def test_prepack_linears_routes_a_bf16_model_through_the_kernel_without_avx512_bf16(tiny_llama):
    """Without AVX512-BF16 (oneDNN's bf16 GEMM is slow there and batch-variant), every linear of a
    bf16 model is packed for this kernel in bf16, and the logits stay those of torch's own bf16
    linears within bf16 rounding."""
    from transformers import AutoModelForCausalLM

    from replica.worker.compilation import prepack_linears

    reference = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert prepack_linears(model) == len(linears) > 0
    assert all(m.carpool_f32_weight.dtype == torch.bfloat16 for m in linears)
    ids = torch.tensor([[5, 900, 31, 7000, 12, 40000, 3]])
    with torch.no_grad():
        got, expected = model(ids).logits, reference(ids).logits
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize(
    "pack, dtype",
    [("pack_bf16_weight", torch.bfloat16), ("pack_f32_weight", torch.float32), ("pack_f32_weight", torch.bfloat16)],
)
def test_a_tied_embedding_reads_the_bf16_kernel_s_packed_weight(pack, dtype):
    """A tied weight (100 outputs: a partial last panel; 63 columns: an odd K, which the bf16
    layout pads) shared by the embedding and two linears: both linears are packed from the whole
    weight. On the bf16 kernel's layout the weight is released and the embedding's rows, read
    from the packed copy, are the weight's bit for bit, for ids on both sides of a panel's edge,
    in any shape; on the float32 kernel's layout the embedding keeps the weight."""
    from replica.worker.compilation import _pack_each

    torch.manual_seed(0)
    weight = torch.randn(100, 63).to(dtype)
    model = torch.nn.Module()
    model.embedding = embedding = torch.nn.Embedding(100, 63, _weight=weight.clone())
    model.head = torch.nn.Linear(63, 100, bias=False, dtype=dtype)
    model.head2 = torch.nn.Linear(63, 100, bias=False, dtype=dtype)
    model.head.weight = model.head2.weight = embedding.weight  # tied
    model.get_input_embeddings = lambda: embedding
    field = "carpool_gemv_weight" if pack == "pack_bf16_weight" else "carpool_f32_weight"

    def pack_head(module, w):
        setattr(module, field, getattr(ops, pack)(w))

    assert _pack_each(model, pack_head) == 2
    assert torch.equal(getattr(model.head2, field), getattr(ops, pack)(weight))
    ids = torch.tensor([[0, 15, 16, 17], [31, 32, 98, 99]])
    if pack == "pack_f32_weight":
        assert embedding.weight.numel() == 100 * 63 and torch.equal(embedding(ids), weight[ids])
        return
    assert embedding.weight.numel() == 0
    got = embedding(ids)
    assert got.dtype == dtype and got.shape == (2, 4, 63)
    assert torch.equal(got, weight[ids])
    assert torch.equal(embedding(ids[1]), weight[ids[1]])
