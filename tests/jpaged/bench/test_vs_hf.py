"""jpaged vs HF on the tiny model: all three produce the same greedy tokens, full lengths."""

from helpers import tiny

from jpaged.bench import vs_hf
from jpaged.bench.workloads import mixed_length_requests


def test_three_runners_agree_token_for_token(tmp_path):
    loaded = tiny()
    hf = vs_hf.hf_twin(loaded, tmp_path / "twin")
    prompts = [p for p, _ in mixed_length_requests(loaded.spec.vocab_size, 3, 0, (5, 20), (1, 1))]
    runs = [vs_hf.run_jpaged(vs_hf.jpaged_engine(loaded, 128, 3), prompts, 5, "t"),
            vs_hf.run_hf_generate(hf, prompts, 5, pad_id=0),
            # A small paged cache: HF's own sizing allocates GiBs of CPU RAM in the call.
            vs_hf.run_hf_generate_batch(hf, prompts, 5, pad_id=0, cache_blocks=16)]
    for r in runs:
        assert [len(t) for t in r["token_ids"]] == [5, 5, 5]
        assert r["tokens_per_s"] > 0 and 0 < r["ttft_s"] <= r["wall_s"]
    assert vs_hf.agreement(runs[0]["token_ids"], runs[1]["token_ids"]) == 1.0
    assert vs_hf.agreement(runs[0]["token_ids"], runs[2]["token_ids"]) == 1.0
    assert vs_hf.xla_cpu_threads() >= 1
