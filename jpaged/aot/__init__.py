"""Ahead-of-time checks of the compiled engine step: GPU targets without a GPU, buffers, kernels.

`target` describes an H200 to XLA (deviceless compile), `buffers` reads XLA's buffer assignment
(is the KV pool updated in place, or copied), `kernels` reads each Pallas kernel's launch and
ptxas resources, `hlo` / `hbm` estimate the HBM bytes a compiled program moves from its
optimized HLO (`traffic`: the per-case kernel rules and least bytes), `cases` builds the
engine's real step on abstract weights and `report` runs a set of cases into one JSON
(`scripts/gpu_aot.py`).
"""
