"""Render the pool and block-table pictures of docs/ from a real run of the embedded model.

    python scripts/plot_cache_state.py [--out-dir docs/img]

Four chat requests share a system prompt that an earlier batch left in the prefix cache; the
snapshot is taken while they decode, so the pool shows one shared copy of the system prompt,
each request's private blocks, cached free blocks and free blocks.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jpaged import LLM, SamplingParams, viz

SYSTEM = ("You are the jpaged manual assistant. Answer in one short sentence, use plain words, "
          "and say so when you do not know. ") * 2
FIRST = ["What is a KV block?", "What is prefix caching?", "What is preemption?",
         "What is a block table?"]
SECOND = ["What is a free block?", "What is eviction?", "What is a null block?",
          "What is a token budget?"]


def main() -> None:
    """Run the scenario, write pool.png and block_tables.png."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out-dir", type=Path, default=Path("docs/img"))
    args = ap.parse_args()
    llm = LLM(max_model_len=512, num_gpu_blocks_override=96, max_num_seqs=8,
              max_num_batched_tokens=256)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.chat([[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
              for q in FIRST], params)
    tok = llm.get_tokenizer()
    engine = llm.llm_engine
    for i, q in enumerate(SECOND):
        text = tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                        {"role": "user", "content": q}])
        engine.add_request(f"req-{i}", {"prompt_token_ids": tok.encode(
            text, add_special_tokens=False)}, params)
    for _ in range(2):
        engine.step()
    state = llm.cache_state()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    viz.plot_pool(state).savefig(args.out_dir / "pool.png", dpi=110)
    viz.plot_block_tables(state).savefig(args.out_dir / "block_tables.png", dpi=110)
    while engine.has_unfinished_requests():
        engine.step()
    print(f"wrote {args.out_dir / 'pool.png'} and {args.out_dir / 'block_tables.png'}")


if __name__ == "__main__":
    main()
