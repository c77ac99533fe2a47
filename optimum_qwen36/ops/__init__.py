"""Weight-quantization ops: block-scaled FP8 (Qwen's FP8 layout), a PyTorch twin and a native CPU kernel."""
