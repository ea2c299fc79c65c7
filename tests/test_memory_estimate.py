"""The 4D memory estimator: hand-derived values, reference points, validity rules, sweep."""

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracekit.memory.estimate import (
    GIB,
    PRESETS,
    EstimateError,
    ModelDims,
    StageContents,
    StateBuffer,
    StateBytes,
    check_config,
    config_problems,
    estimate_rank,
    paper_estimate,
    param_count,
    preset,
    stage_contents,
    stage_layers,
    sweep,
    total_params,
    verdict,
)
from tracekit.topology import Layout

# h 64, f 128 (f/h = 2), a 4, k 2 (k/a = 1/2, kv_dim = 16*2 = 32), L 4, v 256
TINY = ModelDims(hidden=64, ffn_hidden=128, heads=4, kv_heads=2, layers=4, vocab=256, name="tiny")


def test_tiny_two_stages_by_hand():
    # t=2 c=1 p=2 d=2, s=128 b=1
    e = paper_estimate(TINY, Layout(tp=2, cp=1, pp=2, dp=2), seq=128, mbs=1)
    # params: h*v/t = 64*256/2 = 8192
    #       + 2*(L/p)*h^2*((1 + k/a + 1.5 f/h)/t + 1/h) = 2*2*4096*((1+0.5+3)/2 + 1/64)
    #       = 16384 * 2.265625 = 37120                                        -> 45312
    assert e.params == 45312
    assert e.weights == 2 * 45312 == 90624
    assert e.gradients == 4 * 45312 == 181248
    assert e.optimizer == 12 * 45312 / (2 * 1) == 271872
    # activations: unit s*b*h/(t*c) = 128*64/2 = 4096; per layer 12 + 4*2/4 + 8*2 = 30
    #   layers 30*4096*4 = 491520; embedding input 8*4096*p = 65536; no head (p > 1)
    assert e.detail["act_layers"] == 491520
    assert e.detail["act_embedding"] == 65536
    assert e.activations == 557056
    assert e.total == 90624 + 181248 + 271872 + 557056 == 1_100_800


def test_tiny_single_stage_by_hand():
    # t=1 c=2 p=1 d=1, s=128 b=2: the single stage holds embedding, head and final norm
    e = paper_estimate(TINY, Layout(tp=1, cp=2, pp=1, dp=1), seq=128, mbs=2)
    # params: 2*h*v/t + h = 32768 + 64 = 32832
    #       + 2*4*4096*((1 + 0.5 + 3)/1 + 1/64) = 32768 * 4.515625 = 147968    -> 180800
    assert e.params == 180800
    assert e.optimizer == 12 * 180800 / 2 == 1_084_800
    # unit = 128*2*64/(1*2) = 8192; layers 30*8192*4 = 983040; embedding 8*8192 = 65536;
    # head 4*(1 + 256/64)*8192 = 163840
    assert e.activations == 983040 + 65536 + 163840 == 1_212_416
    assert e.total == 2 * 180800 + 4 * 180800 + 1_084_800 + 1_212_416


def test_param_count_by_module_by_hand():
    # TP rank of 2, middle-free first stage of 2 layers with the embedding
    pc = param_count(TINY, 2, StageContents(layers=2, embedding=True, head=False))
    # per layer: q 64*32 + o 32*64 = 4096, k and v 64*(32/2) each = 2048 -> 6144
    assert pc.attention == 2 * 6144
    assert pc.mlp == 2 * 3 * 64 * 64  # gate, up, down: 64 x 128/2
    assert pc.norms == 2 * 2 * 64  # two RMSNorms per layer, whole on every TP rank
    assert pc.embedding == 128 * 64 and pc.head == 0
    assert pc.total == 45312  # equals the paper's count for the same stage


def test_vocab_is_padded_when_tp_does_not_divide_it():
    odd = ModelDims(64, 128, 4, 2, 4, 255)
    pc = param_count(odd, 2, StageContents(0, True, True))
    assert pc.embedding == pc.head == 128 * 64  # ceil(255 / 2) rows per TP rank
    assert pc.norms == 64  # the final norm


def test_published_llama_parameter_counts():
    assert total_params(PRESETS["llama3-8b"]) == 8_030_261_248
    assert total_params(PRESETS["llama3-70b"]) == 70_553_706_496
    assert total_params(PRESETS["llama3-405b"]) == 405_853_388_800


