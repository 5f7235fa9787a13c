"""The search: space, meshes, candidates, layer-cost table, intra-op ILP, stage problem and partition DP, branch and bound."""
