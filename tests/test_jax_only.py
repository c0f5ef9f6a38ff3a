"""`packattn.jax` without PyTorch. Runs in the full test environment and, in CI, in a venv that holds only JAX,
pytest and packattn installed without its dependencies (`.ci/run`, with ``--noconftest``): so this file imports
neither torch nor tests/ helpers. Import checks run in a fresh interpreter, where ``sys.modules`` tells what an
import pulled in."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


def test_import_pulls_in_neither_torch_nor_triton():
    pytest.importorskip("jax")
    done = _python("""
        import sys
        import packattn.jax
        print(sorted(m for m in ("torch", "triton", "transformers") if m in sys.modules))
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_without_jax_the_error_says_how_to_install_it():
    done = _python("""
        import sys
        sys.modules["jax"] = None  # what an environment without JAX looks like to an import
        try:
            import packattn.jax
        except ModuleNotFoundError as e:
            print(e.name, "|", e)
        else:
            raise SystemExit("imported")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("jax |") and "pip install 'packattn[jax]'" in done.stdout


def _oracle(q, k, v, lengths):
    """float64 loop per (item, head): softmax over the item's first ``lengths[b]`` keys; zeros without keys."""
    batch, heads_q, head_dim = q.shape
    group = heads_q // k.shape[2]
    out = np.zeros((batch, heads_q, head_dim))
    for b in range(batch):
        n = int(lengths[b])
        for h in range(heads_q):
            if n == 0:
                continue
            kh, vh = k[b, :n, h // group], v[b, :n, h // group]
            s = kh @ q[b, h] / np.sqrt(head_dim)
            p = np.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ vh
    return out


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_small_seq_attention_runs_and_is_right(implementation):
    """GQA 4/2, lengths 0, 1 and S: forward against the float64 loop, and a gradient that is finite."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from packattn.jax import small_seq_attention

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape) for shape in ((3, 4, 64), (3, 16, 2, 64), (3, 16, 2, 64)))
    lengths = np.array([0, 1, 16], np.int32)
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v)] + [jnp.asarray(lengths)]
    out = small_seq_attention(*args, implementation=implementation)
    np.testing.assert_allclose(np.asarray(out, np.float64), _oracle(q, k, v, lengths), atol=2e-5, rtol=2e-5)
    grad = jax.grad(lambda q_: small_seq_attention(q_, *args[1:], implementation=implementation).sum())(args[0])
    assert np.isfinite(np.asarray(grad)).all() and not np.asarray(grad)[0].any()  # item 0 has no keys