def test_llama3_8b_unsharded_is_18_bytes_per_parameter():
    m = preset("llama3-8b")
    e = paper_estimate(m, Layout(), seq=8192, mbs=1)
    assert e.params == 8_030_261_248
    assert e.model_states == 18 * 8_030_261_248  # 134.6 GiB: cannot fit one 80 GiB GPU
    assert e.model_states / GIB == pytest.approx(134.61, abs=0.01)
    assert e.verdict(80) == "will-not-fit"


def test_llama3_8b_tp4_pp2_reference_numbers():
    e = paper_estimate(preset("llama3-8b"), Layout(tp=4, pp=2), seq=8192, mbs=1)
    # stage 0: embedding 128256*4096/4 + 16 layers * 218112000/4 + 16 * 2 * 4096 norms
    assert e.params == 128256 * 4096 / 4 + 16 * (218_112_000 - 8192) / 4 + 16 * 8192
    # activations: 8192*4096/4 * (12 + 1 + 28) * 32 layers + 8 * 8192*4096/4 * 2 = 10.375 GiB
    assert e.activations == 8192 * 1024 * 41 * 32 + 8 * 8192 * 1024 * 2
    assert e.activations / GIB == 10.375
    assert e.total / GIB == pytest.approx(27.20, abs=0.01)
    assert e.verdict(80) == "fits" and e.verdict(32) == "may-not-fit" and e.verdict(24) == "will-not-fit"


EVEN = [(name, lay) for name in sorted(PRESETS)
        for lay in (Layout(), Layout(tp=8, pp=2, dp=4), Layout(tp=4, cp=2, pp=4, dp=2), Layout(tp=2, cp=4, dp=3))
        if not config_problems(PRESETS[name], lay, 8192, 1) and PRESETS[name].layers % lay.pp == 0]


@pytest.mark.parametrize("name,lay", EVEN, ids=[f"{n}-{lay}" for n, lay in EVEN])
def test_exact_equals_paper_when_everything_divides(name, lay):
    m, cp, dp = PRESETS[name], lay.cp, lay.dp
    assert len(EVEN) == 11  # 405B (126 layers) has no even split over pp 4
    p, x = paper_estimate(m, lay, 8192, 1), estimate_rank(m, lay, 8192, 1)
    assert x.params == p.params
    assert (x.weights, x.gradients) == (p.weights, p.gradients)
    # ZeRO shards are whole elements: ceil(N / (d*c)); the paper divides exactly
    assert x.optimizer == 12 * math.ceil(p.params / (dp * cp))
    assert x.optimizer - p.optimizer < 12
    assert x.activations == pytest.approx(p.activations, rel=1e-12)


def test_zero_stages_and_byte_counts_are_explicit():
    lay = Layout(tp=2, cp=2, pp=2, dp=3)  # shards over d*c = 6
    n = param_count(TINY, 2, stage_contents(TINY, 2, 1)).total  # last stage: layers + head + norm
    assert n == 2 * 18560 + 128 * 64 + 64
    shard = math.ceil(n / 6)
    fp32_everything = StateBytes(weight=4, gradient=4, master=0, optimizer=8, zero_stage=2)
    e = estimate_rank(TINY, lay, 128, 1, stage=1, state=fp32_everything)
    assert e.params == n and e.detail["shard_params"] == shard
    assert e.weights == 4 * n  # not sharded below ZeRO-3
    assert e.gradients == 4 * shard  # ZeRO-2 shards gradients
    assert e.optimizer == 8 * shard
    z3 = estimate_rank(TINY, lay, 128, 1, stage=1, state=StateBytes(zero_stage=3))
    assert (z3.weights, z3.gradients, z3.optimizer) == (2 * shard, 4 * shard, 12 * shard)
    z0 = estimate_rank(TINY, lay, 128, 1, stage=1, state=StateBytes(zero_stage=0))
    assert z0.optimizer == 12 * n
    with pytest.raises(EstimateError, match="zero_stage"):
        StateBytes(zero_stage=4)


