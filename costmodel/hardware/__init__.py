"""The hardware the cost model prices: device specs and their catalog (`data/`), clusters and their YAML form,
the collective model and its fits to measured collectives."""
