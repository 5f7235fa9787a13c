"""Model zoo: plain PyTorch definitions with config dataclasses and named presets.

One module per family (gpt, llama, moe, bert, t5, vit, resnet, dlrm), each exporting a `FAMILY` record
(models/family.py); shared layers live in attention.py, feedforward.py and rope.py; zoo.py holds the family
table and the presets. Only the CLI's model registry and the tests import this package.
"""