def test_explicit_buffers_per_virtual_stage_bucket():
    # A trainer-like arrangement: rank of PP stage 0 of 2 with 2 virtual stages holds virtual
    # stages 0 (embedding + 1 layer) and 2 (1 layer), each in its own flat buffer sharded over
    # d*c = 3; bf16 weights, a full padded fp32 gradient buffer plus two fp32 gradient shards
    # (reduce-scatter output and the reduced copy), fp32 master and Adam moments on the shard.
    state = (StateBuffer("weights", 2, "params"), StateBuffer("gradients", 4, "padded"),
             StateBuffer("gradients", 4, "shard"), StateBuffer("gradients", 4, "shard"),
             StateBuffer("optimizer", 4, "shard"), StateBuffer("optimizer", 8, "shard"))
    buckets = [StageContents(1, True, False), StageContents(1, False, False)]
    e = estimate_rank(TINY, Layout(pp=2, dp=3), 128, 1, contents=buckets, state=state)
    # per layer at tp 1: q 4096 + o 4096 + k 2048 + v 2048 + mlp 3*64*128 + norms 128 = 36992
    # bucket A: 256*64 + 36992 = 53376 = 3 * 17792; bucket B: 36992 -> shard 12331, padded 36993
    assert e.params == 53376 + 36992
    assert e.detail["shard_params"] == 17792 + 12331
    assert e.weights == 2 * 90368
    assert e.gradients == 4 * (53376 + 36993) + 2 * 4 * (17792 + 12331) == 602460
    assert e.optimizer == 12 * 30123 == 361476
    # one buffer holding both would shard 90368 -> 30123 as well, but pad to 90369 only once
    one = estimate_rank(TINY, Layout(pp=2, dp=3), 128, 1, contents=StageContents(2, True, False),
                        state=state)
    assert one.gradients == 4 * 90369 + 8 * 30123
    with pytest.raises(EstimateError, match="extent must be one of"):
        StateBuffer("weights", 2, "half")
    with pytest.raises(EstimateError, match="component must be one of"):
        StateBuffer("activations", 2, "params")
    with pytest.raises(EstimateError, match="at least one stage"):
        estimate_rank(TINY, Layout(pp=2), 128, 1, contents=[])


def test_activations_follow_stage_and_microbatches_in_flight():
    lay = Layout(tp=1, cp=1, pp=4, dp=1)
    m = ModelDims(64, 128, 4, 2, 8, 256)
    unit = 128 * 64  # s*b*h/(t*c)
    per_layer = 30 * unit
    first = estimate_rank(m, lay, 128, 1, stage=0)
    assert first.detail["microbatches_in_flight"] == 4  # 1F1B: p - stage
    assert first.activations == 2 * 4 * per_layer + 8 * unit * 4
    last = estimate_rank(m, lay, 128, 1, stage=3)
    assert last.activations == 2 * 1 * per_layer + 4 * (1 + 256 / 64) * unit
    afab = estimate_rank(m, lay, 128, 1, stage=3, microbatches_in_flight=6)
    assert afab.activations == 2 * 6 * per_layer + 4 * (1 + 256 / 64) * unit
    fp32 = estimate_rank(m, lay, 128, 1, stage=1, activation_bytes=4)
    assert fp32.activations == 2 * estimate_rank(m, lay, 128, 1, stage=1).activations
    # materialized attention (no FlashAttention): b*(a/t)*(s/c)*s elements per layer and micro-batch
    # t=2 c=2 s=128 b=1 a=4: 1*2*64*128 = 16384 elements, 6 bytes each, 2 layers x 2 in flight
    lay2 = Layout(tp=2, cp=2, pp=2)
    eager = estimate_rank(TINY, lay2, 128, 1, attention_matrix_bytes=6)
    assert eager.detail["act_attention_matrices"] == 16384 * 6 * 2 * 2 == 393216
    assert eager.activations - estimate_rank(TINY, lay2, 128, 1).activations == 393216
    with pytest.raises(EstimateError, match="stage 4 outside"):
        estimate_rank(m, lay, 128, 1, stage=4)
    with pytest.raises(EstimateError, match="microbatches_in_flight"):
        estimate_rank(m, lay, 128, 1, microbatches_in_flight=0)


def test_verdict_is_the_80_percent_rule():
    assert verdict(80, 100) == "fits"
    assert verdict(80.001, 100) == "may-not-fit"
    assert verdict(100, 100) == "may-not-fit"
    assert verdict(100.001, 100) == "will-not-fit"
    with pytest.raises(EstimateError, match="device size"):
        verdict(1, 0)


