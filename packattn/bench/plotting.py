"""matplotlib for the bench's PNG charts: an optional dependency (the ``bench`` extra)."""

from __future__ import annotations


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only, no display), or None with a message when
    matplotlib is not installed: a missing plot never fails a run whose numbers are already written."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib missing (pip install 'packattn[bench]'): no plot")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
