"""Float products on CPU: padded and packed ``Linear`` replacements (``linear``), the per-row-count
choice between them (``row_plans``), and the exact screened argmax over a large vocabulary
(``screened_head``). Products on a GGUF's own quantized blocks are ``tandem.quant``."""
