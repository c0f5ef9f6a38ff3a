"""A light import: `import packattn` loads neither torch nor a backend, the public names load only their
own modules, and the heavy ones (triton, FlexAttention, torch's varlen_attn / dynamo) wait for first use.
Each check runs in a fresh interpreter (this one has everything imported already). Times are measured by
`benchmarks/import_time.py`, not here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("triton", "torch._dynamo", "sympy", "torch.nn.attention.varlen", "torch.nn.attention.flex_attention",
         "packattn.backends.triton_varlen", "packattn.backends.flex", "packattn.backends.torch_varlen")


def loaded_after(code: str) -> set[str]:
    """Modules in ``sys.modules`` after running ``code`` in a fresh interpreter."""
    program = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_import_packattn_loads_no_torch():
    mods = loaded_after("import packattn\nassert packattn.__version__")
    assert "torch" not in mods and not any(m.startswith("packattn.") for m in mods), sorted(mods)


def test_submodules_load_on_first_access():
    """``import packattn`` then ``packattn.tree.Tree`` works as when the package imported its submodules eagerly."""
    mods = loaded_after("import packattn\nassert packattn.tree.Tree is packattn.Tree\nassert packattn.dispatch.select")
    assert {"packattn.tree", "packattn.dispatch"} <= mods


def test_public_names_load_no_backend():
    mods = loaded_after("import torch\nfrom packattn import attention, Varlen, Tree, Mask, NoBackendError, "
                        "DotProductAttention")
    assert not [m for m in HEAVY if m in mods]
    assert not [m for m in mods if m.startswith(("packattn.backends.", "packattn.ops"))
                and m != "packattn.backends.base"]


def test_a_first_cpu_call_loads_no_dynamo_flex_or_varlen_attn():
    """On a machine without CUDA the backends that need it say so before importing their torch modules."""
    mods = loaded_after("import torch, packattn\n"
                        "assert not torch.cuda.is_available()\n"
                        "seqs = packattn.Varlen.from_lengths([3, 4])\n"
                        "q = torch.randn(7, 2, 16)\n"
                        "packattn.attention(q, q, q, seqs, causal=True)")
    assert not [m for m in ("torch._dynamo", "torch.nn.attention.varlen", "torch.nn.attention.flex_attention")
                if m in mods]


def test_lazy_names_resolve_and_unknown_names_fail():
    import packattn
    from packattn.api import attention
    from packattn.tree import Tree

    assert packattn.attention is attention and packattn.Tree is Tree
    assert set(packattn.__all__) <= set(dir(packattn))
    with pytest.raises(AttributeError, match="has no attribute 'atention'"):
        packattn.atention  # noqa: B018
    from packattn import backends

    assert backends.REGISTRY is backends.registry() and backends.get("reference").name == "reference"
    with pytest.raises(AttributeError):
        backends.REGISTRYS  # noqa: B018
