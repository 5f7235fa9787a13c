"""Intra-operator sharding over the tensor-parallel axis: the layout algebra (`layout`), tensor dims (`dims`),
per-op strategies (`rules`), the integer problem (`problem`), the priced model of a segment (`model`) and its
pricing (`cost`)."""
