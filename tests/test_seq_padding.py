"""Sequence padding: CP load balancing, sequence parallelism and the FP8 GEMM token alignment together."""
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.config.model import ParallelConfig
from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.phases import batching


def test_known_layouts():
    tp2_sp = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    assert batching.seq_multiple(tp2_sp) == 2
    assert batching.seq_multiple(tp2_sp, PrecisionConfig()) == 2
    assert batching.seq_multiple(tp2_sp, PrecisionConfig(recipe="blockwise")) == 32
    assert batching.seq_multiple(ParallelConfig(), PrecisionConfig(recipe="mxfp8")) == 32
    cp2 = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2)
    assert batching.seq_multiple(cp2) == 8
    assert batching.seq_multiple(cp2, PrecisionConfig(recipe="tensorwise")) == 64


@settings(max_examples=200, deadline=None)
@given(tp=st.sampled_from([1, 2, 4, 8]), cp=st.sampled_from([1, 2, 4]), sp=st.booleans(),
       recipe=st.sampled_from(["none", "delayed", "tensorwise", "blockwise", "mxfp8"]), length=st.integers(1, 5000))
def test_padded_length_satisfies_every_constraint(tp, cp, sp, recipe, length):
    parallel = ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp and tp > 1)
    m = batching.seq_multiple(parallel, PrecisionConfig(recipe=recipe))
    padded = -(-length // m) * m
    shards = cp * (tp if parallel.sequence_parallel else 1)
    assert padded % (2 * cp if cp > 1 else 1) == 0
    assert padded % shards == 0
    tokens_per_rank_row = padded // shards
    align = {"none": 1, "mxfp8": 32}.get(recipe, 16)
    assert tokens_per_rank_row % align == 0
    assert padded - length < m  # no more padding than needed
