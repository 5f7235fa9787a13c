"""Applying a plan on this rank with torch.distributed: one module per parallelism, the mesh, the train step."""
