"""@triton.jit code only; launchers live in `packattn.backends`."""