# -- validity -----------------------------------------------------------------------------------


def test_validity_rules_name_each_problem():
    m = preset("llama3-8b")  # a 32, k 8, f 14336, L 32
    assert config_problems(m, Layout(tp=8, cp=2, pp=4, dp=1), 8192, 1) == []
    probs = config_problems(m, Layout(tp=16), 8192, 1)
    assert probs == ["tp 16 does not divide kv_heads 8"]  # 32 heads and 14336 divide by 16
    assert config_problems(m, Layout(pp=5), 8192, 1) == ["pp 5 divides neither layers 32 nor layers + 2"]
    assert config_problems(m, Layout(cp=3), 8192, 1) == ["seq 8192 does not split into 2*cp = 6 chunks"]
    # 12 tokens split in 4 chunks over cp 2: 6 per CP rank cannot be split over tp 8
    assert config_problems(preset("llama3-70b"), Layout(tp=8, cp=2), 12, 1) == [
        "per-CP-rank tokens 6 do not divide over tp 8 (sequence parallel)"]
    assert config_problems(m, Layout(), 0, 1) and config_problems(m, Layout(), 8192, 0)
    with pytest.raises(EstimateError, match="invalid config .*tp 3 does not divide heads 32"):
        check_config(m, Layout(tp=3), 8192, 1)
    with pytest.raises(EstimateError, match="tp 3"):
        paper_estimate(m, Layout(tp=3), 8192, 1)


def test_llama3_405b_pipeline_layout_sheds_a_layer_on_first_and_last_stage():
    m = preset("llama3-405b")  # 126 layers, Llama 3 ran PP 16
    layers = stage_layers(m, 16)
    assert layers == [7] + [8] * 14 + [7] and sum(layers) == 126
    assert config_problems(m, Layout(tp=8, pp=16, dp=128), 8192, 1) == []
    assert stage_contents(m, 16, 0) == StageContents(7, True, False)
    assert stage_contents(m, 16, 15) == StageContents(7, False, True)
    assert stage_layers(m, 7) == [18] * 7
    with pytest.raises(EstimateError, match="pp 5 divides neither"):
        stage_layers(m, 5)
    # the per-rank parameter counts of all stages add up to the model (tp 1)
    assert sum(param_count(m, 1, stage_contents(m, 16, s)).total for s in range(16)) == total_params(m)


def test_llama3_405b_at_metas_8k_layout_needs_activation_savings():
    # Llama 3 Table 2 at seq 8192: TP 8, CP 1, PP 16, DP 128 (16K GPUs). L/p = 126/16 as in the paper.
    e = paper_estimate(preset("llama3-405b"), Layout(tp=8, pp=16, dp=128), 8192, 1)
    assert e.params == 16384 * 128256 / 8 + 2 * (126 / 16) * 16384**2 * (
        (1 + 8 / 128 + 1.5 * 53248 / 16384) / 8 + 1 / 16384)
    unit = 8192 * 16384 / 8  # s*b*h/(t*c)
    assert e.activations == pytest.approx(unit * ((12 + 0.25 + 26) * 126 + 8 * 16))  # 77.30 GiB
    assert e.total / GIB == pytest.approx(96.61, abs=0.01)
    assert e.verdict(80) == "will-not-fit" and e.verdict(141) == "fits"  # an H200 would do


def test_bad_model_dims_raise_clearly():
    with pytest.raises(EstimateError, match="hidden 100 not divisible by heads 3"):
        ModelDims(100, 128, 3, 1, 2, 10)
    with pytest.raises(EstimateError, match="heads 4 not divisible by kv_heads 3"):
        ModelDims(64, 128, 4, 3, 2, 10)
    with pytest.raises(EstimateError, match="layers must be a positive integer"):
        ModelDims(64, 128, 4, 2, 0, 10)
    with pytest.raises(EstimateError, match="unknown model preset 'gpt2'; known: llama3-405b"):
        preset("gpt2")
    assert preset("Llama-3.1-70B".lower()) is PRESETS["llama3-70b"]


