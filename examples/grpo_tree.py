"""One GRPO training step of a small decoder on a tree-packed batch vs the same batch as plain varlen.

    python examples/grpo_tree.py                      # small on CPU, larger on a GPU
    python examples/grpo_tree.py --device cuda --prompts 8 --group 16 --prompt-len 1024
    python examples/grpo_tree.py --help

Prints tokens, peak memory (CUDA), step time and the largest relative differences (log-probs, loss,
parameter gradients) between the two packings; exits with status 1 when a float32 difference
exceeds 1e-5. The logic lives in `packattn.demo_tree` (also run by ``packattn demo tree``).
"""

import sys

from packattn.demo_tree import main

if __name__ == "__main__":
    sys.exit(main())
