"""The quantized-weights bench's core on a tiny GGUF (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 linears, a
Q8_0 embedding): every row's keys; float32 is its own reference (KL 0, agreement 1); the GGUF
at its own quantization matches its dequantized twin. (fp8 is left to the bench's own run: a
third engine would double the test's compile time.)"""

from tiny_models import random_weights, tiny_spec, write_gguf

from jpaged.bench.quant import load_formats, measure_model

SEQS = [[256, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100],
        [256, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
KEYS = {"model", "format", "mean_kl", "top1_agreement", "greedy_agreement_4", "tokens_per_s",
        "weight_bytes", "weight_bytes_float32"}


def test_rows_on_a_tiny_gguf(tmp_path):
    spec = tiny_spec()
    types = {"q_proj": "Q4_1", "k_proj": "Q4_0", "v_proj": "Q8_0", "o_proj": "Q5_0",
             "gate_proj": "Q5_1", "up_proj": "Q4_1", "down_proj": "Q4_0",
             "embed_tokens": "Q8_0", "lm_head": "Q8_0"}
    path = write_gguf(tmp_path / "tiny.gguf", spec, random_weights(spec), quantize=types)
    loaded = dict(load_formats(str(path), ("float32", "gguf")))
    rows = measure_model("tiny", loaded, SEQS, max_tokens=4, rounds=1, engine_args={
        "model": str(path), "kv_cache_memory_bytes": 2**20, "max_num_batched_tokens": 32})
    by = {r["format"]: r for r in rows}
    assert list(by) == ["float32", "gguf"]
    for r in rows:
        assert KEYS <= set(r) and r["model"] == "tiny"
        assert r["positions"] == sum(map(len, SEQS)) and r["generated_tokens"] == 2 * 4
        assert r["tokens_per_s"] > 0 and r["compiles_during_timed_run"] == 0
        assert r["weight_bytes_float32"] == by["float32"]["weight_bytes"]
        assert r["greedy_common_prefix"] == 4.0
    ref = by["float32"]
    assert ref["mean_kl"] == 0.0 and ref["top1_agreement"] == 1.0
    assert ref["greedy_agreement_4"] == 1.0 and ref["greedy_repeatable"]
    g = by["gguf"]
    assert g["mean_kl"] < 1e-8 and g["top1_agreement"] == 1.0
    assert g["greedy_agreement_4"] == 1.0 and g["weight_bytes"] < 0.35 * ref["weight_bytes"]
