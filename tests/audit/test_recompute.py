"""The head-only, chunked recompute equals a naive full forward on a tiny random Qwen3 built in-process."""

from __future__ import annotations

import math

import pytest

from polar_gym.audit.recompute import token_logprobs
from tests.audit._tiny import build_model, naive_logprobs

torch = pytest.importorskip("torch")


@pytest.mark.parametrize(("chunk_tokens", "head_rows"), [(4096, 256), (64, 5), (7, 1)])
def test_equals_the_naive_forward(chunk_tokens: int, head_rows: int) -> None:
    model = build_model()
    ids = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    positions = [*range(150, 300, 3), 1, 299]
    naive = naive_logprobs(model, ids)
    got = token_logprobs(model, ids, positions, chunk_tokens=chunk_tokens, head_rows=head_rows)
    assert len(got) == len(positions)
    # a KV-cached chunked prefill only reorders fp32 sums; even one chunk is not bit for bit the naive forward, since
    # the head's GEMM over the chosen rows is another shape than over every row, and BLAS may round those apart
    # (4.8e-7 seen on an AMD EPYC; 0 on other CPUs)
    assert max(abs(a - naive[t - 1]) for a, t in zip(got, positions, strict=True)) <= 1e-5
    assert all(math.isfinite(v) and v < 0 for v in got)


def test_positions_in_any_order_and_repeated() -> None:
    model = build_model()
    ids = list(range(40))
    naive = naive_logprobs(model, ids)
    got = token_logprobs(model, ids, [30, 2, 30])
    assert got == pytest.approx([naive[29], naive[1], naive[29]], abs=1e-5)
    assert got[0] == got[2]  # a repeated position is the same row of the same computation
    assert token_logprobs(model, ids, []) == []


def test_positions_out_of_range_are_refused() -> None:
    model = build_model()
    with pytest.raises(ValueError):
        token_logprobs(model, [1, 2, 3], [0])
    with pytest.raises(ValueError):
        token_logprobs(model, [1, 2, 3], [3])
