"""Matrix products and embedding lookups straight from GGUF (ggml) quantized weight blocks."""
