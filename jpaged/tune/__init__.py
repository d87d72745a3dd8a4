"""`jpaged tune`: the tuning flow (memory until preemptions stop, then max_num_seqs, then
features), replayed on the user's workload (the decisions in policy.py)."""