@settings(max_examples=60, deadline=None)
@given(
    heads_kv=st.sampled_from([(4, 1), (4, 2), (8, 2), (8, 8), (6, 3)]),
    head_dim=st.sampled_from([8, 16]),
    ffn_mult=st.integers(1, 4),
    layers=st.integers(1, 12),
    vocab=st.integers(1, 1000),
    tp=st.sampled_from([1, 2, 4]),
    pp=st.sampled_from([1, 2, 3, 4]),
)
def test_stage_counts_add_up_to_the_model(heads_kv, head_dim, ffn_mult, layers, vocab, tp, pp):
    a, k = heads_kv
    h = a * head_dim
    m = ModelDims(h, 2 * ffn_mult * h, a, k, layers, vocab)
    try:
        per_stage = [stage_contents(m, pp, s) for s in range(pp)]
        counts = [param_count(m, tp, c) for c in per_stage]
    except EstimateError:
        assert a % tp or k % tp or (layers % pp and (layers + 2) % pp) or (layers + 2) // pp < 2
        return
    padded_vocab = math.ceil(vocab / tp) * tp
    # TP shards of every stage, times tp, plus one copy of the (replicated) norms, are the
    # model plus the embedding's and head's vocab padding
    assert sum(c.norms for c in counts) == 2 * layers * h + h
    sharded = sum(c.total - c.norms for c in counts) * tp
    assert sharded + sum(c.norms for c in counts) == total_params(m) + 2 * (padded_vocab - vocab) * h
    assert sum(c.layers for c in per_stage) == layers


# -- sweep --------------------------------------------------------------------------------------


def test_sweep_lists_exactly_the_valid_configs_sorted():
    df = sweep(TINY, 8, 128, mbs_values=(1, 2), device_gib=0.001)
    expected = set()
    for tp, cp, pp in itertools.product([1, 2, 4, 8], repeat=3):
        if 8 % (tp * cp * pp):
            continue
        ok_tp = TINY.heads % tp == 0 and TINY.kv_heads % tp == 0  # a 4, k 2 -> tp in {1, 2}
        ok_pp = TINY.layers % pp == 0 or (TINY.layers + 2) % pp == 0 and (TINY.layers + 2) // pp >= 2
        ok_cp = 128 % (2 * cp) == 0 and (128 // cp) % tp == 0
        if ok_tp and ok_pp and ok_cp:
            expected |= {(tp, cp, pp, 8 // (tp * cp * pp), mbs) for mbs in (1, 2)}
    got = {tuple(r) for r in df.select("tp", "cp", "pp", "dp", "mbs").iter_rows()}
    assert got == expected and df.height == len(expected)
    assert df["total_gib"].to_list() == sorted(df["total_gib"].to_list())
    first = df.row(0, named=True)
    e = paper_estimate(TINY, Layout(tp=first["tp"], cp=first["cp"], pp=first["pp"], dp=first["dp"]),
                       128, first["mbs"])
    assert first["total_gib"] == e.total / GIB
    assert first["fraction"] == pytest.approx(e.total / (0.001 * GIB))
    assert set(df["verdict"]) <= {"fits", "may-not-fit", "will-not-fit"}


def test_sweep_filters_and_rejects_bad_arguments():
    m = preset("llama3-70b")
    df = sweep(m, 64, 8192, mbs_values=(1, 2), global_batch=64, max_tp=8)
    assert df.height > 0
    assert (df["tp"] <= 8).all()
    assert ((64 % (df["mbs"] * df["dp"])) == 0).all()
    assert (df["tp"] * df["cp"] * df["pp"] * df["dp"] == 64).all()
    # 70B on 64 GPUs: the best config fits, the worst will not
    assert df["verdict"][0] == "fits" and df["verdict"][-1] == "will-not-fit"
    # 3 GPUs: tp 3 (heads 4) and cp 3 (128 tokens in 6 chunks) are invalid; pp 3 takes
    # Llama 3's layout of 4 + 2 layers: [1, 2, 1]
    three = sweep(TINY, 3, 128, mbs_values=(1,))
    assert sorted(three.select("tp", "cp", "pp", "dp").iter_rows()) == [(1, 1, 1, 3), (1, 1, 3, 1)]
    for kwargs, msg in [({"gpus": 0}, "gpus"), ({"device_gib": 0}, "device size"),
                        ({"mbs_values": (0,)}, "micro-batch")]:
        args = {"gpus": 8, **kwargs}
        with pytest.raises(EstimateError, match=msg):
            sweep(TINY, args.pop("gpus"), 128, **args)
