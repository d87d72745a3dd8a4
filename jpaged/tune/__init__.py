"""`jpaged tune`: the seed's tuning flow, replayed on the user's workload (policy apart)."""
