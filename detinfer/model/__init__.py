"""Model files: the GGUF file and its validated metadata, the frozen config, architectures, the registry of
downloadable models, the tokenizer, chat templates, quantized block formats and the repacked weights (with their
on-disk store). Nothing here runs a forward pass; compute/ does."""
