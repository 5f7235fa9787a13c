"""The search: the space, meshes, candidates, the layer-cost table, the intra-op ILP, the stage problem and
partition DP, branch and bound."""
