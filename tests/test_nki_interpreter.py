"""The numpy NKI interpreter: each modelled instruction against numpy, and each limit it enforces."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from optimum_qwen36.nki import interpreter
from optimum_qwen36.nki.interpreter import NkiLimitError, NkiUnsupportedError
from optimum_qwen36.nki.interpreter import isa as nisa
from optimum_qwen36.nki.interpreter import language as nl
from optimum_qwen36.nki.interpreter import runtime as nki

RNG = np.random.default_rng(0)


def tile(values: np.ndarray, buffer: object = nl.sbuf, dtype: object = nl.float32) -> nl.NkiTensor:
    out = nl.ndarray(values.shape, dtype=dtype, buffer=buffer)
    out.write(values)
    return out


def rand(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def psum(*shape: int) -> nl.NkiTensor:
    return nl.ndarray(shape, dtype=nl.float32, buffer=nl.psum)


def sbuf(*shape: int, dtype: object = nl.float32) -> nl.NkiTensor:
    return nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)


# --- instructions against numpy -------------------------------------------------------------------


def test_nc_matmul_computes_stationary_transpose_times_moving_and_accumulates() -> None:
    a, b, c = rand(128, 96), rand(128, 512), rand(128, 512)
    out = psum(96, 512)
    nisa.nc_matmul(out, tile(a), tile(b), accumulate=False)
    np.testing.assert_allclose(out.read(), a.T @ b, rtol=1e-5, atol=1e-4)
    nisa.nc_matmul(out, tile(a), tile(c), accumulate=True)
    np.testing.assert_allclose(out.read(), a.T @ b + a.T @ c, rtol=1e-5, atol=1e-4)
    nisa.nc_matmul(out, tile(a), tile(c), accumulate=False)  # overwrites
    np.testing.assert_allclose(out.read(), a.T @ c, rtol=1e-5, atol=1e-4)


def test_nc_matmul_bfloat16_operands_are_rounded() -> None:
    a, b = rand(64, 8), rand(64, 16)
    out = psum(8, 16)
    nisa.nc_matmul(out, tile(a, dtype=nl.bfloat16), tile(b, dtype=nl.bfloat16), accumulate=False)
    a16, b16 = (torch.from_numpy(x).bfloat16().float().numpy() for x in (a, b))
    np.testing.assert_allclose(out.read(), a16.T @ b16, rtol=1e-5, atol=1e-5)


def test_nc_transpose_tensor_and_vector_engines() -> None:
    x = rand(64, 128)
    out = psum(128, 64)
    nisa.nc_transpose(out, tile(x), engine=nisa.engine.tensor)
    np.testing.assert_array_equal(out.read(), x.T)
    small = rand(32, 16)
    out_v = sbuf(16, 32)
    nisa.nc_transpose(out_v, tile(small), engine=nisa.engine.vector)
    np.testing.assert_array_equal(out_v.read(), small.T)


@pytest.mark.parametrize(
    ("op", "fn"),
    [(nl.add, np.add), (nl.subtract, np.subtract), (nl.multiply, np.multiply)],
)
def test_tensor_tensor(op: object, fn: object) -> None:
    a, b = rand(16, 40), rand(16, 40)
    out = sbuf(16, 40)
    nisa.tensor_tensor(out, tile(a), tile(b, nl.psum), op=op)  # one input may be in PSUM
    np.testing.assert_array_equal(out.read(), fn(a, b))


def test_tensor_scalar_scalar_vector_reverse_and_two_ops() -> None:
    x, col = rand(8, 24), rand(8, 1)
    out = sbuf(8, 24)
    nisa.tensor_scalar(out, tile(x), op0=nl.subtract, operand0=tile(col), reverse0=True, op1=nl.multiply,
                       operand1=3.0)  # fmt: skip
    np.testing.assert_array_equal(out.read(), (col - x) * np.float32(3.0))
    nisa.tensor_scalar(out, tile(x), op0=nl.multiply, operand0=2.5)
    np.testing.assert_array_equal(out.read(), x * np.float32(2.5))


def test_activation_exp_and_rsqrt_with_scale_and_bias() -> None:
    x, col = rand(16, 32), rand(16, 1)
    out = sbuf(16, 32)
    nisa.activation(dst=out, op=nl.exp, data=tile(x), scale=-1.0, bias=tile(col))
    np.testing.assert_allclose(out.read(), np.exp(-x + col), rtol=1e-6)
    positive = np.abs(x)
    nisa.activation(dst=out, op=nl.rsqrt, data=tile(positive), bias=1e-6)
    np.testing.assert_allclose(out.read(), 1 / np.sqrt(positive + 1e-6), rtol=1e-6)


def test_tensor_reduce_tensor_copy_memset_and_casts() -> None:
    x = rand(16, 64)
    total = sbuf(16, 1)
    nisa.tensor_reduce(total, op=nl.add, data=tile(x), axis=1)
    np.testing.assert_allclose(total.read(), x.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-5)
    narrow = sbuf(16, 64, dtype=nl.bfloat16)
    nisa.tensor_copy(dst=narrow, src=tile(x, nl.psum))
    np.testing.assert_array_equal(narrow.read(), torch.from_numpy(x).bfloat16().float().numpy())
    nisa.memset(narrow, 3.0)
    assert (narrow.read() == 3.0).all()


def test_affine_select_builds_causal_masks() -> None:
    values = rand(16, 64)
    out = sbuf(16, 64)
    first_row = 32  # rows are tokens 32..47 of a 64-token chunk; keep j <= row
    nisa.affine_select(out, pattern=[[-1, 64]], offset=first_row, channel_multiplier=1,
                       on_true_tile=tile(values), on_false_value=0.0, cmp_op=nl.greater_equal)  # fmt: skip
    rows = first_row + np.arange(16)[:, None]
    np.testing.assert_array_equal(out.read(), np.where(np.arange(64)[None, :] <= rows, values, 0.0))


def test_dma_copy_between_hbm_and_sbuf_with_slices() -> None:
    host = rand(2, 100, 128)
    hbm = nl.ndarray(host.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    hbm.write(host)
    on_chip = sbuf(16, 128)
    nisa.dma_copy(dst=on_chip, src=hbm[1, nl.ds(20, 16), :])
    np.testing.assert_array_equal(on_chip.read(), host[1, 20:36])
    back = nl.ndarray((16, 128), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=back, src=on_chip)
    np.testing.assert_array_equal(back.read(), host[1, 20:36])


def test_ndarray_is_poisoned_until_written() -> None:
    assert np.isnan(sbuf(4, 4).read()).all()
    assert (nl.zeros((4, 4), dtype=nl.float32).read() == 0).all()


def test_jit_round_trips_numpy_and_torch() -> None:
    @nki.jit
    def double(x: nl.NkiTensor) -> nl.NkiTensor:
        on_chip = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=on_chip, src=x)
        nisa.tensor_scalar(on_chip, on_chip, op0=nl.multiply, operand0=2.0)
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=on_chip)
        return out

    x = rand(8, 8)
    np.testing.assert_array_equal(nki.simulate(double)(x), 2 * x)
    xt = torch.from_numpy(x).bfloat16()
    result = double(xt)
    assert result.dtype == torch.bfloat16
    torch.testing.assert_close(result, 2 * xt)


def test_nki_modules_falls_back_to_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPTIMUM_QWEN36_NKI_INTERPRETER", "1")
    assert interpreter.nki_modules() == (nki, nl, nisa)
    assert not interpreter.real_nki_available()


# --- limits and unmodelled constructs raise -------------------------------------------------------


def test_partition_dim_over_128_raises() -> None:
    with pytest.raises(NkiLimitError, match="partition"):
        sbuf(129, 4)


def test_psum_tile_over_one_bank_raises() -> None:
    with pytest.raises(NkiLimitError, match="bank"):
        psum(128, 513)


def test_more_than_eight_live_psum_banks_raises() -> None:
    live = [psum(128, 512) for _ in range(8)]
    with pytest.raises(NkiLimitError, match="PSUM overflow"):
        psum(1, 1)
    del live
    psum(1, 1)  # banks are released with their tiles


def test_sbuf_overflow_raises() -> None:
    with pytest.raises(NkiLimitError, match="SBUF overflow"):
        _tiles = [sbuf(128, 16 * 1024) for _ in range(4)]  # 4 x 64 KiB per partition > 192 KiB


@pytest.mark.parametrize(
    ("stationary", "moving", "dst", "match"),
    [
        ((128, 129), (128, 16), (128, 16), "stationary free"),
        ((128, 16), (128, 513), (16, 513), "moving free|bank"),
        ((64, 16), (32, 16), (16, 16), "contraction"),
        ((16, 16), (16, 16), (16, 8), "dst shape"),
    ],
)
def test_nc_matmul_shape_limits(stationary: tuple, moving: tuple, dst: tuple, match: str) -> None:
    with pytest.raises(NkiLimitError, match=match):
        nisa.nc_matmul(psum(*dst), tile(rand(*stationary)), tile(rand(*moving)), accumulate=False)


def test_nc_matmul_operand_buffers_and_dtypes() -> None:
    a, b = tile(rand(16, 16)), tile(rand(16, 16))
    with pytest.raises(NkiLimitError, match="stationary must be in sbuf"):
        nisa.nc_matmul(psum(16, 16), tile(rand(16, 16), nl.psum), b, accumulate=False)
    with pytest.raises(NkiLimitError, match="dst must be in psum"):
        nisa.nc_matmul(sbuf(16, 16), a, b, accumulate=False)
    with pytest.raises(NkiLimitError, match="float32"):
        nisa.nc_matmul(nl.ndarray((16, 16), dtype=nl.bfloat16, buffer=nl.psum), a, b, accumulate=False)
    with pytest.raises(NkiUnsupportedError, match="accumulate"):
        nisa.nc_matmul(psum(16, 16), a, b)


def test_nc_transpose_limits() -> None:
    with pytest.raises(NkiLimitError, match="reads SBUF, writes PSUM"):
        nisa.nc_transpose(sbuf(8, 4), tile(rand(4, 8)), engine=nisa.engine.tensor)
    with pytest.raises(NkiLimitError, match="32x32"):
        nisa.nc_transpose(sbuf(64, 4), tile(rand(4, 64)), engine=nisa.engine.vector)


def test_elementwise_operand_rules() -> None:
    with pytest.raises(NkiLimitError, match="both be in PSUM"):
        nisa.tensor_tensor(sbuf(4, 4), tile(rand(4, 4), nl.psum), tile(rand(4, 4), nl.psum), op=nl.add)
    with pytest.raises(NkiLimitError, match="shapes"):
        nisa.tensor_tensor(sbuf(4, 4), tile(rand(4, 4)), tile(rand(4, 5)), op=nl.add)
    with pytest.raises(NkiLimitError, match=r"\(4, 1\)"):
        nisa.tensor_scalar(sbuf(4, 4), tile(rand(4, 4)), op0=nl.add, operand0=tile(rand(4, 2)))
    with pytest.raises(NkiLimitError, match="affine_select dst must be in sbuf"):
        nisa.affine_select(psum(4, 4), [[1, 4]], 0, 1, tile(rand(4, 4)), 0.0, cmp_op=nl.greater_equal)


def test_dma_rules() -> None:
    hbm = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.shared_hbm)
    with pytest.raises(NkiLimitError, match="PSUM"):
        nisa.dma_copy(dst=psum(4, 4), src=hbm)
    with pytest.raises(NkiLimitError, match="convert"):
        nisa.dma_copy(dst=sbuf(4, 4, dtype=nl.bfloat16), src=hbm)


def test_indexing_rules() -> None:
    x = sbuf(16, 64)
    with pytest.raises(NkiLimitError, match="out of bounds"):
        x[:, 60:70]
    with pytest.raises(NkiUnsupportedError, match="strided"):
        x[:, ::2]
    with pytest.raises(NkiUnsupportedError, match="partition"):
        x[3, :]
    with pytest.raises(NkiUnsupportedError, match="assignment"):
        x[0:1, 0:1] = 1.0
    assert x[nl.ds(2, 4), nl.ds(8, 8)].shape == (4, 8)


def test_unmodelled_constructs_raise() -> None:
    with pytest.raises(NkiUnsupportedError, match="tile function"):
        nl.add(sbuf(4, 4), sbuf(4, 4))
    with pytest.raises(NkiUnsupportedError, match="reduce registers"):
        nisa.activation(dst=sbuf(4, 4), op=nl.exp, data=tile(rand(4, 4)), reduce_op=nl.add)
    with pytest.raises(NkiUnsupportedError, match="axis 1"):
        nisa.tensor_reduce(sbuf(4, 1), op=nl.add, data=tile(rand(4, 4, 2)), axis=2)
    with pytest.raises(NkiUnsupportedError, match="not a modelled"):
        nisa.activation(dst=sbuf(4, 4), op=nl.add, data=tile(rand(4, 4)))
    with pytest.raises(NkiUnsupportedError, match="dtype"):
        nki.simulate(lambda x: x)(np.zeros((2, 2), dtype=np.float64))
    with pytest.raises(NkiUnsupportedError, match="HBM"):
        nki.simulate(lambda x: sbuf(2, 2))(np.zeros((2, 2), dtype=np.float32))
