"""Weight quantization: methods (int8, int4, fp8, gguf), calibration (GPTQ, AWQ) and checkpoints."""
