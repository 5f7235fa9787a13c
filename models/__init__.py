"""Model zoo: plain PyTorch definitions with config dataclasses and named presets."""
